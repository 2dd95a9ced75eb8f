//! Options that name one of a few choices, parsed once when the config is
//! built. In TOML and `--set` they stay strings (the same strings as
//! before, serialised by their canonical names, so `to_toml()` round-trips);
//! a bad value is an error that names the key:
//! `optim.name must be "adamw", "adam" or "sgd", not "lamb"`.
//!
//! ```
//! use phalanx::config::{OffloadDevice, OptimName, PpPartition, PpSchedule, ShardingStrategy, TrainConfig};
//! use phalanx::data::Tokenizer;
//! let c = TrainConfig::build(None, &[
//!     "data.tokenizer=gpt2".into(), "optim.name=sgd".into(),
//!     "parallel.sharding_strategy=full_shard".into(),
//!     "parallel.pp_schedule=interleaved:3".into(), "parallel.pp_partition=\"2,3\"".into(),
//!     "zero_optimization.offload_param.device=cpu".into(),
//! ]).unwrap();
//! assert_eq!(c.data.tokenizer, Tokenizer::Gpt2);
//! assert_eq!(c.optim.name, OptimName::Sgd);
//! assert_eq!(c.parallel.sharding_strategy, ShardingStrategy::FullShard);
//! assert_eq!(c.parallel.pp_schedule.to_string(), "interleaved:3");
//! assert_eq!(c.parallel.pp_partition, PpPartition::Counts(vec![2, 3]));
//! assert_eq!(c.zero_optimization.offload_param.device, OffloadDevice::Cpu);
//! assert_eq!(TrainConfig::build(None, &[]).unwrap().parallel.pp_schedule.to_string(), "1f1b");
//! assert_eq!("interleaved".parse::<PpSchedule>().unwrap(), PpSchedule::Interleaved);
//! let e = TrainConfig::build(None, &["data.tokenizer=bpe".into()]).unwrap_err().to_string();
//! assert!(e.contains(r#"data.tokenizer must be "byte", "gpt2" or the path of a Hugging Face tokenizer.json, not "bpe""#), "{e}");
//! ```

use super::ConfigError;
use crate::data::Tokenizer;
use std::fmt;
use std::str::FromStr;

/// An option with a fixed set of names (matched case-insensitively).
pub trait Choice: Sized + Copy + PartialEq + 'static {
    /// The canonical names, in the order error messages list them.
    const NAMES: &'static [(&'static str, Self)];
    /// Other names accepted on input.
    const ALIASES: &'static [(&'static str, Self)] = &[];

    fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, v)| *v == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }

    /// Parse a name; the error reads `must be "a", "b" or "c", not "x"`.
    fn parse_name(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Self::NAMES
            .iter()
            .chain(Self::ALIASES)
            .find(|(n, _)| n.eq_ignore_ascii_case(t))
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                let names: Vec<String> =
                    Self::NAMES.iter().map(|(n, _)| format!("{n:?}")).collect();
                format!("must be {}, not {s:?}", one_of(&names))
            })
    }
}

/// "a", "a or b", "a, b or c".
pub(crate) fn one_of(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [a] => a.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// Display, FromStr and serde (as a string) through [`Choice`].
macro_rules! choice_impls {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(Choice::name(*self))
            }
        }
        impl FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                <$t as Choice>::parse_name(s)
            }
        }
        serde_as_str!($t);
    )*};
}

/// serde through Display / FromStr (a TOML string).
macro_rules! serde_as_str {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

/// `data.tokenizer`: [`Tokenizer`] itself.
impl Choice for Tokenizer {
    const NAMES: &'static [(&'static str, Self)] =
        &[("byte", Tokenizer::Byte), ("gpt2", Tokenizer::Gpt2)];
    const ALIASES: &'static [(&'static str, Self)] = &[("r50k_base", Tokenizer::Gpt2)];
}

