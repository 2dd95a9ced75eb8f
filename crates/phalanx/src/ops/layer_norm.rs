//! LayerNorm over the last dimension, fused forward and backward.
//!
//!   mean = avg(x), rstd = 1 / sqrt(var(x) + eps)   (biased variance, as PyTorch)
//!   xhat = (x - mean) * rstd,  y = xhat * w + b
//! Backward (per row, with dxhat = dy * w):
//!   dx = rstd * (dxhat - avg(dxhat) - xhat * avg(dxhat * xhat))
//!   dw = sum_rows(dy * xhat),  db = sum_rows(dy)
//!
//! Why our own: candle-nn's fused `layer_norm` has no backward (gradients
//! silently stop), and its composed fallback allocates ~8 tensors per call.
//! The backward recomputes mean/rstd from x instead of saving them.
//!
//! f16 / bf16 (mixed precision): x, w and b may each be f32, f16 or bf16;
//! all are widened to f32 at the kernel boundary, statistics and sums are in
//! f32, y and dx come back in x's dtype, dw in w's and db in b's.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let x = Tensor::new(&[[1f32, 2., 3.]], &dev).unwrap();
//! let (w, b) = (Tensor::ones(3, candle_core::DType::F32, &dev).unwrap(),
//!               Tensor::zeros(3, candle_core::DType::F32, &dev).unwrap());
//! let y = phalanx::ops::layer_norm(&x, &w, &b, 1e-5).unwrap().to_vec2::<f32>().unwrap();
//! assert!((y[0][0] + 1.2247).abs() < 1e-3 && y[0][1].abs() < 1e-6);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::cpu::{
    cpu_f32, dot_lanes, is_float, par_rows, storage_in, sum_lanes, tensor_in, with_f32_any, RowSums,
};
use super::tape;
use crate::simd_dispatch;

struct LayerNorm {
    eps: f32,
}

/// (mean, rstd) of one row; two passes (mean, then centred squares) for accuracy.
#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let c = x.len() as f32;
    let mean = sum_lanes(x) / c;
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|v| (v - mean) * (v - mean))
        .sum();
    for ch in chunks {
        for i in 0..16 {
            let d = ch[i] - mean;
            acc[i] += d * d;
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / c;
    (mean, 1.0 / (var + eps).sqrt())
}

#[inline(always)]
fn row_fwd(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], eps: f32) {
    let (mean, rstd) = row_stats(x, eps);
    for i in 0..x.len() {
        y[i] = (x[i] - mean) * rstd * w[i] + b[i];
    }
}

/// One row's backward: writes dx, adds into dw and db.
#[inline(always)]
fn row_bwd(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    eps: f32,
) {
    let c = x.len();
    let (mean, rstd) = row_stats(x, eps);
    // dx is first used as scratch for dxhat = dy * w.
    for i in 0..c {
        let xhat = (x[i] - mean) * rstd;
        dx[i] = dy[i] * w[i];
        dw[i] += dy[i] * xhat;
        db[i] += dy[i];
    }
    let m1 = sum_lanes(dx) / c as f32;
    // avg(dxhat * xhat) = rstd * (avg(dxhat * x) - mean * avg(dxhat)).
    let m2 = rstd * (dot_lanes(dx, x) / c as f32 - mean * m1);
    for i in 0..c {
        let xhat = (x[i] - mean) * rstd;
        dx[i] = rstd * (dx[i] - m1 - xhat * m2);
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "phalanx-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let (x, w, b) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?, cpu_f32(s3, l3)?);
        let mut y = vec![0f32; x.len()];
        layer_norm_forward(&x, &w, &b, self.eps, &mut y);
        Ok((storage_in(s1.dtype(), y)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = with_f32_any(x_t, |x| {
            with_f32_any(w_t, |w| {
                with_f32_any(grad, |dy| layer_norm_backward(x, w, dy, self.eps))
            })
        })????;
        let (dev, c) = (x_t.device(), w_t.elem_count());
        let dx = tensor_in(dx, x_t.dtype(), x_t.shape(), dev)?;
        let dw = tensor_in(dw, w_t.dtype(), c, dev)?;
        let db = tensor_in(db, b_t.dtype(), c, dev)?;
        if tape::active() && !w_t.track_op() && !b_t.track_op() {
            // The zero-bubble input pass (B) with constant w and b: the
            // kernel gave their gradients with dx, so the W pass only adds
            // them in.
            tape::defer(Box::new(tape::Ready(vec![
                (w_t.clone(), dw),
                (b_t.clone(), db),
            ])));
            return Ok((Some(dx), None, None));
        }
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The forward over slices (rows of `w.len()`): every element of `y` is written.
pub fn layer_norm_forward(x: &[f32], w: &[f32], b: &[f32], eps: f32, y: &mut [f32]) {
    let c = w.len();
    assert!(b.len() == c && x.len() == y.len() && x.len().is_multiple_of(c));
    par_rows(y, c, |rows, y| {
        for (r, y) in rows.zip(y.chunks_exact_mut(c)) {
            let x = &x[r * c..(r + 1) * c];
            simd_dispatch!(row_fwd(x, w, b, y, eps));
        }
    });
}

/// The backward pass over slices: returns (dx, dw, db).
pub fn layer_norm_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let c = w.len();
    let mut dx = vec![0f32; x.len()];
    let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
    layer_norm_backward_into(x, w, dy, eps, &mut dx, &mut dw, &mut db)?;
    Ok((dx, dw, db))
}

/// The backward pass over slices into `dx` (every element written),
/// adding the gain's and the bias's gradients into `dw` and `db`.
pub fn layer_norm_backward_into(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) -> Result<()> {
    let c = w.len();
    if x.len() != dy.len() || x.len() != dx.len() || !x.len().is_multiple_of(c) {
        bail!(
            "layer_norm backward: x {} dy {} dx {} c {c}",
            x.len(),
            dy.len(),
            dx.len()
        )
    }
    if dw.len() != c || db.len() != c {
        bail!("layer_norm backward: dw {} db {} c {c}", dw.len(), db.len())
    }
    // Each row chunk sums its dw/db locally; the chunks' sums are added in
    // row order (not as threads finish: the same bits every run).
    let sums = RowSums::new();
    par_rows(dx, c, |rows, dx| {
        let start = rows.start;
        let mut dwb = vec![0f32; 2 * c];
        let (dw, db) = dwb.split_at_mut(c);
        for (r, dx) in rows.zip(dx.chunks_exact_mut(c)) {
            let x = &x[r * c..(r + 1) * c];
            let dy = &dy[r * c..(r + 1) * c];
            simd_dispatch!(row_bwd(x, w, dy, dx, dw, db, eps));
        }
        sums.push(start, dwb);
    });
    sums.add_into(&mut [dw, db]);
    Ok(())
}

/// LayerNorm over the last dim of `x` with gain `w` and bias `b` (both (C,)).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> Result<Tensor> {
    let c = x.dim(candle_core::D::Minus1)?;
    if w.dims() != [c] || b.dims() != [c] {
        bail!(
            "layer_norm: x {:?}, weight {:?}, bias {:?}",
            x.shape(),
            w.shape(),
            b.shape()
        )
    }
    let float = [x, w, b].iter().all(|t| is_float(t.dtype()));
    if !float || !super::host_kernels(x.device()) {
        return candle_nn::ops::layer_norm_slow(x, w, b, eps);
    }
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}
