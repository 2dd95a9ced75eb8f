//! Training any family from a `TrainConfig`: the path `phalanx train`
//! takes, and the one the equivalence tests drive with ranks as threads.
//!
//! Data parallel (DDP), ZeRO-1/2/3, FSDP and pipeline parallel come from
//! the generic strategies (`phalanx::trainer::Trainer::with_mesh`): they see
//! blocks and flat buffers only. Tensor parallel takes the family's own
//! blocks ([`crate::family::ModelFamily::tp_blocks`]), whose parameters
//! carry their declared placements; the HF weights in and out are
//! the family's too. Nothing here names a family.
//!
//! ```no_run
//! use phalanx_models::{family, train::{self, Run}};
//! let cfg = family::build(None, &["model.arch=llama".into(), "train.steps=10".into()]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let loader = std::sync::Arc::new(train::open_data(&cfg).unwrap());
//! let (report, _trainer) = train::train(&cfg, pg, loader, &Run::default()).unwrap();
//! println!("final loss {}", report.losses.last().unwrap());
//! ```

use crate::common::tp::{self as ctp, TpPlacement};
use crate::family;
use candle_core::Tensor;
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

/// What a run reads and writes besides its config.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// Start from Hugging Face weights: a `model.safetensors`, an index
    /// (for families that read shards), or a directory holding either.
    pub init_from: Option<PathBuf>,
    /// Save the trained model in HF layout, with `config.json` beside it
    /// (GPT-2: the safetensors file; Llama and Qwen2: a directory, or a
    /// `.safetensors` file).
    pub save_final: Option<PathBuf>,
    pub run: RunOptions,
}

/// A one-rank engine of the config's family, initialised with `train.seed`.
pub fn build_engine(cfg: &TrainConfig) -> Result<Engine> {
    let blocks = family::of(cfg)?.blocks(cfg)?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    Ok(Engine::new(blocks, &cfg.device()?, ecfg)?)
}

/// The data loader the config describes (tokens checked against the vocabulary).
pub fn open_data(cfg: &TrainConfig) -> Result<DataLoader> {
    let m = family::of(cfg)?.summary(cfg)?;
    crate::common::data::open_data_for(cfg, m.block_size, m.vocab_size)
}

fn tp_of(cfg: &TrainConfig, mesh: &DeviceMesh) -> Option<Tp> {
    (cfg.parallel.tp > 1).then(|| Tp::new(mesh.tp().clone(), cfg.parallel.sequence_parallel))
}

/// The trainer for `cfg` on `pg` (data parallel, pipeline, and tensor
/// parallel when `parallel.tp` > 1), with `--init-from` loaded; not yet run.
pub fn trainer(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &Run,
) -> Result<Trainer> {
    let family = family::of(cfg)?;
    let dp = cfg.dp_for_world(pg.size())?;
    let mesh = DeviceMesh::new(&pg, dp, cfg.parallel.pp, cfg.parallel.tp)?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    let init_err = |p: &Path, e: Error| Error::Check(format!("--init-from {}: {e}", p.display()));
    if let Some(p) = &run.init_from {
        crate::common::backed::check_hf(cfg, p).map_err(|e| init_err(p, e))?;
    }
    let tp = tp_of(cfg, &mesh);
    let (engine, replicated) = match &tp {
        None => {
            let mut engine = build_engine(cfg)?;
            // A pipeline stage reads its own tensors once it knows them
            // (below); other layouts read the whole checkpoint now.
            if let (Some(p), 1) = (&run.init_from, cfg.parallel.pp) {
                family
                    .load_hf(&mut engine, cfg, p)
                    .map_err(|e| init_err(p, e))?;
            }
            (engine, Vec::new())
        }
        Some(t) => {
            let context = family.summary(cfg)?.block_size;
            if cfg.parallel.sequence_parallel && !context.is_multiple_of(t.size()) {
                return Err(Error::Check(format!(
                    "sequence parallel: model.block_size {context} is not divisible by parallel.tp {}",
                    t.size()
                )));
            }
            let mut engine = match &run.init_from {
                Some(p) => family
                    .tp_load(cfg, t, ecfg, p)
                    .map_err(|e| init_err(p, e))?,
                None => ctp::init_engine(
                    family.blocks(cfg)?,
                    family.tp_blocks(cfg, t)?,
                    t,
                    ecfg,
                    &cfg.device()?,
                )?,
            };
            // The slices copied in are the initial values (a pipeline stage
            // must not overwrite them with a fresh initialisation).
            engine.init_params(Some(&[]));
            let rep = ctp::replicated_ranges(&engine, t.size());
            (engine, rep)
        }
    };
    let seq = loader.seq_len();
    let mut trainer = Trainer::with_mesh(cfg, engine, loader, &mesh, replicated)?;
    // Model FLOPs per token (6 x what the tokens go through + attention), for MFU.
    let shape = family.plan_shape(cfg, seq)?;
    trainer.set_flops_per_token(phalanx::plan::model_flops_per_token(&shape));
    if let Some(t) = &tp {
        trainer.set_placement(Arc::new(TpPlacement {
            rank: t.rank(),
            size: t.size(),
        }));
    }
    if let (Some(p), None, true) = (&run.init_from, &tp, cfg.parallel.pp > 1) {
        family
            .load_hf(trainer.engine_mut(), cfg, p)
            .map_err(|e| init_err(p, e))?;
    }
    Ok(trainer)
}

/// Build, optionally load, train on `pg`, optionally save (rank 0 writes):
/// not after a graceful stop ([`Report::stopped_at`]), whose model is
/// partly trained (the run that resumes and finishes saves it).
pub fn train(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &Run,
) -> Result<(Report, Trainer)> {
    let mut trainer = self::trainer(cfg, pg, loader, run)?;
    let report = trainer.run(&run.run)?;
    if let (Some(p), None) = (&run.save_final, report.stopped_at) {
        let named = full_named_params(&mut trainer, cfg)?;
        if trainer.group().global_rank() == 0 {
            save(&named, cfg, p)?;
        }
    }
    Ok((report, trainer))
}

/// The whole model's parameters by name (engine orientation) on every
/// rank: gathered from tensor-parallel and ZeRO-3 shards and pipeline
/// stages (collective).
pub fn full_named_params(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
) -> Result<HashMap<String, Tensor>> {
    trainer.materialize_params()?;
    if let Some(t) = tp_of(cfg, trainer.mesh()) {
        return ctp::gather_full(trainer.engine(), &t);
    }
    named_params(trainer.engine())
}

/// A whole engine's parameters by name (engine orientation).
pub fn named_params(engine: &Engine) -> Result<HashMap<String, Tensor>> {
    Ok(crate::common::hf::engine_tensors(engine)?)
}

/// Write the whole model (`tensors`: engine names and orientation) in the
/// family's HF layout at `path`, with `config.json`, and a `data.tokenizer`
/// `tokenizer.json` beside it.
pub fn save(tensors: &HashMap<String, Tensor>, cfg: &TrainConfig, path: &Path) -> Result<()> {
    let dir = family::of(cfg)?.save_hf(tensors, cfg, path)?;
    crate::hf_tokenizer::save_beside(&cfg.data.tokenizer, &dir)
}
