//! The split backward of zero-bubble pipeline schedules (ZB-H1): the
//! backward of a range becomes two passes that a schedule can run apart.
//!
//! - B, [`Stack::backward_input`]: the input gradient only. The forward ran
//!   with the parameters as constants ([`Stack::forward_frozen`]), so candle's
//!   backward walks the activation path and computes no weight gradient.
//! - W, [`Stack::backward_weight`]: the parameter gradients only, two ways:
//!   - a block whose ops defer their weight gradients
//!     ([`crate::engine::Block::defers_weight_grads`], the reference GPT-2
//!     and Llama blocks) runs B with a tape recording ([`crate::ops::tape`]):
//!     each linear and bias hands in the tensors its weight gradient needs
//!     (its input and output gradient), and W runs only those kernels; the
//!     norms, whose kernel yields their gains' gradients with dx, hand in
//!     the finished gradients. No forward again: B + W cost what one
//!     backward costs.
//!   - any other block keeps its input and upstream gradient; W rebuilds it
//!     with its parameters as `Var`s, runs its forward again from the
//!     detached input and backpropagates the kept gradient. The cost is one
//!     more forward per block.
//!
//! B then W gives the same gradients as [`Stack::backward`] (the same kernels
//! on the same values), which the pipeline equivalence tests check end to end.
//!
//! ```
//! use phalanx::engine::{Activations, Block, FlatBuffer, FnBlock, Stack};
//! use phalanx::ledger::{Ledger, Mem};
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let blocks = || -> Vec<Box<dyn Block>> { vec![
//!     Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(3, 3, vb.pp("l0")))),
//!     Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(3, 1, vb.pp("l1")))),
//! ]};
//! let ledger = Ledger::new();
//! let stack = Stack::new(blocks(), &dev, Activations::KeepGraph, &ledger).unwrap();
//! let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
//! stack.init_params(params.as_mut_slice(), 0);
//! let x = Tensor::ones((2, 3), candle_core::DType::F32, &dev).unwrap();
//! // Reference: the fused backward.
//! let mut full = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
//! let (y, stash) = stack.forward(0..2, &x, None, &params).unwrap();
//! let gy = Tensor::ones(y.shape(), y.dtype(), &dev).unwrap();
//! let dx = stack.backward(stash, &gy, &params, &mut full, &mut |_, _| Ok(())).unwrap().unwrap();
//! // Split: B gives dx and no parameter gradient, W gives the rest later.
//! let mut split = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
//! let (_, stash) = stack.forward_frozen(0..2, &x, None, &params).unwrap();
//! let (dx2, w) = stack.backward_input(stash, &gy, &params).unwrap();
//! assert!(split.as_slice().iter().all(|&g| g == 0.0));
//! stack.backward_weight(w, &params, &mut split, &mut |_, _| Ok(())).unwrap();
//! let d = (dx - dx2.unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
//! assert!(d < 1e-6);
//! for (a, b) in full.as_slice().iter().zip(split.as_slice()) {
//!     assert!((a - b).abs() < 1e-6);
//! }
//! ```

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use candle_core::{bail, Result, Tensor, TensorId};

use super::{tensor_bytes, Saved, Stack, Stash};
use crate::engine::backend::ParamSource;
use crate::engine::block::Ctx;
use crate::engine::flat::GradSink;
use crate::ledger::{Charge, Mem};
use crate::ops::tape::DeferredGrad;

/// What W needs of one block once B has run.
enum Kept {
    /// The weight-gradient work B's ops deferred, and the block's parameter
    /// tensors by id.
    Tape {
        work: Vec<Box<dyn DeferredGrad>>,
        ids: HashMap<TensorId, usize>,
    },
    /// The block's input and the gradient of its output (W recomputes).
    Recompute { x: Tensor, gy: Tensor },
}

/// What a weight-gradient pass (W) needs once the input-gradient pass (B)
/// has run, per block.
pub struct WeightStash {
    range: Range<usize>,
    /// Per block, in block order.
    saved: Vec<Kept>,
    targets: Option<Tensor>,
    _activations: Charge,
}

impl WeightStash {
    /// The blocks this stash covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// How many blocks' W recomputes their forward (the others use the tape).
    pub fn recomputed_blocks(&self) -> usize {
        self.saved
            .iter()
            .filter(|k| matches!(k, Kept::Recompute { .. }))
            .count()
    }
}

/// Bytes of the distinct tensors a tape keeps.
fn tape_bytes(work: &[Box<dyn DeferredGrad>]) -> usize {
    let mut seen = HashSet::new();
    let tensors: usize = work
        .iter()
        .flat_map(|w| w.kept())
        .filter(|t| seen.insert(t.id()))
        .map(tensor_bytes)
        .sum();
    tensors + work.iter().map(|w| w.kept_buffer_bytes()).sum::<usize>()
}

impl Stack {
    /// Forward of blocks `range` for a split backward: as [`Stack::forward`],
    /// but in `KeepGraph` mode the parameters enter the graph as constants,
    /// so that [`Stack::backward_input`] computes no parameter gradient.
    pub fn forward_frozen(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
        src: &dyn ParamSource,
    ) -> Result<(Tensor, Stash)> {
        self.forward_impl(range, x, targets, src, false)
    }

    /// B: the gradient of the range's input (`None` for token ids), block by
    /// block from the top, without parameter gradients. Returns it with the
    /// stash of the matching [`Stack::backward_weight`].
    pub fn backward_input(
        &self,
        stash: Stash,
        gy: &Tensor,
        src: &dyn ParamSource,
    ) -> Result<(Option<Tensor>, WeightStash)> {
        let Stash {
            range,
            saved,
            targets,
            _activations,
        } = stash;
        let ctx = Ctx {
            targets: targets.as_ref(),
            train: true,
        };
        let mut gy = gy.detach();
        let mut dx = None;
        let mut keep = Vec::with_capacity(range.len());
        let mut bytes = 0;
        for (b, saved) in range.clone().rev().zip(saved.into_iter().rev()) {
            // The input (detached, for a recomputing W), the graph from the
            // input `Var` to the output for a float input, and the
            // parameters' ids.
            let saved = super::partition::restore(saved, self.partition.as_ref())?;
            let (x, node, ids) = match saved {
                Saved::Part(_) => unreachable!("restored above"),
                Saved::Input(x) if !x.dtype().is_float() => (Some(x), None, HashMap::new()),
                Saved::Input(x) => {
                    let (m, served, _working) = self.build(b, src, false)?;
                    let (_, node) = self.forward_node(b, m.as_ref(), &x, &ctx)?;
                    (Some(x), Some(node), served.ids)
                }
                Saved::Graph { node, .. } if node.has_id_input() => bail!(
                    "block {b}: its token-id input was not kept; run the range with \
                     `forward_frozen` (not `forward`) before `backward_input`"
                ),
                Saved::Graph { node, served, .. } => (node.input(), Some(node), served.ids),
                Saved::Released(_) => bail!(
                    "block {b}: a ZeRO-3 forward (Activations::KeepActivations) has no split \
                     backward; run the range with `forward_frozen`"
                ),
            };
            // Only the CPU kernels record weight gradients for later; on the
            // device-generic path the block recomputes for its W pass.
            let taped = node.is_some()
                && self.blocks[b].defers_weight_grads()
                && crate::ops::host_kernels(&self.device);
            let mut work = Vec::new();
            dx = match node {
                Some(node) => {
                    let (_, w, g) = node.backward(b, &gy, taped)?;
                    work = w;
                    g
                }
                None => None,
            };
            if taped {
                bytes += tape_bytes(&work);
                keep.push(Kept::Tape { work, ids });
            } else {
                // Only blocks that defer run direct, and their W is taped.
                let x = x.expect("a node without its input defers its weight gradients");
                bytes += tensor_bytes(&x) + tensor_bytes(&gy);
                keep.push(Kept::Recompute { x, gy: gy.clone() });
            }
            if let Some(g) = &dx {
                gy = g.clone();
            }
        }
        keep.reverse();
        let w = WeightStash {
            range,
            saved: keep,
            targets,
            _activations: self.ledger.charge(Mem::Activations, bytes),
        };
        Ok((dx, w))
    }

    /// W: the parameter gradients of a range whose B has run, added into
    /// `sink`; `hook(b, sink)` runs after each block (top block first), as in
    /// [`Stack::backward`].
    pub fn backward_weight<S: GradSink>(
        &self,
        stash: WeightStash,
        src: &dyn ParamSource,
        sink: &mut S,
        hook: &mut dyn FnMut(usize, &mut S) -> Result<()>,
    ) -> Result<()> {
        let WeightStash {
            range,
            saved,
            targets,
            _activations,
        } = stash;
        let ctx = Ctx {
            targets: targets.as_ref(),
            train: true,
        };
        for (b, kept) in range.rev().zip(saved.into_iter().rev()) {
            match kept {
                Kept::Tape { work, ids } => self.weight_from_tape(b, work, &ids, sink)?,
                Kept::Recompute { x, gy } => {
                    let (m, served, working) = self.build(b, src, true)?;
                    let y = m.forward(&x, &ctx)?;
                    if y.shape() != gy.shape() {
                        bail!(
                            "block {b}: output {:?} but upstream gradient {:?}",
                            y.shape(),
                            gy.shape()
                        )
                    }
                    let tape = self.blocks[b].defers_weight_grads();
                    let (grads, work) = super::backward_taped(&y, &gy, tape)?;
                    self.accumulate_vars(Some(b), &served, Some(&grads), work, sink)?;
                    drop((grads, served, working));
                }
            }
            hook(b, sink)?;
        }
        Ok(())
    }

    /// W of one block from its tape: each deferred op's weight gradients,
    /// in the order B met them, added to their parameters' slots.
    fn weight_from_tape<S: GradSink>(
        &self,
        b: usize,
        work: Vec<Box<dyn DeferredGrad>>,
        ids: &HashMap<TensorId, usize>,
        sink: &mut S,
    ) -> Result<()> {
        let got = self.accumulate_deferred(work, ids, sink)?;
        if let Some(k) = ids.values().filter(|k| !got.contains(k)).min() {
            bail!(
                "parameter `{}` (block {b}) received no deferred gradient: the block says \
                 `defers_weight_grads` but uses it outside the ops that defer (phalanx::ops \
                 linear, layer_norm, add_bias, or an op calling ops::tape::defer)",
                self.layout.params()[*k].name
            )
        }
        Ok(())
    }
}
