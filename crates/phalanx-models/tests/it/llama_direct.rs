//! The direct Llama layer (explicit forward and backward over reused
//! buffers, `llama::direct`) against the composed layer run by candle
//! autograd: the same loss and every gradient on odd shapes (grouped-query
//! and multi-head attention, a head size other than C / n_head, Qwen2's
//! q/k/v biases, T = 1 and T past one attention block), through the block
//! stack's three paths: kept graph (the layer as one graph node),
//! recomputation, and kept activations (the engine's direct path, which
//! ZeRO-3 releases and rebinds the parameters around).

use candle_core::{DType, Device};
use phalanx::engine::{Activations, FlatBuffer, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx_models::common::direct::set_fused_layer;
use phalanx_models::llama::{self, config::RopeScaling, LlamaConfig};

use crate::common;
use common::{stack_step, token_ids as ids};

/// (loss, flat gradient) of one forward and backward of the whole stack,
/// with the direct layer on or off.
fn run(cfg: &LlamaConfig, act: Activations, direct: bool, b: usize, t: usize) -> (f32, Vec<f32>) {
    run_in(DType::F32, cfg, act, direct, b, t)
}

/// [`run`] with the blocks computing in `dtype` (mixed precision: f32
/// master parameters and gradients).
fn run_in(
    dtype: DType,
    cfg: &LlamaConfig,
    act: Activations,
    direct: bool,
    b: usize,
    t: usize,
) -> (f32, Vec<f32>) {
    set_fused_layer(Some(direct));
    let ledger = Ledger::new();
    let mut stack = Stack::new(llama::blocks(cfg).unwrap(), &Device::Cpu, act, &ledger).unwrap();
    stack.set_compute_dtype(dtype);
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 11);
    // Larger than init weights (and nonzero biases), so every path carries signal.
    params
        .as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, p)| *p += 0.02 * ((i % 13) as f32 - 6.0));
    let (x, y) = (ids(b, t, cfg.vocab_size, 1), ids(b, t, cfg.vocab_size, 2));
    let mut grads = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let loss = stack_step(&stack, &params, (&x, &y), &mut grads);
    set_fused_layer(None);
    (loss, grads.as_slice().to_vec())
}

#[test]
fn direct_layer_matches_candle_autograd_on_odd_shapes() {
    let blk = phalanx::ops::ATTENTION_BLOCK;
    // (layers, heads, kv heads, C, head size (0: C / heads), M, vocab, B, T, qkv bias)
    let cases = [
        (2, 6, 2, 36, 0, 50, 61, 3, 7, false), // grouped-query, 3 per kv head
        (1, 3, 3, 30, 0, 22, 11, 2, 1, false), // multi-head, T = 1
        (1, 4, 1, 20, 6, 17, 29, 1, 13, true), // one kv head, d != C / heads, biases
        (2, 2, 2, 16, 0, 40, 19, 4, blk + 9, true),
    ];
    for (l, nh, nkv, c, hs, m, v, b, t, bias) in cases {
        let mut cfg = LlamaConfig::new(l, nh, nkv, c, m, v, t.max(16));
        cfg.head_size = hs;
        cfg.qkv_bias = bias;
        if bias {
            cfg.rope_scaling = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8,
            };
        }
        for act in [
            Activations::KeepGraph,
            Activations::Recompute,
            Activations::KeepActivations,
        ] {
            let before = phalanx::ops::buffers::fresh_allocations();
            let (l0, g0) = run(&cfg, act, false, b, t);
            // The composed layer takes no pooled buffer; the direct one
            // does (so this compares the two paths, not one with itself).
            assert_eq!(phalanx::ops::buffers::fresh_allocations(), before);
            let (l1, g1) = run(&cfg, act, true, b, t);
            assert!(phalanx::ops::buffers::fresh_allocations() > 0);
            let what =
                format!("heads {nh}/{nkv}, C {c}, d {hs}, B {b}, T {t}, bias {bias}, {act:?}");
            assert!(
                (l0 - l1).abs() <= 2e-6 * l0.abs(),
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
                worst <= 2e-6 * scale,
                "{what}: gradients differ by {worst:e} (largest {scale:e})"
            );
        }
    }
}

