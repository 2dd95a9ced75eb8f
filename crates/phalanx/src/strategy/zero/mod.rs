//! ZeRO-1/2/3 (and FSDP's names for them): data parallel with the model
//! states sharded across the data-parallel ranks.
//!
//! | stage | FSDP | parameters | gradients | optimizer state |
//! |---|---|---|---|---|
//! | 1 | — | full | full, all-reduced | shard |
//! | 2 | SHARD_GRAD_OP | full | shard, reduce-scattered in backward | shard |
//! | 3 | FULL_SHARD | shard, gathered per block | shard | shard |
//! | 3 + replicas | HYBRID_SHARD | as 3 inside a shard group, gradients all-reduced across groups | | |
//!
//! Every stage uses one geometry (`Shards`): rank r owns a contiguous range
//! of the flat parameter buffer, and its optimizer updates only that range.
//! Stage 1 all-reduces full gradients (DDP's buckets) and all-gathers the
//! updated parameters. Stage 2 reduce-scatters each gradient bucket as soon
//! as backward completes it, into the rank's gradient shard (every
//! micro-step: on the host path full gradients never outlive a bucket;
//! with its gradients on the device, `on_device`, each bucket is
//! reduce-scattered there as the backward completes it, stage 1 in the
//! last micro-batch only, and kept until the backward's end). Stage 3 runs the
//! model block by block: a block's parameters (and those it ties to) are
//! all-gathered just before its forward and again before its backward, then
//! freed; the next `prefetch` blocks' gathers are already in flight. Blocks
//! whose direct backward can let go of its parameters (the fused GPT-2 and
//! direct Llama layers) keep their activations in between
//! ([`crate::engine::Activations::KeepActivations`]); the others (and every block under
//! `train.activation_checkpointing = "full"`) recompute their forward in
//! the backward, FSDP with activation checkpointing. Gradients are
//! reduce-scattered per block ([`sharded`]); with them on the device
//! (`stage3_on_device`), the shard, the gathers and the reduce-scatters
//! are in device memory as well (there the gathers run as many blocks
//! ahead as the prefetch settings say, each waited for by its own event,
//! and the buffers do not come from the [`Pool`]: candle's allocator
//! reuses device memory).
//!
//! Gradient clipping uses the global norm: each rank's shard sum of squares
//! is all-reduced.
//!
//! Stage 3's parameter shard lives in a [`offload::ShardStore`]: memory, or
//! a file with `offload_param.device = "nvme"` (ZeRO-Infinity's parameter
//! offload). Offloaded, a block's piece is read from the file when its
//! gather is issued, and the optimizer step streams the shard through one
//! chunk at a time ([`crate::optim::step::agree_and_clip`] then
//! [`Optimizer::step_range`] per chunk), so the parameters held are the
//! pieces in flight plus one chunk, never the shard.
//!
//! Stages 2-3 take their per-step buffers (gathered blocks, gradient
//! staging, reduce-scatter outputs) from a [`Pool`] that lives as long as
//! the strategy, so steady steps reuse the previous step's memory.

mod gather;
pub mod offload;
mod on_device;
mod sharded;
mod stage3_on_device;

use super::ddp::all_reduce_micro_step;
use super::pool::Pool;
use super::reduce::{plan_buckets, Bucket, CommHook, DefaultHook, Reducer};
use super::shard::Shards;
use super::state::{fill_params, restore_optimizer, snapshot, StateFill, StateRange};
use super::{accumulate, BatchFn, MakeOptimizer, Strategy};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ledger::{Charge, Mem};
use crate::mesh::{Axis, DeviceMesh};
use crate::optim::step::{agree_and_clip, finish_step, weighted_sum_squares, StepOutcome, Update};
use crate::optim::Optimizer;
use crate::precision::LossScaler;
use candle_core::Tensor;
use gather::Gatherer;
use offload::{InMemory, OnDisk, ShardStore};
use phalanx_comm::ProcessGroup;
use std::ops::Range;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub struct ZeroConfig {
    /// 1, 2 or 3.
    pub stage: u8,
    /// Gradient bucket size (stages 1 and 2).
    pub bucket_bytes: usize,
    /// Blocks whose parameters are gathered ahead, in forward and backward (stage 3).
    pub forward_prefetch: usize,
    pub backward_prefetch: usize,
    /// HYBRID_SHARD: shard inside groups of this many consecutive ranks and
    /// replicate across groups (0: shard across all ranks).
    pub shard_group_size: usize,
    /// Stage 3: keep the parameter shard in a file under this directory
    /// (`offload_param.device = "nvme"`); `None` keeps it in memory.
    pub param_offload: Option<PathBuf>,
    /// Stage 3: `offload_param.device = "cpu"`: the parameter shard stays
    /// in host memory (on a GPU, off the device: each block goes up for
    /// its pass; on the CPU it is there anyway).
    pub param_offload_host: bool,
    /// Elements per chunk of the offloaded shard's streamed update.
    pub offload_chunk: usize,
    /// ZeRO++ qwZ: stage 3's parameter gathers carry block-wise int8.
    pub quantized_weights: bool,
    /// ZeRO++ hpZ: keep a secondary shard within groups of this many
    /// consecutive ranks and gather inside them in backward (0 or 1: off).
    pub hpz_partition_size: usize,
    /// Stage 3: keep a block's gathered parameters for its backward when
    /// they are used again within this many parameters gathered (0: free
    /// every block after its forward).
    pub max_reuse_distance: usize,
}

