//! The training loop: data-parallel steps over an `Engine`, with gradient
//! accumulation, clipping, a learning-rate schedule, validation, and logs.
//!
//! It is model-agnostic: anything built as an `Engine` of blocks trains
//! here (GPT-2 from `phalanx-models`, or a user's own candle model).
//!
//! ```no_run
//! # fn blocks() -> Vec<Box<dyn phalanx::engine::Block>> { unimplemented!() }
//! use phalanx::{config::TrainConfig, data::{DataLoader, LoaderConfig, Tokenizer}, trainer::Trainer};
//! let cfg = TrainConfig::build(None, &[]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let engine = phalanx::engine::Engine::new(blocks(), &candle_core::Device::Cpu, Default::default()).unwrap();
//! let loader = DataLoader::open("data/corpus.txt", Tokenizer::Byte, LoaderConfig::default()).unwrap();
//! let mut t = Trainer::new(&cfg, engine, std::sync::Arc::new(loader), pg).unwrap();
//! let report = t.run(&Default::default()).unwrap();
//! ```

mod ckpt;
mod ft;
mod log;
mod memory;
mod resume;
mod run;

pub use log::{write_loss_svg, Resume, RunOptions, StepLog};
pub use memory::{print_memory, MemoryReport};

use crate::config::TrainConfig;
use crate::data::{micro_batch_size, DataLoader};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::{LrSchedule, Optimizer};
use crate::precision::{LossScaler, ScalerConfig};
use crate::strategy::{BuildArgs, Strategy};
use phalanx_comm::ProcessGroup;
use std::sync::Arc;
use std::time::Instant;

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    pub step: usize,
    /// Mean cross-entropy over all G*T targets of the step, before the update.
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// Bytes this rank sent to peers during the step (all collectives).
    pub comm_bytes: u64,
    /// Bytes this rank sent since the run started, including what went
    /// between steps (an all-reduce still in flight when a step ended,
    /// the monitor's and evaluation's collectives); set by `run`.
    pub comm_bytes_total: Option<u64>,
    /// The loss scale the step ran with (1 unless fp16).
    pub loss_scale: f64,
    /// Whether the run computes in fp16 (its loss scale is shown, even at
    /// 1: then a skip says what kept it there).
    pub fp16: bool,
    /// The loss scale after the step's update: after an overflow, halved,
    /// or kept while fp16.hysteresis holds it.
    pub scale_after: f64,
    /// What keeps the scale after an overflow where it is not lowered
    /// ([`crate::precision::LossScaler::kept_by`]).
    pub scale_kept_by: &'static str,
    /// A non-finite gradient on some rank skipped the update (fp16, or
    /// `train.on_nonfinite = skip`).
    pub skipped: bool,
    /// The step minus the time this rank was blocked in communication.
    pub compute_ms: f64,
    /// Model FLOPs utilisation: model FLOPs per token × tokens/s over the
    /// matmul peak of every rank (set by `run` where the model's FLOPs are
    /// known).
    pub mfu: Option<f64>,
    /// Under fault tolerance: how many replica groups' samples the step
    /// committed (this step's quorum; torchft's `batches_committed`).
    pub groups_committed: Option<usize>,
    /// The text loader's counters on this rank after the step (skipped
    /// records, tokens tokenized, reader time, queue depth), when a text
    /// source is read.
    pub data: Option<crate::data::LoaderStats>,
    /// Off the CPU kernels (a GPU, or the CPU's device-generic path): the
    /// gradient read-backs from the device during the step, in this
    /// process (`engine::resident::downloads`; 0 where they stay there).
    pub grad_reads: Option<u64>,
}

