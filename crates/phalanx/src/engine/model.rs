//! `Engine`: a block stack plus the flat parameter and gradient buffers of one
//! rank. This is what a trainer, or a DDP / ZeRO / pipeline layer, drives.
//!
//! One training step, single process (gradient accumulation over micro-steps):
//!
//! ```
//! use phalanx::engine::{Block, Engine, EngineConfig, FnBlock};
//! use phalanx::optim::{AdamW, AdamWConfig, Optimizer};
//! use candle_core::{Device, Tensor, Module};
//! # struct Head;
//! # impl phalanx::engine::BlockModule for Head {
//! #     fn forward(&self, x: &Tensor, ctx: &phalanx::engine::Ctx) -> candle_core::Result<Tensor> {
//! #         (x - ctx.targets.unwrap())?.sqr()?.mean_all()
//! #     }
//! # }
//! let blocks: Vec<Box<dyn Block>> = vec![
//!     Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(4, 4, vb.pp("fc")))),
//!     Box::new(phalanx::engine::CtxBlock::new(|_vb: candle_nn::VarBuilder| Ok(Head))),
//! ];
//! let mut engine = Engine::new(blocks, &Device::Cpu, EngineConfig::default()).unwrap();
//! let mut opt = AdamW::new(AdamWConfig::default(), engine.layout(), 0..engine.num_params(), engine.ledger());
//! let x = Tensor::ones((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
//! let y = Tensor::zeros((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
//! engine.zero_grad();
//! for _micro in 0..2 {
//!     engine.forward_backward(&x, &y, 0.5).unwrap(); // loss scale 1 / micro-steps
//! }
//! let (params, grads) = engine.params_and_grads_mut();
//! opt.step(params, grads, 1e-3, 1.0);
//! ```

use std::ops::Range;

use candle_core::{bail, Device, Result, Tensor};

use super::backend::ParamSource;
use super::block::Block;
use super::flat::FlatBuffer;
use super::layout::{Layout, ParamInfo};
use super::stack::{Activations, Stack, Stash, WeightStash};
use crate::ledger::{Ledger, Mem};

/// How an [`Engine`] is set up.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Seed of the parameter initialisation (same on every rank).
    pub seed: u64,
    pub activations: Activations,
    /// The dtype blocks compute in: F32, or BF16 / F16 for mixed precision
    /// (master parameters, gradients and optimizer state stay f32).
    pub compute_dtype: candle_core::DType,
    /// Leave the parameters zero until [`Engine::init_params`] names the
    /// ranges to initialise (a pipeline stage initialises only its own).
    pub defer_init: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            seed: 1337,
            activations: Activations::KeepGraph,
            compute_dtype: candle_core::DType::F32,
            defer_init: false,
        }
    }
}

/// Blocks + flat parameters + flat gradients + the rank's memory ledger.
pub struct Engine {
    stack: Stack,
    params: FlatBuffer,
    grads: FlatBuffer,
    ledger: Ledger,
    /// The init seed while the parameters await [`Engine::init_params`].
    pending_init: Option<u64>,
    /// The gradient buffer's version when it was last zeroed: unchanged
    /// since, it is zero still and `zero_grad` leaves it (gradients that
    /// stay on the device never touch it).
    grads_zeroed: Option<(u64, u64)>,
}

impl Engine {
    /// Discover the blocks' parameters, allocate the flat buffers and
    /// initialise the parameters.
    pub fn new(blocks: Vec<Box<dyn Block>>, device: &Device, cfg: EngineConfig) -> Result<Self> {
        super::heap::retain_if_asked();
        let ledger = Ledger::new();
        let mut stack = Stack::new(blocks, device, cfg.activations, &ledger)?;
        stack.set_compute_dtype(cfg.compute_dtype);
        // Fallible, so a model configured beyond this machine is an error.
        let mut params = FlatBuffer::try_zeros(stack.layout(), &ledger, Mem::Params)
            .map_err(candle_core::Error::Msg)?;
        if !cfg.defer_init {
            stack.init_params(params.as_mut_slice(), cfg.seed);
        }
        let grads = FlatBuffer::try_zeros(stack.layout(), &ledger, Mem::Grads)
            .map_err(candle_core::Error::Msg)?;
        Ok(Self {
            stack,
            params,
            grads,
            ledger,
            pending_init: cfg.defer_init.then_some(cfg.seed),
            grads_zeroed: None,
        })
    }

