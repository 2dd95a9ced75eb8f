//! Data parallel (DDP): every rank holds the whole model, computes gradients
//! on its slice of the batch, and the gradients are averaged across ranks.
//!
//! As PyTorch's DDP:
//! - gradients travel in buckets (default 25 MB), filled in backward order;
//!   a bucket's async all-reduce starts as soon as the last block in it has
//!   finished its backward, so it overlaps the backward of earlier blocks;
//! - no communication on the non-final micro-steps of gradient accumulation
//!   (`no_sync`): gradients accumulate locally and are reduced once;
//! - initial parameters are broadcast from rank 0;
//! - the optimizer (whole model) belongs to the strategy, and the step ends
//!   through the shared finish path (`optim::step`);
//! - optionally, every K steps, a check that all ranks hold identical
//!   parameters, with an error naming the diverged rank.
//!
//! Buckets are [`Bucket`]s of the gradient-reduction seam ([`super::reduce`]):
//! contiguous ranges of the flat gradient buffer covering whole blocks.
//! With the gradients held on the device (a GPU under NCCL, or the CPU's
//! device-generic path), the same buckets are averaged where they lie
//! (`held::forward_backward_reducing`).

use super::pool::Pool;
use super::reduce::{Collective, CommHook, DefaultHook, ReadyCursor, Reducer};
use super::state::{fill_params, restore_optimizer, snapshot, StateFill, StateRange};
use super::{accumulate, BatchFn, Strategy};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::step::{
    agree_and_clip, finish_step, weighted_sum_squares, weighted_sum_squares_on, StepOutcome, Update,
};
use crate::optim::Grads;
use crate::optim::Optimizer;
use crate::precision::LossScaler;
use candle_core::Tensor;
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::ops::Range;

pub use super::reduce::{plan_buckets, Bucket};

#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Bucket capacity in bytes (PyTorch's bucket_cap_mb * 2^20).
    pub bucket_bytes: usize,
    /// Check parameter equality across ranks every K steps (0: never).
    pub check_every: usize,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_bytes: 25 << 20,
            check_every: 0,
        }
    }
}

pub struct Ddp {
    pg: ProcessGroup,
    mesh: DeviceMesh,
    cfg: DdpConfig,
    buckets: Vec<Bucket>,
    reducer: Reducer,
    /// The buckets' copies, reused every step (see `all_reduce_micro_step`).
    pool: Pool,
    opt: Box<dyn Optimizer + Send>,
    tp_replicated: Vec<Range<usize>>,
    /// Allowed to keep unreduced gradients on the device through the step
    /// ([`Strategy::keep_grads_on_device`]).
    device_grads: bool,
    /// This step's micro-batches held all their gradients on the device
    /// (set by each micro-step, the same for all of a step's; read by
    /// `finish_step`).
    held_all: bool,
    /// The step's gradients averaged on the device bucket by bucket
    /// during the last backward (`held::forward_backward_reducing`).
    reduced: Option<Tensor>,
}

impl Ddp {
    /// Plan the buckets for `engine` and broadcast dp rank 0's parameters.
    /// `opt` updates the whole flat buffer; `tp_replicated` lists the flat
    /// ranges every tensor-parallel rank holds whole (for the norm).
    pub fn new(
        engine: &mut Engine,
        mesh: &DeviceMesh,
        cfg: DdpConfig,
        opt: Box<dyn Optimizer + Send>,
        tp_replicated: Vec<Range<usize>>,
    ) -> Result<Ddp> {
        let pg = mesh.dp().clone();
        let ranges: Vec<Range<usize>> = engine
            .layout()
            .blocks()
            .iter()
            .map(|b| b.range.clone())
            .collect();
        let buckets = plan_buckets(&ranges, cfg.bucket_bytes.max(4));
        pg.broadcast(engine.params_flat_mut(), 0)?;
        let mut reducer = Reducer::new(pg.clone(), Box::new(DefaultHook::default()));
        reducer.describe(super::reduce::describe(engine.layout(), &buckets));
        let pool = Pool::new(engine.ledger());
        reducer.set_pool(pool.clone());
        Ok(Ddp {
            pg,
            mesh: mesh.clone(),
            cfg,
            buckets,
            reducer,
            pool,
            opt,
            tp_replicated,
            device_grads: false,
            held_all: false,
            reduced: None,
        })
    }