/// ZeRO++ hpZ's secondary partition: this rank's piece of the parameters
/// among the `pg.size()` ranks of its group, kept from the forward gather
/// (already dequantised under qwZ) so that the backward gathers inside the
/// group only, from values identical to the forward's.
struct Secondary {
    pg: ProcessGroup,
    shards: Shards,
    store: InMemory,
    _charge: Charge,
}

impl Secondary {
    /// Keep this rank's piece of every block in `g`.
    fn keep(&mut self, engine: &Engine, g: &gather::Gathered) {
        let mine = self.shards.mine();
        for (&b, vals) in &g.blocks {
            let r = engine.layout().block(b).range.clone();
            let local = self.shards.local(&r);
            if local.is_empty() {
                continue;
            }
            let from = mine.start + local.start - r.start;
            self.store.0[local.clone()].copy_from_slice(&vals[from..from + local.len()]);
        }
    }
}

pub struct Zero {
    cfg: ZeroConfig,
    /// All data-parallel ranks (losses are averaged over these).
    dp: ProcessGroup,
    /// The ranks the states are sharded over.
    shard_pg: ProcessGroup,
    /// HYBRID_SHARD: the same shard on the other groups.
    replica_pg: Option<ProcessGroup>,
    shards: Shards,
    /// Gradient buckets: DDP's (stages 1-2) or one per block (stage 3).
    units: Vec<Bucket>,
    unit_of_block: Vec<usize>,
    reducer: Reducer,
    /// Stage 3: this rank's parameter shard (empty for stages 1-2).
    store: Box<dyn ShardStore>,
    /// Stages 2-3: this rank's gradient shard.
    grad_shard: Vec<f32>,
    opt: Box<dyn Optimizer + Send>,
    _charges: Vec<Charge>,
    mesh: DeviceMesh,
    /// Flat ranges every tensor-parallel rank holds whole (for the norm).
    tp_replicated: Vec<Range<usize>>,
    /// ZeRO++ hpZ.
    secondary: Option<Secondary>,
    /// Stage 3: the first block whose forward-gathered parameters are kept
    /// for its backward (`max_reuse_distance`; the number of blocks: none).
    first_kept: usize,
    /// Stages 2-3: buffers reused from step to step.
    pool: Pool,
    /// Allowed to keep gradients on the device through the step
    /// ([`Strategy::keep_grads_on_device`]; every stage acts on it,
    /// `on_device` and `stage3_on_device`).
    device_grads: bool,
    /// This step's micro-batches held all their gradients on the device.
    held_all: bool,
    /// Stage 3 on the device: this rank's parameter shard there (the host
    /// shard holds the same values after every step), and its charge.
    device_store: Option<(Tensor, Charge)>,
    /// On the device: this rank's piece of each unit's gradients (stage
    /// 3's blocks, stages 1-2's buckets), summed over the step's
    /// micro-batches so far.
    device_pieces: std::collections::HashMap<usize, Tensor>,
    /// Their charge, as gradients.
    device_pieces_charge: Option<Charge>,
}

