//! The parameter index: where every named parameter lives in the flat buffers.
//!
//! Order (stable, documented, the same on every rank): block order, then
//! parameter name order (byte-wise sort) inside a block. Parameter `k` of the
//! model occupies `offset..offset + numel` of the flat parameter buffer, and
//! the same range of the flat gradient and optimizer-state buffers. A block's
//! parameters are contiguous: block `b` owns `blocks[b].range`.
//!
//! Tied parameters: a name requested by several blocks is one parameter,
//! owned by the first block that asks for it (lowest index). Later blocks list
//! it in `BlockLayout::tied`; their gradient contribution is added to the
//! owner's gradient slot, so the owner's gradient is the sum of all uses.
//!
//! ```
//! use phalanx::engine::{Layout, ParamDecl};
//! let layout = Layout::new(vec![
//!     vec![ParamDecl::new("emb.weight", &[10, 4])],
//!     vec![ParamDecl::new("fc.weight", &[4, 4]), ParamDecl::new("fc.bias", &[4])],
//!     vec![ParamDecl::new("emb.weight", &[10, 4])], // tied to block 0
//! ]).unwrap();
//! assert_eq!(layout.num_params(), 40 + 16 + 4);
//! let bias = layout.find("fc.bias").unwrap(); // "fc.bias" sorts before "fc.weight"
//! assert_eq!((bias.block, bias.offset), (1, 40));
//! assert_eq!(layout.block(2).tied, vec![0]);
//! ```

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{bail, Result};
use candle_nn::Init;

use crate::placement::{Placement, Rule};

/// The most parameters a model may hold: 2^40 (about 10^12, 4 TiB in
/// f32), as a checkpoint may record; beyond it sizes are a mistake, and
/// their products could wrap.
pub const MAX_PARAMS: usize = 1 << 40;

/// A parameter as a block asks for it (name, shape, initialisation hint,
/// tensor-parallel placement).
#[derive(Debug, Clone)]
pub struct ParamDecl {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// How the whole tensor is laid over the tp ranks (`shape` is one
    /// rank's); see [`crate::placement`].
    pub placement: Placement,
}

impl ParamDecl {
    pub fn new(name: &str, shape: &[usize]) -> Self {
        Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            init: Init::Const(0.0),
            placement: Placement::Replicate,
        }
    }

    /// With a tensor-parallel placement.
    pub fn placed(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }
}

/// One parameter in the flat buffers.
#[derive(Debug, Clone)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<usize>,
    /// The block that owns it.
    pub block: usize,
    /// Start in the flat buffer (global, in elements).
    pub offset: usize,
    pub numel: usize,
    pub init: Init,
    /// As declared (see [`crate::placement`]): `shape` is this tp rank's.
    pub placement: Placement,
}

impl ParamInfo {
    /// Global range in the flat buffers.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }

    /// Matrices (ndim >= 2: linear weights, embeddings) get weight decay;
    /// biases and LayerNorm gains do not, as in nanoGPT.
    pub fn is_matrix(&self) -> bool {
        self.shape.len() >= 2
    }

    /// The whole (one-rank) shape over `tp` tensor-parallel ranks.
    pub fn full_shape(&self, tp: usize) -> Vec<usize> {
        self.placement.full_shape(&self.shape, tp)
    }

    /// The slice of the whole tensor tp rank `rank` of `tp` holds.
    pub fn rule(&self, rank: usize, tp: usize) -> Rule {
        self.placement.rule(&self.shape, rank, tp)
    }
}

/// One block's share of the flat buffers.
#[derive(Debug, Clone)]
pub struct BlockLayout {
    /// Global range of the parameters this block owns.
    pub range: Range<usize>,
    /// Indices (into `Layout::params`) of the parameters it owns.
    pub params: Range<usize>,
    /// Indices of parameters owned by earlier blocks that it also uses.
    pub tied: Vec<usize>,
}

/// The index of all parameters: `(name, shape, offset)` in a stable order.
#[derive(Debug, Clone)]
pub struct Layout {
    params: Vec<ParamInfo>,
    blocks: Vec<BlockLayout>,
    by_name: HashMap<String, usize>,
    total: usize,
}

