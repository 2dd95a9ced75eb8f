//! One block's forward, kept for its backward: candle's graph from the
//! block's input `Var` to its output, or, for a block that runs as one op
//! with its own backward ([`BlockModule::forward_direct`]), that backward.
//! Both backward the same way here, so the full backward, the split B pass
//! and recomputation share one path.

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Shape, Tensor, Var};

use super::{weighted_sum, Stack};
use crate::engine::block::{BlockModule, Ctx, DirectBackward};
use crate::ops::tape::{self, DeferredGrad};

/// A block's forward, ready for its backward.
pub(super) enum Node {
    /// candle's graph from the input variable (`None`: token ids) to `y`.
    Graph { x: Option<Var>, y: Tensor },
    /// The block's own backward, and its output's shape.
    Direct {
        back: Box<dyn DirectBackward>,
        shape: Shape,
    },
}

/// What a block's backward gives: candle's gradients (a graph's), the
/// weight-gradient work its ops deferred, and the input's gradient (`None`
/// for token ids).
pub(super) type BlockGrads = (
    Option<GradStore>,
    Vec<Box<dyn DeferredGrad>>,
    Option<Tensor>,
);

impl Stack {
    /// Runs block `b`'s module on `x` for a later backward: its direct
    /// forward where the block defers its weight gradients and has one,
    /// else a graph from a fresh `Var` of `x` (float `x`) or from `x`.
    pub(super) fn forward_node(
        &self,
        b: usize,
        m: &dyn BlockModule,
        x: &Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Node)> {
        if x.dtype().is_float() && self.blocks[b].defers_weight_grads() {
            if let Some((y, back)) = m.forward_direct(x, ctx)? {
                let shape = y.shape().clone();
                return Ok((y, Node::Direct { back, shape }));
            }
        }
        let xv = if x.dtype().is_float() {
            Some(Var::from_tensor(x)?)
        } else {
            None
        };
        let y = m.forward(xv.as_ref().map_or(x, |v| v.as_tensor()), ctx)?;
        Ok((y.clone(), Node::Graph { x: xv, y }))
    }
}

impl Node {
    /// The input, detached (`None` for a direct node, which keeps its own).
    pub(super) fn input(&self) -> Option<Tensor> {
        match self {
            Node::Graph { x, .. } => x.as_ref().map(|v| v.as_tensor().detach()),
            Node::Direct { .. } => None,
        }
    }

    /// Bytes a direct node keeps in buffers of its own (a graph's
    /// tensors are candle's, not counted here).
    pub(super) fn kept_bytes(&self) -> usize {
        match self {
            Node::Graph { .. } => 0,
            Node::Direct { back, .. } => back.kept_bytes(),
        }
    }

    /// Whether the input is token ids (a graph with no input variable).
    pub(super) fn has_id_input(&self) -> bool {
        matches!(self, Node::Graph { x: None, .. })
    }

    /// Block `b`'s backward from the gradient `gy` of its output, with the
    /// weight-gradient tape recording when `tape` (always, for a direct
    /// node: its parameters' gradients only go there).
    pub(super) fn backward(self, b: usize, gy: &Tensor, tape: bool) -> Result<BlockGrads> {
        let shape = match &self {
            Node::Graph { y, .. } => y.shape(),
            Node::Direct { shape, .. } => shape,
        };
        if shape != gy.shape() {
            bail!(
                "block {b}: output {:?} but upstream gradient {:?}",
                shape,
                gy.shape()
            )
        }
        match self {
            Node::Graph { x, y } => {
                let (grads, work) = backward_taped(&y, gy, tape)?;
                let dx = match &x {
                    Some(v) => match grads.get(v.as_tensor()) {
                        Some(g) => Some(g.detach()),
                        None => bail!("block {b}: its input received no gradient"),
                    },
                    None => None,
                };
                Ok((Some(grads), work, dx))
            }
            Node::Direct { back, .. } => {
                let (dx, work) = tape::recording(|| back.backward(gy))?;
                Ok((None, work, Some(dx)))
            }
        }
    }
}

/// candle's backward of `y` seeded with `gy`, with the weight-gradient tape
/// recording when `tape`: the gradients, and the work the ops deferred.
pub(super) fn backward_taped(
    y: &Tensor,
    gy: &Tensor,
    tape: bool,
) -> Result<(GradStore, Vec<Box<dyn DeferredGrad>>)> {
    let backward = || weighted_sum(y, gy)?.backward();
    if tape {
        tape::recording(backward)
    } else {
        Ok((backward()?, Vec::new()))
    }
}
