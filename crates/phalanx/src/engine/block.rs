//! Blocks: the unit the engine runs, checkpoints, shards and pipelines.
//!
//! A model is a sequence of blocks: typically an embedding (input: token ids),
//! N transformer blocks (activation in, activation out) and a head (activation
//! in, scalar mean loss out when targets are given, logits otherwise).
//!
//! A block is ordinary candle / candle-nn code. `Block::build` receives a
//! `candle_nn::VarBuilder` and constructs the block's module exactly as a
//! candle model's `new(vb)` would; the engine calls it
//! - once at start-up with a recording backend, to learn the parameters'
//!   names, shapes and init hints (that is how the flat layout is built), and
//! - before each forward (and recompute) with a backend that serves the
//!   parameters from the flat buffer, as candle `Var`s when gradients are
//!   needed. Building is cheap (a few map look-ups and a copy of the block's
//!   parameters), and it is what lets ZeRO-3/FSDP gather a block's parameters
//!   just before its forward and drop them right after.
//!
//! Parameter names are global (e.g. `transformer.h.3.attn.c_attn.weight`): a
//! name used by two blocks is one tied parameter (see `layout`). Tensor
//! parallel blocks get their tp rank/size from their own constructor.
//!
//! Beware: candle-nn's fused `layer_norm`, `rms_norm` and `softmax_last_dim`
//! (used by `candle_nn::LayerNorm` on contiguous input) have no backward; a
//! block using them trains nothing. Use `phalanx::ops` instead. The engine
//! reports a parameter that receives no gradient as an error.
//!
//! ```
//! use phalanx::engine::{Block, FnBlock};
//! use candle_nn::{linear, Module, VarBuilder};
//! // A residual MLP block from plain candle-nn code.
//! struct Mlp(candle_nn::Linear, candle_nn::Linear);
//! impl Module for Mlp {
//!     fn forward(&self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
//!         x + x.apply(&self.0)?.relu()?.apply(&self.1)?
//!     }
//! }
//! let block = FnBlock::new(|vb: VarBuilder| {
//!     Ok(Mlp(linear(8, 32, vb.pp("mlp0.fc1"))?, linear(32, 8, vb.pp("mlp0.fc2"))?))
//! });
//! let _boxed: Box<dyn Block> = Box::new(block);
//! ```

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

/// Per-call context handed to every block's forward.
#[derive(Clone, Copy, Default)]
pub struct Ctx<'a> {
    /// Targets for the loss (the head uses them; other blocks ignore them).
    /// `None` asks the head for logits instead of the loss.
    pub targets: Option<&'a Tensor>,
    /// Training (dropout on) or evaluation. Dropout is 0 in the reference
    /// models, so this is informational for now.
    pub train: bool,
}

/// A built block: runs its forward with parameters already bound.
pub trait BlockModule {
    /// `x`: token ids (first block) or an activation. Returns the next
    /// activation, or for the head the scalar mean loss (targets given) or
    /// the logits (no targets).
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor>;

    /// For a block whose whole forward is one op with its own backward (the
    /// fused GPT-2 layer): the output with no candle graph behind it, and
    /// that backward. The engine asks only blocks that defer their weight
    /// gradients ([`Block::defers_weight_grads`]), for float inputs, and
    /// runs the backward under the weight-gradient tape. That skips what
    /// candle's backward costs around a single op: the seed `sum(y * dy)`
    /// and the zero-filled gradients it adds y's and x's into, and the
    /// copy that makes x a `Var`. The default, `None`, runs [`Self::forward`]
    /// and candle's backward.
    fn forward_direct(
        &self,
        _x: &Tensor,
        _ctx: &Ctx,
    ) -> Result<Option<(Tensor, Box<dyn DirectBackward>)>> {
        Ok(None)
    }

    /// The parameter tensors [`Self::forward_direct`]'s backward runs on,
    /// for [`DirectBackward::rebind`] (`None`: it cannot be rebound).
    fn direct_params(&self) -> Option<Vec<Tensor>> {
        None
    }
}

/// The backward of a forward that ran outside candle's graph
/// ([`BlockModule::forward_direct`]).
pub trait DirectBackward: Send {
    /// The gradient of the block's input from that of its output; the
    /// parameters' gradients go to the weight-gradient tape
    /// ([`crate::ops::tape`]) the engine runs this under.
    fn backward(self: Box<Self>, dy: &Tensor) -> Result<Tensor>;

    /// Drop the parameters this backward holds, keeping its activations,
    /// so that a strategy that gathers each block's parameters (ZeRO-3)
    /// frees them between the forward and the backward; `false` (the
    /// default): it cannot, and holds them.
    fn release_params(&mut self) -> bool {
        false
    }

    /// Bytes of activations this backward keeps outside tensors (a direct
    /// layer's own buffers), for the memory ledger; 0 (the default): none.
    fn kept_bytes(&self) -> usize {
        0
    }

    /// Hand the parameters back before the backward, from the block
    /// rebuilt on them gathered again ([`BlockModule::direct_params`]).
    fn rebind(&mut self, m: &dyn BlockModule) -> Result<()> {
        let _ = m;
        candle_core::bail!("this block's direct backward cannot take its parameters back")
    }
}

/// A block of the model: knows how to build its module from a VarBuilder.
pub trait Block: Send + Sync {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>>;

    /// Whether every parameter of this block meets the computation only as
    /// a direct argument (or the engine's dtype cast) of ops that defer
    /// their weight gradients to a tape (`phalanx::ops::{linear,
    /// layer_norm, add_bias}`, or a model's own ops through
    /// [`crate::ops::tape`]). Then the zero-bubble W pass computes the
    /// block's parameter gradients from the tensors its B pass kept, with no
    /// recomputation. `false` (the default, always safe) makes W rebuild the
    /// block and run its forward again. A block that says `true` but whose
    /// parameter is missed by the tape is an error at its W pass.
    fn defers_weight_grads(&self) -> bool {
        false
    }
}

/// Adapts a candle-nn style constructor `Fn(VarBuilder) -> Result<M>` with
/// `M: candle_core::Module` into a [`Block`] (for blocks that need no targets).
pub struct FnBlock<F>(F);

impl<F> FnBlock<F> {
    pub fn new(f: F) -> Self {
        Self(f)
    }
}

struct ModuleAdapter<M>(M);

impl<M: Module> BlockModule for ModuleAdapter<M> {
    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        self.0.forward(x)
    }
}

impl<F, M> Block for FnBlock<F>
where
    F: Fn(VarBuilder) -> Result<M> + Send + Sync,
    M: Module + 'static,
{
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        Ok(Box::new(ModuleAdapter((self.0)(vb)?)))
    }
}

/// Adapts a constructor whose module needs the context (e.g. a loss head):
/// `Fn(VarBuilder) -> Result<M>` with `M: BlockModule`.
pub struct CtxBlock<F>(F);

impl<F> CtxBlock<F> {
    pub fn new(f: F) -> Self {
        Self(f)
    }
}

impl<F, M> Block for CtxBlock<F>
where
    F: Fn(VarBuilder) -> Result<M> + Send + Sync,
    M: BlockModule + 'static,
{
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        Ok(Box::new((self.0)(vb)?))
    }
}

/// Any closure `Fn(&Tensor, &Ctx) -> Result<Tensor>` is a built block.
impl<F: Fn(&Tensor, &Ctx) -> Result<Tensor>> BlockModule for F {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        self(x, ctx)
    }
}
