//! Hugging Face `LlamaForCausalLM` weights: import and export.
//!
//! Names are HF's and the engine's alike (nn.Linear stores (out, in), as
//! the engine does, so nothing is transposed):
//! `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`,
//! `model.layers.{i}.{input,post_attention}_layernorm.weight`,
//! `model.norm.weight`, `lm_head.weight` (absent when tied).
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, DType, Device, Result, Tensor};
use phalanx::engine::Engine;
use serde_json::{json, Value};

use super::config::LlamaConfig;
pub use super::hf_config::{
    check_config, config_from_json, config_json, overrides_from_config, read_config, rope_scaling,
    rope_theta,
};

/// The index file of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";
/// The single-file checkpoint.
pub const SINGLE: &str = "model.safetensors";
/// HF's default `max_shard_size` (5 GB).
pub const DEFAULT_SHARD_BYTES: usize = 5_000_000_000;

/// The safetensors files of a checkpoint given as a file, an index or a
/// directory, and the directory (where `config.json` would be).
pub fn resolve(path: &Path) -> Result<(Vec<PathBuf>, PathBuf)> {
    let (index, single) = if path.is_dir() {
        (path.join(INDEX), path.join(SINGLE))
    } else if path.to_string_lossy().ends_with(".json") {
        (path.to_path_buf(), PathBuf::new())
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        return Ok((vec![path.to_path_buf()], dir));
    };
    let dir = index.parent().unwrap_or(Path::new(".")).to_path_buf();
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", index.display())))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", index.display())))?;
        let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
            bail!("{}: no `weight_map` object", index.display())
        };
        let mut files: Vec<String> = map
            .values()
            .map(|f| f.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "{}: weight_map values must be file names",
                    index.display()
                ))
            })?;
        files.sort();
        files.dedup();
        let mut out = Vec::new();
        for f in files {
            if f.contains('/') || f.contains("..") {
                bail!(
                    "{}: shard name {f:?} must be a file beside the index",
                    index.display()
                )
            }
            out.push(dir.join(f));
        }
        return Ok((out, dir));
    }
    if single.is_file() {
        return Ok((vec![single], dir));
    }
    bail!("{}: neither {INDEX} nor {SINGLE} found", path.display())
}

/// Load an HF Llama checkpoint (file, index or directory) into the engine;
/// a `config.json` beside it is checked against `cfg` first.
pub fn load(engine: &mut Engine, cfg: &LlamaConfig, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let (files, dir) = resolve(path)?;
    if let Some(v) = read_config(&dir)? {
        check_config(&v, cfg)?;
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
    import(engine, cfg, shapes, &|name| st.load(name, &Device::Cpu))
}

/// Non-parameter tensors old HF files carry.
fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

type Shapes = HashMap<String, (Vec<usize>, safetensors::Dtype)>;

/// Check names, shapes and dtypes, then copy in what the engine holds.
fn import(
    engine: &mut Engine,
    cfg: &LlamaConfig,
    mut shapes: Shapes,
    read: &dyn Fn(&str) -> Result<Tensor>,
) -> Result<()> {
    use safetensors::Dtype;
    let held = engine.held().map(|h| h.to_vec());
    let params: Vec<(String, Vec<usize>, std::ops::Range<usize>)> = engine
        .layout()
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), p.range()))
        .collect();
    for (name, shape, range) in &params {
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
        if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64) {
            bail!("tensor `{name}` is {dtype:?}; parameters must be floats")
        }
        let needed = held
            .as_ref()
            .is_none_or(|h| h.iter().any(|k| k.start < range.end && range.start < k.end));
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
    engine
        .layout()
        .params()
        .iter()
        .map(|p| Ok((p.name.clone(), engine.param_tensor(&p.name)?)))
        .collect()
}

/// Write HF tensors in HF layout under `path`: a directory (created) that
/// gets `model.safetensors` (or shards + index past `max_shard_bytes`) and
/// `config.json`; a path ending in `.safetensors` is that file, with
/// `config.json` beside it (never sharded). Files are written atomically.
/// Returns the files written.
pub fn save(
    tensors: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    tokenizer: &str,
    path: &Path,
    max_shard_bytes: usize,
) -> Result<Vec<PathBuf>> {
    let io = |p: &Path, e: String| candle_core::Error::Msg(format!("{}: {e}", p.display()));
    let single_file = path.to_string_lossy().ends_with(".safetensors");
    let dir = if single_file {
        path.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    } else {
        path.to_path_buf()
    };
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e.to_string()))?;
    // Sorted by name, then cut into shards by size (every shard non-empty).
    let mut sorted: Vec<(&String, &Tensor)> = tensors.iter().collect();
    sorted.sort_by_key(|(n, _)| *n);
    let mut shards: Vec<Vec<(&String, &Tensor)>> = vec![vec![]];
    let mut size = 0;
    for (n, t) in sorted {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        let cur = shards.last_mut().expect("one shard");
        if !single_file && !cur.is_empty() && size + bytes > max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += bytes;
        shards.last_mut().expect("one shard").push((n, t));
    }
    let write = |p: &Path, items: &[(&String, &Tensor)]| -> Result<()> {
        let meta: HashMap<String, String> =
            HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes = safetensors::serialize(items.iter().copied(), Some(meta))
            .map_err(|e| io(p, e.to_string()))?;
        phalanx::fsutil::write_atomic(p, &bytes).map_err(|e| io(p, e.to_string()))
    };
    if !single_file {
        // A directory saved to before keeps no other layout: a stale index
        // would win over a new model.safetensors when loading.
        remove_previous(&dir)?;
    }
    let mut written = Vec::new();
    if shards.len() == 1 {
        let p = if single_file {
            path.to_path_buf()
        } else {
            dir.join(SINGLE)
        };
        write(&p, &shards[0])?;
        written.push(p);
    } else {
        let n = shards.len();
        let mut map = BTreeMap::new();
        let mut total = 0;
        for (k, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            for (t, v) in shard {
                map.insert(t.to_string(), name.clone());
                total += v.elem_count() * v.dtype().size_in_bytes();
            }
            let p = dir.join(&name);
            write(&p, shard)?;
            written.push(p);
        }
        let index = json!({ "metadata": { "total_size": total }, "weight_map": map });
        let p = dir.join(INDEX);
        phalanx::fsutil::write_atomic(&p, serde_json::to_string_pretty(&index).unwrap().as_bytes())
            .map_err(|e| io(&p, e.to_string()))?;
        written.push(p);
    }
    let p = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config_json(cfg, tokenizer)).unwrap();
    phalanx::fsutil::write_atomic(&p, text.as_bytes()).map_err(|e| io(&p, e.to_string()))?;
    written.push(p);
    Ok(written)
}

/// Remove a checkpoint saved in `dir` before: `model.safetensors`, or the
/// index and the shards it names (nothing else in the directory).
fn remove_previous(dir: &Path) -> Result<()> {
    let rm = |p: &Path| match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(candle_core::Error::Msg(format!("{}: {e}", p.display())))
        }
        _ => Ok(()),
    };
    if dir.join(INDEX).is_file() {
        for f in resolve(&dir.join(INDEX))?.0 {
            rm(&f)?;
        }
        rm(&dir.join(INDEX))?;
    }
    rm(&dir.join(SINGLE))
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
    }
    out
}
