//! The loss from vocabulary-sharded logits (Megatron-LM's vocab-parallel
//! cross-entropy): each rank holds logits (N, V_pad/tp) for its rows of
//! the padded vocabulary, and three small all-reduces of N values (the row
//! maxima, the sums of exponentials, the target logits) replace gathering
//! the logits.
//!
//! Two forms with one result: on the CPU with its kernels on, one fused op
//! (f32 loops, the loss summed in f64); elsewhere (a GPU, or the CPU's
//! device-generic path) candle's ops on the logits where they lie, the
//! maxima exchanged outside autograd and the two sums through Megatron's
//! g (`reduce_from_tp`: summed forward, identity backward), so a GPU's
//! logits never cross to the host.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use phalanx::tp::{vocab_parallel_cross_entropy, Tp};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let tp = Tp::new(pg, false);
//!     // Vocabulary 4, two columns per rank; both rows target token 1 (rank 0's).
//!     let x = Var::new(&[[0f32, 0.0], [0.0, 0.0]], &Device::Cpu).unwrap();
//!     let t = Tensor::new(&[1u32, 1], &Device::Cpu).unwrap();
//!     let loss = vocab_parallel_cross_entropy(x.as_tensor(), &t, &tp, 4).unwrap();
//!     loss.to_scalar::<f32>().unwrap()
//! });
//! assert!((out[0] - 4f32.ln()).abs() < 1e-6); // uniform over 4 tokens
//! ```

use super::comm::{max_over_tp, reduce_from_tp};
use super::layers::Tp;
use crate::ops;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::sync::Mutex;

/// Mean cross-entropy over N rows from vocabulary-sharded logits
/// (N, V_pad/tp) on each rank; `vocab` is the real vocabulary (columns at or
/// past it are padding and masked out). Three small all-reduces of N values
/// (max, sum of exponentials, target logit) replace gathering the logits.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    tp: &Tp,
    vocab: usize,
) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let t: Vec<u32> = targets.flatten_all()?.to_vec1()?;
    if t.len() != n {
        bail!(
            "vocab_parallel_cross_entropy: {} targets for {n} rows",
            t.len()
        )
    }
    let lo = tp.rank() * v;
    if !ops::host_kernels(logits.device()) {
        return composed(logits, &t, &tp.pg, lo, vocab);
    }
    let op = VocabCe {
        pg: tp.pg.clone(),
        lo,
        vocab,
        targets: t,
        saved: Mutex::new(None),
    };
    logits.contiguous()?.apply_op1(op)
}

/// The loss in candle's ops on the logits' device: logits (N, V/tp) of
/// vocabulary rows [`lo`, `lo` + V/tp), `targets` (N,) global ids.
fn composed(
    logits: &Tensor,
    targets: &[u32],
    pg: &ProcessGroup,
    lo: usize,
    vocab: usize,
) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    let dev = logits.device();
    // Columns at or past the real vocabulary are padding: left out.
    let valid = vocab.saturating_sub(lo).min(v);
    let full = logits.to_dtype(DType::F32)?.contiguous()?; // (N, V/tp)
    let (max, sum, tgt) = if valid == 0 {
        // A shard of padding only: nothing to the sums, and gradients of
        // zero (the logits still take part in the graph).
        // (Times a zero tensor: candle's autograd drops a graph scaled
        // by the number 0, and the logits would get no gradient at all.)
        let zeros = Tensor::zeros((n, 1), DType::F32, dev)?;
        let zero = full.sum_keepdim(1)?.mul(&zeros)?; // (N, 1)
        let low = Tensor::full(f32::MIN, (n, 1), dev)?;
        (low, zero.clone(), zero)
    } else {
        let x = full.narrow(1, 0, valid)?; // (N, valid), a view
        let max = x.max_keepdim(1)?; // (N, 1)
                                     // The target's column here, and whether it lies here at all.
        let (col, here): (Vec<u32>, Vec<f32>) = targets
            .iter()
            .map(|&j| match (j as usize).checked_sub(lo) {
                Some(c) if c < valid => (c as u32, 1.0),
                _ => (0, 0.0),
            })
            .unzip();
        let col = Tensor::from_vec(col, (n, 1), dev)?;
        let here = Tensor::from_vec(here, (n, 1), dev)?;
        // (`gather` wants a contiguous source: the whole row, whose
        // first `valid` columns `col` indexes.)
        let tgt = (full.gather(&col, 1)? * here)?; // (N, 1)
        (max, x, tgt)
    };
    // The row maxima over all shards: a shift that leaves the loss as it
    // is, so it carries no gradient (Megatron detaches it too).
    let max = max_over_tp(&max, pg)?; // (N, 1)
    let sum = if valid == 0 {
        sum
    } else {
        sum.broadcast_sub(&max)?.exp()?.sum_keepdim(1)? // (N, 1)
    };
    // Summed forward, identity backward: each rank's partial sum gets the
    // gradient of the replicated loss.
    let sum = reduce_from_tp(&sum, pg)?;
    let tgt = reduce_from_tp(&tgt, pg)?;
    // mean over rows of log(sum exp(x - max)) + max - x[target]
    (sum.log()? + max)?.sub(&tgt)?.mean_all()
}

