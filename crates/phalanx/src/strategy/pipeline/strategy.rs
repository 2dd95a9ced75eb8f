//! The pipeline-parallel strategy: a [`Pipeline`] over the mesh's pp axis,
//! plain data parallel or ZeRO-1 over its dp axis, one optimizer per range
//! of the flat buffer this rank's stages own.

use super::{Partition, Pipeline, PipelineConfig};
use crate::config::{PpPartition, TrainConfig};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::step::{finish_step, weighted_sum_squares, StepOutcome, Update};
use crate::optim::Optimizer;
use crate::precision::LossScaler;
use crate::strategy::reduce::CommHook;
use crate::strategy::state::{fill_params, restore_optimizer, snapshot, StateFill, StateRange};
use crate::strategy::{BatchFn, MakeOptimizer, Strategy};
use candle_core::Tensor;
use std::ops::Range;

pub struct PipeStrategy {
    pub pipe: Pipeline,
    /// (range of the flat buffer, its optimizer): with ZeRO-1, this dp
    /// rank's piece of each owned range.
    pub(super) opts: Vec<(Range<usize>, Box<dyn Optimizer + Send>)>,
    /// ZeRO-1: each owned range and the dp ranks' pieces of it.
    pub(super) zero1: Option<Vec<(Range<usize>, Vec<usize>)>>,
    pub(super) mesh: DeviceMesh,
    /// Flat ranges every tensor-parallel rank holds whole (for the norm).
    pub(super) tp_replicated: Vec<Range<usize>>,
    /// Allowed to keep gradients on the device through the step
    /// ([`Strategy::keep_grads_on_device`]).
    device_grads: bool,
    /// This step's gradients of the optimizers' ranges, reduced on the
    /// device (`on_device`, `scatter`), for `finish`.
    held: Option<Vec<Option<Tensor>>>,
}

/// The pipeline settings of a training config.
pub fn pipeline_config(cfg: &TrainConfig) -> Result<PipelineConfig> {
    let p = &cfg.parallel;
    let schedule = p.pp_schedule.kind(p.pp_virtual_stages);
    let partition = match &p.pp_partition {
        // "time" is replaced by measured costs in `PipeStrategy::new`.
        PpPartition::Balanced | PpPartition::Time => Partition::Balanced,
        PpPartition::Counts(c) => Partition::Sizes(c.clone()),
    };
    Ok(PipelineConfig {
        schedule,
        micro_batches: cfg.train.grad_accum_steps,
        partition,
        bucket_bytes: cfg.bucket_bytes(),
        ..PipelineConfig::default()
    })
}

impl PipeStrategy {
    pub fn new(
        cfg: &TrainConfig,
        engine: &mut Engine,
        mesh: &DeviceMesh,
        zero1: bool,
        make_opt: &MakeOptimizer,
        sample: Option<(Tensor, Tensor)>,
        tp_replicated: Vec<Range<usize>>,
    ) -> Result<PipeStrategy> {
        let mut pcfg = pipeline_config(cfg)?;
        // "time": balance the measured forward + backward time of each block
        // on one micro-batch (world rank 0's measurement is used everywhere).
        // Timing runs the whole model, so it initialises all of it once.
        if let (Some((x, y)), PpPartition::Time) = (&sample, &cfg.parallel.pp_partition) {
            engine.init_params(None);
            let costs = super::partition::measure_block_costs(engine, x, y, 2)?;
            pcfg.partition = Partition::Costs(costs);
        }
        let pipe = Pipeline::new(engine, mesh, pcfg)?;
        // This stage holds, initialises and updates only its own blocks and
        // the tied parameters they read.
        let owned = pipe.owned_ranges().to_vec();
        engine.init_params(Some(&owned));
        engine.hold_only(&owned);
        // Replicas along dp start from dp rank 0's parameters.
        for r in &owned {
            mesh.dp()
                .broadcast(&mut engine.params_flat_mut()[r.clone()], 0)?;
        }
        let (dp, r) = (mesh.dp().size(), mesh.dp().rank());
        let mut opts = Vec::new();
        let mut pieces = Vec::new();
        for range in pipe.owned_ranges().to_vec() {
            let mine = if zero1 {
                let counts: Vec<usize> = (0..dp)
                    .map(|k| crate::engine::shard_range(range.len(), k, dp).len())
                    .collect();
                let s = crate::engine::shard_range(range.len(), r, dp);
                pieces.push((range.clone(), counts));
                range.start + s.start..range.start + s.end
            } else {
                range
            };
            opts.push((mine.clone(), make_opt(engine, mine)?));
        }
        // Disjoint and in flat order (the finish path splits the buffers).
        opts.sort_by_key(|(r, _)| r.start);
        Ok(PipeStrategy {
            pipe,
            opts,
            zero1: zero1.then_some(pieces),
            mesh: mesh.clone(),
            tp_replicated,
            device_grads: false,
            held: None,
        })
    }

