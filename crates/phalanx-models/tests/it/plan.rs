//! `phalanx::plan` against what training does, ranks as threads: the
//! predicted bytes per step equal rank 0's measured `comm_bytes` within 5%
//! (DDP, ZeRO-1/2/3 on 2 and 3 ranks, tensor parallel with and without
//! recomputation, a pipeline with accumulation), and the predicted model
//! states equal the ledger's within 5%. The selection picks DDP when the
//! model fits, ZeRO-3 when model states do not, adds tensor parallel when
//! one layer does not, a pipeline for depth on slow links, and
//! checkpointing when activations do not fit.

use phalanx::plan::{self, select, Hardware, Layout, ModelShape};
use phalanx_models::gpt2::train::{self, GptRun};
use phalanx_models::gpt2::Gpt2Config;

use crate::common;

fn cfg(extra: &[&str]) -> phalanx::config::TrainConfig {
    let mut sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_head=4",
        "model.n_embd=36",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_interval=0",
        "log.plot=\"\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    phalanx_models::gpt2::config::build(None, &sets).unwrap()
}

/// Rank 0's comm_bytes of its second step and its ledger's model states.
fn measure(world: usize, cfg: &phalanx::config::TrainConfig) -> (u64, usize) {
    let loader = common::loader(cfg.seq_len().unwrap());
    let c = cfg.clone();
    let out = phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&c, pg, loader.clone(), &GptRun::default()).unwrap();
        t.step(0).unwrap();
        let bytes = t.step(1).unwrap().comm_bytes;
        let states = t.memory_report().unwrap()[0].model_states();
        (bytes, states)
    });
    out[0]
}

#[test]
fn predicted_bytes_and_model_states_match_training() {
    let cases: &[(usize, &[&str])] = &[
        (2, &[]),
        (3, &[]),
        (2, &["zero_optimization.stage=1"]),
        (
            3,
            &["zero_optimization.stage=2", "train.grad_accum_steps=2"],
        ),
        (2, &["zero_optimization.stage=3"]),
        (3, &["zero_optimization.stage=3"]),
        (2, &["parallel.tp=2"]),
        (
            2,
            &["parallel.tp=2", "train.activation_checkpointing=\"full\""],
        ),
        (2, &["parallel.pp=2", "train.grad_accum_steps=2"]),
        (
            2,
            &["train.precision=\"bf16\"", "zero_optimization.stage=3"],
        ),
    ];
    for (world, extra) in cases {
        let c = cfg(extra);
        let m = phalanx_models::family::plan_shape(&c).unwrap();
        let l = Layout::from_config(&c, *world).unwrap();
        let predicted = plan::comm::bytes_per_step(&m, &l);
        let (measured, states) = measure(*world, &c);
        let err = (predicted as f64 - measured as f64).abs() / measured as f64;
        assert!(
            err <= 0.05,
            "{world} ranks {extra:?}: predicted {predicted} bytes per step, measured {measured}"
        );
        if l.pp == 1 {
            let p = plan::memory::per_rank(&m, &l).model_states();
            let err = (p as f64 - states as f64).abs() / states as f64;
            assert!(
                err <= 0.05,
                "{world} ranks {extra:?}: model states predicted {p}, ledger {states}"
            );
        }
    }
}

/// The planner's GPT-2 of `n_layer` layers, `n_head` heads, `n_embd` wide,
/// a vocabulary of `vocab`, context `t` (its parameters as its blocks
/// declare them).
fn gpt2(n_layer: usize, n_head: usize, n_embd: usize, vocab: usize, t: usize) -> ModelShape {
    Gpt2Config::new(n_layer, n_head, n_embd, vocab, t)
        .plan_shape(t)
        .unwrap()
}

fn best(m: &ModelShape, hw: &Hardware, base: &Layout) -> Layout {
    let ranked = select::rank(&select::enumerate(m, hw, base), m, hw);
    assert!(ranked[0].fits, "{}", select::explain(m, &ranked, hw));
    ranked[0].layout
}

const GIB: u64 = 1 << 30;