/// ZeRO-3 keeps the direct layers' activations and serves them their
/// parameters gathered again for the backward: only the embedding and the
/// head are recomputed, the run equals DDP's, and holds less.
#[test]
fn zero3_runs_the_direct_llama_layers_once() {
    use phalanx_models::llama::train::{self, LlamaRun};
    let run = |stage: &str| {
        let sets: Vec<String> = [
            "model.arch=llama",
            "model.n_layer=3",
            "model.n_head=4",
            "model.n_kv_head=2",
            "model.n_embd=32",
            "model.intermediate_size=40",
            "model.block_size=15",
            "train.steps=3",
            "train.micro_batch_size=4",
            "train.eval_interval=0",
            "log.plot=\"\"",
            "log.report=\"\"",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("zero_optimization.stage={stage}")])
        .collect();
        let cfg = phalanx_models::arch::build(None, &sets).unwrap();
        let loader = common::loader(cfg.seq_len().unwrap());
        phalanx_comm::threads::run(2, move |pg| {
            let (report, trainer) =
                train::train(&cfg, pg, loader.clone(), &LlamaRun::default()).unwrap();
            let recomputed = trainer.engine().stack().recomputed_blocks();
            let m = trainer.memory_report().unwrap()[0];
            (
                report.losses,
                recomputed,
                m.model_states() + m.activations_peak,
            )
        })
        .remove(0)
    };
    let (ddp, z3) = (run("0"), run("3"));
    assert_eq!(ddp.1, 0, "DDP recomputes nothing");
    // 3 steps: the embedding and the head each step, no layer.
    assert_eq!(z3.1, 3 * 2, "ZeRO-3 recomputed {} blocks", z3.1);
    for (k, (a, b)) in z3.0.iter().zip(&ddp.0).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "step {k}: loss {a} vs {b}");
    }
    assert!(
        z3.2 < ddp.2,
        "ZeRO-3 holds {} B of model states and activations, DDP {} B",
        z3.2,
        ddp.2
    );
}

/// In bf16 and f16 the direct layer widens to f32 at its boundary (f32
/// kernels and accumulation), so it is at least as close to the f32 run
/// as the composed layer computing in the half dtype.
#[test]
fn direct_layer_in_half_precision_is_as_close_to_f32_as_the_composed_one() {
    let mut cfg = LlamaConfig::new(2, 6, 2, 36, 0, 50, 16);
    cfg.intermediate_size = 50;
    cfg.vocab_size = 61;
    cfg.qkv_bias = true;
    let (b, t) = (2, 7);
    let err = |g: &[f32], r: &[f32]| {
        let scale = r.iter().fold(0f32, |m, v| m.max(v.abs()));
        g.iter()
            .zip(r)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / scale
    };
    for act in [Activations::KeepGraph, Activations::KeepActivations] {
        let (l32, g32) = run(&cfg, act, true, b, t);
        for dtype in [DType::BF16, DType::F16] {
            let (lc, gc) = run_in(dtype, &cfg, act, false, b, t);
            let (ld, gd) = run_in(dtype, &cfg, act, true, b, t);
            let (ec, ed) = (err(&gc, &g32), err(&gd, &g32));
            let what = format!("{dtype:?}, {act:?}");
            eprintln!("{what}: gradients from f32: direct {ed:e}, composed {ec:e}");
            // Not the f32 run itself: the blocks' boundaries round.
            assert!(gd != g32, "{what}: the half run equals f32's");
            assert!(ed < 0.05, "{what}: gradients {ed:e} from f32's");
            assert!(
                ed <= 1.5 * ec + 1e-3,
                "{what}: direct {ed:e}, composed {ec:e} from f32"
            );
            let (dc, dd) = ((lc - l32).abs(), (ld - l32).abs());
            assert!(
                dd <= 1.5 * dc + 1e-3 * l32,
                "{what}: loss {ld} / {lc} / f32 {l32}"
            );
        }
    }
}

/// The memory ledger sees what the direct layer keeps: after a forward,
/// its activations are the composed layer's count (block inputs and
/// outputs) plus each layer's own f32 buffers, `N (3C + 4Q + 3M)` and the
/// probabilities `B H T^2`, in every compute dtype.
#[test]
fn the_ledger_counts_the_direct_layers_buffers() {
    // (layers, heads, kv heads, C, MLP, vocab, block).
    let cfg = LlamaConfig::new(2, 6, 2, 36, 50, 61, 16);
    let (b, t) = (2, 9);
    let kept = |dtype, direct| {
        let blocks = llama::blocks(&cfg).unwrap();
        common::forward_activation_bytes(blocks, dtype, direct, (b, t, cfg.vocab_size))
    };
    let (n, c, q, m) = (b * t, cfg.n_embd, cfg.n_embd, cfg.intermediate_size);
    let per_layer = 4 * (n * (3 * c + 4 * q + 3 * m) + b * cfg.n_head * t * t);
    for dtype in [DType::F32, DType::BF16] {
        let (on, off) = (kept(dtype, true), kept(dtype, false));
        assert_eq!(
            on - off,
            cfg.n_layer * per_layer,
            "{dtype:?}: {on} vs {off}"
        );
    }
}
