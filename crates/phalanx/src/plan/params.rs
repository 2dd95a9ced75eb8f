//! The parameters the planner sizes, as a model's blocks declare them:
//! each one's name, whole shape and placement over the tensor-parallel
//! ranks ([`crate::placement`]), for the three kinds of block the planner
//! knows: the embedding, a layer (every layer declares the same shapes)
//! and the head.
//!
//! A model family records them from its own blocks, at every tp size
//! they can be cut for (`phalanx_models::common::plan`): the placement of
//! a parameter may depend on tp (Llama's kv heads are split while there
//! are enough of them, replicated beyond). One rank's share of a
//! parameter is the local shape of its placement
//! ([`Placement::local_shape`]): a `Shard` over t ranks holds 1/t of its
//! dimension, a vocabulary padded to a multiple of t ⌈V/t⌉ rows, a
//! replicated parameter all of it. A name a later block declares again
//! is a tied parameter, owned and counted by the first block, as in the
//! engine's layout.
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx::plan::{BlockParams, Declared, Param};
//! // On 2 ranks: a vocabulary of 5 rows, 4 wide, tied to the head; a layer
//! // of a column-parallel matrix (8 x 4) and a replicated norm (4).
//! let table = Param::new("wte", &[5, 4], Placement::vocab(5));
//! let d = Declared {
//!     tp: 2,
//!     embedding: vec![table.clone()],
//!     layer: vec![
//!         Param::new("fc", &[8, 4], Placement::rows()),
//!         Param::new("ln", &[4], Placement::Replicate),
//!     ],
//!     head: vec![table],
//! };
//! // 3 rows of the padded table; half of fc and all of ln; the tied table
//! // is the embedding's.
//! assert_eq!(d.per_rank(), BlockParams { embedding: 3 * 4, layer: 4 * 4 + 4, head: 0 });
//! assert_eq!(d.whole(), BlockParams { embedding: 5 * 4, layer: 8 * 4 + 4, head: 0 });
//! assert_eq!(d.tied_per_rank(), 3 * 4);
//! ```

use std::collections::HashSet;

use crate::placement::Placement;

/// One parameter as a block declares it: the whole tensor's shape and how
/// it is laid over the tensor-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    /// The whole (one-rank) shape.
    pub shape: Vec<usize>,
    pub placement: Placement,
}

impl Param {
    pub fn new(name: &str, shape: &[usize], placement: Placement) -> Param {
        Param {
            name: name.to_string(),
            shape: shape.to_vec(),
            placement,
        }
    }

    /// Elements of the whole tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements one of `tp` ranks holds (padding rows included: a rank
    /// allocates them).
    pub fn local_numel(&self, tp: usize) -> usize {
        self.placement
            .local_shape(&self.shape, tp.max(1))
            .iter()
            .product()
    }

    /// A matrix (two or more dimensions: what tokens are multiplied by, or
    /// a table they index).
    pub fn is_matrix(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// Parameters of each kind of block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockParams {
    pub embedding: usize,
    /// One layer's.
    pub layer: usize,
    /// The head's own (without a table tied to the embedding's).
    pub head: usize,
}

impl BlockParams {
    /// The embedding, `n_layer` layers and the head.
    pub fn total(&self, n_layer: usize) -> usize {
        self.embedding + n_layer * self.layer + self.head
    }
}

/// What a model's blocks declare on one of `tp` tensor-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Declared {
    pub tp: usize,
    pub embedding: Vec<Param>,
    /// One layer's (every layer declares the same shapes and placements).
    pub layer: Vec<Param>,
    /// The head's, a table tied to the embedding's included.
    pub head: Vec<Param>,
}

impl Declared {
    /// One rank's parameters of each kind of block, by their placements.
    pub fn per_rank(&self) -> BlockParams {
        self.count(|p| p.local_numel(self.tp))
    }

    /// The whole model's parameters of each kind of block (the same at
    /// every tp).
    pub fn whole(&self) -> BlockParams {
        self.count(Param::numel)
    }

    /// Elements of the parameters one rank's head shares with its
    /// embedding (a tied table; 0 when untied).
    pub fn tied_per_rank(&self) -> usize {
        let emb: HashSet<&str> = self.embedding.iter().map(|p| p.name.as_str()).collect();
        self.head
            .iter()
            .filter(|p| emb.contains(p.name.as_str()))
            .map(|p| p.local_numel(self.tp))
            .sum()
    }

    /// Whether the head declares a parameter of the embedding (a tied table).
    pub fn tied(&self) -> bool {
        let emb: HashSet<&str> = self.embedding.iter().map(|p| p.name.as_str()).collect();
        self.head.iter().any(|p| emb.contains(p.name.as_str()))
    }

    /// Whole elements of one layer's matrices and of the head's (a tied
    /// table included): the parameters tokens are multiplied by.
    pub fn matrices(&self) -> (usize, usize) {
        let sum = |ps: &[Param]| ps.iter().filter(|p| p.is_matrix()).map(Param::numel).sum();
        (sum(&self.layer), sum(&self.head))
    }

    /// `size` of each block's parameters, a name counted in the first
    /// block that declares it only.
    fn count(&self, size: impl Fn(&Param) -> usize) -> BlockParams {
        let mut seen = HashSet::new();
        let mut own = |ps: &[Param]| -> usize {
            ps.iter()
                .filter(|p| seen.insert(p.name.clone()))
                .map(&size)
                .sum()
        };
        BlockParams {
            embedding: own(&self.embedding),
            layer: own(&self.layer),
            head: own(&self.head),
        }
    }
}

