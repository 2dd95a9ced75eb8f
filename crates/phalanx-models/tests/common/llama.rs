//! The Llama equivalence runs' model and runner (`llama_parallel.rs`,
//! `device_generic.rs`).

use super::{loader, named_f32s, run_sets, RankResult};
use phalanx::config::TrainConfig;
use phalanx_models::arch;
use phalanx_models::llama::train::{self, LlamaRun};

pub const STEPS: usize = 5;

/// A 2-layer Llama (4 heads over 2 kv heads, 32 wide, MLP 40, context 15,
/// byte vocabulary: 25,920 parameters + 2 norms) at global batch G.
pub fn config(dp: usize, accum: usize, extra: &[&str]) -> TrainConfig {
    let mut sets: Vec<String> = vec![
        "model.arch=llama".into(),
        "model.n_layer=2".into(),
        "model.n_head=4".into(),
        "model.n_kv_head=2".into(),
        "model.n_embd=32".into(),
        "model.intermediate_size=40".into(),
        "model.block_size=15".into(),
        "log.report=\"\"".into(),
    ];
    sets.extend(run_sets(STEPS, dp, accum));
    sets.extend(extra.iter().map(|s| s.to_string()));
    arch::build(None, &sets).unwrap()
}

pub fn run(world: usize, cfg: TrainConfig, run: LlamaRun) -> Vec<RankResult> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let (report, mut trainer) = train::train(&cfg, pg, loader.clone(), &run).unwrap();
        let named = named_f32s(train::full_named_params(&mut trainer, &cfg).unwrap());
        RankResult {
            losses: report.losses,
            grad_norms: report.grad_norms,
            params: Vec::new(),
            memory: Vec::new(),
            named,
            chunks: None,
        }
    })
}

pub fn base() -> RankResult {
    run(1, config(1, 1, &[]), LlamaRun::default()).remove(0)
}
