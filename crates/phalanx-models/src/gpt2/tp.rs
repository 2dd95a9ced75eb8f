//! GPT-2 under tensor parallelism: which slice of each full parameter a
//! tensor-parallel rank holds, and moving whole models in and out of shards
//! (initialisation, Hugging Face import and export).
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
use candle_core::{Device, Result, Tensor};
use phalanx::engine::{Engine, EngineConfig};
use phalanx::tp::{padded_vocab, Tp};
use std::collections::HashMap;
use std::ops::Range;

/// Returns this rank's slice of parameter `name` given its rule and full shape.
pub type ShardFn<'a> = dyn Fn(&str, &Rule, &[usize]) -> Result<Tensor> + 'a;

/// How rank t's shard is cut from the full parameter (engine orientation).
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    Full,
    /// Rows (dim 0), possibly several ranges concatenated; rows past the
    /// full tensor's end are zero padding.
    Rows(Vec<Range<usize>>),
    /// Columns (dim 1).
    Cols(Range<usize>),
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

/// Cut rank t's shard from the full tensor.
pub fn extract(full: &Tensor, r: &Rule) -> Result<Tensor> {
    match r {
        Rule::Full => Ok(full.clone()),
        Rule::Cols(c) => full.narrow(1, c.start, c.len())?.contiguous(),
        Rule::Rows(ranges) => {
            let n = full.dims()[0];
            let mut parts = Vec::new();
            for rg in ranges {
                let have = rg.start.min(n)..rg.end.min(n);
                if !have.is_empty() {
                    parts.push(full.narrow(0, have.start, have.len())?);
                }
                if have.len() < rg.len() {
                    let mut shape = full.dims().to_vec();
                    shape[0] = rg.len() - have.len();
                    parts.push(Tensor::zeros(shape, full.dtype(), full.device())?);
                }
            }
            Tensor::cat(&parts, 0)
        }
    }
}

/// Reassemble a full tensor of shape `full` from every rank's shard.
pub fn assemble(name: &str, full: &[usize], vocab: usize, shards: &[Tensor]) -> Result<Tensor> {
    let tp = shards.len();
    match rule(name, full, vocab, 0, tp) {
        Rule::Full => Ok(shards[0].clone()),
        Rule::Cols(_) => Tensor::cat(shards, 1),
        Rule::Rows(_) => {
            // Place each rank's row ranges, then drop the padding.
            let mut rows: Vec<(usize, Tensor)> = Vec::new();
            for (t, s) in shards.iter().enumerate() {
                let Rule::Rows(ranges) = rule(name, full, vocab, t, tp) else {
                    unreachable!()
                };
                let mut off = 0;
                for rg in ranges {
                    rows.push((rg.start, s.narrow(0, off, rg.len())?));
                    off += rg.len();
                }
            }
            rows.sort_by_key(|r| r.0);
            let all = Tensor::cat(&rows.into_iter().map(|r| r.1).collect::<Vec<_>>(), 0)?;
            all.narrow(0, 0, full[0])
        }
    }
}

/// A tensor-parallel GPT-2 engine whose parameters come from `shard(name,
/// rule, full_shape)`, which returns this rank's slice (engine orientation).
pub fn shard_engine(
    cfg: &Gpt2Config,
    tp: &Tp,
    ecfg: EngineConfig,
    shard: &ShardFn,
) -> Result<Engine> {
    let mut engine = Engine::new(super::blocks_tp(cfg, Some(tp.clone()))?, &Device::Cpu, ecfg)?;
    engine.fill_params(&mut |name, shape| {
        let full = full_shape(name, shape, cfg.vocab_size, tp.size());
        shard(
            name,
            &rule(name, &full, cfg.vocab_size, tp.rank(), tp.size()),
            &full,
        )
    })?;
    Ok(engine)
}

/// Initialise: the whole model with `ecfg.seed`, then this rank's slices.
pub fn init_engine(cfg: &Gpt2Config, tp: &Tp, ecfg: EngineConfig) -> Result<Engine> {
    let eager = EngineConfig {
        defer_init: false,
        ..ecfg
    };
    let full = super::engine(cfg, &Device::Cpu, eager)?;
    shard_engine(cfg, tp, ecfg, &|name, r, _| {
        extract(&full.param_tensor(name)?, r)
    })
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
    let engine = shard_engine(cfg, tp, ecfg, &|name, r, want| {
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
    Tensor::from_vec(d, (rows, n), &Device::Cpu)
}

/// The whole model's parameters (engine names and orientation), gathered
/// from every tensor-parallel rank (collective over the tp group).
pub fn gather_full(
    engine: &Engine,
    cfg: &Gpt2Config,
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
        let full = full_shape(&p.name, &p.shape, cfg.vocab_size, tp.size());
        out.insert(
            p.name.clone(),
            assemble(&p.name, &full, cfg.vocab_size, &shards)?,
        );
    }
    Ok(out)
}

/// Flat ranges of the parameters every tensor-parallel rank holds whole
/// (LayerNorms, wpe, row-parallel biases). Under sequence parallelism their
/// gradients are partial sums over the sequence chunks and must be summed
/// over the tp group; and in the global gradient norm they count once.
pub fn replicated_ranges(engine: &Engine, cfg: &Gpt2Config, tp: usize) -> Vec<Range<usize>> {
    engine
        .layout()
        .params()
        .iter()
        .filter(|p| rule(&p.name, &p.shape, cfg.vocab_size, 0, tp) == Rule::Full)
        .map(|p| p.range())
        .collect()
}

/// Where this tp rank's parameters sit in the full tensors, for
/// checkpoints: the slices of [`rule`] (c_attn's three row ranges, the
/// vocab-parallel rows without their padding, the row-parallel columns).
pub struct TpPlacement {
    pub vocab: usize,
    pub rank: usize,
    pub size: usize,
}

impl phalanx::checkpoint::Placement for TpPlacement {
    fn place(&self, p: &phalanx::engine::ParamInfo) -> phalanx::checkpoint::Placed {
        use phalanx::checkpoint::Placed;
        let full = full_shape(&p.name, &p.shape, self.vocab, self.size);
        match rule(&p.name, &full, self.vocab, self.rank, self.size) {
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
                        let mut off = vec![0; full.len()];
                        off[0] = have.start;
                        blocks.push((at..at + have.len(), off));
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
