//! The block stack: forward and backward block by block over any sub-range.
//!
//! Backward of block b with upstream gradient gy (llm.c's layer-by-layer
//! backward, done with candle autograd inside the block):
//!   1. the block input x becomes a `Var` (token ids do not: no input grad),
//!      the parameters are materialised as `Var`s from the parameter source;
//!   2. y = block(x);  (y * gy).sum_all().backward()
//!      (for the head, y is the scalar mean loss and gy the loss scale, e.g.
//!      1 / grad_accum_steps);
//!   3. the `GradStore` holds d/dx (the next gy, going down) and d/dparams,
//!      which are added into the gradient sink (ties included);
//!   4. the block's graph and working parameters are dropped, then
//!      `hook(b, sink)` runs: every parameter *owned* by block b now has its
//!      final gradient for this micro-batch, so DDP can launch the all-reduce
//!      of the buckets that just completed while blocks b-1.. still compute.
//!
//! Activations, two modes ([`Activations`]):
//! - `KeepGraph` (default, fastest): the forward runs with `Var`s and keeps
//!   each block's autograd graph until its backward.
//! - `Recompute` (activation checkpointing per block): the forward runs
//!   without autograd and saves only each block's input; the backward runs the
//!   block's forward again. Costs one more forward; saves all the inner
//!   activations. The ledger's `Activations` count is exact here.
//!
//! In `KeepGraph` the ledger counts the block boundary tensors (inputs and
//! outputs); candle does not expose its graph, so the inner tensors a graph
//! keeps are not counted.
//!
//! A range's forward returns a [`Stash`] (what its backward needs); several
//! stashes may be alive at once, which is what pipeline schedules (1F1B) need.
//!
//! Split backward (zero-bubble schedules, [`split`]): `forward_frozen` keeps a
//! graph whose parameters are constants; `backward_input` (B) then gives the
//! input gradient only, and `backward_weight` (W) the parameter gradients
//! only, as late as the schedule wants: from the tensors B's ops kept on a
//! tape (`ops::tape`) for blocks that defer their weight gradients, else by
//! running the block's forward again with the parameters as `Var`s.
//!
//! How each backward's gradients reach the sink (candle's, the deferred
//! ones, or held on the device): [`grads`].
//!
//! ```
//! use phalanx::engine::{Activations, FlatBuffer, FnBlock, Stack, Block};
//! use phalanx::ledger::{Ledger, Mem};
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let blocks: Vec<Box<dyn Block>> = vec![
//!     Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(3, 3, vb.pp("l0")))),
//!     Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(3, 1, vb.pp("l1")))),
//! ];
//! let ledger = Ledger::new();
//! let stack = Stack::new(blocks, &dev, Activations::Recompute, &ledger).unwrap();
//! let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
//! stack.init_params(params.as_mut_slice(), 0);
//! let mut grads = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
//! let x = Tensor::ones((2, 3), candle_core::DType::F32, &dev).unwrap();
//! let (y, stash) = stack.forward(0..2, &x, None, &params).unwrap();
//! let gy = Tensor::ones(y.shape(), y.dtype(), &dev).unwrap();
//! let mut order = vec![];
//! let dx = stack.backward(stash, &gy, &params, &mut grads, &mut |b, _| { order.push(b); Ok(()) }).unwrap();
//! assert_eq!(order, vec![1, 0]);
//! assert_eq!(dx.unwrap().dims(), &[2, 3]);
//! ```

use std::ops::Range;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::backend::{ParamSource, Served, Server};
use super::block::{Block, BlockModule, Ctx};
use super::flat::{FlatBuffer, GradSink};
use super::init;
use super::layout::Layout;
use super::resident::{HeldGrads, Resident};
use crate::ledger::{Charge, Ledger, Mem};

mod grads;
mod node;
mod partition;
mod split;
use node::{backward_taped, Node};
pub use split::WeightStash;

/// What the forward keeps for the backward (activation checkpointing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// Keep every block's autograd graph (fast, more memory).
    #[default]
    KeepGraph,
    /// Keep block inputs only, recompute each block in its backward
    /// (`checkpoint()` around every block; Megatron's full recomputation).
    Recompute,
    /// Recompute every k-th block (blocks 0, k, 2k, ...), keep the others'
    /// graphs: Megatron's `--recompute-method uniform` trade-off.
    RecomputeEvery(usize),
    /// ZeRO-3 without recomputation: a block with a direct backward that
    /// can let go of its parameters ([`super::DirectBackward::release_params`])
    /// keeps its activations but not its parameters, which the backward
    /// is served again (gathered again); every other block is recomputed.
    KeepActivations,
}