/// What a model's blocks declare at each tp size they can be cut for
/// (ascending); a size missing is one the model cannot run on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Declarations(Vec<Declared>);

impl Declarations {
    /// From declarations at distinct tp sizes (in any order).
    pub fn new(mut at: Vec<Declared>) -> Declarations {
        at.sort_by_key(|d| d.tp);
        at.dedup_by_key(|d| d.tp);
        Declarations(at)
    }

    /// The same blocks declared at every size of `tps`: for a model whose
    /// placements do not depend on tp (hand-made models, examples).
    pub fn uniform(
        tps: &[usize],
        embedding: Vec<Param>,
        layer: Vec<Param>,
        head: Vec<Param>,
    ) -> Declarations {
        Declarations::new(
            tps.iter()
                .map(|&tp| Declared {
                    tp,
                    embedding: embedding.clone(),
                    layer: layer.clone(),
                    head: head.clone(),
                })
                .collect(),
        )
    }

    /// The declarations on `tp` ranks, if the blocks can be cut for it.
    pub fn at(&self, tp: usize) -> Option<&Declared> {
        self.0.iter().find(|d| d.tp == tp)
    }

    /// The tp sizes declared.
    pub fn sizes(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().map(|d| d.tp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama-shaped layer by hand, C = 8, 4 query heads of 2 over 2 kv
    /// heads (KV = 4), MLP 12, on `tp` ranks: k and v placed `kv`.
    fn layer(kv: Placement) -> Vec<Param> {
        let (rows, cols) = (Placement::rows(), Placement::cols());
        vec![
            Param::new("q.weight", &[8, 8], rows),
            Param::new("k.weight", &[4, 8], kv),
            Param::new("v.weight", &[4, 8], kv),
            Param::new("k.bias", &[4], kv),
            Param::new("o.weight", &[8, 8], cols),
            Param::new("up.weight", &[12, 8], rows),
            Param::new("down.weight", &[8, 12], cols),
            Param::new("norm.weight", &[8], Placement::Replicate),
        ]
    }

    fn at(tp: usize, kv: Placement, vocab: usize, tied: bool) -> Declared {
        let table = Param::new("embed", &[vocab, 8], Placement::vocab(vocab));
        let head = match tied {
            true => table.clone(),
            false => Param::new("lm_head", &[vocab, 8], Placement::vocab(vocab)),
        };
        Declared {
            tp,
            embedding: vec![table],
            layer: layer(kv),
            head: vec![Param::new("final_norm", &[8], Placement::Replicate), head],
        }
    }

    #[test]
    fn a_rank_holds_its_placements_local_shapes() {
        let split = at(2, Placement::rows(), 10, false).per_rank();
        // q 32, k 16, v 16, k bias 2, o 32, up 48, down 48: halves; norm whole.
        assert_eq!(split.layer, 32 + 16 + 16 + 2 + 32 + 48 + 48 + 8);
        assert_eq!(split.embedding, 5 * 8);
        assert_eq!(split.head, 8 + 5 * 8);
        // The same layer with k, v (and k's bias) replicated: they are whole.
        let rep = at(2, Placement::Replicate, 10, false).per_rank();
        assert_eq!(rep.layer, split.layer + (32 + 32 + 4) / 2);
        // Whole counts do not depend on the placement.
        let whole = at(2, Placement::rows(), 10, false).whole();
        assert_eq!(whole, at(2, Placement::Replicate, 10, false).whole());
        assert_eq!(whole.layer, 64 + 32 + 32 + 4 + 64 + 96 + 96 + 8);
        assert_eq!(at(1, Placement::rows(), 10, false).per_rank(), whole);
    }

    #[test]
    fn a_padded_vocabulary_and_a_tied_table() {
        // 10 rows over 4 ranks: 3 each (12, the last 2 padding).
        let d = at(4, Placement::rows(), 10, true);
        assert_eq!(d.per_rank().embedding, 3 * 8);
        assert_eq!(d.whole().embedding, 10 * 8);
        // Tied: the head's table is the embedding's, counted there once.
        assert_eq!(d.per_rank().head, 8);
        assert!(d.tied() && !at(4, Placement::rows(), 10, false).tied());
        assert_eq!(d.tied_per_rank(), 3 * 8);
        assert_eq!(at(4, Placement::rows(), 10, false).tied_per_rank(), 0);
        // Its matrices: the layer's five, and the head's tied table.
        assert_eq!(d.matrices(), (64 + 32 + 32 + 64 + 96 + 96, 80));
        // Grouped rows (GPT-2's [q | k | v]): 3 groups of 6 over 3 ranks.
        let qkv = Placement::Shard {
            dim: 0,
            groups: 3,
            full: None,
        };
        assert_eq!(Param::new("c_attn", &[18, 6], qkv).local_numel(3), 6 * 6);
    }

    #[test]
    fn declarations_are_looked_up_by_tp() {
        let t = Declarations::new(vec![
            at(4, Placement::Replicate, 10, true),
            at(1, Placement::rows(), 10, true),
            at(2, Placement::rows(), 10, true),
        ]);
        assert_eq!(t.sizes().collect::<Vec<_>>(), vec![1, 2, 4]);
        assert_eq!(t.at(4).unwrap().layer[1].placement, Placement::Replicate);
        assert!(t.at(3).is_none());
    }
}
