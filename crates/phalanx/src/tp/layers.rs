//! Megatron-LM's tensor-parallel layers, built from a `VarBuilder` like any
//! candle-nn layer, so they serve any model (GPT-2 in `phalanx-models` uses
//! them). Each rank declares only its shard; parameter names are the full
//! model's, so checkpoints map onto shards by name, and each parameter's
//! placement is declared with it (`crate::placement`): the slices, the
//! gathered whole tensors and the checkpoint regions follow from it.
//!
//! - `ColumnParallelLinear`: weight (out/tp, in); input replicated (or
//!   gathered from sequence shards), output split over `out`.
//! - `RowParallelLinear`: weight (out, in/tp); input split over `in`, partial
//!   outputs all-reduced (or reduce-scattered over the sequence); the bias is
//!   replicated and added once, after the reduction.
//! - `VocabParallelEmbedding`: rows [lo, hi) of the (padded) vocabulary.
//! - `vocab_parallel_cross_entropy`: the loss from vocabulary-sharded logits,
//!   never materialising the full logits on one rank.
//!
//! Mixed precision: everything follows the dtype of the parameters the
//! `VarBuilder` hands out (f32, f16 or bf16); the loss is computed in f32
//! from widened logits and returned as f32.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use phalanx::tp::{ColumnParallelLinear, RowParallelLinear, Tp};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let tp = Tp::new(pg, false);
//!     let vb = candle_nn::VarBuilder::zeros(DType::F32, &Device::Cpu);
//!     let up = ColumnParallelLinear::new(&tp, &vb, "up", 4, 8, true).unwrap();   // weight (4, 4) here
//!     let down = RowParallelLinear::new(&tp, &vb, "down", 8, 4, true).unwrap(); // weight (4, 4) here
//!     let x = Tensor::ones((1, 3, 4), DType::F32, &Device::Cpu).unwrap();
//!     let y = down.forward(&up.forward(&x).unwrap()).unwrap();
//!     (up.weight().dims().to_vec(), y.dims().to_vec())
//! });
//! assert_eq!(out[0], (vec![4, 4], vec![1, 3, 4]));
//! ```

use super::comm::{copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq};
use super::overlap::{column_parallel_linear, tp_overlap_enabled};
use crate::ops;
use crate::placement::{declare, Placement};
use candle_core::{bail, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use phalanx_comm::ProcessGroup;

/// The tensor-parallel group and mode a layer is built for.
#[derive(Clone)]
pub struct Tp {
    pub pg: ProcessGroup,
    /// Megatron sequence parallelism: activations between the parallel
    /// regions are split along the sequence.
    pub sequence_parallel: bool,
}

impl Tp {
    pub fn new(pg: ProcessGroup, sequence_parallel: bool) -> Tp {
        Tp {
            pg,
            sequence_parallel,
        }
    }
    /// Rank `rank` of `size` with no group behind it
    /// ([`ProcessGroup::detached`]): enough to build that rank's blocks and
    /// record what they declare (shapes and placements), as the planner's
    /// model families do, without the other ranks; a forward's collectives
    /// fail.
    pub fn detached(rank: usize, size: usize) -> Tp {
        Tp::new(ProcessGroup::detached(rank, size), false)
    }
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }
    pub fn size(&self) -> usize {
        self.pg.size()
    }
    /// This rank's part of `n` (which must divide).
    pub fn part(&self, n: usize, what: &str) -> Result<usize> {
        if !n.is_multiple_of(self.size()) {
            bail!(
                "{what} ({n}) is not divisible by the tensor-parallel size {}",
                self.size()
            )
        }
        Ok(n / self.size())
    }
    /// Into a column-parallel region: f, or all-gather of sequence shards.
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            gather_seq(x, &self.pg)
        } else {
            copy_to_tp(x, &self.pg)
        }
    }
    /// `linear(enter(x), w, b)`: a column-parallel linear. By default one
    /// op whose backward overlaps the collective on dx with dw and db
    /// ([`super::column_parallel_linear`]); `PHALANX_TP_OVERLAP=0` selects
    /// the unfused ops (same results).
    pub fn column_linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        if tp_overlap_enabled() {
            column_parallel_linear(self, x, w, b)
        } else {
            ops::linear(&self.enter(x)?, w, b)
        }
    }
    /// Out of a row-parallel region: g, or reduce-scatter over the sequence.
    pub fn leave(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            reduce_scatter_seq(x, &self.pg)
        } else {
            reduce_from_tp(x, &self.pg)
        }
    }
}

fn normal(stdev: f64) -> Init {
    Init::Randn { mean: 0.0, stdev }
}

/// `name.weight` of `shape` (out, in), N(`std`), and `name.bias` (out,) = 0,
/// placed `w` and `b` over the tp ranks.
pub fn linear_params(
    vb: &VarBuilder,
    name: &str,
    shape: (usize, usize),
    std: f64,
    bias: bool,
    (w, b): (Placement, Placement),
) -> Result<(Tensor, Option<Tensor>)> {
    let w = declare(vb, shape, &format!("{name}.weight"), normal(std), w)?;
    let b = match bias {
        true => Some(declare(
            vb,
            shape.0,
            &format!("{name}.bias"),
            Init::Const(0.0),
            b,
        )?),
        false => None,
    };
    Ok((w, b))
}

