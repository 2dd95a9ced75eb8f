//! Checks of a built config that do not depend on the world size.

use super::{ConfigError, OffloadDevice, Precision, Result, Sharding, TrainConfig};

impl TrainConfig {
    /// Checks that do not depend on the world size.
    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(ConfigError(s));
        // A device this build cannot run on is refused before anything starts
        // (the device itself is opened by each rank).
        if self.activation_checkpointing.cpu_checkpointing
            && self.train.device != super::DeviceKind::Cpu
        {
            return bad(format!(
                "activation_checkpointing.cpu_checkpointing (checkpoints kept in host memory) is not \
                 built for train.device = {:?}; set it to false",
                self.train.device
            ));
        }
        self.train.device.check_built()?;
        if let super::ScheduleKind::Interleaved { v } = self
            .parallel
            .pp_schedule
            .kind(self.parallel.pp_virtual_stages)
        {
            if v < 2 && self.parallel.pp > 1 {
                return bad(format!(
                    "parallel.pp_schedule = interleaved needs at least 2 chunks per rank \
                     (parallel.pp_virtual_stages = {v}); use 1f1b for one",
                ));
            }
        }
        if self.train.micro_batch_size == 0 || self.train.grad_accum_steps == 0 {
            return bad(
                "train.micro_batch_size and train.grad_accum_steps must be at least 1".into(),
            );
        }
        if self.checkpoint.interval > 0 && self.checkpoint.keep == 0 {
            return bad("checkpoint.keep must be at least 1".into());
        }
        if self.checkpoint.interval > 0 && self.checkpoint.dir.trim().is_empty() {
            return bad("checkpoint.dir must name a directory".into());
        }
        if !(0.0..1.0).contains(&self.data.val_fraction) {
            return bad(format!(
                "data.val_fraction must be in [0, 1), not {}",
                self.data.val_fraction
            ));
        }
        self.check_numbers()?;
        self.data.validate()?;
        self.fault_tolerance.validate()?;
        let p = &self.parallel;
        if !(p.topk_ratio.is_finite() && p.topk_ratio > 0.0 && p.topk_ratio <= 1.0) {
            return bad(format!(
                "parallel.topk_ratio must be in (0, 1], not {}",
                p.topk_ratio
            ));
        }
        if p.comm_hook != super::CommHookKind::None && self.train.reduce_dtype != Precision::Fp32 {
            return bad(format!(
                "parallel.comm_hook = {} and train.reduce_dtype = {} both choose how gradients travel; set one",
                p.comm_hook, self.train.reduce_dtype
            ));
        }
        if self.zero_optimization.zero_quantized_gradients
            && self.train.reduce_dtype != Precision::Fp32
        {
            return bad(format!(
                "zero_optimization.zero_quantized_gradients (int8 gradients) and train.reduce_dtype = {} \
                 both choose how gradients travel; set one",
                self.train.reduce_dtype
            ));
        }
        self.check_compression()?;
        self.check_diloco()?;
        if self.monitor.straggler_steps == 0 {
            return bad("monitor.straggler_steps must be at least 1".into());
        }
        if self.optim.warmup_min_lr < 0.0 || self.optim.warmup_min_lr > self.optim.lr {
            return bad(format!(
                "optim.warmup_min_lr ({}) must be in [0, optim.lr = {}]",
                self.optim.warmup_min_lr, self.optim.lr
            ));
        }
        if self.optim.lr <= 0.0 || self.optim.grad_clip < 0.0 {
            return bad("optim.lr must be positive and optim.grad_clip non-negative".into());
        }
        if self.parallel.bucket_mb <= 0.0 {
            return bad("parallel.bucket_mb must be positive".into());
        }
        self.sharding()?;
        if self.offload_dir().is_some() && !self.optim.name.is_adam() {
            return bad("optimizer offload is built for optim.name = adamw (or adam)".into());
        }
        let op = &self.zero_optimization.offload_param;
        if op.buffer_size == 0 {
            return bad("zero_optimization.offload_param.buffer_size must be at least 1".into());
        }
        if op.device != OffloadDevice::None && self.sharding()?.stage != 3 {
            return bad(format!(
                "zero_optimization.offload_param.device = {} needs ZeRO stage 3 (zero_optimization.stage = 3), \
                 the stage that partitions parameters; this config is stage {}",
                op.device,
                self.sharding()?.stage
            ));
        }
        if self.zero_optimization.reduce_bucket_size < 0.0
            || self.zero_optimization.stage3_prefetch_bucket_size < 0.0
        {
            return bad("zero_optimization bucket sizes must not be negative".into());
        }
        let d = self.zero_optimization.stage3_max_reuse_distance;
        if d.is_nan() || d < 0.0 {
            return bad(format!(
                "zero_optimization.stage3_max_reuse_distance must be a non-negative number, not {d}"
            ));
        }
        self.fp16.check().map_err(ConfigError)?;
        self.checked_precision()?;
        if self.parallel.tp == 0 {
            return bad("parallel.tp must be at least 1".into());
        }
        if self.parallel.sequence_parallel && self.parallel.tp > 1 && self.sharding()?.stage >= 2 {
            return bad(
                "sequence parallel composes with DDP and ZeRO-1 in this build (zero stage <= 1)"
                    .into(),
            );
        }
        if self.parallel.pp == 0 {
            return bad("parallel.pp must be at least 1".into());
        }
        if self.parallel.pp > 1 && self.sharding()?.stage >= 2 {
            return bad(
                "pipeline parallel composes with DDP and ZeRO-1 on the dp axis (zero stage <= 1)"
                    .into(),
            );
        }
        Ok(())
    }

    /// Which compression goes with which strategy (the README's table).
    fn check_compression(&self) -> Result<()> {
        use super::CommHookKind as H;
        let p = &self.parallel;
        let z = &self.zero_optimization;
        let stage = self.sharding()?.stage;
        let bad = |s: String| Err(ConfigError(s));
        if p.powersgd_rank == 0 {
            return bad("parallel.powersgd_rank must be at least 1".into());
        }
        if p.comm_hook == H::Powersgd && p.pp > 1 {
            return bad(format!(
                "parallel.comm_hook = powersgd needs to see each bucket's matrices, which the pipeline's \
                 dp reduction (parallel.pp = {}) does not describe; use fp16, bf16, int8 or topk there",
                p.pp
            ));
        }
        if p.comm_hook == H::Powersgd && stage >= 2 && self.train.grad_accum_steps > 1 {
            // ZeRO-2/3 reduce every micro-step: PowerSGD's warm start, its
            // residual and its count would advance once per micro-step (A
            // power iterations a step, compression from start_iter / A).
            return bad(format!(
                "parallel.comm_hook = powersgd counts one power iteration per reduction, which ZeRO \
                 stage {stage} runs every micro-step (train.grad_accum_steps = {}); use stage 1, \
                 train.grad_accum_steps = 1, or the int8 or fp16 hook",
                self.train.grad_accum_steps
            ));
        }
        self.check_dgc(stage)?;
        let zpp = z.zero_quantized_weights
            || z.zero_quantized_gradients
            || z.zero_hpz_partition_size != 1;
        if zpp && stage != 3 {
            return bad(format!(
                "ZeRO++ (zero_optimization.zero_quantized_weights / zero_quantized_gradients / \
                 zero_hpz_partition_size) is built on ZeRO stage 3; zero_optimization.stage is {stage}"
            ));
        }
        if z.zero_quantized_gradients && !matches!(p.comm_hook, H::None | H::Int8) {
            return bad(format!(
                "zero_optimization.zero_quantized_gradients = true is the int8 hook; \
                 parallel.comm_hook = {} asks for another",
                p.comm_hook
            ));
        }
        if z.zero_hpz_partition_size == 0 {
            return bad(
                "zero_optimization.zero_hpz_partition_size must be at least 1 (1: off)".into(),
            );
        }
        if z.zero_hpz_partition_size > 1 && self.sharding()?.hybrid_group > 0 {
            return bad(
                "zero_optimization.zero_hpz_partition_size and parallel.sharding_strategy = HYBRID_SHARD \
                 both choose groups inside the data-parallel ranks; set one"
                    .into(),
            );
        }
        Ok(())
    }

    /// Top-k's Deep Gradient Compression keys. Momentum correction moves
    /// the momentum into the hook, so it must not be applied twice, and it
    /// counts one velocity update per reduction, which ZeRO-2/3 run every
    /// micro-step.
    fn check_dgc(&self, stage: u8) -> Result<()> {
        let p = &self.parallel;
        let m = p.topk_momentum;
        if !(m.is_finite() && (0.0..1.0).contains(&m)) {
            return Err(ConfigError(format!(
                "parallel.topk_momentum must be in [0, 1) (0: no momentum correction), not {m}"
            )));
        }
        if self.topk_freeze_after().is_some() {
            if p.topk_warmup_steps == 0 {
                return Err(ConfigError(
                    "parallel.topk_warmup_steps = 0: with AdamW, top-k freezes the optimizer's \
                     variance after its warm-up (parallel.topk_freeze_variance = true), which must \
                     first measure it; give some steps (the default is 60), or set \
                     parallel.topk_freeze_variance = false"
                        .into(),
                ));
            }
            if self.offload_dir().is_some() {
                return Err(ConfigError(
                    "zero_optimization.offload_optimizer keeps AdamW's state on disk, where \
                     top-k's frozen variance (parallel.topk_freeze_variance = true) is not built; \
                     set parallel.topk_freeze_variance = false, or do not offload"
                        .into(),
                ));
            }
            if m != 0.0 {
                return Err(ConfigError(format!(
                    "parallel.topk_momentum = {m}: with AdamW, top-k's hook already carries the \
                     momentum at optim.betas[0] (parallel.topk_freeze_variance = true); set \
                     parallel.topk_momentum = 0, or parallel.topk_freeze_variance = false"
                )));
            }
            if stage >= 2 && self.train.grad_accum_steps > 1 {
                return Err(ConfigError(format!(
                    "parallel.topk_freeze_variance: the top-k hook's momentum updates once per \
                     reduction, and ZeRO stage {stage} reduces every micro-step \
                     (train.grad_accum_steps = {}); use stage 0 or 1, train.grad_accum_steps = 1, \
                     or parallel.topk_freeze_variance = false",
                    self.train.grad_accum_steps
                )));
            }
            return Ok(());
        }
        if p.comm_hook != super::CommHookKind::Topk || m == 0.0 {
            return Ok(());
        }
        let o = &self.optim;
        if o.name == super::OptimName::Sgd && o.momentum != 0.0 {
            return Err(ConfigError(format!(
                "parallel.topk_momentum = {m} is DGC's momentum correction: the top-k hook carries the \
                 momentum, so optim.momentum = {} would apply it a second time; set optim.momentum = 0 \
                 (and parallel.topk_momentum to the momentum you want), or parallel.topk_momentum = 0",
                o.momentum
            )));
        }
        if stage >= 2 && self.train.grad_accum_steps > 1 {
            return Err(ConfigError(format!(
                "parallel.topk_momentum = {m} updates its velocity once per reduction, and ZeRO stage \
                 {stage} reduces every micro-step (train.grad_accum_steps = {}); use stage 0 or 1, \
                 train.grad_accum_steps = 1, or parallel.topk_momentum = 0",
                self.train.grad_accum_steps
            )));
        }
        Ok(())
    }

    /// DiLoCo's settings, and what it composes with in this build: every
    /// data-parallel rank is a group of its own, whose inner step is local.
    fn check_diloco(&self) -> Result<()> {
        let d = &self.diloco;
        if !d.on() {
            return Ok(());
        }
        let bad = |s: String| Err(ConfigError(s));
        let h = d.inner_steps;
        if self.fault_tolerance.enabled() && (d.fragments > 1 || d.quantize) {
            return bad(format!(
                "diloco.fragments = {} / diloco.quantize = {} with fault_tolerance.lighthouse: over a \
                 fault-tolerant quorum this build takes DiLoCo's outer step whole and in f32 (Streaming \
                 DiLoCo's fragments and int8 pseudo-gradients run in a plain job); use diloco.fragments = 1 \
                 and diloco.quantize = false",
                d.fragments, d.quantize
            ));
        }
        if h == 0 {
            return bad(
                "diloco.enabled = true needs diloco.inner_steps (H, the inner steps between outer steps) of at least 1"
                    .into(),
            );
        }
        if !(d.outer_lr.is_finite() && d.outer_lr > 0.0) {
            return bad(format!(
                "diloco.outer_lr must be a positive number, not {}",
                d.outer_lr
            ));
        }
        if !(d.outer_momentum.is_finite() && (0.0..1.0).contains(&d.outer_momentum)) {
            return bad(format!(
                "diloco.outer_momentum must be in [0, 1), not {}",
                d.outer_momentum
            ));
        }
        if d.fragments == 0 || d.fragments > h {
            return bad(format!(
                "diloco.fragments = {} must be between 1 and diloco.inner_steps = {h} \
                 (fragment f syncs H / fragments steps after fragment f - 1)",
                d.fragments
            ));
        }
        if d.fragments == 1 && d.overlap_steps > 1 {
            return bad(format!(
                "diloco.overlap_steps = {} applies to Streaming DiLoCo (diloco.fragments > 1); \
                 with one fragment the outer step is taken in place",
                d.overlap_steps
            ));
        }
        if d.fragments > 1 && d.overlap_steps >= h {
            return bad(format!(
                "diloco.overlap_steps = {} must be below diloco.inner_steps = {h}: a fragment's outer \
                 step must land before the fragment syncs again",
                d.overlap_steps
            ));
        }
        let stage = self.sharding()?.stage;
        if stage != 0 {
            return bad(format!(
                "DiLoCo (diloco.inner_steps = {h}) runs every data-parallel rank as a group of its own; \
                 ZeRO stage {stage} (zero_optimization.stage / parallel.sharding_strategy) shards over those \
                 ranks, which do not share a model between outer steps: use stage 0 (NO_SHARD)"
            ));
        }
        let p = &self.parallel;
        if p.tp > 1 || p.pp > 1 {
            return bad(format!(
                "DiLoCo (diloco.inner_steps = {h}) is built for data parallelism alone in this build; \
                 parallel.tp = {} and parallel.pp = {} must be 1",
                p.tp, p.pp
            ));
        }
        if p.comm_hook != super::CommHookKind::None || self.train.reduce_dtype != Precision::Fp32 {
            // Name the key that was set (both together are refused above).
            let set = if p.comm_hook != super::CommHookKind::None {
                format!("parallel.comm_hook = {} chooses", p.comm_hook)
            } else {
                format!("train.reduce_dtype = {} chooses", self.train.reduce_dtype)
            };
            return bad(format!(
                "{set} how gradients travel, but DiLoCo's inner steps (diloco.inner_steps = {h}) \
                 send none; diloco.quantize = true sends the pseudo-gradients in int8"
            ));
        }
        if p.check_params_every > 0 && d.fragments > 1 {
            return bad(format!(
                "parallel.check_params_every = {}: under Streaming DiLoCo (diloco.fragments = {}) the \
                 groups never hold the whole model in common; use it with one fragment, where it checks \
                 after every outer step",
                p.check_params_every, d.fragments
            ));
        }
        Ok(())
    }

    /// The sharding the config asks for, from `parallel.sharding_strategy`
    /// (FSDP) or `zero_optimization.stage` (DeepSpeed); both given and
    /// different is an error.
    pub fn sharding(&self) -> Result<Sharding> {
        let ds = self.zero_optimization.stage;
        if ds > 3 {
            return Err(ConfigError(format!(
                "zero_optimization.stage must be 0 to 3, not {ds}"
            )));
        }
        let Some((stage, hybrid)) = self.parallel.sharding_strategy.stage() else {
            return Ok(Sharding {
                stage: ds,
                hybrid_group: 0,
            });
        };
        if ds != 0 && ds != stage {
            return Err(ConfigError(format!(
                "parallel.sharding_strategy = {} means ZeRO stage {stage}, but zero_optimization.stage = {ds}",
                self.parallel.sharding_strategy
            )));
        }
        let group = if hybrid {
            match self.parallel.hybrid_shard_size {
                0 => {
                    let j = phalanx_comm::JobSizes::from_env()
                        .map_err(|e| ConfigError(e.to_string()))?;
                    node_shard_group(&j, self.parallel.tp, self.parallel.pp)
                }
                g => g,
            }
        } else {
            0
        };
        Ok(Sharding {
            stage,
            hybrid_group: group,
        })
    }

    pub(crate) fn checked_precision(&self) -> Result<Precision> {
        let (f16, b16) = (self.fp16.enabled, self.bf16.enabled);
        if f16 && b16 {
            return Err(ConfigError(
                "fp16.enabled and bf16.enabled are both true; enable one".into(),
            ));
        }
        let section = if f16 {
            Some((Precision::Fp16, "fp16.enabled"))
        } else if b16 {
            Some((Precision::Bf16, "bf16.enabled"))
        } else {
            None
        };
        match (self.train.precision, section) {
            (p, None) => Ok(p),
            (Precision::Fp32, Some((s, _))) => Ok(s),
            (p, Some((s, _))) if p == s => Ok(p),
            (p, Some((_, key))) => Err(ConfigError(format!(
                "train.precision = {p} disagrees with {key} = true"
            ))),
        }
    }

    /// Every number a run depends on is finite and in its range, checked
    /// in one place (NaN compares false with everything, so each check is
    /// written to fail on NaN).
    fn check_numbers(&self) -> Result<()> {
        let o = &self.optim;
        let positive = [
            ("optim.lr", o.lr),
            ("optim.eps", o.eps),
            ("parallel.bucket_mb", self.parallel.bucket_mb),
        ];
        for (k, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError(format!(
                    "{k} must be a positive number, not {v}"
                )));
            }
        }
        // At or below 1 every rank slower than its peers' median (half of
        // them) would be a straggler.
        let f = self.monitor.straggler_factor;
        if !(f.is_finite() && f > 1.0) {
            return Err(ConfigError(format!(
                "monitor.straggler_factor must be a number above 1 (how many times its peers' \
                 median a rank's compute time must be), not {f}"
            )));
        }
        let non_negative = [
            ("optim.min_lr", o.min_lr),
            ("optim.weight_decay", o.weight_decay),
            ("optim.grad_clip", o.grad_clip),
            ("optim.momentum", o.momentum),
            ("optim.warmup_min_lr", o.warmup_min_lr),
        ];
        for (k, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError(format!(
                    "{k} must be a non-negative number, not {v}"
                )));
            }
        }
        // The optimizers compute in f32: a beta that rounds to 1 there
        // (0.99999999) divides by a zero bias correction, an eps that
        // rounds to 0 (1e-50) divides 0 by 0, and every parameter is NaN
        // after the first step.
        for (i, b) in o.betas.iter().enumerate() {
            if !(b.is_finite() && (0.0..1.0).contains(b)) {
                return Err(ConfigError(format!(
                    "optim.betas[{i}] must be in [0, 1), not {b}"
                )));
            }
            if *b as f32 >= 1.0 {
                return Err(ConfigError(format!(
                    "optim.betas[{i}] = {b} is 1 in f32, the precision the optimizer computes in: \
                 use at most 0.9999999"
                )));
            }
        }
        // ... and a value past f32's range is infinite there: the first
        // step's update is inf or NaN.
        for (k, v) in [
            ("optim.lr", o.lr),
            ("optim.min_lr", o.min_lr),
            ("optim.warmup_min_lr", o.warmup_min_lr),
            ("optim.weight_decay", o.weight_decay),
            ("optim.momentum", o.momentum),
            ("optim.eps", o.eps),
        ] {
            if (v as f32).is_infinite() {
                return Err(ConfigError(format!(
                    "{k} = {v:e} is infinite in f32, the precision the optimizer computes in: \
                     use at most 3.4e38"
                )));
            }
        }
        if o.eps as f32 <= 0.0 || o.lr as f32 <= 0.0 {
            let (k, v) = if o.eps as f32 <= 0.0 {
                ("optim.eps", o.eps)
            } else {
                ("optim.lr", o.lr)
            };
            return Err(ConfigError(format!(
                "{k} = {v} is 0 in f32, the precision the optimizer computes in: use at least 1e-38"
            )));
        }
        let decays_to_min = matches!(
            o.schedule,
            super::LrScheduleKind::Cosine | super::LrScheduleKind::WarmupLinear
        );
        if decays_to_min && o.min_lr > o.lr {
            return Err(ConfigError(format!(
                "optim.min_lr ({}) must not exceed optim.lr ({})",
                o.min_lr, o.lr
            )));
        }
        if self.train.steps == 0 {
            return Err(ConfigError("train.steps must be at least 1".into()));
        }
        if self.train.eval_interval > 0 && self.train.eval_batches == 0 {
            return Err(ConfigError(format!(
                "train.eval_batches = 0 evaluates nothing, while train.eval_interval = {} asks \
                 for validation every {} steps; set train.eval_interval = 0 to turn it off",
                self.train.eval_interval, self.train.eval_interval
            )));
        }
        self.check_counts()
    }

    /// Counts from the user are bounded, so that the products the trainer
    /// forms (global batch = micro x dp x accum, samples x sequence length,
    /// steps x batch) cannot wrap: every refusal names the key.
    fn check_counts(&self) -> Result<()> {
        const MAX: usize = 1 << 40;
        let (t, o, p) = (&self.train, &self.optim, &self.parallel);
        let counts = [
            ("train.steps", t.steps),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.grad_accum_steps", t.grad_accum_steps),
            ("train.global_batch_size", t.global_batch_size),
            ("train.eval_interval", t.eval_interval),
            ("train.eval_batches", t.eval_batches),
            ("optim.warmup_steps", o.warmup_steps),
            ("optim.decay_steps", o.decay_steps),
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("checkpoint.interval", self.checkpoint.interval),
            ("checkpoint.keep", self.checkpoint.keep),
            ("diloco.inner_steps", self.diloco.inner_steps),
            ("fault_tolerance.replicas", self.fault_tolerance.replicas),
        ];
        for (k, v) in counts {
            if v > MAX {
                return Err(ConfigError(format!(
                    "{k} = {v} is larger than any run needs (at most 2^40)"
                )));
            }
        }
        // Counts that size allocations or threads up front: the bound is
        // what a machine could hold, so that a typo is an error naming the
        // key, not an allocation failure or a failed thread spawn.
        let v = match p.pp_schedule.kind(p.pp_virtual_stages) {
            super::ScheduleKind::Interleaved { v } => v,
            _ => 1,
        };
        let chunks = p.pp.saturating_mul(v);
        let sized = [
            ("data.prefetch", self.data.prefetch, 1 << 16),
            ("data.loader_threads", self.data.loader_threads, 1 << 12),
            ("parallel.pp_virtual_stages", p.pp_virtual_stages, 1 << 14),
            (
                "parallel.pp x the interleaved schedule's chunks per rank",
                chunks,
                1 << 14,
            ),
            ("parallel.forward_prefetch", p.forward_prefetch, 1 << 20),
            ("parallel.backward_prefetch", p.backward_prefetch, 1 << 20),
        ];
        for (k, v, max) in sized {
            if v > max {
                return Err(ConfigError(format!("{k} = {v} is more than {max}")));
            }
        }
        // Samples per rank per step: the factor of the global batch the
        // config fixes (dp comes from the world, at most 2^20 ranks).
        if t.micro_batch_size
            .checked_mul(t.grad_accum_steps)
            .is_none_or(|n| n > MAX)
        {
            return Err(ConfigError(format!(
                "train.micro_batch_size {} x train.grad_accum_steps {} is more samples per rank \
                 and step than any run needs (at most 2^40)",
                t.micro_batch_size, t.grad_accum_steps
            )));
        }
        Ok(())
    }
}

