//! Training GPT-2 from a `TrainConfig`: the path `phalanx train` takes, and
//! the one the equivalence tests drive with ranks as threads.
//!
//! ```no_run
//! use phalanx_models::gpt2::{config, train::{self, GptRun}};
//! let cfg = config::build(None, &["train.steps=10".into()]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let loader = std::sync::Arc::new(train::open_data(&cfg).unwrap());
//! let (report, trainer) = train::train(&cfg, pg, loader, &GptRun::default()).unwrap();
//! println!("final loss {}", report.losses.last().unwrap());
//! ```

use super::config::Gpt2Section;
use super::{hf, Gpt2Config};
use crate::hf_tokenizer;
use candle_core::Device;
use phalanx::config::{TokenizerSpec, TrainConfig};
use phalanx::data::{DataLoader, LoaderConfig, TokenData, Tokenizer};
use phalanx::engine::Engine;
use phalanx::mesh::DeviceMesh;
use phalanx::tp::Tp;
use phalanx::trainer::{Report, RunOptions, Trainer};
use phalanx::{Error, Result};
use phalanx_comm::ProcessGroup;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct GptRun {
    /// Start from a Hugging Face GPT-2 safetensors file.
    pub init_from: Option<PathBuf>,
    /// Save the trained model (HF layout) here, with `config.json` beside it.
    pub save_final: Option<PathBuf>,
    pub run: RunOptions,
}

/// The model of a config built with [`super::config::build`].
pub fn model_config(cfg: &TrainConfig) -> Result<Gpt2Config> {
    Ok(Gpt2Section::of(cfg)?.model())
}

/// A GPT-2 engine for the config, initialised with `train.seed`.
pub fn build_engine(cfg: &TrainConfig) -> Result<Engine> {
    let g = model_config(cfg)?;
    g.validate()?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    Ok(super::engine(&g, &Device::Cpu, ecfg)?)
}

/// The data loader the config describes (tokens checked against the vocabulary).
pub fn open_data(cfg: &TrainConfig) -> Result<DataLoader> {
    let m = model_config(cfg)?;
    open_data_for(cfg, m.block_size, m.vocab_size)
}

/// The data loader `cfg.data` describes, for any model: samples of
/// `seq_len` tokens, every token checked to be below `vocab_size`.
///
/// `data.tokenizer` naming a `tokenizer.json` encodes a text file with it
/// (its vocabulary checked against `vocab_size` first); token files
/// (`.bin`) are read as they are, whatever the tokenizer.
pub fn open_data_for(cfg: &TrainConfig, seq_len: usize, vocab_size: usize) -> Result<DataLoader> {
    let lc = LoaderConfig {
        seq_len,
        val_fraction: cfg.data.val_fraction,
        shuffle: cfg.data.shuffle,
        seed: cfg.data.seed,
        vocab_size: Some(vocab_size),
    };
    let path = Path::new(&cfg.data.path);
    let is_bin = path.extension().is_some_and(|e| e == "bin");
    let tok = match (&cfg.data.tokenizer, is_bin) {
        (TokenizerSpec::Builtin(t), _) => *t,
        // A token file: the loader reads its ids (the tokenizer only
        // matters for text), but a tokenizer too big for the model is
        // still a mistake worth naming.
        (TokenizerSpec::HfJson(j), true) => {
            hf_tokenizer::open_for_model(Path::new(j), vocab_size)?;
            Tokenizer::Byte
        }
        (TokenizerSpec::HfJson(j), false) => {
            let hf = hf_tokenizer::open_for_model(Path::new(j), vocab_size)?;
            let text = if cfg.data.path == DEFAULT_CORPUS_PATH && !path.exists() {
                String::from_utf8_lossy(BUILTIN_CORPUS).into_owned()
            } else {
                std::fs::read_to_string(path).map_err(|e| {
                    Error::Check(format!(
                        "data.path {}: {e} (a text file to encode with data.tokenizer {j})",
                        path.display()
                    ))
                })?
            };
            let ids = hf_tokenizer::encode_corpus(&hf, &text, Path::new(j))?;
            return Ok(DataLoader::new(TokenData::from_tokens(ids), lc)?);
        }
    };
    // The default corpus is built in, so `phalanx train` works from any
    // directory; a file at the path (the repository's copy) is used first.
    if cfg.data.path == DEFAULT_CORPUS_PATH && !path.exists() {
        let data = TokenData::from_text(BUILTIN_CORPUS.to_vec(), tok, path)?;
        return Ok(DataLoader::new(data, lc)?);
    }
    Ok(DataLoader::open(path, tok, lc)?)
}

/// `data.path`'s default.
pub const DEFAULT_CORPUS_PATH: &str = "data/corpus.txt";

/// The shipped corpus (World English Bible, public domain; 4.7 MiB).
pub static BUILTIN_CORPUS: &[u8] = include_bytes!("../../../../data/corpus.txt");

