//! Typed training configuration: sections `model`, `data`, `train`, `optim`,
//! `parallel`, `log`, with presets, a TOML file and `--set section.key=value`
//! overrides, applied in that order. Unknown keys and wrong types are
//! errors that name the key.
//!
//! ```
//! use phalanx::config::TrainConfig;
//! let cfg = TrainConfig::build(None, &["train.steps=5".into(), "model.n_layer=2".into()]).unwrap();
//! assert_eq!(cfg.train.steps, 5);
//! assert_eq!(cfg.model.n_layer, 2);
//! assert!(TrainConfig::build(None, &["train.stepz=5".into()]).is_err());
//! ```

mod presets;

pub use presets::{model_preset, PRESETS};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainSection,
    pub optim: OptimConfig,
    pub parallel: ParallelConfig,
    /// ZeRO in DeepSpeed's words (`parallel.sharding_strategy` says the same in FSDP's).
    pub zero_optimization: ZeroOptimization,
    pub log: LogConfig,
}

/// DeepSpeed's `zero_optimization` block.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroOptimization {
    /// 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    pub stage: u8,
    pub offload_optimizer: OffloadOptimizer,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadOptimizer {
    /// `none`, `cpu` (host memory: on CPU training the state is already
    /// there) or `nvme` (files under `nvme_path`, streamed in chunks).
    pub device: String,
    pub nvme_path: String,
}