    /// Every micro-batch holds its gradients on the device and the step
    /// takes them there ([`grads_may_stay_on_device`]).
    fn grads_stay_on_device(&mut self, engine: &Engine) -> bool {
        let on_device = self.opt.as_device().is_some();
        grads_may_stay_on_device(
            self.device_grads,
            on_device,
            engine,
            &self.pg,
            &self.reducer,
        )
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Forward and backward of one micro-batch. With `sync` (the last
    /// micro-step), each bucket's reduction is launched as soon as it is
    /// ready and all are awaited before returning; otherwise gradients only
    /// accumulate locally (`no_sync`). Where they stay on the device
    /// (`grads_stay_on_device`) every micro-step holds them there, and the
    /// last averages each bucket there as its backward completes it
    /// (`held::forward_backward_reducing`; with one rank, nothing to).
    pub fn micro_step(
        &mut self,
        engine: &mut Engine,
        inputs: &Tensor,
        targets: &Tensor,
        loss_scale: f32,
        sync: bool,
    ) -> Result<f32> {
        // Unreduced micro-steps keep their gradients on the device (CUDA);
        // with nothing to reduce, or reduced there, all of them do.
        let all = self.grads_stay_on_device(engine);
        self.held_all = all;
        engine.hold_grads(!sync || all);
        if all && sync && self.pg.size() > 1 {
            // Each bucket averaged where it lies as the backward completes
            // it, overlapping the backward of earlier blocks (NCCL).
            let (loss, g) = super::held::forward_backward_reducing(
                engine,
                inputs,
                targets,
                loss_scale,
                &self.buckets,
                &self.pg,
                "DDP",
            )?;
            self.reduced = Some(g);
            return Ok(loss);
        }
        if !sync || all || self.pg.size() == 1 {
            return Ok(engine.forward_backward(inputs, targets, loss_scale)?);
        }
        all_reduce_micro_step(
            engine,
            inputs,
            targets,
            loss_scale,
            &self.buckets,
            &mut self.reducer,
            &self.pool,
        )
    }

    /// Every `check_every` steps: verify that all ranks hold bitwise
    /// identical parameters; the error names the ranks that diverged.
    pub fn maybe_check(&self, engine: &Engine, step: usize) -> Result<()> {
        if self.cfg.check_every == 0 || !step.is_multiple_of(self.cfg.check_every) {
            return Ok(());
        }
        check_identical(&self.pg, engine.params_flat(), step)
    }

    /// The step with the reduced gradients in the flat buffer: on `kept`
    /// (the parameters' device copies, current) where the optimizer is on
    /// the device, which it then keeps as the copies for the next forward.
    #[allow(clippy::too_many_arguments)]
    fn finish_on_host(
        &mut self,
        engine: &mut Engine,
        kept: Option<Tensor>,
        ss: f64,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        let n = engine.num_params();
        let (p, g) = engine.params_and_grads_mut();
        let u = vec![Update {
            params: p,
            grads: g,
            opt: self.opt.as_mut(),
            on_device: kept.as_ref(),
        }];
        let out = finish_step(self.mesh.world(), ss, u, scaler, lr, max_norm, step)?;
        if let Some(dev) = &kept {
            // Stepped on (or, skipped, unchanged): still the copies.
            engine.keep_device_params(0..n, dev)?;
        }
        Ok(out)
    }

    /// The step on the reduced gradients (see `Strategy::finish_step`).
    fn finish_reduced(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        // Every dp replica holds the same reduced gradients: each counts
        // 1/dp of them; tp shards add up, tp-replicated ranges count once.
        let w = 1.0 / self.pg.size() as f64;
        let tp = self.mesh.tp_size;
        let n = engine.num_params();
        // Gradients that stayed on the device, averaged over dp there
        // (bucket by bucket during the last backward; with one rank there
        // is nothing to average), else the reduced ones in the flat buffer.
        let on_device = if std::mem::take(&mut self.held_all) {
            Some(match self.reduced.take() {
                Some(g) => g,
                None => take_reduced_grads(engine, &self.pg, "DDP")?,
            })
        } else {
            None
        };
        let ss = match &on_device {
            Some(g) => weighted_sum_squares_on(g, 0, w, &self.tp_replicated, tp)?,
            None => weighted_sum_squares(engine.grads_flat(), 0, w, &self.tp_replicated, tp),
        };
        // With the optimizer on the device and the parameters' copies
        // there current, it steps on those (no upload), and they stay the
        // copies for the next forward (`engine::resident`).
        let kept = match self.opt.as_device() {
            Some(_) => engine.device_params(0..n)?,
            None => None,
        };
        let (grads_dev, params_dev) = match (on_device, kept) {
            (Some(g), Some(p)) => (g, p),
            (Some(_), None) => {
                // Kept gradients come with kept parameters (the same
                // forward built them): this is a bug, not an input.
                return Err(Error::Check(
                    "DDP: the gradients stayed on the device but the parameters' copies did not"
                        .into(),
                ));
            }
            (None, kept) => {
                let out = self.finish_on_host(engine, kept, ss, scaler, lr, max_norm, step)?;
                self.maybe_check(engine, step + 1)?;
                return Ok(out);
            }
        };
        // Everything on the device: the step too, and the host's copy of
        // the parameters waits there until something on the host reads it
        // (a checkpoint, `check_every`, the end of training).
        let (out, factor) = agree_and_clip(self.mesh.world(), ss, scaler, max_norm, step)?;
        if let Some(factor) = factor {
            if let Some(opt) = self.opt.as_device() {
                opt.step_on(None, &params_dev, Grads::Device(&grads_dev), lr, factor)?;
            }
        }
        engine.defer_params(&params_dev)?;
        self.maybe_check(engine, step + 1)?;
        Ok(out)
    }
}

/// Whether DDP's and ZeRO-1/2's gradients may stay on the device through
/// the step: `allowed` by the trainer, the optimizer on the device
/// (`opt_on_device`), off the CPU kernels, and the gradients either in no
/// need of reduction (a group `pg` of one) or reduced where they lie (the
/// plain average of `reducer`'s hook, on a backend that reduces the
/// device's memory: NCCL on CUDA; any on the CPU). The same on every rank.
pub(crate) fn grads_may_stay_on_device(
    allowed: bool,
    opt_on_device: bool,
    engine: &Engine,
    pg: &ProcessGroup,
    reducer: &Reducer,
) -> bool {
    let dev = engine.device();
    allowed
        && opt_on_device
        && !crate::ops::host_kernels(dev)
        && (pg.size() == 1 || (reducer.plain_average() && crate::collective::reduces_on(pg, dev)))
}

/// The gradients every micro-batch of the step held on the device (DDP's
/// device path with one rank), taken out as one (n,) f32 tensor and
/// averaged over `pg` where they lie (`collective`). Every rank joins the
/// reduction, so no peer waits for one that held nothing; that one fails
/// after it (its zeros were averaged in), naming `what` and its rank.
pub(crate) fn take_reduced_grads(
    engine: &mut Engine,
    pg: &ProcessGroup,
    what: &str,
) -> Result<Tensor> {
    let n = engine.num_params();
    let (g, held) = take_held_grads(engine, 0..n, 0)?;
    crate::collective::all_reduce_in_place(pg, &g, ReduceOp::Avg)?;
    held_or_fail(g, held, pg, what)
}

/// The gradients of `range` held on the device as one (len + `pad`,) f32
/// tensor, `pad` zeros last, and whether there were any (zeros stand in
/// where not, so that the rank still joins its group's reduction;
/// [`held_or_fail`] then fails it). Holding stops.
pub(crate) fn take_held_grads(
    engine: &mut Engine,
    range: Range<usize>,
    pad: usize,
) -> Result<(Tensor, bool)> {
    engine.hold_grads(false);
    let len = range.len();
    Ok(match engine.take_device_grads(range, pad)? {
        Some(g) => (g, true),
        None => (
            Tensor::zeros(len + pad, candle_core::DType::F32, engine.device())?,
            false,
        ),
    })
}

/// The zeros that pad `len` elements to `n` equal blocks (a
/// reduce-scatter's, of ceil(`len` / `n`) each: the shards' geometry).
pub(crate) fn block_padding(len: usize, n: usize) -> usize {
    len.div_ceil(n) * n - len
}

/// `g`, the reduced gradients, where this rank held some; an error naming
/// `what` and the rank where it held none.
pub(crate) fn held_or_fail<T>(g: T, held: bool, pg: &ProcessGroup, what: &str) -> Result<T> {
    if held {
        return Ok(g);
    }
    Err(Error::Check(format!(
        "{what}: rank {} held no gradients on the device after backward",
        pg.rank()
    )))
}

/// One micro-step whose buckets are all-reduced as backward completes them
/// (DDP, ZeRO-1), results written back into the flat gradient buffer.
///
/// Each bucket is reduced in a copy (backward goes on writing the flat
/// buffer's other ranges meanwhile); the copies come from `pool` and go
/// back to it, so a step takes no fresh pages from the kernel (a fresh
/// copy per bucket per step cost llama-60m about 4% of its step zeroing
/// pages).
pub(crate) fn all_reduce_micro_step(
    engine: &mut Engine,
    inputs: &Tensor,
    targets: &Tensor,
    loss_scale: f32,
    buckets: &[Bucket],
    reducer: &mut Reducer,
    pool: &Pool,
) -> Result<f32> {
    let mut cursor = ReadyCursor::default();
    let loss = engine.forward_backward_with(inputs, targets, loss_scale, &mut |b, grads| {
        for id in cursor.advance(buckets, b) {
            let src = &grads[buckets[id].range.clone()];
            let mut copy: Vec<f32> = pool.take(src.len());
            copy.copy_from_slice(src);
            reducer.launch(id, copy, &Collective::AllReduce);
        }
        Ok(())
    });
    // Collect what was launched even when backward failed.
    let reduced = reducer.wait_all();
    let loss = loss?;
    let grads = engine.grads_flat_mut();
    for (id, g) in reduced? {
        grads[buckets[id].range.clone()].copy_from_slice(&g);
        pool.put(g);
    }
    cursor.check_all(buckets, "DDP")?;
    Ok(loss)
}

impl Strategy for Ddp {
    fn name(&self) -> String {
        "DDP".into()
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        accum: usize,
        loss_scale: f32,
    ) -> Result<f32> {
        engine.zero_grad();
        self.reduced = None;
        let dp = self.pg.clone();
        accumulate(&dp, batch, accum, loss_scale, &mut |x, y, scale, last| {
            self.micro_step(engine, x, y, scale, last)
        })
    }

    fn finish_step(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        let out = self.finish_reduced(engine, scaler, lr, max_norm, step);
        // A skipped step leaves the hook's state as it was.
        self.reducer.settled(out)
    }

    fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        Ok(engine.eval_loss(x, y)?)
    }

    fn full_params(&self, engine: &Engine) -> Result<Vec<f32>> {
        Ok(engine.params_flat().to_vec())
    }

    fn optimizers(&self) -> Vec<&(dyn Optimizer + Send)> {
        vec![self.opt.as_ref()]
    }

    fn save_state(&self, engine: &Engine) -> Result<Vec<StateRange>> {
        // Every replica holds the same state: each writes its 1/dp of it,
        // so the replicas write in parallel (DCP's de-duplication).
        let all = snapshot(self.opt.as_ref(), engine.params_flat())?;
        let mine = crate::engine::shard_range(all.range.len(), self.pg.rank(), self.pg.size());
        Ok(vec![all.slice(&mine)])
    }

    fn load_state(
        &mut self,
        engine: &mut Engine,
        fill: &mut StateFill,
        optim_step: u64,
    ) -> Result<()> {
        let p = fill_params(fill, 0..engine.num_params())?;
        engine.params_flat_mut().copy_from_slice(&p);
        restore_optimizer(self.opt.as_mut(), fill, optim_step)
    }

    fn set_comm_hook(&mut self, make: &dyn Fn() -> Box<dyn CommHook>) {
        self.reducer.set_hook(make());
    }

    fn set_hook_rollback(&mut self, on: bool) {
        self.reducer.set_rollback(on);
    }

    fn keep_grads_on_device(&mut self, allowed: bool) {
        self.device_grads = allowed;
    }

    fn hook_state(&self) -> Vec<(String, Vec<f32>)> {
        self.reducer.hook_state()
    }

    fn load_hook_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.reducer.load_hook_state(state)
    }
}

/// A 64-bit digest of the bits of `xs` (FNV-1a over the words).
pub fn digest(xs: &[f32]) -> i64 {
    xs.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3)
    }) as i64
}

/// All-gather a digest of `params` and compare with rank 0's.
pub fn check_identical(pg: &ProcessGroup, params: &[f32], step: usize) -> Result<()> {
    let mut all = vec![0i64; pg.size()];
    pg.all_gather(&[digest(params)], &mut all)?;
    let diverged: Vec<usize> = (0..pg.size()).filter(|&r| all[r] != all[0]).collect();
    if diverged.is_empty() {
        Ok(())
    } else {
        Err(Error::Check(format!(
            "parameters diverged at step {step}: rank(s) {diverged:?} differ from rank 0 \
             (global ranks {:?})",
            diverged
                .iter()
                .map(|&r| pg.global_ranks()[r])
                .collect::<Vec<_>>()
        )))
    }
}