/// What a run produced.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub losses: Vec<f32>,
    /// The global gradient norm of every step (before clipping), as
    /// [`StepStats::grad_norm`]: equivalence tests compare it, since
    /// AdamW with clipping hides a gradient off by a constant factor.
    pub grad_norms: Vec<f32>,
    /// The bytes this rank sent during every step ([`StepStats::comm_bytes`]).
    pub comm_bytes: Vec<u64>,
    /// (step, validation loss)
    pub val_losses: Vec<(usize, f32)>,
    pub tokens_per_s: f64,
    /// Pipeline runs: the measured bubble (idle / step time) of every world
    /// rank, and the peak micro-batches in flight of every world rank.
    pub bubble: Option<Vec<f64>>,
    pub in_flight: Option<Vec<usize>>,
    /// Stragglers reported during the run (`phalanx::monitor`), with the
    /// step each was reported at.
    pub stragglers: Vec<(usize, crate::monitor::Straggler)>,
    /// The step count at which a graceful stop ([`RunOptions::stop`]) ended
    /// the run early.
    pub stopped_at: Option<usize>,
    /// Steps whose update was skipped (inf/NaN gradients: fp16 overflows,
    /// or `train.on_nonfinite = "skip"`).
    pub skipped: usize,
}

pub struct Trainer {
    cfg: TrainConfig,
    engine: Engine,
    loader: Arc<DataLoader>,
    strat: Box<dyn Strategy>,
    scaler: LossScaler,
    /// The data-parallel group (replicas of this rank's model shard).
    pg: ProcessGroup,
    mesh: DeviceMesh,
    /// Tensor parallel: flat ranges of parameters every tp rank holds whole.
    tp_replicated: Vec<std::ops::Range<usize>>,
    sched: LrSchedule,
    /// Model FLOPs per token (for MFU), where the model says.
    flops_per_token: Option<f64>,
    /// Where local parameters sit in the global tensors (checkpoints).
    placement: std::sync::Arc<dyn crate::checkpoint::Placement>,
    /// `checkpoint.async`: the background writer (its own process group).
    ckpt_async: Option<crate::checkpoint::AsyncWriter>,
    /// The first step `run` trains (after a resume).
    start_step: usize,
    micro: usize,
    global_batch: usize,
    memory: Option<Vec<MemoryReport>>,
    /// `[fault_tolerance]`: this job as one replica group (set by `run`).
    ft: Option<ft::Ft>,
}

impl Trainer {
    /// Set up data-parallel training over `pg` (every rank of `pg` is a
    /// data-parallel replica), sharded as the config says (DDP, ZeRO-1/2/3,
    /// FSDP). Rank 0's initial parameters are broadcast.
    pub fn new(
        cfg: &TrainConfig,
        engine: Engine,
        loader: Arc<DataLoader>,
        pg: ProcessGroup,
    ) -> Result<Trainer> {
        let mesh = DeviceMesh::new(&pg, pg.size(), 1, 1)?;
        Trainer::with_mesh(cfg, engine, loader, &mesh, Vec::new())
    }

