//! Parallel strategies, applied to a plain `Engine` and a device mesh, all
//! behind one trait, [`Strategy`], that the trainer drives:
//!
//! - [`ddp`]: data parallel with bucketed, overlapped gradient all-reduce;
//! - [`zero`]: ZeRO-1/2/3 and FSDP sharding over the same data axis;
//! - [`pipeline`]: pipeline parallelism over the mesh's `pp` axis (GPipe,
//!   1F1B, interleaved 1F1B, ZB-H1), with DDP or ZeRO-1 on dp;
//! - [`diloco`]: LocalSGD, DiLoCo and Streaming DiLoCo: every dp rank
//!   trains on its own and the groups average their pseudo-gradients every
//!   H steps.
//!
//! The seams every strategy shares:
//! - [`reduce`]: a ready bucket of gradients is handed to a communication
//!   hook (all-reduce, reduce-scatter, in fp32 / bf16 / fp16);
//! - [`pool`]: the buffers ZeRO-2/3 reuse from step to step instead of
//!   taking fresh pages every step;
//! - [`crate::optim::step::finish_step`]: unscale → non-finite check agreed
//!   by all ranks → global norm → clip → optimizer step, written once;
//! - state access: the state a rank owns ([`Strategy::save_state`],
//!   [`Strategy::load_state`]), so a checkpoint writes exactly that and a
//!   loader fills it from any layout.
//!
//! Order of application: model axes first (tensor parallel builds the
//! blocks' shards, the pipeline picks this rank's blocks), the data axis
//! last, around them. [`build`] picks the strategy from a config.

pub mod ddp;
pub mod diloco;
mod held;
pub mod hooks;
pub mod pipeline;
pub mod pool;
pub mod powersgd;
pub mod reduce;
pub mod shard;
pub mod state;
pub mod topk;
pub mod zero;

pub use ddp::{Ddp, DdpConfig};
pub use zero::{Zero, ZeroConfig};

use crate::config::{CommHookKind, TrainConfig};
use crate::engine::Engine;
use crate::error::Result;
use crate::mesh::DeviceMesh;
use crate::optim::step::StepOutcome;
use crate::optim::Optimizer;
use crate::precision::LossScaler;
use candle_core::Tensor;
use phalanx_comm::{ProcessGroup, ReduceOp};
use reduce::CommHook;
use std::ops::Range;

/// Micro-batch `a` of the current step: (inputs, targets).
pub type BatchFn<'a> = dyn FnMut(usize) -> Result<(Tensor, Tensor)> + 'a;

/// Builds the optimizer for a range of the flat buffer.
pub type MakeOptimizer<'a> =
    dyn Fn(&Engine, Range<usize>) -> Result<Box<dyn Optimizer + Send>> + 'a;

/// One way of running the data (and pipeline) axes of training.
pub trait Strategy: Send {
    /// What the progress line calls it (e.g. "DDP", "ZeRO-3", "pipeline 1f1b + DDP").
    fn name(&self) -> String;

    /// The parameters this rank computes with (its tensor-parallel slice
    /// of the model; a pipeline stage's blocks), for the progress line.
    fn local_params(&self, engine: &Engine) -> usize {
        engine.num_params()
    }