/// The trainer for `cfg` on `pg` (data parallel, and tensor parallel when
/// `parallel.tp` > 1), with `--init-from` loaded; not yet run.
pub fn trainer(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &GptRun,
) -> Result<Trainer> {
    let tp_size = cfg.parallel.tp;
    let dp = cfg.dp_for_world(pg.size())?;
    let mesh = DeviceMesh::new(&pg, dp, cfg.parallel.pp, tp_size)?;
    let g = model_config(cfg)?;
    let ecfg = phalanx::trainer::engine_config(cfg);
    let tp = (tp_size > 1).then(|| Tp::new(mesh.tp().clone(), cfg.parallel.sequence_parallel));
    let init_err = |p: &Path, e: candle_core::Error| {
        Error::Check(format!("--init-from {}: {}", p.display(), Error::from(e)))
    };
    let (engine, replicated) = match &tp {
        None => {
            let mut engine = build_engine(cfg)?;
            // A pipeline stage reads its own tensors once it knows them
            // (below); other layouts read the whole file now.
            if let (Some(p), 1) = (&run.init_from, cfg.parallel.pp) {
                hf::load_safetensors(&mut engine, p).map_err(|e| init_err(p, e))?;
            }
            (engine, Vec::new())
        }
        Some(t) => {
            if !g.block_size.is_multiple_of(t.size()) && cfg.parallel.sequence_parallel {
                return Err(Error::Check(format!(
                    "sequence parallel: model.block_size {} is not divisible by parallel.tp {}",
                    g.block_size,
                    t.size()
                )));
            }
            let mut engine = match &run.init_from {
                Some(p) => super::tp::load_engine(&g, t, ecfg, p).map_err(|e| init_err(p, e))?,
                None => super::tp::init_engine(&g, t, ecfg)?,
            };
            // The slices copied in are the initial values (a pipeline stage
            // must not overwrite them with a fresh initialisation).
            engine.init_params(Some(&[]));
            let rep = super::tp::replicated_ranges(&engine, &g, t.size());
            (engine, rep)
        }
    };
    let seq = loader.seq_len();
    let mut trainer = Trainer::with_mesh(cfg, engine, loader, &mesh, replicated)?;
    // Model FLOPs per token (6N + attention), for MFU.
    let shape = phalanx::plan::ModelShape::gpt2(g.n_layer, g.n_head, g.n_embd, g.vocab_size, seq);
    trainer.set_flops_per_token(phalanx::plan::model_flops_per_token(&shape));
    if let Some(t) = &tp {
        trainer.set_placement(Arc::new(super::tp::TpPlacement {
            vocab: g.vocab_size,
            rank: t.rank(),
            size: t.size(),
        }));
    }
    if let (Some(p), None, true) = (&run.init_from, &tp, cfg.parallel.pp > 1) {
        hf::load_safetensors(trainer.engine_mut(), p).map_err(|e| init_err(p, e))?;
    }
    Ok(trainer)
}

/// Build, optionally load, train on `pg` (data parallel, and tensor
/// parallel when `parallel.tp` > 1), optionally save.
pub fn train(
    cfg: &TrainConfig,
    pg: ProcessGroup,
    loader: Arc<DataLoader>,
    run: &GptRun,
) -> Result<(Report, Trainer)> {
    let mut trainer = self::trainer(cfg, pg, loader, run)?;
    let tp = (cfg.parallel.tp > 1)
        .then(|| Tp::new(trainer.mesh().tp().clone(), cfg.parallel.sequence_parallel));
    let g = model_config(cfg)?;
    let report = trainer.run(&run.run)?;
    if let Some(p) = &run.save_final {
        // ZeRO-3 holds shards: gather the whole model first (every rank).
        trainer.materialize_params()?;
        let full = match &tp {
            Some(t) => Some(super::tp::gather_full(trainer.engine(), &g, t)?),
            None => None,
        };
        if trainer.group().global_rank() == 0 {
            match full {
                Some(f) => save_tensors(hf::to_hf(f)?, cfg, p)?,
                None => save(trainer.engine(), cfg, p)?,
            }
        }
    }
    Ok((report, trainer))
}

/// The whole model's parameters by name (engine orientation) on every rank:
/// gathered from tensor-parallel and ZeRO-3 shards (collective).
pub fn full_named_params(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    trainer.materialize_params()?;
    let g = model_config(cfg)?;
    if cfg.parallel.tp > 1 {
        let t = Tp::new(trainer.mesh().tp().clone(), cfg.parallel.sequence_parallel);
        return super::tp::gather_full(trainer.engine(), &g, &t);
    }
    let e = trainer.engine();
    e.layout()
        .params()
        .iter()
        .map(|p| Ok((p.name.clone(), e.param_tensor(&p.name)?)))
        .collect()
}

/// Write the model in HF layout, atomically (temp file + rename), and a
/// `config.json` beside it, so the directory opens with
/// `GPT2LMHeadModel.from_pretrained`.
pub fn save(engine: &Engine, cfg: &TrainConfig, path: &Path) -> Result<()> {
    save_tensors(hf::export_tensors(engine)?, cfg, path)
}

/// Write HF tensors atomically, with `config.json` beside them.
pub fn save_tensors(
    tensors: std::collections::HashMap<String, candle_core::Tensor>,
    cfg: &TrainConfig,
    path: &Path,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Written whole, with the umask's permissions; no temporary is left on
    // an error.
    let mut sorted: Vec<(&String, &candle_core::Tensor)> = tensors.iter().collect();
    sorted.sort_by_key(|(n, _)| *n);
    let bytes = safetensors::serialize(sorted, None)
        .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    phalanx::fsutil::write_atomic(path, &bytes)?;
    let m = model_config(cfg)?;
    let hf_cfg = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd,
        "vocab_size": m.vocab_size, "n_positions": m.block_size, "n_ctx": m.block_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "initializer_range": 0.02, "tie_word_embeddings": true,
        "bos_token_id": 50256, "eos_token_id": 50256,
        "phalanx_tokenizer": cfg.data.tokenizer.to_string(),
    });
    phalanx::fsutil::write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&hf_cfg).unwrap().as_bytes(),
    )?;
    hf_tokenizer::save_beside(&cfg.data.tokenizer, dir)
}
