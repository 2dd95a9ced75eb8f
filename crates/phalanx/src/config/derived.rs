//! Values derived from a built [`TrainConfig`]: the device, the batch
//! arithmetic, precision and recompute policies, offload directories, the
//! DeepSpeed "auto" summary and the TOML the config prints as.

use super::{
    batch, AutoValue, CommHookKind, ConfigError, ModelFacts, OffloadDevice, Precision, Recompute,
    Result, TrainConfig,
};
use std::path::PathBuf;

impl TrainConfig {
    /// The device this rank computes on (`train.device`): the engine, the
    /// strategies and the optimizers take it from here.
    pub fn device(&self) -> Result<candle_core::Device> {
        self.train.device.device()
    }

    /// Top-k under Adam with a frozen variance (`parallel.topk_freeze_variance`):
    /// the optimizer step after which the variance freezes, or `None`.
    pub fn topk_freeze_after(&self) -> Option<u64> {
        let p = &self.parallel;
        (p.comm_hook == CommHookKind::Topk && p.topk_freeze_variance && self.optim.name.is_adam())
            .then_some(p.topk_warmup_steps.max(1) as u64)
    }

    /// [`TrainConfig::topk_freeze_after`] on a data-parallel group of `dp`
    /// ranks: with one rank nothing is reduced, so the hook never runs
    /// (the gradient is its own average) and carries no momentum, and a
    /// frozen variance would take the raw gradient for it: no freeze.
    pub fn topk_freeze_after_on(&self, dp: usize) -> Option<u64> {
        self.topk_freeze_after().filter(|_| dp > 1)
    }

    /// What the model's schema said of its section.
    pub fn model_facts(&self) -> ModelFacts {
        self.model_facts
    }

    /// Tokens per sample the model takes, where its section says.
    pub fn seq_len(&self) -> Option<usize> {
        self.model_facts.seq_len
    }

    /// The compute precision: `train.precision` when not fp32, else fp16 when
    /// `fp16.enabled`, bf16 when `bf16.enabled`, else fp32. (Conflicts are
    /// rejected by `validate`.)
    pub fn precision(&self) -> Precision {
        self.checked_precision().unwrap_or(Precision::Fp16)
    }

    /// The activation checkpointing policy (`train.activation_checkpointing`).
    pub fn recompute(&self) -> Recompute {
        self.train.activation_checkpointing
    }

    /// Gradient bucket size in bytes: `zero_optimization.reduce_bucket_size`
    /// (DeepSpeed counts elements: bytes = elements x 4) when nonzero, else
    /// `parallel.bucket_mb` MiB.
    pub fn bucket_bytes(&self) -> usize {
        let z = self.zero_optimization.reduce_bucket_size;
        if z > 0.0 {
            (z * 4.0) as usize
        } else {
            (self.parallel.bucket_mb * (1 << 20) as f64) as usize
        }
    }

    /// Where ZeRO-3 parameters are offloaded to (nvme), if anywhere.
    pub fn param_offload_dir(&self) -> Option<PathBuf> {
        let o = &self.zero_optimization.offload_param;
        (o.device == OffloadDevice::Nvme).then(|| o.nvme_path.clone().into())
    }

    /// Whether the optimizer's state and step go on `device`
    /// ([`crate::optim::DeviceOptimizer`]): off the CPU kernels (CUDA, or
    /// the CPU's device-generic path) unless
    /// `zero_optimization.offload_optimizer.device` offloads it (`cpu`:
    /// host memory and the host's loop; `nvme`: files).
    pub fn optimizer_on_device(&self, device: &candle_core::Device) -> bool {
        self.zero_optimization.offload_optimizer.device == OffloadDevice::None
            && !crate::ops::host_kernels(device)
    }

    /// Where optimizer state is offloaded to (nvme), if anywhere.
    pub fn offload_dir(&self) -> Option<PathBuf> {
        let o = &self.zero_optimization.offload_optimizer;
        (o.device == OffloadDevice::Nvme).then(|| o.nvme_path.clone().into())
    }

    /// The data-parallel size for a world size, with the batch checks that
    /// depend on it: with `train.global_batch_size` set, the identity
    /// global = micro x dp x accum, or that the missing one can be derived
    /// (see [`TrainConfig::batch_for_dp`]).
    pub fn dp_for_world(&self, world: usize) -> Result<usize> {
        let per = self.parallel.tp * self.parallel.pp;
        if !world.is_multiple_of(per) {
            return Err(ConfigError(format!(
                "world size {world} is not divisible by tp x pp = {per}"
            )));
        }
        let dp = world / per;
        if self.parallel.dp != 0 && self.parallel.dp != dp {
            return Err(ConfigError(format!(
                "parallel.dp = {} but the world size {world} / (tp x pp) gives {dp}",
                self.parallel.dp
            )));
        }
        self.batch_for_dp(dp)?;
        Ok(dp)
    }

