//! Tensor parallelism (Megatron-LM) and sequence parallelism: the
//! differentiable communication operators, the parallel layers, and how a
//! full checkpoint maps onto shards.
//!
//! Reusable for any candle model: build the layers from a `VarBuilder` with
//! a [`Tp`] (the tensor-parallel group from the `DeviceMesh`).

mod comm;
mod layers;
mod overlap;
mod vocab_loss;

pub use comm::{copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq, split_seq};
pub use layers::{
    linear_params, padded_vocab, vocab_table, ColumnParallelLinear, RowParallelLinear, Tp,
    VocabParallelEmbedding, COLUMN_PARALLEL, ROW_PARALLEL,
};
pub use overlap::{column_parallel_linear, tp_overlap_enabled};
pub use vocab_loss::vocab_parallel_cross_entropy;
