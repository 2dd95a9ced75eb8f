//! Notes on a built config: settings accepted that do nothing, or less
//! than they say, beside the others (rank 0 prints them when the config
//! is built). What cannot run at all is refused in `validate` instead.

use super::TrainConfig;

impl TrainConfig {
    /// Settings accepted but doing nothing, or less than they say, beside
    /// the others (notes rank 0 prints when the config is built).
    pub fn notes(&self) -> Vec<String> {
        let (t, o, p) = (&self.train, &self.optim, &self.parallel);
        let stage = self.sharding().map_or(0, |s| s.stage);
        let mut n = Vec::new();
        let constant = o.schedule == super::LrScheduleKind::Constant;
        if constant && o.warmup_steps > 0 {
            n.push(format!(
                "optim.schedule = \"constant\" has no warm-up: optim.warmup_steps = {} is not used \
                 (\"warmup_constant\" warms up to optim.lr and stays there)",
                o.warmup_steps
            ));
        } else if o.warmup_steps > 0 && {
            // The warm-ups of `s / W` end one step short of optim.lr at W =
            // train.steps; cosine's linear `(s + 1) / W` and the log one,
            // `ln(s + 1) / ln(W)` (W >= 2), reach it at the run's last step
            // (optim::schedule).
            let reaches_at_last = (o.schedule == super::LrScheduleKind::Cosine
                && o.warmup_type == super::WarmupType::Linear)
                || (o.warmup_type == super::WarmupType::Log && o.warmup_steps >= 2);
            o.warmup_steps > t.steps || (o.warmup_steps == t.steps && !reaches_at_last)
        } {
            n.push(format!(
                "optim.warmup_steps = {} is not below train.steps = {}: the learning rate never \
                 reaches optim.lr",
                o.warmup_steps, t.steps
            ));
        }
        let decays = matches!(
            o.schedule,
            super::LrScheduleKind::Cosine | super::LrScheduleKind::WarmupLinear
        );
        if decays && o.decay_steps != 0 && o.decay_steps <= o.warmup_steps {
            n.push(format!(
                "optim.decay_steps = {} ends within the warm-up's {} steps: there is no decay \
                 phase (the rate goes from optim.lr to optim.min_lr at once)",
                o.decay_steps, o.warmup_steps
            ));
        }
        let ac = &self.activation_checkpointing;
        if (ac.partition_activations || ac.cpu_checkpointing)
            && self.recompute() == super::Recompute::None
        {
            n.push(
                "activation_checkpointing.partition_activations / cpu_checkpointing shape the \
                 checkpoints of recomputed blocks, and train.activation_checkpointing = \"none\" \
                 recomputes none: no effect (set train.activation_checkpointing = \"full\")"
                    .into(),
            );
        }
        if p.sequence_parallel && p.tp == 1 {
            n.push("parallel.sequence_parallel has no effect with parallel.tp = 1".into());
        }
        if stage == 3 && matches!(self.recompute(), super::Recompute::Every(_)) {
            n.push(format!(
                "train.activation_checkpointing = {}: ZeRO-3 frees each block's parameters after \
                 its forward, so every block is recomputed in the backward (or served its \
                 parameters again, where it has a direct backward)",
                self.recompute()
            ));
        }
        if p.check_params_every > 0
            && !self.diloco.on()
            && !self.fault_tolerance.enabled()
            && (stage >= 1 || p.pp > 1)
        {
            let under = if p.pp > 1 {
                "pipeline parallelism".to_string()
            } else {
                format!("ZeRO stage {stage}")
            };
            n.push(format!(
                "parallel.check_params_every compares DDP's (and DiLoCo's) replicas; it has no \
                 effect under {under}"
            ));
        }
        // fp16 on the wire without fp16's loss scale: gradients below fp16's
        // smallest subnormal (6e-8) arrive as zeros, and bf16 would keep
        // fp32's range at the same size.
        // Loss scaling is fp16's: its keys set for bf16 or fp32 compute.
        let fp16_default = super::Fp16Section {
            enabled: self.fp16.enabled,
            ..Default::default()
        };
        if self.precision() != super::Precision::Fp16 && self.fp16 != fp16_default {
            n.push(format!(
                "fp16.* (loss scaling) has no effect in {} training: it scales fp16's gradients",
                self.precision()
            ));
        }
        let fp16_wire =
            t.reduce_dtype == super::Precision::Fp16 || p.comm_hook == super::CommHookKind::Fp16;
        if fp16_wire && self.precision() != super::Precision::Fp16 {
            n.push(format!(
                "gradients are reduced in fp16 ({}) without a loss scale ({} training): values \
                 below 6e-8 arrive as zeros and above 65504 as infinities; bf16 keeps fp32's \
                 range",
                if t.reduce_dtype == super::Precision::Fp16 {
                    "train.reduce_dtype"
                } else {
                    "parallel.comm_hook"
                },
                self.precision()
            ));
        }
        if !decays && o.decay_steps != 0 {
            n.push(format!(
                "optim.decay_steps = {} has no effect: optim.schedule = {:?} does not decay",
                o.decay_steps,
                o.schedule.to_string()
            ));
        }
        let hybrid = p.sharding_strategy == super::ShardingStrategy::HybridShard;
        if p.hybrid_shard_size != 0 && !hybrid {
            n.push(format!(
                "parallel.hybrid_shard_size = {} has no effect without parallel.sharding_strategy = \
                 \"HYBRID_SHARD\"",
                p.hybrid_shard_size
            ));
        }
        let z = &self.zero_optimization;
        let defaults = super::ParallelConfig::default();
        if stage == 3 && (p.bucket_mb != defaults.bucket_mb || z.reduce_bucket_size != 0.0) {
            n.push(
                "parallel.bucket_mb / zero_optimization.reduce_bucket_size have no effect under \
                 ZeRO-3, which reduces each block's gradients as one bucket"
                    .into(),
            );
        }
        let prefetch = p.forward_prefetch != defaults.forward_prefetch
            || p.backward_prefetch != defaults.backward_prefetch
            || z.stage3_prefetch_bucket_size != 0.0
            || z.stage3_max_reuse_distance != 0.0;
        if stage != 3 && prefetch {
            n.push(format!(
                "parallel.forward_prefetch / backward_prefetch and zero_optimization.stage3_* \
                 gather ZeRO-3's blocks ahead; no effect under {}",
                if stage == 0 {
                    "DDP".to_string()
                } else {
                    format!("ZeRO stage {stage}")
                }
            ));
        }
        let od = super::OptimConfig::default();
        let sgd = o.name == super::OptimName::Sgd;
        if sgd && (o.betas != od.betas || o.eps != od.eps) {
            n.push("optim.betas / optim.eps have no effect with optim.name = \"sgd\"".into());
        }
        if !sgd && o.momentum != od.momentum {
            n.push(format!(
                "optim.momentum has no effect with optim.name = \"{}\" (its betas are)",
                o.name
            ));
        }
        let c = &self.checkpoint;
        if c.interval == 0 && (c.async_save || c.keep != super::CheckpointConfig::default().keep) {
            n.push(
                "checkpoint.keep / checkpoint.async have no effect with checkpoint.interval = 0 \
                 (no checkpoint is saved)"
                    .into(),
            );
        }
        // (An accumulation still to derive for the world size has no
        // final count.)
        let accum_final = self.derive != super::batch::Derive::Accum;
        if p.pp > 1 && t.grad_accum_steps < p.pp && accum_final {
            n.push(format!(
                "parallel.pp = {} runs train.grad_accum_steps = {} micro-batch(es) per step: each \
                 stage idles most of the step (the bubble); a few times pp micro-batches keep \
                 the stages busy",
                p.pp, t.grad_accum_steps
            ));
        }
        let pipeline_keys = p.pp_schedule != defaults.pp_schedule
            || p.pp_virtual_stages != defaults.pp_virtual_stages
            || p.pp_partition != defaults.pp_partition;
        if p.pp > 1 && p.pp_virtual_stages != defaults.pp_virtual_stages {
            match p.pp_schedule {
                super::PpSchedule::Interleaved => {}
                // interleaved:V with V = pp_virtual_stages: consistent.
                super::PpSchedule::Kind(super::ScheduleKind::Interleaved { v })
                    if v == p.pp_virtual_stages => {}
                super::PpSchedule::Kind(super::ScheduleKind::Interleaved { v }) => n.push(format!(
                    "parallel.pp_virtual_stages = {} has no effect: parallel.pp_schedule = \
                     interleaved:{v} gives its own chunk count",
                    p.pp_virtual_stages
                )),
                s => n.push(format!(
                    "parallel.pp_virtual_stages = {} has no effect with parallel.pp_schedule = \
                     {s} (it is the chunk count of `interleaved`)",
                    p.pp_virtual_stages
                )),
            }
        }
        let v = match p.pp_schedule.kind(p.pp_virtual_stages) {
            super::ScheduleKind::Interleaved { v } => Some(v),
            _ => None,
        };
        if let (true, Some(v), true) = (p.pp > 1, v, accum_final) {
            let m = t.grad_accum_steps;
            if m % p.pp != 0 {
                n.push(format!(
                    "parallel.pp_schedule = interleaved:{v} with train.grad_accum_steps = {m} \
                     micro-batches, not a multiple of parallel.pp = {}: its warm-up grows, so its \
                     bubble can be no smaller than 1F1B's and it holds more activations \
                     (Megatron-LM requires a multiple); `phalanx schedule --schedule \
                     interleaved:{v} --pp {} --micro-batches {m}` shows it",
                    p.pp, p.pp
                ));
            }
        }
        if p.pp == 1 && pipeline_keys {
            n.push(
                "parallel.pp_schedule / pp_virtual_stages / pp_partition have no effect with \
                 parallel.pp = 1"
                    .into(),
            );
        }
        n
    }
}
