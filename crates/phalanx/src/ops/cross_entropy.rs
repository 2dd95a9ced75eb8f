//! Mean cross-entropy of logits against class ids, fused forward and backward.
//! Logits (.., V), targets (..) u32: any leading dims, no reshape needed.
//!
//!   loss = mean_r( logsumexp(x_r) - x_r[t_r] )
//!   dx_r = (softmax(x_r) - onehot(t_r)) * dloss / N
//!
//! Why our own: candle-nn's `cross_entropy` is log_softmax + gather, which
//! keeps (N, V) log-probabilities alive and builds its backward from several
//! (N, V) tensors; with GPT-2's V = 50257 that is the largest activation of
//! the model. Here the forward keeps nothing and the backward recomputes the
//! softmax row by row, writing the gradient once.
//!
//! f16 / bf16 logits: widened to f32 at the kernel boundary one row at a
//! time (no f32 copy of the (N, V) logits), logsumexp in f32 and the mean in
//! f64; the loss is f32 whatever the logits' dtype, the gradient is written
//! row by row in the logits' dtype.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let logits = Tensor::new(&[[0f32, 0.], [0., 0.]], &dev).unwrap();
//! let targets = Tensor::new(&[0u32, 1], &dev).unwrap();
//! let loss = phalanx::ops::cross_entropy(&logits, &targets).unwrap();
//! assert!((loss.to_scalar::<f32>().unwrap() - 2f32.ln()).abs() < 1e-6);
//! ```

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

use std::cell::RefCell;

use super::cpu::{
    cpu_slice_u32, is_float, max_lanes, par_map_rows, rows_in, tensor_of, FloatSlice,
};
use super::gelu::exp_approx;
use crate::simd_dispatch;

struct CrossEntropy;

thread_local! {
    /// One widened row of half logits per thread.
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` on row `r` (length `v`) of `x` as f32 (borrowed, or widened into
/// this thread's scratch row).
fn with_row<R>(x: FloatSlice, r: usize, v: usize, f: impl FnOnce(&[f32]) -> R) -> R {
    if let FloatSlice::F32(s) = x {
        return f(&s[r * v..(r + 1) * v]);
    }
    ROW.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(v, 0.0);
        f(x.get(r * v..(r + 1) * v, &mut buf))
    })
}

/// log(sum(exp(x))) of one row, shifted by the max for stability; the
/// vectorised `exp_approx` matters here: N * V exps per pass.
#[inline(always)]
fn row_lse(x: &[f32]) -> f32 {
    let max = max_lanes(x);
    // 16 partial sums so the exp + sum loop vectorises.
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| exp_approx(v - max))
        .sum();
    for c in chunks {
        for i in 0..16 {
            acc[i] += exp_approx(c[i] - max);
        }
    }
    max + (acc.iter().sum::<f32>() + tail).ln()
}

#[inline(always)]
fn row_grad(x: &[f32], dx: &mut [f32], t: usize, g: f32) {
    let lse = row_lse(x);
    for (d, &x) in dx.iter_mut().zip(x) {
        *d = exp_approx(x - lse) * g;
    }
    dx[t] -= g;
}

fn check_targets(t: &[u32], v: usize) -> Result<()> {
    if let Some(&bad) = t.iter().find(|&&t| t as usize >= v) {
        bail!("cross_entropy: target {bad} out of range for {v} classes")
    }
    Ok(())
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "phalanx-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let (x, t) = (FloatSlice::new(s1, l1)?, cpu_slice_u32(s2, l2)?);
        let (n, v) = (t.len(), l1.dims()[l1.dims().len() - 1]);
        check_targets(t, v)?;
        let losses = par_map_rows(n, v, |r| {
            with_row(x, r, v, |row| {
                simd_dispatch!(row_lse(row)) - row[t[r] as usize]
            })
        });
        // Sum in f64: N can be large and the mean should not drift.
        let mean = losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
        Ok((CpuStorage::F32(vec![mean as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let v = logits.dim(candle_core::D::Minus1)?;
        let n = logits.elem_count() / v;
        let g = grad.to_scalar::<f32>()? / n as f32;
        let (tstore, tl) = targets.storage_and_layout();
        let t = match &*tstore {
            Storage::Cpu(c) => cpu_slice_u32(c, tl)?,
            _ => bail!("cross_entropy: CPU only"),
        };
        let (xstore, xl) = logits.storage_and_layout();
        let x = match &*xstore {
            Storage::Cpu(c) => FloatSlice::new(c, xl)?,
            _ => bail!("cross_entropy: CPU only"),
        };
        // The gradient in the logits' dtype, row by row.
        let dx = rows_in(logits.dtype(), n, v, |r, dx| {
            with_row(x, r, v, |row| {
                simd_dispatch!(row_grad(row, dx, t[r] as usize, g))
            })
        })?;
        let dx = tensor_of(dx, logits.shape(), logits.device())?;
        Ok((Some(dx), None))
    }
}

/// Mean cross-entropy (an f32 scalar) of `logits` (.., V) f32 / f16 / bf16 against `targets` (..) u32
/// (the same leading dims, e.g. (B, T, V) and (B, T), or (N, V) and (N,)).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let ld = logits.dims();
    if ld.is_empty() || targets.dims() != &ld[..ld.len() - 1] || targets.dtype() != DType::U32 {
        bail!(
            "cross_entropy: logits {:?} need targets {:?} u32, got {:?} {:?}",
            logits.shape(),
            &ld[..ld.len().saturating_sub(1)],
            targets.shape(),
            targets.dtype()
        )
    }
    if !is_float(logits.dtype()) || !super::host_kernels(logits.device()) {
        let v = ld[ld.len() - 1];
        let x = logits.reshape(((), v))?.to_dtype(DType::F32)?;
        let lp = candle_nn::ops::log_softmax(&x, 1)?;
        return candle_nn::loss::nll(&lp, &targets.flatten_all()?);
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)
}
