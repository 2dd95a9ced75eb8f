//! The fused ops on f16 / bf16 inputs against the f32 ops on the same
//! (rounded) inputs: values, gradients and dtypes.
//!
//! Why the tolerances: a half op widens its inputs to f32, runs exactly the
//! f32 kernel and rounds the result once. With identical (already rounded)
//! inputs, every output and every gradient computed only from the inputs is
//! therefore the f32 result rounded to nearest: elementwise error at most
//! u |y|, u the unit roundoff (bf16: 8 significant bits, u = 2^-8; f16: 11
//! bits, u = 2^-11), plus a few f32 ulps where threaded sums run in another
//! order. Backward passes that use a saved half activation (softmax's y,
//! attention's P) see inputs perturbed by u as well, so they are checked
//! normwise at 4u.

use candle_core::{DType, Device, Result, Tensor, Var};
use phalanx::ops;

use crate::common;
use common::{flat, randn};

/// Unit roundoff of a dtype: 2^-(significant bits).
fn unit(dt: DType) -> f32 {
    match dt {
        DType::BF16 => 2f32.powi(-8),
        DType::F16 => 2f32.powi(-11),
        _ => 2f32.powi(-24),
    }
}

/// Value and input gradients of `sum(f(inputs) * w)`, `w` random (rounded
/// to `w_dt` so both runs receive the same upstream gradient).
fn run(
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    w_dt: DType,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).unwrap();
    let w = randn(y.dims(), 99)
        .to_dtype(w_dt)
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
    let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = ts
        .iter()
        .map(|t| grads.get(t).expect("no gradient").clone())
        .collect();
    (y, g)
}

/// Elementwise: |a - b| <= u |b| + 1e-6 max|b| (+ f16's subnormal spacing).
fn check_rounded(what: &str, half: &Tensor, reference: &Tensor, dt: DType) {
    let (a, b) = (flat(half), flat(reference));
    assert_eq!(a.len(), b.len(), "{what}: sizes");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let u = unit(dt);
    let mut worst = 0f32;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let tol = u * y.abs() + 1e-6 * scale + 1e-7;
        assert!(
            (x - y).abs() <= tol,
            "{what} {dt:?}: element {i}: {x} vs {y} (tolerance {tol})"
        );
        worst = worst.max((x - y).abs() / (y.abs() + 1e-6 * scale + 1e-7));
    }
    eprintln!("{what} {dt:?}: worst relative error {worst:.2e} (u = {u:.2e})");
}

/// Normwise: |a - b|_2 <= k u |b|_2.
fn check_norm(what: &str, half: &Tensor, reference: &Tensor, dt: DType, k: f32) {
    let (a, b) = (flat(half), flat(reference));
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    let rel = (num / den).sqrt() as f32;
    eprintln!(
        "{what} {dt:?}: normwise relative error {rel:.2e} (u = {:.2e})",
        unit(dt)
    );
    assert!(rel <= k * unit(dt), "{what} {dt:?}: relative error {rel}");
}

/// Run `f` on `inputs` cast to `dts` (one per input) and on the same rounded
/// values in f32; check the output (in `out_dt`, or the first input's dtype)
/// and every gradient (in its input's dtype). `saved_half`: the backward
/// reads a saved half activation, so gradients are checked normwise.
fn compare(
    name: &str,
    inputs: &[Tensor],
    dts: &[DType],
    out_dt: Option<DType>,
    saved_half: bool,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let dt = dts[0];
    let half: Vec<Tensor> = inputs
        .iter()
        .zip(dts)
        .map(|(t, &d)| t.to_dtype(d).unwrap())
        .collect();
    let rounded: Vec<Tensor> = half
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let (y_ref, g_ref) = run(&rounded, f, dt);
    let (y, g) = run(&half, f, dt);
    assert_eq!(y.dtype(), out_dt.unwrap_or(dt), "{name}: output dtype");
    check_rounded(&format!("{name} forward"), &y, &y_ref, dt);
    for (i, ((g, gr), h)) in g.iter().zip(&g_ref).zip(&half).enumerate() {
        assert_eq!(g.dtype(), h.dtype(), "{name}: gradient {i} dtype");
        let what = format!("{name} grad {i}");
        if saved_half {
            check_norm(&what, g, gr, dt, 4.0);
        } else {
            check_rounded(&what, g, gr, h.dtype().max_by_unit(dt));
        }
    }
}

/// The coarser of two dtypes (for mixed-dtype inputs).
trait Coarser {
    fn max_by_unit(self, other: DType) -> DType;
}
impl Coarser for DType {
    fn max_by_unit(self, other: DType) -> DType {
        if unit(self) >= unit(other) {
            self
        } else {
            other
        }
    }
}

const HALVES: [DType; 2] = [DType::BF16, DType::F16];

#[test]
fn gelu_half() {
    let x = (randn(&[4, 64, 160], 1) * 2.0).unwrap(); // 40960: the threaded path
    for dt in HALVES {
        compare("gelu", std::slice::from_ref(&x), &[dt], None, false, &|t| {
            ops::gelu(&t[0])
        });
    }
}