    /// Zero the gradients, then forward and backward over `accum`
    /// micro-batches `batch(0..accum)`, each micro-batch's loss multiplied
    /// by `loss_scale / accum`; gradients reduced over the data axis.
    /// Returns the step's mean loss over the global batch, on every rank.
    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        accum: usize,
        loss_scale: f32,
    ) -> Result<f32>;

    /// Finish the step through [`crate::optim::step::finish_step`].
    fn finish_step(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome>;

    /// Validation loss of one batch without autograd.
    fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32>;

    /// Evaluation is collective (ZeRO-3 gathers): every data-parallel rank
    /// must run every validation batch.
    fn collective_eval(&self) -> bool {
        false
    }

    /// Make the engine's parameters current everywhere before evaluation
    /// (pipeline stages update only their own blocks). Collective.
    fn prepare_eval(&mut self, _engine: &mut Engine) -> Result<()> {
        Ok(())
    }

    /// Undo what [`prepare_eval`](Strategy::prepare_eval) changed that
    /// training must not see (DiLoCo evaluates the global model, then puts
    /// each group's own parameters back).
    fn after_eval(&mut self, _engine: &mut Engine) -> Result<()> {
        Ok(())
    }

    /// After the last of `done` steps (the run's end, not a stop to resume
    /// later): finish what is still in flight that the final model should
    /// hold (Streaming DiLoCo's last outer steps). Collective.
    fn finish_run(&mut self, _engine: &mut Engine, _done: usize) -> Result<()> {
        Ok(())
    }

    /// The whole model's flat parameters on every rank. Collective.
    fn full_params(&self, engine: &Engine) -> Result<Vec<f32>>;

    /// Make the engine hold the full, current parameters (to save or
    /// generate). Collective.
    fn materialize_params(&mut self, engine: &mut Engine) -> Result<()> {
        let full = self.full_params(engine)?;
        if engine.params_flat().is_empty() {
            engine.restore_params(full);
        } else {
            engine.params_flat_mut().copy_from_slice(&full);
        }
        Ok(())
    }

    /// The optimizers of the owned ranges, in flat order.
    fn optimizers(&self) -> Vec<&(dyn Optimizer + Send)>;

    /// Copy out the state this rank writes to a checkpoint: the ranges it
    /// owns, each value written by exactly one rank of the job (replicas
    /// leave it to their first rank).
    fn save_state(&self, engine: &Engine) -> Result<Vec<state::StateRange>>;

    /// Fill every range this rank owns from a checkpoint (`fill` reads any
    /// flat range, whatever layout saved it), set the optimizers' step
    /// count, and make the parameters consistent again. Collective.
    fn load_state(
        &mut self,
        engine: &mut Engine,
        fill: &mut state::StateFill,
        optim_step: u64,
    ) -> Result<()>;

    /// Replace the gradient communication hook (`register_comm_hook`).
    fn set_comm_hook(&mut self, make: &dyn Fn() -> Box<dyn CommHook>);

    /// Whether a step may be skipped after its gradients were reduced
    /// (fp16's overflow, `train.on_nonfinite = "skip"`): only then does the
    /// reducer keep the hook's state from before each step to restore
    /// ([`reduce::Reducer::set_rollback`]). A strategy without a reducer
    /// ignores it.
    fn set_hook_rollback(&mut self, _on: bool) {}

    /// This rank's communication-hook state ([`CommHook::state`]: residuals,
    /// warm starts, counters), which checkpoints save per rank.
    fn hook_state(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    /// Restore this rank's communication-hook state (saved by the same rank
    /// of the same layout).
    fn load_hook_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        match state.first() {
            None => Ok(()),
            Some((name, _)) => Err(crate::error::Error::Check(format!(
                "{} keeps no communication-hook state, but the checkpoint holds `{name}`",
                self.name()
            ))),
        }
    }

    /// Whether gradients may stay on the device through the optimizer's
    /// step, never reaching the flat gradient buffer: the trainer allows it
    /// when nothing else reads that buffer between the backward and the
    /// step (no sequence-parallel sum over tp, no fault-tolerant average
    /// across replica groups). DDP, ZeRO-1 and ZeRO-2 with the optimizer
    /// on the device act on it (one data-parallel rank, or a plain average
    /// on a backend that reduces the device's memory).
    fn keep_grads_on_device(&mut self, allowed: bool) {
        let _ = allowed;
    }

    /// The pipeline, for pipeline strategies (timelines and traces).
    fn pipeline(&self) -> Option<&pipeline::Pipeline> {
        None
    }

    /// After `forward_backward`: the reduced gradients that `finish_step`
    /// will read on this rank, which an average across replica groups
    /// (fault tolerance) must cover. The engine's flat gradients, or a
    /// ZeRO-2/3 rank's gradient shard.
    fn step_grads<'a>(&'a mut self, engine: &'a mut Engine) -> &'a mut [f32] {
        engine.grads_flat_mut()
    }

    /// DiLoCo, whose outer step a fault-tolerant trainer takes over a
    /// quorum ([`diloco::Diloco::set_external_outer`]).
    fn diloco_mut(&mut self) -> Option<&mut diloco::Diloco> {
        None
    }
}

