//! The fused GPT-2 layer (explicit forward and backward over reused
//! buffers) against the composed layer run by candle autograd: the same
//! loss and every gradient on odd shapes, through the block stack (its
//! zero-bubble split and buffer reuse are in `zero_bubble.rs`).

use candle_core::Device;
use phalanx::engine::{Activations, FlatBuffer, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx_models::gpt2::{self, set_fused_layer, Gpt2Config};

use crate::common;
use common::{stack_step, token_ids as ids};

/// (loss, flat gradient) of one forward and backward of the whole stack,
/// with the fused layer on or off.
fn run(cfg: &Gpt2Config, act: Activations, fused: bool, b: usize, t: usize) -> (f32, Vec<f32>) {
    set_fused_layer(Some(fused));
    let ledger = Ledger::new();
    let stack = Stack::new(gpt2::blocks(cfg).unwrap(), &Device::Cpu, act, &ledger).unwrap();
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 11);
    // Larger than init weights, so every path carries signal.
    params
        .as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, p)| *p += 0.01 * ((i % 13) as f32 - 6.0));
    let (x, y) = (ids(b, t, cfg.vocab_size, 1), ids(b, t, cfg.vocab_size, 2));
    let mut grads = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let loss = stack_step(&stack, &params, (&x, &y), &mut grads);
    set_fused_layer(None);
    (loss, grads.as_slice().to_vec())
}

#[test]
fn fused_layer_matches_candle_autograd_on_odd_shapes() {
    // (n_layer, n_head, C, vocab, B, T): odd widths, one head, T = 1; an
    // even B (split over the pool's threads, one share of the batch each,
    // where there are 2 or 4) with T over one attention block.
    let blk = phalanx::ops::ATTENTION_BLOCK;
    for (l, nh, c, v, b, t) in [
        (2, 5, 35, 61, 3, 7),
        (1, 1, 8, 11, 2, 1),
        (1, 3, 24, 29, 1, 13),
        (2, 2, 16, 19, 4, blk + 9),
    ] {
        let cfg = Gpt2Config::new(l, nh, c, v, t.max(16));
        for act in [Activations::KeepGraph, Activations::Recompute] {
            let before = phalanx::ops::buffers::fresh_allocations();
            let (l0, g0) = run(&cfg, act, false, b, t);
            // The composed layer takes no pooled buffer; the fused one does
            // (so this compares the two paths, not one with itself).
            assert_eq!(phalanx::ops::buffers::fresh_allocations(), before);
            let (l1, g1) = run(&cfg, act, true, b, t);
            assert!(phalanx::ops::buffers::fresh_allocations() > 0);
            let what = format!("C {c}, heads {nh}, B {b}, T {t}, {act:?}");
            assert!(
                (l0 - l1).abs() <= 1e-6 * l0.abs(),
                "{what}: loss {l0} vs {l1}"
            );
            let scale = g0.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0);
            let worst = g0
                .iter()
                .zip(&g1)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-6 * scale,
                "{what}: gradients differ by {worst:e} (largest {scale:e})"
            );
        }
    }
}

/// The memory ledger sees what the fused layer keeps: in f32, after a
/// forward, the composed layer's count (block inputs and outputs) plus
/// each layer's buffers: ln_1, qkv, attention output, residual, ln_2
/// (7C), the MLP's hidden and GELU (8C) per token and the probabilities.
#[test]
fn the_ledger_counts_the_fused_layers_buffers() {
    let cfg = Gpt2Config::new(2, 3, 24, 37, 16);
    let (b, t) = (2, 9);
    let kept = |fused| {
        let blocks = gpt2::blocks(&cfg).unwrap();
        common::forward_activation_bytes(blocks, candle_core::DType::F32, fused, (b, t, 37))
    };
    let per_layer = 4 * (b * t * 15 * cfg.n_embd + b * cfg.n_head * t * t);
    let (on, off) = (kept(true), kept(false));
    assert_eq!(on - off, cfg.n_layer * per_layer, "{on} vs {off}");
}