    /// The DeepSpeed file's keys given as `"auto"` (sorted by JSON path),
    /// each with the value it stands for with `dp` data-parallel ranks:
    /// Phalanx's own setting for the key (its default, or `--set`'s), as
    /// if the key were not in the file. Empty without a DeepSpeed file or
    /// an "auto" in it.
    ///
    /// ```
    /// use phalanx::config::TrainConfig;
    /// let p = std::env::temp_dir().join(format!("doc-auto-{}.json", std::process::id()));
    /// std::fs::write(&p, r#"{"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}"#).unwrap();
    /// let c = TrainConfig::build(Some(&p), &["optim.lr=0.01".into()]).unwrap();
    /// let a = c.deepspeed_auto(1);
    /// assert_eq!(a[0].to_string(), "gradient_clipping = 1.0 (optim.grad_clip)");
    /// assert_eq!(a[1].to_string(), "optimizer.params.lr = 0.01 (optim.lr)");
    /// # std::fs::remove_file(&p).unwrap();
    /// ```
    pub fn deepspeed_auto(&self, dp: usize) -> Vec<AutoValue> {
        self.ds_auto.resolve(self, dp)
    }

    /// [`TrainConfig::deepspeed_auto`] as a block to print at start: a
    /// heading naming the file and one indented line per key; `None` when
    /// no key was "auto".
    pub fn deepspeed_auto_summary(&self, dp: usize) -> Option<String> {
        if self.ds_auto.is_empty() {
            return None;
        }
        let mut s = format!(
            "DeepSpeed \"auto\" values in {}, resolved to Phalanx's settings:",
            self.ds_auto.file()
        );
        for a in self.deepspeed_auto(dp) {
            s.push_str(&format!("\n  {a}"));
        }
        Some(s)
    }

    /// Where `log.plot` or `log.report` (`value`, its setting) is written,
    /// or `None` when it is off (empty). Under fault tolerance the default
    /// path names the replica group (`runs/loss-replica-1.svg`), as the
    /// groups' checkpoint directories do: groups started with one config
    /// would otherwise write over each other's. Any other path is taken
    /// as given.
    ///
    /// ```
    /// use phalanx::config::TrainConfig;
    /// use std::path::PathBuf;
    /// let ft = ["fault_tolerance.lighthouse=\"h:29510\"".into(),
    ///     "fault_tolerance.replicas=2".into(), "fault_tolerance.replica_id=1".into()];
    /// let c = TrainConfig::build(None, &ft).unwrap();
    /// assert_eq!(c.log_output(&c.log.plot), Some(PathBuf::from("runs/loss-replica-1.svg")));
    /// assert_eq!(c.log_output(&c.log.report), Some(PathBuf::from("runs/report-replica-1.html")));
    /// assert_eq!(c.log_output("mine.svg"), Some(PathBuf::from("mine.svg")));
    /// assert_eq!(c.log_output(""), None);
    /// let plain = TrainConfig::build(None, &[]).unwrap();
    /// assert_eq!(plain.log_output(&plain.log.report), Some(PathBuf::from("runs/report.html")));
    /// ```
    pub fn log_output(&self, value: &str) -> Option<PathBuf> {
        if value.is_empty() {
            return None;
        }
        let d = super::LogConfig::default();
        let p = PathBuf::from(value);
        if !self.fault_tolerance.enabled() || (value != d.plot && value != d.report) {
            return Some(p);
        }
        // (In the same directory: only one level is made for an output.)
        let stem = p.file_stem()?.to_string_lossy();
        let ext = p
            .extension()
            .map(|e| e.to_string_lossy())
            .unwrap_or_default();
        let id = self.fault_tolerance.replica_id;
        Some(p.with_file_name(format!("{stem}-replica-{id}.{ext}")))
    }

    /// Global batch in samples: micro_batch x dp x grad_accum.
    pub fn global_batch(&self, dp: usize) -> usize {
        // (Saturating: the factors are bounded by `validate`, dp by the world.)
        self.train
            .micro_batch_size
            .saturating_mul(dp)
            .saturating_mul(self.train.grad_accum_steps)
    }

    pub fn to_toml(&self) -> String {
        // A batch number still to be derived from train.global_batch_size
        // (outside a job, before the world is known) is left out: printed
        // at its default it would read back as given, and the identity
        // check would then fail on the job's world.
        let derived = match self.derive {
            batch::Derive::Nothing => return toml::to_string(self).unwrap_or_default(),
            batch::Derive::Micro => "micro_batch_size",
            batch::Derive::Accum => "grad_accum_steps",
        };
        let Ok(mut t) = toml::Table::try_from(self) else {
            return String::new();
        };
        if let Some(train) = t.get_mut("train").and_then(|v| v.as_table_mut()) {
            train.remove(derived);
        }
        toml::to_string(&t).unwrap_or_default()
    }
}
