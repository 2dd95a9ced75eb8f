//! What every family's first and last blocks do alike: token embeddings
//! with the context check, and the head's loss or logits.

use candle_core::{bail, DType, Result, Tensor};
use phalanx::engine::Ctx;
use phalanx::ops;

/// An error unless `t` tokens fit the context of `block_size`.
pub fn check_context(t: usize, block_size: usize) -> Result<()> {
    if t > block_size {
        bail!("sequence length {t} exceeds the context length {block_size} (model.block_size)")
    }
    Ok(())
}

/// The rows of `wte` (V, C) for the tokens `idx` (B, T): (B, T, C), after
/// checking that T fits the context.
pub fn token_embeddings(wte: &Tensor, idx: &Tensor, block_size: usize) -> Result<Tensor> {
    let (b, t) = idx.dims2()?;
    check_context(t, block_size)?;
    let c = wte.dim(1)?;
    wte.index_select(&idx.flatten_all()?, 0)?.reshape((b, t, c))
}

/// A head's output from its logits (B, T, V): with targets (B, T), the
/// scalar mean cross-entropy; without, the logits in f32 (generation reads
/// f32 whatever the compute dtype).
pub fn loss_or_logits(logits: &Tensor, ctx: &Ctx) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    match ctx.targets {
        Some(targets) => {
            if targets.dims() != [b, t] {
                bail!(
                    "targets {:?} do not match inputs ({b}, {t})",
                    targets.shape()
                )
            }
            ops::cross_entropy(logits, targets)
        }
        None => logits.to_dtype(DType::F32),
    }
}