    /// Training on a device mesh: the engine holds this rank's tensor-parallel
    /// shard (built with `mesh.tp()`), data parallelism (DDP / ZeRO / FSDP)
    /// runs over `mesh.dp()`. `tp_replicated` lists the flat ranges of
    /// parameters every tp rank holds whole (their gradients are summed over
    /// tp under sequence parallelism, and counted once in the global norm).
    pub fn with_mesh(
        cfg: &TrainConfig,
        mut engine: Engine,
        loader: Arc<DataLoader>,
        mesh: &DeviceMesh,
        tp_replicated: Vec<std::ops::Range<usize>>,
    ) -> Result<Trainer> {
        let pg = mesh.dp().clone();
        let world = mesh.world().size();
        let dp = cfg.dp_for_world(world)?;
        if dp != pg.size() {
            return Err(Error::Check(format!(
                "the mesh's data-parallel size {} differs from the config's {dp}",
                pg.size()
            )));
        }
        // A batch number left to derive from train.global_batch_size (a
        // config built outside a job: library use) is derived for this
        // mesh's dp here, so training runs what the identity says.
        let resolved;
        let cfg = if cfg.batch_to_derive() {
            let mut c = cfg.clone();
            c.resolve_batch(dp)?;
            resolved = c;
            &resolved
        } else {
            cfg
        };
        let global_batch = cfg.global_batch(dp);
        let micro = micro_batch_size(global_batch, dp, cfg.train.grad_accum_steps)?;
        if let Some(t) = cfg.seq_len().filter(|&t| t != loader.seq_len()) {
            return Err(Error::Check(format!(
                "data sequence length {} differs from the model's {t} (model section)",
                loader.seq_len(),
            )));
        }
        if (loader.train_samples() as usize) < global_batch {
            return Err(Error::Check(format!(
                "the training split holds {} samples of {} tokens, fewer than one global batch of {global_batch} \
                 (micro_batch {} x dp {dp} x grad_accum {})",
                loader.train_samples(),
                loader.seq_len(),
                cfg.train.micro_batch_size,
                cfg.train.grad_accum_steps
            )));
        }
        let offload = cfg.offload_dir();
        let tag = format!("rank{}", pg.global_rank());
        let make_opt = |e: &Engine,
                        range: std::ops::Range<usize>|
         -> Result<Box<dyn Optimizer + Send>> {
            let off = offload.as_deref().map(|d| (d, tag.as_str()));
            let mut o = if cfg.optimizer_on_device(e.device()) {
                crate::optim::from_config_on(&cfg.optim, e.layout(), range, e.ledger(), e.device())
                    .map_err(|e| Error::Io(e.to_string()))?
            } else {
                crate::optim::from_config(&cfg.optim, e.layout(), range, e.ledger(), off).map_err(
                    |e| {
                        Error::Io(format!(
                            "optimizer offload (zero_optimization.offload_optimizer.nvme_path): {e}"
                        ))
                    },
                )?
            };
            if let Some(after) = cfg.topk_freeze_after_on(mesh.dp().size()) {
                o.freeze_variance_after(after)
                    .map_err(|m| Error::Check(format!("parallel.topk_freeze_variance: {m}")))?;
            }
            Ok(o)
        };
        // A micro-batch to time the blocks on, for a time-balanced pipeline.
        let sample =
            if mesh.pp_size > 1 && cfg.parallel.pp_partition == crate::config::PpPartition::Time {
                let b = loader.micro_batch(
                    0,
                    pg.rank(),
                    pg.size(),
                    0,
                    micro,
                    cfg.train.grad_accum_steps,
                )?;
                Some(b.to_tensors(engine.device())?)
            } else {
                None
            };
        // DeepSpeed's activation-checkpointing options.
        let ac = &cfg.activation_checkpointing;
        let lead = mesh.world().rank() == 0;
        if ac.partition_activations {
            if mesh.tp_size > 1 && cfg.parallel.sequence_parallel {
                // Each tp rank's block input is its own part of the
                // sequence, (B, T/tp, C), not a copy to split: the
                // checkpoint is already 1/tp, and gathering slices of
                // different ranks' inputs would recompute from garbage.
                if lead {
                    eprintln!("note: activation_checkpointing.partition_activations: with parallel.sequence_parallel each tensor-parallel rank already keeps only its part of the sequence; nothing more to split");
                }
            } else if mesh.tp_size > 1 {
                engine
                    .stack_mut()
                    .set_partition_group(Some(mesh.tp().clone()));
            } else if lead {
                eprintln!("note: activation_checkpointing.partition_activations splits checkpoints over tensor-parallel ranks; with parallel.tp = 1 it has no effect");
            }
        }
        let hook = cfg.parallel.comm_hook;
        let topk = hook == crate::config::CommHookKind::Topk;
        let topk_noted = topk && cfg.topk_freeze_after().is_some();
        if lead && hook != crate::config::CommHookKind::None && !topk_noted && mesh.dp().size() == 1
        {
            eprintln!("note: parallel.comm_hook = \"{hook}\": the data-parallel group has one rank, so no gradient is reduced or compressed; the hook has no effect");
        }
        if lead && cfg.topk_freeze_after().is_some() && mesh.dp().size() == 1 {
            eprintln!("note: parallel.comm_hook = \"topk\": the data-parallel group has one rank, so no gradient is reduced or compressed; AdamW runs as without the hook (parallel.topk_freeze_variance has no effect)");
        }
        if ac.cpu_checkpointing && lead {
            eprintln!("note: activation_checkpointing.cpu_checkpointing: on CPU training the checkpoints are already in host memory; nothing changes");
        }
        let args = BuildArgs {
            mesh,
            tp_replicated: tp_replicated.clone(),
            make_opt: &make_opt,
            sample,
        };
        let mut strat = crate::strategy::build(cfg, &mut engine, args)?;
        if let (Some(d), true) = (strat.diloco_mut(), cfg.fault_tolerance.enabled()) {
            // The groups are replica groups: the trainer takes the outer
            // step over each outer step's quorum.
            d.set_external_outer()?;
        }
        let scaler = loss_scaler(cfg);
        // Background checkpoints talk over a group of their own, so their
        // collectives never interleave with training's.
        let ckpt_async = if cfg.checkpoint.async_save && cfg.checkpoint.interval > 0 {
            let world = mesh.world();
            let all: Vec<usize> = (0..world.size()).collect();
            let g = world.new_group(&all)?.expect("every rank is a member");
            Some(crate::checkpoint::AsyncWriter::new(g))
        } else {
            None
        };
        let sched = LrSchedule::from_config(&cfg.optim, cfg.train.steps);
        Ok(Trainer {
            cfg: cfg.clone(),
            engine,
            loader,
            strat,
            scaler,
            pg,
            mesh: mesh.clone(),
            tp_replicated,
            sched,
            micro,
            global_batch,
            memory: None,
            flops_per_token: None,
            placement: std::sync::Arc::new(crate::checkpoint::Whole),
            ckpt_async,
            start_step: 0,
            ft: None,
        })
    }