impl Activations {
    /// Whether block `b` is recomputed in its backward.
    pub fn recomputes(self, b: usize) -> bool {
        match self {
            Activations::KeepGraph | Activations::KeepActivations => false,
            Activations::Recompute => true,
            Activations::RecomputeEvery(k) => k > 0 && b.is_multiple_of(k),
        }
    }
}

/// One block's saved state.
enum Saved {
    /// Recompute mode: the block's input.
    Input(Tensor),
    /// Recompute mode with partitioned checkpoints: this tp rank's slice.
    Part(partition::Piece),
    /// KeepGraph mode: the block's forward (its graph from the input
    /// variable to the output, or its direct backward), and what the block
    /// was served (its parameter variables, and every parameter tensor by
    /// id for the tape).
    Graph {
        node: Node,
        served: Served,
        _working: Charge,
    },
    /// KeepActivations mode: a direct backward without its parameters
    /// (rebound from the block rebuilt for the backward).
    Released(Node),
}

/// Everything the backward of a forwarded range needs.
pub struct Stash {
    range: Range<usize>,
    saved: Vec<Saved>,
    targets: Option<Tensor>,
    _activations: Charge,
}

impl Stash {
    /// The blocks this stash covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }
}

/// The model's blocks, their parameter layout, and how to run them.
pub struct Stack {
    blocks: Vec<Box<dyn Block>>,
    layout: Layout,
    device: Device,
    activations: Activations,
    /// The dtype blocks compute in (parameters are cast to it, block inputs
    /// too); master parameters and gradients stay f32.
    compute: DType,
    /// Partitioned checkpoints: the tp group whose ranks each keep a slice.
    partition: Option<phalanx_comm::ProcessGroup>,
    ledger: Ledger,
    /// Blocks whose forward a backward ran again (recomputation), so far.
    recomputed: std::sync::atomic::AtomicU64,
    /// The parameters' device copies, kept while the source is unchanged.
    resident: Resident,
    /// Gradients held on the device across micro-batches.
    held: HeldGrads,
}