impl Zero {
    /// Shard `engine` over `dp` (every rank of `dp` calls this). `make_opt`
    /// builds the optimizer for a range of the flat buffer.
    pub fn new(
        engine: &mut Engine,
        mesh: &DeviceMesh,
        cfg: ZeroConfig,
        make_opt: &MakeOptimizer,
        tp_replicated: Vec<Range<usize>>,
    ) -> Result<Zero> {
        let dp = mesh.dp().clone();
        if !(1..=3).contains(&cfg.stage) {
            return Err(Error::Check(format!(
                "ZeRO stage {} is not 1, 2 or 3",
                cfg.stage
            )));
        }
        let n = dp.size();
        let g = if cfg.shard_group_size == 0 {
            n
        } else {
            cfg.shard_group_size
        };
        if !n.is_multiple_of(g) {
            return Err(Error::Check(format!(
                "HYBRID_SHARD: {n} data-parallel ranks do not split into shard groups of {g}"
            )));
        }
        if g != n && cfg.stage != 3 {
            return Err(Error::Check(
                "hybrid sharding is built for full sharding (stage 3) only".into(),
            ));
        }
        // Shard groups are consecutive ranks (a node); replica groups take the
        // same position in every shard group (the mesh's split of dp).
        let groups = n / g;
        let (shard_pg, replica_pg) = mesh.split(Axis::Dp, g)?;
        let replica_pg = (groups > 1).then_some(replica_pg);

        // Identical initial parameters everywhere, then shard.
        dp.broadcast(engine.params_flat_mut(), 0)?;
        let layout = engine.layout().clone();
        let shards = Shards::new(layout.num_params(), shard_pg.size(), shard_pg.rank());
        let mine = shards.mine();
        let ranges: Vec<Range<usize>> = layout.blocks().iter().map(|b| b.range.clone()).collect();
        // Stage 3 reduces block by block (cap 0: a bucket per block).
        let cap = if cfg.stage == 3 {
            0
        } else {
            cfg.bucket_bytes.max(4)
        };
        let units = plan_buckets(&ranges, cap);
        let mut unit_of_block = vec![0; ranges.len()];
        for (u, unit) in units.iter().enumerate() {
            for (b, r) in ranges.iter().enumerate() {
                if r.start >= unit.range.start && r.end <= unit.range.end {
                    unit_of_block[b] = u;
                }
            }
        }
        let ledger = engine.ledger().clone();
        let mut charges = Vec::new();
        let mut store: Box<dyn ShardStore> = Box::new(InMemory(Vec::new()));
        let mut grad_shard = Vec::new();
        if cfg.stage >= 2 {
            grad_shard = vec![0f32; mine.len()];
            charges.push(ledger.charge(Mem::Grads, mine.len() * 4));
            engine.release_grads();
        }
        if cfg.param_offload.is_some() && cfg.stage != 3 {
            return Err(Error::Check(format!(
                "parameter offload needs ZeRO stage 3, not {}",
                cfg.stage
            )));
        }
        if cfg.stage == 3 {
            let shard = &engine.params_flat()[mine.clone()];
            store = match &cfg.param_offload {
                Some(dir) => {
                    let tag = format!("rank{}", mesh.world().rank());
                    Box::new(
                        OnDisk::create(dir, &tag, shard).map_err(|e| Error::Io(e.to_string()))?,
                    )
                }
                None => {
                    charges.push(ledger.charge(Mem::Params, mine.len() * 4));
                    Box::new(InMemory(shard.to_vec()))
                }
            };
            engine.release_params();
            // The parameters are gathered per block and freed after it, so a
            // block cannot keep a graph that holds them: blocks with a
            // direct backward keep their activations and are served their
            // parameters again for the backward; the others are recomputed
            // (all of them under train.activation_checkpointing).
            use crate::engine::Activations;
            let a = match engine.stack().activations() {
                Activations::KeepGraph => Activations::KeepActivations,
                _ => Activations::Recompute,
            };
            engine.stack_mut().set_activations(a);
        }
        let hpz = cfg.hpz_partition_size;
        let mut secondary = None;
        if hpz > 1 {
            let n = shard_pg.size();
            if cfg.stage != 3 {
                return Err(Error::Check(format!(
                    "zero_hpz_partition_size = {hpz} needs ZeRO stage 3 (zero_optimization.stage \
                     = {})",
                    cfg.stage
                )));
            }
            if !n.is_multiple_of(hpz) {
                return Err(Error::Check(format!(
                    "zero_hpz_partition_size = {hpz} must divide the ranks that shard the \
                     parameters ({n} here): give a divisor of {n}"
                )));
            }
            // hpz divides g: blocks of hpz consecutive dp ranks lie inside
            // one shard group.
            let (pg, _) = mesh.split(Axis::Dp, hpz)?;
            let shards = Shards::new(layout.num_params(), hpz, pg.rank());
            let len = shards.mine().len();
            secondary = Some(Secondary {
                pg,
                shards,
                store: InMemory(vec![0f32; len]),
                _charge: ledger.charge(Mem::Params, len * 4),
            });
        }
        if cfg.quantized_weights && cfg.stage != 3 {
            return Err(Error::Check(format!(
                "zero_quantized_weights needs ZeRO stage 3, not {}",
                cfg.stage
            )));
        }
        let opt = make_opt(engine, mine)?;
        if !store.is_resident() && !opt.steps_in_ranges() {
            return Err(Error::Check(
                "ZeRO-3 parameter offload streams the update in chunks, which this optimizer cannot do".into(),
            ));
        }
        let mut reducer = Reducer::new(shard_pg.clone(), Box::new(DefaultHook::default()));
        reducer.describe(super::reduce::describe(&layout, &units));
        let pool = Pool::new(&ledger);
        reducer.set_pool(pool.clone());
        let first_kept = first_kept_block(engine, cfg.max_reuse_distance);
        Ok(Zero {
            cfg,
            dp,
            shard_pg,
            replica_pg,
            shards,
            units,
            unit_of_block,
            store,
            grad_shard,
            opt,
            _charges: charges,
            mesh: mesh.clone(),
            tp_replicated,
            reducer,
            secondary,
            first_kept,
            pool,
            device_grads: false,
            held_all: false,
            device_store: None,
            device_pieces: Default::default(),
            device_pieces_charge: None,
        })
    }

