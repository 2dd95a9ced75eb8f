//! GELU, tanh approximation (GPT-2's `gelu_new`), as a fused op with its own
//! backward:
//!
//!   y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//!   dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//!
//! Why: candle's GELU calls the scalar libm `tanhf` per element and builds its
//! backward from half a dozen elementwise tensors; on the project's machine
//! that was ~17% of a GPT-2 step. Here tanh is computed from a branch-free
//! polynomial `exp` that the compiler vectorises (AVX-512 when present), and
//! the backward is one pass. Accuracy: ~1e-7 absolute against f64.
//! f16 / bf16: widened to f32 at the kernel boundary, results narrowed back.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let x = Tensor::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu).unwrap();
//! let y = phalanx::ops::gelu(&x).unwrap().to_vec1::<f32>().unwrap();
//! assert!((y[0] + 0.158808).abs() < 1e-5 && y[1] == 0.0 && (y[2] - 1.954597).abs() < 1e-5);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::cpu::{cpu_f32, is_float, par_elems, storage_in, tensor_in, with_f32_any};
use crate::simd_dispatch;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;

// exp_approx's constants, shared with the AVX-512 kernels.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 * 2^23: adding it rounds to an integer.
const ROUND: f32 = 12_582_912.0;
const EXP_MAX_ARG: f32 = 87.0;
/// e^r's Taylor coefficients, highest degree first (Horner's order).
const EXP_POLY: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// e^x for x in about [-87, 87]: Cody-Waite range reduction to r in
/// [-ln2/2, ln2/2], a degree-6 Taylor polynomial (rel. error ~1e-7), and
/// 2^n built in the exponent bits. No branches, so it vectorises.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    let x = x.clamp(-EXP_MAX_ARG, EXP_MAX_ARG);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p * r + c);
    // n sits in the low mantissa bits of `shifted` (its bits are 0x4B40_0000 + n):
    // integer ops on those bits build 2^n without a float->int conversion,
    // whose saturating semantics would stop vectorisation.
    let pow2n = (shifted
        .to_bits()
        .wrapping_sub(0x4B40_0000)
        .wrapping_add(127))
        << 23;
    p * f32::from_bits(pow2n)
}

/// tanh(u) = 1 - 2 / (e^{2u} + 1); |u| > 9 is +-1 to f32 precision.
#[inline(always)]
pub fn tanh_approx(u: f32) -> f32 {
    let u = u.clamp(-9.0, 9.0);
    1.0 - 2.0 / (exp_approx(2.0 * u) + 1.0)
}

#[inline(always)]
fn gelu_fwd_kernel(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
        *y = 0.5 * x * (1.0 + tanh_approx(u));
    }
}

#[inline(always)]
fn gelu_bwd_kernel(x: &[f32], g: &[f32], dx: &mut [f32]) {
    for ((dx, &x), &g) in dx.iter_mut().zip(x).zip(g) {
        let x2 = x * x;
        let t = tanh_approx(SQRT_2_OVER_PI * (x + COEF * x2 * x));
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x2);
        *dx = g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du);
    }
}

