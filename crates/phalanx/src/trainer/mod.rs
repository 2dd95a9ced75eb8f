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

mod log;
mod pipe;

pub use log::{write_loss_svg, RunOptions, StepLog};

use crate::config::TrainConfig;
use crate::data::{micro_batch_size, DataLoader};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ledger::Mem;
use crate::mesh::DeviceMesh;
use crate::optim::{clip, LrSchedule, Optimizer};
use crate::strategy::{Ddp, DdpConfig, Zero, ZeroConfig};
use phalanx_comm::{ProcessGroup, ReduceOp};
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
}

/// What a run produced.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub losses: Vec<f32>,
    /// (step, validation loss)
    pub val_losses: Vec<(usize, f32)>,
    pub tokens_per_s: f64,
    /// Pipeline runs: the measured bubble (idle / step time) of every world
    /// rank, and the peak micro-batches in flight of every world rank.
    pub bubble: Option<Vec<f64>>,
    pub in_flight: Option<Vec<usize>>,
}

/// How the data-parallel axis is run.
enum Strategy {
    /// Full replicas (ZeRO stage 0, FSDP NO_SHARD).
    Ddp {
        ddp: Ddp,
        opt: Box<dyn Optimizer + Send>,
    },
    /// ZeRO-1/2/3, FSDP.
    Zero(Box<Zero>),
    /// Pipeline parallel over the mesh's pp axis (DDP or ZeRO-1 on dp).
    Pipe(Box<pipe::PipeStrategy>),
}

pub struct Trainer {
    cfg: TrainConfig,
    engine: Engine,
    loader: Arc<DataLoader>,
    strat: Strategy,
    /// The data-parallel group (replicas of this rank's model shard).
    pg: ProcessGroup,
    mesh: DeviceMesh,
    /// Tensor parallel: flat ranges of parameters every tp rank holds whole.
    tp_replicated: Vec<std::ops::Range<usize>>,
    sched: LrSchedule,
    micro: usize,
    global_batch: usize,
    memory: Option<Vec<MemoryReport>>,
}

/// One rank's memory at the end of the first step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryReport {
    pub rank: usize,
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    pub activations_peak: usize,
    pub working_peak: usize,
    /// Peak resident set of the process (VmHWM), 0 where unknown.
    pub peak_rss: usize,
}

