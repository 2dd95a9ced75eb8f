//! Typed training configuration: sections `data`, `train`, `optim`,
//! `parallel`, `log` (and DeepSpeed's), from defaults, a TOML file and
//! `--set section.key=value` overrides, applied in that order. Unknown keys
//! and wrong types are errors that name the key.
//!
//! The `model` section belongs to the model crate (see [`ModelSchema`]):
//! `phalanx_models::gpt2::config::build` builds a config with GPT-2's
//! section and presets.
//!
//! ```
//! use phalanx::config::TrainConfig;
//! let cfg = TrainConfig::build(None, &["train.steps=5".into()]).unwrap();
//! assert_eq!(cfg.train.steps, 5);
//! assert!(cfg.model.is_empty());
//! assert!(TrainConfig::build(None, &["train.stepz=5".into()]).is_err());
//! ```

mod batch;
mod build;
mod choices;
mod data;
mod deepspeed;
mod derived;
mod fault_tolerance;
mod merge;
mod model;
mod notes;
mod precision;
mod validate;

pub use crate::data::Tokenizer;
pub use build::CONFIG_SAID;
pub use choices::{
    Choice, CommHookKind, DeviceKind, LrScheduleKind, OffloadDevice, OnNonfinite, OptimName,
    PpPartition, PpSchedule, ScheduleKind, ShardingStrategy, TokenizerSpec, WarmupType,
};
pub use data::{DataPath, DataSource};
pub use fault_tolerance::FaultToleranceConfig;
pub use model::{ModelFacts, ModelSchema, NoModel};
pub use precision::{
    ActivationCheckpointingSection, Bf16Section, Fp16Section, Precision, Recompute,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// The model's section, as its crate defines it (see [`ModelSchema`]).
    pub model: toml::Table,
    pub data: DataConfig,
    pub train: TrainSection,
    pub optim: OptimConfig,
    pub parallel: ParallelConfig,
    /// ZeRO in DeepSpeed's words (`parallel.sharding_strategy` says the same in FSDP's).
    pub zero_optimization: ZeroOptimization,
    pub log: LogConfig,
    pub checkpoint: CheckpointConfig,
    /// Health of a running job: Prometheus metrics, stragglers.
    pub monitor: MonitorConfig,
    /// LocalSGD / DiLoCo / Streaming DiLoCo on the data-parallel axis.
    pub diloco: DilocoSection,
    /// DeepSpeed's fp16 section (loss scaling); see [`TrainConfig::precision`].
    pub fp16: Fp16Section,
    /// DeepSpeed's bf16 section.
    pub bf16: Bf16Section,
    /// DeepSpeed's activation_checkpointing section (where saved inputs live).
    pub activation_checkpointing: ActivationCheckpointingSection,
    /// This job as one replica group of a fault-tolerant job.
    pub fault_tolerance: FaultToleranceConfig,
    /// Which batch number is derived from `train.global_batch_size` (set by
    /// `build` from the keys given; see the `batch` module).
    #[serde(skip)]
    derive: batch::Derive,
    /// What the model's schema said of its section (set by `build_for`).
    #[serde(skip)]
    model_facts: ModelFacts,
    /// The DeepSpeed file's `"auto"` keys (see [`TrainConfig::deepspeed_auto`]).
    #[serde(skip)]
    ds_auto: deepspeed::Autos,
}

/// A DeepSpeed key given as `"auto"`, and what it resolved to
/// ([`TrainConfig::deepspeed_auto`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AutoValue {
    /// Its JSON path, e.g. `optimizer.params.lr`.
    pub key: String,
    /// The value it stands for, as printed; `None` for a knob that has no
    /// effect in Phalanx (ignored).
    pub value: Option<String>,
    /// Where the value comes from (the Phalanx key, e.g. `optim.lr`), or
    /// why the key is ignored or has one value.
    pub from: String,
}

impl std::fmt::Display for AutoValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Some(v) => write!(f, "{} = {v} ({})", self.key, self.from),
            None => write!(f, "{}: ignored ({})", self.key, self.from),
        }
    }
}

