//! DeepSpeed `"auto"` values: where each comes from ([`Via`]), the record of
//! a file's autos ([`Autos`]) and what each resolved to in the final config
//! (the summary `phalanx train` prints). Kept apart from the key mapping in
//! the parent module, which only says, key by key, which `Via` an "auto" is.
//!
//! `"auto"` (as Hugging Face's Trainer writes its configs, to be filled in
//! from its own arguments) is Phalanx's own setting for the key: the value
//! the key would have without the DeepSpeed file (Phalanx's default, or
//! `--set`'s), not DeepSpeed's default for an omitted key. So
//! `"gradient_clipping": "auto"` is `optim.grad_clip` (1.0 unless set),
//! `"lr": "auto"` is `optim.lr`, `"warmup_max_lr": "auto"` leaves `optim.lr`
//! as the optimizer section left it, and an auto batch number is derived or
//! defaulted as if the key were not there. An "auto" knob Phalanx has no
//! setting for is accepted where ignoring it changes nothing (a key that
//! already has no effect here, or one of which Phalanx has only one value);
//! anywhere else it is an error naming the key. What each auto became is
//! kept ([`TrainConfig::deepspeed_auto`]) and `phalanx train` prints it once
//! at start.

use super::Tx;
use crate::config::{batch::Derive, AutoValue, Precision, TrainConfig};
use serde_json::Value as J;
use toml::Value as T;

/// Where an `"auto"` key's value comes from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Via {
    /// The Phalanx key of that name.
    Key(String),
    /// The first key, and a second one the DeepSpeed key also sets.
    Also(String, String),
    /// `train_batch_size`: `train.global_batch_size`, or micro x dp x accum.
    GlobalBatch,
    /// `train_micro_batch_size_per_gpu` (given, defaulted or derived).
    Micro,
    /// `gradient_accumulation_steps` (given, defaulted or derived).
    Accum,
    /// `fp16.enabled` / `bf16.enabled`: whether the run computes in it.
    Enabled(Precision),
    /// `reduce_bucket_size` in elements (`parallel.bucket_mb` when 0).
    Bucket,
    /// `stage3_prefetch_bucket_size` (`parallel.forward_prefetch` when 0).
    Prefetch,
    /// `total_num_steps`: `optim.decay_steps`, 0 being `train.steps`.
    DecaySteps,
    /// `zero_optimization.stage` (or `parallel.sharding_strategy`'s).
    Stage,
    /// The one value Phalanx has, and why.
    Fixed(String, String),
    /// A knob with no effect here, and why.
    Ignored(String),
}

impl Via {
    /// The translated keys an "auto" leaves to Phalanx (dropping
    /// DeepSpeed's defaults for them).
    fn keys(&self) -> Vec<&str> {
        match self {
            Via::Key(k) => vec![k],
            Via::Also(a, b) => vec![a, b],
            Via::GlobalBatch => vec!["train.global_batch_size"],
            Via::Micro => vec!["train.micro_batch_size"],
            Via::Accum => vec!["train.grad_accum_steps"],
            Via::Enabled(Precision::Bf16) => vec!["bf16.enabled"],
            Via::Enabled(_) => vec!["fp16.enabled"],
            Via::Bucket => vec!["zero_optimization.reduce_bucket_size"],
            Via::Prefetch => vec!["zero_optimization.stage3_prefetch_bucket_size"],
            Via::DecaySteps => vec!["optim.decay_steps"],
            Via::Stage => vec!["zero_optimization.stage"],
            Via::Fixed(..) | Via::Ignored(_) => vec![],
        }
    }
}

/// The `"auto"` keys of a DeepSpeed file, by JSON path.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Autos {
    pub(super) file: String,
    pub(super) keys: Vec<(String, Via)>,
}

impl Autos {
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub(crate) fn file(&self) -> &str {
        &self.file
    }

