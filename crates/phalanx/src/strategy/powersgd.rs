//! PowerSGD (Vogels et al., 2019; PyTorch's `powerSGD_hook`): each matrix
//! gradient M (n × m, a parameter of shape [n, ...] read as n rows) travels
//! as a rank-r approximation P Qᵀ, so (n + m) × r values cross the network
//! instead of n × m.
//!
//! One power iteration per step, warm-started from the previous step's Q:
//!
//! ```text
//! P = M Q            (n, r)   all-reduced (average), then orthonormalised
//! Q = Mᵀ P           (m, r)   all-reduced (average)
//! M ≈ P Qᵀ           (n, m)   the same on every rank
//! ```
//!
//! Vectors (biases, norms) and matrices too small to gain at least 2× (PyTorch's
//! `min_compression_rate`) are all-reduced uncompressed, in the same message
//! as the P's. With error feedback the part of M that the approximation
//! missed (M − P Qᵀ, per rank) is added to the next step's gradient. The
//! first `start_iter` reductions of each bucket are plain all-reduces
//! (PyTorch's `start_powerSGD_iter`), which lets training settle first.
//!
//! Every rank orthonormalises the same averaged P and multiplies by the same
//! averaged Q, so all ranks end each step with bitwise identical gradients.
//! The hook needs to know where the matrices lie in a bucket
//! ([`GradBucket::params`]); a bucket described by nothing is all-reduced
//! whole.

use super::hooks::{bucket_entry, counter_from_f32, counter_to_f32, share, state_error};
use super::reduce::{BucketParam, Collective, CommHook, DefaultHook, GradBucket, Pending};
use crate::error::{Error, Result};
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// PyTorch's `min_compression_rate`: compress a matrix only if that divides
/// its bytes by at least this.
const MIN_COMPRESSION_RATE: usize = 2;

pub struct PowerSgd {
    rank: usize,
    start_iter: usize,
    error_feedback: bool,
    state: HashMap<usize, Arc<Mutex<BucketState>>>,
}

#[derive(Default)]
struct BucketState {
    /// Reductions of this bucket so far.
    iter: usize,
    /// M − P Qᵀ of the last step (error feedback).
    residual: Vec<f32>,
    /// Each compressed matrix's Q (m × r, row-major), warm start.
    qs: Vec<Vec<f32>>,
}

impl BucketState {
    /// Whether state restored from a checkpoint fits this bucket: a
    /// residual of `len` values and one m × r Q per matrix (or none yet).
    fn check(&self, id: usize, len: usize, mats: &[Mat]) -> Result<()> {
        let bad = |what: String| {
            Err(Error::Check(format!(
                "PowerSGD: the {what} restored for bucket {id} does not fit it (the checkpoint was \
                 saved with other buckets, another parallel.bucket_mb or model, or another \
                 parallel.powersgd_rank?); resume once with parallel.comm_hook = \"none\" to carry the model and optimizer over, the hook starting fresh"
            )))
        };
        if !self.residual.is_empty() && self.residual.len() != len {
            return bad(format!("residual of {} values", self.residual.len()));
        }
        if !self.qs.is_empty() && self.qs.len() != mats.len() {
            return bad(format!("{} Q matrices", self.qs.len()));
        }
        for (k, (q, x)) in self.qs.iter().zip(mats).enumerate() {
            if q.len() != x.m * x.r {
                return bad(format!("Q {k} of {} values", q.len()));
            }
        }
        Ok(())
    }
}

/// A matrix of the bucket: its element range and (rows, cols, rank).
#[derive(Clone)]
struct Mat {
    range: Range<usize>,
    n: usize,
    m: usize,
    r: usize,
}

impl PowerSgd {
    /// `rank`: the approximation rank (PyTorch's `matrix_approximation_rank`);
    /// `start_iter`: plain all-reduces before compression starts.
    pub fn new(rank: usize, start_iter: usize, error_feedback: bool) -> PowerSgd {
        PowerSgd {
            rank: rank.max(1),
            start_iter,
            error_feedback,
            state: HashMap::new(),
        }
    }

    /// The matrices worth compressing, in bucket order.
    fn matrices(&self, params: &[BucketParam], len: usize) -> Vec<Mat> {
        params
            .iter()
            .filter(|p| p.shape.len() >= 2 && p.offset + p.numel() <= len)
            .filter_map(|p| {
                let n = p.shape[0];
                let m = p.numel() / n.max(1);
                let r = self.rank.min(n).min(m);
                ((n + m) * r * MIN_COMPRESSION_RATE < n * m).then_some(Mat {
                    range: p.offset..p.offset + p.numel(),
                    n,
                    m,
                    r,
                })
            })
            .collect()
    }
}

