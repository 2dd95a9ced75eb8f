//! Activation checkpointing (`train.activation_checkpointing = none | full
//! | k`): recomputing blocks in backward reproduces the run without it under
//! DDP, ZeRO-3, tensor and pipeline parallel, and lowers the measured
//! activation peak.

use crate::common;
use common::*;

/// 6 heads of 6: divisible by tp 2. Three layers, so k = 2 recomputes
/// blocks 0 and 2 (the embedding and the second layer) and keeps the rest.
fn shape(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "model.n_head=6".into(),
        "model.n_embd=36".into(),
        "model.n_layer=3".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn check(what: &str, dp: usize, pp: usize, tp: usize, accum: usize, extra: &[&str]) {
    let base = run(1, config(1, 1, &shape(&[]))).remove(0);
    for policy in ["full", "2"] {
        let mut e = shape(extra);
        e.push(format!("parallel.pp={pp}"));
        e.push(format!("parallel.tp={tp}"));
        e.push(format!("train.activation_checkpointing={policy}"));
        let out = run(dp * pp * tp, config(dp, accum, &e));
        assert_named_match(
            &format!("{what}, checkpointing {policy}"),
            &out,
            &base,
            1e-5,
        );
    }
}

#[test]
fn ddp_and_zero3_reproduce_the_run_without_checkpointing() {
    check("DDP 2", 2, 1, 1, 1, &[]);
    check("ZeRO-3 2", 2, 1, 1, 1, &["zero_optimization.stage=3"]);
}

#[test]
fn tensor_and_pipeline_parallel_reproduce_the_run_without_checkpointing() {
    check("tp 2", 1, 1, 2, 1, &[]);
    check("pp 2, 1f1b", 1, 2, 1, 2, &[]);
}

#[test]
fn checkpointing_lowers_the_activation_peak() {
    let peak = |policy: &str| {
        let e = shape(&[&format!("train.activation_checkpointing={policy}")]);
        run(1, config(1, 1, &e)).remove(0).memory[0].activations_peak
    };
    let (none, every2, full) = (peak("none"), peak("2"), peak("full"));
    assert!(
        full < every2 && every2 < none,
        "activation peak: none {none} B, every 2nd block {every2} B, full {full} B"
    );
}

/// DeepSpeed's `partition_activations`: each tp rank keeps 1/tp of a
/// checkpointed block input and all-gathers it before recomputing.
#[test]
fn partitioned_checkpoints_reproduce_the_run_and_hold_less() {
    let base = run(1, config(1, 1, &shape(&[]))).remove(0);
    let tp2 = |extra: &[&str]| {
        let mut e = shape(extra);
        e.push("parallel.tp=2".into());
        e.push("train.activation_checkpointing=full".into());
        run(2, config(1, 1, &e))
    };
    let plain = tp2(&[]);
    let parted = tp2(&["activation_checkpointing.partition_activations=true"]);
    assert_named_match("tp 2, partitioned checkpoints", &parted, &base, 1e-5);
    let (a, b) = (
        plain[0].memory[0].activations_peak,
        parted[0].memory[0].activations_peak,
    );
    assert!(
        b < a,
        "activation peak: whole inputs {a} B, partitioned {b} B"
    );
    // Under sequence parallelism each rank's input is its own part of the
    // sequence: nothing to split, and the run is still the 1-rank run.
    // (T = 16: sequence parallelism splits T over tp.)
    let base16 = run(1, config(1, 1, &shape(&["model.block_size=16"]))).remove(0);
    let sp = tp2(&[
        "model.block_size=16",
        "parallel.sequence_parallel=true",
        "activation_checkpointing.partition_activations=true",
    ]);
    assert_named_match("tp 2, sequence parallel, partitioned", &sp, &base16, 1e-5);
}

#[test]
fn checkpointing_with_plain_sgd_matches_gradient_norms() {
    // Plain SGD: a recomputed block whose gradient came out scaled would
    // move its parameters and the step's gradient norm.
    let sgd = plain_sgd();
    let s: Vec<&str> = sgd.iter().map(|x| x.as_str()).collect();
    let base = run(1, config(1, 1, &shape(&s))).remove(0);
    for (dp, pp, tp, extra) in [
        (2, 1, 1, "zero_optimization.stage=3"),
        (1, 2, 2, "train.seed=0"),
    ] {
        let mut e = shape(&s);
        e.push(extra.into());
        e.push(format!("parallel.pp={pp}"));
        e.push(format!("parallel.tp={tp}"));
        e.push("train.activation_checkpointing=full".into());
        let out = run(dp * pp * tp, config(dp, 2, &e));
        assert_named_match(
            &format!("SGD dp {dp} pp {pp} tp {tp}, full checkpointing"),
            &out,
            &base,
            1e-5,
        );
    }
}
