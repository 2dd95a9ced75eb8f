//! Pipeline parallelism: the model's blocks split into stages along the
//! mesh's `pp` axis, micro-batches streamed through them by a schedule.
//!
//! - [`partition`]: blocks -> chunks (balanced by parameters, by hand, or by
//!   measured cost);
//! - [`schedule`]: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as tables of
//!   [`Action`]s per rank, printable; [`check`] validates and simulates them;
//! - [`runtime`]: the one executor of any table; [`p2p`]: tagged
//!   activation / gradient transfers, receives posted ahead;
//! - [`trace`]: per-rank timeline, measured bubble, Chrome trace.
//!
//! Every rank holds the whole [`Engine`] (full flat buffers) but runs and
//! updates only its chunks' blocks: [`Pipeline::owned_ranges`] are the flat
//! ranges of the parameters its blocks read, tied ones included. After the
//! schedule, gradients of parameters read on several stages (GPT-2's `wte`:
//! embedding on the first stage, head on the last) are summed over a
//! sub-group of exactly those stages, so every reader holds the full
//! gradient and applies the same update; then owned ranges are averaged over
//! the mesh's `dp` group; each chunk's all-reduce starts on the dp group's
//! thread as soon as its last backward has run (`overlap_dp`), overlapping
//! the rest of the schedule. Each step is `forward_backward` (or its parts,
//! for a strategy that reduces gradients its own way, e.g. ZeRO-1:
//! [`Pipeline::run_schedule_with`] and its [`GradsFinal`] callback,
//! [`Pipeline::reduce_tied_grads`], [`Pipeline::reduce_dp_grads`]), then the
//! caller's optimizer over `owned_ranges()`. On a GPU the gradients may
//! stay there instead: [`Pipeline::forward_backward_on_device`] holds them
//! through the schedule and sums the tied ones in device memory, and
//! averages over dp there (ZeRO-1: the strategy's reduce-scatter in its
//! finish; `on_device`).
//!
//! Micro-batches: `m = train.grad_accum_steps`; micro-batch `a` of a step is
//! the loader's `micro_batch(step, dp_rank, dp, a, micro, m)`, so a run
//! equals 1-rank training at the same global batch `micro x dp x m`.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use phalanx::engine::{Block, CtxBlock, Engine, EngineConfig, FnBlock};
//! use phalanx::strategy::pipeline::{Pipeline, PipelineConfig, ScheduleKind};
//! # struct Mse;
//! # impl phalanx::engine::BlockModule for Mse {
//! #     fn forward(&self, x: &Tensor, ctx: &phalanx::engine::Ctx) -> candle_core::Result<Tensor> {
//! #         (x - ctx.targets.unwrap())?.sqr()?.mean_all()
//! #     }
//! # }
//! let losses = phalanx_comm::threads::run(2, |pg| {
//!     let mesh = phalanx::mesh::DeviceMesh::new(&pg, 1, 2, 1).unwrap(); // dp, pp, tp
//!     let blocks: Vec<Box<dyn Block>> = vec![
//!         Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(4, 4, vb.pp("fc0")))),
//!         Box::new(FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(4, 4, vb.pp("fc1")))),
//!         Box::new(CtxBlock::new(|_vb: candle_nn::VarBuilder| Ok(Mse))),
//!     ];
//!     let mut engine = Engine::new(blocks, &Device::Cpu, EngineConfig::default()).unwrap();
//!     let cfg = PipelineConfig { schedule: ScheduleKind::OneFOneB, micro_batches: 4, ..Default::default() };
//!     let mut pipe = Pipeline::new(&engine, &mesh, cfg).unwrap();
//!     assert_eq!(pipe.chunks(), &[0..1, 1..3]); // fc0 | fc1 + loss
//!     let mut batch = |_a: usize| -> phalanx::Result<(Tensor, Tensor)> {
//!         let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
//!         Ok((x.clone(), x.zeros_like()?))
//!     };
//!     let loss = pipe.forward_backward(&mut engine, &mut batch).unwrap();
//!     // ... then an optimizer step over each of pipe.owned_ranges() ...
//!     loss
//! });
//! assert_eq!(losses[0], losses[1]); // the last stage's loss reaches every stage
//! ```

