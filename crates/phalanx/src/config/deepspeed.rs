//! DeepSpeed JSON configs (`ds_config.json`), translated into the same
//! `section.key` table a TOML file gives, so that `--set` overrides apply on
//! top and every later check is shared.
//!
//! Every key is accounted for: a key Phalanx maps is translated; a key
//! DeepSpeed has but that has no effect here is accepted with a warning
//! naming it; any other key is an error naming its JSON path.
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
//!
//! A JSON file means what it means to DeepSpeed: keys it omits take
//! DeepSpeed's defaults where DeepSpeed has one — no `gradient_clipping` is
//! no clipping, no `scheduler` is a constant learning rate, `optimizer.params`
//! omitted take FusedAdam's / SGD's defaults (lr 1e-3, betas [0.9, 0.999],
//! eps 1e-8, weight_decay 0, momentum 0), scheduler params omitted take the
//! scheduler's (WarmupLR: warmup_max_lr 1e-3, 1000 warmup steps, "log"
//! warmup). What DeepSpeed does not configure (model, data, train.steps)
//! keeps Phalanx's defaults.
//!
//! Activation checkpointing: DeepSpeed recomputes whatever the model wraps in
//! `checkpoint()`; Phalanx's blocks are its checkpoint units, so an
//! `activation_checkpointing` section with `partition_activations`,
//! `cpu_checkpointing` or `number_checkpoints` turns
//! `train.activation_checkpointing` on (unless it is set explicitly):
//! `number_checkpoints = n` recomputes every `ceil(n_layer / n)`-th block
//! (about n checkpoints), otherwise every block ("full").

use super::{AutoValue, ConfigError, Precision, Recompute, Result, TrainConfig};
use serde_json::Value as J;
use toml::Value as T;