impl Default for OffloadOptimizer {
    fn default() -> Self {
        OffloadOptimizer {
            device: "none".into(),
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

/// The model's shape. `preset` fills every field; fields given explicitly
/// (in the file or with --set) override the preset.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub preset: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    pub block_size: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// A text file, a nanoGPT .bin (uint16) or an llm.c .bin.
    pub path: String,
    /// `byte` (vocab 256) or `gpt2` (BPE, vocab 50257).
    pub tokenizer: String,
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
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `adamw` or `sgd`.
    pub name: String,
    pub lr: f64,
    pub min_lr: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Clip gradients to this global norm (0 disables).
    pub grad_clip: f64,
    pub warmup_steps: usize,
    /// `cosine` (after warmup) or `constant`.
    pub schedule: String,
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
    /// Empty: use `zero_optimization.stage`.
    pub sharding_strategy: String,
    /// ZeRO-3 / FSDP: blocks gathered ahead in forward and in backward.
    pub forward_prefetch: usize,
    pub backward_prefetch: usize,
    /// HYBRID_SHARD group size (0: the ranks of one node, LOCAL_WORLD_SIZE).
    pub hybrid_shard_size: usize,
    /// Megatron sequence parallelism (with tp > 1).
    pub sequence_parallel: bool,
    /// Pipeline schedule: gpipe, 1f1b, interleaved (or interleaved:V), zb-h1.
    pub pp_schedule: String,
    /// Model chunks per rank for the interleaved schedule.
    pub pp_virtual_stages: usize,
    /// Blocks per stage: "balanced" (by parameter count) or counts "2,3,3".
    pub pp_partition: String,
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
}

impl Default for TrainConfig {
    fn default() -> Self {
        let mut model = ModelConfig::default();
        model_preset("gpt-tiny", &mut model).expect("default preset exists");
        TrainConfig {
            model,
            data: DataConfig::default(),
            train: TrainSection::default(),
            optim: OptimConfig::default(),
            parallel: ParallelConfig::default(),
            zero_optimization: ZeroOptimization::default(),
            log: LogConfig::default(),
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            preset: "gpt-tiny".into(),
            n_layer: 0,
            n_head: 0,
            n_embd: 0,
            vocab_size: 0,
            block_size: 0,
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: "data/corpus.txt".into(),
            tokenizer: "byte".into(),
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
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            name: "adamw".into(),
            lr: 3e-3,
            min_lr: 3e-4,
            weight_decay: 0.1,
            momentum: 0.9,
            betas: [0.9, 0.95],
            eps: 1e-8,
            grad_clip: 1.0,
            warmup_steps: 20,
            schedule: "cosine".into(),
        }
    }
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            dp: 0,
            tp: 1,
            pp: 1,
            bucket_mb: 25.0,
            check_params_every: 0,
            sharding_strategy: String::new(),
            forward_prefetch: 1,
            backward_prefetch: 1,
            hybrid_shard_size: 0,
            sequence_parallel: false,
            pp_schedule: "1f1b".into(),
            pp_virtual_stages: 2,
            pp_partition: "balanced".into(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            interval: 10,
            json: String::new(),
            plot: "runs/loss.svg".into(),
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

impl TrainConfig {
    /// Defaults <- model preset <- TOML file <- `section.key=value` overrides,
    /// then validation.
    pub fn build(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig> {
        let mut table = toml::Table::new();
        if let Some(p) = file {
            let text = std::fs::read_to_string(p)
                .map_err(|e| ConfigError(format!("cannot read {}: {e}", p.display())))?;
            table = text
                .parse::<toml::Table>()
                .map_err(|e| ConfigError(format!("{}: {e}", p.display())))?;
        }
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        // The preset is read first so that explicit model keys win over it.
        let preset = table
            .get("model")
            .and_then(|m| m.get("preset"))
            .and_then(|p| p.as_str())
            .unwrap_or("gpt-tiny")
            .to_string();
        let mut base = TrainConfig::default();
        base.model.preset = preset.clone();
        model_preset(&preset, &mut base.model)?;
        let mut merged = toml::Table::try_from(&base).map_err(|e| ConfigError(e.to_string()))?;
        merge(&mut merged, table, "")?;
        let cfg: TrainConfig = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError(e.message().to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that do not depend on the world size.
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        let bad = |s: String| Err(ConfigError(s));
        if m.n_layer == 0
            || m.n_head == 0
            || m.n_embd == 0
            || m.vocab_size == 0
            || m.block_size == 0
        {
            return bad(format!("model sizes must be positive: {m:?}"));
        }
        if !m.n_embd.is_multiple_of(m.n_head) {
            return bad(format!(
                "model.n_embd ({}) must be divisible by model.n_head ({})",
                m.n_embd, m.n_head
            ));
        }
        if self.train.micro_batch_size == 0 || self.train.grad_accum_steps == 0 {
            return bad(
                "train.micro_batch_size and train.grad_accum_steps must be at least 1".into(),
            );
        }
        if !matches!(self.data.tokenizer.as_str(), "byte" | "gpt2") {
            return bad(format!(
                "data.tokenizer must be \"byte\" or \"gpt2\", not {:?}",
                self.data.tokenizer
            ));
        }
        if !(0.0..1.0).contains(&self.data.val_fraction) {
            return bad(format!(
                "data.val_fraction must be in [0, 1), not {}",
                self.data.val_fraction
            ));
        }
        if !matches!(self.optim.name.as_str(), "adamw" | "sgd") {
            return bad(format!(
                "optim.name must be \"adamw\" or \"sgd\", not {:?}",
                self.optim.name
            ));
        }
        if !matches!(self.optim.schedule.as_str(), "cosine" | "constant") {
            return bad(format!(
                "optim.schedule must be \"cosine\" or \"constant\", not {:?}",
                self.optim.schedule
            ));
        }
        if self.optim.lr <= 0.0 || self.optim.grad_clip < 0.0 {
            return bad("optim.lr must be positive and optim.grad_clip non-negative".into());
        }
        if self.parallel.bucket_mb <= 0.0 {
            return bad("parallel.bucket_mb must be positive".into());
        }
        self.sharding()?;
        if !matches!(
            self.zero_optimization.offload_optimizer.device.as_str(),
            "none" | "cpu" | "nvme"
        ) {
            return bad(format!(
                "zero_optimization.offload_optimizer.device must be none, cpu or nvme, not {:?}",
                self.zero_optimization.offload_optimizer.device
            ));
        }
        if self.offload_dir().is_some() && self.optim.name != "adamw" {
            return bad("optimizer offload is built for optim.name = adamw".into());
        }
        if self.parallel.tp == 0 {
            return bad("parallel.tp must be at least 1".into());
        }
        if self.parallel.sequence_parallel && self.sharding()?.stage >= 2 {
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
        if !matches!(
            self.parallel
                .pp_schedule
                .to_ascii_lowercase()
                .split(':')
                .next(),
            Some("gpipe" | "1f1b" | "interleaved" | "zb-h1")
        ) {
            return bad(format!(
                "parallel.pp_schedule must be gpipe, 1f1b, interleaved or zb-h1, not {:?}",
                self.parallel.pp_schedule
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
        let (stage, hybrid) = match self.parallel.sharding_strategy.to_ascii_uppercase().as_str() {
            "" => return Ok(Sharding { stage: ds, hybrid_group: 0 }),
            "NO_SHARD" => (0, false),
            "SHARD_GRAD_OP" => (2, false),
            "FULL_SHARD" => (3, false),
            "HYBRID_SHARD" => (3, true),
            other => {
                return Err(ConfigError(format!(
                    "parallel.sharding_strategy {other:?} is not FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"
                )))
            }
        };
        if ds != 0 && ds != stage {
            return Err(ConfigError(format!(
                "parallel.sharding_strategy = {} means ZeRO stage {stage}, but zero_optimization.stage = {ds}",
                self.parallel.sharding_strategy
            )));
        }
        let group = if hybrid {
            match self.parallel.hybrid_shard_size {
                0 => std::env::var("LOCAL_WORLD_SIZE")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
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

    /// Where optimizer state is offloaded to (nvme), if anywhere.
    pub fn offload_dir(&self) -> Option<std::path::PathBuf> {
        let o = &self.zero_optimization.offload_optimizer;
        (o.device == "nvme").then(|| o.nvme_path.clone().into())
    }

    /// The data-parallel size for a world size, with the batch checks that
    /// depend on it.
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
        Ok(dp)
    }

    /// Global batch in samples: micro_batch x dp x grad_accum.
    pub fn global_batch(&self, dp: usize) -> usize {
        self.train.micro_batch_size * dp * self.train.grad_accum_steps
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }
}

/// Parse `section.key=value` and set it in `table`. The value is read as a
/// TOML value (numbers, booleans, arrays) or, failing that, as a string.
fn apply_override(table: &mut toml::Table, o: &str) -> Result<()> {
    let (key, value) = o
        .split_once('=')
        .ok_or_else(|| ConfigError(format!("override {o:?} must look like section.key=value")))?;
    // `a.b.c=v` sets key c of table a.b (nested sections such as
    // zero_optimization.offload_optimizer).
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.len() < 2 || path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError(format!(
            "override key {key:?} must look like section.key"
        )));
    }
    let v = format!("v = {}", value.trim())
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.trim().to_string()));
    let mut t = table;
    for (i, name) in path[..path.len() - 1].iter().enumerate() {
        let entry = t
            .entry(name.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| ConfigError(format!("{} is not a section", path[..=i].join("."))))?;
    }
    t.insert(path[path.len() - 1].to_string(), v);
    Ok(())
}

/// Merge `over` into `base`, naming unknown keys and mismatched types.
fn merge(base: &mut toml::Table, over: toml::Table, path: &str) -> Result<()> {
    for (k, v) in over {
        let full = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        match base.get_mut(&k) {
            None => {
                let known: Vec<&String> = base.keys().collect();
                return Err(ConfigError(format!(
                    "unknown key `{full}` (known here: {known:?})"
                )));
            }
            Some(toml::Value::Table(b)) => match v {
                toml::Value::Table(t) => merge(b, t, &full)?,
                other => {
                    return Err(ConfigError(format!(
                        "`{full}` is a section, not a value ({other})"
                    )))
                }
            },
            Some(slot) => {
                let ok = match (&*slot, &v) {
                    (toml::Value::Float(_), toml::Value::Integer(i)) => {
                        *slot = toml::Value::Float(*i as f64);
                        continue;
                    }
                    (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
                };
                if !ok {
                    return Err(ConfigError(format!(
                        "`{full}` expects {}, got {v}",
                        type_name(slot)
                    )));
                }
                *slot = v;
            }
        }
    }
    Ok(())
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Array(_) => "an array",
        _ => "a table",
    }
}

// --- TEMPORARY shim until the config branch lands (replaced by config/precision.rs) ---
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    Bf16,
    Fp16,
}
impl Precision {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Precision::Fp32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::Fp16 => candle_core::DType::F16,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    #[default]
    None,
    Full,
    Every(usize),
}
impl Recompute {
    pub fn recomputes(&self, block: usize) -> bool {
        match *self {
            Recompute::None => false,
            Recompute::Full => true,
            Recompute::Every(k) => k > 0 && block.is_multiple_of(k),
        }
    }
}
#[derive(Debug, Clone, PartialEq)]
pub struct Fp16Section {
    pub enabled: bool,
    pub loss_scale: f64,
    pub initial_scale_power: u32,
    pub loss_scale_window: usize,
    pub hysteresis: usize,
    pub min_loss_scale: f64,
}
impl TrainConfig {
    pub fn precision(&self) -> Precision {
        std::env::var("PHALANX_SHIM_PRECISION")
            .ok()
            .and_then(|p| match p.as_str() {
                "bf16" => Some(Precision::Bf16),
                "fp16" => Some(Precision::Fp16),
                _ => None,
            })
            .unwrap_or_default()
    }
    pub fn recompute(&self) -> Recompute {
        Recompute::None
    }
    pub fn reduce_dtype(&self) -> Precision {
        Precision::Fp32
    }
    pub fn fp16_section(&self) -> Fp16Section {
        Fp16Section {
            enabled: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}