    /// The strategy running this trainer's data (and pipeline) axes.
    pub fn strategy(&self) -> &dyn Strategy {
        self.strat.as_ref()
    }

    /// The loss scaler (its scale and history are checkpoint state).
    pub fn loss_scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// Model FLOPs per token (forward and backward, without
    /// recomputation: `phalanx::plan::model_flops_per_token`), so that
    /// `run` reports MFU.
    pub fn set_flops_per_token(&mut self, f: f64) {
        self.flops_per_token = Some(f);
    }

    /// The model FLOPs per token MFU is computed from, where the model set them.
    pub fn flops_per_token(&self) -> Option<f64> {
        self.flops_per_token
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
    /// The data-parallel group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    pub fn global_batch(&self) -> usize {
        self.global_batch
    }
    /// Per-rank memory after the first step (on every rank), once run.
    pub fn memory_report(&self) -> Option<&[MemoryReport]> {
        self.memory.as_deref()
    }

    /// The full flat parameters on every rank (ZeRO-3 gathers them: every
    /// rank must call this).
    pub fn full_params(&self) -> Result<Vec<f32>> {
        self.strat.full_params(&self.engine)
    }

    /// Make the engine hold full, current parameters (after ZeRO-3, or on a
    /// pipeline stage), e.g. to save them. Collective.
    pub fn materialize_params(&mut self) -> Result<()> {
        self.strat.materialize_params(&mut self.engine)
    }

    /// The samples one step takes from the data's global order: the global
    /// batch, times the replica groups that share each step's data under
    /// fault tolerance (group i reads share i of them).
    pub(crate) fn data_batch(&self) -> usize {
        let ft = &self.cfg.fault_tolerance;
        self.global_batch * if ft.enabled() { ft.replicas } else { 1 }
    }

    /// One optimizer step: `grad_accum` micro-batches of this rank's slice,
    /// gradient reduction, then the finish path (unscale, non-finite check,
    /// clip, update).
    pub fn step(&mut self, step: usize) -> Result<StepStats> {
        self.step_inner(step)?
            .ok_or_else(|| Error::Check(format!("step {step} did not commit")))
    }