/// What can only be settled once the model (or the final config) is known.
#[derive(Debug, Default)]
pub(crate) struct Extra {
    /// `None`: leave checkpointing alone; `Some(None)`: every block;
    /// `Some(Some(n))`: about n checkpoints.
    recompute: Option<Option<usize>>,
    /// WarmupCosineLR's ratios: `optim.KEY = optim.lr x ratio`, with the
    /// final `optim.lr` (the file's, or `--set`'s, or Phalanx's).
    lr_ratios: Vec<(&'static str, f64)>,
}

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
    file: String,
    keys: Vec<(String, Via)>,
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
        let derived = |d: super::batch::Derive| {
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
                        format!(
                            "train.micro_batch_size{}",
                            derived(super::batch::Derive::Micro)
                        ),
                    ),
                    Via::Accum => (
                        Some(a.to_string()),
                        format!(
                            "train.grad_accum_steps{}",
                            derived(super::batch::Derive::Accum)
                        ),
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

fn is_auto(v: &J) -> bool {
    matches!(v, J::String(s) if s.eq_ignore_ascii_case("auto"))
}

impl Extra {
    /// WarmupCosineLR's `optim.min_lr` / `optim.warmup_min_lr` from the
    /// final `optim.lr`, unless the key was given (`--set`).
    pub(crate) fn apply_lr_ratios(&self, cfg: &mut TrainConfig, given: impl Fn(&str) -> bool) {
        for &(key, ratio) in &self.lr_ratios {
            if given(key) {
                continue;
            }
            let v = cfg.optim.lr * ratio;
            match key {
                "min_lr" => cfg.optim.min_lr = v,
                _ => cfg.optim.warmup_min_lr = v,
            }
        }
    }

    pub(crate) fn apply_recompute(&self, cfg: &mut TrainConfig, warnings: &mut Vec<String>) {
        cfg.train.activation_checkpointing = match self.recompute {
            None => return,
            Some(None) => Recompute::Full,
            Some(Some(n)) => match cfg.model_facts.n_layer {
                Some(layers) => match layers.div_ceil(n.max(1)) {
                    0 | 1 => Recompute::Full,
                    k => Recompute::Every(k),
                },
                None => {
                    warnings.push(format!(
                        "DeepSpeed key \"activation_checkpointing.number_checkpoints\" = {n}: the model \
                         section does not say how many layers there are; recomputing every block"
                    ));
                    Recompute::Full
                }
            },
        };
    }
}

/// Translate the DeepSpeed config `text` (from the file `label`).
pub(crate) fn translate(
    text: &str,
    label: &str,
    warnings: &mut Vec<String>,
) -> Result<(toml::Table, Extra, Autos)> {
    let json: J = serde_json::from_str(text).map_err(|e| ConfigError(format!("{label}: {e}")))?;
    let J::Object(top) = &json else {
        return Err(ConfigError(format!(
            "{label}: a DeepSpeed config is a JSON object"
        )));
    };
    let mut tx = Tx {
        label,
        out: toml::Table::new(),
        warnings,
        extra: Extra::default(),
        explicit_lr: None,
        autos: Autos {
            file: label.to_string(),
            keys: Vec::new(),
        },
    };
    // DeepSpeed's defaults where they differ from Phalanx's.
    tx.set("optim.grad_clip", T::Float(0.0));
    tx.set("optim.schedule", T::String("constant".into()));
    tx.set("optim.warmup_steps", T::Integer(0));
    // The optimizer first: the scheduler reads (and may replace) its lr.
    if let Some(o) = top.get("optimizer") {
        tx.optimizer(o)?;
    }
    for (k, v) in top {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "train_batch_size" if is_auto(v) => tx.auto(k, Via::GlobalBatch),
            "train_micro_batch_size_per_gpu" if is_auto(v) => tx.auto(k, Via::Micro),
            "gradient_accumulation_steps" if is_auto(v) => tx.auto(k, Via::Accum),
            "train_batch_size" => tx.int(k, v, "train.global_batch_size")?,
            "train_micro_batch_size_per_gpu" => tx.int(k, v, "train.micro_batch_size")?,
            "gradient_accumulation_steps" => tx.int(k, v, "train.grad_accum_steps")?,
            "steps_per_print" => tx.int(k, v, "log.interval")?,
            "gradient_clipping" => tx.num(k, v, "optim.grad_clip")?,
            "fp16" => tx.fp16(v)?,
            "bf16" | "bfloat16" => tx.section(k, v, |tx, key, path, v| match key {
                "enabled" if is_auto(v) => {
                    tx.auto(path, Via::Enabled(Precision::Bf16));
                    Ok(())
                }
                "enabled" => tx.boolean(path, v, "bf16.enabled"),
                _ => Err(tx.unknown(path)),
            })?,
            "amp" => tx.amp(v)?,
            "zero_optimization" => tx.zero(v)?,
            "optimizer" => {} // above
            "scheduler" => tx.scheduler(v)?,
            "activation_checkpointing" => tx.checkpointing(v)?,
            "communication_data_type" if is_auto(v) => {
                tx.auto(k, Via::Key("train.reduce_dtype".into()))
            }
            "communication_data_type" => {
                let p: Precision = tx
                    .string(k, v)?
                    .parse()
                    .map_err(|e: String| tx.err(k, &e))?;
                tx.set("train.reduce_dtype", T::String(p.name().into()));
            }
            "gradient_predivide_factor" | "prescale_gradients" if is_auto(v) => tx.no_effect(
                k,
                v,
                "Phalanx averages gradients in one division after the reduction",
            ),
            "gradient_predivide_factor" => {
                if tx.float(k, v)? != 1.0 {
                    tx.warn(
                        k,
                        "Phalanx averages gradients in one division after the reduction",
                    );
                }
            }
            "prescale_gradients" => {
                if tx.boolean_value(k, v)? {
                    tx.warn(
                        k,
                        "Phalanx averages gradients in one division after the reduction",
                    );
                }
            }
            "sparse_gradients" => tx.only(k, v, false)?,
            "wall_clock_breakdown" | "memory_breakdown" => {
                tx.no_effect(k, v, "Phalanx logs step times with log.interval / log.json")
            }
            "zero_allow_untested_optimizer" | "zero_force_ds_cpu_optimizer" => {
                tx.no_effect(k, v, "Phalanx's ZeRO runs with every optimizer it has")
            }
            "tensorboard" | "wandb" | "csv_monitor" | "comms_logger" | "flops_profiler"
            | "dump_state" => tx.no_effect(k, v, "Phalanx writes metrics to log.json instead"),
            _ => return Err(tx.unknown(k)),
        }
    }
    // A file without "auto" has nothing to say (and equals its TOML twin).
    let autos = if tx.autos.keys.is_empty() {
        Autos::default()
    } else {
        tx.autos
    };
    Ok((tx.out, tx.extra, autos))
}

struct Tx<'a> {
    label: &'a str,
    out: toml::Table,
    warnings: &'a mut Vec<String>,
    extra: Extra,
    /// optimizer.params.lr, when given.
    explicit_lr: Option<f64>,
    /// The keys given as "auto".
    autos: Autos,
}