/// A column-parallel linear's placements (weight, bias): both by rows.
pub const COLUMN_PARALLEL: (Placement, Placement) = (Placement::rows(), Placement::rows());
/// A row-parallel linear's placements: the weight by columns, the bias
/// replicated (added once, after the reduction).
pub const ROW_PARALLEL: (Placement, Placement) = (Placement::cols(), Placement::Replicate);

pub struct ColumnParallelLinear {
    tp: Tp,
    w: Tensor,
    b: Option<Tensor>,
}

impl ColumnParallelLinear {
    /// `name.weight` (out/tp, in) and `name.bias` (out/tp,).
    pub fn new(
        tp: &Tp,
        vb: &VarBuilder,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let o = tp.part(out_dim, &format!("{name} output size"))?;
        let (w, b) = linear_params(vb, name, (o, in_dim), 0.02, bias, COLUMN_PARALLEL)?;
        Ok(Self::from_parts(tp, w, b))
    }

    /// From given tensors (e.g. a block that declares its own names).
    pub fn from_parts(tp: &Tp, w: Tensor, b: Option<Tensor>) -> Self {
        Self {
            tp: tp.clone(),
            w,
            b,
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    /// (B, T, in) replicated, or (B, T/tp, in) under sequence parallelism
    /// -> (B, T, out/tp).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.tp.column_linear(x, &self.w, self.b.as_ref())
    }
}

pub struct RowParallelLinear {
    tp: Tp,
    w: Tensor,
    b: Option<Tensor>,
}

impl RowParallelLinear {
    /// `name.weight` (out, in/tp) and the replicated `name.bias` (out,).
    pub fn new(
        tp: &Tp,
        vb: &VarBuilder,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let i = tp.part(in_dim, &format!("{name} input size"))?;
        let (w, b) = linear_params(vb, name, (out_dim, i), 0.02, bias, ROW_PARALLEL)?;
        Ok(Self::from_parts(tp, w, b))
    }

    pub fn from_parts(tp: &Tp, w: Tensor, b: Option<Tensor>) -> Self {
        Self {
            tp: tp.clone(),
            w,
            b,
        }
    }

    /// (B, T, in/tp) -> (B, T, out), or (B, T/tp, out) under sequence parallelism.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.tp.leave(&ops::linear(x, &self.w, None)?)?;
        match &self.b {
            Some(b) => ops::add_bias(&y, b),
            None => Ok(y),
        }
    }
}

/// Rows [lo, hi) of an embedding table of `vocab` rows, padded up to a
/// multiple of tp (padding rows are never looked up and never win a softmax).
pub struct VocabParallelEmbedding {
    tp: Tp,
    w: Tensor,
    lo: usize,
}

/// The vocabulary padded to a multiple of `tp` (GPT-2's 50257 -> 50258 for tp 2).
pub fn padded_vocab(vocab: usize, tp: usize) -> usize {
    vocab.div_ceil(tp) * tp
}

/// This rank's rows of a vocabulary-parallel table `name` (V'/tp, dim),
/// N(0, 0.02), placed `Shard(0)` of the unpadded `vocab` rows (an embedding,
/// or the head tied to it).
pub fn vocab_table(
    tp: &Tp,
    vb: &VarBuilder,
    name: &str,
    vocab: usize,
    dim: usize,
) -> Result<Tensor> {
    let rows = padded_vocab(vocab, tp.size()) / tp.size();
    declare(vb, (rows, dim), name, normal(0.02), Placement::vocab(vocab))
}

impl VocabParallelEmbedding {
    /// `name` (V'/tp, dim), declared as [`vocab_table`] does.
    pub fn new(tp: &Tp, vb: &VarBuilder, name: &str, vocab: usize, dim: usize) -> Result<Self> {
        Ok(Self::from_parts(tp, vocab_table(tp, vb, name, vocab, dim)?))
    }

    pub fn from_parts(tp: &Tp, w: Tensor) -> Self {
        let rows = w.dims()[0];
        Self {
            tp: tp.clone(),
            lo: tp.rank() * rows,
            w,
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    /// The first vocabulary row this rank holds.
    pub fn lo(&self) -> usize {
        self.lo
    }

    /// Token ids (B, T) -> embeddings (B, T, C) (replicated), or (B, T/tp, C)
    /// under sequence parallelism. Each rank looks up the ids it holds,
    /// zeros elsewhere; the partial sums are reduced.
    pub fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let rows = self.w.dims()[0];
        let ids: Vec<u32> = idx.flatten_all()?.to_vec1()?;
        let (local, mask): (Vec<u32>, Vec<f32>) = ids
            .iter()
            .map(|&i| {
                let i = i as usize;
                if (self.lo..self.lo + rows).contains(&i) {
                    ((i - self.lo) as u32, 1.0)
                } else {
                    (0, 0.0)
                }
            })
            .unzip();
        let dev = self.w.device();
        let local = Tensor::from_vec(local, b * t, dev)?;
        let mask = Tensor::from_vec(mask, (b * t, 1), dev)?.to_dtype(self.w.dtype())?;
        let c = self.w.dims()[1];
        let e = self
            .w
            .index_select(&local, 0)?
            .broadcast_mul(&mask)?
            .reshape((b, t, c))?;
        self.tp.leave(&e)
    }
}
