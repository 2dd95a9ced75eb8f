//! Compressing communication hooks (`parallel.comm_hook`), at the
//! gradient-reduction seam ([`super::reduce`]). Each keeps, per bucket, the
//! error it made (error feedback: what was not sent is added to the next
//! step's gradient, `parallel.error_feedback`), and every rank sums the
//! same compressed contributions in rank order, so all ranks end each step
//! with bitwise identical gradients. What a hook carries from step to step
//! is its [`CommHook::state`], saved per rank in checkpoints so that a
//! resumed run continues bitwise as the one that never stopped.
//!
//! - [`TopK`] ([`super::topk`]): the `ratio` largest-magnitude entries of
//!   each bucket travel as (index, value) pairs, all-gathered: 2 × k × 4
//!   bytes per rank instead of the bucket's 4 × n; with Deep Gradient
//!   Compression's sparsity warm-up and momentum correction.
//! - [`Int8`]: each block of 256 values becomes 256 int8 and one f32 scale
//!   (max |x| / 127), all-gathered (int8 sums would overflow, so each rank
//!   dequantises and adds every rank's blocks): about a quarter of the bytes.
//!
//! A user hook is a [`CommHook`]; `Strategy::set_comm_hook` installs it:
//!
//! ```
//! use phalanx::strategy::reduce::{Collective, CommHook, GradBucket, Pending};
//! use phalanx_comm::{ProcessGroup, ReduceOp};
//! /// Sum in f64 (more precise, twice the bytes).
//! struct F64Hook;
//! impl CommHook for F64Hook {
//!     fn reduce(&mut self, _b: &GradBucket, g: Vec<f32>, coll: &Collective, pg: &ProcessGroup) -> Pending {
//!         assert!(matches!(coll, Collective::AllReduce), "DDP only");
//!         let w = pg.all_reduce_async(g.iter().map(|&x| x as f64).collect::<Vec<_>>(), ReduceOp::Avg);
//!         Pending::new(move || Ok(w.wait()?.into_iter().map(|x| x as f32).collect()))
//!     }
//! }
//! ```

use super::reduce::{Collective, CommHook, GradBucket, Pending};
use crate::error::{Error, Result};
use phalanx_comm::ProcessGroup;
use std::collections::{BTreeMap, HashMap};

pub use super::topk::TopK;

/// A step counter as two f32 values, each below 2^24 so that f32 holds it
/// exactly (checkpoints hold f32 arrays): the low and the high 24 bits.
pub(crate) fn counter_to_f32(c: u64) -> Vec<f32> {
    vec![(c & 0xff_ffff) as f32, (c >> 24) as f32]
}

/// The counter [`counter_to_f32`] wrote, if `v` is one.
pub(crate) fn counter_from_f32(v: &[f32]) -> Option<u64> {
    let ok = |x: f32| x >= 0.0 && x < (1u64 << 24) as f32 && x.fract() == 0.0;
    match v {
        [lo, hi] if ok(*lo) && ok(*hi) => Some(*lo as u64 | (*hi as u64) << 24),
        _ => None,
    }
}

/// `bucket{id}/{what}`, the names hook state is kept under: (id, what).
pub(crate) fn bucket_entry(name: &str) -> Option<(usize, &str)> {
    let (b, what) = name.strip_prefix("bucket")?.split_once('/')?;
    Some((b.parse().ok()?, what))
}

/// A checkpoint's hook state that this hook does not keep.
pub(crate) fn state_error(hook: &str, name: &str) -> Error {
    Error::Check(format!(
        "the checkpoint's communication-hook state `{name}` is not {hook}'s \
         (saved with another parallel.comm_hook or an older build?)"
    ))
}

/// Error-feedback residuals, per bucket.
struct Residuals {
    on: bool,
    by_bucket: HashMap<usize, Vec<f32>>,
}

impl Residuals {
    fn new(on: bool) -> Residuals {
        Residuals {
            on,
            by_bucket: HashMap::new(),
        }
    }

