//! Compositions on the device mesh through the trainer (the path `phalanx
//! train` takes): pipeline x data, pipeline x tensor, and 3-D data x
//! pipeline x tensor, each reproducing 1-rank training.

mod common;
use common::*;

/// 6 heads of 6: divisible by tp 2.
fn shape() -> Vec<String> {
    vec!["model.n_head=6".into(), "model.n_embd=36".into()]
}

fn check(what: &str, dp: usize, pp: usize, tp: usize, accum: usize, extra: &[&str]) {
    let base = run(1, config(1, 1, &shape())).remove(0);
    let mut e = shape();
    e.push(format!("parallel.pp={pp}"));
    e.push(format!("parallel.tp={tp}"));
    e.extend(extra.iter().map(|s| s.to_string()));
    let out = run(dp * pp * tp, config(dp, accum, &e));
    assert_named_match(what, &out, &base, 1e-5);
}

#[test]
fn pipeline_times_data_with_ddp_and_zero1() {
    check("pp 2 x dp 2, 1f1b", 2, 2, 1, 3, &[]);
    check(
        "pp 2 x dp 2, gpipe + ZeRO-1",
        2,
        2,
        1,
        2,
        &["parallel.pp_schedule=gpipe", "zero_optimization.stage=1"],
    );
}

#[test]
fn pipeline_times_tensor() {
    check(
        "pp 2 x tp 2, zb-h1",
        1,
        2,
        2,
        4,
        &["parallel.pp_schedule=zb-h1"],
    );
}

#[test]
fn three_d_2x2x2_on_8_ranks() {
    check(
        "dp 2 x pp 2 x tp 2, 1f1b + ZeRO-1",
        2,
        2,
        2,
        2,
        &["zero_optimization.stage=1"],
    );
}

#[test]
fn pipeline_with_zero2_is_refused_clearly() {
    let e = phalanx_models::gpt2::config::build(
        None,
        &["parallel.pp=2".into(), "zero_optimization.stage=2".into()],
    );
    assert!(e
        .unwrap_err()
        .to_string()
        .contains("pipeline parallel composes with DDP and ZeRO-1"));
}

#[test]
fn time_balanced_partition_trains_the_same() {
    check(
        "pp 2, partition by measured time",
        1,
        2,
        1,
        2,
        &["parallel.pp_partition=time"],
    );
    check(
        "pp 2, partition by hand",
        1,
        2,
        1,
        2,
        &["parallel.pp_partition=1,3"],
    );
}
