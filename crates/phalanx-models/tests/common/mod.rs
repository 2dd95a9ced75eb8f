//! Shared by the equivalence tests: a small GPT-2, a slice of the corpus,
//! and a runner that trains on N ranks (threads) and returns what each rank
//! ended with.

#![allow(dead_code)]

pub mod llama;

use phalanx::config::TrainConfig;
use phalanx::data::{DataLoader, LoaderConfig, TokenData};
use phalanx::trainer::MemoryReport;
use phalanx_models::gpt2::train::{self, GptRun};
use std::sync::Arc;

/// Global batch of every equivalence run.
pub const G: usize = 24;
pub const STEPS: usize = 6;

pub fn corpus() -> Vec<u32> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/corpus.txt");
    let bytes = std::fs::read(p).unwrap();
    bytes[..60_000].iter().map(|&b| b as u32).collect()
}

/// A 2-layer GPT-2 (35 wide, 5 heads, context 15: 39,865 parameters, a
/// count no world size of 2-4 divides) at global batch G over `dp`
/// data-parallel ranks; `extra` are further `section.key=value` overrides.
pub fn config(dp: usize, accum: usize, extra: &[String]) -> TrainConfig {
    let mut sets: Vec<String> = vec![
        "model.n_layer=2".into(),
        "model.n_head=5".into(),
        "model.n_embd=35".into(),
        "model.block_size=15".into(),
    ];
    sets.extend(run_sets(STEPS, dp, accum));
    sets.extend_from_slice(extra);
    phalanx_models::gpt2::config::build(None, &sets).unwrap()
}

/// The overrides every equivalence run shares: `steps` steps at global
/// batch G over `dp` ranks and `accum` micro-steps, no evaluation, a short
/// warmup, no plot.
pub fn run_sets(steps: usize, dp: usize, accum: usize) -> Vec<String> {
    vec![
        format!("train.steps={steps}"),
        format!("train.micro_batch_size={}", G / dp / accum),
        format!("train.grad_accum_steps={accum}"),
        "train.eval_interval=0".into(),
        "optim.lr=0.01".into(),
        "optim.warmup_steps=2".into(),
        "log.plot=\"\"".into(),
    ]
}

/// A model by parameter name, as f32 values (what `full_named_params` gives).
pub fn named_f32s(
    named: impl IntoIterator<Item = (String, candle_core::Tensor)>,
) -> std::collections::HashMap<String, Vec<f32>> {
    named
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

pub struct RankResult {
    pub losses: Vec<f32>,
    /// The global gradient norm of every step, before clipping.
    pub grad_norms: Vec<f32>,
    /// The full flat parameters at the end (gathered under ZeRO-3).
    pub params: Vec<f32>,
    pub memory: Vec<MemoryReport>,
    /// The whole model by parameter name (gathered from tp / ZeRO-3 shards).
    pub named: std::collections::HashMap<String, Vec<f32>>,
    /// Pipeline runs: the block range of every chunk, as this rank holds it.
    pub chunks: Option<Vec<std::ops::Range<usize>>>,
}

/// Deterministic token ids (B, T) below `vocab`, different per `seed`.
pub fn token_ids(b: usize, t: usize, vocab: usize, seed: u32) -> candle_core::Tensor {
    let v: Vec<u32> = (0..(b * t) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % vocab as u32)
        .collect();
    candle_core::Tensor::from_vec(v, (b, t), &candle_core::Device::Cpu).unwrap()
}

/// One forward and backward of the whole `stack` on (x, y) at loss scale
/// 1, the gradients added into `grads`; returns the loss.
pub fn stack_step(
    stack: &phalanx::engine::Stack,
    params: &phalanx::engine::FlatBuffer,
    (x, y): (&candle_core::Tensor, &candle_core::Tensor),
    grads: &mut phalanx::engine::FlatBuffer,
) -> f32 {
    let (loss, stash) = stack
        .forward(0..stack.num_blocks(), x, Some(y), params)
        .unwrap();
    let one = candle_core::Tensor::new(1f32, &candle_core::Device::Cpu).unwrap();
    stack
        .backward(stash, &one, params, grads, &mut |_, _| Ok(()))
        .unwrap();
    loss.to_scalar::<f32>().unwrap()
}

/// The memory ledger's activation bytes after a forward of a whole stack
/// of `blocks` (keeping graphs) in `dtype` on a (b, t) batch of token ids
/// below `vocab`, with the direct layers on or off; checks that dropping
/// the stash gives them all back.
pub fn forward_activation_bytes(
    blocks: Vec<Box<dyn phalanx::engine::Block>>,
    dtype: candle_core::DType,
    direct: bool,
    (b, t, vocab): (usize, usize, usize),
) -> usize {
    use phalanx::ledger::{Ledger, Mem};
    phalanx_models::common::direct::set_fused_layer(Some(direct));
    let ledger = Ledger::new();
    let act = phalanx::engine::Activations::KeepGraph;
    let dev = candle_core::Device::Cpu;
    let mut stack = phalanx::engine::Stack::new(blocks, &dev, act, &ledger).unwrap();
    stack.set_compute_dtype(dtype);
    let mut params = phalanx::engine::FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 3);
    let (x, y) = (token_ids(b, t, vocab, 1), token_ids(b, t, vocab, 2));
    let (_, stash) = stack
        .forward(0..stack.num_blocks(), &x, Some(&y), &params)
        .unwrap();
    let bytes = ledger.current(Mem::Activations);
    drop(stash);
    assert_eq!(ledger.current(Mem::Activations), 0);
    phalanx_models::common::direct::set_fused_layer(None);
    bytes
}