type Handler<'a> = fn(&mut Tx<'a>, &str, &str, &J) -> Result<()>;

impl<'a> Tx<'a> {
    fn err(&self, path: &str, msg: &str) -> ConfigError {
        ConfigError(format!("{}: DeepSpeed key \"{path}\" {msg}", self.label))
    }

    fn unknown(&self, path: &str) -> ConfigError {
        ConfigError(format!("{}: unknown DeepSpeed key \"{path}\"", self.label))
    }

    /// `path` was "auto": record where its value comes from, and leave the
    /// Phalanx keys it names to Phalanx (dropping DeepSpeed's defaults).
    fn auto(&mut self, path: &str, via: Via) {
        for k in via.keys() {
            self.unset(k);
        }
        self.note(path, via);
    }

    /// Record an "auto" without touching the translated keys.
    fn note(&mut self, path: &str, via: Via) {
        self.autos.keys.push((path.to_string(), via));
    }

    /// A key with no effect in Phalanx: a warning naming it, or (as "auto")
    /// a line in the auto summary.
    fn no_effect(&mut self, path: &str, v: &J, why: &str) {
        if is_auto(v) {
            self.note(path, Via::Ignored(format!("no effect in Phalanx: {why}")));
        } else {
            self.warn(path, why);
        }
    }

    fn warn(&mut self, path: &str, why: &str) {
        let w = format!(
            "{}: DeepSpeed key \"{path}\" has no effect in Phalanx ({why})",
            self.label
        );
        if !self.warnings.contains(&w) {
            self.warnings.push(w);
        }
    }

    /// Set `a.b.c` in the output table.
    fn set(&mut self, key: &str, v: T) {
        let parts: Vec<&str> = key.split('.').collect();
        let mut t = &mut self.out;
        for p in &parts[..parts.len() - 1] {
            t = t
                .entry(p.to_string())
                .or_insert_with(|| T::Table(toml::Table::new()))
                .as_table_mut()
                .expect("translated sections are tables");
        }
        t.insert(parts[parts.len() - 1].to_string(), v);
    }

    /// Remove `a.b.c` from the output table, if there.
    fn unset(&mut self, key: &str) {
        let parts: Vec<&str> = key.split('.').collect();
        let mut t = &mut self.out;
        for p in &parts[..parts.len() - 1] {
            match t.get_mut(*p).and_then(T::as_table_mut) {
                Some(inner) => t = inner,
                None => return,
            }
        }
        t.remove(parts[parts.len() - 1]);
    }

    fn float(&self, path: &str, v: &J) -> Result<f64> {
        v.as_f64()
            .ok_or_else(|| self.err(path, &format!("must be a number, not {v}")))
    }