/// `data.tokenizer`: a built-in [`Tokenizer`] by name, or the path of a
/// Hugging Face `tokenizer.json` (any value ending in `.json`), which the
/// model crate encodes text with (`phalanx_models::hf_tokenizer`; this
/// crate does not link the `tokenizers` library).
///
/// ```
/// use phalanx::config::{TokenizerSpec, TrainConfig};
/// use phalanx::data::Tokenizer;
/// let c = TrainConfig::build(None, &["data.tokenizer=tok/tokenizer.json".into()]).unwrap();
/// assert_eq!(c.data.tokenizer, TokenizerSpec::HfJson("tok/tokenizer.json".into()));
/// assert_eq!(c.data.tokenizer.builtin(), None);
/// assert!(c.to_toml().contains(r#"tokenizer = "tok/tokenizer.json""#));
/// assert_eq!(TrainConfig::build(None, &[]).unwrap().data.tokenizer, Tokenizer::Byte);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    Builtin(Tokenizer),
    /// The path as given (relative to the working directory).
    HfJson(String),
}

impl Default for TokenizerSpec {
    fn default() -> Self {
        TokenizerSpec::Builtin(Tokenizer::Byte)
    }
}

impl TokenizerSpec {
    /// The built-in tokenizer, if this is one.
    pub fn builtin(&self) -> Option<Tokenizer> {
        match self {
            TokenizerSpec::Builtin(t) => Some(*t),
            TokenizerSpec::HfJson(_) => None,
        }
    }

    /// The `tokenizer.json` path, if this is one.
    pub fn json_path(&self) -> Option<&std::path::Path> {
        match self {
            TokenizerSpec::Builtin(_) => None,
            TokenizerSpec::HfJson(p) => Some(std::path::Path::new(p)),
        }
    }
}

impl PartialEq<Tokenizer> for TokenizerSpec {
    fn eq(&self, other: &Tokenizer) -> bool {
        self.builtin() == Some(*other)
    }
}

impl From<Tokenizer> for TokenizerSpec {
    fn from(t: Tokenizer) -> Self {
        TokenizerSpec::Builtin(t)
    }
}

impl fmt::Display for TokenizerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerSpec::Builtin(t) => f.write_str(Choice::name(*t)),
            TokenizerSpec::HfJson(p) => f.write_str(p),
        }
    }
}

impl FromStr for TokenizerSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(t) = Tokenizer::parse_name(s) {
            return Ok(TokenizerSpec::Builtin(t));
        }
        let t = s.trim();
        if t.to_ascii_lowercase().ends_with(".json") {
            return Ok(TokenizerSpec::HfJson(t.to_string()));
        }
        Err(format!(
            "must be \"byte\", \"gpt2\" or the path of a Hugging Face tokenizer.json, not {s:?}"
        ))
    }
}

serde_as_str!(TokenizerSpec);

/// `optim.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimName {
    #[default]
    AdamW,
    /// DeepSpeed's Adam with its default `adam_w_mode = true`: the same
    /// update as AdamW (decoupled weight decay).
    Adam,
    Sgd,
}

impl OptimName {
    /// AdamW or Adam (the same update here).
    pub fn is_adam(self) -> bool {
        matches!(self, OptimName::AdamW | OptimName::Adam)
    }
}

impl Choice for OptimName {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("adamw", OptimName::AdamW),
        ("adam", OptimName::Adam),
        ("sgd", OptimName::Sgd),
    ];
}

/// `optim.schedule` (see [`crate::optim::LrSchedule::from_config`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LrScheduleKind {
    /// Warmup, then cosine to `optim.min_lr`.
    #[default]
    Cosine,
    Constant,
    /// DeepSpeed's WarmupLR.
    WarmupConstant,
    /// DeepSpeed's WarmupDecayLR.
    WarmupLinear,
}

impl Choice for LrScheduleKind {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("cosine", LrScheduleKind::Cosine),
        ("constant", LrScheduleKind::Constant),
        ("warmup_constant", LrScheduleKind::WarmupConstant),
        ("warmup_linear", LrScheduleKind::WarmupLinear),
    ];
}