#[test]
fn add_bias_half() {
    let x = randn(&[4, 64, 160], 2);
    let b = randn(&[64, 160], 3);
    for dt in HALVES {
        compare(
            "add_bias",
            &[x.clone(), b.clone()],
            &[dt, dt],
            None,
            false,
            &|t| ops::add_bias(&t[0], &t[1]),
        );
    }
}

#[test]
fn softmax_half() {
    let x = (randn(&[2, 4, 64, 64], 4) * 3.0).unwrap();
    for dt in HALVES {
        compare(
            "softmax",
            std::slice::from_ref(&x),
            &[dt],
            None,
            true,
            &|t| ops::softmax_last_dim(&t[0]),
        );
        compare(
            "causal_softmax",
            std::slice::from_ref(&x),
            &[dt],
            None,
            true,
            &|t| ops::causal_softmax(&t[0], 0.125),
        );
    }
}

#[test]
fn layer_norm_half() {
    let x = randn(&[4, 64, 160], 5).affine(3.0, 1.0).unwrap();
    let w = randn(&[160], 6).affine(0.5, 1.0).unwrap();
    let b = randn(&[160], 7);
    for dt in HALVES {
        compare(
            "layer_norm",
            &[x.clone(), w.clone(), b.clone()],
            &[dt, dt, dt],
            None,
            false,
            &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        );
        // Half activations with f32 LayerNorm parameters.
        compare(
            "layer_norm (f32 w, b)",
            &[x.clone(), w.clone(), b.clone()],
            &[dt, DType::F32, DType::F32],
            None,
            false,
            &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        );
    }
}

#[test]
fn linear_half() {
    let x = randn(&[4, 48, 96], 8);
    let w = (randn(&[160, 96], 9) * 0.1).unwrap();
    let b = randn(&[160], 10);
    for dt in HALVES {
        compare(
            "linear",
            &[x.clone(), w.clone(), b.clone()],
            &[dt, dt, dt],
            None,
            false,
            &|t| ops::linear(&t[0], &t[1], Some(&t[2])),
        );
        compare(
            "linear (no bias)",
            &[x.clone(), w.clone()],
            &[dt, dt],
            None,
            false,
            &|t| ops::linear(&t[0], &t[1], None),
        );
    }
}

#[test]
fn attention_half() {
    let qkv = randn(&[2, 48, 3 * 64], 11);
    for dt in HALVES {
        compare(
            "causal_attention",
            std::slice::from_ref(&qkv),
            &[dt],
            None,
            true,
            &|t| ops::causal_attention(&t[0], 4),
        );
    }
}

#[test]
fn cross_entropy_half() {
    let logits = (randn(&[3, 40, 517], 12) * 4.0).unwrap();
    let targets: Vec<u32> = (0..120u32).map(|i| (i * 37) % 517).collect();
    let targets = Tensor::from_vec(targets, (3, 40), &Device::Cpu).unwrap();
    for dt in HALVES {
        compare(
            "cross_entropy",
            std::slice::from_ref(&logits),
            &[dt],
            Some(DType::F32),
            false,
            &|t| ops::cross_entropy(&t[0], &targets),
        );
    }
}

/// f32 master weights cast to half (what a half `VarBuilder` hands a block):
/// the gradient reaches the f32 Var, in f32.
#[test]
fn gradients_reach_f32_master_weights() {
    let w = Var::from_tensor(&(randn(&[32, 16], 13) * 0.1).unwrap()).unwrap();
    let x = randn(&[2, 8, 16], 14).to_dtype(DType::BF16).unwrap();
    let y = ops::linear(&x, &w.as_tensor().to_dtype(DType::BF16).unwrap(), None).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let g = y.sum_all().unwrap().backward().unwrap();
    let gw = g.get(w.as_tensor()).unwrap();
    assert_eq!(gw.dtype(), DType::F32);
    assert_eq!(gw.dims(), &[32, 16]);
}