    /// Whether this step's gradients stay on the device
    /// ([`Pipeline::forward_backward_on_device`]): the trainer's leave,
    /// every optimizer on the device, and the pipeline's reductions on
    /// that device's memory.
    fn grads_stay_on_device(&mut self, engine: &Engine) -> bool {
        let on_device = self.opts.iter_mut().all(|(_, o)| o.as_device().is_some());
        self.pipe
            .grads_may_stay_on_device(self.device_grads, on_device, engine)
    }

    /// The finish path over the owned ranges, then (ZeRO-1) the dp ranks
    /// put their updated pieces back together.
    fn finish(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        // Global norm: every parameter once — primary ranges over pp (tied
        // copies elsewhere count 0), 1/dp on each dp replica, tp shards add
        // up, tp-replicated ranges once.
        let (tp, dp) = (self.mesh.tp_size, self.mesh.dp().size());
        let w = 1.0 / dp as f64;
        let rep = &self.tp_replicated;
        let ss: f64 = {
            let g = engine.grads_flat();
            self.pipe
                .primary_ranges()
                .iter()
                .map(|r| weighted_sum_squares(&g[r.clone()], r.start, w, rep, tp))
                .sum()
        };
        // An optimizer on the device steps on the parameters' kept copies
        // of its range, where they are current, and they stay the copies
        // for the next forward (as DDP's; `engine::resident`).
        let mut kept = Vec::with_capacity(self.opts.len());
        for (r, opt) in &mut self.opts {
            kept.push(match opt.as_device() {
                Some(_) => engine.device_params(r.clone())?,
                None => None,
            });
        }
        let (p, g) = engine.params_and_grads_mut();
        // The owned ranges are disjoint and in flat order: split the
        // buffers into them.
        let mut updates = Vec::with_capacity(self.opts.len());
        let (mut prest, mut grest, mut at) = (&mut p[..], &g[..], 0);
        for ((r, opt), dev) in self.opts.iter_mut().zip(&kept) {
            let (_, ptail) = std::mem::take(&mut prest).split_at_mut(r.start - at);
            let (pr, ptail) = ptail.split_at_mut(r.len());
            let (gr, gtail) = grest[r.start - at..].split_at(r.len());
            updates.push(Update {
                params: pr,
                grads: gr,
                opt: opt.as_mut(),
                on_device: dev.as_ref(),
            });
            (prest, grest, at) = (ptail, gtail, r.end);
        }
        let out = finish_step(self.mesh.world(), ss, updates, scaler, lr, max_norm, step)?;
        for ((r, _), dev) in self.opts.iter().zip(&kept) {
            if let Some(dev) = dev {
                engine.keep_device_params(r.clone(), dev)?;
            }
        }
        if !out.skipped {
            self.regather(engine)?;
        }
        Ok(out)
    }

    /// ZeRO-1: the dp ranks put their pieces of each owned range back
    /// together (after an update or a load).
    fn regather(&self, engine: &mut Engine) -> Result<()> {
        let Some(pieces) = &self.zero1 else {
            return Ok(());
        };
        let p = engine.params_flat_mut();
        for (range, counts) in pieces {
            let r = self.mesh.dp().rank();
            let s = crate::engine::shard_range(range.len(), r, counts.len());
            let piece = p[range.start + s.start..range.start + s.end].to_vec();
            self.mesh
                .dp()
                .all_gather_v(&piece, counts, &mut p[range.clone()])?;
        }
        Ok(())
    }
}

