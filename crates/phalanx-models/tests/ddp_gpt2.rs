//! DDP equivalence: GPT-2 trained on N ranks (threads) at the same global
//! batch reproduces 1-rank training, in losses and final parameters.

use phalanx::config::TrainConfig;
use phalanx::data::{DataLoader, LoaderConfig, TokenData};
use phalanx_models::gpt2::train::{self, GptRun};
use std::sync::Arc;

const G: usize = 12;

fn corpus() -> Vec<u32> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/corpus.txt");
    let bytes = std::fs::read(p).unwrap();
    bytes[..60_000].iter().map(|&b| b as u32).collect()
}

fn config(world: usize, accum: usize, bucket_mb: f64, optim: &str) -> TrainConfig {
    let sets: Vec<String> = [
        "model.n_layer=2".to_string(),
        "model.n_head=2".into(),
        "model.n_embd=32".into(),
        "model.block_size=16".into(),
        "train.steps=6".into(),
        format!("train.micro_batch_size={}", G / world / accum),
        format!("train.grad_accum_steps={accum}"),
        "train.eval_interval=0".into(),
        format!("parallel.bucket_mb={bucket_mb}"),
        "parallel.check_params_every=2".into(),
        format!("optim.name=\"{optim}\""),
        "optim.lr=0.01".into(),
        "optim.warmup_steps=2".into(),
        "log.plot=\"\"".into(),
    ]
    .to_vec();
    TrainConfig::build(None, &sets).unwrap()
}

/// Train on `world` ranks; returns (losses, final params) of every rank.
fn run(world: usize, accum: usize, bucket_mb: f64, optim: &str) -> Vec<(Vec<f32>, Vec<f32>)> {
    let cfg = config(world, accum, bucket_mb, optim);
    let lc = LoaderConfig {
        seq_len: 16,
        val_fraction: 0.0,
        shuffle: true,
        seed: 7,
        vocab_size: Some(256),
    };
    let loader = Arc::new(DataLoader::new(TokenData::from_tokens(corpus()), lc).unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let (report, trainer) = train::train(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        (report.losses, trainer.engine().params_flat().to_vec())
    })
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n).sqrt()
}

fn assert_equivalent(world: usize, accum: usize, bucket_mb: f64, optim: &str) {
    let base = run(1, 1, 25.0, optim).remove(0);
    let out = run(world, accum, bucket_mb, optim);
    for (r, (losses, params)) in out.iter().enumerate() {
        assert_eq!(losses.len(), 6);
        for (k, (a, b)) in losses.iter().zip(&base.0).enumerate() {
            let e = ((a - b) / b).abs();
            assert!(
                e < 1e-5,
                "world {world} accum {accum} bucket {bucket_mb}: rank {r} step {k} loss {a} vs {b}"
            );
        }
        let e = rel(params, &base.1);
        assert!(
            e < 1e-5,
            "world {world} accum {accum} bucket {bucket_mb} {optim}: rank {r} params rel err {e:e}"
        );
        // All ranks hold the same parameters, bit for bit.
        assert_eq!(params, &out[0].1);
    }
    // And training did something.
    assert!(base.0[5] < base.0[0]);
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
    let cfg = config(2, 1, 0.001, "adamw");
    let engine = train::build_engine(&cfg).unwrap();
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