/// How a warmup rises (`optim.warmup_type`, DeepSpeed's `warmup_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WarmupType {
    #[default]
    Linear,
    /// `ln(s + 1) / ln(warmup)`: fast at first.
    Log,
}

impl Choice for WarmupType {
    const NAMES: &'static [(&'static str, Self)] =
        &[("linear", WarmupType::Linear), ("log", WarmupType::Log)];
}

/// `parallel.sharding_strategy`: FSDP's names for the ZeRO stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShardingStrategy {
    /// `""`: `zero_optimization.stage` decides.
    #[default]
    Unset,
    /// ZeRO-3.
    FullShard,
    /// ZeRO-2.
    ShardGradOp,
    /// DDP.
    NoShard,
    /// ZeRO-3 inside groups, replicated across them.
    HybridShard,
}

impl Choice for ShardingStrategy {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("FULL_SHARD", ShardingStrategy::FullShard),
        ("SHARD_GRAD_OP", ShardingStrategy::ShardGradOp),
        ("NO_SHARD", ShardingStrategy::NoShard),
        ("HYBRID_SHARD", ShardingStrategy::HybridShard),
        ("", ShardingStrategy::Unset),
    ];
}

impl ShardingStrategy {
    /// (ZeRO stage, hybrid), or `None` when unset.
    pub fn stage(self) -> Option<(u8, bool)> {
        match self {
            ShardingStrategy::Unset => None,
            ShardingStrategy::NoShard => Some((0, false)),
            ShardingStrategy::ShardGradOp => Some((2, false)),
            ShardingStrategy::FullShard => Some((3, false)),
            ShardingStrategy::HybridShard => Some((3, true)),
        }
    }
}

/// `train.device`: what runs the model's kernels and holds the activations
/// ([`crate::device`] says what each choice keeps where). The engine,
/// strategies and optimizers take it from here ([`DeviceKind::device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// Host memory and the CPU kernels (fused layers, gemm, AVX-512 where
    /// the CPU has it).
    #[default]
    Cpu,
    /// An NVIDIA GPU (`LOCAL_RANK` picks it), through candle's CUDA backend;
    /// builds without the `cuda` feature refuse it, naming the feature.
    Cuda,
}

impl Choice for DeviceKind {
    const NAMES: &'static [(&'static str, Self)] =
        &[("cpu", DeviceKind::Cpu), ("cuda", DeviceKind::Cuda)];
}

impl DeviceKind {
    /// Whether this build can compute on this device (no device is opened).
    pub fn check_built(self) -> Result<(), ConfigError> {
        match self {
            DeviceKind::Cpu => Ok(()),
            DeviceKind::Cuda => crate::device::cuda_built().map_err(ConfigError),
        }
    }

    /// The candle device this rank computes on (opened on first use, then
    /// the same handle).
    pub fn device(self) -> Result<candle_core::Device, ConfigError> {
        match self {
            DeviceKind::Cpu => Ok(candle_core::Device::Cpu),
            DeviceKind::Cuda => crate::device::open_cuda().map_err(ConfigError),
        }
    }
}

/// `zero_optimization.offload_optimizer.device` / `offload_param.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadDevice {
    #[default]
    None,
    /// Host memory (on CPU training the state is already there).
    Cpu,
    /// Files under `nvme_path`, streamed in chunks.
    Nvme,
}

impl Choice for OffloadDevice {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("none", OffloadDevice::None),
        ("cpu", OffloadDevice::Cpu),
        ("nvme", OffloadDevice::Nvme),
    ];
}

/// `parallel.comm_hook`: how gradient buckets travel (PyTorch's DDP
/// communication hooks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommHookKind {
    #[default]
    None,
    Fp16,
    Bf16,
    /// Block-wise (256) scaled int8, with error feedback.
    Int8,
    /// The largest-magnitude `parallel.topk_ratio` of each bucket, with
    /// error feedback and Deep Gradient Compression's sparsity warm-up
    /// (`parallel.topk_warmup_steps`) and momentum correction
    /// (`parallel.topk_momentum`).
    Topk,
    /// A rank-`parallel.powersgd_rank` approximation of each matrix, with
    /// error feedback and warm start.
    Powersgd,
}

