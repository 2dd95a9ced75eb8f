//! Hugging Face `LlamaForCausalLM` weights: import and export.
//!
//! Names are HF's and the engine's alike (nn.Linear stores (out, in), as
//! the engine does, so nothing is transposed):
//! `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`,
//! `model.layers.{i}.{input,post_attention}_layernorm.weight`,
//! `model.norm.weight`, `lm_head.weight` (absent when tied), and with
//! `qkv_bias` (Qwen2's layer) `model.layers.{i}.self_attn.{q,k,v}_proj.bias`.
//!
//! Layouts read: one `model.safetensors`, or HF's sharded layout (a
//! `model.safetensors.index.json` whose `weight_map` names the shard of
//! every tensor), given as the file or as the directory holding it. A
//! `config.json` beside the weights is checked against the model config
//! ([`super::hf_config`]). Shards are memory-mapped; only the tensors the
//! engine holds are read (a pipeline stage reads its own blocks);
//! f16/bf16/f64 become f32.
//! Tied files may carry `lm_head.weight` (its shape is checked), and old
//! files `rotary_emb.inv_freq` buffers (ignored); any other unknown tensor
//! is an error.
//!
//! Export writes the same layout: `model.safetensors`, or shards of at most
//! `max_shard_bytes` with the index (as `save_pretrained` does past 5 GB),
//! plus `config.json` for `LlamaForCausalLM.from_pretrained`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, DType, Device, Result, Tensor};
use phalanx::engine::Engine;

use super::config::LlamaConfig;
pub use super::hf_config::{
    check_config, config_from_json, config_json, hf_keys, rope_scaling, rope_theta,
};
pub use crate::common::hf::read_config;

pub use crate::common::hf::{resolve, DEFAULT_SHARD_BYTES, INDEX, SINGLE};

/// Checks a `config.json` against the model (Llama's: [`check_config`]).
pub type ConfigCheck = dyn Fn(&serde_json::Value, &LlamaConfig) -> Result<()>;

/// Load an HF Llama checkpoint (file, index or directory) into the engine;
/// a `config.json` beside it is checked against `cfg` first.
pub fn load(engine: &mut Engine, cfg: &LlamaConfig, path: impl AsRef<Path>) -> Result<()> {
    load_with(engine, cfg, path.as_ref(), &check_config)
}

/// [`load`], `config.json` checked by `check` (a family on Llama's layers
/// reads its own).
pub fn load_with(
    engine: &mut Engine,
    cfg: &LlamaConfig,
    path: &Path,
    check: &ConfigCheck,
) -> Result<()> {
    let (files, dir) = resolve(path)?;
    if let Some(v) = read_config(&dir)? {
        check(&v, cfg)?;
    }
    for f in &files {
        if !f.is_file() {
            bail!("{}: shard {} is missing", path.display(), f.display())
        }
    }
    // Safety: the files are only read, and not expected to change meanwhile.
    let st = unsafe { MmapedSafetensors::multi(&files) }?;
    let mut shapes: HashMap<String, (Vec<usize>, safetensors::Dtype)> = HashMap::new();
    let mut count = 0;
    for (name, view) in st.tensors() {
        count += 1;
        shapes.insert(name, (view.shape().to_vec(), view.dtype()));
    }
    if count != shapes.len() {
        bail!(
            "{}: a tensor name appears in more than one shard",
            path.display()
        )
    }
    // Host memory by design: file bytes, copied into the engine's buffers.
    import(engine, cfg, shapes, &|name| st.load(name, &Device::Cpu))
}

/// Non-parameter tensors old HF files carry.
fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

type Shapes = HashMap<String, (Vec<usize>, safetensors::Dtype)>;

/// Parameters load from floats only: integers would convert silently.
pub(super) fn check_float(name: &str, dtype: safetensors::Dtype) -> Result<()> {
    use safetensors::Dtype;
    if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64) {
        bail!("tensor `{name}` is {dtype:?}; parameters must be floats")
    }
    Ok(())
}

/// Check names, shapes and dtypes, then copy in what the engine holds.
fn import(
    engine: &mut Engine,
    cfg: &LlamaConfig,
    mut shapes: Shapes,
    read: &dyn Fn(&str) -> Result<Tensor>,
) -> Result<()> {
    for (name, shape, needed) in &crate::common::hf::params_held(engine) {
        let Some((dims, dtype)) = shapes.remove(name) else {
            let why = if name == "lm_head.weight" {
                " (model.tie_word_embeddings = false: an untied head needs its own matrix)"
            } else {
                ""
            };
            bail!("missing tensor `{name}` (expected shape {shape:?}){why}")
        };
        if &dims != shape {
            bail!("tensor `{name}`: expected shape {shape:?}, found {dims:?}")
        }
        check_float(name, dtype)?;
        if !needed {
            continue;
        }
        let values = read(name)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        engine.param_mut(name)?.copy_from_slice(&values);
    }
    if cfg.tie_word_embeddings {
        if let Some((dims, _)) = shapes.remove("lm_head.weight") {
            let want = [cfg.vocab_size, cfg.n_embd];
            if dims != want {
                bail!("tensor `lm_head.weight`: expected shape {want:?} (tied to embed_tokens), found {dims:?}")
            }
        }
    }
    let mut leftover: Vec<String> = shapes
        .into_keys()
        .filter(|n| !is_ignored_buffer(n))
        .collect();
    if !leftover.is_empty() {
        leftover.sort();
        bail!("tensors not in this model: {leftover:?} (wrong config?)")
    }
    Ok(())
}

/// The engine's parameters by name, as CPU f32 tensors (HF names).
pub fn export_tensors(engine: &Engine) -> Result<HashMap<String, Tensor>> {
    crate::common::hf::engine_tensors(engine)
}

/// Write HF tensors in HF layout under `path` (see
/// [`crate::common::hf::save`]: a directory, or a `.safetensors` file;
/// shards past `max_shard_bytes`) with this model's `config.json`. Returns
/// the files written.
pub fn save(
    tensors: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    tokenizer: &str,
    path: &Path,
    max_shard_bytes: usize,
) -> Result<Vec<PathBuf>> {
    crate::common::hf::save(tensors, &config_json(cfg, tokenizer), path, max_shard_bytes)
}

/// The names a Llama of this config has in HF files (for checks and tests).
pub fn names(cfg: &LlamaConfig) -> HashSet<String> {
    let mut out = HashSet::from([
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
    ]);
    if !cfg.tie_word_embeddings {
        out.insert("lm_head.weight".into());
    }
    for i in 0..cfg.n_layer {
        for s in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            out.insert(format!("model.layers.{i}.{s}.weight"));
        }
        if cfg.qkv_bias {
            for s in ["q_proj", "k_proj", "v_proj"] {
                out.insert(format!("model.layers.{i}.self_attn.{s}.bias"));
            }
        }
    }
    out
}
