//! Tensor parallel equivalence: GPT-2 split over tp = 2, 3, 4 ranks (and
//! composed with data parallelism) reproduces 1-rank training, in losses,
//! gradients and parameters.

mod common;
use common::*;

/// A TP-friendly shape: 6 heads (divisible by 2 and 3), 4 heads for tp 4.
fn shape(heads: usize) -> Vec<String> {
    vec![
        format!("model.n_head={heads}"),
        format!("model.n_embd={}", heads * 6),
    ]
}

fn with(mut a: Vec<String>, b: &[&str]) -> Vec<String> {
    a.extend(b.iter().map(|s| s.to_string()));
    a
}

/// `world` ranks with the tp size given in `extra`; the data-parallel size
/// (which sets the micro-batch at the fixed global batch) is world / tp.
fn check(what: &str, heads: usize, world: usize, accum: usize, extra: &[&str]) {
    let tp: usize = extra
        .iter()
        .find_map(|e| e.strip_prefix("parallel.tp="))
        .map_or(1, |v| v.parse().unwrap());
    // The base run shares the model's context length.
    let ctx: Vec<&str> = extra
        .iter()
        .copied()
        .filter(|e| e.starts_with("model.block_size"))
        .collect();
    let base = run(1, config(1, 1, &with(shape(heads), &ctx))).remove(0);
    let out = run(world, config(world / tp, accum, &with(shape(heads), extra)));
    assert_named_match(what, &out, &base, 1e-5);
}

#[test]
fn tp2_and_tp4_reproduce_one_rank() {
    check("tp 2", 6, 2, 1, &["parallel.tp=2"]);
    check("tp 4", 4, 4, 2, &["parallel.tp=4"]);
}

#[test]
fn vocabulary_not_divisible_by_tp_is_padded_and_masked() {
    // 256 byte tokens over 3 ranks: padded to 258, the pad never counts.
    check("tp 3", 6, 3, 1, &["parallel.tp=3"]);
}

#[test]
fn gradients_match_one_rank() {
    // One plain SGD step with lr 1: the parameter change is minus the
    // gradient, so equal parameters mean equal gradients.
    let sgd = [
        "optim.name=sgd",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "optim.lr=1",
        "optim.schedule=constant",
        "optim.grad_clip=0",
        "train.steps=1",
        "optim.warmup_steps=0",
    ];
    let base = run(1, config(1, 1, &with(shape(6), &sgd))).remove(0);
    let out = run(
        2,
        config(
            1,
            1,
            &with(shape(6), &[&sgd[..], &["parallel.tp=2"]].concat()),
        ),
    );
    assert_named_match("tp 2 gradient", &out, &base, 1e-5);
}

#[test]
fn sequence_parallel_reproduces_one_rank() {
    check(
        "tp 2 + sequence parallel",
        6,
        2,
        1,
        &[
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "model.block_size=16",
        ],
    );
}

#[test]
fn tp_times_dp_with_ddp_and_zero2() {
    check("tp 2 x dp 2 (DDP)", 6, 4, 1, &["parallel.tp=2"]);
    check(
        "tp 2 x dp 2 (ZeRO-2)",
        6,
        4,
        1,
        &["parallel.tp=2", "zero_optimization.stage=2"],
    );
    check(
        "tp 2 x dp 2 (ZeRO-3)",
        6,
        4,
        1,
        &["parallel.tp=2", "zero_optimization.stage=3"],
    );
    check(
        "tp 2 x dp 2 (ZeRO-1 + SP)",
        6,
        4,
        1,
        &[
            "parallel.tp=2",
            "zero_optimization.stage=1",
            "parallel.sequence_parallel=true",
            "model.block_size=16",
        ],
    );
}

#[test]
fn n_head_not_divisible_by_tp_is_a_clear_error() {
    let cfg = config(1, 1, &with(shape(6), &["parallel.tp=4"]));
    let out = phalanx_comm::threads::run(4, move |pg| {
        let loader = loader(15);
        phalanx_models::gpt2::train::train(&cfg, pg, loader, &Default::default())
            .err()
            .map(|e| e.to_string())
    });
    for e in out {
        let e = e.expect("must fail");
        assert!(
            e.contains("n_head (6) is not divisible by the tensor-parallel size 4"),
            "{e}"
        );
    }
}