impl Choice for CommHookKind {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("none", CommHookKind::None),
        ("fp16", CommHookKind::Fp16),
        ("bf16", CommHookKind::Bf16),
        ("int8", CommHookKind::Int8),
        ("topk", CommHookKind::Topk),
        ("powersgd", CommHookKind::Powersgd),
    ];
}

/// `train.on_nonfinite`: what a non-finite loss or gradient does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnNonfinite {
    /// Stop the run, naming the rank and step.
    #[default]
    Stop,
    /// Skip the step (no update) and go on, as fp16 loss scaling does.
    Skip,
}

impl Choice for OnNonfinite {
    const NAMES: &'static [(&'static str, Self)] =
        &[("stop", OnNonfinite::Stop), ("skip", OnNonfinite::Skip)];
}

choice_impls!(
    DeviceKind,
    OnNonfinite,
    Tokenizer,
    OptimName,
    LrScheduleKind,
    WarmupType,
    ShardingStrategy,
    OffloadDevice,
    CommHookKind
);

/// Which pipeline schedule to build (`crate::strategy::pipeline` builds
/// its tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    Gpipe,
    OneFOneB,
    /// Interleaved 1F1B with `v >= 2` model chunks per rank.
    Interleaved {
        v: usize,
    },
    ZbH1,
}

impl ScheduleKind {
    /// Model chunks per rank.
    pub fn chunks_per_rank(&self) -> usize {
        match self {
            ScheduleKind::Interleaved { v } => *v,
            _ => 1,
        }
    }

    /// Whether backwards are split into I and W.
    pub fn split_backward(&self) -> bool {
        matches!(self, ScheduleKind::ZbH1)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::Gpipe => write!(f, "gpipe"),
            ScheduleKind::OneFOneB => write!(f, "1f1b"),
            ScheduleKind::Interleaved { v } => write!(f, "interleaved:{v}"),
            ScheduleKind::ZbH1 => write!(f, "zb-h1"),
        }
    }
}

/// `gpipe`, `1f1b`, `interleaved:V` (`interleaved` = 2 chunks), `zb-h1`.
impl FromStr for ScheduleKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> std::result::Result<Self, ConfigError> {
        let l = s.trim().to_ascii_lowercase().replace('_', "-");
        Ok(match l.as_str() {
            "gpipe" => ScheduleKind::Gpipe,
            "1f1b" | "one-f-one-b" | "pipedream-flush" => ScheduleKind::OneFOneB,
            "interleaved" | "interleaved-1f1b" => ScheduleKind::Interleaved { v: 2 },
            "zb-h1" | "zbh1" | "zero-bubble" => ScheduleKind::ZbH1,
            _ => match l.strip_prefix("interleaved:").map(str::parse) {
                Some(Ok(v)) => ScheduleKind::Interleaved { v },
                _ => {
                    return Err(ConfigError(format!(
                        "unknown pipeline schedule `{s}`: use gpipe, 1f1b, interleaved:V or zb-h1"
                    )))
                }
            },
        })
    }
}

/// `parallel.pp_schedule`: a [`ScheduleKind`], or `interleaved` without a
/// chunk count (`parallel.pp_virtual_stages` chunks per rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PpSchedule {
    /// `interleaved`: `parallel.pp_virtual_stages` chunks per rank.
    Interleaved,
    /// A schedule given in full (`gpipe`, `1f1b`, `interleaved:V`, `zb-h1`).
    Kind(ScheduleKind),
}

impl Default for PpSchedule {
    fn default() -> Self {
        PpSchedule::Kind(ScheduleKind::OneFOneB)
    }
}

impl PpSchedule {
    pub fn new(kind: ScheduleKind) -> Self {
        PpSchedule::Kind(kind)
    }

