//! Llama's fused CPU ops, each one autograd node with a hand-written
//! backward (as `phalanx::ops` does for GPT-2's): RMSNorm, rotary
//! embeddings, SwiGLU. Composed from candle ops they cost several
//! full-size tensors and graph nodes each (llama-tiny trained at 0.64x
//! gpt-tiny's tokens/s that way).
//!
//! ```text
//! rms_norm:  r = 1 / sqrt(mean(x^2) + eps);  y = x r w
//!            dx = r (dy w - xhat mean(dy w xhat)),  xhat = x r;  dw = sum_rows(dy xhat)
//! rope:      per head, pairs (i, i + d/2) at angle a = pos * theta^(-2i/d):
//!            y_i = x_i cos a - x_{i+d/2} sin a;  y_{i+d/2} = x_{i+d/2} cos a + x_i sin a
//!            (HF's x cos + rotate_half(x) sin); backward rotates by -a
//! swiglu:    y = silu(g) u;  dg = dy u s (1 + g (1 - s)),  du = dy g s,  s = sigmoid(g)
//! ```
//!
//! f16 / bf16 are widened to f32 in the kernels and narrowed back (RMSNorm
//! scales by w in f32 where HF multiplies in the input dtype: the same in
//! f32). Other devices use the composed ops of [`super::blocks`].
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_models::llama::ops;
//! let x = Tensor::new(&[[3f32, 4.]], &Device::Cpu).unwrap();
//! let w = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
//! let y = ops::rms_norm(&x, &w, 0.0).unwrap().to_vec2::<f32>().unwrap();
//! let r = (12.5f32).sqrt();
//! assert!((y[0][0] - 3. / r).abs() < 1e-6 && (y[0][1] - 8. / r).abs() < 1e-6);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use phalanx::ops::cpu::{
    cpu_f32, dot_lanes, is_float, par_rows, storage_in, tensor_in, with_f32_any, RowSums,
};
use phalanx::ops::tape;
use phalanx::simd_dispatch;

// ------------------------------------------------------------------ RMSNorm

struct RmsNorm {
    eps: f32,
}

#[inline(always)]
fn rstd(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot_lanes(x, x) / x.len() as f32 + eps).sqrt()
}

#[inline(always)]
pub(crate) fn rms_row_fwd(x: &[f32], w: &[f32], y: &mut [f32], eps: f32) {
    let r = rstd(x, eps);
    for i in 0..x.len() {
        y[i] = x[i] * r * w[i];
    }
}

#[inline(always)]
pub(crate) fn rms_row_bwd(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    eps: f32,
) {
    let c = x.len();
    let r = rstd(x, eps);
    // dx holds dxhat = dy w first; mean(dxhat xhat) = r mean(dxhat x).
    for i in 0..c {
        dx[i] = dy[i] * w[i];
        dw[i] += dy[i] * x[i] * r;
    }
    let m = r * dot_lanes(dx, x) / c as f32;
    for i in 0..c {
        dx[i] = r * (dx[i] - x[i] * r * m);
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "phalanx-llama-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        phalanx::ops::kernel_ran();
        let (x, w) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?);
        let w = &w[..];
        let c = w.len();
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, c, |rows, y| {
            for (r, y) in rows.zip(y.chunks_exact_mut(c)) {
                simd_dispatch!(rms_row_fwd(&x[r * c..(r + 1) * c], w, y, self.eps));
            }
        });
        Ok((storage_in(s1.dtype(), y)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_grads(x_t, w_t, grad, self.eps)?;
        let dev = x_t.device();
        let dx = tensor_in(dx, x_t.dtype(), x_t.shape(), dev)?;
        let dw = tensor_in(dw, w_t.dtype(), w_t.elem_count(), dev)?;
        // The zero-bubble input pass (B) with a constant gain: the kernel
        // gave its gradient with dx, so the W pass only adds it in.
        if !w_t.track_op() && tape::defer(Box::new(tape::Ready(vec![(w_t.clone(), dw.clone())]))) {
            return Ok((Some(dx), None));
        }
        Ok((Some(dx), Some(dw)))
    }
}