    /// Initialise the parameters overlapping `ranges` (all of them with
    /// `None`) if the engine was built with `defer_init`; a no-op otherwise.
    pub fn init_params(&mut self, ranges: Option<&[Range<usize>]>) {
        let Some(seed) = self.pending_init.take() else {
            return;
        };
        let all = 0..self.num_params();
        let ranges = ranges.unwrap_or(std::slice::from_ref(&all));
        self.stack
            .init_params_in(self.params.as_mut_slice(), seed, ranges);
    }

    /// Whether the parameters still await [`Engine::init_params`].
    pub fn init_pending(&self) -> bool {
        self.pending_init.is_some()
    }

    /// Hold only `ranges` of the parameters and gradients (a pipeline
    /// stage's blocks and the tied parameters they read): the rest of the
    /// flat index space costs no memory and the ledger counts only these.
    pub fn hold_only(&mut self, ranges: &[Range<usize>]) {
        self.params.hold_only(ranges);
        self.grads.hold_only(ranges);
    }

    /// The ranges held, `None` when the whole model is.
    pub fn held(&self) -> Option<&[Range<usize>]> {
        self.params.held()
    }

    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    pub fn stack_mut(&mut self) -> &mut Stack {
        &mut self.stack
    }

    pub fn layout(&self) -> &Layout {
        self.stack.layout()
    }

    pub fn device(&self) -> &Device {
        self.stack.device()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn num_blocks(&self) -> usize {
        self.stack.num_blocks()
    }

    /// Number of scalar parameters (tied ones once).
    pub fn num_params(&self) -> usize {
        self.layout().num_params()
    }

    pub fn params_flat(&self) -> &[f32] {
        self.params.as_slice()
    }

    pub fn params_flat_mut(&mut self) -> &mut [f32] {
        self.params.as_mut_slice()
    }

    pub fn grads_flat(&self) -> &[f32] {
        self.grads.as_slice()
    }

    /// The flat gradient buffer, for in-place all-reduce of buckets.
    pub fn grads_flat_mut(&mut self) -> &mut [f32] {
        self.grads.as_mut_slice()
    }

    /// Both buffers at once, for the optimizer step.
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (self.params.as_mut_slice(), self.grads.as_mut_slice())
    }

    /// Off the CPU kernels: the parameters of `range` on the device as one
    /// (n,) tensor when the kept copies are current (no upload), else
    /// `None` ([`super::resident`]).
    pub fn device_params(&self, range: Range<usize>) -> candle_core::Result<Option<Tensor>> {
        self.stack.device_params(&self.params, range)
    }

    /// Off the CPU kernels: keep `flat`, the values of `range` the
    /// optimizer just wrote on the device and into the flat buffer, as the
    /// parameters' device copies (the next forward uploads nothing).
    pub fn keep_device_params(
        &self,
        range: Range<usize>,
        flat: &Tensor,
    ) -> candle_core::Result<()> {
        self.stack.keep_device_params(&self.params, range, flat)
    }

    /// The parameters' values are `t`'s ((n,) f32 on the device) from now
    /// on, until the host reads them (`FlatBuffer::defer_to`): what DDP
    /// with its gradients on the device leaves after its optimizer's step
    /// there, so no step reads them back; a checkpoint, an evaluation on
    /// the host or any other read copies them back then, once.
    /// The values are copied once per parameter, and those copies also
    /// serve the next forward (`engine::resident`): `t` may be dropped.
    pub fn defer_params(&mut self, t: &Tensor) -> candle_core::Result<()> {
        self.stack.defer_params(&mut self.params, t)
    }

