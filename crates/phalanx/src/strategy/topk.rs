//! Top-k sparsification with Deep Gradient Compression's additions (Lin et
//! al., 2018, "Deep Gradient Compression: Reducing the Communication
//! Bandwidth for Distributed Training"): each bucket sends the `ratio`
//! largest-magnitude entries of what it has accumulated, as (index, value)
//! pairs, all-gathered: 2 × k × 4 bytes per rank per bucket (k = ⌈ratio ×
//! n⌉) instead of the bucket's 4 × n.
//!
//! - **Error feedback** (`parallel.error_feedback`): what was not sent
//!   stays in a residual v and is added to the next step's gradient, so
//!   over many steps everything is delivered.
//! - **Momentum correction** (`parallel.topk_momentum` = m > 0): the hook
//!   keeps a velocity u = m u + g per rank and accumulates the velocity,
//!   v += u, instead of the raw gradient. A coordinate that waits many steps
//!   to be sent then carries the momentum it would have had under dense
//!   momentum SGD (plain error feedback would hand the optimizer a sum of
//!   stale gradients, and its momentum would then act on that sum). The
//!   hook carries the momentum, so the optimizer must not add its own:
//!   DGC pairs it with plain SGD (`optim.momentum = 0`); the config refuses
//!   SGD momentum on top of it.
//! - **Momentum factor masking**: where an entry is sent, both v and u are
//!   cleared, so a stale velocity does not keep pushing a coordinate whose
//!   update has just been applied.
//! - **Sparsity warm-up** (`parallel.topk_warmup_steps` = W): the first W
//!   reductions of a bucket send a larger fraction that falls
//!   exponentially, by 4× per stage, to `ratio` ([`warmup_ratio`]: for 1%,
//!   25 %, 6.25 %, 1.5625 %, then 1 %), so the early steps, when the
//!   gradients change fastest, are not starved. These reductions send more
//!   bytes than the promised 2 × k × 4.
//!
//! - **With Adam** (`parallel.topk_freeze_variance`, on by default with
//!   AdamW): plain error feedback hands Adam delayed spikes, which its
//!   per-coordinate normalisation shrinks (a coordinate sent once in 100
//!   steps moves about a third as far as under dense steps), so top-1%
//!   trailed uncompressed by 9.7% on gpt-10m. 1-bit Adam's answer (Tang et
//!   al., 2021) is used instead: the first W reductions are dense
//!   all-reduces while Adam's second moment settles ([`TopK::adam`]); then
//!   the optimizer freezes its variance and takes what it is handed as its
//!   momentum ([`crate::optim::Optimizer::freeze_variance_after`]), and the
//!   hook carries that momentum with momentum correction at factor
//!   `optim.betas[0]`. With v fixed the update is linear in what is
//!   delivered, so error feedback again moves each coordinate as far as it
//!   would have moved at once.
//!
//! Every rank sums the same (index, value) pairs in rank order, so all
//! ranks end each step with bitwise identical gradients. The state (v, u
//! and the reduction count the warm-up reads) is the hook's
//! ([`CommHook::state`]), saved per rank in checkpoints.

use super::hooks::{averaged_share, counter_from_f32, counter_to_f32, state_error};
use super::reduce::{Collective, CommHook, GradBucket, Pending};
use crate::error::{Error, Result};
use phalanx_comm::ProcessGroup;
use std::collections::{BTreeMap, HashMap};

/// The fraction of a bucket top-k sends at its reduction `t` (0-based),
/// DGC's sparsity warm-up: the first `warmup` reductions are split into
/// equal stages sending 1/4, 1/16, 1/64, … of the entries, every fraction
/// above `target`; from reduction `warmup` on, `target`. A target of 1/4
/// or more has no stages.
///
/// ```
/// use phalanx::strategy::topk::warmup_ratio;
/// let r: Vec<f64> = (0..5).map(|t| warmup_ratio(0.01, 3, t)).collect();
/// assert_eq!(r, vec![0.25, 0.0625, 0.015625, 0.01, 0.01]);
/// ```
pub fn warmup_ratio(target: f64, warmup: usize, t: usize) -> f64 {
    let stages = warmup_stages(target);
    if t >= warmup || stages == 0 {
        return target;
    }
    let s = t * stages / warmup;
    0.25f64.powi(s as i32 + 1).max(target)
}