struct VocabCe {
    pg: ProcessGroup,
    lo: usize,
    vocab: usize,
    targets: Vec<u32>,
    /// Per row: global max and sum of exp(x - max), for the backward.
    saved: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

impl VocabCe {
    fn valid(&self, v: usize) -> usize {
        // Columns of this shard that are real vocabulary.
        self.vocab.saturating_sub(self.lo).min(v)
    }
}

impl CustomOp1 for VocabCe {
    fn name(&self) -> &'static str {
        "vocab-parallel-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        ops::kernel_ran();
        let x = ops::cpu::cpu_f32(s, l)?;
        let x = &x[..];
        let (n, v) = l.shape().dims2()?;
        let valid = self.valid(v);
        let err = |e: phalanx_comm::CommError| {
            candle_core::Error::Msg(format!("vocab-parallel loss: {e}"))
        };
        // (N,) per-row max over this shard, then over all shards.
        let mut max: Vec<f32> = (0..n)
            .map(|r| {
                x[r * v..r * v + valid]
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &a| m.max(a))
            })
            .collect();
        self.pg.all_reduce(&mut max, ReduceOp::Max).map_err(err)?;
        let mut sum: Vec<f32> = (0..n)
            .map(|r| {
                x[r * v..r * v + valid]
                    .iter()
                    .map(|&a| (a - max[r]).exp())
                    .sum()
            })
            .collect();
        // The target's logit lives on exactly one shard.
        let mut tgt: Vec<f32> = (0..n)
            .map(|r| {
                let j = self.targets[r] as usize;
                if (self.lo..self.lo + valid).contains(&j) {
                    x[r * v + j - self.lo]
                } else {
                    0.0
                }
            })
            .collect();
        self.pg.all_reduce(&mut sum, ReduceOp::Sum).map_err(err)?;
        self.pg.all_reduce(&mut tgt, ReduceOp::Sum).map_err(err)?;
        let loss: f64 = (0..n)
            .map(|r| (sum[r].ln() + max[r] - tgt[r]) as f64)
            .sum::<f64>()
            / n as f64;
        *self.saved.lock().unwrap() = Some((max, sum));
        Ok((CpuStorage::F32(vec![loss as f32]), Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (n, v) = arg.dims2()?;
        let valid = self.valid(v);
        let g = grad.to_scalar::<f32>()? / n as f32;
        let saved = self.saved.lock().unwrap();
        let Some((max, sum)) = saved.as_ref() else {
            bail!("vocab-parallel loss: backward before forward")
        };
        let x: Vec<f32> = arg.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let mut dx = vec![0f32; n * v];
        for r in 0..n {
            let j = self.targets[r] as usize;
            for c in 0..valid {
                let p = (x[r * v + c] - max[r]).exp() / sum[r];
                let hot = if self.lo + c == j { 1.0 } else { 0.0 };
                dx[r * v + c] = g * (p - hot);
            }
        }
        // The gradient in the logits' dtype.
        Ok(Some(ops::cpu::tensor_in(
            dx,
            arg.dtype(),
            (n, v),
            arg.device(),
        )?))
    }
}