impl Strategy for PipeStrategy {
    /// The stage's blocks (tied parameters included), not the whole model.
    fn local_params(&self, _engine: &Engine) -> usize {
        self.pipe.owned_ranges().iter().map(|r| r.len()).sum()
    }

    fn name(&self) -> String {
        let dp = if self.zero1.is_some() {
            "ZeRO-1"
        } else {
            "DDP"
        };
        format!("pipeline {} + {dp}", self.pipe.config().schedule)
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        accum: usize,
        loss_scale: f32,
    ) -> Result<f32> {
        if accum != self.pipe.config().micro_batches {
            return Err(Error::Check(format!(
                "pipeline built for {} micro-batches, asked for {accum}",
                self.pipe.config().micro_batches
            )));
        }
        self.pipe.set_loss_scale(loss_scale);
        self.held = None;
        // Already the mean over micro-batches and dp replicas.
        if self.grads_stay_on_device(engine) {
            let (loss, grads) = match self.zero1.is_some() {
                true => self.pipe.forward_backward_scattered(engine, batch)?,
                false => {
                    let (loss, g) = self.pipe.forward_backward_on_device(engine, batch, false)?;
                    (loss, g.into_iter().map(Some).collect())
                }
            };
            self.held = Some(grads);
            return Ok(loss);
        }
        self.pipe.forward_backward(engine, batch)
    }

    fn finish_step(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        let out = match self.held.take() {
            Some(grads) => self.finish_on_device(engine, grads, scaler, lr, max_norm, step),
            None => self.finish(engine, scaler, lr, max_norm, step),
        };
        // A skipped step leaves the hook's state as it was.
        self.pipe.settle_hook(out)
    }

    fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        self.pipe.eval_loss(engine, x, y)
    }

    fn full_params(&self, engine: &Engine) -> Result<Vec<f32>> {
        self.pipe.full_params(engine)
    }

    fn optimizers(&self) -> Vec<&(dyn Optimizer + Send)> {
        self.opts.iter().map(|(_, o)| o.as_ref()).collect()
    }

    fn save_state(&self, engine: &Engine) -> Result<Vec<StateRange>> {
        // With DDP on dp the replicas hold the same ranges and each writes
        // 1/dp; ZeRO-1 pieces are each written by their owner. A tied
        // weight's copies are written once, from its primary stage.
        let (dp, dr) = (self.mesh.dp().size(), self.mesh.dp().rank());
        let p = engine.params_flat();
        let mut out = Vec::new();
        for (r, opt) in &self.opts {
            let mut s = snapshot(opt.as_ref(), &p[r.clone()])?;
            if self.zero1.is_none() {
                // DDP replicas each write 1/dp of the range.
                let k = crate::engine::shard_range(r.len(), dr, dp);
                s = s.slice(&(r.start + k.start..r.start + k.end));
            }
            out.extend(s.keep_only(self.pipe.primary_ranges()));
        }
        Ok(out)
    }

    fn load_state(
        &mut self,
        engine: &mut Engine,
        fill: &mut StateFill,
        optim_step: u64,
    ) -> Result<()> {
        for (r, opt) in &mut self.opts {
            let v = fill_params(fill, r.clone())?;
            engine.params_flat_mut()[r.clone()].copy_from_slice(&v);
            restore_optimizer(opt.as_mut(), fill, optim_step)?;
        }
        self.regather(engine)
    }

    fn set_comm_hook(&mut self, make: &dyn Fn() -> Box<dyn CommHook>) {
        self.pipe.set_comm_hook(make());
    }

    fn set_hook_rollback(&mut self, on: bool) {
        self.pipe.set_hook_rollback(on);
    }

    fn keep_grads_on_device(&mut self, allowed: bool) {
        self.device_grads = allowed;
    }

    fn hook_state(&self) -> Vec<(String, Vec<f32>)> {
        self.pipe.hook_state()
    }

    fn load_hook_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.pipe.load_hook_state(state)
    }

    fn pipeline(&self) -> Option<&Pipeline> {
        Some(&self.pipe)
    }
}