    pub fn stage(&self) -> u8 {
        self.cfg.stage
    }

    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    /// Zero the gradients before the first micro-step of a step.
    pub fn zero_grad(&mut self, engine: &mut Engine) {
        engine.zero_grad();
        self.grad_shard.fill(0.0);
        self.device_pieces.clear();
        self.device_pieces_charge = None;
    }

    /// Forward and backward of one micro-batch; `last` marks the final
    /// micro-step of the step (stage 1 communicates only then).
    pub fn micro_step(
        &mut self,
        engine: &mut Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f32,
        last: bool,
    ) -> Result<f32> {
        // ZeRO-1 reduces on the last micro-step only: the ones before keep
        // their gradients on the device (CUDA); where it reduces them there
        // too (`on_device`), all of them do. ZeRO-2 reduces them there
        // bucket by bucket during every micro-batch's backward.
        let all = self.grads_stay_on_device(engine);
        self.held_all = all;
        engine.hold_grads((self.cfg.stage == 1 && !last) || all);
        match self.cfg.stage {
            // ZeRO-1's earlier micro-batches only hold theirs.
            1 | 2 if all && (last || self.cfg.stage == 2) => {
                self.scatter_on_device(engine, x, y, scale)
            }
            3 if all => self.gathered_on_device(engine, x, y, scale),
            1 if !last || all || self.dp.size() == 1 => Ok(engine.forward_backward(x, y, scale)?),
            1 => {
                let (units, pool) = (&self.units, &self.pool);
                all_reduce_micro_step(engine, x, y, scale, units, &mut self.reducer, pool)
            }
            2 => self.backward_sharded(engine, x, y, scale, false),
            _ => self.backward_sharded(engine, x, y, scale, true),
        }
    }