/// DeepSpeed's `zero_optimization` block.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroOptimization {
    /// 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    pub stage: u8,
    pub offload_optimizer: OffloadOptimizer,
    /// ZeRO-3 parameter offload: `none`, `cpu` or `nvme`.
    pub offload_param: OffloadParam,
    /// Overlap gradient reduction with backward.
    pub overlap_comm: bool,
    /// Gradients in one contiguous buffer (Phalanx always does this).
    pub contiguous_gradients: bool,
    /// Gradient bucket size in elements, as DeepSpeed counts it (bytes =
    /// elements x 4); 0 uses `parallel.bucket_mb`.
    pub reduce_bucket_size: f64,
    /// ZeRO-3 prefetch size in elements, as whole blocks of the largest
    /// block's size (at least one); 0 uses `parallel.forward_prefetch`.
    pub stage3_prefetch_bucket_size: f64,
    /// ZeRO-3: a block whose parameters will be used again (in the
    /// backward) within this many parameters gathered keeps them instead
    /// of gathering them again (DeepSpeed's knob, per block here). 0 (the
    /// default here; DeepSpeed's is 1e9) frees every block after its
    /// forward: the least memory.
    pub stage3_max_reuse_distance: f64,
    /// ZeRO++ qwZ: stage 3's parameter all-gathers carry block-wise int8
    /// (256 values and one scale per block).
    pub zero_quantized_weights: bool,
    /// ZeRO++ qgZ: stage 3's gradient reduce-scatter carries block-wise
    /// int8, through an all-to-all (the `int8` communication hook).
    pub zero_quantized_gradients: bool,
    /// ZeRO++ hpZ: after the forward gather each rank keeps a secondary
    /// shard of the parameters within groups of this many consecutive
    /// ranks, and the backward gathers inside its group (1: off).
    pub zero_hpz_partition_size: usize,
}

impl Default for ZeroOptimization {
    fn default() -> Self {
        ZeroOptimization {
            stage: 0,
            offload_optimizer: OffloadOptimizer::default(),
            offload_param: OffloadParam::default(),
            overlap_comm: true,
            contiguous_gradients: true,
            reduce_bucket_size: 0.0,
            stage3_prefetch_bucket_size: 0.0,
            stage3_max_reuse_distance: 0.0,
            zero_quantized_weights: false,
            zero_quantized_gradients: false,
            zero_hpz_partition_size: 1,
        }
    }
}

/// DeepSpeed's `zero_optimization.offload_param` (ZeRO-3 only).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadParam {
    /// `none`, `cpu` (host memory: on CPU training the parameters are
    /// already there, so it behaves as `none`) or `nvme` (one file per rank
    /// under `nvme_path`, read block by block and streamed by the update).
    pub device: OffloadDevice,
    pub nvme_path: String,
    /// Elements per chunk of the streamed optimizer update with `nvme`
    /// (DeepSpeed's `offload_param.buffer_size`); 2^20 = 4 MiB of f32.
    pub buffer_size: usize,
}