/// `sum(y * gy)`, whose backward gives the vector-Jacobian product; `gy`
/// is cast to `y`'s dtype (the head's loss is f32 whatever blocks compute in).
pub(super) fn weighted_sum(y: &Tensor, gy: &Tensor) -> Result<Tensor> {
    if gy.dtype() != y.dtype() {
        (y * gy.to_dtype(y.dtype())?)?.sum_all()
    } else {
        (y * gy)?.sum_all()
    }
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Stack {
    /// Build each block once with a recording backend (shapes only) to
    /// learn its parameters.
    pub fn new(
        blocks: Vec<Box<dyn Block>>,
        device: &Device,
        activations: Activations,
        ledger: &Ledger,
    ) -> Result<Self> {
        let mut requests = Vec::with_capacity(blocks.len());
        let memory = machine_memory();
        for (b, block) in blocks.iter().enumerate() {
            // Its shapes first (nothing allocated): a block bigger than the
            // machine is an error here, not the allocator's abort below.
            let decls = super::backend::declarations(block.as_ref())
                .map_err(|e| e.context(format!("building block {b}")))?;
            let numel = decls.iter().try_fold(0usize, |n, d| {
                n.checked_add(crate::ledger::checked_numel(&d.shape)?)
            });
            let bytes = numel.and_then(|n| n.checked_mul(4));
            if let (Some(mem), b_bytes) = (memory, bytes) {
                if b_bytes.is_none_or(|x| x as u64 > mem) {
                    candle_core::bail!(
                        "block {b} declares {} parameters ({}), more than this machine's {:.1} GiB \
                         of memory and swap can hold: check the model's size settings",
                        numel.map_or("over 2^64".to_string(), |n| n.to_string()),
                        b_bytes.map_or("beyond any machine".to_string(), |x| format!(
                            "{:.1} GiB as f32",
                            x as f64 / (1u64 << 30) as f64
                        )),
                        mem as f64 / (1u64 << 30) as f64
                    );
                }
            }
            // The shapes are the layout's requests: the block is built once,
            // with nothing of its parameters' size allocated.
            requests.push(decls);
        }
        Ok(Self {
            layout: Layout::new(requests)?,
            blocks,
            device: device.clone(),
            activations,
            compute: DType::F32,
            partition: None,
            ledger: ledger.clone(),
            recomputed: Default::default(),
            resident: Resident::new(ledger),
            held: HeldGrads::new(ledger),
        })
    }

    /// Off the CPU kernels (CUDA): while `on`, backwards add their
    /// gradients up on the device instead of into the sink; the first
    /// backward after adds them to its own and reads the sum back (see
    /// [`super::resident`]). On the CPU kernels it changes nothing.
    pub fn hold_grads(&self, on: bool) {
        self.held.set_holding(on);
    }

    /// Off the CPU kernels: the parameters of `range` (whole parameters)
    /// on the device as one (n,) f32 tensor, when the copies kept for
    /// `src` are current; `None` otherwise (the caller uploads).
    pub fn device_params(
        &self,
        src: &dyn ParamSource,
        range: Range<usize>,
    ) -> Result<Option<Tensor>> {
        if crate::ops::host_kernels(&self.device) {
            return Ok(None);
        }
        self.resident.flat(src, self.layout.params(), range)
    }

    /// Off the CPU kernels: keep `flat`, the values of `range` just
    /// written into `src` (an optimizer's step on the device), as the
    /// parameters' device copies, so that the next build uploads nothing.
    pub fn keep_device_params(
        &self,
        src: &dyn ParamSource,
        range: Range<usize>,
        flat: &Tensor,
    ) -> Result<()> {
        if crate::ops::host_kernels(&self.device) {
            return Ok(());
        }
        self.resident.adopt(src, self.layout.params(), range, flat)
    }

    /// `flat` ((n,) f32 on the device) becomes the values of `params` (the
    /// whole buffer), left on the device until the host reads them
    /// ([`FlatBuffer::defer_to`]), and, off the CPU kernels, the kept
    /// copies for the next build: one copy per parameter, shared by both.
    pub fn defer_params(&self, params: &mut FlatBuffer, flat: &Tensor) -> Result<()> {
        if crate::ops::host_kernels(&self.device) {
            return params.defer_to(vec![(0, flat.copy()?)]);
        }
        let infos = self.layout.params();
        // The old values (the kept copies, and the pieces the buffer was
        // deferred to, the same tensors) go before the new copies are
        // made: `flat` holds the new values meanwhile.
        params.defer_to(vec![(0, flat.clone())])?;
        self.resident.clear();
        let vars = Resident::copies(infos, 0..params.len(), flat)?;
        let pieces = vars
            .iter()
            .map(|(k, v)| (infos[*k].offset, v.as_tensor().clone()))
            .collect();
        params.defer_to(pieces)?;
        self.resident.keep(params, infos, &vars);
        Ok(())
    }

    /// Off the CPU kernels: the gradients held on the device for `range`
    /// (whole parameters), taken out as one (n + `pad`,) f32 tensor, `pad`
    /// zeros last; `None` when none are held.
    pub fn take_held_grads(&self, range: Range<usize>, pad: usize) -> Result<Option<Tensor>> {
        if crate::ops::host_kernels(&self.device) {
            return Ok(None);
        }
        self.held
            .take_flat(self.layout.params(), range, &self.device, pad)
    }

    /// How many parameters' gradients are held on the device.
    pub fn held_grads_count(&self) -> usize {
        self.held.count()
    }

    /// Drop every gradient held on the device.
    pub fn drop_held_grads(&self) {
        self.held.clear();
    }

    /// Blocks whose forward a backward has run again (activation
    /// recomputation) since the stack was built.
    pub fn recomputed_blocks(&self) -> u64 {
        self.recomputed.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn activations(&self) -> Activations {
        self.activations
    }

    pub fn set_activations(&mut self, a: Activations) {
        self.activations = a;
    }

    /// Mixed precision: blocks compute in `dtype` (F32, BF16 or F16).
    pub fn set_compute_dtype(&mut self, dtype: DType) {
        self.compute = dtype;
    }

    /// Keep only this rank's 1/tp slice of each checkpointed (recomputed)
    /// block input, all-gathered over `tp` before recomputation
    /// (`activation_checkpointing.partition_activations`).
    pub fn set_partition_group(&mut self, tp: Option<phalanx_comm::ProcessGroup>) {
        self.partition = tp.filter(|g| g.size() > 1);
    }

    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// A float activation in the compute dtype (token ids pass unchanged).
    fn to_compute(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype().is_float() && x.dtype() != self.compute {
            x.to_dtype(self.compute)
        } else {
            Ok(x.clone())
        }
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Write the initial parameters (from the blocks' init hints, seeded by
    /// `(seed, name)`) into a flat buffer of `layout().num_params()` values.
    pub fn init_params(&self, flat: &mut [f32], seed: u64) {
        let all = 0..self.layout.num_params();
        self.init_params_in(flat, seed, std::slice::from_ref(&all));
    }

    /// As [`Stack::init_params`], for the parameters overlapping `ranges`
    /// only (each is seeded by its name, so the values are the same as in a
    /// whole-model initialisation).
    pub fn init_params_in(&self, flat: &mut [f32], seed: u64, ranges: &[Range<usize>]) {
        for p in self.layout.params() {
            let r = p.range();
            if ranges.iter().any(|k| k.start < r.end && r.start < k.end) {
                init::fill(&mut flat[r], &p.shape, &p.init, seed, &p.name);
            }
        }
    }

    /// Build block `b` from `src`; `grad` binds `Var`s.
    fn build(
        &self,
        b: usize,
        src: &dyn ParamSource,
        grad: bool,
    ) -> Result<(Box<dyn BlockModule>, Served, Charge)> {
        let (server, served) = Server::new(&self.layout, src, Some(b), grad, &self.device);
        // Off the CPU kernels (CUDA), the parameters stay on the device
        // between builds while they are unchanged (`resident`).
        let keep = !crate::ops::host_kernels(&self.device);
        let server = server.keeping(keep.then_some(&self.resident));
        let vb = VarBuilder::from_backend(Box::new(server), self.compute, self.device.clone());
        // A deferring block's backward always runs under a tape
        // (`backward_taped`), so it may build tape-only modules.
        let module = if self.blocks[b].defers_weight_grads() {
            crate::ops::tape::collected(|| self.blocks[b].build(vb))?
        } else {
            self.blocks[b].build(vb)?
        };
        let served = std::mem::take(&mut *served.lock().unwrap());
        let working = self.ledger.charge(Mem::Working, served.bytes);
        Ok((module, served, working))
    }

    fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start >= range.end || range.end > self.blocks.len() {
            bail!(
                "block range {range:?} is empty or outside 0..{}",
                self.blocks.len()
            )
        }
        Ok(())
    }

    /// Forward without autograd (evaluation, generation). `targets` reach the
    /// head; without them the head returns logits.
    pub fn forward_eval(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
        src: &dyn ParamSource,
    ) -> Result<Tensor> {
        self.check_range(&range)?;
        let ctx = Ctx {
            targets,
            train: false,
        };
        let mut x = self.to_compute(x)?;
        for b in range {
            let (m, _served, _working) = self.build(b, src, false)?;
            x = m.forward(&x, &ctx)?;
        }
        // Callers read logits and losses as f32.
        if x.dtype().is_float() && x.dtype() != DType::F32 {
            x = x.to_dtype(DType::F32)?;
        }
        Ok(x)
    }

    /// Forward of blocks `range` for training: returns the output (the loss
    /// if the range ends with the head and targets are given) and the stash
    /// its backward needs.
    pub fn forward(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
        src: &dyn ParamSource,
    ) -> Result<(Tensor, Stash)> {
        self.forward_impl(range, x, targets, src, true)
    }

    /// The training forward; `param_vars = false` binds the parameters as
    /// constants (the input stays a `Var`), for the split backward.
    fn forward_impl(
        &self,
        range: Range<usize>,
        x: &Tensor,
        targets: Option<&Tensor>,
        src: &dyn ParamSource,
        param_vars: bool,
    ) -> Result<(Tensor, Stash)> {
        self.check_range(&range)?;
        let ctx = Ctx {
            targets,
            train: true,
        };
        let mut saved = Vec::with_capacity(range.len());
        let mut act_bytes = 0;
        let mut x = self.to_compute(&x.detach())?;
        for b in range.clone() {
            match self.activations {
                a if a.recomputes(b) => {
                    match &self.partition {
                        Some(pg) if x.dtype().is_float() => {
                            let piece = partition::split(&x, pg)?;
                            act_bytes += piece.bytes();
                            saved.push(Saved::Part(piece));
                        }
                        _ => {
                            act_bytes += tensor_bytes(&x);
                            saved.push(Saved::Input(x.clone()));
                        }
                    }
                    let (m, _served, _working) = self.build(b, src, false)?;
                    x = m.forward(&x, &ctx)?;
                }
                Activations::KeepActivations => {
                    let (m, _served, _working) = self.build(b, src, false)?;
                    let node = match x.dtype().is_float() && self.blocks[b].defers_weight_grads() {
                        true => m.forward_direct(&x, &ctx)?,
                        false => None,
                    };
                    // A direct backward that lets go of its parameters is
                    // kept; anything else keeps the input and recomputes the
                    // block in its backward.
                    let (y, released) = match node {
                        Some((y, mut back)) => {
                            let ok = back.release_params();
                            (y, ok.then_some(back))
                        }
                        None => (m.forward(&x, &ctx)?, None),
                    };
                    act_bytes += tensor_bytes(&x);
                    match released {
                        Some(back) => {
                            act_bytes += tensor_bytes(&y) + back.kept_bytes();
                            let shape = y.shape().clone();
                            saved.push(Saved::Released(Node::Direct { back, shape }));
                        }
                        None => saved.push(Saved::Input(x.clone())),
                    }
                    x = y;
                }
                _ if !param_vars && !x.dtype().is_float() => {
                    // Token ids under a split backward: B has nothing to do
                    // for this block and W recomputes it from the ids.
                    act_bytes += tensor_bytes(&x);
                    saved.push(Saved::Input(x.clone()));
                    let (m, _served, _working) = self.build(b, src, false)?;
                    x = m.forward(&x, &ctx)?;
                }
                _ => {
                    act_bytes += tensor_bytes(&x);
                    let (m, served, working) = self.build(b, src, param_vars)?;
                    let (y, node) = self.forward_node(b, m.as_ref(), &x, &ctx)?;
                    act_bytes += tensor_bytes(&y) + node.kept_bytes();
                    x = y.detach();
                    saved.push(Saved::Graph {
                        node,
                        served,
                        _working: working,
                    });
                }
            }
        }
        let stash = Stash {
            range,
            saved,
            targets: targets.cloned(),
            _activations: self.ledger.charge(Mem::Activations, act_bytes),
        };
        Ok((x, stash))
    }

    /// Backward of a stash with upstream gradient `gy` (same shape as the
    /// range's output; for the loss a scalar: the loss scale). Parameter
    /// gradients are added into `sink`; `hook(b, sink)` runs after each block,
    /// in backward order. Returns the gradient of the range's input (`None`
    /// when the input is token ids).
    pub fn backward<S: GradSink>(
        &self,
        stash: Stash,
        gy: &Tensor,
        src: &dyn ParamSource,
        sink: &mut S,
        hook: &mut dyn FnMut(usize, &mut S) -> Result<()>,
    ) -> Result<Option<Tensor>> {
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
        for (b, saved) in range.rev().zip(saved.into_iter().rev()) {
            let saved = partition::restore(saved, self.partition.as_ref())?;
            let (node, served, working) = match saved {
                Saved::Input(x) => {
                    self.recomputed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let (m, served, working) = self.build(b, src, true)?;
                    let (_, node) = self.forward_node(b, m.as_ref(), &x, &ctx)?;
                    (node, served, working)
                }
                Saved::Graph {
                    node,
                    served,
                    _working,
                } => (node, served, _working),
                Saved::Released(mut node) => {
                    let (m, served, working) = self.build(b, src, true)?;
                    if let Node::Direct { back, .. } = &mut node {
                        back.rebind(m.as_ref())?;
                    }
                    (node, served, working)
                }
                Saved::Part(_) => unreachable!("restored above"),
            };
            let tape = self.blocks[b].defers_weight_grads();
            let (grads, work, g) = node.backward(b, &gy, tape)?;
            self.accumulate_vars(Some(b), &served, grads.as_ref(), work, sink)?;
            dx = g;
            // Free the graph and the working parameters before the hook runs.
            drop((grads, served, working));
            hook(b, sink)?;
            if let Some(g) = &dx {
                gy = g.clone();
            }
        }
        Ok(dx)
    }

    /// Whole-model autograd in one graph (no block boundaries, ties are one
    /// `Var`): the reference the block-by-block backward is tested against.
    /// Returns the loss and the flat gradient of `loss * loss_scale`.
    pub fn reference_grads(
        &self,
        x: &Tensor,
        targets: &Tensor,
        loss_scale: f32,
        src: &dyn ParamSource,
    ) -> Result<(f32, Vec<f32>)> {
        let (server, served) = Server::new(&self.layout, src, None, true, &self.device);
        let vb = VarBuilder::from_backend(Box::new(server), self.compute, self.device.clone());
        let ctx = Ctx {
            targets: Some(targets),
            train: true,
        };
        let mut h = x.clone();
        for block in &self.blocks {
            let m = crate::ops::tape::collected(|| block.build(vb.clone()))?;
            h = m.forward(&h, &ctx)?;
        }
        let loss = h.to_scalar::<f32>()?;
        let served = std::mem::take(&mut *served.lock().unwrap());
        let scale = Tensor::new(loss_scale, h.device())?;
        let (grads, work) = backward_taped(&h, &scale, true)?;
        // A buffer of its own ledger: the reference is not the engine's memory.
        let mut flat = FlatBuffer::zeros(&self.layout, &Ledger::new(), Mem::Grads);
        self.accumulate_vars(None, &served, Some(&grads), work, &mut flat)?;
        Ok((loss, flat.as_slice().to_vec()))
    }
}

/// This machine's memory and swap in bytes (Linux `/proc/meminfo`), if
/// known.
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    Some((kib("MemTotal:")? + kib("SwapTotal:").unwrap_or(0)) * 1024)
}
