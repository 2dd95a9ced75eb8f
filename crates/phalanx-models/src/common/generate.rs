//! Generation, for any family: a [`Decoder`] gives the logits of the next
//! token. [`FullForward`] runs the engine over the latest context (any
//! family); a family with a KV cache gives its own.

use candle_core::{IndexOp, Tensor};
use phalanx::engine::Engine;
use phalanx::Result;

/// The logits of the next token, fed one token at a time.
pub trait Decoder {
    /// `ids`: every token so far (the prompt, then what was generated);
    /// `next`: the last one generated (unused on the first call, when the
    /// prompt is fed). Returns the logits (V) of the token after `ids`.
    fn next_logits(&mut self, ids: &[u32], next: u32) -> Result<Vec<f32>>;
}

/// A full forward of the latest `context` tokens per token (no cache).
pub struct FullForward<'a> {
    pub engine: &'a Engine,
    pub context: usize,
}

impl Decoder for FullForward<'_> {
    fn next_logits(&mut self, ids: &[u32], _next: u32) -> Result<Vec<f32>> {
        let ctx = &ids[ids.len().saturating_sub(self.context)..];
        let x = Tensor::from_slice(ctx, (1, ctx.len()), self.engine.device())?;
        let logits = self.engine.forward(&x)?; // (1, T, V)
        Ok(logits.i((0, ctx.len() - 1))?.to_vec1()?)
    }
}