    /// As `step`; `None` when, under fault tolerance, the cross-group
    /// average failed (a group was lost): nothing was updated, and the step
    /// runs again with the next quorum.
    fn step_inner(&mut self, step: usize) -> Result<Option<StepStats>> {
        let t0 = Instant::now();
        let blocked0 = phalanx_comm::blocked_seconds();
        let reads0 = crate::engine::resident::downloads();
        let sent0 = self.bytes_sent();
        if let Some(f) = &self.ft {
            // The lighthouse keeps a group whose steps go on (see
            // `Manager::note_progress`).
            f.mgr.note_progress(step as u64);
        }
        if let Some(d) = crate::fault::step_delay(self.mesh.world().rank()) {
            std::thread::sleep(d);
        }
        let accum = self.cfg.train.grad_accum_steps;
        // A replica group reads its own share of each step's data.
        let (dp_rank, dp) = match &self.ft {
            Some(f) => f.shard,
            None => (self.pg.rank(), self.pg.size()),
        };
        let device = self.engine.device().clone();
        let (loader, micro) = (&self.loader, self.micro);
        let mut batch = |a: usize| -> Result<(candle_core::Tensor, candle_core::Tensor)> {
            Ok(loader
                .micro_batch(step as u64, dp_rank, dp, a, micro, accum)?
                .to_tensors(&device)?)
        };
        let mut scale = self.scaler.scale() as f32;
        if crate::fault::overflow_at(step, dp_rank) {
            scale = f32::INFINITY;
        }
        // Gradients may stay on the device through the step unless
        // something here reads the flat buffer in between (below).
        let sp_sum = self.mesh.tp_size > 1 && self.cfg.parallel.sequence_parallel;
        self.strat
            .keep_grads_on_device(!sp_sum && self.ft.is_none());
        let loss = self
            .strat
            .forward_backward(&mut self.engine, &mut batch, accum, scale)?;
        if !loss.is_finite() && !self.scaler.skips_on_overflow() {
            return Err(Error::Check(format!(
                "loss is {loss} at step {step} (rank {}); {}",
                self.pg.global_rank(),
                crate::optim::step::diverged_hint(self.cfg.optim.grad_clip as f32)
            )));
        }
        // Sequence parallel: replicated parameters saw only this rank's
        // sequence chunk; their gradients are summed over tp.
        if self.mesh.tp_size > 1 && self.cfg.parallel.sequence_parallel {
            let tp = self.mesh.tp().clone();
            for r in &self.tp_replicated {
                tp.all_reduce(
                    &mut self.engine.grads_flat_mut()[r.clone()],
                    phalanx_comm::ReduceOp::Sum,
                )?;
            }
        }
        let lead = self.mesh.world().rank() == 0;
        let per_step_ft = self.ft.as_ref().is_some_and(|f| f.diloco.is_none());
        if per_step_ft {
            let overlapped = !self.ft.as_ref().is_some_and(|f| f.sync);
            if overlapped {
                if let Some(nk) = self.ft_after_forward(step, lead)? {
                    // The members changed during the forward: healed; the
                    // step runs again on the quorum's state.
                    self.ft.as_mut().expect("on").resume_at = Some(nk);
                    return Ok(None);
                }
            }
            if !self.ft_reduce()? {
                return Ok(None);
            }
        }
        let lr = self.sched.lr(step);
        let clip_to = self.cfg.optim.grad_clip as f32;
        let out = self
            .strat
            .finish_step(&mut self.engine, &mut self.scaler, lr, clip_to, step)?;
        let check = self.cfg.parallel.check_params_every;
        if let Some(f) = &self.ft {
            match f.diloco {
                Some(h) if (step + 1).is_multiple_of(h) => {
                    // DiLoCo's outer step over this sync's quorum.
                    let next = self.ft_outer(step + 1, true, false, lead)?;
                    if next != step + 1 {
                        self.ft.as_mut().expect("on").resume_at = Some(next);
                    }
                }
                None if check > 0 && (step + 1).is_multiple_of(check) => {
                    self.ft_check_identical(step + 1)?;
                }
                _ => {}
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let blocked = phalanx_comm::blocked_seconds() - blocked0;
        let comm_bytes = self.bytes_sent() - sent0;
        if self.memory.is_none() {
            self.memory = Some(self.gather_memory()?);
        }
        let tokens = (self.global_batch * self.loader.seq_len()) as f64;
        Ok(Some(StepStats {
            step,
            loss,
            lr,
            grad_norm: out.grad_norm,
            step_ms: secs * 1e3,
            tokens_per_s: tokens / secs,
            comm_bytes,
            comm_bytes_total: None,
            loss_scale: out.loss_scale,
            fp16: self.cfg.precision() == crate::config::Precision::Fp16,
            scale_after: self.scaler.scale(),
            scale_kept_by: self.scaler.kept_by(),
            skipped: out.skipped,
            compute_ms: (secs - blocked).max(0.0) * 1e3,
            mfu: None,
            groups_committed: self
                .ft
                .as_ref()
                .and_then(|f| f.quorum.as_ref())
                .map(|q| q.size),
            data: self.loader.stats(),
            grad_reads: (!crate::ops::host_kernels(self.engine.device()))
                .then(|| (crate::engine::resident::downloads() - reads0) as u64),
        }))
    }

    /// Gather every rank's measured bubble and in-flight peak; print them
    /// against the schedule's theory.
    fn report_pipeline(
        &self,
        p: &crate::strategy::pipeline::Pipeline,
        report: &mut Report,
        print: bool,
    ) -> Result<()> {
        let world = self.mesh.world();
        let t = p.timeline();
        let mine = [
            t.bubble_fraction().unwrap_or(f64::NAN),
            t.peak_in_flight() as f64,
        ];
        let mut all = vec![0f64; 2 * world.size()];
        world.all_gather(&mine, &mut all)?;
        let bubble: Vec<f64> = all.chunks(2).map(|c| c[0]).collect();
        let flight: Vec<usize> = all.chunks(2).map(|c| c[1] as usize).collect();
        if print {
            let (pp, m) = (self.mesh.pp_size, self.cfg.train.grad_accum_steps);
            let theory = (pp - 1) as f64 / (m + pp - 1) as f64;
            let sched = p.config().schedule;
            println!(
                "pipeline {sched}: p = {pp}, m = {m}; measured bubble per rank {:?} (GPipe/1F1B theory (p-1)/(m+p-1) = {theory:.3}); \
                 peak micro-batches in flight per rank {flight:?}",
                bubble.iter().map(|b| (b * 1000.0).round() / 1000.0).collect::<Vec<_>>()
            );
        }
        report.bubble = Some(bubble);
        report.in_flight = Some(flight);
        Ok(())
    }

    /// The job's matmul peak (FLOP/s): every rank probes at once (so ranks
    /// sharing a host share its cores, as in training) and the figures are
    /// summed. `None` when the model's FLOPs are unknown.
    fn matmul_peak(&self) -> Result<Option<f64>> {
        // The probe times the CPU's products; on a GPU the peak to hold a
        // step against is the device's (scripts/gpu_check.sh takes it).
        if self.flops_per_token.is_none() || self.cfg.train.device != crate::config::DeviceKind::Cpu
        {
            return Ok(None);
        }
        let world = self.mesh.world();
        world.barrier()?;
        let mut p = [crate::plan::probe_matmul_flops()];
        world.all_reduce(&mut p, phalanx_comm::ReduceOp::Sum)?;
        Ok(Some(p[0]))
    }

    /// Bytes this rank has sent: in its job, and under fault tolerance to
    /// the other replica groups too.
    pub(super) fn bytes_sent(&self) -> u64 {
        self.pg.bytes_sent() + self.ft.as_ref().map_or(0, |f| f.mgr.bytes_sent())
    }

    /// This rank's figures for the monitor after step `s`.
    fn figures(&self, s: &StepStats, sent_at_start: u64) -> crate::monitor::Figures {
        let memory = self.memory_now();
        crate::monitor::Figures {
            step: s.step,
            loss: s.loss as f64,
            tokens_per_s: s.tokens_per_s,
            step_s: s.step_ms / 1e3,
            compute_s: s.compute_ms / 1e3,
            grad_norm: s.grad_norm as f64,
            comm_bytes_total: self.bytes_sent() - sent_at_start,
            loss_scale: (self.cfg.precision() == crate::config::Precision::Fp16)
                .then_some(s.loss_scale),
            mfu: s.mfu,
            memory: std::array::from_fn(|k| (crate::monitor::MEMORY_KINDS[k], memory[k] as u64)),
        }
    }

    /// Mean validation loss over up to `train.eval_batches` batches of
    /// `micro_batch_size`, split across the data-parallel ranks.
    pub fn evaluate(&mut self) -> Result<Option<f32>> {
        let bs = self.micro;
        let n = self
            .loader
            .val_batch_count(bs)
            .min(self.cfg.train.eval_batches);
        if n == 0 {
            return Ok(None);
        }
        // Pipeline stages update only their own blocks: bring the rest up to
        // date, then every rank can run the whole model.
        self.strat.prepare_eval(&mut self.engine)?;
        let loss = self.eval_batches(n, bs);
        // Whatever the batches gave: training must not go on from what
        // evaluation put in place (DiLoCo's anchor).
        self.strat.after_eval(&mut self.engine)?;
        Ok(Some(loss?))
    }

    /// The mean loss of `n` validation batches of `bs` samples, spread
    /// evenly over the validation split (of a corpus of many sources and
    /// shards, the first `n` would all come from one shard of the first).
    fn eval_batches(&mut self, n: usize, bs: usize) -> Result<f32> {
        let which = self.loader.val_spread(n, bs);
        let n = which.len();
        let pg = &self.pg;
        let mut acc = [0.0f64, 0.0];
        // ZeRO-3 gathers collectively: every rank runs every batch there.
        let stride = if self.strat.collective_eval() {
            1
        } else {
            pg.size()
        };
        let first = if stride == 1 { 0 } else { pg.rank() };
        for i in (first..n).step_by(stride) {
            let (x, y) = self
                .loader
                .val_batch(which[i], bs)?
                .to_tensors(self.engine.device())?;
            acc[0] += self.strat.eval_loss(&self.engine, &x, &y)? as f64;
            acc[1] += 1.0;
        }
        pg.all_reduce(&mut acc, phalanx_comm::ReduceOp::Sum)?;
        Ok((acc[0] / acc[1]) as f32)
    }
}

/// The loss scaler the config asks for: dynamic or fixed for fp16
/// (`fp16.loss_scale` 0 = dynamic), none for fp32 and bf16.
pub fn loss_scaler(cfg: &TrainConfig) -> LossScaler {
    if cfg.precision() != crate::config::Precision::Fp16 {
        // `train.on_nonfinite = skip`: a scale of 1 that skips as fp16's does.
        return match cfg.train.on_nonfinite {
            crate::config::OnNonfinite::Stop => LossScaler::none(),
            crate::config::OnNonfinite::Skip => LossScaler::fixed(1.0),
        };
    }
    let f = &cfg.fp16;
    if f.loss_scale > 0.0 {
        return LossScaler::fixed(f.loss_scale);
    }
    LossScaler::dynamic(ScalerConfig {
        initial_scale_power: f.initial_scale_power,
        window: f.loss_scale_window,
        hysteresis: f.hysteresis,
        min_scale: f.min_loss_scale,
    })
}

/// The engine settings a config asks for: the init seed, the compute dtype
/// (`train.precision`) and activation checkpointing
/// (`train.activation_checkpointing`).
pub fn engine_config(cfg: &TrainConfig) -> crate::engine::EngineConfig {
    use crate::config::Recompute;
    use crate::engine::Activations;
    crate::engine::EngineConfig {
        seed: cfg.train.seed,
        activations: match cfg.recompute() {
            Recompute::None => Activations::KeepGraph,
            Recompute::Full => Activations::Recompute,
            Recompute::Every(k) => Activations::RecomputeEvery(k),
        },
        compute_dtype: cfg.precision().dtype(),
        // A pipeline stage initialises only its own blocks, once the
        // partition is known.
        defer_init: cfg.parallel.pp > 1,
    }
}