/// The equivalence tests' data: 60 KB of the corpus as byte tokens, in
/// samples of `seq_len`.
pub fn loader(seq_len: usize) -> Arc<DataLoader> {
    let lc = LoaderConfig {
        seq_len,
        val_fraction: 0.0,
        shuffle: true,
        seed: 7,
        vocab_size: Some(256),
    };
    Arc::new(DataLoader::new(TokenData::from_tokens(corpus()), lc).unwrap())
}

/// Train `cfg` on `world` ranks as threads.
pub fn run(world: usize, cfg: TrainConfig) -> Vec<RankResult> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let (report, mut trainer) =
            train::train(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        let named = named_f32s(train::full_named_params(&mut trainer, &cfg).unwrap());
        let chunks = trainer.strategy().pipeline().map(|p| p.chunks().to_vec());
        RankResult {
            losses: report.losses,
            grad_norms: report.grad_norms,
            params: trainer.full_params().unwrap(),
            memory: trainer.memory_report().unwrap().to_vec(),
            named,
            chunks,
        }
    })
}

/// Norm-relative difference ||a - b|| / ||b||.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n).sqrt()
}

/// Every step's gradient norm within `tol` relative of the 1-rank run's
/// (AdamW normalises a gradient off by a constant factor away, and
/// clipping hides it: the norm does not).
pub fn assert_grad_norms(what: &str, r: usize, o: &RankResult, base: &RankResult, tol: f32) {
    assert_eq!(
        o.grad_norms.len(),
        base.grad_norms.len(),
        "{what}: rank {r}"
    );
    for (k, (a, b)) in o.grad_norms.iter().zip(&base.grad_norms).enumerate() {
        assert!(
            ((a - b) / b).abs() < tol,
            "{what}: rank {r} step {k} gradient norm {a} vs {b}"
        );
    }
}

/// Every rank of `out` matches the 1-rank `base`: losses within 1e-5
/// relative, gradient norms within 1e-4, parameters within 1e-5
/// norm-relative.
pub fn assert_matches(what: &str, out: &[RankResult], base: &RankResult) {
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.losses.len(), STEPS, "{what}");
        assert_grad_norms(what, r, o, base, 1e-4);
        for (k, (a, b)) in o.losses.iter().zip(&base.losses).enumerate() {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{what}: rank {r} step {k} loss {a} vs {b}"
            );
        }
        let e = rel(&o.params, &base.params);
        assert!(e < 1e-5, "{what}: rank {r} parameters differ by {e:e}");
    }
    assert!(
        base.losses[STEPS - 1] < base.losses[0],
        "training should lower the loss"
    );
}

/// As `assert_matches`, for runs whose ranks hold different shards: the
/// whole model (gathered, by name) within `tol` norm-relative, and every
/// parameter within 1e-3 (AdamW turns rounding noise in gradients that are
/// zero in exact arithmetic, such as the attention key bias's, into
/// lr-sized steps, so single small parameters are compared loosely; the
/// SGD gradient test compares every parameter tightly).
pub fn assert_named_match(what: &str, out: &[RankResult], base: &RankResult, tol: f64) {
    let mut names: Vec<&String> = base.named.keys().collect();
    names.sort();
    let flat = |m: &std::collections::HashMap<String, Vec<f32>>| -> Vec<f32> {
        names.iter().flat_map(|n| m[*n].iter().copied()).collect()
    };
    let want = flat(&base.named);
    assert!(
        !base.losses.is_empty(),
        "{what}: the 1-rank run has no losses"
    );
    for (r, o) in out.iter().enumerate() {
        assert_eq!(
            o.losses.len(),
            base.losses.len(),
            "{what}: rank {r} ran {} steps, the 1-rank run {}",
            o.losses.len(),
            base.losses.len()
        );
        for (k, (a, b)) in o.losses.iter().zip(&base.losses).enumerate() {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{what}: rank {r} step {k} loss {a} vs {b}"
            );
        }
        assert_grad_norms(what, r, o, base, 1e-4);
        assert_eq!(o.named.len(), base.named.len(), "{what}");
        for name in &names {
            let e = rel(&o.named[*name], &base.named[*name]);
            assert!(
                e < 1e-3f64.max(tol),
                "{what}: rank {r} `{name}` differs by {e:e}"
            );
        }
        let e = rel(&flat(&o.named), &want);
        assert!(e < tol, "{what}: rank {r}: the model differs by {e:e}");
    }
}

/// The overrides of a plain-SGD run: no momentum, no weight decay, no
/// clipping, constant learning rate, so every parameter moves by exactly
/// lr x its gradient and a gradient off by any factor shows in the
/// parameters as well as in the norm.
pub fn plain_sgd() -> Vec<String> {
    [
        "optim.name=\"sgd\"",
        "optim.momentum=0.0",
        "optim.weight_decay=0.0",
        "optim.grad_clip=0.0",
        "optim.lr=0.5",
        "optim.warmup_steps=0",
        "optim.schedule=\"constant\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}