    /// Off the CPU kernels: the gradients of `range` that backwards held on
    /// the device ([`Engine::hold_grads`]) and never read back, taken out
    /// as one (n + `pad`,) tensor, `pad` zeros last (a collective's whole
    /// blocks, in the same allocation); `None` when none are held. The
    /// flat gradient buffer does not hold them.
    pub fn take_device_grads(
        &self,
        range: Range<usize>,
        pad: usize,
    ) -> candle_core::Result<Option<Tensor>> {
        self.stack.take_held_grads(range, pad)
    }

    /// The flat parameter buffer as a [`ParamSource`] (e.g. to run the stack
    /// with another gradient sink).
    pub fn param_source(&self) -> &dyn ParamSource {
        &self.params
    }

    /// Drop the full gradient buffer: ZeRO-2/3 keep only a shard of the
    /// gradients, outside the engine. `grads_flat` is empty afterwards.
    pub fn release_grads(&mut self) {
        self.grads = FlatBuffer::released(&self.ledger, Mem::Grads);
    }

    /// Drop the full parameter buffer: ZeRO-3 keeps only a shard and gathers
    /// each block's parameters when it runs. `params_flat` is empty afterwards.
    pub fn release_params(&mut self) {
        self.params = FlatBuffer::released(&self.ledger, Mem::Params);
    }

    /// Put a full parameter buffer back (e.g. gathered from shards to save).
    pub fn restore_params(&mut self, flat: Vec<f32>) {
        self.params = FlatBuffer::from_vec(self.stack.layout(), &self.ledger, Mem::Params, flat);
    }

    /// Start a new accumulation: gradients are added by every backward.
    pub fn zero_grad(&mut self) {
        // (A FlatBuffer always has a version: `None` here never matches.)
        if self.grads.version() != self.grads_zeroed {
            self.grads.fill(0.0);
            self.grads_zeroed = self.grads.version();
        }
        self.stack.drop_held_grads();
    }

    /// Gradient accumulation without reduction (DDP's `no_sync`): while
    /// `on`, off the CPU kernels (CUDA), each backward adds its gradients
    /// up on the device instead of reading them back into the flat buffer;
    /// the first backward with it off reads back the sum, block by block,
    /// before its hook runs. The flat buffer then holds bitwise what it
    /// would have. On the CPU kernels it changes nothing.
    pub fn hold_grads(&mut self, on: bool) {
        self.stack.hold_grads(on);
    }

    fn find(&self, name: &str) -> Result<&ParamInfo> {
        match self.layout().find(name) {
            Some(p) => Ok(p),
            None => bail!("no parameter named `{name}`"),
        }
    }

    /// One parameter's values, flat.
    pub fn param(&self, name: &str) -> Result<&[f32]> {
        let r = self.find(name)?.range();
        Ok(&self.params.as_slice()[r])
    }

