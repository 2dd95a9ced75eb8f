//! Compressing communication hooks (`parallel.comm_hook`), at the
//! gradient-reduction seam ([`super::reduce`]). Each keeps, per bucket, the
//! error it made (error feedback: what was not sent is added to the next
//! step's gradient, `parallel.error_feedback`), and every rank sums the
//! same compressed contributions in rank order, so all ranks end each step
//! with bitwise identical gradients.
//!
//! - [`TopK`]: the `ratio` largest-magnitude entries of each bucket travel
//!   as (index, value) pairs, all-gathered: 2 × k × 4 bytes per rank
//!   instead of the bucket's 4 × n.
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
use phalanx_comm::ProcessGroup;
use std::collections::HashMap;

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

    /// `g` plus the bucket's residual.
    fn add_to(&mut self, bucket: usize, g: &mut [f32]) {
        if let Some(r) = self.by_bucket.get(&bucket).filter(|r| r.len() == g.len()) {
            for (x, e) in g.iter_mut().zip(r) {
                *x += e;
            }
        }
    }
    fn keep(&mut self, bucket: usize, r: Vec<f32>) {
        if self.on {
            self.by_bucket.insert(bucket, r);
        }
    }
}

/// `sum` (of every rank's contribution) averaged, and this rank's share
/// of it.
fn averaged_share(mut sum: Vec<f32>, coll: &Collective, pg: &ProcessGroup) -> Vec<f32> {
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

/// Top-k sparsification with error feedback.
pub struct TopK {
    pub ratio: f64,
    res: Residuals,
}

impl TopK {
    pub fn new(ratio: f64, error_feedback: bool) -> TopK {
        TopK {
            ratio,
            res: Residuals::new(error_feedback),
        }
    }
}

impl CommHook for TopK {
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        mut g: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending {
        let n = g.len();
        self.res.add_to(bucket.id, &mut g);
        let k = ((n as f64 * self.ratio).ceil() as usize).clamp(1.min(n), n);
        // The k largest magnitudes (ties by index, so every rank's choice is
        // deterministic).
        let mut order: Vec<u32> = (0..n as u32).collect();
        if k < n {
            order.select_nth_unstable_by(k, |&a, &b| {
                g[b as usize]
                    .abs()
                    .total_cmp(&g[a as usize].abs())
                    .then(a.cmp(&b))
            });
        }
        let mut idx: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
        idx.sort_unstable();
        let vals: Vec<f32> = idx.iter().map(|&i| g[i as usize]).collect();
        let mut residual = g;
        for &i in &idx {
            residual[i as usize] = 0.0;
        }
        self.res.keep(bucket.id, residual);
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
        let m = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = if m > 0.0 && m.is_finite() {
            m / 127.0
        } else {
            1.0
        };
        scales.push(if m.is_finite() { s } else { f32::NAN });
        for (i, x) in block.iter().enumerate() {
            let v = (x / s).round().clamp(-127.0, 127.0) as i8;
            q[b * INT8_BLOCK + i] = v;
            decoded[b * INT8_BLOCK + i] = v as f32 * s;
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
        self.res.add_to(bucket.id, &mut g);
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
}