pub mod check;
mod eval;
mod links;
mod on_device;
pub mod p2p;
pub mod partition;
pub mod runtime;
mod scatter;
pub mod schedule;
pub mod strategy;
mod ties;
pub mod trace;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use phalanx_comm::ReduceOp;

pub use check::{Costs, Simulation};
pub use partition::Partition;
pub use runtime::{BatchFn, GradsFinal};
pub use schedule::{Action, Schedule, ScheduleKind};
pub use strategy::{pipeline_config, PipeStrategy};
pub use trace::{StepRecord, Timeline};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::clip;
use crate::strategy::reduce::{Collective, CommHook, DefaultHook, Reducer};
use trace::{Event, EventKind};

/// How to pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineConfig {
    pub schedule: ScheduleKind,
    /// Micro-batches per step (`train.grad_accum_steps`).
    pub micro_batches: usize,
    pub partition: Partition,
    /// Receives posted ahead of their use.
    pub recv_lookahead: usize,
    /// Steps whose events the timeline keeps for the trace.
    pub trace_steps: usize,
    /// Start each chunk's data-parallel all-reduce as soon as its gradients
    /// are final, overlapping the rest of the schedule.
    pub overlap_dp: bool,
    /// With the gradients on the device: the chunk's all-reduce cut into
    /// buckets of at least this many bytes, each started as soon as the
    /// chunk's last backward has made it final (the trainer's gradient
    /// bucket size, `TrainConfig::bucket_bytes`, as DDP's and ZeRO's).
    pub bucket_bytes: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: ScheduleKind::OneFOneB,
            micro_batches: 1,
            partition: Partition::Balanced,
            recv_lookahead: 2,
            trace_steps: 4,
            overlap_dp: true,
            bucket_bytes: 25 << 20,
        }
    }
}

/// One rank's share of a pipeline (see the module docs).
pub struct Pipeline {
    cfg: PipelineConfig,
    mesh: DeviceMesh,
    schedule: Schedule,
    chunks: Vec<Range<usize>>,
    stage: usize,
    ties: ties::Ties,
    /// Ranges reduced over dp when each chunk finishes (see `overlap_dp`).
    dp_buckets: BTreeMap<usize, Vec<Range<usize>>>,
    /// The same cut by when each chunk's last backward makes them final
    /// (the device path's buckets, `bucket_bytes`).
    dp_block_buckets: BTreeMap<usize, Vec<ties::BlockBucket>>,
    timeline: Timeline,
    step: u64,
    /// Data-parallel gradient reduction (the shared seam), over `mesh.dp()`.
    reducer: Reducer,
    loss_scale: f32,
    /// Activations and gradients between stages on device links (off the
    /// CPU kernels, where the pipeline group moves the device's memory:
    /// NCCL on a GPU, the host on the CPU's generic path); `None`: tagged
    /// host messages.
    links: Option<links::Links>,
}