    fn uint(&self, path: &str, v: &J) -> Result<i64> {
        match v.as_u64() {
            Some(u) => Ok(u as i64),
            None => match v.as_f64() {
                Some(f) if f >= 0.0 && f.fract() == 0.0 => Ok(f as i64),
                _ => Err(self.err(path, &format!("must be a non-negative integer, not {v}"))),
            },
        }
    }

    fn boolean_value(&self, path: &str, v: &J) -> Result<bool> {
        v.as_bool()
            .ok_or_else(|| self.err(path, &format!("must be true or false, not {v}")))
    }

    fn string(&self, path: &str, v: &J) -> Result<String> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.err(path, &format!("must be a string, not {v}")))
    }

    fn int(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        if is_auto(v) {
            self.auto(path, Via::Key(to.into()));
            return Ok(());
        }
        let i = self.uint(path, v)?;
        self.set(to, T::Integer(i));
        Ok(())
    }

    fn num(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        if is_auto(v) {
            self.auto(path, Via::Key(to.into()));
            return Ok(());
        }
        let f = self.float(path, v)?;
        self.set(to, T::Float(f));
        Ok(())
    }

    fn boolean(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        if is_auto(v) {
            self.auto(path, Via::Key(to.into()));
            return Ok(());
        }
        let b = self.boolean_value(path, v)?;
        self.set(to, T::Boolean(b));
        Ok(())
    }

    fn text(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        if is_auto(v) {
            self.auto(path, Via::Key(to.into()));
            return Ok(());
        }
        let s = self.string(path, v)?;
        self.set(to, T::String(s));
        Ok(())
    }

    /// A key DeepSpeed allows several values for, of which Phalanx has one
    /// (which is what "auto" is).
    fn only(&mut self, path: &str, v: &J, ok: bool) -> Result<()> {
        if is_auto(v) {
            self.note(
                path,
                Via::Fixed(ok.to_string(), "the only value Phalanx has".into()),
            );
            return Ok(());
        }
        if self.boolean_value(path, v)? != ok {
            return Err(self.err(
                path,
                &format!("= {} is not supported in Phalanx (only {ok})", !ok),
            ));
        }
        Ok(())
    }

    /// Walk the JSON object `v` at `path`, calling `f(tx, key, key_path, value)`
    /// for each non-null entry.
    fn section(&mut self, path: &str, v: &J, f: Handler<'a>) -> Result<()> {
        let J::Object(m) = v else {
            return Err(self.err(path, &format!("must be an object, not {v}")));
        };
        for (k, v) in m {
            if !v.is_null() {
                f(self, k, &format!("{path}.{k}"), v)?;
            }
        }
        Ok(())
    }

    fn fp16(&mut self, v: &J) -> Result<()> {
        self.section("fp16", v, |tx, key, p, v| match key {
            "enabled" if is_auto(v) => {
                tx.auto(p, Via::Enabled(Precision::Fp16));
                Ok(())
            }
            "enabled" => tx.boolean(p, v, "fp16.enabled"),
            "loss_scale" => tx.num(p, v, "fp16.loss_scale"),
            "initial_scale_power" => tx.int(p, v, "fp16.initial_scale_power"),
            "loss_scale_window" => tx.int(p, v, "fp16.loss_scale_window"),
            "hysteresis" => tx.int(p, v, "fp16.hysteresis"),
            "min_loss_scale" => tx.num(p, v, "fp16.min_loss_scale"),
            "consecutive_hysteresis" | "auto_cast" => tx.only(p, v, false),
            _ => Err(tx.unknown(p)),
        })
    }

    /// NVIDIA Apex AMP: Phalanx has none, so only a section that leaves it
    /// off (`enabled` false, absent, or "auto": Hugging Face fills in true
    /// only for its Apex backend) is accepted.
    fn amp(&mut self, v: &J) -> Result<()> {
        let J::Object(m) = v else {
            return Err(self.err("amp", &format!("must be an object, not {v}")));
        };
        let off = "amp is off (Phalanx has no NVIDIA Apex AMP)";
        for (k, v) in m {
            let p = format!("amp.{k}");
            match k.as_str() {
                _ if v.is_null() => {}
                "enabled" if is_auto(v) => self.note(
                    &p,
                    Via::Fixed(
                        "false".into(),
                        "Phalanx has no NVIDIA Apex AMP; bf16 / fp16 are its mixed precision"
                            .into(),
                    ),
                ),
                "enabled" => {
                    if self.boolean_value(&p, v)? {
                        return Err(self.err(
                            "amp",
                            "(NVIDIA Apex AMP) is not implemented in Phalanx; use \"bf16\" or \"fp16\" instead",
                        ));
                    }
                }
                _ => self.no_effect(&p, v, off),
            }
        }
        Ok(())
    }

    fn zero(&mut self, v: &J) -> Result<()> {
        self.section("zero_optimization", v, |tx, key, p, v| match key {
            "stage" if is_auto(v) => {
                tx.auto(p, Via::Stage);
                Ok(())
            }
            "stage" => tx.int(p, v, "zero_optimization.stage"),
            "offload_optimizer" | "offload_param" => {
                tx.section(p, v, |tx, key, p, v| {
                    // The JSON path is the Phalanx key.
                    let to = |k: &str| format!("{}.{k}", &p[..p.rfind('.').unwrap_or(0)]);
                    match key {
                        "device" => tx.text(p, v, &to("device")),
                        "nvme_path" => tx.text(p, v, &to("nvme_path")),
                        "buffer_size" if p.contains("offload_param") => {
                            tx.int(p, v, &to("buffer_size"))
                        }
                        "pin_memory" => {
                            tx.no_effect(p, v, "pinned host memory matters for GPU copies; on CPU the state is already in host memory");
                            Ok(())
                        }
                        "buffer_count" | "buffer_size" | "max_in_cpu" | "fast_init" => {
                            tx.no_effect(p, v, "Phalanx streams offloaded state in fixed-size chunks");
                            Ok(())
                        }
                        _ => Err(tx.unknown(p)),
                    }
                })
            }
            "overlap_comm" => tx.boolean(p, v, "zero_optimization.overlap_comm"),
            "contiguous_gradients" => tx.boolean(p, v, "zero_optimization.contiguous_gradients"),
            "reduce_bucket_size" if is_auto(v) => {
                tx.auto(p, Via::Bucket);
                Ok(())
            }
            "reduce_bucket_size" => tx.num(p, v, "zero_optimization.reduce_bucket_size"),
            "stage3_prefetch_bucket_size" if is_auto(v) => {
                tx.auto(p, Via::Prefetch);
                Ok(())
            }
            "stage3_prefetch_bucket_size" => {
                tx.num(p, v, "zero_optimization.stage3_prefetch_bucket_size")
            }
            "zero_quantized_weights" => tx.boolean(p, v, "zero_optimization.zero_quantized_weights"),
            "zero_quantized_gradients" => {
                tx.boolean(p, v, "zero_optimization.zero_quantized_gradients")
            }
            "zero_hpz_partition_size" => tx.int(p, v, "zero_optimization.zero_hpz_partition_size"),
            "reduce_scatter" => tx.only(p, v, true),
            "allgather_bucket_size" | "allgather_partitions" => {
                tx.no_effect(p, v, "Phalanx gathers parameters per block");
                Ok(())
            }
            "stage3_param_persistence_threshold"
            | "stage3_max_live_parameters"
            | "stage3_max_reuse_distance"
            | "stage3_gather_16bit_weights_on_model_save"
            | "sub_group_size"
            | "round_robin_gradients"
            | "elastic_checkpoint"
            | "load_from_fp32_weights"
            | "ignore_unused_parameters" => {
                tx.no_effect(p, v, "Phalanx shards and gathers whole blocks; this tuning knob does not apply");
                Ok(())
            }
            _ => Err(tx.unknown(p)),
        })
    }

    fn optimizer(&mut self, v: &J) -> Result<()> {
        let J::Object(m) = v else {
            return Err(self.err("optimizer", &format!("must be an object, not {v}")));
        };
        let ty = match m.get("type") {
            Some(t) if is_auto(t) => None,
            Some(t) => Some(self.string("optimizer.type", t)?),
            None => return Err(self.err("optimizer", "needs a \"type\"")),
        };
        match ty {
            // Phalanx's optimizer, with its own values for the params omitted.
            None => self.auto("optimizer.type", Via::Key("optim.name".into())),
            Some(ty) => {
                let name = match ty.to_ascii_lowercase().as_str() {
                    "adamw" => "adamw",
                    "adam" => "adam",
                    "sgd" => "sgd",
                    _ => {
                        return Err(self.err(
                            "optimizer.type",
                            &format!(
                                "= {ty:?} is not an optimizer Phalanx has (AdamW, Adam or SGD)"
                            ),
                        ))
                    }
                };
                self.set("optim.name", T::String(name.into()));
                // FusedAdam's / torch SGD's defaults for what params omit.
                self.set("optim.lr", T::Float(1e-3));
                self.set("optim.weight_decay", T::Float(0.0));
                if name == "sgd" {
                    self.set("optim.momentum", T::Float(0.0));
                } else {
                    self.set(
                        "optim.betas",
                        T::Array(vec![T::Float(0.9), T::Float(0.999)]),
                    );
                    self.set("optim.eps", T::Float(1e-8));
                }
            }
        }
        for (k, v) in m {
            match k.as_str() {
                "type" => {}
                "params" => self.section("optimizer.params", v, |tx, key, p, v| match key {
                    "lr" => {
                        if !is_auto(v) {
                            tx.explicit_lr = Some(tx.float(p, v)?);
                        }
                        tx.num(p, v, "optim.lr")
                    }
                    "eps" => tx.num(p, v, "optim.eps"),
                    "weight_decay" => tx.num(p, v, "optim.weight_decay"),
                    "momentum" => tx.num(p, v, "optim.momentum"),
                    "betas" if is_auto(v) => {
                        tx.auto(p, Via::Key("optim.betas".into()));
                        Ok(())
                    }
                    "betas" => {
                        let b = v.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                            tx.err(p, &format!("must be two numbers [beta1, beta2], not {v}"))
                        })?;
                        let b = [tx.float(p, &b[0])?, tx.float(p, &b[1])?];
                        tx.set(
                            "optim.betas",
                            T::Array(vec![T::Float(b[0]), T::Float(b[1])]),
                        );
                        Ok(())
                    }
                    "adam_w_mode" | "bias_correction" => tx.only(p, v, true),
                    "amsgrad" | "nesterov" => tx.only(p, v, false),
                    "torch_adam" | "fused" => {
                        tx.no_effect(p, v, "Phalanx has one fused AdamW loop");
                        Ok(())
                    }
                    _ => Err(tx.unknown(p)),
                })?,
                _ => return Err(self.unknown(&format!("optimizer.{k}"))),
            }
        }
        Ok(())
    }

    fn scheduler(&mut self, v: &J) -> Result<()> {
        let J::Object(m) = v else {
            return Err(self.err("scheduler", &format!("must be an object, not {v}")));
        };
        for k in m.keys() {
            if k != "type" && k != "params" {
                return Err(self.unknown(&format!("scheduler.{k}")));
            }
        }
        // None: "auto", Phalanx's own schedule (optim.schedule).
        let ty = match m.get("type") {
            Some(t) if is_auto(t) => None,
            Some(t) => Some(self.string("scheduler.type", t)?),
            None => return Err(self.err("scheduler", "needs a \"type\"")),
        };
        let empty = J::Object(Default::default());
        let params = match m.get("params").unwrap_or(&empty) {
            J::Object(p) => p,
            other => {
                return Err(self.err(
                    "scheduler.params",
                    &format!("must be an object, not {other}"),
                ))
            }
        };
        let warmup_keys = [
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
        ];
        let allowed: &[&str] = match ty.as_deref() {
            None | Some("WarmupDecayLR") => &warmup_keys,
            Some("WarmupLR") => &warmup_keys[..4],
            Some("WarmupCosineLR") => &[
                "total_num_steps",
                "warmup_min_ratio",
                "cos_min_ratio",
                "warmup_num_steps",
                "warmup_type",
            ],
            Some(ty) => {
                return Err(self.err(
                    "scheduler.type",
                    &format!("= {ty:?} is not a schedule Phalanx has (WarmupLR, WarmupDecayLR or WarmupCosineLR)"),
                ))
            }
        };
        for (k, v) in params {
            if k == "last_batch_iteration" && (v.as_i64() == Some(-1) || is_auto(v)) {
                if is_auto(v) {
                    self.note(
                        "scheduler.params.last_batch_iteration",
                        Via::Fixed(
                            "-1".into(),
                            "a fresh schedule; a resumed run restores its step from the checkpoint"
                                .into(),
                        ),
                    );
                }
                continue;
            }
            if ty.is_none() && matches!(k.as_str(), "cos_min_ratio" | "warmup_min_ratio") {
                return Err(self.err(
                    &format!("scheduler.params.{k}"),
                    "is WarmupCosineLR's, but scheduler.type is \"auto\"; give the type",
                ));
            }
            if !allowed.contains(&k.as_str()) {
                return Err(self.unknown(&format!("scheduler.params.{k}")));
            }
        }
        let path = |k: &str| format!("scheduler.params.{k}");
        // Some(None): "auto"; None: absent.
        let p = |k: &str| match params.get(k).filter(|v| !v.is_null()) {
            None => None,
            Some(v) if is_auto(v) => Some(None),
            Some(v) => Some(Some(v)),
        };
        match ty {
            // Phalanx's own schedule: its values for what params omit.
            None => {
                self.auto("scheduler.type", Via::Key("optim.schedule".into()));
                self.unset("optim.warmup_steps");
            }
            Some(ref ty) => {
                let name = match ty.as_str() {
                    "WarmupLR" => "warmup_constant",
                    "WarmupDecayLR" => "warmup_linear",
                    _ => "cosine",
                };
                self.set("optim.schedule", T::String(name.into()));
            }
        }
        let defaults = ty.is_some();
        match p("warmup_num_steps") {
            Some(None) => self.auto(
                &path("warmup_num_steps"),
                Via::Key("optim.warmup_steps".into()),
            ),
            Some(Some(v)) => {
                let n = self.uint(&path("warmup_num_steps"), v)?;
                self.set("optim.warmup_steps", T::Integer(n));
            }
            None if defaults => self.set("optim.warmup_steps", T::Integer(1000)),
            None => {}
        }
        match p("warmup_type") {
            Some(None) => self.auto(&path("warmup_type"), Via::Key("optim.warmup_type".into())),
            Some(Some(v)) => {
                let w = self.string(&path("warmup_type"), v)?;
                if !matches!(w.as_str(), "linear" | "log") {
                    return Err(self.err(
                        &path("warmup_type"),
                        &format!("= {w:?} is not \"linear\" or \"log\""),
                    ));
                }
                self.set("optim.warmup_type", T::String(w));
            }
            None if defaults => self.set("optim.warmup_type", T::String("log".into())),
            None => {}
        }
        match p("total_num_steps") {
            Some(None) => self.auto(&path("total_num_steps"), Via::DecaySteps),
            Some(Some(v)) => {
                let n = self.uint(&path("total_num_steps"), v)?;
                self.set("optim.decay_steps", T::Integer(n));
            }
            None => {
                if let Some(t @ ("WarmupDecayLR" | "WarmupCosineLR")) = ty.as_deref() {
                    return Err(
                        self.err("scheduler.params", &format!("of {t} needs total_num_steps"))
                    );
                }
            }
        }
        if ty.as_deref() == Some("WarmupCosineLR") {
            // Ratios of the optimizer's lr, applied to the final optim.lr.
            for (k, to, d) in [
                ("cos_min_ratio", "min_lr", 1e-4),
                ("warmup_min_ratio", "warmup_min_lr", 0.0),
            ] {
                match p(k) {
                    Some(None) => self.auto(&path(k), Via::Key(format!("optim.{to}"))),
                    Some(Some(v)) => {
                        let r = self.float(&path(k), v)?;
                        self.extra.lr_ratios.push((to, r));
                    }
                    None => self.extra.lr_ratios.push((to, d)),
                }
            }
            return Ok(());
        }
        // WarmupLR / WarmupDecayLR (or "auto"): warmup_min_lr is where the
        // warmup starts (and WarmupDecayLR's decay ends).
        let decay = ty.as_deref() == Some("WarmupDecayLR");
        match p("warmup_min_lr") {
            Some(None) => {
                let via = if decay {
                    Via::Also("optim.warmup_min_lr".into(), "optim.min_lr".into())
                } else {
                    Via::Key("optim.warmup_min_lr".into())
                };
                self.auto(&path("warmup_min_lr"), via);
            }
            given => {
                let min_lr = match given {
                    Some(Some(v)) => Some(self.float(&path("warmup_min_lr"), v)?),
                    _ => defaults.then_some(0.0),
                };
                if let Some(min_lr) = min_lr {
                    self.set("optim.warmup_min_lr", T::Float(min_lr));
                    if decay {
                        self.set("optim.min_lr", T::Float(min_lr));
                    }
                }
            }
        }
        // As in DeepSpeed, the scheduler's warmup_max_lr is the lr; "auto"
        // leaves optim.lr as the optimizer section (or Phalanx) has it.
        let max_lr = match p("warmup_max_lr") {
            Some(None) => {
                self.note(&path("warmup_max_lr"), Via::Key("optim.lr".into()));
                None
            }
            Some(Some(v)) => Some(self.float(&path("warmup_max_lr"), v)?),
            None => defaults.then_some(1e-3),
        };
        if let Some(max_lr) = max_lr {
            if let Some(opt_lr) = self.explicit_lr {
                if opt_lr != max_lr {
                    let w = format!(
                        "{}: scheduler.params.warmup_max_lr = {max_lr} replaces optimizer.params.lr = {opt_lr} (as in DeepSpeed, the scheduler's wins)",
                        self.label
                    );
                    self.warnings.push(w);
                }
            }
            self.set("optim.lr", T::Float(max_lr));
        }
        Ok(())
    }

    fn checkpointing(&mut self, v: &J) -> Result<()> {
        self.section("activation_checkpointing", v, |tx, key, p, v| match key {
            "partition_activations" | "cpu_checkpointing" if is_auto(v) => {
                tx.auto(p, Via::Key(format!("activation_checkpointing.{key}")));
                Ok(())
            }
            "partition_activations" | "cpu_checkpointing" => {
                let b = tx.boolean_value(p, v)?;
                tx.set(&format!("activation_checkpointing.{key}"), T::Boolean(b));
                if b && tx.extra.recompute.is_none() {
                    tx.extra.recompute = Some(None);
                }
                Ok(())
            }
            "number_checkpoints" if is_auto(v) => {
                tx.note(p, Via::Key("train.activation_checkpointing".into()));
                Ok(())
            }
            "number_checkpoints" => {
                let n = tx.uint(p, v)?;
                if n == 0 {
                    return Err(tx.err(p, "must be at least 1"));
                }
                tx.extra.recompute = Some(Some(n as usize));
                Ok(())
            }
            "contiguous_memory_optimization" | "synchronize_checkpoint_boundary" | "profile" => {
                tx.no_effect(
                    p,
                    v,
                    "Phalanx saves one block input per checkpoint, contiguous already",
                );
                Ok(())
            }
            _ => Err(tx.unknown(p)),
        })
    }
}
