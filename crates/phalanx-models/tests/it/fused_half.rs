//! The fused GPT-2 layer in bf16 and f16 (`train.precision = bf16 | fp16`)
//! against the composed layer in the same dtype, both measured against an
//! f32 run of the same (half-representable) weights and inputs: the
//! outputs, the input gradient, every parameter gradient and the loss.
//! The fused layer computes in f32 between its boundaries, so its error
//! must be no larger than the composed layer's (which rounds every
//! intermediate to half), within a slack; and it must agree with the
//! composed one to the dtype's rounding. Odd shapes, through the engine's
//! direct path (kept and recomputed activations) and the graph path
//! (whole-model autograd, `Stack::reference_grads`).

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use phalanx::engine::{Activations, FlatBuffer, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx_models::gpt2::{self, set_fused_layer, Gpt2Config};

use crate::common;
use common::{stack_step, token_ids as ids};

/// `v` rounded to `dtype` (and back): values the half runs see exactly.
fn round_to(dtype: DType, v: &mut [f32]) {
    for x in v {
        *x = match dtype {
            DType::BF16 => bf16::from_f32(*x).to_f32(),
            DType::F16 => f16::from_f32(*x).to_f32(),
            _ => *x,
        }
    }
}

/// Deterministic values in about [-1, 1], rounded to `dtype`.
fn values(n: usize, seed: u64, dtype: DType) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    round_to(dtype, &mut v);
    v
}

/// A stack computing in `dtype`, with parameters representable in `half`
/// (so every run computes on the same weights).
fn stack(cfg: &Gpt2Config, act: Activations, dtype: DType, half: DType) -> (Stack, FlatBuffer) {
    let ledger = Ledger::new();
    let mut stack = Stack::new(gpt2::blocks(cfg).unwrap(), &Device::Cpu, act, &ledger).unwrap();
    stack.set_compute_dtype(dtype);
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 11);
    // Larger than init weights, so every path carries signal.
    let p = params.as_mut_slice();
    p.iter_mut()
        .enumerate()
        .for_each(|(i, p)| *p += 0.01 * ((i % 13) as f32 - 6.0));
    round_to(half, p);
    (stack, params)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A run's results, by name: "y", "dx" or "loss", and every parameter's
/// gradient.
type Named = Vec<(String, Vec<f32>)>;

fn param_grads(stack: &Stack, grads: &FlatBuffer, out: &mut Named) {
    for p in stack.layout().params() {
        out.push((p.name.clone(), grads.as_slice()[p.range()].to_vec()));
    }
}

