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

pub use log::{write_loss_svg, RunOptions, StepLog};

use crate::config::TrainConfig;
use crate::data::{micro_batch_size, DataLoader};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::optim::{clip, AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};
use crate::strategy::{Ddp, DdpConfig};
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
}

/// What a run produced.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub losses: Vec<f32>,
    /// (step, validation loss)
    pub val_losses: Vec<(usize, f32)>,
    pub tokens_per_s: f64,
}

pub struct Trainer {
    cfg: TrainConfig,
    engine: Engine,
    loader: Arc<DataLoader>,
    ddp: Ddp,
    opt: Box<dyn Optimizer + Send>,
    sched: LrSchedule,
    micro: usize,
    global_batch: usize,
}

impl Trainer {
    /// Set up data-parallel training over `pg` (every rank of `pg` is a
    /// data-parallel replica). Rank 0's initial parameters are broadcast.
    pub fn new(
        cfg: &TrainConfig,
        mut engine: Engine,
        loader: Arc<DataLoader>,
        pg: ProcessGroup,
    ) -> Result<Trainer> {
        let dp = cfg.dp_for_world(pg.size())?;
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
        let ddp_cfg = DdpConfig {
            bucket_bytes: (cfg.parallel.bucket_mb * (1 << 20) as f64) as usize,
            check_every: cfg.parallel.check_params_every,
        };
        let ddp = Ddp::new(&mut engine, pg, ddp_cfg)?;
        let o = &cfg.optim;
        let all = 0..engine.num_params();
        let opt: Box<dyn Optimizer + Send> = match o.name.as_str() {
            "adamw" => Box::new(AdamW::new(
                AdamWConfig {
                    beta1: o.betas[0] as f32,
                    beta2: o.betas[1] as f32,
                    eps: o.eps as f32,
                    weight_decay: o.weight_decay as f32,
                },
                engine.layout(),
                all,
                engine.ledger(),
            )),
            _ => Box::new(Sgd::new(
                SgdConfig {
                    momentum: o.momentum as f32,
                    nesterov: false,
                    weight_decay: o.weight_decay as f32,
                },
                engine.layout(),
                all,
                engine.ledger(),
            )),
        };
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
            ddp,
            opt,
            sched,
            micro,
            global_batch,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
    pub fn group(&self) -> &ProcessGroup {
        self.ddp.group()
    }
    pub fn ddp(&self) -> &Ddp {
        &self.ddp
    }
    pub fn global_batch(&self) -> usize {
        self.global_batch
    }

    /// One optimizer step: `grad_accum` micro-batches of this rank's slice,
    /// gradient all-reduce on the last, clip, update.
    pub fn step(&mut self, step: usize) -> Result<StepStats> {
        let t0 = Instant::now();
        let accum = self.cfg.train.grad_accum_steps;
        let (dp_rank, dp) = (self.ddp.group().rank(), self.ddp.group().size());
        let device = self.engine.device().clone();
        self.engine.zero_grad();
        let mut loss_sum = 0.0f64;
        for a in 0..accum {
            let batch = self
                .loader
                .micro_batch(step as u64, dp_rank, dp, a, self.micro, accum)?;
            let (x, y) = batch.to_tensors(&device)?;
            let loss = self.ddp.forward_backward(
                &mut self.engine,
                &x,
                &y,
                1.0 / accum as f32,
                a + 1 == accum,
            )?;
            if !loss.is_finite() {
                return Err(Error::Check(format!(
                    "loss is {loss} at step {step} (rank {}); lower optim.lr or enable optim.grad_clip",
                    self.ddp.group().global_rank()
                )));
            }
            loss_sum += loss as f64;
        }
        // The step's loss: mean over micro-steps here, then over ranks.
        let mut l = [loss_sum / accum as f64];
        self.ddp.group().all_reduce(&mut l, ReduceOp::Avg)?;
        // Gradients are identical on every rank after the all-reduce, so the
        // norm is too: no extra communication.
        let (norm, scale) = {
            let g = self.engine.grads_flat();
            let (n, s) = clip::clip_scale(clip::sum_squares(g), self.cfg.optim.grad_clip as f32);
            if self.cfg.optim.grad_clip > 0.0 {
                (n, s)
            } else {
                (n, 1.0)
            }
        };
        let lr = self.sched.lr(step);
        let (p, g) = self.engine.params_and_grads_mut();
        self.opt.step(p, g, lr, scale);
        self.ddp.maybe_check(&self.engine, step + 1)?;
        let secs = t0.elapsed().as_secs_f64();
        let tokens = (self.global_batch * self.cfg.model.block_size) as f64;
        Ok(StepStats {
            step,
            loss: l[0] as f32,
            lr,
            grad_norm: norm,
            step_ms: secs * 1e3,
            tokens_per_s: tokens / secs,
        })
    }

    /// Mean validation loss over up to `train.eval_batches` batches of
    /// `micro_batch_size`, split across the data-parallel ranks.
    pub fn evaluate(&self) -> Result<Option<f32>> {
        let bs = self.micro;
        let n = self
            .loader
            .val_batch_count(bs)
            .min(self.cfg.train.eval_batches);
        if n == 0 {
            return Ok(None);
        }
        let pg = self.ddp.group();
        let mut acc = [0.0f64, 0.0];
        for i in (pg.rank()..n).step_by(pg.size()) {
            let (x, y) = self
                .loader
                .val_batch(i, bs)?
                .to_tensors(self.engine.device())?;
            acc[0] += self.engine.eval_loss(&x, &y)? as f64;
            acc[1] += 1.0;
        }
        pg.all_reduce(&mut acc, ReduceOp::Sum)?;
        Ok(Some((acc[0] / acc[1]) as f32))
    }

    /// Train for `train.steps` steps, logging on global rank 0.
    pub fn run(&mut self, opts: &RunOptions) -> Result<Report> {
        let steps = self.cfg.train.steps;
        let lead = self.ddp.group().global_rank() == 0;
        let mut log = StepLog::new(opts, lead, steps)?;
        if lead && opts.progress {
            println!(
                "training {} parameters on {} data-parallel rank(s): global batch {} x {} tokens \
                 (micro-batch {} x grad_accum {}), {} steps",
                self.engine.num_params(),
                self.ddp.group().size(),
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
            log.step(&s, val)?;
        }
        report.tokens_per_s = if tok_s.is_empty() {
            0.0
        } else {
            tok_s.iter().sum::<f64>() / tok_s.len() as f64
        };
        log.finish(&report)?;
        Ok(report)
    }
}