/// How many of 1/4, 1/16, … lie above `target`.
fn warmup_stages(target: f64) -> usize {
    let (mut s, mut d) = (0, 0.25f64);
    while d > target && s < 64 {
        s += 1;
        d /= 4.0;
    }
    s
}

/// The entries sent of `n` at fraction `ratio` (at least one).
pub fn k_of(n: usize, ratio: f64) -> usize {
    ((n as f64 * ratio).ceil() as usize).clamp(1.min(n), n)
}

/// One bucket's state.
#[derive(Default)]
struct Bucket {
    /// Reductions so far (the warm-up's clock).
    iter: u64,
    /// What was not sent yet (error feedback), or empty.
    residual: Vec<f32>,
    /// The momentum-correction velocity, or empty.
    velocity: Vec<f32>,
}

/// Top-k sparsification with error feedback, DGC's momentum correction and
/// sparsity warm-up (see the module docs).
pub struct TopK {
    /// The fraction of each bucket sent after the warm-up.
    pub ratio: f64,
    /// Reductions of each bucket over which the fraction falls to `ratio`.
    pub warmup: usize,
    /// Momentum factor of the correction (0: off).
    pub momentum: f32,
    /// Adam mode: the warm-up is dense, and the momentum correction starts
    /// after it (see the module docs).
    pub dense_warmup: bool,
    error_feedback: bool,
    buckets: HashMap<usize, Bucket>,
}

impl TopK {
    /// Plain top-k: `ratio` from the first step, no momentum correction.
    pub fn new(ratio: f64, error_feedback: bool) -> TopK {
        TopK::dgc(ratio, error_feedback, 0, 0.0)
    }

    /// Top-k with DGC's sparsity warm-up over `warmup` reductions and
    /// momentum correction with factor `momentum` (0: off).
    pub fn dgc(ratio: f64, error_feedback: bool, warmup: usize, momentum: f32) -> TopK {
        TopK {
            ratio,
            warmup,
            momentum,
            dense_warmup: false,
            error_feedback,
            buckets: HashMap::new(),
        }
    }

    /// Top-k for Adam with a frozen variance (1-bit Adam's scheme): dense
    /// all-reduces for the first `warmup` reductions of each bucket, then
    /// `ratio` with error feedback and momentum correction at `beta1` (the
    /// optimizer freezes its variance after step `warmup`).
    pub fn adam(ratio: f64, error_feedback: bool, warmup: usize, beta1: f32) -> TopK {
        TopK {
            dense_warmup: true,
            ..TopK::dgc(ratio, error_feedback, warmup, beta1)
        }
    }

    /// The fraction of bucket `id` its next reduction sends.
    pub fn next_ratio(&self, id: usize) -> f64 {
        let t = self.buckets.get(&id).map_or(0, |b| b.iter) as usize;
        match self.dense_warmup {
            true if t < self.warmup => 1.0,
            true => self.ratio,
            false => warmup_ratio(self.ratio, self.warmup, t),
        }
    }
}

/// `state` for `n` values: `len` must be `n` (an empty one starts at 0).
fn fit(v: &mut Vec<f32>, n: usize, what: &str, id: usize) -> Result<()> {
    if v.is_empty() {
        v.resize(n, 0.0);
    }
    if v.len() != n {
        return Err(Error::Check(format!(
            "top-k: the {what} restored for bucket {id} holds {} values, the bucket has {n} \
             (the checkpoint was saved with other buckets: parallel.bucket_mb or the model \
             changed?); resume once with parallel.comm_hook = \"none\" to carry the model and optimizer over, the hook starting fresh",
            v.len()
        )));
    }
    Ok(())
}

