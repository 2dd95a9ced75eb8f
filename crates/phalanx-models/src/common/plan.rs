//! The planner's parameters, declared by a family's own blocks: at tp = 1
//! the whole model's blocks, at every other tp size that divides the heads
//! the blocks of rank 0 on a detached group ([`Tp::detached`]: no other
//! rank is started), each recorded without allocating its parameters
//! ([`declarations`]). A parameter reaches the planner with its whole
//! shape (the shape the rank declares, through
//! [`phalanx::placement::Placement::full_shape`]) and its declared
//! placement; the planner's per-rank sizes are those placements' local
//! shapes ([`phalanx::plan::params`]). A tp size the blocks refuse (a
//! width it does not divide) is not declared, and the planner does not
//! propose it.
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx_models::common::plan::declare;
//! use phalanx_models::llama::{self, LlamaConfig};
//! let c = LlamaConfig::new(2, 4, 2, 32, 64, 256, 16); // 4 heads over 2 kv heads
//! let d = declare(c.n_head, |tp| match tp {
//!     None => llama::blocks(&c),
//!     Some(t) => llama::tp::blocks_tp(&c, t),
//! })
//! .unwrap();
//! assert_eq!(d.sizes().collect::<Vec<_>>(), vec![1, 2, 4]);
//! // tp 4 replicates the 2 kv heads: k_proj is whole on every rank.
//! let k = |tp| {
//!     let layer = &d.at(tp).unwrap().layer;
//!     layer.iter().find(|p| p.name.ends_with("k_proj.weight")).unwrap().clone()
//! };
//! assert_eq!((k(2).placement, k(4).placement), (Placement::rows(), Placement::Replicate));
//! assert_eq!((k(2).shape, k(4).shape), (vec![16, 32], vec![16, 32])); // whole shapes
//! ```

use candle_core::{bail, Result};
use phalanx::engine::backend::declarations;
use phalanx::engine::Block;
use phalanx::plan::{Declarations, Declared, Param};
use phalanx::tp::Tp;

/// What a model's blocks declare at tp = 1 and at every tp size dividing
/// `n_head` that they accept. `blocks(None)` builds the whole model's
/// blocks, `blocks(Some(tp))` one tp rank's (embedding, layers, head).
pub fn declare(
    n_head: usize,
    blocks: impl Fn(Option<&Tp>) -> Result<Vec<Box<dyn Block>>>,
) -> Result<Declarations> {
    let mut at = vec![declared(&blocks(None)?, 1)?];
    for tp in (2..=n_head).filter(|t| n_head.is_multiple_of(*t)) {
        // Every rank declares the same shapes and placements: rank 0's
        // stand for all.
        let t = Tp::detached(0, tp);
        if let Ok(d) = blocks(Some(&t)).and_then(|b| declared(&b, tp)) {
            at.push(d);
        }
    }
    Ok(Declarations::new(at))
}

/// What `blocks` (one rank's of `tp`: embedding, layers, head) declare,
/// with whole shapes. The planner counts `n_layer` copies of a layer: a
/// layer that declares other shapes or placements than the first is an
/// error.
pub fn declared(blocks: &[Box<dyn Block>], tp: usize) -> Result<Declared> {
    let [first, layers @ .., last] = blocks else {
        bail!(
            "a model of {} block(s) has no embedding and head",
            blocks.len()
        )
    };
    let params = |b: &dyn Block| -> Result<Vec<Param>> {
        Ok(declarations(b)?
            .into_iter()
            .map(|d| {
                let whole = d.placement.full_shape(&d.shape, tp);
                Param::new(&d.name, &whole, d.placement)
            })
            .collect())
    };
    let layer = match layers.first() {
        Some(b) => params(b.as_ref())?,
        None => Vec::new(),
    };
    for (i, b) in layers.iter().enumerate().skip(1) {
        let other = params(b.as_ref())?;
        let same = other.len() == layer.len()
            && other
                .iter()
                .zip(&layer)
                .all(|(a, b)| a.shape == b.shape && a.placement == b.placement);
        if !same {
            bail!("layer {i} declares other parameters than layer 0: the planner sizes identical layers")
        }
    }
    Ok(Declared {
        tp,
        embedding: params(first.as_ref())?,
        layer,
        head: params(last.as_ref())?,
    })
}