    /// The schedule, with `interleaved` taking `virtual_stages` chunks.
    pub fn kind(self, virtual_stages: usize) -> ScheduleKind {
        match self {
            PpSchedule::Interleaved => ScheduleKind::Interleaved { v: virtual_stages },
            PpSchedule::Kind(k) => k,
        }
    }
}

impl fmt::Display for PpSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PpSchedule::Interleaved => f.write_str("interleaved"),
            PpSchedule::Kind(k) => write!(f, "{k}"),
        }
    }
}

impl FromStr for PpSchedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.trim().to_ascii_lowercase().replace('_', "-");
        if l == "interleaved" || l == "interleaved-1f1b" {
            return Ok(PpSchedule::Interleaved);
        }
        match l.parse::<ScheduleKind>() {
            Ok(ScheduleKind::Interleaved { v }) if v < 2 => Err(format!(
                "must have at least 2 chunks per rank (interleaved:V with V >= 2), not {s:?}"
            )),
            Ok(k) => Ok(PpSchedule::new(k)),
            Err(_) => Err(format!(
                "must be \"gpipe\", \"1f1b\", \"interleaved\", \"interleaved:V\" or \"zb-h1\", not {s:?}"
            )),
        }
    }
}

serde_as_str!(PpSchedule);

/// `parallel.pp_partition`: how blocks are split into pipeline stages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PpPartition {
    /// Balanced by parameter count (`"balanced"`, or `""`).
    #[default]
    Balanced,
    /// Balanced by the measured time of each block on one micro-batch.
    Time,
    /// Blocks per stage, e.g. `"2,3,3"`.
    Counts(Vec<usize>),
}

impl fmt::Display for PpPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PpPartition::Balanced => f.write_str("balanced"),
            PpPartition::Time => f.write_str("time"),
            PpPartition::Counts(c) => {
                let s: Vec<String> = c.iter().map(usize::to_string).collect();
                f.write_str(&s.join(","))
            }
        }
    }
}

impl FromStr for PpPartition {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        match t.to_ascii_lowercase().as_str() {
            "" | "balanced" => Ok(PpPartition::Balanced),
            "time" => Ok(PpPartition::Time),
            list => list
                .trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map(PpPartition::Counts)
                .map_err(|_| {
                    format!(
                        "must be \"balanced\", \"time\" or block counts per stage like \"2,3,3\", not {s:?}"
                    )
                }),
        }
    }
}

serde_as_str!(PpPartition);

/// The canonical TOML string of `text` parsed as `T`, or the error naming `key`.
pub(crate) fn canonical<T>(key: &str, text: &str) -> Result<toml::Value, String>
where
    T: FromStr<Err = String> + fmt::Display,
{
    text.parse::<T>()
        .map(|v| toml::Value::String(v.to_string()))
        .map_err(|e| format!("{key} {e}"))
}

/// Parses a key's text into its canonical TOML value.
pub(crate) type Parser = fn(&str, &str) -> Result<toml::Value, String>;

/// The parser of each key that holds a choice.
pub(crate) fn parser(key: &str) -> Option<Parser> {
    Some(match key {
        "data.tokenizer" => canonical::<TokenizerSpec>,
        "optim.name" => canonical::<OptimName>,
        "optim.schedule" => canonical::<LrScheduleKind>,
        "optim.warmup_type" => canonical::<WarmupType>,
        "parallel.sharding_strategy" => canonical::<ShardingStrategy>,
        "parallel.pp_schedule" => canonical::<PpSchedule>,
        "parallel.pp_partition" => canonical::<PpPartition>,
        "parallel.comm_hook" => canonical::<CommHookKind>,
        "train.on_nonfinite" => canonical::<OnNonfinite>,
        "train.device" => canonical::<DeviceKind>,
        "zero_optimization.offload_optimizer.device" | "zero_optimization.offload_param.device" => {
            canonical::<OffloadDevice>
        }
        _ => return None,
    })
}