impl Pipeline {
    /// Partition the engine's blocks over the mesh's `pp` axis and build the
    /// schedule. Collective over the world (the partition of world rank 0 is
    /// used everywhere) and over the pipeline group (tie groups).
    pub fn new(engine: &Engine, mesh: &DeviceMesh, cfg: PipelineConfig) -> Result<Pipeline> {
        let p = mesh.pp_size;
        let m = cfg.micro_batches;
        if m >= p2p::MAX_MB {
            return Err(Error::Check(format!(
                "pipeline: {m} micro-batches is too many"
            )));
        }
        let schedule = Schedule::new(cfg.schedule, p, m)?;
        let n_chunks = schedule.num_chunks();
        if n_chunks > p2p::MAX_CHUNKS {
            return Err(Error::Check(format!(
                "pipeline: {n_chunks} chunks is too many"
            )));
        }
        let mut chunks = cfg.partition.split(engine.layout(), n_chunks)?;
        // Measured costs differ between ranks: everyone takes rank 0's split.
        let mut ends: Vec<i64> = chunks.iter().map(|r| r.end as i64).collect();
        mesh.world().broadcast(&mut ends, 0)?;
        let mut lo = 0;
        for (c, &e) in chunks.iter_mut().zip(&ends) {
            *c = lo..e as usize;
            lo = e as usize;
        }
        let stage = mesh.coords().pp;
        let ties = ties::Ties::new(engine.layout(), &chunks, p, stage, mesh)?;
        let dp_buckets = ties::dp_buckets(engine.layout(), &chunks, &schedule, stage);
        let dp_block_buckets =
            ties::dp_block_buckets(engine.layout(), &chunks, &schedule, stage, cfg.bucket_bytes);
        let dev = engine.device();
        // Every stage must make the links or none (their groups are
        // collective over the pipeline group): the stages agree first.
        let mut wants = [i32::from(
            p > 1
                && !crate::ops::host_kernels(dev)
                && crate::collective::reduces_on(mesh.pp(), dev),
        )];
        mesh.pp().all_reduce(&mut wants, ReduceOp::Min)?;
        let links = match wants[0] == 1 {
            true => Some(links::Links::new(mesh.pp(), &schedule, stage, dev)?),
            false => None,
        };
        let mut timeline = Timeline::new(cfg.trace_steps);
        mesh.world().barrier()?;
        timeline.reset_epoch();
        Ok(Pipeline {
            cfg,
            mesh: mesh.clone(),
            schedule,
            chunks,
            stage,
            ties,
            dp_buckets,
            dp_block_buckets,
            timeline,
            step: 0,
            reducer: Reducer::new(mesh.dp().clone(), Box::new(DefaultHook::default())),
            loss_scale: 1.0,
            links,
        })
    }

    pub fn config(&self) -> &PipelineConfig {
        &self.cfg
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Block range of every chunk, in model order (chunk `c` on stage `c % p`).
    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// This rank's stage (its `pp` coordinate).
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// The blocks this rank runs.
    pub fn my_blocks(&self) -> Vec<Range<usize>> {
        let p = self.schedule.p;
        let mine = self.chunks.iter().enumerate();
        mine.filter(|(c, _)| c % p == self.stage)
            .map(|(_, r)| r.clone())
            .collect()
    }

    /// The flat ranges this rank's optimizer updates: every parameter its
    /// blocks read, tied ones included (sorted, merged).
    pub fn owned_ranges(&self) -> &[Range<usize>] {
        &self.ties.owned
    }

    /// The flat ranges this rank answers for in norms and gathers: the
    /// parameters it reads that no lower stage reads (disjoint over stages).
    pub fn primary_ranges(&self) -> &[Range<usize>] {
        &self.ties.primary
    }

    /// The loss scale of the next steps' backward (fp16 loss scaling).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Replace the data-parallel communication hook.
    pub fn set_comm_hook(&mut self, hook: Box<dyn CommHook>) {
        self.reducer.set_hook(hook);
    }

    /// See [`crate::strategy::reduce::Reducer::set_rollback`].
    pub fn set_hook_rollback(&mut self, on: bool) {
        self.reducer.set_rollback(on);
    }

    /// The data-parallel hook's state ([`CommHook::state`]).
    pub fn hook_state(&self) -> Vec<(String, Vec<f32>)> {
        self.reducer.hook_state()
    }

    /// Restore the data-parallel hook's state.
    pub fn load_hook_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.reducer.load_hook_state(state)
    }

