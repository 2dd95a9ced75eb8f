//! Hugging Face `GPT2LMHeadModel` safetensors: import and export.
//!
//! Names are HF's: `transformer.wte.weight`, `transformer.wpe.weight`,
//! `transformer.h.{i}.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}.{weight,bias}`,
//! `transformer.ln_f.{weight,bias}`. The engine uses the same names.
//!
//! Layouts: HF's `Conv1D` (c_attn, c_proj, c_fc weights) stores (in, out), the
//! engine stores candle `Linear`s (out, in): those four weights are
//! transposed on the way in and out; everything else is copied as is.
//!
//! Import accepts what HF files contain in practice: names with or without
//! the `transformer.` prefix, `lm_head.weight` present or absent (it is tied
//! to wte; when present only its shape is checked), and the non-parameter
//! buffers `h.{i}.attn.bias` / `h.{i}.attn.masked_bias` (ignored). f16/bf16
//! files are converted to f32. A missing or mis-shaped tensor, or a tensor
//! the model does not have (e.g. a deeper model's layer), is an error naming
//! it. Export writes the names with the prefix and no `lm_head.weight`, as
//! `save_pretrained` does for tied weights.
//!
//! ```no_run
//! use phalanx_models::gpt2::{self, Gpt2Config};
//! let mut engine = gpt2::engine(&Gpt2Config::gpt2_124m(), &candle_core::Device::Cpu, Default::default()).unwrap();
//! gpt2::hf::load_safetensors(&mut engine, "model.safetensors").unwrap();
//! gpt2::hf::save_safetensors(&engine, "out.safetensors").unwrap();
//! ```

use std::collections::HashMap;
use std::path::Path;

use candle_core::{bail, DType, Device, Result, Tensor};
use phalanx::engine::Engine;

const CONV1D_SUFFIXES: [&str; 4] = [
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
];

/// Is this (engine or HF) name one of HF's `Conv1D` weights, stored (in, out)?
pub fn is_conv1d(name: &str) -> bool {
    CONV1D_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// The name without the `transformer.` prefix (how many HF files spell it).
fn short(name: &str) -> &str {
    name.strip_prefix("transformer.").unwrap_or(name)
}

/// Non-parameter tensors HF files may carry.
fn is_ignored_buffer(short_name: &str) -> bool {
    short_name.ends_with(".attn.bias") || short_name.ends_with(".attn.masked_bias")
}

/// The rules every load follows, whatever the layout: parameters are float
/// tensors (f32, f16, bf16; an integer tensor is refused, not converted),
/// and a file may hold only this model's parameters, the tied
/// `lm_head.weight` and HF's attention buffers (checked when `params` is
/// given). Returns the first breach.
pub fn check_file(
    tensors: &[(String, safetensors::Dtype)],
    params: Option<&std::collections::HashSet<String>>,
) -> Result<()> {
    use safetensors::Dtype;
    let mut foreign = Vec::new();
    for (name, dtype) in tensors {
        let s = short(name);
        if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) && !is_ignored_buffer(s) {
            bail!("tensor `{name}` is {dtype:?}; parameters must be f32, f16 or bf16")
        }
        let Some(params) = params else { continue };
        let known = params.contains(s) || params.contains(&format!("transformer.{s}"));
        if !known && s != "lm_head.weight" && !is_ignored_buffer(s) {
            foreign.push(name.clone());
        }
    }
    if !foreign.is_empty() {
        foreign.sort();
        bail!("tensors not in this model: {foreign:?} (wrong config?)")
    }
    Ok(())
}

/// The shape a parameter has in an HF file.
fn hf_shape(name: &str, shape: &[usize]) -> Vec<usize> {
    if is_conv1d(name) {
        vec![shape[1], shape[0]]
    } else {
        shape.to_vec()
    }
}

/// The engine's parameters as HF tensors (CPU, f32), Conv1D weights transposed.
pub fn export_tensors(engine: &Engine) -> Result<HashMap<String, Tensor>> {
    let mut named = HashMap::new();
    for p in engine.layout().params() {
        // Host memory by design: the flat buffers, on their way to a file.
        let t = Tensor::from_slice(engine.param(&p.name)?, p.shape.as_slice(), &Device::Cpu)?;
        named.insert(p.name.clone(), t);
    }
    to_hf(named)
}

/// Full parameters in engine orientation -> HF tensors (Conv1D transposed).
pub fn to_hf(named: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    named
        .into_iter()
        .map(|(name, t)| {
            let t = if is_conv1d(&name) {
                t.t()?.contiguous()?
            } else {
                t
            };
            Ok((name, t))
        })
        .collect()
}

