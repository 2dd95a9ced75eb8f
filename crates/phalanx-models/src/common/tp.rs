//! Tensor-parallel shards shared by every family: each parameter's
//! placement is declared where its block declares it
//! ([`phalanx::placement`]) and carried by the engine's layout;
//! cutting shards out of whole tensors, reassembling them, the ranges every
//! rank holds whole and the checkpoint placement follow from it here, once.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_models::common::tp::{extract, Rule};
//! let t = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((6, 2)).unwrap();
//! // Two row ranges (as GPT-2's q, k, v of one rank), then padding past the end.
//! let s = extract(&t, &Rule::Rows(vec![1..2, 5..7])).unwrap();
//! assert_eq!(s.to_vec2::<f32>().unwrap(), [[2., 3.], [10., 11.], [0., 0.]]);
//! assert_eq!(extract(&t, &Rule::Cols(1..2)).unwrap().dims(), &[6, 1]);
//! ```

use candle_core::{Device, Result, Tensor};
use phalanx::engine::{Block, Engine, EngineConfig, ParamInfo};
use phalanx::tp::Tp;
use std::collections::HashMap;
use std::ops::Range;

pub use phalanx::placement::{Placement, Rule};

/// Returns this rank's slice of parameter `name` given its rule and full shape.
pub type ShardFn<'a> = dyn Fn(&str, &Rule, &[usize]) -> Result<Tensor> + 'a;

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

/// Reassemble parameter `p`'s whole tensor from every rank's shard (rank
/// order), by its declared placement.
pub fn assemble(p: &ParamInfo, shards: &[Tensor]) -> Result<Tensor> {
    let tp = shards.len();
    let full = p.full_shape(tp);
    match p.rule(0, tp) {
        Rule::Full => Ok(shards[0].clone()),
        Rule::Cols(_) => Tensor::cat(shards, 1),
        Rule::Rows(_) => {
            // Place each rank's row ranges, then drop the padding.
            let mut rows: Vec<(usize, Tensor)> = Vec::new();
            for (t, s) in shards.iter().enumerate() {
                let Rule::Rows(ranges) = p.rule(t, tp) else {
                    unreachable!("a parameter's rule is of one kind on every rank")
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

/// A tensor-parallel engine of `blocks` (one rank's) whose parameters come
/// from `shard(name, rule, full_shape)`, this rank's slice (engine
/// orientation) by the parameter's declared placement.
pub fn shard_engine(
    blocks: Vec<Box<dyn Block>>,
    tp: &Tp,
    ecfg: EngineConfig,
    device: &Device,
    shard: &ShardFn,
) -> Result<Engine> {
    let mut engine = Engine::new(blocks, device, ecfg)?;
    fill_shards(&mut engine, tp, shard)?;
    Ok(engine)
}

/// Fill a tensor-parallel engine's parameters with `shard(name, rule,
/// full_shape)`, this rank's slice by each parameter's declared placement.
pub fn fill_shards(engine: &mut Engine, tp: &Tp, shard: &ShardFn) -> Result<()> {
    let layout = engine.layout().clone();
    engine.fill_params(&mut |name, _shape| {
        let Some(p) = layout.find(name) else {
            candle_core::bail!("parameter `{name}` is not in the layout")
        };
        shard(
            name,
            &p.rule(tp.rank(), tp.size()),
            &p.full_shape(tp.size()),
        )
    })
}

/// Initialise: the whole model (`whole`) with `ecfg.seed`, then this rank's
/// slices into an engine of `blocks`, so a tensor-parallel run starts from
/// exactly the parameters of a one-rank run.
pub fn init_engine(
    whole: Vec<Box<dyn Block>>,
    blocks: Vec<Box<dyn Block>>,
    tp: &Tp,
    ecfg: EngineConfig,
    device: &Device,
) -> Result<Engine> {
    let eager = EngineConfig {
        defer_init: false,
        ..ecfg
    };
    let full = Engine::new(whole, device, eager)?;
    shard_engine(blocks, tp, ecfg, device, &|name, r, _| {
        extract(&full.param_tensor(name)?, r)
    })
}

/// The whole model's parameters (engine names and orientation), gathered
/// from every tensor-parallel rank (collective over the tp group).
pub fn gather_full(engine: &Engine, tp: &Tp) -> phalanx::Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for p in engine.layout().params() {
        let local = engine.param(&p.name)?;
        let mut all = vec![0f32; local.len() * tp.size()];
        tp.pg.all_gather(local, &mut all)?;
        let shards: Vec<Tensor> = all
            .chunks(local.len().max(1))
            // Host memory by design: the engine's flat buffers live there.
            .map(|c| Tensor::from_slice(c, p.shape.as_slice(), &Device::Cpu))
            .collect::<Result<_>>()?;
        out.insert(p.name.clone(), assemble(p, &shards)?);
    }
    Ok(out)
}

/// Flat ranges of the parameters every tensor-parallel rank holds whole
/// (norms, replicated biases, replicated kv projections). Under sequence
/// parallelism their gradients are partial sums over the sequence chunks
/// and must be summed over the tp group; in the global gradient norm they
/// count once.
pub fn replicated_ranges(engine: &Engine, tp: usize) -> Vec<Range<usize>> {
    engine
        .layout()
        .params()
        .iter()
        .filter(|p| p.rule(0, tp) == Rule::Full)
        .map(|p| p.range())
        .collect()
}

/// Where this tp rank's parameters sit in the full tensors, for
/// checkpoints: the slices of their declared placements (several row
/// ranges, the vocabulary-parallel rows without their padding, the
/// row-parallel columns).
pub struct TpPlacement {
    pub rank: usize,
    pub size: usize,
}

impl phalanx::checkpoint::Placement for TpPlacement {
    fn place(&self, p: &ParamInfo) -> phalanx::checkpoint::Placed {
        use phalanx::checkpoint::Placed;
        let full = p.full_shape(self.size);
        match p.rule(self.rank, self.size) {
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
