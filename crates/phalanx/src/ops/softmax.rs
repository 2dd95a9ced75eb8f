//! Softmax over the last dimension with an optional scale and causal mask,
//! fused forward and backward (attention's `softmax(mask(q k^T / sqrt(d)))`).
//!
//!   y = softmax(scale * x)        over j (causal: over j <= i, y = 0 for j > i)
//!   dx = scale * y * (dy - sum_j(dy * y))
//!
//! Why our own: candle-nn's `softmax_last_dim` has no backward, and the
//! composed softmax plus a -inf mask tensor costs five full-size tensors.
//! For the causal form the input's last two dims must be (T, T); row i of
//! each (T, T) matrix sees columns 0..=i. f16 / bf16: computed in f32 at the
//! kernel boundary (max, exp and sum in f32), y and dx narrowed to x's dtype.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let x = Tensor::new(&[[0f32, 0.], [0., 0.]], &Device::Cpu).unwrap();
//! let y = phalanx::ops::causal_softmax(&x, 1.0).unwrap().to_vec2::<f32>().unwrap();
//! assert_eq!(y, vec![vec![1.0, 0.0], vec![0.5, 0.5]]);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

use super::cpu::{
    cpu_f32, dot_lanes, is_float, max_lanes, par_rows, storage_in, sum_lanes, tensor_in,
    with_f32_any,
};
use super::gelu::exp_approx;
use crate::simd_dispatch;

struct Softmax {
    scale: f32,
    causal: bool,
}

/// Row `r` of an (.., T, T) tensor may see columns 0..=r % T.
#[inline(always)]
fn visible(causal: bool, row: usize, n: usize) -> usize {
    if causal {
        row % n + 1
    } else {
        n
    }
}

#[inline(always)]
fn softmax_row(x: &[f32], y: &mut [f32], scale: f32) {
    // scale > 0, so max(scale * x) = scale * max(x).
    let max = max_lanes(x) * scale;
    for (y, &x) in y.iter_mut().zip(x) {
        *y = exp_approx(x * scale - max);
    }
    let inv = 1.0 / sum_lanes(y);
    y.iter_mut().for_each(|y| *y *= inv);
}

#[inline(always)]
fn softmax_row_bwd(y: &[f32], dy: &[f32], dx: &mut [f32], scale: f32) {
    let dot = dot_lanes(y, dy);
    for ((dx, &y), &dy) in dx.iter_mut().zip(y).zip(dy) {
        *dx = scale * y * (dy - dot);
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "phalanx-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let x = cpu_f32(s, l)?;
        let n = l.dims()[l.dims().len() - 1];
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, n, |rows, y| {
            for (r, y) in rows.zip(y.chunks_exact_mut(n)) {
                let k = visible(self.causal, r, n);
                let x = &x[r * n..r * n + k];
                // The masked tail stays 0 (the vec is zeroed).
                simd_dispatch!(softmax_row(x, &mut y[..k], self.scale));
            }
        });
        Ok((storage_in(s.dtype(), y)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = res.dim(D::Minus1)?;
        let dx = with_f32_any(res, |y| {
            with_f32_any(grad, |dy| {
                let mut dx = vec![0f32; y.len()];
                par_rows(&mut dx, n, |rows, dx| {
                    for (r, dx) in rows.zip(dx.chunks_exact_mut(n)) {
                        let k = visible(self.causal, r, n);
                        let (y, dy) = (&y[r * n..r * n + k], &dy[r * n..r * n + k]);
                        simd_dispatch!(softmax_row_bwd(y, dy, &mut dx[..k], self.scale));
                    }
                });
                dx
            })
        })??;
        Ok(Some(tensor_in(dx, res.dtype(), res.shape(), res.device())?))
    }
}

fn apply(x: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    // Also rejects NaN.
    if scale.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        bail!("softmax scale must be positive, got {scale}")
    }
    if !is_float(x.dtype()) {
        bail!(
            "phalanx softmax: f32, f16 or bf16 only (got {:?})",
            x.dtype()
        )
    }
    if !super::host_kernels(x.device()) {
        return composed(x, scale, causal);
    }
    x.contiguous()?.apply_op1(Softmax { scale, causal })
}

/// The same softmax from candle's ops (the device-generic path): in f32,
/// entries above the diagonal masked to -inf, the result in x's dtype.
fn composed(x: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let mut s = (x.to_dtype(DType::F32)? * scale as f64)?;
    if causal {
        // Built on x's device from two ranges (no (T, T) upload): key <= query.
        let t = x.dim(D::Minus1)?;
        let r = Tensor::arange(0u32, t as u32, x.device())?;
        let visible = r.unsqueeze(1)?.broadcast_ge(&r.unsqueeze(0)?)?; // (T, T)
        let hidden = Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(s.shape())?;
        s = visible.broadcast_as(s.shape())?.where_cond(&s, &hidden)?;
    }
    candle_nn::ops::softmax(&s, D::Minus1)?.to_dtype(x.dtype())
}

/// [`causal_softmax`]'s device-generic path, for the composed attention.
pub(crate) fn composed_causal(x: &Tensor, scale: f32) -> Result<Tensor> {
    composed(x, scale, true)
}

/// `softmax(x)` over the last dimension, with a backward.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    apply(x, 1.0, false)
}

/// `softmax(scale * x)` over the last dim with a causal mask: x is (.., T, T).
pub fn causal_softmax(x: &Tensor, scale: f32) -> Result<Tensor> {
    let d = x.dims();
    if d.len() < 2 || d[d.len() - 1] != d[d.len() - 2] {
        bail!(
            "causal_softmax: last two dims must be (T, T), got {:?}",
            x.shape()
        )
    }
    apply(x, scale, true)
}