/// (dx, dw) of an RMSNorm as f32 vectors, from tensors of any float dtype.
fn rms_grads(x_t: &Tensor, w_t: &Tensor, grad: &Tensor, eps: f32) -> Result<(Vec<f32>, Vec<f32>)> {
    let c = w_t.elem_count();
    with_f32_any(x_t, |x| {
        with_f32_any(w_t, |w| {
            with_f32_any(grad, |dy| {
                let mut dx = vec![0f32; x.len()];
                // Chunk sums added in row order: the same bits every run.
                let sums = RowSums::new();
                par_rows(&mut dx, c, |rows, dx| {
                    let start = rows.start;
                    let mut dw = vec![0f32; c];
                    for (r, dx) in rows.zip(dx.chunks_exact_mut(c)) {
                        let (x, dy) = (&x[r * c..(r + 1) * c], &dy[r * c..(r + 1) * c]);
                        simd_dispatch!(rms_row_bwd(x, w, dy, dx, &mut dw, eps));
                    }
                    sums.push(start, dw);
                });
                let mut dw = vec![0f32; c];
                sums.add_into(&mut [&mut dw]);
                (dx, dw)
            })
        })
    })??
}

/// RMSNorm over the last dim of `x` with gain `w` (C,).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let c = x.dim(candle_core::D::Minus1)?;
    if w.dims() != [c] {
        bail!("rms_norm: x {:?}, weight {:?}", x.shape(), w.shape())
    }
    if !is_float(x.dtype()) || !is_float(w.dtype()) || !phalanx::ops::host_kernels(x.device()) {
        return super::blocks::rms_norm_composed(x, w, eps);
    }
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

// ------------------------------------------------------------------- rotary

struct Rope {
    /// cos and sin of the angle (t, i), t < T, i < d/2: (T, d/2) each.
    cos: Vec<f32>,
    sin: Vec<f32>,
    t: usize,
    heads: usize,
    d: usize,
}

impl Rope {
    /// Rotate every (b, t, h) row of `x` by +angle (`sign` 1) or -angle (-1).
    fn apply(&self, x: &[f32], sign: f32) -> Vec<f32> {
        let (d, h2) = (self.d, self.d / 2);
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, d, |rows, y| {
            for (r, y) in rows.zip(y.chunks_exact_mut(d)) {
                let pos = (r / self.heads) % self.t;
                let (c, s) = (&self.cos[pos * h2..][..h2], &self.sin[pos * h2..][..h2]);
                let x = &x[r * d..(r + 1) * d];
                for i in 0..h2 {
                    let (a, b, si) = (x[i], x[i + h2], sign * s[i]);
                    y[i] = a * c[i] - b * si;
                    y[i + h2] = b * c[i] + a * si;
                }
            }
        });
        y
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "phalanx-llama-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        phalanx::ops::kernel_ran();
        let y = self.apply(&cpu_f32(s, l)?, 1.0);
        Ok((storage_in(s.dtype(), y)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dx = with_f32_any(grad, |g| self.apply(g, -1.0))?;
        Ok(Some(tensor_in(dx, x.dtype(), x.shape(), x.device())?))
    }
}

/// Rotary embeddings on `x` (B, T, H, d) at positions `start..start + T`
/// with the d/2 inverse frequencies `inv` (`LlamaConfig::inv_freq`), HF's
/// rotate-half convention, angles in f32 as HF computes them.
pub fn rope(x: &Tensor, inv: &[f32], start: usize) -> Result<Tensor> {
    let (_b, t, heads, d) = x.dims4()?;
    if d != 2 * inv.len() {
        bail!(
            "rope: head size {d} needs {} frequencies, got {}",
            d / 2,
            inv.len()
        )
    }
    if !is_float(x.dtype()) || !phalanx::ops::host_kernels(x.device()) {
        let (cos, sin) = super::blocks::rope_tables(inv, start, t, x.dtype(), x.device())?;
        return super::blocks::apply_rope(x, &cos, &sin);
    }
    let h2 = d / 2;
    let (mut cos, mut sin) = (Vec::with_capacity(t * h2), Vec::with_capacity(t * h2));
    for p in start..start + t {
        for f in inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    x.contiguous()?.apply_op1(Rope {
        cos,
        sin,
        t,
        heads,
        d,
    })
}

// ------------------------------------------------------------------- SwiGLU

struct SwiGlu;

/// 1 / (1 + e^-g) with `exp_approx` (branch-free, relative error ~1e-7:
/// it vectorises where libm's `expf`, a call per element, does not).
#[inline(always)]
pub(crate) fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + phalanx::ops::exp_approx(-g))
}

