//! Llama under tensor parallelism: which slice of each full parameter a
//! rank holds (see [`super::tp_blocks`] for the layout), and moving whole
//! models in and out of shards (initialisation, HF import and export,
//! checkpoint placement).
//!
//! | parameter (engine layout, (out, in)) | rank t of tp holds |
//! |---|---|
//! | `embed_tokens`, `lm_head` (V, C) | rows [t V'/tp, (t+1) V'/tp) of the vocabulary padded to V' |
//! | `q_proj` (C, C), `gate_proj`, `up_proj` (M, C) | rows [t n/tp, (t+1) n/tp) |
//! | `k_proj`, `v_proj` (KV, C) | rows of its kv heads when n_kv_head >= tp, else all (replicated) |
//! | `o_proj` (C, C), `down_proj` (C, M) | columns [t n/tp, (t+1) n/tp) |
//! | norms | replicated |
//!
//! Initialisation builds the whole model with the run's seed and keeps each
//! rank's slice, so a tp run starts from a 1-rank run's parameters.
//!
//! ```
//! use phalanx_models::gpt2::tp::Rule;
//! use phalanx_models::llama::{tp::rule, LlamaConfig};
//! let c = LlamaConfig::new(2, 4, 2, 32, 64, 256, 16); // KV = 16
//! assert_eq!(rule(&c, "model.layers.0.self_attn.k_proj.weight", 1, 2), Rule::Rows(vec![8..16]));
//! assert_eq!(rule(&c, "model.layers.0.self_attn.k_proj.weight", 1, 4), Rule::Full); // 2 kv heads < tp 4
//! assert_eq!(rule(&c, "model.layers.0.mlp.down_proj.weight", 1, 2), Rule::Cols(32..64));
//! ```

use super::config::LlamaConfig;
use super::tp_blocks::{kv_split, TpEmbedding, TpHead, TpLayer};
use crate::gpt2::tp::{extract, Rule};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, Device, Result, Tensor};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::tp::{padded_vocab, Tp};
use std::collections::HashMap;
use std::ops::Range;

/// The blocks of one tensor-parallel rank.
pub fn blocks_tp(cfg: &LlamaConfig, tp: &Tp) -> Result<Vec<Box<dyn Block>>> {
    cfg.validate()?;
    super::tp_blocks::check(cfg, tp)?;
    let mut out: Vec<Box<dyn Block>> = vec![Box::new(TpEmbedding {
        cfg: *cfg,
        tp: tp.clone(),
    })];
    for index in 0..cfg.n_layer {
        out.push(Box::new(TpLayer {
            cfg: *cfg,
            index,
            tp: tp.clone(),
        }));
    }
    out.push(Box::new(TpHead {
        cfg: *cfg,
        tp: tp.clone(),
    }));
    Ok(out)
}