impl Default for OffloadParam {
    fn default() -> Self {
        OffloadParam {
            device: OffloadDevice::None,
            nvme_path: "runs/offload".into(),
            buffer_size: 1 << 20,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadOptimizer {
    /// `none`, `cpu` (host memory and the host's loop: on CPU training the
    /// state is there already; on a GPU, where `none` keeps it in device
    /// memory, this offloads it) or `nvme` (files under `nvme_path`,
    /// streamed in chunks).
    pub device: OffloadDevice,
    pub nvme_path: String,
}

impl Default for OffloadOptimizer {
    fn default() -> Self {
        OffloadOptimizer {
            device: OffloadDevice::None,
            nvme_path: "runs/offload".into(),
        }
    }
}

/// How the data-parallel axis shards the model states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// ZeRO stage 0-3.
    pub stage: u8,
    /// HYBRID_SHARD: shard inside groups of this size (0: no replication).
    pub hybrid_group: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A file (text, JSONL, nanoGPT .bin, llm.c .bin), a directory, a glob,
    /// or a list of them (see [`data`] and `crate::data::corpus`).
    pub path: DataPath,
    /// Weighted sources (`[[data.sources]]`), instead of `path`.
    pub sources: Vec<DataSource>,
    /// JSONL key of a document's text (for `path`; sources have their own).
    pub field: String,
    /// Validation files; empty: the tail `val_fraction` of each token file.
    pub val_path: DataPath,
    /// A record that cannot be read: `error` (naming file and line) or `skip`.
    pub on_bad_record: crate::data::OnBadRecord,
    /// A resume over data that differs from the checkpoint's: `error`
    /// (naming the difference) or `warn` and continue at its position.
    pub on_resume_mismatch: crate::data::OnMismatch,
    /// Tokenizer threads per text source (0: up to 4); the order does not depend on it.
    pub loader_threads: usize,
    /// Tokenized text shards queued ahead per source.
    pub prefetch: usize,
    /// `byte` (vocab 256), `gpt2` (BPE, vocab 50257), or the path of a
    /// Hugging Face `tokenizer.json`.
    pub tokenizer: TokenizerSpec,
    pub shuffle: bool,
    pub seed: u64,
    /// The tail fraction of the tokens kept for validation.
    pub val_fraction: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    pub steps: usize,
    pub micro_batch_size: usize,
    pub grad_accum_steps: usize,
    /// Seed of the parameter initialisation.
    pub seed: u64,
    /// Evaluate the validation loss every this many steps (0: never).
    pub eval_interval: usize,
    pub eval_batches: usize,
    /// Compute dtype: fp32, bf16 or fp16 (also set by `fp16.enabled` /
    /// `bf16.enabled`; read it through [`TrainConfig::precision`]).
    pub precision: Precision,
    /// The dtype gradients are reduced in (DeepSpeed's communication_data_type).
    pub reduce_dtype: Precision,
    /// "none", "full" or k: recompute every k-th block (see [`Recompute`]).
    pub activation_checkpointing: Recompute,
    /// Samples per optimizer step over all ranks (DeepSpeed's
    /// train_batch_size); 0: micro_batch_size x dp x grad_accum_steps.
    pub global_batch_size: usize,
    /// A non-finite loss or gradient: `stop` the run naming the rank and
    /// step, or `skip` the step (no update) and go on.
    pub on_nonfinite: OnNonfinite,
    /// `cpu` (the one built; `cuda` is refused with a clear error).
    pub device: DeviceKind,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `adamw`, `adam` or `sgd`. `adam` is DeepSpeed's Adam with its default
    /// `adam_w_mode = true`, i.e. AdamW (decoupled weight decay): the same
    /// update as `adamw`.
    pub name: OptimName,
    pub lr: f64,
    pub min_lr: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Clip gradients to this global norm (0 disables).
    pub grad_clip: f64,
    pub warmup_steps: usize,
    /// `cosine` (warmup then cosine to min_lr), `constant`, `warmup_constant`
    /// (DeepSpeed's WarmupLR) or `warmup_linear` (DeepSpeed's WarmupDecayLR);
    /// see [`crate::optim::LrSchedule`].
    pub schedule: LrScheduleKind,
    /// The learning rate warmup starts from (DeepSpeed's warmup_min_lr).
    pub warmup_min_lr: f64,
    /// `linear` or `log` (DeepSpeed's warmup_type).
    pub warmup_type: WarmupType,
    /// Step at which decay reaches min_lr (0: train.steps).
    pub decay_steps: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel ranks; 0 infers it from the world size.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// DDP gradient bucket size in MB (as PyTorch's bucket_cap_mb).
    pub bucket_mb: f64,
    /// Check every K steps that all ranks hold identical parameters (0: off).
    pub check_params_every: usize,
    /// FSDP's names: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD
    /// (DDP), HYBRID_SHARD (ZeRO-3 inside groups, replicated across them).
    /// Empty: use `zero_optimization.stage`. Case-insensitive.
    pub sharding_strategy: ShardingStrategy,
    /// ZeRO-3 / FSDP: blocks gathered ahead in forward and in backward.
    pub forward_prefetch: usize,
    pub backward_prefetch: usize,
    /// HYBRID_SHARD group size in dp ranks (0: those of one node,
    /// LOCAL_WORLD_SIZE / tp).
    pub hybrid_shard_size: usize,
    /// Megatron sequence parallelism (with tp > 1).
    pub sequence_parallel: bool,
    /// Pipeline schedule: gpipe, 1f1b, interleaved (or interleaved:V), zb-h1.
    pub pp_schedule: PpSchedule,
    /// Model chunks per rank for the interleaved schedule.
    pub pp_virtual_stages: usize,
    /// Blocks per stage: "balanced" (by parameter count), "time" (by the
    /// measured time of each block) or counts "2,3,3".
    pub pp_partition: PpPartition,
    /// Gradient compression (communication hook): none, fp16, bf16, int8,
    /// topk, powersgd.
    pub comm_hook: CommHookKind,
    /// `topk`: the fraction of each bucket's entries sent.
    pub topk_ratio: f64,
    /// `topk`: Deep Gradient Compression's sparsity warm-up: over this many
    /// steps the fraction sent falls from 1/4, by 4x per stage, to
    /// `topk_ratio` (0: `topk_ratio` from the first step).
    pub topk_warmup_steps: usize,
    /// `topk`: DGC's momentum correction: the hook accumulates a velocity
    /// u = m u + g with this factor m and sends the top-k of its sum (0:
    /// off). The hook then carries the momentum: use it with
    /// `optim.name = sgd` and `optim.momentum = 0` (SGD momentum on top is
    /// refused). With AdamW, the default optimizer, leave it at 0: Adam's
    /// first moment over the hook's velocity trained worse when measured.
    pub topk_momentum: f64,
    /// `topk` with AdamW (or Adam): 1-bit Adam's scheme, on by default:
    /// `topk_warmup_steps` dense steps, then the optimizer's variance is
    /// frozen and the hook carries the momentum (factor `optim.betas[0]`).
    /// `false`: top-k of the gradients with error feedback under a plain
    /// Adam (trails uncompressed further; see `strategy::topk`).
    pub topk_freeze_variance: bool,
    /// `powersgd`: the rank of each matrix's approximation.
    pub powersgd_rank: usize,
    /// `powersgd`: steps of plain all-reduce before compressing (PyTorch's
    /// `start_powerSGD_iter`, whose default is 1000; ours is 10, see
    /// [`POWERSGD_START_ITER`]).
    pub powersgd_start_iter: usize,
    /// Compressing hooks add what they left out to the next step's gradient.
    pub error_feedback: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Print a progress line every this many steps.
    pub interval: usize,
    /// One JSON object per step (also `--log-json`).
    pub json: String,
    /// Loss-curve image written at the end ("" disables).
    pub plot: String,
    /// The run's HTML report, written at the end ("" disables).
    pub report: String,
}

/// Distributed checkpoints (`phalanx::checkpoint`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Where checkpoints go (`step-NNNNNNNN/` directories and `latest`).
    pub dir: String,
    /// Save every this many steps, and at the end (0: never).
    pub interval: usize,
    /// How many checkpoints to keep (the newest).
    pub keep: usize,
    /// Write in the background (DCP's `async_save`): the step pays for a
    /// staging copy only.
    #[serde(rename = "async")]
    pub async_save: bool,
}

/// Monitoring a running job (`phalanx::monitor`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// Rank 0 serves Prometheus text at `http://HOST:PORT/metrics` (0: off).
    pub prometheus_port: u16,
    /// The address it binds: loopback unless told otherwise.
    pub prometheus_host: String,
    /// A rank whose compute time per step exceeds this many times the
    /// median of its peers (above 1) ...
    pub straggler_factor: f64,
    /// ... for this many steps in a row is reported as a straggler.
    pub straggler_steps: usize,
}