    pub fn param_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let r = self.find(name)?.range();
        Ok(&mut self.params.as_mut_slice()[r])
    }

    /// Set every parameter from `value(name, shape)`, which must give a
    /// tensor of the shape the layout declares (a tensor-parallel shard, a
    /// loaded weight); a different shape is an error naming the parameter.
    pub fn fill_params(
        &mut self,
        value: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<()> {
        let names: Vec<(String, Vec<usize>)> = self
            .layout()
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        for (name, shape) in names {
            let t = value(&name, &shape)?;
            if t.dims() != shape.as_slice() {
                bail!(
                    "shard of `{name}`: {:?}, the block declared {shape:?}",
                    t.dims()
                )
            }
            self.param_mut(&name)?
                .copy_from_slice(&t.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(())
    }

    /// One parameter's gradient, flat.
    pub fn grad(&self, name: &str) -> Result<&[f32]> {
        let r = self.find(name)?.range();
        Ok(&self.grads.as_slice()[r])
    }

    /// One parameter as a candle tensor (a copy).
    pub fn param_tensor(&self, name: &str) -> Result<Tensor> {
        let p = self.find(name)?;
        Tensor::from_slice(self.param(name)?, p.shape.as_slice(), self.device())
    }

    /// Forward and backward of one micro-batch over all blocks; gradients of
    /// `loss * loss_scale` are added to the flat gradient buffer. Returns the
    /// (unscaled) mean loss.
    pub fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_scale: f32,
    ) -> Result<f32> {
        self.forward_backward_with(inputs, targets, loss_scale, &mut |_, _| Ok(()))
    }

    /// As [`Engine::forward_backward`], calling `hook(block, grads_flat)`
    /// after each block's backward (blocks in reverse order). When it runs,
    /// the gradients of the parameters block `block` owns
    /// (`layout().block(block).range`) are final for this micro-batch.
    pub fn forward_backward_with(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_scale: f32,
        hook: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<f32> {
        let all = 0..self.num_blocks();
        let (loss, stash) = self
            .stack
            .forward(all, inputs, Some(targets), &self.params)?;
        let loss_value = loss.to_scalar::<f32>()?;
        let gy = Tensor::new(loss_scale, self.device())?;
        self.backward_range(stash, &gy, hook)?;
        Ok(loss_value)
    }

    /// Pipeline building block: forward of blocks `range` from activation (or
    /// token ids) `x`. Keep the stash until the matching backward.
    pub fn forward_range(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
    ) -> Result<(Tensor, Stash)> {
        self.stack.forward(range, x, targets, &self.params)
    }

    /// Pipeline building block: backward of a stash with upstream gradient
    /// `gy` (the loss scale, as a scalar tensor, for a range ending with the
    /// head). Returns the gradient of the range's input.
    pub fn backward_range(
        &mut self,
        stash: Stash,
        gy: &Tensor,
        hook: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        let mut h = |b: usize, g: &mut FlatBuffer| hook(b, g.as_mut_slice());
        self.stack
            .backward(stash, gy, &self.params, &mut self.grads, &mut h)
    }

    /// Zero-bubble building block: forward of blocks `range` with the
    /// parameters as constants, for [`Engine::backward_input_range`] (B) and
    /// [`Engine::backward_weight_range`] (W) instead of `backward_range`.
    pub fn forward_range_frozen(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
    ) -> Result<(Tensor, Stash)> {
        self.stack.forward_frozen(range, x, targets, &self.params)
    }

    /// B: the gradient of the range's input only (no parameter gradient is
    /// touched), and the stash its weight pass needs.
    pub fn backward_input_range(
        &self,
        stash: Stash,
        gy: &Tensor,
    ) -> Result<(Option<Tensor>, WeightStash)> {
        self.stack.backward_input(stash, gy, &self.params)
    }

    /// W: add the range's parameter gradients to the flat gradient buffer,
    /// calling `hook(block, grads_flat)` after each block (top first).
    pub fn backward_weight_range(
        &mut self,
        stash: WeightStash,
        hook: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let mut h = |b: usize, g: &mut FlatBuffer| hook(b, g.as_mut_slice());
        self.stack
            .backward_weight(stash, &self.params, &mut self.grads, &mut h)
    }

    /// Mean loss without autograd.
    pub fn eval_loss(&self, inputs: &Tensor, targets: &Tensor) -> Result<f32> {
        let all = 0..self.num_blocks();
        self.stack
            .forward_eval(all, inputs, Some(targets), &self.params)?
            .to_scalar::<f32>()
    }

    /// The model output without targets (logits for a language model).
    pub fn forward(&self, inputs: &Tensor) -> Result<Tensor> {
        let all = 0..self.num_blocks();
        self.stack.forward_eval(all, inputs, None, &self.params)
    }

    /// Whole-model autograd reference: (loss, flat grads of loss * scale).
    /// Does not touch the gradient buffer.
    pub fn reference_grads(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_scale: f32,
    ) -> Result<(f32, Vec<f32>)> {
        self.stack
            .reference_grads(inputs, targets, loss_scale, &self.params)
    }
}