/// s = silu(g) u, elementwise.
#[inline(always)]
pub(crate) fn swiglu_fwd(g: &[f32], u: &[f32], s: &mut [f32]) {
    for ((s, g), u) in s.iter_mut().zip(g).zip(u) {
        *s = g * sigmoid(*g) * u;
    }
}

/// The gradients of s = silu(g) u from ds: dg = ds u σ (1 + g (1 - σ)),
/// du = ds g σ, σ = sigmoid(g).
#[inline(always)]
pub(crate) fn swiglu_bwd(ds: &[f32], g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let n = ds.len();
    let (g, u, dg, du) = (&g[..n], &u[..n], &mut dg[..n], &mut du[..n]);
    for i in 0..n {
        let (gi, sg) = (g[i], sigmoid(g[i]));
        dg[i] = ds[i] * u[i] * sg * (1.0 + gi * (1.0 - sg));
        du[i] = ds[i] * gi * sg;
    }
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "phalanx-llama-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        phalanx::ops::kernel_ran();
        let (g, u) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?);
        let c = *l1.dims().last().unwrap_or(&1);
        let mut y = vec![0f32; g.len()];
        par_rows(&mut y, c.max(1), |rows, y| {
            let lo = rows.start * c;
            for (k, y) in y.iter_mut().enumerate() {
                let gi = g[lo + k];
                *y = gi * sigmoid(gi) * u[lo + k];
            }
        });
        Ok((storage_in(s1.dtype(), y)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        g_t: &Tensor,
        u_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = g_t.dim(candle_core::D::Minus1)?.max(1);
        let (dg, du) = with_f32_any(g_t, |g| {
            with_f32_any(u_t, |u| {
                with_f32_any(grad, |dy| {
                    let mut dg = vec![0f32; g.len()];
                    let mut du = vec![0f32; g.len()];
                    par_rows(&mut dg, c, |rows, dg| {
                        let lo = rows.start * c;
                        for (k, dg) in dg.iter_mut().enumerate() {
                            let (gi, s) = (g[lo + k], sigmoid(g[lo + k]));
                            *dg = dy[lo + k] * u[lo + k] * s * (1.0 + gi * (1.0 - s));
                        }
                    });
                    par_rows(&mut du, c, |rows, du| {
                        let lo = rows.start * c;
                        for (k, du) in du.iter_mut().enumerate() {
                            let gi = g[lo + k];
                            *du = dy[lo + k] * gi * sigmoid(gi);
                        }
                    });
                    (dg, du)
                })
            })
        })???;
        let dev = g_t.device();
        Ok((
            Some(tensor_in(dg, g_t.dtype(), g_t.shape(), dev)?),
            Some(tensor_in(du, u_t.dtype(), u_t.shape(), dev)?),
        ))
    }
}

/// `silu(g) * u`, elementwise (g and u of one shape).
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        bail!("swiglu: gate {:?}, up {:?}", g.shape(), u.shape())
    }
    if !is_float(g.dtype()) || g.dtype() != u.dtype() || !phalanx::ops::host_kernels(g.device()) {
        return g.silu()? * u;
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}