/// Write the engine's parameters as an HF `GPT2LMHeadModel` safetensors file.
pub fn save_safetensors(engine: &Engine, path: impl AsRef<Path>) -> Result<()> {
    let t = export_tensors(engine)?;
    let mut sorted: Vec<(&String, &Tensor)> = t.iter().collect();
    sorted.sort_by_key(|(n, _)| *n);
    let bytes = safetensors::serialize(sorted, crate::common::hf::pt_metadata())
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.as_ref().display())))?;
    phalanx::fsutil::write_atomic(path.as_ref(), &bytes).map_err(candle_core::Error::wrap)
}

/// Put the file's tensors into the engine (names and shapes checked).
pub fn import_tensors(engine: &mut Engine, tensors: HashMap<String, Tensor>) -> Result<()> {
    let entries = tensors
        .into_iter()
        .map(|(name, t)| (name, (t.dims().to_vec(), Some(t))))
        .collect();
    import_entries(engine, entries, &|_| {
        unreachable!("every tensor is in memory")
    })
}

/// A file's tensor: its shape, and its values when already in memory.
type Entry = (Vec<usize>, Option<Tensor>);

/// The import: every engine parameter must be in `entries` with its HF
/// shape; the values of those the engine holds are read (`read(name)` for
/// entries not in memory), the others are checked by shape only (a
/// pipeline stage reads only its own blocks' tensors).
fn import_entries(
    engine: &mut Engine,
    entries: HashMap<String, Entry>,
    read: &dyn Fn(&str) -> Result<Tensor>,
) -> Result<()> {
    // Index the file by short name; refuse a name given twice (with and
    // without the prefix) since we could not tell which one is meant.
    let mut by_short: HashMap<String, (String, Entry)> = HashMap::new();
    for (name, e) in entries {
        let s = short(&name).to_string();
        if let Some((other, _)) = by_short.get(&s) {
            bail!("tensors `{name}` and `{other}` name the same parameter")
        }
        by_short.insert(s, (name, e));
    }
    for (name, shape, needed) in &crate::common::hf::params_held(engine) {
        let want = hf_shape(name, shape);
        let Some((file_name, (dims, t))) = by_short.remove(short(name)) else {
            bail!("missing tensor `{name}` (expected shape {want:?})")
        };
        if dims != want {
            bail!("tensor `{file_name}`: expected shape {want:?}, found {dims:?}")
        }
        if !needed {
            continue;
        }
        let t = match t {
            Some(t) => t,
            None => read(&file_name)?,
        };
        let t = t.to_dtype(DType::F32)?;
        let t = if is_conv1d(name) { t.t()? } else { t };
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        engine.param_mut(name)?.copy_from_slice(&values);
    }
    // What is left must be the tied head or known buffers.
    let wte = engine
        .layout()
        .find("transformer.wte.weight")
        .map(|p| p.shape.clone());
    let mut leftover: Vec<String> = Vec::new();
    for (s, (file_name, (dims, _))) in by_short {
        if s == "lm_head.weight" {
            if Some(dims.clone()) != wte {
                bail!(
                    "tensor `lm_head.weight`: expected shape {:?} (tied to wte), found {:?}",
                    wte.unwrap_or_default(),
                    dims
                )
            }
        } else if !is_ignored_buffer(&s) {
            leftover.push(file_name);
        }
    }
    if !leftover.is_empty() {
        leftover.sort();
        bail!("tensors not in this model: {leftover:?} (wrong config?)")
    }
    Ok(())
}

/// Load an HF `GPT2LMHeadModel` safetensors file into the engine. The file
/// is memory-mapped and only the tensors the engine holds are read (all of
/// them, unless the engine is a pipeline stage).
pub fn load_safetensors(engine: &mut Engine, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let ctx = |e: candle_core::Error| e.context(format!("reading {}", path.display()));
    // Safety: the file is only read, and not expected to change while loading.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(ctx)?;
    // Dtypes first; names (missing ones, then foreign ones) as the import
    // goes.
    let kinds: Vec<(String, safetensors::Dtype)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype()))
        .collect();
    check_file(&kinds, None)?;
    let entries = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.shape().to_vec(), None)))
        .collect();
    import_entries(engine, entries, &|name| {
        // Host memory by design: file bytes, copied into the engine's buffers.
        st.load(name, &Device::Cpu).map_err(ctx)
    })
}

/// As [`load_safetensors`], from bytes in memory.
pub fn load_safetensors_bytes(engine: &mut Engine, bytes: &[u8]) -> Result<()> {
    import_tensors(
        engine,
        // Host memory by design (file bytes).
        candle_core::safetensors::load_buffer(bytes, &Device::Cpu)?,
    )
}