/// The element ranges of `0..len` outside every matrix.
fn uncompressed(mats: &[Mat], len: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    for m in mats {
        if m.range.start > at {
            out.push(at..m.range.start);
        }
        at = at.max(m.range.end);
    }
    if at < len {
        out.push(at..len);
    }
    out
}

/// A deterministic standard-normal-ish start for Q (the same on every rank:
/// seeded by bucket and matrix), orthonormalised.
fn initial_q(bucket: usize, k: usize, m: usize, r: usize) -> Vec<f32> {
    let mut s = (bucket as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (k as u64 + 1);
    let mut next = || {
        // splitmix64, then a sum of uniforms for a bell shape.
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) as f64 / u64::MAX as f64
    };
    let mut q: Vec<f32> = (0..m * r)
        .map(|_| ((0..4).map(|_| next()).sum::<f64>() - 2.0) as f32)
        .collect();
    orthonormalise(&mut q, m, r);
    q
}

/// Gram-Schmidt on the r columns of a row-major (rows × r) matrix. A column
/// that vanishes stays zero (its direction carries nothing).
fn orthonormalise(a: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f64 = (0..rows)
                .map(|i| a[i * r + k] as f64 * a[i * r + j] as f64)
                .sum();
            for i in 0..rows {
                a[i * r + j] -= (dot as f32) * a[i * r + k];
            }
        }
        let norm = (0..rows)
            .map(|i| (a[i * r + j] as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm > 0.0 {
            let inv = (1.0 / norm) as f32;
            for i in 0..rows {
                a[i * r + j] *= inv;
            }
        }
    }
}

/// P = M Q: (n, m) × (m, r) → (n, r).
fn m_times_q(mat: &[f32], q: &[f32], n: usize, m: usize, r: usize) -> Vec<f32> {
    let mut p = vec![0f32; n * r];
    for a in 0..n {
        let row = &mat[a * m..(a + 1) * m];
        for j in 0..r {
            p[a * r + j] = row.iter().enumerate().map(|(b, x)| x * q[b * r + j]).sum();
        }
    }
    p
}

/// Q = Mᵀ P: (m, n) × (n, r) → (m, r).
fn mt_times_p(mat: &[f32], p: &[f32], n: usize, m: usize, r: usize) -> Vec<f32> {
    let mut q = vec![0f32; m * r];
    for a in 0..n {
        let row = &mat[a * m..(a + 1) * m];
        for j in 0..r {
            let pa = p[a * r + j];
            for (b, x) in row.iter().enumerate() {
                q[b * r + j] += x * pa;
            }
        }
    }
    q
}

impl CommHook for PowerSgd {
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        mut g: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending {
        let st = self.state.entry(bucket.id).or_default().clone();
        let mut s = st.lock().unwrap();
        s.iter += 1;
        if s.iter <= self.start_iter {
            return DefaultHook::default().reduce(bucket, g, coll, pg);
        }
        let len = g.len();
        let mats = self.matrices(&bucket.params, len);
        // State of another shape can only come from a checkpoint saved
        // with other buckets or another rank.
        if let Err(e) = s.check(bucket.id, len, &mats) {
            return Pending::new(move || Err(e));
        }
        if self.error_feedback && !s.residual.is_empty() {
            for (x, e) in g.iter_mut().zip(&s.residual) {
                *x += e;
            }
        }
        if s.qs.is_empty() {
            s.qs = mats
                .iter()
                .enumerate()
                .map(|(k, x)| initial_q(bucket.id, k, x.m, x.r))
                .collect();
        }
        // One message: the uncompressed values, then every P.
        let plain = uncompressed(&mats, len);
        let mut msg: Vec<f32> = plain.iter().flat_map(|r| g[r.clone()].to_vec()).collect();
        for (x, q) in mats.iter().zip(&s.qs) {
            msg.extend(m_times_q(&g[x.range.clone()], q, x.n, x.m, x.r));
        }
        drop(s);
        let w = pg.all_reduce_async(msg, ReduceOp::Avg);
        let (coll, pg) = (coll.clone(), pg.clone());
        let (ef, id) = (self.error_feedback, bucket.id);
        Pending::new(move || -> Result<Vec<f32>> {
            let msg = w.wait()?;
            let mut out = vec![0f32; len];
            let mut at = 0;
            for r in &plain {
                out[r.clone()].copy_from_slice(&msg[at..at + r.len()]);
                at += r.len();
            }
            // Orthonormal P's, then Q = Mᵀ P, all averaged in one message.
            let mut ps = Vec::with_capacity(mats.len());
            let mut qmsg = Vec::new();
            for x in &mats {
                let mut p = msg[at..at + x.n * x.r].to_vec();
                at += x.n * x.r;
                orthonormalise(&mut p, x.n, x.r);
                qmsg.extend(mt_times_p(&g[x.range.clone()], &p, x.n, x.m, x.r));
                ps.push(p);
            }
            if !qmsg.is_empty() {
                pg.all_reduce(&mut qmsg, ReduceOp::Avg)?;
            }
            let mut s = st.lock().unwrap();
            let mut qat = 0;
            for (k, (x, p)) in mats.iter().zip(&ps).enumerate() {
                let q = &qmsg[qat..qat + x.m * x.r];
                qat += x.m * x.r;
                let dst = &mut out[x.range.clone()];
                for a in 0..x.n {
                    for b in 0..x.m {
                        dst[a * x.m + b] = (0..x.r).map(|j| p[a * x.r + j] * q[b * x.r + j]).sum();
                    }
                }
                // The warm start for the next step: a Q holding inf or NaN
                // (from a gradient that overflowed: 1/inf = 0 in the
                // orthonormalisation, then inf x 0) would make every later
                // P NaN; such a step is skipped, and Q starts over.
                s.qs[k] = if q.iter().all(|v| v.is_finite()) {
                    q.to_vec()
                } else {
                    initial_q(id, k, x.m, x.r)
                };
            }
            if ef {
                // What this rank's gradient had that the average did not
                // carry; the uncompressed ranges were sent whole.
                let mut res = g;
                for (e, o) in res.iter_mut().zip(&out) {
                    *e -= o;
                }
                for r in &plain {
                    res[r.clone()].fill(0.0);
                }
                s.residual = res;
            }
            Ok(share(out, &coll, &pg))
        })
    }

