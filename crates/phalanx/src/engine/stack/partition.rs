//! Partitioned activation checkpoints (DeepSpeed's
//! `activation_checkpointing.partition_activations`): under tensor
//! parallelism every tp rank holds the same block input, so each keeps only
//! its 1/tp slice of a checkpointed input and the slices are all-gathered
//! just before the block is recomputed in backward.

use super::Saved;
use candle_core::{bail, DType, Result, Shape, Tensor};
use phalanx_comm::{Element, ProcessGroup};

/// One rank's slice of a checkpointed block input.
pub struct Piece {
    /// This rank's slice of the flattened input (a copy: the full input is
    /// freed).
    slice: Tensor,
    shape: Shape,
    /// Every rank's slice length.
    counts: Vec<usize>,
}

impl Piece {
    pub(super) fn bytes(&self) -> usize {
        self.slice.elem_count() * self.slice.dtype().size_in_bytes()
    }
}

/// Keep this rank's slice of `x`.
pub(super) fn split(x: &Tensor, pg: &ProcessGroup) -> Result<Piece> {
    let n = x.elem_count();
    let counts: Vec<usize> = (0..pg.size())
        .map(|r| crate::engine::shard_range(n, r, pg.size()).len())
        .collect();
    let mine = crate::engine::shard_range(n, pg.rank(), pg.size());
    let flat = x.flatten_all()?.narrow(0, mine.start, mine.len())?;
    // A fresh buffer, so the full input's storage can go.
    let slice = Tensor::zeros(mine.len(), x.dtype(), x.device())?.add(&flat)?;
    Ok(Piece {
        slice,
        shape: x.shape().clone(),
        counts,
    })
}

fn gather_as<T: Element + candle_core::WithDType>(p: &Piece, pg: &ProcessGroup) -> Result<Tensor> {
    let mine = p.slice.to_vec1::<T>()?;
    let mut all = vec![<T as Element>::from_i64(0); p.counts.iter().sum()];
    pg.all_gather_v(&mine, &p.counts, &mut all)
        .map_err(|e| candle_core::Error::Msg(format!("partitioned activations: {e}")))?;
    Tensor::from_vec(all, p.shape.clone(), p.slice.device())
}

/// The whole input again (collective over the tp group).
pub(super) fn gather(p: &Piece, pg: &ProcessGroup) -> Result<Tensor> {
    match p.slice.dtype() {
        DType::F32 => gather_as::<f32>(p, pg),
        DType::BF16 => gather_as::<half::bf16>(p, pg),
        DType::F16 => gather_as::<half::f16>(p, pg),
        d => bail!("partitioned activations: dtype {d:?} is not supported"),
    }
}

/// A saved block state with a partitioned input made whole again.
pub(super) fn restore(saved: Saved, pg: Option<&ProcessGroup>) -> Result<Saved> {
    match (saved, pg) {
        (Saved::Part(p), Some(pg)) => Ok(Saved::Input(gather(&p, pg)?)),
        (Saved::Part(_), None) => bail!("partitioned activation without a partition group"),
        (s, _) => Ok(s),
    }
}