/// The same kernels with AVX-512 intrinsics, where the one thing the
/// compiler cannot do matters: `1 / (e + 1)` from the 14-bit reciprocal
/// estimate and one Newton step (about 1 ulp) instead of a division, which
/// was about half of the kernel's time. The tail runs the portable kernel.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{COEF, EXP_MAX_ARG, EXP_POLY, LN2_HI, LN2_LO, LOG2E, ROUND, SQRT_2_OVER_PI};

    /// `exp_approx` on 16 lanes (same reduction and polynomial).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let s = _mm512_set1_ps;
        let x = _mm512_min_ps(_mm512_max_ps(x, s(-EXP_MAX_ARG)), s(EXP_MAX_ARG));
        let shifted = _mm512_fmadd_ps(x, s(LOG2E), s(ROUND));
        let n = _mm512_sub_ps(shifted, s(ROUND));
        let r = _mm512_fnmadd_ps(n, s(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, s(LN2_LO), r);
        let mut p = s(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, s(c));
        }
        let bits = _mm512_castps_si512(shifted);
        let pow2n = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_sub_epi32(bits, _mm512_set1_epi32(0x4B40_0000)),
            _mm512_set1_epi32(127),
        ));
        _mm512_mul_ps(p, _mm512_castsi512_ps(pow2n))
    }

    /// tanh(u) = 1 - 2 / (e^{2u} + 1), |u| clamped to 9.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tanh16(u: __m512) -> __m512 {
        let s = _mm512_set1_ps;
        let u = _mm512_min_ps(_mm512_max_ps(u, s(-9.0)), s(9.0));
        let d = _mm512_add_ps(exp16(_mm512_add_ps(u, u)), s(1.0));
        let r = _mm512_rcp14_ps(d);
        let r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, s(2.0))); // r (2 - d r)
        _mm512_fnmadd_ps(s(2.0), r, s(1.0))
    }

    /// u = sqrt(2/pi) (x + 0.044715 x^3).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn inner(x: __m512, x2: __m512) -> __m512 {
        let s = _mm512_set1_ps;
        _mm512_mul_ps(
            s(SQRT_2_OVER_PI),
            _mm512_fmadd_ps(_mm512_mul_ps(s(COEF), x2), x, x),
        )
    }

    #[target_feature(enable = "avx512f")]
    pub fn forward(x: &[f32], y: &mut [f32]) {
        let s = _mm512_set1_ps;
        let (xc, yc) = (x.chunks_exact(16), y.chunks_exact_mut(16));
        let (xt, n) = (xc.remainder(), x.len() - x.len() % 16);
        for (x, y) in xc.zip(yc) {
            // SAFETY: x and y are 16-lane chunks.
            unsafe {
                let x = _mm512_loadu_ps(x.as_ptr());
                let t = tanh16(inner(x, _mm512_mul_ps(x, x)));
                let v = _mm512_mul_ps(_mm512_mul_ps(s(0.5), x), _mm512_add_ps(s(1.0), t));
                _mm512_storeu_ps(y.as_mut_ptr(), v);
            }
        }
        super::gelu_fwd_kernel(xt, &mut y[n..]);
    }

    #[target_feature(enable = "avx512f")]
    pub fn backward(x: &[f32], g: &[f32], dx: &mut [f32]) {
        let s = _mm512_set1_ps;
        let n = x.len() - x.len() % 16;
        for ((x, g), dx) in x
            .chunks_exact(16)
            .zip(g.chunks_exact(16))
            .zip(dx.chunks_exact_mut(16))
        {
            // SAFETY: x, g and dx are 16-lane chunks.
            unsafe {
                let x = _mm512_loadu_ps(x.as_ptr());
                let g = _mm512_loadu_ps(g.as_ptr());
                let x2 = _mm512_mul_ps(x, x);
                let t = tanh16(inner(x, x2));
                let du = _mm512_mul_ps(
                    s(SQRT_2_OVER_PI),
                    _mm512_fmadd_ps(s(3.0 * COEF), x2, s(1.0)),
                );
                let one_m_t2 = _mm512_fnmadd_ps(t, t, s(1.0));
                let a = _mm512_mul_ps(s(0.5), _mm512_add_ps(s(1.0), t));
                let b = _mm512_mul_ps(_mm512_mul_ps(s(0.5), x), _mm512_mul_ps(one_m_t2, du));
                _mm512_storeu_ps(dx.as_mut_ptr(), _mm512_mul_ps(g, _mm512_add_ps(a, b)));
            }
        }
        super::gelu_bwd_kernel(&x[n..], &g[n..], &mut dx[n..]);
    }
}

/// Whether the AVX-512 kernels run here.
#[cfg(target_arch = "x86_64")]
fn use_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

/// GELU forward over slices (used by the op; public for benchmarks).
pub fn gelu_forward(x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "gelu: x and y differ in length");
    par_elems(y, |r, y| {
        let x = &x[r];
        #[cfg(target_arch = "x86_64")]
        if use_avx512() {
            // SAFETY: AVX-512F is present.
            return unsafe { avx512::forward(x, y) };
        }
        simd_dispatch!(gelu_fwd_kernel(x, y))
    });
}

/// GELU backward over slices: `dx = g * gelu'(x)`.
pub fn gelu_backward(x: &[f32], g: &[f32], dx: &mut [f32]) {
    assert!(
        x.len() == dx.len() && g.len() == dx.len(),
        "gelu: lengths differ"
    );
    par_elems(dx, |r, dx| {
        let (x, g) = (&x[r.clone()], &g[r]);
        #[cfg(target_arch = "x86_64")]
        if use_avx512() {
            // SAFETY: AVX-512F is present.
            return unsafe { avx512::backward(x, g, dx) };
        }
        simd_dispatch!(gelu_bwd_kernel(x, g, dx))
    });
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "phalanx-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let x = cpu_f32(s, l)?;
        let mut y = vec![0f32; x.len()];
        gelu_forward(&x, &mut y);
        Ok((storage_in(s.dtype(), y)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dx = with_f32_any(arg, |x| {
            with_f32_any(grad, |g| {
                let mut dx = vec![0f32; x.len()];
                gelu_backward(x, g, &mut dx);
                dx
            })
        })??;
        Ok(Some(tensor_in(dx, arg.dtype(), arg.shape(), arg.device())?))
    }
}

/// GELU (tanh approximation) with a fused, vectorised forward and backward.
/// f32, f16 or bf16 on CPU; other dtypes/devices fall back to candle's `gelu`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !is_float(x.dtype()) || !super::host_kernels(x.device()) {
        return x.gelu();
    }
    x.contiguous()?.apply_op1(Gelu)
}