    /// The finish path over this rank's shard, then make the parameters
    /// whole again where the stage keeps them whole.
    fn finish(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        let mine = self.shards.mine();
        // Each shard counts on its owner; HYBRID_SHARD replicas of a shard
        // count 1/replicas each; tp-replicated ranges once over tp.
        let w = 1.0 / self.replica_pg.as_ref().map_or(1, |r| r.size()) as f64;
        let tp = self.mesh.tp_size;
        let rep = &self.tp_replicated;
        let world = self.mesh.world().clone();
        let stage = self.cfg.stage;
        let mut gathered = false;
        let held = std::mem::take(&mut self.held_all);
        if !held {
            // The host path steps the host shard: stage 3's device copy
            // of it would be stale.
            self.device_store = None;
        }
        let out = if held {
            let (out, done) = self.finish_on_device(engine, scaler, lr, max_norm, step)?;
            gathered = done;
            out
        } else if stage == 3 && !self.store.is_resident() {
            let ss = weighted_sum_squares(&self.grad_shard, mine.start, w, rep, tp);
            let (out, factor) = agree_and_clip(&world, ss, scaler, max_norm, step)?;
            if let Some(factor) = factor {
                self.stream_update(engine, lr, factor)?;
            }
            out
        } else if stage == 1 {
            let (p, g) = engine.params_and_grads_mut();
            let ss = weighted_sum_squares(&g[mine.clone()], mine.start, w, rep, tp);
            let u = Update {
                params: &mut p[mine.clone()],
                grads: &g[mine.clone()],
                opt: self.opt.as_mut(),
                on_device: None,
            };
            finish_step(&world, ss, vec![u], scaler, lr, max_norm, step)?
        } else {
            let ss = weighted_sum_squares(&self.grad_shard, mine.start, w, rep, tp);
            let params = if stage == 2 {
                &mut engine.params_flat_mut()[mine.clone()]
            } else {
                self.store.resident_mut().expect("a resident shard")
            };
            let u = Update {
                params,
                grads: &self.grad_shard,
                opt: self.opt.as_mut(),
                on_device: None,
            };
            finish_step(&world, ss, vec![u], scaler, lr, max_norm, step)?
        };
        if stage < 3 && !out.skipped && !gathered {
            self.gather_params(engine)?;
        }
        Ok(out)
    }

    /// The offloaded shard's update: read a chunk, step it with its
    /// gradients and optimizer state range, write it back. One chunk of
    /// parameters is held (and charged) at a time.
    fn stream_update(&mut self, engine: &Engine, lr: f32, factor: f32) -> Result<()> {
        let n = self.store.len();
        let chunk = self.cfg.offload_chunk.clamp(1, n.max(1));
        let held = engine.ledger().charge(Mem::Params, chunk * 4);
        // Overwritten by each read; back to the pool after the update.
        let mut buf = self.pool.take::<f32>(chunk);
        let io = |e: std::io::Error| Error::Io(e.to_string());
        self.opt.begin_step();
        for lo in (0..n).step_by(chunk) {
            let hi = (lo + chunk).min(n);
            let p = &mut buf[..hi - lo];
            self.store.read(lo..hi, p).map_err(io)?;
            self.opt
                .step_range(lo..hi, p, &self.grad_shard[lo..hi], lr, factor);
            self.store.write(lo..hi, p).map_err(io)?;
        }
        drop(held);
        self.pool.put(buf);
        Ok(())
    }

    /// All-gather the updated shards into the engine's full parameters.
    fn gather_params(&mut self, engine: &mut Engine) -> Result<()> {
        let all = 0..engine.num_params();
        let mine = self.shards.mine();
        let piece = engine.params_flat()[mine].to_vec();
        self.shard_pg
            .all_gather_v(&piece, &self.shards.counts(&all), engine.params_flat_mut())?;
        Ok(())
    }

    /// The full flat parameters (stage 3 gathers them; others copy).
    pub fn full_params(&self, engine: &Engine) -> Result<Vec<f32>> {
        if self.cfg.stage != 3 {
            return Ok(engine.params_flat().to_vec());
        }
        let all = 0..engine.num_params();
        let mut out = vec![0f32; all.len()];
        if let Some(shard) = self.store.resident() {
            self.shard_pg
                .all_gather_v(shard, &self.shards.counts(&all), &mut out)?;
            return Ok(out);
        }
        // Offloaded: window by window, each rank reading at most a chunk.
        let step = self.cfg.offload_chunk.max(1);
        let mut piece = Vec::new();
        for lo in (0..all.end).step_by(step) {
            let r = lo..(lo + step).min(all.end);
            let local = self.shards.local(&r);
            piece.resize(local.len(), 0.0);
            self.store
                .read(local, &mut piece)
                .map_err(|e| Error::Io(e.to_string()))?;
            self.shard_pg
                .all_gather_v(&piece, &self.shards.counts(&r), &mut out[r])?;
        }
        Ok(out)
    }

