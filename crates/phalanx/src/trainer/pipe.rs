//! The trainer's pipeline-parallel path: a `Pipeline` over the mesh's pp
//! axis, plain data parallel or ZeRO-1 over its dp axis, one optimizer per
//! range of the flat buffer this rank's stages own.

use crate::config::TrainConfig;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::Optimizer;
use crate::strategy::pipeline::{Partition, Pipeline, PipelineConfig, ScheduleKind};
use phalanx_comm::ReduceOp;
use std::ops::Range;

/// Builds the optimizer for a range of the flat buffer.
pub type MakeOptimizer<'a> =
    dyn Fn(&Engine, Range<usize>) -> Result<Box<dyn Optimizer + Send>> + 'a;

pub struct PipeStrategy {
    pub pipe: Pipeline,
    /// (range of the flat buffer, its optimizer): with ZeRO-1, this dp
    /// rank's piece of each owned range.
    opts: Vec<(Range<usize>, Box<dyn Optimizer + Send>)>,
    /// ZeRO-1: each owned range and the dp ranks' pieces of it.
    zero1: Option<Vec<(Range<usize>, Vec<usize>)>>,
    mesh: DeviceMesh,
}

/// The pipeline settings of a training config.
pub fn pipeline_config(cfg: &TrainConfig) -> Result<PipelineConfig> {
    let p = &cfg.parallel;
    let schedule = match p.pp_schedule.parse::<ScheduleKind>()? {
        ScheduleKind::Interleaved { .. } if !p.pp_schedule.contains(':') => {
            ScheduleKind::Interleaved {
                v: p.pp_virtual_stages,
            }
        }
        s => s,
    };
    let partition = match p.pp_partition.trim() {
        "" | "balanced" => Partition::Balanced,
        // Replaced by measured costs in `PipeStrategy::new`.
        "time" => Partition::Balanced,
        list => Partition::Sizes(
            list.split(',')
                .map(|s| s.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| {
                    Error::Check(format!(
                        "parallel.pp_partition {list:?}: expected \"balanced\", \"time\" or block counts like \"2,3,3\""
                    ))
                })?,
        ),
    };
    Ok(PipelineConfig {
        schedule,
        micro_batches: cfg.train.grad_accum_steps,
        partition,
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
        sample: Option<(candle_core::Tensor, candle_core::Tensor)>,
    ) -> Result<PipeStrategy> {
        // Replicas along dp start from dp rank 0's parameters.
        mesh.dp().broadcast(engine.params_flat_mut(), 0)?;
        let mut pcfg = pipeline_config(cfg)?;
        // "time": balance the measured forward + backward time of each block
        // on one micro-batch (world rank 0's measurement is used everywhere).
        if let (Some((x, y)), "time") = (&sample, cfg.parallel.pp_partition.trim()) {
            let costs = crate::strategy::pipeline::partition::measure_block_costs(engine, x, y, 2)?;
            pcfg.partition = Partition::Costs(costs);
        }
        let pipe = Pipeline::new(engine, mesh, pcfg)?;
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
        Ok(PipeStrategy {
            pipe,
            opts,
            zero1: zero1.then_some(pieces),
            mesh: mesh.clone(),
        })
    }

    /// Clip by the global norm and update the owned ranges; returns the norm.
    pub fn step(
        &mut self,
        engine: &mut Engine,
        lr: f32,
        max_norm: f32,
        replicated: &[Range<usize>],
    ) -> Result<f32> {
        // Global norm: every parameter once (primary ranges over pp; tp
        // shards add up, replicated ones count once).
        let tp = self.mesh.tp_size;
        let g = engine.grads_flat();
        let mut ss = [self
            .pipe
            .primary_ranges()
            .iter()
            .map(|r| super::weighted_sum_squares(&g[r.clone()], r.start, replicated, tp))
            .sum::<f64>()];
        self.mesh.pp().all_reduce(&mut ss, ReduceOp::Sum)?;
        if tp > 1 {
            self.mesh.tp().all_reduce(&mut ss, ReduceOp::Sum)?;
        }
        let (norm, s) = crate::optim::clip::clip_scale(ss[0], max_norm);
        let scale = if max_norm > 0.0 { s } else { 1.0 };
        let (p, g) = engine.params_and_grads_mut();
        for (r, opt) in &mut self.opts {
            opt.step(&mut p[r.clone()], &g[r.clone()], lr, scale);
        }
        // ZeRO-1: the dp ranks put their updated pieces back together.
        if let Some(pieces) = &self.zero1 {
            for (range, counts) in pieces {
                let r = self.mesh.dp().rank();
                let s = crate::engine::shard_range(range.len(), r, counts.len());
                let piece = p[range.start + s.start..range.start + s.end].to_vec();
                self.mesh
                    .dp()
                    .all_gather_v(&piece, counts, &mut p[range.clone()])?;
            }
        }
        Ok(norm)
    }

    /// Bring every block's parameters up to date on this rank (each stage
    /// updates only its own): for evaluation on one rank, or saving.
    pub fn sync_params(&self, engine: &mut Engine) -> Result<()> {
        let full = self.pipe.full_params(engine)?;
        engine.params_flat_mut().copy_from_slice(&full);
        Ok(())
    }
}