/// LocalSGD and DiLoCo (`phalanx::strategy::diloco`): every data-parallel
/// rank is a group that trains on its own for `inner_steps` steps with the
/// configured optimizer; then the groups average their parameter deltas
/// (pseudo-gradients) and apply an outer SGD step to the global model. On
/// when `enabled` or `inner_steps > 0`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DilocoSection {
    /// Turn DiLoCo on (`inner_steps` must then be set).
    pub enabled: bool,
    /// H: inner steps between outer steps (0: off unless `enabled`).
    pub inner_steps: usize,
    /// The outer SGD's learning rate (LocalSGD: 1).
    pub outer_lr: f64,
    /// The outer SGD's momentum (LocalSGD: 0).
    pub outer_momentum: f64,
    /// Nesterov momentum for the outer step.
    pub nesterov: bool,
    /// Streaming DiLoCo: the model syncs in this many contiguous fragments
    /// of the flat parameter buffer, at offsets staggered by H / fragments.
    pub fragments: usize,
    /// Streaming DiLoCo (fragments > 1): a fragment's averaged
    /// pseudo-gradient is applied this many inner steps after its
    /// all-reduce starts (τ; the all-reduce overlaps them). One fragment
    /// syncs in place.
    pub overlap_steps: usize,
    /// Send pseudo-gradients as int8 (one f32 scale per 256 values).
    pub quantize: bool,
}

impl Default for DilocoSection {
    fn default() -> Self {
        DilocoSection {
            enabled: false,
            inner_steps: 0,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true,
            fragments: 1,
            overlap_steps: 1,
            quantize: false,
        }
    }
}

impl DilocoSection {
    /// Whether DiLoCo runs (`enabled` or `inner_steps > 0`).
    pub fn on(&self) -> bool {
        self.enabled || self.inner_steps > 0
    }