    /// End the step for the dp hook after a step whose outcome is `out`
    /// ([`crate::strategy::reduce::Reducer::settled`]).
    pub fn settle_hook(
        &mut self,
        out: Result<crate::optim::step::StepOutcome>,
    ) -> Result<crate::optim::step::StepOutcome> {
        self.reducer.settled(out)
    }

    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// One step: zero the gradients, run the schedule over the
    /// `micro_batches` micro-batches `batch(a)`, reduce tied gradients over
    /// the pipeline and owned gradients over `dp`. Returns the step's mean
    /// loss (over micro-batches and dp replicas), on every rank.
    pub fn forward_backward(&mut self, engine: &mut Engine, batch: &mut BatchFn) -> Result<f32> {
        engine.zero_grad();
        let dp = self.mesh.dp().clone();
        if !self.cfg.overlap_dp || dp.size() == 1 {
            let loss = self.run_schedule(engine, batch)?;
            self.reduce_tied_grads(engine)?;
            self.reduce_dp_grads(engine)?;
            return self.dp_mean(loss);
        }
        // Each chunk's all-reduce runs on the dp group's thread while the
        // schedule goes on; only what is left at the end is waited for.
        let buckets = std::mem::take(&mut self.dp_buckets);
        let mut reducer = std::mem::replace(
            &mut self.reducer,
            Reducer::new(dp.clone(), Box::new(DefaultHook::default())),
        );
        let mut done = |c: usize, engine: &mut Engine| {
            if let Some(rs) = buckets.get(&c) {
                let g = engine.grads_flat_mut();
                reducer.launch(c, gather_ranges(g, rs), &Collective::AllReduce);
            }
            Ok(())
        };
        let loss = self.run_schedule_with(engine, batch, &mut done);
        let t0 = self.timeline.now_us();
        // Wait for every launched reduction, even after a failure.
        let reduced = reducer.wait_all();
        self.reducer = reducer;
        let mut waited = Ok(());
        match reduced {
            Ok(list) if loss.is_ok() => {
                let g = engine.grads_flat_mut();
                for (c, buf) in list {
                    scatter_ranges(&buf, g, &buckets[&c]);
                }
            }
            Ok(_) => {}
            Err(e) => waited = Err(e),
        }
        self.dp_buckets = buckets;
        let loss = loss?;
        waited?;
        self.event(EventKind::DpReduce, t0);
        self.reduce_tied_grads(engine)?;
        self.dp_mean(loss)
    }

    /// The loss averaged over the dp replicas.
    fn dp_mean(&self, loss: f32) -> Result<f32> {
        let mut l = [loss as f64];
        self.mesh.dp().all_reduce(&mut l, ReduceOp::Avg)?;
        Ok(l[0] as f32)
    }

    /// The schedule alone: gradients of this rank's blocks (for the mean loss
    /// over micro-batches) are added to the engine's buffer, unreduced.
    /// Returns this pipeline's mean loss, on every stage.
    pub fn run_schedule(&mut self, engine: &mut Engine, batch: &mut BatchFn) -> Result<f32> {
        self.run_schedule_with(engine, batch, &mut |_: usize, _: &mut Engine| Ok(()))
    }

    /// As [`Pipeline::run_schedule`], calling `done.chunk(chunk, engine)` as soon
    /// as each of this rank's chunks has run its last backward of the step
    /// (its parameters' gradients are final here: in the flat buffer, or
    /// held on the device, `Engine::take_device_grads`): the place to start
    /// a data-parallel reduction (all-reduce, or ZeRO's reduce-scatter)
    /// that overlaps the rest of the schedule. Where `done.by_block()`
    /// (the gradients held on the device), that last backward also calls
    /// `done.block(chunk, block, stack)` after each block, top first, so
    /// that buckets start while the lower blocks compute.
    pub fn run_schedule_with(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        done: &mut dyn GradsFinal,
    ) -> Result<f32> {
        let pp = self.mesh.pp().clone();
        self.timeline.begin_step(self.step);
        // Same window on every stage: start together...
        pp.barrier()?;
        let t0 = self.timeline.now_us();
        let step = runtime::Step {
            engine,
            pg: &pp,
            schedule: &self.schedule,
            rank: self.stage,
            chunks: &self.chunks,
            timeline: &mut self.timeline,
            step: self.step,
            lookahead: self.cfg.recv_lookahead,
            loss_scale: self.loss_scale,
            links: self.links.as_mut(),
        };
        let out = runtime::run(step, batch, done)?;
        // ... and end together: the loss (last stage) reaches every stage.
        let mut l = [out.loss_sum / self.schedule.m as f64];
        pp.all_reduce(&mut l, ReduceOp::Sum)?;
        let window = self.timeline.now_us() - t0;
        self.timeline
            .end_step(window, out.peak_in_flight, out.peak_activation_bytes);
        self.step += 1;
        Ok(l[0] as f32)
    }