    /// `g` plus the bucket's residual. A residual of another length can
    /// only come from a checkpoint saved with other buckets: an error.
    fn add_to(&mut self, bucket: usize, g: &mut [f32]) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        if let Some(r) = self.by_bucket.get(&bucket) {
            if r.len() != g.len() {
                return Err(Error::Check(format!(
                    "the error-feedback residual restored for bucket {bucket} holds {} values, \
                     the bucket has {} (the checkpoint was saved with other buckets: \
                     parallel.bucket_mb, the model, or the layout that splits it, \
                     parallel.tp, pp or pp_partition, changed?); resume once with parallel.comm_hook = \"none\" to carry the model and optimizer over, the hook starting fresh",
                    r.len(),
                    g.len()
                )));
            }
            for (x, e) in g.iter_mut().zip(r) {
                *x += e;
            }
        }
        Ok(())
    }
    fn keep(&mut self, bucket: usize, r: Vec<f32>) {
        if self.on {
            self.by_bucket.insert(bucket, r);
        }
    }

    fn state(&self) -> Vec<(String, Vec<f32>)> {
        self.by_bucket
            .iter()
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .map(|(id, r)| (format!("bucket{id}/residual"), r.clone()))
            .collect()
    }

    fn load_state(&mut self, hook: &str, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.by_bucket.clear();
        for (name, v) in state {
            match bucket_entry(name) {
                // Without error feedback (parallel.error_feedback = false)
                // a checkpoint's residuals are dropped: nothing would ever
                // clear them, and they would be added to every step.
                Some((id, "residual")) => {
                    if self.on {
                        self.by_bucket.insert(id, v.clone());
                    }
                }
                _ => return Err(state_error(hook, name)),
            }
        }
        Ok(())
    }
}

/// `sum` (of every rank's contribution) averaged, and this rank's share
/// of it.
pub(crate) fn averaged_share(mut sum: Vec<f32>, coll: &Collective, pg: &ProcessGroup) -> Vec<f32> {
    let inv = 1.0 / pg.size() as f32;
    sum.iter_mut().for_each(|x| *x *= inv);
    share(sum, coll, pg)
}

/// This rank's share of a whole reduced bucket: all of it for an
/// all-reduce, its piece for a reduce-scatter.
pub(crate) fn share(full: Vec<f32>, coll: &Collective, pg: &ProcessGroup) -> Vec<f32> {
    match coll {
        Collective::AllReduce => full,
        Collective::ReduceScatter { counts } => {
            let lo: usize = counts[..pg.rank()].iter().sum();
            full[lo..lo + counts[pg.rank()]].to_vec()
        }
    }
}

/// Values per int8 block (one f32 scale each).
pub const INT8_BLOCK: usize = 256;

/// Block-wise int8 quantisation with error feedback.
pub struct Int8 {
    res: Residuals,
}

impl Int8 {
    pub fn new(error_feedback: bool) -> Int8 {
        Int8 {
            res: Residuals::new(error_feedback),
        }
    }
}

/// (int8 values packed 4 to an i32, one scale per block, what they decode to).
pub(crate) fn quantise(g: &[f32]) -> (Vec<i32>, Vec<f32>, Vec<f32>) {
    let mut q = vec![0i8; g.len().div_ceil(4) * 4];
    let mut scales = Vec::with_capacity(g.len().div_ceil(INT8_BLOCK));
    let mut decoded = vec![0f32; g.len()];
    for (b, block) in g.chunks(INT8_BLOCK).enumerate() {
        // The largest magnitude, NaN if the block holds one (`f32::max`
        // would pass over a NaN, which int8 would then send as 0).
        let m = block.iter().fold(0f32, |m, x| {
            if m.is_nan() || x.is_nan() {
                f32::NAN
            } else {
                m.max(x.abs())
            }
        });
        let s = if m > 0.0 && m.is_finite() {
            m / 127.0
        } else {
            1.0
        };
        // A block holding inf or NaN gets a NaN scale: it decodes to NaN
        // on every rank, so the reduced gradient is non-finite and the
        // step's non-finite check sees it (fp16 skips the step,
        // train.on_nonfinite = "stop" names it).
        let scale = if m.is_finite() { s } else { f32::NAN };
        scales.push(scale);
        for (i, x) in block.iter().enumerate() {
            let v = (x / s).round().clamp(-127.0, 127.0) as i8;
            q[b * INT8_BLOCK + i] = v;
            decoded[b * INT8_BLOCK + i] = v as f32 * scale;
        }
    }
    let packed = q
        .chunks(4)
        .map(|c| i32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))
        .collect();
    (packed, scales, decoded)
}

/// Add the values that `q` (int8 packed 4 to an i32) and `scales` (one per
/// block) decode to into `sum`.
pub(crate) fn add_dequantised(sum: &mut [f32], q: &[i32], scales: &[f32]) {
    for (k, word) in q.iter().enumerate() {
        for (j, b) in word.to_le_bytes().into_iter().enumerate() {
            if let Some(x) = sum.get_mut(k * 4 + j) {
                *x += (b as i8) as f32 * scales[(k * 4 + j) / INT8_BLOCK];
            }
        }
    }
}