/// Gradient accumulation: micro-batches `0..accum`, each run by
/// `micro(x, y, loss_scale / accum, last)`; returns the mean of their
/// losses averaged over the data-parallel replicas `dp`.
pub fn accumulate(
    dp: &ProcessGroup,
    batch: &mut BatchFn,
    accum: usize,
    loss_scale: f32,
    micro: &mut dyn FnMut(&Tensor, &Tensor, f32, bool) -> Result<f32>,
) -> Result<f32> {
    let mut sum = 0.0f64;
    for a in 0..accum {
        let (x, y) = batch(a)?;
        sum += micro(&x, &y, loss_scale / accum as f32, a + 1 == accum)? as f64;
    }
    dp_mean(dp, sum / accum as f64)
}

/// The loss averaged over the data-parallel replicas.
pub fn dp_mean(dp: &ProcessGroup, loss: f64) -> Result<f32> {
    let mut l = [loss];
    dp.all_reduce(&mut l, ReduceOp::Avg)?;
    Ok(l[0] as f32)
}

/// ZeRO-3's blocks gathered ahead in the forward: DeepSpeed's
/// `stage3_prefetch_bucket_size` (elements) as whole blocks of the largest
/// block's size (at least one), else `parallel.forward_prefetch`.
fn prefetch_blocks(cfg: &TrainConfig, engine: &Engine) -> usize {
    let elements = cfg.zero_optimization.stage3_prefetch_bucket_size;
    if elements <= 0.0 {
        return cfg.parallel.forward_prefetch;
    }
    let largest = engine
        .layout()
        .blocks()
        .iter()
        .map(|b| b.range.len())
        .max()
        .unwrap_or(1)
        .max(1);
    ((elements / largest as f64) as usize).clamp(1, engine.layout().num_blocks().max(1))
}

/// `offload_param.device = "cpu"` behaves as `none`: on CPU training the
/// ZeRO-3 parameter shard already lives in host memory, so there is nothing
/// to move. Rank 0 says so, once per process.
fn note_cpu_param_offload(mesh: &DeviceMesh) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if mesh.world().rank() == 0 {
        ONCE.call_once(|| {
            println!(
                "note: zero_optimization.offload_param.device = \"cpu\": on CPU training the parameter \
                 shard is already in host memory, so this runs as \"none\" (use \"nvme\" to keep it on disk)"
            )
        });
    }
}

/// The communication hook a config runs: `parallel.comm_hook`, or the int8
/// hook for ZeRO++ qgZ (`zero_optimization.zero_quantized_gradients`) on
/// stage 3's reduce-scatter.
pub fn hook_kind(cfg: &TrainConfig) -> CommHookKind {
    match cfg.parallel.comm_hook {
        CommHookKind::None if cfg.zero_optimization.zero_quantized_gradients => CommHookKind::Int8,
        k => k,
    }
}

/// What [`build`] needs besides the config.
pub struct BuildArgs<'a> {
    pub mesh: &'a DeviceMesh,
    /// Flat ranges every tensor-parallel rank holds whole.
    pub tp_replicated: Vec<Range<usize>>,
    pub make_opt: &'a MakeOptimizer<'a>,
    /// A micro-batch to time the blocks on (`parallel.pp_partition = time`).
    pub sample: Option<(Tensor, Tensor)>,
}

