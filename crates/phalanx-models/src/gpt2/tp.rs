//! GPT-2 under tensor parallelism: reading a rank's slices straight out of
//! a Hugging Face file. Which slice of each whole parameter a rank holds is
//! declared with the parameter in [`super::blocks`] (cutting, gathering and
//! placing shards are [`crate::common::tp`]'s):
//!
//! - `wte` (V, C): `Shard(0)` of the vocabulary padded to a multiple of tp
//!   (zeros past V);
//! - `attn.c_attn` weight (3C, C), bias (3C): `Shard(0)` in 3 groups, the q,
//!   k and v rows of this rank's heads;
//! - `mlp.c_fc`: `Shard(0)`; `attn.c_proj`, `mlp.c_proj` weights:
//!   `Shard(1)`, biases replicated;
//! - `wpe`, LayerNorms: replicated.
//!
//! Initialisation builds the whole model with the run's seed and keeps each
//! rank's slice, so a tensor-parallel run starts from exactly the
//! parameters of a single-rank run (and reproduces it).
//!
//! ```
//! use phalanx::engine::{Engine, EngineConfig, Rule};
//! use phalanx::tp::Tp;
//! use phalanx_models::gpt2::{blocks_tp, Gpt2Config};
//! let rules = phalanx_comm::threads::run(2, |pg| {
//!     let tp = Tp::new(pg, false);
//!     let cfg = Gpt2Config::new(1, 2, 4, 256, 8); // C = 4
//!     let e = Engine::new(blocks_tp(&cfg, Some(tp.clone())).unwrap(), &candle_core::Device::Cpu,
//!                         EngineConfig { defer_init: true, ..Default::default() }).unwrap();
//!     let p = |n: &str| e.layout().find(n).unwrap().rule(tp.rank(), 2);
//!     (p("transformer.h.0.attn.c_attn.weight"), p("transformer.h.0.attn.c_proj.bias"))
//! });
//! // Rank 1 of 2: its q, k and v rows of c_attn; c_proj's bias whole.
//! assert_eq!(rules[1], (Rule::Rows(vec![2..4, 6..8, 10..12]), Rule::Full));
//! ```

use super::{hf, Gpt2Config};
use crate::common::tp::shard_engine;
pub use crate::common::tp::{extract, Rule};
use candle_core::{Device, Result, Tensor};
use phalanx::engine::{Engine, EngineConfig};
use phalanx::tp::Tp;
use std::collections::HashMap;
use std::ops::Range;

/// Load an HF safetensors file: the file is memory-mapped and each rank
/// copies out only the bytes of its slices (rows, or the column range of
/// every row), so it reads only its shard. Missing or mis-shaped tensors are
/// errors naming them.
pub fn load_engine(
    cfg: &Gpt2Config,
    tp: &Tp,
    ecfg: EngineConfig,
    device: &Device,
    path: &std::path::Path,
) -> Result<Engine> {
    // SAFETY: the file is only read, and not expected to change while mapped.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path)? };
    let names: HashMap<String, Vec<usize>> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect();
    let kinds: Vec<(String, safetensors::Dtype)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype()))
        .collect();
    hf::check_file(&kinds, None)?;
    let blocks = super::blocks_tp(cfg, Some(tp.clone()))?;
    let engine = shard_engine(blocks, tp, ecfg, device, &|name, r, want| {
        let short = name.strip_prefix("transformer.").unwrap_or(name);
        let file_name = if names.contains_key(name) {
            name
        } else {
            short
        };
        let conv = hf::is_conv1d(name);
        // HF's Conv1D stores (in, out): the engine's rows are its columns.
        let want_file: Vec<usize> = if conv {
            vec![want[1], want[0]]
        } else {
            want.to_vec()
        };
        match names.get(file_name) {
            None => candle_core::bail!("missing tensor `{name}` (expected shape {want_file:?})"),
            Some(s) if *s != want_file => {
                candle_core::bail!(
                    "tensor `{file_name}`: expected shape {want_file:?}, found {s:?}"
                )
            }
            Some(_) => {}
        }
        let file_rule = match (conv, r) {
            (true, Rule::Rows(rs)) => {
                // Conv1D weights are only ever split in one range per output
                // block; c_attn's three (q, k, v) become three column ranges.
                return read_cols_multi(&st.get(file_name)?, rs)?.t()?.contiguous();
            }
            (true, Rule::Cols(c)) => Rule::Rows(vec![c.clone()]),
            (_, r) => r.clone(),
        };
        let t = read_slice(&st.get(file_name)?, &file_rule)?;
        if conv {
            t.t()?.contiguous()
        } else {
            Ok(t)
        }
    })?;
    // The same rules as a whole-model load (the names are global).
    let params = engine
        .layout()
        .params()
        .iter()
        .map(|p| p.name.clone())
        .collect();
    hf::check_file(&kinds, Some(&params))?;
    Ok(engine)
}

/// The f32 values of `n` elements starting at element `at` of a tensor view.
fn view_f32(v: &safetensors::tensor::TensorView<'_>, at: usize, n: usize) -> Result<Vec<f32>> {
    use safetensors::Dtype;
    let size = match v.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        d => candle_core::bail!("unsupported dtype {d:?} in checkpoint"),
    };
    let b = &v.data()[at * size..(at + n) * size];
    Ok(match v.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    })
}

/// Read a slice of a tensor view (file orientation): all of it, row ranges
/// (past-the-end rows are zero padding) or a column range of every row.
fn read_slice(v: &safetensors::tensor::TensorView<'_>, r: &Rule) -> Result<Tensor> {
    let shape = v.shape().to_vec();
    let row = shape.iter().skip(1).product::<usize>();
    let (data, out_shape) = match r {
        Rule::Full => (view_f32(v, 0, shape.iter().product())?, shape.clone()),
        Rule::Rows(ranges) => {
            let mut d = Vec::new();
            for rg in ranges {
                let have = rg.start.min(shape[0])..rg.end.min(shape[0]);
                d.extend(view_f32(v, have.start * row, have.len() * row)?);
                d.resize(d.len() + (rg.len() - have.len()) * row, 0.0);
            }
            let mut s = shape.clone();
            s[0] = ranges.iter().map(|x| x.len()).sum();
            (d, s)
        }
        Rule::Cols(c) => return read_cols_multi(v, std::slice::from_ref(c)),
    };
    // Host memory by design: file bytes on their way into the engine.
    Tensor::from_vec(data, out_shape, &Device::Cpu)
}

/// Column ranges of every row of a 2-D view, concatenated along columns.
fn read_cols_multi(
    v: &safetensors::tensor::TensorView<'_>,
    cols: &[Range<usize>],
) -> Result<Tensor> {
    let (rows, width) = (v.shape()[0], v.shape()[1]);
    let n: usize = cols.iter().map(|c| c.len()).sum();
    let mut d = Vec::with_capacity(rows * n);
    for r in 0..rows {
        for c in cols {
            d.extend(view_f32(v, r * width + c.start, c.len())?);
        }
    }
    // Host memory by design (as `read_slice`).
    Tensor::from_vec(d, (rows, n), &Device::Cpu)
}