impl MemoryReport {
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

fn peak_rss() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
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
        let global_batch = cfg.global_batch(dp);
        let micro = micro_batch_size(global_batch, dp, cfg.train.grad_accum_steps)?;
        if loader.seq_len() != cfg.model.block_size {
            return Err(Error::Check(format!(
                "data sequence length {} differs from model.block_size {}",
                loader.seq_len(),
                cfg.model.block_size
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
        let bucket_bytes = (cfg.parallel.bucket_mb * (1 << 20) as f64) as usize;
        let sharding = cfg.sharding()?;
        let offload = cfg.offload_dir();
        let tag = format!("rank{}", pg.global_rank());
        let make_opt =
            |e: &Engine, range: std::ops::Range<usize>| -> Result<Box<dyn Optimizer + Send>> {
                let off = offload.as_deref().map(|d| (d, tag.as_str()));
                crate::optim::from_config(&cfg.optim, e.layout(), range, e.ledger(), off)
                    .map_err(|e| Error::Io(format!("optimizer offload: {e}")))
            };
        // A micro-batch to time the blocks on, for a time-balanced pipeline.
        let sample = if mesh.pp_size > 1 && cfg.parallel.pp_partition.trim() == "time" {
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
        let strat = if mesh.pp_size > 1 {
            let ps = pipe::PipeStrategy::new(
                cfg,
                &mut engine,
                mesh,
                sharding.stage == 1,
                &make_opt,
                sample,
            )?;
            Strategy::Pipe(Box::new(ps))
        } else if sharding.stage == 0 {
            let ddp_cfg = DdpConfig {
                bucket_bytes,
                check_every: cfg.parallel.check_params_every,
            };
            let ddp = Ddp::new(&mut engine, pg.clone(), ddp_cfg)?;
            let opt = make_opt(&engine, 0..engine.num_params())?;
            Strategy::Ddp { ddp, opt }
        } else {
            let zcfg = ZeroConfig {
                stage: sharding.stage,
                bucket_bytes,
                forward_prefetch: cfg.parallel.forward_prefetch,
                backward_prefetch: cfg.parallel.backward_prefetch,
                shard_group_size: sharding.hybrid_group,
            };
            let mut z = Zero::new(&mut engine, pg.clone(), zcfg, make_opt)?;
            if mesh.tp_size > 1 {
                z.tp_norm = Some((mesh.tp().clone(), tp_replicated.clone()));
            }
            Strategy::Zero(Box::new(z))
        };
        let o = &cfg.optim;
        let sched = match o.schedule.as_str() {
            "constant" => LrSchedule::Constant { lr: o.lr as f32 },
            _ => LrSchedule::WarmupCosine {
                max_lr: o.lr as f32,
                min_lr: o.min_lr as f32,
                warmup: o.warmup_steps,
                decay_steps: cfg.train.steps.max(o.warmup_steps + 1),
            },
        };
        Ok(Trainer {
            cfg: cfg.clone(),
            engine,
            loader,
            strat,
            pg,
            mesh: mesh.clone(),
            tp_replicated,
            sched,
            micro,
            global_batch,
            memory: None,
        })
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
        match &self.strat {
            Strategy::Ddp { .. } => Ok(self.engine.params_flat().to_vec()),
            Strategy::Zero(z) => z.full_params(&self.engine),
            Strategy::Pipe(p) => Ok(p.pipe.full_params(&self.engine)?),
        }
    }

    /// Make the engine hold full parameters again (after ZeRO-3), e.g. to
    /// save them. Collective.
    pub fn materialize_params(&mut self) -> Result<()> {
        if let Strategy::Pipe(p) = &self.strat {
            return p.sync_params(&mut self.engine);
        }
        if self.engine.params_flat().is_empty() {
            let full = self.full_params()?;
            self.engine.restore_params(full);
        }
        Ok(())
    }

    /// One optimizer step: `grad_accum` micro-batches of this rank's slice,
    /// gradient reduction, clip, update.
    pub fn step(&mut self, step: usize) -> Result<StepStats> {
        let t0 = Instant::now();
        let sent0 = self.pg.bytes_sent();
        let accum = self.cfg.train.grad_accum_steps;
        let (dp_rank, dp) = (self.pg.rank(), self.pg.size());
        let device = self.engine.device().clone();
        match &mut self.strat {
            Strategy::Ddp { .. } | Strategy::Pipe(_) => self.engine.zero_grad(),
            Strategy::Zero(z) => z.zero_grad(&mut self.engine),
        }
        let mut loss_sum = 0.0f64;
        // Pipeline: the m micro-batches are the pipeline's, run by its schedule.
        let pipelined = matches!(self.strat, Strategy::Pipe(_));
        if let Strategy::Pipe(p) = &mut self.strat {
            let (loader, micro) = (&self.loader, self.micro);
            let mut batch = |a: usize| -> Result<(candle_core::Tensor, candle_core::Tensor)> {
                Ok(loader
                    .micro_batch(step as u64, dp_rank, dp, a, micro, accum)?
                    .to_tensors(&device)?)
            };
            // Already the mean over micro-batches and dp replicas.
            loss_sum = p.pipe.forward_backward(&mut self.engine, &mut batch)? as f64 * accum as f64;
        }
        for a in (0..accum).filter(|_| !pipelined) {
            let batch = self
                .loader
                .micro_batch(step as u64, dp_rank, dp, a, self.micro, accum)?;
            let (x, y) = batch.to_tensors(&device)?;
            let (scale, last) = (1.0 / accum as f32, a + 1 == accum);
            let loss = match &mut self.strat {
                Strategy::Ddp { ddp, .. } => {
                    ddp.forward_backward(&mut self.engine, &x, &y, scale, last)?
                }
                Strategy::Zero(z) => z.forward_backward(&mut self.engine, &x, &y, scale, last)?,
                Strategy::Pipe(_) => unreachable!("pipelined steps run above"),
            };
            if !loss.is_finite() {
                return Err(Error::Check(format!(
                    "loss is {loss} at step {step} (rank {}); lower optim.lr or enable optim.grad_clip",
                    self.pg.global_rank()
                )));
            }
            loss_sum += loss as f64;
        }
        // Sequence parallel: replicated parameters saw only this rank's
        // sequence chunk; their gradients are summed over tp.
        if self.mesh.tp_size > 1 && self.cfg.parallel.sequence_parallel {
            let tp = self.mesh.tp().clone();
            for r in &self.tp_replicated {
                tp.all_reduce(&mut self.engine.grads_flat_mut()[r.clone()], ReduceOp::Sum)?;
            }
        }
        // The step's loss: mean over micro-steps here, then over ranks.
        let mut l = [loss_sum / accum as f64];
        self.pg.all_reduce(&mut l, ReduceOp::Avg)?;
        let lr = self.sched.lr(step);
        let clip_to = self.cfg.optim.grad_clip as f32;
        let norm = match &mut self.strat {
            Strategy::Ddp { ddp, opt } => {
                // Gradients are identical on every dp rank after the
                // all-reduce, so the norm is too; tp shards add up.
                let mut ss = [weighted_sum_squares(
                    self.engine.grads_flat(),
                    0,
                    &self.tp_replicated,
                    self.mesh.tp_size,
                )];
                if self.mesh.tp_size > 1 {
                    self.mesh.tp().all_reduce(&mut ss, ReduceOp::Sum)?;
                }
                let (n, s) = clip::clip_scale(ss[0], clip_to);
                let (p, g) = self.engine.params_and_grads_mut();
                opt.step(p, g, lr, if clip_to > 0.0 { s } else { 1.0 });
                ddp.maybe_check(&self.engine, step + 1)?;
                n
            }
            Strategy::Zero(z) => z.step(&mut self.engine, lr, clip_to)?,
            Strategy::Pipe(p) => p.step(&mut self.engine, lr, clip_to, &self.tp_replicated)?,
        };
        let secs = t0.elapsed().as_secs_f64();
        let comm_bytes = self.pg.bytes_sent() - sent0;
        if step == 0 {
            self.memory = Some(self.gather_memory()?);
        }
        let tokens = (self.global_batch * self.cfg.model.block_size) as f64;
        Ok(StepStats {
            step,
            loss: l[0] as f32,
            lr,
            grad_norm: norm,
            step_ms: secs * 1e3,
            tokens_per_s: tokens / secs,
            comm_bytes,
        })
    }

    /// Gather every rank's measured bubble and in-flight peak; print them
    /// against the schedule's theory.
    fn report_pipeline(
        &self,
        p: &pipe::PipeStrategy,
        report: &mut Report,
        print: bool,
    ) -> Result<()> {
        let world = self.mesh.world();
        let t = p.pipe.timeline();
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
            let sched = p.pipe.config().schedule;
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

    /// Every rank's ledger and peak RSS, gathered on every rank.
    fn gather_memory(&self) -> Result<Vec<MemoryReport>> {
        let l = self.engine.ledger();
        let mine = [
            self.pg.global_rank() as i64,
            l.current(Mem::Params) as i64,
            l.current(Mem::Grads) as i64,
            l.current(Mem::OptState) as i64,
            l.peak(Mem::Activations) as i64,
            l.peak(Mem::Working) as i64,
            peak_rss() as i64,
        ];
        let world = self.mesh.world();
        let mut all = vec![0i64; 7 * world.size()];
        world.all_gather(&mine, &mut all)?;
        Ok(all
            .chunks(7)
            .map(|c| MemoryReport {
                rank: c[0] as usize,
                params: c[1] as usize,
                grads: c[2] as usize,
                optimizer: c[3] as usize,
                activations_peak: c[4] as usize,
                working_peak: c[5] as usize,
                peak_rss: c[6] as usize,
            })
            .collect())
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
        if let Strategy::Pipe(p) = &self.strat {
            p.sync_params(&mut self.engine)?;
        }
        let pg = &self.pg;
        let mut acc = [0.0f64, 0.0];
        // ZeRO-3 gathers collectively: every rank runs every batch there.
        let stride = if matches!(&self.strat, Strategy::Zero(z) if z.stage() == 3) {
            1
        } else {
            pg.size()
        };
        let first = if stride == 1 { 0 } else { pg.rank() };
        for i in (first..n).step_by(stride) {
            let (x, y) = self
                .loader
                .val_batch(i, bs)?
                .to_tensors(self.engine.device())?;
            acc[0] += match &self.strat {
                Strategy::Ddp { .. } | Strategy::Pipe(_) => self.engine.eval_loss(&x, &y)?,
                Strategy::Zero(z) => z.eval_loss(&self.engine, &x, &y)?,
            } as f64;
            acc[1] += 1.0;
        }
        pg.all_reduce(&mut acc, ReduceOp::Sum)?;
        Ok(Some((acc[0] / acc[1]) as f32))
    }

    /// Train for `train.steps` steps, logging on global rank 0.
    pub fn run(&mut self, opts: &RunOptions) -> Result<Report> {
        let steps = self.cfg.train.steps;
        let lead = self.pg.global_rank() == 0;
        let m = &self.mesh;
        let mut log = StepLog::new(opts, lead, steps)?;
        if lead && opts.progress {
            println!(
                "training {} parameters per rank on {} rank(s) (dp {} x pp {} x tp {}): global batch {} x {} tokens \
                 (micro-batch {} x grad_accum {}), {} steps",
                self.engine.num_params(),
                m.world().size(),
                m.dp_size,
                m.pp_size,
                m.tp_size,
                self.global_batch,
                self.cfg.model.block_size,
                self.micro,
                self.cfg.train.grad_accum_steps,
                steps
            );
        }
        let mut report = Report::default();
        let mut tok_s = Vec::new();
        for k in 0..steps {
            let s = self.step(k)?;
            report.losses.push(s.loss);
            if k >= 2 {
                tok_s.push(s.tokens_per_s);
            }
            let eval_now = self.cfg.train.eval_interval > 0
                && ((k + 1) % self.cfg.train.eval_interval == 0 || k + 1 == steps);
            let val = if eval_now { self.evaluate()? } else { None };
            if let Some(v) = val {
                report.val_losses.push((k, v));
            }
            let mem = if k == 0 { self.memory.as_deref() } else { None };
            if let (Some(m), true, true) = (mem, lead, opts.progress) {
                print_memory(m);
            }
            log.step(&s, val, mem)?;
        }
        report.tokens_per_s = if tok_s.is_empty() {
            0.0
        } else {
            tok_s.iter().sum::<f64>() / tok_s.len() as f64
        };
        if let Strategy::Pipe(p) = &self.strat {
            self.report_pipeline(p, &mut report, lead && opts.progress)?;
            if let Some(path) = &opts.trace {
                p.pipe.write_trace(path)?;
                if lead && opts.progress {
                    println!(
                        "pipeline trace written to {} (open in Perfetto or chrome://tracing)",
                        path.display()
                    );
                }
            }
        } else if let (Some(path), true) = (&opts.trace, lead) {
            println!("no trace written to {}: timelines are recorded for pipeline runs (parallel.pp > 1)", path.display());
        }
        log.finish(&report)?;
        Ok(report)
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The per-rank memory table printed after the first step.
pub fn print_memory(m: &[MemoryReport]) {
    println!("memory after step 1 (MiB)   params     grads optimizer  model states  activations(peak)  unsharded(peak)  peak RSS");
    for r in m {
        println!(
            "  rank {:<20} {:>9.2} {:>9.2} {:>9.2} {:>13.2} {:>18.2} {:>16.2} {:>9.1}",
            r.rank,
            mib(r.params),
            mib(r.grads),
            mib(r.optimizer),
            mib(r.model_states()),
            mib(r.activations_peak),
            mib(r.working_peak),
            mib(r.peak_rss)
        );
    }
}

/// Sum of squares of `g` (flat positions `offset..`), where elements in
/// `replicated` count 1/tp: they are held whole by every tensor-parallel
/// rank, so after a sum over tp they count once.
pub fn weighted_sum_squares(
    g: &[f32],
    offset: usize,
    replicated: &[std::ops::Range<usize>],
    tp: usize,
) -> f64 {
    let mut ss = clip::sum_squares(g);
    if tp > 1 {
        for r in replicated {
            let lo = r.start.max(offset);
            let hi = r.end.min(offset + g.len());
            if lo < hi {
                ss -= (1.0 - 1.0 / tp as f64) * clip::sum_squares(&g[lo - offset..hi - offset]);
            }
        }
    }
    ss
}
