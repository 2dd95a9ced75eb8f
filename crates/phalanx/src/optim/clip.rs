//! Gradient clipping by global norm, split so shards can cooperate:
//! 1. each rank computes `sum_squares` of its part of the gradient,
//! 2. the sums are all-reduced (sum) by the caller when sharded,
//! 3. `clip_scale` turns the global sum into (norm, scale), and the scale is
//!    applied with `scale_in_place` or fused into the optimizer step.
//!
//! As PyTorch's `clip_grad_norm_`: `scale = min(1, max_norm / (norm + 1e-6))`,
//! and the norm returned is the one before clipping.
//!
//! ```
//! use phalanx::optim::clip::clip_grad_norm;
//! let mut g = vec![3.0f32, 4.0];
//! let norm = clip_grad_norm(&mut g, 1.0);
//! assert_eq!(norm, 5.0);
//! assert!((g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5);
//! ```

/// Sum of squares of a gradient slice, accumulated in f64 per block of 1024
/// (exact enough for 1e9 elements). Within a block 16 f32 lanes add
/// independently, so the loop runs at the CPU's vector width: one running
/// f32 sum cannot be reordered by the compiler and ran one element at a
/// time (about 0.5% of a llama-60m step).
pub fn sum_squares(g: &[f32]) -> f64 {
    crate::simd_dispatch!(sum_squares_kernel(g))
}

#[inline(always)]
fn sum_squares_kernel(g: &[f32]) -> f64 {
    g.chunks(1024)
        .map(|c| {
            let s = crate::ops::cpu::dot_lanes(c, c);
            if s.is_finite() {
                s as f64
            } else {
                // Squares past f32's range (values above ~1.8e19, or a
                // block whose squares sum past 3.4e38) are finite in f64:
                // only a non-finite gradient may read as one.
                c.iter().map(|&x| x as f64 * x as f64).sum()
            }
        })
        .sum()
}

/// From the global sum of squares: (pre-clip norm, factor to multiply the
/// gradients by, <= 1).
pub fn clip_scale(sum_sq: f64, max_norm: f32) -> (f32, f32) {
    let norm = sum_sq.sqrt();
    let scale = (max_norm as f64 / (norm + 1e-6)).min(1.0);
    (norm as f32, scale as f32)
}

pub fn scale_in_place(g: &mut [f32], scale: f32) {
    if scale != 1.0 {
        g.iter_mut().for_each(|x| *x *= scale);
    }
}

/// Single-process clipping: returns the pre-clip global norm.
pub fn clip_grad_norm(g: &mut [f32], max_norm: f32) -> f32 {
    let (norm, scale) = clip_scale(sum_squares(g), max_norm);
    scale_in_place(g, scale);
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squares_past_f32s_range_are_finite_and_non_finite_values_stay_so() {
        assert_eq!(sum_squares(&[2e19]), 2e19f32 as f64 * 2e19f32 as f64);
        assert!(sum_squares(&vec![1e19f32; 4096]).is_finite());
        assert_eq!(sum_squares(&[1.0, f32::INFINITY]), f64::INFINITY);
        assert!(sum_squares(&[1.0, f32::NAN]).is_nan());
    }

    #[test]
    fn sum_squares_matches_f64_on_odd_lengths() {
        for n in [0, 1, 15, 17, 1023, 1025, 5000] {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
            let got = sum_squares(&g);
            assert!(
                (got - want).abs() <= 1e-6 * want.max(1.0),
                "n {n}: {got} vs {want}"
            );
        }
    }
}