/// The full (1-rank) shape of parameter `name`.
pub fn full_shape(cfg: &LlamaConfig, name: &str) -> Vec<usize> {
    let (c, kv, m, v) = (
        cfg.n_embd,
        cfg.kv_dim(),
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let ends = |s: &str| name.ends_with(s);
    if ends("embed_tokens.weight") || name == "lm_head.weight" {
        vec![v, c]
    } else if ends("q_proj.weight") {
        vec![cfg.q_dim(), c]
    } else if ends("o_proj.weight") {
        vec![c, cfg.q_dim()]
    } else if ends("k_proj.weight") || ends("v_proj.weight") {
        vec![kv, c]
    } else if ends("gate_proj.weight") || ends("up_proj.weight") {
        vec![m, c]
    } else if ends("down_proj.weight") {
        vec![c, m]
    } else {
        vec![c] // norms
    }
}

/// How rank t's shard of `name` is cut from the full parameter.
pub fn rule(cfg: &LlamaConfig, name: &str, t: usize, tp: usize) -> Rule {
    if tp == 1 {
        return Rule::Full;
    }
    let full = full_shape(cfg, name);
    let part = |n: usize| (t * n / tp)..((t + 1) * n / tp);
    let ends = |s: &str| name.ends_with(s);
    if ends("embed_tokens.weight") || name == "lm_head.weight" {
        let rows = padded_vocab(cfg.vocab_size, tp) / tp;
        return Rule::Rows(std::iter::once(t * rows..(t + 1) * rows).collect());
    }
    if ends("k_proj.weight") || ends("v_proj.weight") {
        return if kv_split(cfg, tp) {
            Rule::Rows(vec![part(full[0])])
        } else {
            Rule::Full
        };
    }
    if ends("q_proj.weight") || ends("gate_proj.weight") || ends("up_proj.weight") {
        return Rule::Rows(vec![part(full[0])]);
    }
    if ends("o_proj.weight") || ends("down_proj.weight") {
        return Rule::Cols(part(full[1]));
    }
    Rule::Full
}

/// A tp engine whose parameters come from `shard(name, rule)`.
fn shard_engine(
    cfg: &LlamaConfig,
    tp: &Tp,
    ecfg: EngineConfig,
    shard: &dyn Fn(&str, &Rule) -> Result<Tensor>,
) -> Result<Engine> {
    let mut engine = Engine::new(blocks_tp(cfg, tp)?, &Device::Cpu, ecfg)?;
    engine.fill_params(&mut |name, _| shard(name, &rule(cfg, name, tp.rank(), tp.size())))?;
    Ok(engine)
}

/// Initialise: the whole model with `ecfg.seed`, then this rank's slices.
pub fn init_engine(cfg: &LlamaConfig, tp: &Tp, ecfg: EngineConfig) -> Result<Engine> {
    let eager = EngineConfig {
        defer_init: false,
        ..ecfg
    };
    let full = super::engine(cfg, &Device::Cpu, eager)?;
    shard_engine(cfg, tp, ecfg, &|name, r| {
        extract(&full.param_tensor(name)?, r)
    })
}

/// Load HF weights (any layout [`super::hf::resolve`] reads; `config.json`
/// checked): every rank maps the files and keeps its slices. The whole
/// file is checked by name and shape first, as a 1-rank load does.
pub fn load_engine(
    cfg: &LlamaConfig,
    tp: &Tp,
    ecfg: EngineConfig,
    path: &std::path::Path,
) -> Result<Engine> {
    // The names and shapes are checked on a whole (unallocated) engine's
    // layout, so the errors are a 1-rank load's.
    let (files, dir) = super::hf::resolve(path)?;
    if let Some(v) = super::hf::read_config(&dir)? {
        super::hf::check_config(&v, cfg)?;
    }
    // Safety: the files are only read, and not expected to change meanwhile.
    let st = unsafe { MmapedSafetensors::multi(&files) }?;
    let shapes: HashMap<String, Vec<usize>> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect();
    let mut want = super::hf::names(cfg);
    for (name, dims) in &shapes {
        if want.remove(name) {
            let full = full_shape(cfg, name);
            if dims != &full {
                bail!("tensor `{name}`: expected shape {full:?}, found {dims:?}")
            }
        } else {
            // What a 1-rank load allows besides the parameters.
            let tied_head = cfg.tie_word_embeddings && name == "lm_head.weight";
            if tied_head && dims != &full_shape(cfg, name) {
                bail!(
                    "tensor `lm_head.weight`: expected shape {:?} (tied to embed_tokens), found {dims:?}",
                    full_shape(cfg, name)
                )
            }
            if tied_head || name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            bail!("tensors not in this model: [{name:?}] (wrong config?)")
        }
    }
    if let Some(missing) = want.into_iter().min() {
        bail!("missing tensor `{missing}`")
    }
    shard_engine(cfg, tp, ecfg, &|name, r| {
        extract(
            &st.load(name, &Device::Cpu)?
                .to_dtype(candle_core::DType::F32)?,
            r,
        )
    })
}

/// Reassemble a full tensor from every rank's shard.
fn assemble(cfg: &LlamaConfig, name: &str, shards: &[Tensor]) -> Result<Tensor> {
    let tp = shards.len();
    let full = full_shape(cfg, name);
    match rule(cfg, name, 0, tp) {
        Rule::Full => Ok(shards[0].clone()),
        Rule::Cols(_) => Tensor::cat(shards, 1),
        // One row range per rank, in rank order; drop the vocabulary padding.
        Rule::Rows(_) => Tensor::cat(shards, 0)?.narrow(0, 0, full[0]),
    }
}

/// The whole model's parameters by name, gathered from every tp rank
/// (collective over the tp group).
pub fn gather_full(
    engine: &Engine,
    cfg: &LlamaConfig,
    tp: &Tp,
) -> phalanx::Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for p in engine.layout().params() {
        let local = engine.param(&p.name)?;
        let mut all = vec![0f32; local.len() * tp.size()];
        tp.pg.all_gather(local, &mut all)?;
        let shards: Vec<Tensor> = all
            .chunks(local.len().max(1))
            .map(|c| Tensor::from_slice(c, p.shape.as_slice(), &Device::Cpu))
            .collect::<Result<_>>()?;
        out.insert(p.name.clone(), assemble(cfg, &p.name, &shards)?);
    }
    Ok(out)
}

/// Flat ranges of the parameters every tp rank holds whole (norms, and
/// replicated kv projections): their gradients are whole on every rank
/// and count once in the global norm.
pub fn replicated_ranges(engine: &Engine, cfg: &LlamaConfig, tp: usize) -> Vec<Range<usize>> {
    engine
        .layout()
        .params()
        .iter()
        .filter(|p| rule(cfg, &p.name, 0, tp) == Rule::Full)
        .map(|p| p.range())
        .collect()
}

/// Where this tp rank's parameters sit in the full tensors, for checkpoints.
pub struct TpPlacement {
    pub cfg: LlamaConfig,
    pub rank: usize,
    pub size: usize,
}

impl phalanx::checkpoint::Placement for TpPlacement {
    fn place(&self, p: &phalanx::engine::ParamInfo) -> phalanx::checkpoint::Placed {
        use phalanx::checkpoint::Placed;
        let full = full_shape(&self.cfg, &p.name);
        match rule(&self.cfg, &p.name, self.rank, self.size) {
            Rule::Full => Placed::whole(&p.shape),
            Rule::Cols(c) => Placed {
                blocks: vec![(0..p.shape[0], vec![0, c.start])],
                shape: full,
            },
            Rule::Rows(ranges) => {
                let mut at = 0;
                let mut blocks = Vec::new();
                for rg in ranges {
                    let have = rg.start.min(full[0])..rg.end.min(full[0]);
                    if !have.is_empty() {
                        blocks.push((at..at + have.len(), vec![have.start, 0]));
                    }
                    at += rg.len();
                }
                Placed {
                    shape: full,
                    blocks,
                }
            }
        }
    }
}