    /// τ as it runs: `overlap_steps` with several fragments, 0 with one.
    pub fn delay(&self) -> usize {
        if self.fragments > 1 {
            self.overlap_steps
        } else {
            0
        }
    }
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            prometheus_port: 0,
            prometheus_host: "127.0.0.1".into(),
            straggler_factor: 1.3,
            straggler_steps: 3,
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: "runs/checkpoints".into(),
            interval: 0,
            keep: 3,
            async_save: false,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: toml::Table::new(),
            data: DataConfig::default(),
            train: TrainSection::default(),
            optim: OptimConfig::default(),
            parallel: ParallelConfig::default(),
            zero_optimization: ZeroOptimization::default(),
            log: LogConfig::default(),
            checkpoint: CheckpointConfig::default(),
            monitor: MonitorConfig::default(),
            diloco: DilocoSection::default(),
            fp16: Fp16Section::default(),
            bf16: Bf16Section::default(),
            activation_checkpointing: ActivationCheckpointingSection::default(),
            fault_tolerance: FaultToleranceConfig::default(),
            derive: batch::Derive::Nothing,
            model_facts: ModelFacts::default(),
            ds_auto: deepspeed::Autos::default(),
        }
    }
}

/// `data.path`'s default: the shipped corpus.
pub const DEFAULT_DATA_PATH: &str = "data/corpus.txt";

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: DataPath::One(DEFAULT_DATA_PATH.into()),
            sources: Vec::new(),
            field: "text".into(),
            val_path: DataPath::Many(Vec::new()),
            on_bad_record: crate::data::OnBadRecord::Error,
            on_resume_mismatch: crate::data::OnMismatch::Error,
            loader_threads: 0,
            prefetch: 2,
            tokenizer: TokenizerSpec::Builtin(Tokenizer::Byte),
            shuffle: true,
            seed: 1337,
            val_fraction: 0.02,
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 600,
            micro_batch_size: 8,
            grad_accum_steps: 1,
            seed: 0,
            eval_interval: 100,
            eval_batches: 8,
            precision: Precision::Fp32,
            reduce_dtype: Precision::Fp32,
            activation_checkpointing: Recompute::None,
            global_batch_size: 0,
            on_nonfinite: OnNonfinite::Stop,
            device: DeviceKind::Cpu,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            name: OptimName::AdamW,
            lr: 3e-3,
            min_lr: 3e-4,
            weight_decay: 0.1,
            momentum: 0.9,
            betas: [0.9, 0.95],
            eps: 1e-8,
            grad_clip: 1.0,
            warmup_steps: 20,
            schedule: LrScheduleKind::Cosine,
            warmup_min_lr: 0.0,
            warmup_type: WarmupType::Linear,
            decay_steps: 0,
        }
    }
}

/// `parallel.topk_warmup_steps`'s default: DGC's sparsity warm-up over the
/// first 60 steps (25%, 6.25%, 1.5625% for 20 steps each at the default
/// 1%). Measured on 2 ranks at 200 steps with AdamW, it brings top-1% from
/// 36% above uncompressed to 4.5% (gpt-tiny) and from 20% to 10% (gpt-10m);
/// 100 steps gain under a point more for 40 steps of heavier sends
/// (bench/README.md, "Gradient compression").
pub const TOPK_WARMUP_STEPS: usize = 60;
/// `parallel.powersgd_rank`'s default. PyTorch's is 1, which at 200 steps
/// ends 6% (gpt-tiny) and 7% (gpt-10m) above uncompressed; rank 4 ends
/// within 2% of it on both and still sends 59x fewer bytes than the
/// all-reduce on gpt-10m (20x on gpt-tiny, whose matrices are small).
pub const POWERSGD_RANK: usize = 4;
/// `parallel.powersgd_start_iter`'s default: 10 plain all-reduces first,
/// over the steepest part of the loss curve, where the gradient's leading
/// directions turn too fast for a warm-started Q. PyTorch's 1000 suits long
/// runs; here it would leave a run of the default 600 steps uncompressed.
pub const POWERSGD_START_ITER: usize = 10;

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            dp: 0,
            tp: 1,
            pp: 1,
            bucket_mb: 25.0,
            check_params_every: 0,
            sharding_strategy: ShardingStrategy::Unset,
            forward_prefetch: 1,
            backward_prefetch: 1,
            hybrid_shard_size: 0,
            sequence_parallel: false,
            pp_schedule: PpSchedule::default(),
            pp_virtual_stages: 2,
            pp_partition: PpPartition::Balanced,
            comm_hook: CommHookKind::None,
            topk_ratio: 0.01,
            topk_warmup_steps: TOPK_WARMUP_STEPS,
            topk_momentum: 0.0,
            topk_freeze_variance: true,
            powersgd_rank: POWERSGD_RANK,
            powersgd_start_iter: POWERSGD_START_ITER,
            error_feedback: true,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            interval: 10,
            json: String::new(),
            plot: "runs/loss.svg".into(),
            report: "runs/report.html".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "config: {}", self.0)
    }
}
impl std::error::Error for ConfigError {}

type Result<T> = std::result::Result<T, ConfigError>;