/// HYBRID_SHARD's default group: the data-parallel ranks of a node, from
/// whichever launcher started this one (torchrun, mpirun, srun): the
/// node's ranks over tp (tp is innermost on the mesh, pp outermost), at
/// most dp (a node that holds several pipeline stages); 1 where the
/// launcher did not say (one rank per pod).
pub(crate) fn node_shard_group(j: &phalanx_comm::JobSizes, tp: usize, pp: usize) -> usize {
    let tp = tp.max(1);
    let dp = (j.world_size / (tp * pp.max(1))).max(1);
    if j.local_known {
        (j.local_world_size / tp).clamp(1, dp)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::node_shard_group;

    #[test]
    fn the_default_hybrid_group_is_the_data_parallel_ranks_of_a_node() {
        let job = |world, local, local_known| phalanx_comm::JobSizes {
            rank: 0,
            world_size: world,
            local_rank: 0,
            local_world_size: local,
            source: "torchrun",
            local_known,
        };
        // Two nodes of 8 at tp 2: dp 8, four dp ranks on a node.
        assert_eq!(node_shard_group(&job(16, 8, true), 2, 1), 4);
        // One node of 8 at tp 2: dp 4, all on the node.
        assert_eq!(node_shard_group(&job(8, 8, true), 2, 1), 4);
        // tp 1: the node's ranks.
        assert_eq!(node_shard_group(&job(16, 8, true), 1, 1), 8);
        // A node of 8 holding two stages of pp 2 at dp 4: at most dp.
        assert_eq!(node_shard_group(&job(8, 8, true), 1, 2), 4);
        // tp across nodes: 1.
        assert_eq!(node_shard_group(&job(16, 4, true), 8, 1), 1);
        // The launcher did not say (one rank per pod).
        assert_eq!(node_shard_group(&job(16, 16, false), 1, 1), 1);
    }
}