/// Timing of a few ops in f32, bf16 and f16 (`--ignored --nocapture`):
/// forward alone (the kernel and its conversions), and forward + backward
/// through candle's autograd (which adds candle's own half arithmetic).
#[test]
#[ignore]
fn time_half_vs_f32() {
    use std::time::Instant;
    let time = |f: &dyn Fn()| {
        f();
        let t = Instant::now();
        for _ in 0..5 {
            f();
        }
        t.elapsed().as_secs_f64() / 5.0 * 1e3
    };
    let x = randn(&[8, 256, 768], 1);
    let w = (randn(&[3072, 768], 2) * 0.02).unwrap();
    let b = randn(&[3072], 3);
    let qkv = randn(&[8, 256, 3 * 768], 4);
    let ln_w = randn(&[768], 5);
    let logits = randn(&[8, 128, 8192], 6);
    let targets = Tensor::zeros((8, 128), DType::U32, &Device::Cpu).unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let (xh, wh, bh, qh, lh) = (
            x.to_dtype(dt).unwrap(),
            w.to_dtype(dt).unwrap(),
            b.to_dtype(dt).unwrap(),
            qkv.to_dtype(dt).unwrap(),
            logits.to_dtype(dt).unwrap(),
        );
        let (lw, lb) = (ln_w.to_dtype(dt).unwrap(), bh.narrow(0, 0, 768).unwrap());
        let fwd = [
            time(&|| drop(ops::linear(&xh, &wh, Some(&bh)).unwrap())),
            time(&|| drop(ops::causal_attention(&qh, 12).unwrap())),
            time(&|| drop(ops::layer_norm(&xh, &lw, &lb, 1e-5).unwrap())),
            time(&|| drop(ops::gelu(&xh).unwrap())),
            time(&|| drop(ops::cross_entropy(&lh, &targets).unwrap())),
        ];
        let (xv, wv, qv, lv) = (
            Var::from_tensor(&xh).unwrap(),
            Var::from_tensor(&wh).unwrap(),
            Var::from_tensor(&qh).unwrap(),
            Var::from_tensor(&lh).unwrap(),
        );
        let bwd = [
            time(&|| {
                let y = ops::linear(xv.as_tensor(), wv.as_tensor(), Some(&bh)).unwrap();
                y.sum_all().unwrap().backward().unwrap();
            }),
            time(&|| {
                let y = ops::causal_attention(qv.as_tensor(), 12).unwrap();
                y.sum_all().unwrap().backward().unwrap();
            }),
            time(&|| {
                let y = ops::layer_norm(xv.as_tensor(), &lw, &lb, 1e-5).unwrap();
                y.sum_all().unwrap().backward().unwrap();
            }),
            time(&|| {
                ops::gelu(xv.as_tensor())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
            }),
            time(&|| {
                ops::cross_entropy(lv.as_tensor(), &targets)
                    .unwrap()
                    .backward()
                    .unwrap();
            }),
        ];
        eprintln!(
            "{dt:?} ms, forward / forward+backward: linear (2048x768 -> 3072) {:.1} / {:.1}; \
             attention (B8 T256 C768 12 heads) {:.1} / {:.1}; layer_norm {:.1} / {:.1}; \
             gelu {:.1} / {:.1}; cross_entropy (1024 x 8192) {:.1} / {:.1}",
            fwd[0], bwd[0], fwd[1], bwd[1], fwd[2], bwd[2], fwd[3], bwd[3], fwd[4], bwd[4]
        );
    }
}

#[test]
#[ignore]
fn time_conversions() {
    use half::slice::HalfFloatSliceExt;
    use std::time::Instant;
    let n = 8 << 20;
    let src: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let mut hb = vec![half::bf16::ZERO; n];
    let mut hf = vec![half::f16::ZERO; n];
    let mut back = vec![0f32; n];
    hb.convert_from_f32_slice(&src);
    hb.convert_to_f32_slice(&mut back);
    let t = Instant::now();
    hb.convert_from_f32_slice(&src);
    let a = t.elapsed();
    let t = Instant::now();
    hb.convert_to_f32_slice(&mut back);
    let b = t.elapsed();
    let t = Instant::now();
    phalanx::ops::cpu::f32_to_bf16(&src, &mut hb);
    let a2 = t.elapsed();
    let t = Instant::now();
    phalanx::ops::cpu::bf16_to_f32(&hb, &mut back);
    let b2 = t.elapsed();
    eprintln!("8M: phalanx bf16 narrow {a2:?} widen {b2:?}");
    let t = Instant::now();
    hf.convert_from_f32_slice(&src);
    let c = t.elapsed();
    let t = Instant::now();
    hf.convert_to_f32_slice(&mut back);
    let d = t.elapsed();
    eprintln!("8M: bf16 narrow {a:?} widen {b:?}; f16 narrow {c:?} widen {d:?}");
}

/// The vectorised bf16 conversions agree bit for bit with `half`'s.
#[test]
fn bf16_conversions_match_half() {
    use half::bf16;
    let mut v: Vec<f32> = (0..100_000)
        .map(|i| f32::from_bits((i as u32).wrapping_mul(2654435761)))
        .collect();
    v.extend([
        0.0,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        1.0 + f32::EPSILON * 64.0,   // a tie
        f32::from_bits(0x3F80_8000), // a tie, rounds to even
        f32::from_bits(0x3F81_8000),
        f32::from_bits(0x7F7F_FFFF), // rounds to infinity
    ]);
    let mut ours = vec![bf16::ZERO; v.len()];
    phalanx::ops::cpu::f32_to_bf16(&v, &mut ours);
    for (x, o) in v.iter().zip(&ours) {
        assert_eq!(
            o.to_bits(),
            bf16::from_f32(*x).to_bits(),
            "{x} ({:#x})",
            x.to_bits()
        );
    }
    let mut back = vec![0f32; v.len()];
    phalanx::ops::cpu::bf16_to_f32(&ours, &mut back);
    for (b, o) in back.iter().zip(&ours) {
        assert_eq!(b.to_bits(), o.to_f32().to_bits());
    }
}