    /// What each auto key resolved to in `cfg`, for `dp` data-parallel ranks.
    pub(crate) fn resolve(&self, cfg: &TrainConfig, dp: usize) -> Vec<AutoValue> {
        let table = toml::Table::try_from(cfg).unwrap_or_default();
        let look = |key: &str| {
            let mut parts = key.split('.');
            let first = parts.next().and_then(|p| table.get(p));
            parts
                .try_fold(first, |v, p| Some(v?.get(p)))
                .flatten()
                .map_or_else(|| "?".to_string(), show)
        };
        let (m, a) = cfg
            .batch_for_dp(dp)
            .unwrap_or((cfg.train.micro_batch_size, cfg.train.grad_accum_steps));
        let derived = |d: Derive| {
            if cfg.derive == d {
                " (derived from train.global_batch_size)"
            } else {
                ""
            }
        };
        let mut out: Vec<AutoValue> = self
            .keys
            .iter()
            .map(|(path, via)| {
                let (value, from) = match via {
                    Via::Key(k) => (Some(look(k)), k.clone()),
                    Via::Also(k, also) => (Some(look(k)), format!("{k}; {also} = {}", look(also))),
                    Via::GlobalBatch => match cfg.train.global_batch_size {
                        0 => (
                            Some((m * dp.max(1) * a).to_string()),
                            format!(
                                "train.micro_batch_size {m} x dp {} x train.grad_accum_steps {a}",
                                dp.max(1)
                            ),
                        ),
                        g => (Some(g.to_string()), "train.global_batch_size".into()),
                    },
                    Via::Micro => (
                        Some(m.to_string()),
                        format!("train.micro_batch_size{}", derived(Derive::Micro)),
                    ),
                    Via::Accum => (
                        Some(a.to_string()),
                        format!("train.grad_accum_steps{}", derived(Derive::Accum)),
                    ),
                    Via::Enabled(p) => (
                        Some((cfg.precision() == *p).to_string()),
                        format!("train.precision = {}", cfg.precision()),
                    ),
                    Via::Bucket => (
                        Some((cfg.bucket_bytes() / 4).to_string()),
                        if cfg.zero_optimization.reduce_bucket_size > 0.0 {
                            "zero_optimization.reduce_bucket_size".into()
                        } else {
                            format!(
                                "elements of parallel.bucket_mb = {:?}",
                                cfg.parallel.bucket_mb
                            )
                        },
                    ),
                    Via::Prefetch => match cfg.zero_optimization.stage3_prefetch_bucket_size {
                        s if s > 0.0 => (
                            Some(format!("{s:?}")),
                            "zero_optimization.stage3_prefetch_bucket_size".into(),
                        ),
                        _ => (
                            Some("0".into()),
                            format!(
                                "ZeRO-3 gathers parallel.forward_prefetch = {} block(s) ahead",
                                cfg.parallel.forward_prefetch
                            ),
                        ),
                    },
                    Via::DecaySteps => match cfg.optim.decay_steps {
                        0 => (
                            Some(cfg.train.steps.to_string()),
                            "optim.decay_steps = 0: train.steps".into(),
                        ),
                        d => (Some(d.to_string()), "optim.decay_steps".into()),
                    },
                    Via::Stage => match cfg.sharding() {
                        Ok(s) if s.stage != cfg.zero_optimization.stage => (
                            Some(s.stage.to_string()),
                            "parallel.sharding_strategy".into(),
                        ),
                        _ => (
                            Some(cfg.zero_optimization.stage.to_string()),
                            "zero_optimization.stage".into(),
                        ),
                    },
                    Via::Fixed(v, why) => (Some(v.clone()), why.clone()),
                    Via::Ignored(why) => (None, why.clone()),
                };
                AutoValue {
                    key: path.clone(),
                    value,
                    from,
                }
            })
            .collect();
        out.sort_by(|x, y| x.key.cmp(&y.key));
        out
    }
}

/// A config value as a person reads it (strings unquoted).
fn show(v: &T) -> String {
    match v {
        T::String(s) => s.clone(),
        T::Float(f) => format!("{f:?}"),
        T::Array(a) => format!("[{}]", a.iter().map(show).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

pub(super) fn is_auto(v: &J) -> bool {
    matches!(v, J::String(s) if s.eq_ignore_ascii_case("auto"))
}

impl Tx<'_> {
    /// `path` was "auto": record where its value comes from, and leave the
    /// Phalanx keys it names to Phalanx (dropping DeepSpeed's defaults).
    pub(super) fn auto(&mut self, path: &str, via: Via) {
        for k in via.keys() {
            self.unset(k);
        }
        self.note(path, via);
    }

    /// Record an "auto" without touching the translated keys.
    pub(super) fn note(&mut self, path: &str, via: Via) {
        self.autos.keys.push((path.to_string(), via));
    }
}