    fn state(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        for (id, st) in self.state.iter().collect::<BTreeMap<_, _>>() {
            let s = st.lock().unwrap();
            out.push((format!("bucket{id}/iter"), counter_to_f32(s.iter as u64)));
            if !s.residual.is_empty() {
                out.push((format!("bucket{id}/residual"), s.residual.clone()));
            }
            for (k, q) in s.qs.iter().enumerate() {
                out.push((format!("bucket{id}/q{k}"), q.clone()));
            }
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        let mut by: BTreeMap<usize, BucketState> = BTreeMap::new();
        // Q's by index: the names sort q10 before q2.
        let mut qs: BTreeMap<(usize, usize), Vec<f32>> = BTreeMap::new();
        for (name, v) in state {
            let (id, what) = bucket_entry(name).ok_or_else(|| state_error("PowerSGD", name))?;
            let b = by.entry(id).or_default();
            match what {
                "iter" => {
                    b.iter =
                        counter_from_f32(v).ok_or_else(|| state_error("PowerSGD", name))? as usize
                }
                "residual" => b.residual = v.clone(),
                q => {
                    let k = q
                        .strip_prefix('q')
                        .and_then(|k| k.parse().ok())
                        .ok_or_else(|| state_error("PowerSGD", name))?;
                    qs.insert((id, k), v.clone());
                }
            }
        }
        for ((id, k), q) in qs {
            let b = by.entry(id).or_default();
            if b.qs.len() != k {
                return Err(Error::Check(format!(
                    "the checkpoint's PowerSGD state of bucket {id} lacks Q {}",
                    b.qs.len()
                )));
            }
            b.qs.push(q);
        }
        self.state = by
            .into_iter()
            .map(|(id, b)| (id, Arc::new(Mutex::new(b))))
            .collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_one_matrix_is_reproduced_after_one_warm_step() {
        // M = u vᵀ is exactly rank 1: P ∝ u, and Q = Mᵀ P gives it back.
        let (n, m) = (6, 5);
        let u: Vec<f32> = (0..n).map(|i| i as f32 - 2.5).collect();
        let v: Vec<f32> = (0..m).map(|j| (j as f32).sin() + 0.3).collect();
        let mat: Vec<f32> = (0..n * m).map(|k| u[k / m] * v[k % m]).collect();
        let q = initial_q(0, 0, m, 1);
        let mut p = m_times_q(&mat, &q, n, m, 1);
        orthonormalise(&mut p, n, 1);
        let q = mt_times_p(&mat, &p, n, m, 1);
        for a in 0..n {
            for b in 0..m {
                let approx = p[a] * q[b];
                assert!(
                    (approx - mat[a * m + b]).abs() < 1e-4,
                    "{approx} vs {}",
                    mat[a * m + b]
                );
            }
        }
    }

    #[test]
    fn vectors_and_small_matrices_stay_uncompressed() {
        let h = PowerSgd::new(1, 0, true);
        let params = vec![
            BucketParam {
                offset: 0,
                shape: vec![8],
            },
            BucketParam {
                offset: 8,
                shape: vec![2, 2],
            },
            BucketParam {
                offset: 12,
                shape: vec![10, 10],
            },
        ];
        let mats = h.matrices(&params, 112);
        assert_eq!(mats.len(), 1, "only the 10 x 10 gains 2x at rank 1");
        assert_eq!(mats[0].range, 12..112);
        assert_eq!(uncompressed(&mats, 112), vec![0..12]);
    }
}