/// The strategy a config asks for: DiLoCo when `[diloco]` is on, pipeline
/// when `parallel.pp > 1`, else DDP (ZeRO stage 0, FSDP NO_SHARD) or
/// ZeRO-1/2/3 (FSDP's names).
pub fn build(cfg: &TrainConfig, engine: &mut Engine, args: BuildArgs) -> Result<Box<dyn Strategy>> {
    let mesh = args.mesh;
    let sharding = cfg.sharding()?;
    let bucket_bytes = cfg.bucket_bytes();
    let hook = reduce::DefaultHook {
        dtype: cfg.train.reduce_dtype,
    };
    if mesh.pp_size == 1 {
        engine.init_params(None);
    }
    let mut s: Box<dyn Strategy> = if cfg.diloco.on() {
        Box::new(diloco::Diloco::new(
            engine,
            mesh,
            diloco::DilocoConfig::from_config(cfg),
            args.make_opt,
            bucket_bytes,
        )?)
    } else if mesh.pp_size > 1 {
        Box::new(pipeline::PipeStrategy::new(
            cfg,
            engine,
            mesh,
            sharding.stage == 1,
            args.make_opt,
            args.sample,
            args.tp_replicated,
        )?)
    } else if sharding.stage == 0 {
        let dcfg = DdpConfig {
            bucket_bytes,
            check_every: cfg.parallel.check_params_every,
        };
        let opt_range = 0..engine.num_params();
        let opt = (args.make_opt)(engine, opt_range)?;
        Box::new(Ddp::new(engine, mesh, dcfg, opt, args.tp_replicated)?)
    } else {
        let zcfg = ZeroConfig {
            stage: sharding.stage,
            bucket_bytes,
            forward_prefetch: prefetch_blocks(cfg, engine),
            backward_prefetch: cfg.parallel.backward_prefetch,
            shard_group_size: sharding.hybrid_group,
            param_offload: cfg.param_offload_dir(),
            param_offload_host: cfg.zero_optimization.offload_param.device
                == crate::config::OffloadDevice::Cpu,
            offload_chunk: cfg.zero_optimization.offload_param.buffer_size,
            quantized_weights: cfg.zero_optimization.zero_quantized_weights,
            hpz_partition_size: cfg.zero_optimization.zero_hpz_partition_size,
            max_reuse_distance: cfg.zero_optimization.stage3_max_reuse_distance as usize,
        };
        if zcfg.param_offload_host && cfg.train.device == crate::config::DeviceKind::Cpu {
            note_cpu_param_offload(mesh);
        }
        Box::new(Zero::new(
            engine,
            mesh,
            zcfg,
            args.make_opt,
            args.tp_replicated,
        )?)
    };
    let p = &cfg.parallel;
    let (ratio, ef) = (p.topk_ratio, p.error_feedback);
    let (warmup, momentum) = (p.topk_warmup_steps, p.topk_momentum as f32);
    match hook_kind(cfg) {
        CommHookKind::None => s.set_comm_hook(&|| Box::new(hook)),
        CommHookKind::Fp16 => s.set_comm_hook(&|| {
            Box::new(reduce::DefaultHook {
                dtype: crate::config::Precision::Fp16,
            })
        }),
        CommHookKind::Bf16 => s.set_comm_hook(&|| {
            Box::new(reduce::DefaultHook {
                dtype: crate::config::Precision::Bf16,
            })
        }),
        CommHookKind::Topk => match cfg.topk_freeze_after_on(mesh.dp().size()) {
            Some(after) => {
                let beta1 = cfg.optim.betas[0] as f32;
                s.set_comm_hook(&|| Box::new(hooks::TopK::adam(ratio, ef, after as usize, beta1)))
            }
            None => s.set_comm_hook(&|| Box::new(hooks::TopK::dgc(ratio, ef, warmup, momentum))),
        },
        CommHookKind::Int8 => s.set_comm_hook(&|| Box::new(hooks::Int8::new(ef))),
        CommHookKind::Powersgd => {
            let (rank, start) = (p.powersgd_rank, p.powersgd_start_iter);
            s.set_comm_hook(&|| Box::new(powersgd::PowerSgd::new(rank, start, ef)))
        }
    }
    s.set_hook_rollback(
        cfg.precision() == crate::config::Precision::Fp16
            || cfg.train.on_nonfinite == crate::config::OnNonfinite::Skip,
    );
    Ok(s)
}