/// The layers alone (blocks 1..=L) on a float input x (B, T, C) with an
/// upstream gradient gy, both representable in `half`: y, dx and the
/// layers' parameter gradients.
fn layers(
    cfg: &Gpt2Config,
    act: Activations,
    dtype: DType,
    half: DType,
    b: usize,
    t: usize,
) -> Named {
    let (stack, params) = stack(cfg, act, dtype, half);
    let c = cfg.n_embd;
    let dev = Device::Cpu;
    let x = Tensor::from_vec(values(b * t * c, 1, half), (b, t, c), &dev).unwrap();
    let gy = Tensor::from_vec(values(b * t * c, 2, half), (b, t, c), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let mut grads = FlatBuffer::zeros(stack.layout(), &Ledger::new(), Mem::Grads);
    let (y, st) = stack
        .forward(1..1 + cfg.n_layer, &x, None, &params)
        .unwrap();
    assert_eq!(y.dtype(), dtype, "the layers' output dtype");
    let dx = stack
        .backward(st, &gy, &params, &mut grads, &mut |_, _| Ok(()))
        .unwrap()
        .unwrap();
    assert_eq!(dx.dtype(), dtype, "the input gradient's dtype");
    let mut out = vec![("y".into(), f32s(&y)), ("dx".into(), f32s(&dx))];
    let n = out.len();
    param_grads(&stack, &grads, &mut out);
    // Only the layers' parameters (the embedding and head did not run).
    out.retain(|(k, _)| k.starts_with("transformer.h.") || k == "y" || k == "dx");
    assert!(out.len() == n + 12 * cfg.n_layer, "{}", out.len());
    out
}

/// The whole model on token ids: the loss and every parameter's gradient,
/// block by block (`graph` false: the engine's direct path) or as one
/// graph (`Stack::reference_grads`).
fn model(cfg: &Gpt2Config, dtype: DType, half: DType, graph: bool, b: usize, t: usize) -> Named {
    let (stack, params) = stack(cfg, Activations::KeepGraph, dtype, half);
    let (x, y) = (ids(b, t, cfg.vocab_size, 1), ids(b, t, cfg.vocab_size, 2));
    let mut grads = FlatBuffer::zeros(stack.layout(), &Ledger::new(), Mem::Grads);
    let loss = if graph {
        let (loss, g) = stack.reference_grads(&x, &y, 1.0, &params).unwrap();
        grads.as_mut_slice().copy_from_slice(&g);
        loss
    } else {
        stack_step(&stack, &params, (&x, &y), &mut grads)
    };
    let mut out = vec![("loss".into(), vec![loss])];
    param_grads(&stack, &grads, &mut out);
    out
}

/// Norm-relative distance of `a` to `r`.
fn rel(a: &[f32], r: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(r).map(|(a, r)| ((a - r) as f64).powi(2)).sum();
    let n: f64 = r.iter().map(|r| (*r as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// Runs `f(dtype, fused)` for the f32 reference and `dtype` composed and
/// fused, and checks each named result: the fused error against f32 is at
/// most `SLACK` times the composed one's plus `floor` (the dtype's
/// rounding), and fused and composed agree within `agree`.
fn check(what: &str, dtype: DType, f: impl Fn(DType, bool) -> Named) {
    // bf16 keeps 8 significant bits (relative rounding 2^-9), f16 11 bits
    // (2^-12); every result is rounded once at least. The floor absorbs
    // differences far below one rounding (the loss, a scalar, whose error
    // is luck: 9e-5 vs 3e-5 here in bf16); per result the fused error was
    // at most 1.2x the composed one. Fused and composed differed by up to
    // 1.1e-2 (bf16) and 1.4e-3 (f16); a wrong gradient differs by O(1).
    let (floor, agree) = match dtype {
        DType::BF16 => (2f64.powi(-12), 0.03),
        _ => (2f64.powi(-15), 0.004),
    };
    const SLACK: f64 = 1.25;
    let reference = f(DType::F32, true);
    let composed = f(dtype, false);
    let fused = f(dtype, true);
    // Two paths ran: the composed one rounds where the fused one does not.
    assert!(
        composed.iter().zip(&fused).any(|(c, u)| c.1 != u.1),
        "{what}: the fused layer did not run in {dtype:?}"
    );
    let (mut sum_f, mut sum_c) = (0f64, 0f64);
    for ((k, r), ((_, c), (_, u))) in reference.iter().zip(composed.iter().zip(&fused)) {
        assert!(r.iter().any(|v| *v != 0.0), "{what} {k}: no signal");
        let (ef, ec, fc) = (rel(u, r), rel(c, r), rel(u, c));
        sum_f += ef;
        sum_c += ec;
        assert!(
            ef <= SLACK * ec + floor,
            "{what} {dtype:?} {k}: fused error {ef:.2e} vs composed {ec:.2e}"
        );
        assert!(
            fc <= agree,
            "{what} {dtype:?} {k}: fused vs composed {fc:.2e}"
        );
        assert!(u.iter().all(|v| v.is_finite()), "{what} {k}");
    }
    let n = reference.len() as f64;
    eprintln!(
        "{what} {dtype:?}: mean error vs f32 over {n} results: fused {:.2e}, composed {:.2e}",
        sum_f / n,
        sum_c / n
    );
    // Overall the fused layer is the more accurate one.
    assert!(
        sum_f <= sum_c,
        "{what} {dtype:?}: fused {sum_f:e} vs composed {sum_c:e}"
    );
}

fn with_fused<T>(fused: bool, f: impl FnOnce() -> T) -> T {
    set_fused_layer(Some(fused));
    let out = f();
    set_fused_layer(None);
    out
}

#[test]
fn fused_half_layers_match_f32_better_than_composed() {
    let blk = phalanx::ops::ATTENTION_BLOCK;
    // (n_layer, n_head, C, B, T): odd widths, one head, T = 1, an even B
    // (split over the pool's threads) with T over one attention block.
    for (l, nh, c, b, t) in [
        (2, 5, 35, 3, 7),
        (1, 1, 8, 2, 1),
        (1, 3, 24, 1, 13),
        (2, 2, 16, 4, blk + 9),
    ] {
        let cfg = Gpt2Config::new(l, nh, c, 29, t.max(16));
        for act in [Activations::KeepGraph, Activations::Recompute] {
            for half in [DType::BF16, DType::F16] {
                let what = format!("layers C {c}, heads {nh}, B {b}, T {t}, {act:?}");
                check(&what, half, |dtype, fused| {
                    with_fused(fused, || layers(&cfg, act, dtype, half, b, t))
                });
            }
        }
    }
}

#[test]
fn fused_half_model_direct_and_graph_paths() {
    for (l, nh, c, v, b, t) in [(2, 5, 35, 61, 3, 7), (1, 2, 16, 19, 2, 1)] {
        let cfg = Gpt2Config::new(l, nh, c, v, t.max(16));
        for half in [DType::BF16, DType::F16] {
            for graph in [false, true] {
                let path = if graph { "graph" } else { "direct" };
                let what = format!("model C {c}, heads {nh}, B {b}, T {t}, {path} path");
                check(&what, half, |dtype, fused| {
                    with_fused(fused, || model(&cfg, dtype, half, graph, b, t))
                });
            }
            // The two paths run the same kernels on the same values.
            let [d, g] = [false, true]
                .map(|graph| with_fused(true, || model(&cfg, half, half, graph, b, t)));
            for ((k, d), (_, g)) in d.iter().zip(&g) {
                assert!(
                    rel(g, d) <= 1e-6,
                    "{half:?} {k}: graph vs direct path {:e}",
                    rel(g, d)
                );
            }
        }
    }
}

#[test]
fn fused_half_steady_steps_take_every_buffer_from_the_pool() {
    // Half activations live in the same pool as f32 ones (two values per
    // f32 slot): after the first step, every buffer comes back from it.
    let cfg = Gpt2Config::new(2, 5, 35, 61, 16);
    for half in [DType::BF16, DType::F16] {
        let fresh: Vec<usize> = (0..4)
            .map(|_| {
                with_fused(true, || model(&cfg, half, half, false, 4, 9));
                phalanx::ops::buffers::fresh_allocations()
            })
            .collect();
        assert_eq!(fresh[1], fresh[3], "{half:?}: {fresh:?}");
    }
}

#[test]
fn f16_conversions_match_the_half_crate_bit_for_bit() {
    use phalanx::ops::cpu::{f16_to_f32, f32_to_f16};
    // Every f16 (NaNs included), at a length that leaves a tail.
    let all: Vec<f16> = (0..=u16::MAX)
        .map(f16::from_bits)
        .chain([f16::ONE; 7])
        .collect();
    let mut wide = vec![0f32; all.len()];
    f16_to_f32(&all, &mut wide);
    for (h, w) in all.iter().zip(&wide) {
        let r = h.to_f32();
        assert!(
            r.to_bits() == w.to_bits() || (r.is_nan() && w.is_nan()),
            "{h:?}"
        );
    }
    // f32 values around every f16 rounding boundary, subnormals, overflow,
    // infinities and NaN.
    let mut v: Vec<f32> = wide.iter().filter(|w| w.is_finite()).copied().collect();
    v.extend(wide.windows(2).map(|w| (w[0] + w[1]) / 2.0));
    v.extend([
        65504.0,
        65520.0,
        65536.0,
        1e-8,
        -6e-8,
        f32::INFINITY,
        f32::NAN,
        3.0e38,
    ]);
    let mut narrow = vec![f16::ZERO; v.len()];
    f32_to_f16(&v, &mut narrow);
    for (x, h) in v.iter().zip(&narrow) {
        let r = f16::from_f32(*x);
        assert!(
            r.to_bits() == h.to_bits() || (r.is_nan() && h.is_nan()),
            "{x:e}"
        );
    }
}
