//! Llama under tensor parallelism: a rank's blocks and reading its slices
//! of HF weights. Which slice of each whole parameter a rank holds is
//! declared with the parameter in [`super::tp_blocks`] (see its layout);
//! cutting, gathering and placing shards are [`crate::common::tp`]'s.
//!
//! Initialisation builds the whole model with the run's seed and keeps each
//! rank's slice, so a tp run starts from a 1-rank run's parameters.
//!
//! ```
//! use phalanx::engine::{Engine, EngineConfig, Rule};
//! use phalanx::tp::Tp;
//! use phalanx_models::llama::{tp::blocks_tp, LlamaConfig};
//! let c = LlamaConfig::new(2, 4, 2, 32, 64, 256, 16); // KV = 16
//! let rules = phalanx_comm::threads::run(4, move |pg| {
//!     let tp = Tp::new(pg, false);
//!     let e = Engine::new(blocks_tp(&c, &tp).unwrap(), &candle_core::Device::Cpu,
//!                         EngineConfig { defer_init: true, ..Default::default() }).unwrap();
//!     let p = |n: &str| e.layout().find(n).unwrap().rule(tp.rank(), 4);
//!     (p("model.layers.0.self_attn.k_proj.weight"), p("model.layers.0.mlp.down_proj.weight"))
//! });
//! assert_eq!(rules[1], (Rule::Full, Rule::Cols(16..32))); // 2 kv heads < tp 4: replicated
//! ```

use super::config::LlamaConfig;
use super::tp_blocks::{TpEmbedding, TpHead, TpLayer};
use crate::common::tp::{extract, fill_shards};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, Device, Result};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::tp::Tp;
use std::collections::HashMap;

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
    // The names and the whole shapes (this rank's layout's, by their
    // placements) are checked first, so the errors are a 1-rank load's.
    let (files, dir) = super::hf::resolve(path)?;
    if let Some(v) = super::hf::read_config(&dir)? {
        check(&v, cfg)?;
    }
    let mut engine = Engine::new(blocks_tp(cfg, tp)?, device, ecfg)?;
    let whole: HashMap<String, Vec<usize>> = engine
        .layout()
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.full_shape(tp.size())))
        .collect();
    let full_shape = |name: &str| {
        // A tied head is the embedding's table.
        let name = if name == "lm_head.weight" && !whole.contains_key(name) {
            "model.embed_tokens.weight"
        } else {
            name
        };
        whole.get(name).cloned().unwrap_or_default()
    };
    // Safety: the files are only read, and not expected to change meanwhile.
    let st = unsafe { MmapedSafetensors::multi(&files) }?;
    let mut shapes: HashMap<String, (Vec<usize>, safetensors::Dtype)> = HashMap::new();
    for (n, v) in st.tensors() {
        // (As the one-rank load: one of two copies would be taken silently.)
        if shapes
            .insert(n.clone(), (v.shape().to_vec(), v.dtype()))
            .is_some()
        {
            candle_core::bail!("tensor `{n}` is in more than one of the model's files")
        }
    }
    let mut want = super::hf::names(cfg);
    for (name, (dims, dtype)) in &shapes {
        if want.remove(name) {
            let full = full_shape(name);
            if dims != &full {
                bail!("tensor `{name}`: expected shape {full:?}, found {dims:?}")
            }
            // As the 1-rank load.
            super::hf::check_float(name, *dtype)?;
        } else {
            // What a 1-rank load allows besides the parameters.
            let tied_head = cfg.tie_word_embeddings && name == "lm_head.weight";
            if tied_head && dims != &full_shape(name) {
                bail!(
                    "tensor `lm_head.weight`: expected shape {:?} (tied to embed_tokens), found {dims:?}",
                    full_shape(name)
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
    fill_shards(&mut engine, tp, &|name, r, _| {
        // Read into host memory (file bytes), then copied into the
        // engine's buffers.
        extract(
            &st.load(name, &Device::Cpu)?
                .to_dtype(candle_core::DType::F32)?,
            r,
        )
    })?;
    Ok(engine)
}
