//! GPT-2 under tensor parallelism: which slice of each full parameter a
//! tensor-parallel rank holds ([`Gpt2Tp`]; cutting, gathering and placing
//! shards are [`crate::common::tp`]'s), and reading a rank's slices
//! straight out of a Hugging Face file.
//!
//! | parameter (engine layout, `Linear` = (out, in)) | rank t of tp holds |
//! |---|---|
//! | `wte` (V, C) | rows [t V'/tp, (t+1) V'/tp) of the vocabulary padded to V' (zeros past V) |
//! | `attn.c_attn` weight (3C, C), bias (3C) | the q, k and v rows of its heads: three row ranges |
//! | `attn.c_proj` weight (C, C) | columns [t C/tp, (t+1) C/tp); bias replicated |
//! | `mlp.c_fc` weight (4C, C), bias | rows [t 4C/tp, ...) |
//! | `mlp.c_proj` weight (C, 4C) | columns; bias replicated |
//! | `wpe`, LayerNorms | replicated |
//!
//! Initialisation builds the whole model with the run's seed and keeps each
//! rank's slice, so a tensor-parallel run starts from exactly the
//! parameters of a single-rank run (and reproduces it).
//!
//! ```
//! use phalanx_models::gpt2::tp::{rule, Rule};
//! // Rank 1 of 2, C = 4: its q, k and v rows of c_attn.
//! assert_eq!(rule("transformer.h.0.attn.c_attn.weight", &[12, 4], 256, 1, 2), Rule::Rows(vec![2..4, 6..8, 10..12]));
//! assert_eq!(rule("transformer.h.0.attn.c_proj.bias", &[4], 256, 1, 2), Rule::Full);
//! ```

use super::{hf, Gpt2Config};
pub use crate::common::tp::{extract, Rule};
use crate::common::tp::{shard_engine, TpLayout};
use candle_core::{Device, Result, Tensor};
use phalanx::engine::{Engine, EngineConfig};
use phalanx::tp::{padded_vocab, Tp};
use std::collections::HashMap;
use std::ops::Range;

/// GPT-2's [`TpLayout`]: [`rule`] and [`full_shape`] for a vocabulary.
pub struct Gpt2Tp {
    pub vocab: usize,
}

impl TpLayout for Gpt2Tp {
    fn full_shape(&self, name: &str, local: &[usize], size: usize) -> Vec<usize> {
        full_shape(name, local, self.vocab, size)
    }

    fn rule(&self, name: &str, full: &[usize], rank: usize, size: usize) -> Rule {
        rule(name, full, self.vocab, rank, size)
    }
}

/// The rule for parameter `name` of full shape `full` on rank `t` of `tp`.
pub fn rule(name: &str, full: &[usize], vocab: usize, t: usize, tp: usize) -> Rule {
    let part = |n: usize| (t * n / tp)..((t + 1) * n / tp);
    if tp == 1 {
        return Rule::Full;
    }
    if name.ends_with("wte.weight") {
        let rows = padded_vocab(vocab, tp) / tp;
        return Rule::Rows(std::iter::once(t * rows..(t + 1) * rows).collect());
    }
    if name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias") {
        let c = full[0] / 3;
        let p = part(c);
        return Rule::Rows((0..3).map(|k| k * c + p.start..k * c + p.end).collect());
    }
    if name.ends_with("mlp.c_fc.weight") || name.ends_with("mlp.c_fc.bias") {
        return Rule::Rows(vec![part(full[0])]);
    }
    if name.ends_with("attn.c_proj.weight") || name.ends_with("mlp.c_proj.weight") {
        return Rule::Cols(part(full[1]));
    }
    Rule::Full
}

/// The full shape of a parameter from one shard's shape.
pub fn full_shape(name: &str, local: &[usize], vocab: usize, tp: usize) -> Vec<usize> {
    let mut f = local.to_vec();
    match rule(
        name,
        &[local[0] * tp, *local.get(1).unwrap_or(&0) * tp],
        vocab,
        0,
        tp,
    ) {
        Rule::Full => {}
        Rule::Cols(_) => f[1] *= tp,
        Rule::Rows(_) if name.ends_with("wte.weight") => f[0] = vocab,
        Rule::Rows(_) => f[0] *= tp,
    }
    f
}

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
    let layout = Gpt2Tp {
        vocab: cfg.vocab_size,
    };
    let engine = shard_engine(blocks, &layout, tp, ecfg, device, &|name, r, want| {
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
