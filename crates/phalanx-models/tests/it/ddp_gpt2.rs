//! DDP equivalence: GPT-2 trained on N ranks (threads) at the same global
//! batch reproduces 1-rank training, in losses and final parameters.

use crate::common;
use common::*;

fn assert_equivalent(world: usize, accum: usize, bucket_mb: f64, optim: &str) {
    let extra = vec![
        format!("parallel.bucket_mb={bucket_mb}"),
        "parallel.check_params_every=2".into(),
        format!("optim.name={optim}"),
    ];
    let base = run(1, config(1, 1, &extra)).remove(0);
    let out = run(world, config(world, accum, &extra));
    assert_matches(
        &format!("DDP world {world} accum {accum} bucket {bucket_mb} MB {optim}"),
        &out,
        &base,
    );
    // DDP replicas hold the same parameters, bit for bit.
    for o in &out {
        assert_eq!(o.params, out[0].params);
    }
}

#[test]
fn two_ranks_equal_one_rank() {
    assert_equivalent(2, 1, 25.0, "adamw");
}

#[test]
fn three_ranks_with_accumulation_equal_one_rank() {
    assert_equivalent(3, 2, 25.0, "adamw");
}

#[test]
fn two_ranks_with_accumulation_and_tiny_buckets() {
    // 1 KB buckets: one bucket per block, each launched as its block finishes.
    assert_equivalent(2, 2, 0.001, "adamw");
}

#[test]
fn three_ranks_tiny_buckets_sgd() {
    assert_equivalent(3, 1, 0.001, "sgd");
}

#[test]
fn tiny_buckets_cover_the_flat_buffer_in_backward_order() {
    let cfg = config(2, 1, &[]);
    let engine = phalanx_models::gpt2::train::build_engine(&cfg).unwrap();
    let ranges: Vec<_> = engine
        .layout()
        .blocks()
        .iter()
        .map(|b| b.range.clone())
        .collect();
    let buckets = phalanx::strategy::ddp::plan_buckets(&ranges, 1024);
    assert!(buckets.len() >= 3, "{buckets:?}");
    let mut end = engine.num_params();
    for b in &buckets {
        assert_eq!(
            b.range.end, end,
            "buckets must tile the buffer from the end"
        );
        end = b.range.start;
    }
    assert_eq!(end, 0);
    let one = phalanx::strategy::ddp::plan_buckets(&ranges, usize::MAX);
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].range, 0..engine.num_params());
}