impl Layout {
    /// Build the index from what each block asked for, in block order.
    pub fn new(requests: Vec<Vec<ParamDecl>>) -> Result<Self> {
        let mut params: Vec<ParamInfo> = Vec::new();
        let mut blocks = Vec::with_capacity(requests.len());
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut offset = 0;
        for (b, mut decls) in requests.into_iter().enumerate() {
            // Name order inside a block; a name asked twice by one block is
            // one parameter, and both requests must agree on what it is.
            decls.sort_by(|a, b| a.name.cmp(&b.name));
            for w in decls.windows(2) {
                let (x, y) = (&w[0], &w[1]);
                if x.name == y.name && (x.shape != y.shape || x.placement != y.placement) {
                    bail!(
                        "block {b} requests parameter `{}` twice, as {:?} placed {:?} and as {:?} \
                         placed {:?}",
                        x.name,
                        x.shape,
                        x.placement,
                        y.shape,
                        y.placement
                    );
                }
            }
            decls.dedup_by(|a, b| a.name == b.name);
            let first = params.len();
            let start = offset;
            let mut tied = Vec::new();
            for d in decls {
                if let Some(&k) = by_name.get(&d.name) {
                    let owner = &params[k];
                    if owner.shape != d.shape {
                        bail!(
                            "parameter `{}` is requested by block {b} with shape {:?} but block {} \
                             declared it with shape {:?}",
                            d.name,
                            d.shape,
                            owner.block,
                            owner.shape
                        );
                    }
                    // A tied use that declares a placement declares the owner's.
                    if d.placement != Placement::Replicate && d.placement != owner.placement {
                        bail!(
                            "parameter `{}` is requested by block {b} placed {:?} but block {} \
                             declared it placed {:?}",
                            d.name,
                            d.placement,
                            owner.block,
                            owner.placement
                        );
                    }
                    tied.push(k);
                    continue;
                }
                let numel = crate::ledger::checked_numel(&d.shape)
                    .filter(|&n| n <= MAX_PARAMS)
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "parameter `{}` of shape {:?} holds more than {MAX_PARAMS} values",
                            d.name, d.shape
                        ))
                    })?;
                by_name.insert(d.name.clone(), params.len());
                params.push(ParamInfo {
                    name: d.name,
                    shape: d.shape,
                    block: b,
                    offset,
                    numel,
                    init: d.init,
                    placement: d.placement,
                });
                offset += numel;
                if offset > MAX_PARAMS {
                    bail!("the model holds more than {MAX_PARAMS} parameters (2^40)");
                }
            }
            tied.sort_unstable();
            blocks.push(BlockLayout {
                range: start..offset,
                params: first..params.len(),
                tied,
            });
        }
        Ok(Self {
            params,
            blocks,
            by_name,
            total: offset,
        })
    }

    /// Total number of scalar parameters (ties counted once).
    pub fn num_params(&self) -> usize {
        self.total
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    pub fn blocks(&self) -> &[BlockLayout] {
        &self.blocks
    }

    pub fn block(&self, b: usize) -> &BlockLayout {
        &self.blocks[b]
    }

    /// Index of a parameter by name.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn find(&self, name: &str) -> Option<&ParamInfo> {
        self.index_of(name).map(|k| &self.params[k])
    }

    /// The parameters a block reads: the ones it owns, then the tied ones.
    pub fn block_param_indices(&self, b: usize) -> impl Iterator<Item = usize> + '_ {
        let bl = &self.blocks[b];
        bl.params.clone().chain(bl.tied.iter().copied())
    }

    /// The weight-decay mask of `range` (global), run-length encoded: segments
    /// relative to `range.start` with `true` where the element belongs to a
    /// matrix. This is the per-element mask a ZeRO-1 shard needs, compressed.
    pub fn decay_segments(&self, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let mut out: Vec<(Range<usize>, bool)> = Vec::new();
        for p in &self.params {
            let lo = p.offset.max(range.start);
            let hi = (p.offset + p.numel).min(range.end);
            if lo >= hi {
                continue;
            }
            let seg = (lo - range.start)..(hi - range.start);
            match out.last_mut() {
                Some((last, d)) if *d == p.is_matrix() && last.end == seg.start => {
                    last.end = seg.end
                }
                _ => out.push((seg, p.is_matrix())),
            }
        }
        out
    }

    /// The weight-decay mask of `range` as one flag per element.
    pub fn decay_mask(&self, range: Range<usize>) -> Vec<bool> {
        let mut mask = vec![false; range.len()];
        for (seg, d) in self.decay_segments(range) {
            mask[seg].fill(d);
        }
        mask
    }

    /// Rank `rank`'s shard of the flat buffer among `world` ranks: equal
    /// chunks of `ceil(n / world)`, the last one shorter (possibly empty), so
    /// any size works. Padding, where a collective needs equal sizes, is the
    /// caller's business.
    pub fn shard(&self, rank: usize, world: usize) -> Range<usize> {
        shard_range(self.total, rank, world)
    }
}

/// `[lo, hi)` of shard `rank` of `n` elements split in `world` chunks of
/// `ceil(n / world)`.
pub fn shard_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    assert!(world > 0 && rank < world, "rank {rank} of world {world}");
    let chunk = n.div_ceil(world);
    let lo = (rank * chunk).min(n);
    lo..(lo + chunk).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(name: &str, shape: &[usize], placement: Placement) -> ParamDecl {
        ParamDecl::new(name, shape).placed(placement)
    }

    #[test]
    fn one_block_asking_twice_for_a_name_must_agree() {
        let same = vec![vec![
            decl("w", &[2, 3], Placement::Replicate),
            decl("w", &[2, 3], Placement::Replicate),
        ]];
        assert_eq!(Layout::new(same).unwrap().num_params(), 6);
        let shapes = vec![vec![
            decl("w", &[2, 3], Placement::Replicate),
            decl("w", &[3, 2], Placement::Replicate),
        ]];
        let e = Layout::new(shapes).unwrap_err().to_string();
        assert!(e.contains("block 0 requests parameter `w` twice"), "{e}");
        let placed = vec![vec![
            decl("w", &[2, 3], Placement::Replicate),
            decl("w", &[2, 3], Placement::rows()),
        ]];
        assert!(Layout::new(placed).is_err());
    }
}
