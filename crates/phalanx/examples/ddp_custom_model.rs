//! Training your own candle model with Phalanx DDP.
//!
//! The model is written with plain candle-nn layers, cut into blocks (the
//! unit the engine runs forward and backward, and that DDP buckets):
//! an embedding, a residual MLP, and a loss head. Nothing GPT-specific.
//!
//! Run it on 2 local ranks:
//! ```sh
//! cargo build --release --example ddp_custom_model -p phalanx
//! cargo run --release -- run --nproc-per-node 2 -- target/release/examples/ddp_custom_model
//! ```
//! Started by hand (no launcher), it runs 2 ranks as threads.

use candle_core::{Module, Result, Tensor};
use candle_nn::{embedding, linear, VarBuilder};
use phalanx::config::TrainConfig;
use phalanx::data::{DataLoader, LoaderConfig, Tokenizer};
use phalanx::engine::{Block, BlockModule, Ctx, CtxBlock, Engine, EngineConfig, FnBlock};
use phalanx::trainer::{RunOptions, Trainer};
use std::sync::Arc;

const VOCAB: usize = 256;
const WIDTH: usize = 64;
pub const CONTEXT: usize = 32;

/// A residual MLP on every position: x + W2 relu(W1 x).
struct Mlp {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // (B, T, C) -> (B, T, 4C) -> (B, T, C)
        x + self.fc2.forward(&self.fc1.forward(x)?.relu()?)?
    }
}

/// Logits over the vocabulary and the mean cross-entropy against the targets.
struct Head {
    out: candle_nn::Linear,
}

impl BlockModule for Head {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let logits = self.out.forward(x)?; // (B, T, V)
        match ctx.targets {
            None => Ok(logits),
            Some(t) => {
                let (b, tt, v) = logits.dims3()?;
                candle_nn::loss::cross_entropy(&logits.reshape((b * tt, v))?, &t.flatten_all()?)
            }
        }
    }
}

/// The model as blocks, each built from a candle-nn `VarBuilder`.
pub fn blocks() -> Vec<Box<dyn Block>> {
    vec![
        Box::new(FnBlock::new(|vb: VarBuilder| {
            embedding(VOCAB, WIDTH, vb.pp("tok"))
        })),
        Box::new(FnBlock::new(|vb: VarBuilder| {
            Ok(Mlp {
                fc1: linear(WIDTH, 4 * WIDTH, vb.pp("fc1"))?,
                fc2: linear(4 * WIDTH, WIDTH, vb.pp("fc2"))?,
            })
        })),
        Box::new(CtxBlock::new(|vb: VarBuilder| {
            Ok(Head {
                out: linear(WIDTH, VOCAB, vb.pp("out"))?,
            })
        })),
    ]
}

/// The training settings, in `phalanx train`'s config language.
pub fn config(steps: usize, micro_batch: usize, grad_accum: usize) -> TrainConfig {
    let sets = [
        format!("train.steps={steps}"),
        format!("train.micro_batch_size={micro_batch}"),
        format!("train.grad_accum_steps={grad_accum}"),
        "train.eval_interval=50".into(),
        "optim.lr=0.003".into(),
        "log.plot=\"\"".into(),
    ];
    TrainConfig::build(None, &sets).expect("valid config")
}

/// This rank's trainer: the model of [`blocks`] on the shipped corpus.
pub fn trainer(pg: phalanx_comm::ProcessGroup, cfg: &TrainConfig) -> phalanx::Result<Trainer> {
    let lc = LoaderConfig {
        seq_len: CONTEXT,
        val_fraction: 0.02,
        shuffle: true,
        seed: 1,
        vocab_size: Some(VOCAB),
    };
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/corpus.txt");
    let loader = Arc::new(DataLoader::open(path, Tokenizer::Byte, lc)?);
    let engine = Engine::new(blocks(), &candle_core::Device::Cpu, EngineConfig::default())?;
    Trainer::new(cfg, engine, loader, pg)
}

/// Train on this rank's slice; returns the step losses and final parameters.
pub fn train_rank(
    pg: phalanx_comm::ProcessGroup,
    cfg: &TrainConfig,
    quiet: bool,
) -> phalanx::Result<(Vec<f32>, Vec<f32>)> {
    let mut trainer = trainer(pg, cfg)?;
    let opts = RunOptions {
        progress: !quiet,
        log_interval: 25,
        ..Default::default()
    };
    let losses = trainer.run(&opts)?.losses;
    Ok((losses, trainer.engine().params_flat().to_vec()))
}

#[allow(dead_code)]
fn main() {
    // 200 steps of 16 sequences per rank.
    let cfg = config(200, 16, 1);
    if std::env::var_os("RANK").is_some() {
        let pg = phalanx_comm::init_process_group().expect("process group");
        train_rank(pg, &cfg, false).expect("training");
    } else {
        phalanx_comm::threads::run(2, move |pg| train_rank(pg, &cfg, false).expect("training"));
    }
}