#[test]
fn selection_follows_the_seed_table() {
    // A small model fits: DDP, no checkpointing.
    let small = gpt2(6, 6, 384, 256, 256);
    let hw = Hardware::new(8, 1, 16 * GIB, 100e12, 100e9);
    let b = best(&small, &hw, &Layout::ddp(8, 8, 1));
    assert_eq!(
        (b.dp, b.tp, b.pp, b.zero_stage, b.activation_checkpointing),
        (8, 1, 1, 0, false)
    );

    // 1.5B parameters: 25 GB of fp32 model states do not fit in 6 GiB;
    // sharded 8 ways they do: ZeRO-3 (stages 1-2 keep 4-8 bytes/param
    // whole, 6-12 GB, even with the optimizer state offloaded).
    let big = gpt2(48, 25, 1600, 50257, 1024);
    let base = Layout::ddp(8, 1, 1);
    let hw6 = Hardware::new(8, 1, 6 * GIB, 100e12, 100e9);
    let b = best(&big, &hw6, &base);
    assert_eq!((b.tp, b.pp, b.zero_stage), (1, 1, 3), "{b:?}");
    let ranked = select::rank(&select::enumerate(&big, &hw6, &base), &big, &hw6);
    let why = select::bottleneck(&big, &ranked[0], &hw6);
    assert!(
        matches!(
            why,
            select::Bottleneck::Parameters | select::Bottleneck::OptimizerState
        ),
        "{why}"
    );

    // One layer of an 8192-wide model is 805 M parameters (12.9 GB of
    // model states); gathered whole for its forward (ZeRO-3) it does not
    // fit next to the shards on an 8 GiB rank in any precision: tensor
    // parallel splits it.
    let wide = gpt2(4, 64, 8192, 256, 512);
    let hw_wide = Hardware::new(8, 1, 8 * GIB, 100e12, 100e9);
    let all = select::rank(&select::enumerate(&wide, &hw_wide, &base), &wide, &hw_wide);
    assert!(all
        .iter()
        .filter(|c| c.layout.tp == 1 && c.layout.pp == 1)
        .all(|c| !c.fits));
    let b = best(&wide, &hw_wide, &base);
    assert!(b.tp > 1, "{b:?}");

    // Deep, on slow links between nodes with many micro-batches: the
    // pipeline's point-to-point activations beat ZeRO's gathers.
    let deep = gpt2(96, 16, 1024, 50257, 1024);
    let mut hw_slow = Hardware::new(1, 8, 24 * GIB, 100e12, 1e9);
    hw_slow.inter_bw = 1e8;
    let b = best(&deep, &hw_slow, &Layout::ddp(8, 1, 32));
    assert!(b.pp > 1, "{b:?}");

    // Long sequences and a big micro-batch: activations do not fit, the
    // model states do: checkpointing.
    let long = gpt2(12, 12, 768, 50257, 4096);
    let hw_act = Hardware::new(8, 1, 24 * GIB, 100e12, 100e9);
    let b = best(&long, &hw_act, &Layout::ddp(8, 8, 1));
    assert!(b.activation_checkpointing, "{b:?}");
    let ranked = select::rank(
        &select::enumerate(&long, &hw_act, &Layout::ddp(8, 8, 1)),
        &long,
        &hw_act,
    );
    assert_eq!(
        select::bottleneck(&long, &ranked[0], &hw_act),
        select::Bottleneck::Activations
    );
}

/// On several nodes the tensor-parallel traffic, on the innermost axis,
/// stays inside a node: only the rest is timed at the slow links between
/// nodes.
#[test]
fn tensor_parallel_bytes_are_timed_inside_a_node() {
    let m = gpt2(4, 8, 512, 1024, 256);
    let mut hw = Hardware::new(2, 2, 24 * GIB, 100e12, 1e10);
    hw.inter_bw = 1e8;
    let l = Layout {
        tp: 2,
        ..Layout::ddp(2, 4, 1)
    };
    let (tp, rest) = plan::comm::bytes_per_step_parts(&m, &l);
    assert!(tp > 0 && rest > 0);
    let e = plan::estimate(&m, &l, &hw);
    let want = tp as f64 / 1e10 + rest as f64 / 1e8;
    assert!(
        (e.comm_seconds - want).abs() < 1e-9 * want,
        "{} vs {want}",
        e.comm_seconds
    );
    assert_eq!(e.comm_bytes_per_step, tp + rest);
}