    /// Sum the gradients of parameters read on several stages over those
    /// stages. Collective over the pipeline group.
    pub fn reduce_tied_grads(&mut self, engine: &mut Engine) -> Result<()> {
        let t0 = self.timeline.now_us();
        self.ties.reduce(engine.grads_flat_mut())?;
        self.event(EventKind::TieReduce, t0);
        Ok(())
    }

    /// Average the owned gradient ranges over the `dp` group.
    pub fn reduce_dp_grads(&mut self, engine: &mut Engine) -> Result<()> {
        let dp = self.mesh.dp();
        if dp.size() == 1 {
            return Ok(());
        }
        let t0 = self.timeline.now_us();
        let g = engine.grads_flat_mut();
        let buf = gather_ranges(g, &self.ties.owned);
        self.reducer.launch(usize::MAX, buf, &Collective::AllReduce);
        for (_, buf) in self.reducer.wait_all()? {
            scatter_ranges(&buf, g, &self.ties.owned);
        }
        self.event(EventKind::DpReduce, t0);
        Ok(())
    }

    fn event(&mut self, kind: EventKind, t0: f64) {
        let step = self.step.saturating_sub(1);
        let dur_us = self.timeline.now_us() - t0;
        self.timeline.record(Event {
            kind,
            step,
            mb: 0,
            chunk: 0,
            start_us: t0,
            dur_us,
        });
    }

    /// Sum of squared gradients of the whole model (each parameter counted
    /// once), for clipping by global norm. Collective over the pipeline.
    pub fn grad_sum_squares(&self, engine: &Engine) -> Result<f64> {
        let g = engine.grads_flat();
        let mut s = [self
            .ties
            .primary
            .iter()
            .map(|r| clip::sum_squares(&g[r.clone()]))
            .sum::<f64>()];
        self.mesh.pp().all_reduce(&mut s, ReduceOp::Sum)?;
        Ok(s[0])
    }

    /// Zero the gradient slots this rank does not own (they are never
    /// written by its blocks; this is for buffers reused from elsewhere).
    pub fn zero_unowned_grads(&self, engine: &mut Engine) {
        let g = engine.grads_flat_mut();
        let mut lo = 0;
        for r in &self.ties.owned {
            g[lo..r.start].fill(0.0);
            lo = r.end;
        }
        let n = g.len();
        g[lo..n].fill(0.0);
    }

    /// The whole model's parameters, assembled from every stage's primary
    /// ranges (to save or compare). Collective over the pipeline.
    pub fn full_params(&self, engine: &Engine) -> Result<Vec<f32>> {
        let src = engine.params_flat();
        let mut all = vec![0f32; src.len()];
        for r in &self.ties.primary {
            all[r.clone()].copy_from_slice(&src[r.clone()]);
        }
        self.mesh.pp().all_reduce(&mut all, ReduceOp::Sum)?;
        Ok(all)
    }

    /// Write every rank's recent events as a Chrome / Perfetto trace on world
    /// rank 0. Collective over the world.
    pub fn write_trace(&self, path: &Path) -> Result<()> {
        let v = self.schedule.v;
        trace::write_chrome_trace(
            self.mesh.world(),
            self.mesh.coords(),
            v,
            &self.timeline,
            path,
        )
    }
}

/// The elements of `rs` (ranges of `g`), concatenated.
fn gather_ranges(g: &[f32], rs: &[Range<usize>]) -> Vec<f32> {
    let mut buf = Vec::with_capacity(rs.iter().map(|r| r.len()).sum());
    for r in rs {
        buf.extend_from_slice(&g[r.clone()]);
    }
    buf
}

/// The inverse of [`gather_ranges`].
fn scatter_ranges(buf: &[f32], g: &mut [f32], rs: &[Range<usize>]) {
    let mut at = 0;
    for r in rs {
        g[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
        at += r.len();
    }
}
