//! Llama under tensor parallelism: which slice of each full parameter a
//! rank holds ([`LlamaTp`]; see [`super::tp_blocks`] for the layout), and
//! reading a rank's slices of HF weights. Cutting, gathering and placing
//! shards are [`crate::common::tp`]'s.
//!
//! | parameter (engine layout, (out, in)) | rank t of tp holds |
//! |---|---|
//! | `embed_tokens`, `lm_head` (V, C) | rows [t V'/tp, (t+1) V'/tp) of the vocabulary padded to V' |
//! | `q_proj` (C, C), `gate_proj`, `up_proj` (M, C) | rows [t n/tp, (t+1) n/tp) |
//! | `k_proj`, `v_proj` (KV, C) | rows of its kv heads when n_kv_head >= tp, else all (replicated) |
//! | q / k / v biases (`qkv_bias`) | as their matrix's rows |
//! | `o_proj` (C, C), `down_proj` (C, M) | columns [t n/tp, (t+1) n/tp) |
//! | norms | replicated |
//!
//! Initialisation builds the whole model with the run's seed and keeps each
//! rank's slice, so a tp run starts from a 1-rank run's parameters.
//!
//! ```
//! use phalanx_models::common::tp::Rule;
//! use phalanx_models::llama::{tp::rule, LlamaConfig};
//! let c = LlamaConfig::new(2, 4, 2, 32, 64, 256, 16); // KV = 16
//! assert_eq!(rule(&c, "model.layers.0.self_attn.k_proj.weight", 1, 2), Rule::Rows(vec![8..16]));
//! assert_eq!(rule(&c, "model.layers.0.self_attn.k_proj.weight", 1, 4), Rule::Full); // 2 kv heads < tp 4
//! assert_eq!(rule(&c, "model.layers.0.mlp.down_proj.weight", 1, 2), Rule::Cols(32..64));
//! ```

use super::config::LlamaConfig;
use super::tp_blocks::{kv_split, TpEmbedding, TpHead, TpLayer};
use crate::common::tp::{extract, shard_engine, Rule, TpLayout};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, Device, Result};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::tp::{padded_vocab, Tp};
use std::collections::HashMap;

/// Llama's [`TpLayout`]: [`rule`] and [`full_shape`] for a config.
pub struct LlamaTp {
    pub cfg: LlamaConfig,
}

impl TpLayout for LlamaTp {
    fn full_shape(&self, name: &str, _local: &[usize], _size: usize) -> Vec<usize> {
        full_shape(&self.cfg, name)
    }

    fn rule(&self, name: &str, _full: &[usize], rank: usize, size: usize) -> Rule {
        rule(&self.cfg, name, rank, size)
    }
}

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
    if ends("q_proj.bias") {
        vec![cfg.q_dim()]
    } else if ends("k_proj.bias") || ends("v_proj.bias") {
        vec![kv]
    } else if ends("embed_tokens.weight") || name == "lm_head.weight" {
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
    // A q / k / v bias (Qwen2) is cut as its matrix's rows.
    let kv = [
        "k_proj.weight",
        "v_proj.weight",
        "k_proj.bias",
        "v_proj.bias",
    ];
    if kv.iter().any(|s| ends(s)) {
        return if kv_split(cfg, tp) {
            Rule::Rows(vec![part(full[0])])
        } else {
            Rule::Full
        };
    }
    let rows = [
        "q_proj.weight",
        "q_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
    ];
    if rows.iter().any(|s| ends(s)) {
        return Rule::Rows(vec![part(full[0])]);
    }
    if ends("o_proj.weight") || ends("down_proj.weight") {
        return Rule::Cols(part(full[1]));
    }
    Rule::Full
}

/// Load HF weights (any layout [`super::hf::resolve`] reads; `config.json`
/// checked): every rank maps the files and keeps its slices. The whole
/// file is checked by name and shape first, as a 1-rank load does.
pub fn load_engine(
    cfg: &LlamaConfig,
    tp: &Tp,
    ecfg: EngineConfig,
    device: &Device,
    path: &std::path::Path,
) -> Result<Engine> {
    load_engine_with(cfg, tp, ecfg, device, path, &super::hf::check_config)
}

/// [`load_engine`], `config.json` checked by `check` (a family on Llama's
/// layers reads its own).
pub fn load_engine_with(
    cfg: &LlamaConfig,
    tp: &Tp,
    ecfg: EngineConfig,
    device: &Device,
    path: &std::path::Path,
    check: &super::hf::ConfigCheck,
) -> Result<Engine> {
    // The names and shapes are checked on a whole (unallocated) engine's
    // layout, so the errors are a 1-rank load's.
    let (files, dir) = super::hf::resolve(path)?;
    if let Some(v) = super::hf::read_config(&dir)? {
        check(&v, cfg)?;
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
    shard_engine(
        blocks_tp(cfg, tp)?,
        &LlamaTp { cfg: *cfg },
        tp,
        ecfg,
        device,
        &|name, r, _| {
            // Read into host memory (file bytes), then copied into the
            // engine's buffers.
            extract(
                &st.load(name, &Device::Cpu)?
                    .to_dtype(candle_core::DType::F32)?,
                r,
            )
        },
    )
}