impl CommHook for Int8 {
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        mut g: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending {
        let n = g.len();
        if let Err(e) = self.res.add_to(bucket.id, &mut g) {
            return Pending::new(move || Err(e));
        }
        let w = pg.size();
        match coll {
            // Every rank's quantised bucket, all-gathered; each rank adds
            // them all in rank order (int8 sums would overflow).
            Collective::AllReduce => {
                let (packed, scales, decoded) = quantise(&g);
                let residual: Vec<f32> = g.iter().zip(&decoded).map(|(x, d)| x - d).collect();
                self.res.keep(bucket.id, residual);
                let (np, ns) = (packed.len(), scales.len());
                let wq = pg.all_gather_async(packed, vec![np; w]);
                let ws = pg.all_gather_async(scales, vec![ns; w]);
                let (coll, pg) = (coll.clone(), pg.clone());
                Pending::new(move || {
                    let (q, s) = (wq.wait()?, ws.wait()?);
                    let mut sum = vec![0f32; n];
                    for r in 0..w {
                        add_dequantised(
                            &mut sum,
                            &q[r * np..(r + 1) * np],
                            &s[r * ns..(r + 1) * ns],
                        );
                    }
                    Ok(averaged_share(sum, &coll, &pg))
                })
            }
            // ZeRO's reduce-scatter (ZeRO++ qgZ): rank r's piece is
            // quantised on its own and sent to r alone (all-to-all), which
            // adds what it receives in rank order.
            Collective::ReduceScatter { counts } => {
                let mut q = Vec::new();
                let mut s = Vec::new();
                let mut decoded = Vec::with_capacity(n);
                let mut lo = 0;
                for &c in counts {
                    let (p, sc, d) = quantise(&g[lo..lo + c]);
                    q.extend(p);
                    s.extend(sc);
                    decoded.extend(d);
                    lo += c;
                }
                let residual: Vec<f32> = g.iter().zip(&decoded).map(|(x, d)| x - d).collect();
                self.res.keep(bucket.id, residual);
                let me = counts[pg.rank()];
                let (np, ns) = (me.div_ceil(4), me.div_ceil(INT8_BLOCK));
                let qc: Vec<usize> = counts.iter().map(|c| c.div_ceil(4)).collect();
                let sc: Vec<usize> = counts.iter().map(|c| c.div_ceil(INT8_BLOCK)).collect();
                let wq = pg.all_to_all_v_async(q, qc, vec![np; w]);
                let ws = pg.all_to_all_v_async(s, sc, vec![ns; w]);
                Pending::new(move || {
                    let (q, s) = (wq.wait()?, ws.wait()?);
                    let mut sum = vec![0f32; me];
                    for r in 0..w {
                        add_dequantised(
                            &mut sum,
                            &q[r * np..(r + 1) * np],
                            &s[r * ns..(r + 1) * ns],
                        );
                    }
                    let inv = 1.0 / w as f32;
                    sum.iter_mut().for_each(|x| *x *= inv);
                    Ok(sum)
                })
            }
        }
    }

    fn state(&self) -> Vec<(String, Vec<f32>)> {
        self.res.state()
    }

    fn load_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.res.load_state("int8", state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(g: &[f32]) -> Vec<f32> {
        let (q, s, decoded) = quantise(g);
        let mut sum = vec![0f32; g.len()];
        add_dequantised(&mut sum, &q, &s);
        assert_eq!(
            sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            decoded.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "what the receivers add is what the sender decoded"
        );
        sum
    }

    #[test]
    fn a_block_holding_nan_or_inf_decodes_to_nan() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let d = decode(&[1.0, bad, 2.0]);
            assert!(
                d.iter().all(|x| x.is_nan()),
                "[1, {bad}, 2] decodes to {d:?}"
            );
        }
        // Only the block that holds it: the next block of 256 is exact.
        let mut g = vec![0.5f32; INT8_BLOCK + 3];
        g[7] = f32::NAN;
        g[INT8_BLOCK..].copy_from_slice(&[0.0, -127.0, 0.0]);
        let d = decode(&g);
        assert!(d[..INT8_BLOCK].iter().all(|x| x.is_nan()));
        assert_eq!(d[INT8_BLOCK..], [0.0, -127.0, 0.0]);
        // Finite blocks as before: max |x| / 127 per block, zeros as zeros.
        assert_eq!(decode(&[127.0, -63.0, 0.0]), vec![127.0, -63.0, 0.0]);
        assert_eq!(decode(&[0.0; 5]), vec![0.0; 5]);
    }
}