    /// Validation loss without autograd (stage 3 gathers block by block).
    pub fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        if self.cfg.stage != 3 {
            return Ok(engine.eval_loss(x, y)?);
        }
        if let Some(loss) = self.eval_on_device(engine, x, y)? {
            return Ok(loss);
        }
        let nb = engine.num_blocks();
        let src = (&*self.store, &self.shards, &self.shard_pg);
        let ahead = self.cfg.forward_prefetch;
        let mut g = Gatherer::over(src, engine, ahead, (0..nb).collect(), self.pool.clone());
        let mut h = x.clone();
        for b in 0..nb {
            let src = g.take(b)?;
            h = engine
                .stack()
                .forward_eval(b..b + 1, &h, (b + 1 == nb).then_some(y), &src)?;
        }
        Ok(h.to_scalar::<f32>()?)
    }

    /// The data-parallel group (all replicas).
    pub fn group(&self) -> &ProcessGroup {
        &self.dp
    }
}

impl Strategy for Zero {
    fn name(&self) -> String {
        match (self.cfg.stage, self.replica_pg.is_some()) {
            (3, true) => "ZeRO-3 (HYBRID_SHARD)".into(),
            (s, _) => format!("ZeRO-{s}"),
        }
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        accum: usize,
        loss_scale: f32,
    ) -> Result<f32> {
        self.zero_grad(engine);
        let dp = self.dp.clone();
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
        let out = self.finish(engine, scaler, lr, max_norm, step);
        // A skipped step leaves the hook's state as it was.
        self.reducer.settled(out)
    }

    fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        Zero::eval_loss(self, engine, x, y)
    }

    fn collective_eval(&self) -> bool {
        self.cfg.stage == 3
    }

    fn full_params(&self, engine: &Engine) -> Result<Vec<f32>> {
        Zero::full_params(self, engine)
    }

    fn optimizers(&self) -> Vec<&(dyn Optimizer + Send)> {
        vec![self.opt.as_ref()]
    }

    fn save_state(&self, engine: &Engine) -> Result<Vec<StateRange>> {
        // HYBRID_SHARD: the replicas of a shard leave it to the first.
        if self.replica_pg.as_ref().is_some_and(|r| r.rank() != 0) {
            return Ok(Vec::new());
        }
        let mine = self.shards.mine();
        let params = if self.cfg.stage == 3 {
            let mut v = vec![0f32; mine.len()];
            self.store
                .read(0..mine.len(), &mut v)
                .map_err(|e| Error::Io(format!("ZeRO-3 parameter shard: {e}")))?;
            v
        } else {
            engine.params_flat()[mine].to_vec()
        };
        Ok(vec![snapshot(self.opt.as_ref(), &params)?])
    }

    fn load_state(
        &mut self,
        engine: &mut Engine,
        fill: &mut StateFill,
        optim_step: u64,
    ) -> Result<()> {
        let mine = self.shards.mine();
        let p = fill_params(fill, mine.clone())?;
        // The device's copy of the shard is uploaded again from the host's.
        self.device_store = None;
        if self.cfg.stage == 3 {
            self.store
                .write(0..mine.len(), &p)
                .map_err(|e| Error::Io(format!("ZeRO-3 parameter shard: {e}")))?;
        } else {
            engine.params_flat_mut()[mine].copy_from_slice(&p);
            self.gather_params(engine)?;
        }
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

    /// Stages 2-3 reduce-scatter into this rank's gradient shard.
    fn step_grads<'a>(&'a mut self, engine: &'a mut Engine) -> &'a mut [f32] {
        if self.cfg.stage >= 2 {
            &mut self.grad_shard
        } else {
            engine.grads_flat_mut()
        }
    }
}

/// The first block whose parameters, gathered for the forward, are kept
/// for the backward under `max_reuse_distance`: block b's are used again
/// after the forward and backward of every later block, 2 x their
/// parameters later (`nb`, none, when the distance is 0).
fn first_kept_block(engine: &Engine, max_reuse_distance: usize) -> usize {
    let nb = engine.num_blocks();
    if max_reuse_distance == 0 {
        return nb;
    }
    let mut per_block = vec![0usize; nb];
    for p in engine.layout().params() {
        per_block[p.block] += p.numel;
    }
    let mut later = 0usize;
    for b in (0..nb).rev() {
        if later.saturating_mul(2) > max_reuse_distance {
            return b + 1;
        }
        later += per_block[b];
    }
    0
}