impl CommHook for TopK {
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        g: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending {
        let n = g.len();
        let ratio = self.next_ratio(bucket.id);
        let (ef, m) = (self.error_feedback, self.momentum);
        let st = self.buckets.entry(bucket.id).or_default();
        st.iter += 1;
        if self.dense_warmup && ratio >= 1.0 {
            // Adam's warm-up: a plain all-reduce (the hook's state stays empty).
            return super::reduce::DefaultHook {
                dtype: crate::config::Precision::Fp32,
            }
            .reduce(bucket, g, coll, pg);
        }
        // What to choose from: the gradient (or, with momentum correction,
        // the velocity) plus what earlier steps left unsent.
        let mut acc = g;
        if m != 0.0 {
            if let Err(e) = fit(&mut st.velocity, n, "velocity", bucket.id) {
                return Pending::new(move || Err(e));
            }
            for (u, x) in st.velocity.iter_mut().zip(acc.iter_mut()) {
                *u = m * *u + *x;
                *x = *u;
            }
        }
        if ef && !st.residual.is_empty() {
            if let Err(e) = fit(&mut st.residual, n, "residual", bucket.id) {
                return Pending::new(move || Err(e));
            }
            for (x, r) in acc.iter_mut().zip(&st.residual) {
                *x += r;
            }
        }
        let k = k_of(n, ratio);
        // The k largest magnitudes of the whole bucket (ties by index, so
        // every rank's choice is deterministic).
        let mut order: Vec<u32> = (0..n as u32).collect();
        if k < n {
            order.select_nth_unstable_by(k, |&a, &b| {
                acc[b as usize]
                    .abs()
                    .total_cmp(&acc[a as usize].abs())
                    .then(a.cmp(&b))
            });
        }
        let mut idx: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
        idx.sort_unstable();
        let vals: Vec<f32> = idx.iter().map(|&i| acc[i as usize]).collect();
        // Momentum factor masking: a sent entry's velocity starts over.
        if m != 0.0 {
            for &i in &idx {
                st.velocity[i as usize] = 0.0;
            }
        }
        if ef {
            for &i in &idx {
                acc[i as usize] = 0.0;
            }
            st.residual = acc;
        }
        let w = pg.size();
        let wi = pg.all_gather_async(idx, vec![k; w]);
        let wv = pg.all_gather_async(vals, vec![k; w]);
        let (coll, pg) = (coll.clone(), pg.clone());
        Pending::new(move || {
            let (idx, vals) = (wi.wait()?, wv.wait()?);
            let mut sum = vec![0f32; n];
            for (i, v) in idx.iter().zip(&vals) {
                sum[*i as usize] += v;
            }
            Ok(averaged_share(sum, &coll, &pg))
        })
    }

    fn state(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        for (id, b) in self.buckets.iter().collect::<BTreeMap<_, _>>() {
            out.push((format!("bucket{id}/iter"), counter_to_f32(b.iter)));
            if !b.residual.is_empty() {
                out.push((format!("bucket{id}/residual"), b.residual.clone()));
            }
            if !b.velocity.is_empty() {
                out.push((format!("bucket{id}/velocity"), b.velocity.clone()));
            }
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.buckets.clear();
        for (name, v) in state {
            let (id, what) =
                super::hooks::bucket_entry(name).ok_or_else(|| state_error("top-k", name))?;
            let b = self.buckets.entry(id).or_default();
            match what {
                "iter" => b.iter = counter_from_f32(v).ok_or_else(|| state_error("top-k", name))?,
                "residual" => b.residual = v.clone(),
                "velocity" => b.velocity = v.clone(),
                _ => return Err(state_error("top-k", name)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_falls_by_four_per_stage_to_the_target() {
        // 12 reductions, three stages of four above 1%.
        let r: Vec<f64> = (0..14).map(|t| warmup_ratio(0.01, 12, t)).collect();
        let want = [0.25, 0.0625, 0.015625]
            .iter()
            .flat_map(|&x| [x; 4])
            .chain([0.01, 0.01])
            .collect::<Vec<_>>();
        assert_eq!(r, want);
        // DGC's own: 0.1% after 75%, 93.75%, 98.4375% and 99.6% sparsity.
        let r: Vec<f64> = (0..5).map(|t| warmup_ratio(0.001, 4, t)).collect();
        assert_eq!(r, vec![0.25, 0.0625, 0.015625, 0.00390625, 0.001]);
        // No warm-up, or a target of a quarter or more: the target.
        assert_eq!(warmup_ratio(0.01, 0, 0), 0.01);
        assert_eq!(warmup_ratio(0.3, 10, 0), 0.3);
        assert_eq!(warmup_ratio(0.25, 10, 0), 0.25);
    }
}
