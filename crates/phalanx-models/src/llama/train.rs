//! Training a Llama from a `TrainConfig` (`model.arch = "llama"`): the path
//! `phalanx train` takes, and the one the tests drive with ranks as threads.
//!
//! Data parallel (DDP), ZeRO-1/2/3, FSDP and pipeline parallel come from
//! the generic strategies (`phalanx::trainer::Trainer::with_mesh`): they see
//! blocks and flat buffers only, so no Llama-specific code is needed.
//! Tensor parallel needs the model's own blocks and shard rules
//! ([`super::tp`]); the trainer then takes them like GPT-2's.
//!
//! ```no_run
//! use phalanx_models::{arch, llama::train::{self, LlamaRun}};
//! let cfg = arch::build(None, &["model.arch=llama".into(), "train.steps=10".into()]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let loader = std::sync::Arc::new(train::open_data(&cfg).unwrap());
//! let (report, _trainer) = train::train(&cfg, pg, loader, &LlamaRun::default()).unwrap();
//! println!("final loss {}", report.losses.last().unwrap());
//! ```

use super::config::{LlamaConfig, LlamaSection};
use super::hf;
use candle_core::Device;
use phalanx::config::TrainConfig;
use phalanx::data::DataLoader;
use phalanx::engine::Engine;
use phalanx::mesh::DeviceMesh;
use phalanx::tp::Tp;
use phalanx::trainer::{Report, RunOptions, Trainer};
use phalanx::{Error, Result};
use phalanx_comm::ProcessGroup;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct LlamaRun {
    /// Start from HF Llama weights: `model.safetensors`, an index, or a
    /// directory holding either (with `config.json`, checked).
    pub init_from: Option<PathBuf>,
    /// Save the trained model in HF layout: a directory, or a
    /// `.safetensors` file with `config.json` beside it.
    pub save_final: Option<PathBuf>,
    pub run: RunOptions,
}

/// The model of a config built with [`crate::arch::build`].
pub fn model_config(cfg: &TrainConfig) -> Result<LlamaConfig> {
    Ok(LlamaSection::of(cfg)?.model())
}

/// A Llama engine for the config, initialised with `train.seed`.
pub fn build_engine(cfg: &TrainConfig) -> Result<Engine> {
    let m = model_config(cfg)?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    Ok(super::engine(&m, &Device::Cpu, ecfg)?)
}

/// The data loader the config describes (tokens checked against the vocabulary).
pub fn open_data(cfg: &TrainConfig) -> Result<DataLoader> {
    let m = model_config(cfg)?;
    crate::gpt2::train::open_data_for(cfg, m.block_size, m.vocab_size)
}

/// The trainer for `cfg` on `pg` (data parallel, pipeline, and tensor
/// parallel when `parallel.tp` > 1), with `--init-from` loaded; not yet run.
pub fn trainer(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &LlamaRun,
) -> Result<Trainer> {
    let m = model_config(cfg)?;
    let dp = cfg.dp_for_world(pg.size())?;
    let mesh = DeviceMesh::new(&pg, dp, cfg.parallel.pp, cfg.parallel.tp)?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    let init_err = |p: &Path, e: candle_core::Error| {
        Error::Check(format!("--init-from {}: {}", p.display(), Error::from(e)))
    };
    let tp = tp_of(cfg, &mesh);
    let (engine, replicated) = match &tp {
        None => {
            let mut engine = build_engine(cfg)?;
            // A pipeline stage reads its own tensors once it knows them
            // (below); other layouts read the whole checkpoint now.
            if let (Some(p), 1) = (&run.init_from, cfg.parallel.pp) {
                hf::load(&mut engine, &m, p).map_err(|e| init_err(p, e))?;
            }
            (engine, Vec::new())
        }
        Some(t) => {
            if cfg.parallel.sequence_parallel && !m.block_size.is_multiple_of(t.size()) {
                return Err(Error::Check(format!(
                    "sequence parallel: model.block_size {} is not divisible by parallel.tp {}",
                    m.block_size,
                    t.size()
                )));
            }
            let mut engine = match &run.init_from {
                Some(p) => super::tp::load_engine(&m, t, ecfg, p).map_err(|e| init_err(p, e))?,
                None => super::tp::init_engine(&m, t, ecfg)?,
            };
            // The slices copied in are the initial values (a pipeline stage
            // must not overwrite them with a fresh initialisation).
            engine.init_params(Some(&[]));
            let rep = super::tp::replicated_ranges(&engine, &m, t.size());
            (engine, rep)
        }
    };
    let seq = loader.seq_len();
    let mut trainer = Trainer::with_mesh(cfg, engine, loader, &mesh, replicated)?;
    // Model FLOPs per token (6 x matrices + attention), for MFU.
    trainer.set_flops_per_token(phalanx::plan::model_flops_per_token(&m.plan_shape(seq)));
    if let Some(t) = &tp {
        trainer.set_placement(Arc::new(super::tp::TpPlacement {
            cfg: m,
            rank: t.rank(),
            size: t.size(),
        }));
    }
    if let (Some(p), None, true) = (&run.init_from, &tp, cfg.parallel.pp > 1) {
        hf::load(trainer.engine_mut(), &m, p).map_err(|e| init_err(p, e))?;
    }
    Ok(trainer)
}

fn tp_of(cfg: &TrainConfig, mesh: &DeviceMesh) -> Option<Tp> {
    (cfg.parallel.tp > 1).then(|| Tp::new(mesh.tp().clone(), cfg.parallel.sequence_parallel))
}

/// Build, optionally load, train on `pg`, optionally save (rank 0 writes).
pub fn train(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &LlamaRun,
) -> Result<(Report, Trainer)> {
    let mut trainer = self::trainer(cfg, pg, loader, run)?;
    let report = trainer.run(&run.run)?;
    if let Some(p) = &run.save_final {
        let named = full_named_params(&mut trainer, cfg)?;
        if trainer.group().global_rank() == 0 {
            save(&named, cfg, p)?;
        }
    }
    Ok((report, trainer))
}

/// The whole model's parameters by name on every rank (gathered from
/// tensor-parallel and ZeRO-3 shards and pipeline stages; collective).
pub fn full_named_params(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
) -> Result<HashMap<String, candle_core::Tensor>> {
    trainer.materialize_params()?;
    if let Some(t) = tp_of(cfg, trainer.mesh()) {
        return super::tp::gather_full(trainer.engine(), &model_config(cfg)?, &t);
    }
    Ok(hf::export_tensors(trainer.engine())?)
}

/// Write the model in HF layout (see [`hf::save`]) with `config.json`.
pub fn save(
    tensors: &HashMap<String, candle_core::Tensor>,
    cfg: &TrainConfig,
    path: &Path,
) -> Result<()> {
    let m = model_config(cfg)?;
    let files = hf::save(
        tensors,
        &m,
        &cfg.data.tokenizer.to_string(),
        path,
        hf::DEFAULT_SHARD_BYTES,
    )?;
    // A data.tokenizer's tokenizer.json goes beside the weights.
    match files.first().and_then(|f| f.parent()) {
        Some(dir) => crate::hf_tokenizer::save_beside(&cfg.data.tokenizer, dir),
        None => Ok(()),
    }
}
