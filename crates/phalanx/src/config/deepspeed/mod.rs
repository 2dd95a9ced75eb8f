//! DeepSpeed JSON configs (`ds_config.json`), translated into the same
//! `section.key` table a TOML file gives, so that `--set` overrides apply on
//! top and every later check is shared.
//!
//! This file holds the entry point ([`translate`]), the top-level key
//! mapping, the translator's primitives ([`Tx`]) and what is settled only
//! once the model is known ([`Extra`]); the nested sections' tables (fp16,
//! amp, ZeRO, optimizer, scheduler, activation checkpointing) are in
//! [`sections`], and everything about `"auto"` values (where each comes
//! from, and the summary of what each became) is in [`auto`], so that the
//! key mapping reads without the auto bookkeeping in the way.
//!
//! Every key is accounted for: a key Phalanx maps is translated; a key
//! DeepSpeed has but that has no effect here is accepted with a warning
//! naming it; any other key is an error naming its JSON path.
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

mod auto;
mod sections;

pub(crate) use auto::Autos;

use super::{ConfigError, Precision, Recompute, Result, TrainConfig};
use auto::{is_auto, Via};
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
    /// `scheduler.params.total_num_steps`, when given.
    total_num_steps: Option<usize>,
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

    /// A note where the schedule's length (`total_num_steps`) is not the
    /// run's (`train.steps`): DeepSpeed's runs end where the script says.
    pub(crate) fn check_length(&self, cfg: &TrainConfig, warnings: &mut Vec<String>) {
        match self.total_num_steps {
            Some(n) if n != cfg.train.steps => warnings.push(format!(
                "DeepSpeed key \"scheduler.params.total_num_steps\" = {n} is the schedule's \
                 length; the run's is train.steps = {} (set it too for a run of {n} steps)",
                cfg.train.steps
            )),
            _ => {}
        }
    }

    pub(crate) fn apply_recompute(&self, cfg: &mut TrainConfig, warnings: &mut Vec<String>) {
        let ac = &cfg.activation_checkpointing;
        cfg.train.activation_checkpointing = match self.recompute {
            None => return,
            // Turned on by a flag the file set: decided on the merged
            // section, where `--set` may have turned the flag off again.
            Some(None) if !(ac.partition_activations || ac.cpu_checkpointing) => return,
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
    if let Some(key) = duplicate_key(text) {
        // (serde_json keeps the last silently; DeepSpeed refuses the file.)
        return Err(ConfigError(format!(
            "{label}: DeepSpeed key \"{key}\" is given twice (DeepSpeed refuses duplicate keys)"
        )));
    }
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
    match top.get("optimizer").filter(|o| !o.is_null()) {
        Some(o) => tx.optimizer(o)?,
        None => {
            // DeepSpeed then takes the script's optimizer; here it is
            // Phalanx's optim section, which the user should know.
            let o = super::OptimConfig::default();
            tx.warnings.push(format!(
                "{label}: no DeepSpeed \"optimizer\" section (DeepSpeed would take the script's \
                 optimizer): training with Phalanx's optim section, by default {} lr {} betas \
                 {:?} eps {:e} weight_decay {} (set optim.* to change it)",
                o.name, o.lr, o.betas, o.eps, o.weight_decay
            ));
        }
    }
    let batch_keys = ["train_batch_size", "train_micro_batch_size_per_gpu"];
    if !batch_keys
        .iter()
        .any(|k| top.get(*k).is_some_and(|v| !v.is_null()))
    {
        tx.warnings.push(format!(
            "{label}: neither train_batch_size nor train_micro_batch_size_per_gpu (DeepSpeed \
             refuses such a file): the batch is Phalanx's train section's (set \
             train.micro_batch_size or train.global_batch_size)"
        ));
    }
    for (k, v) in top {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "train_batch_size" if is_auto(v) => tx.auto(k, Via::GlobalBatch),
            "train_micro_batch_size_per_gpu" if is_auto(v) => tx.auto(k, Via::Micro),
            "gradient_accumulation_steps" if is_auto(v) => tx.auto(k, Via::Accum),
            "train_batch_size" => tx.count(k, v, "train.global_batch_size")?,
            "train_micro_batch_size_per_gpu" => tx.count(k, v, "train.micro_batch_size")?,
            "gradient_accumulation_steps" => tx.count(k, v, "train.grad_accum_steps")?,
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
            // Async I/O tuning of NVMe offload (libaio).
            "aio" => tx.no_effect(
                k,
                v,
                "Phalanx reads and writes offloaded state with plain file I/O in fixed-size chunks",
            ),
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

/// The first key given twice in one JSON object of `text` (its path, as
/// `zero_optimization.stage`), or `None` (also for text that is not JSON:
/// the parse proper reports that).
fn duplicate_key(text: &str) -> Option<String> {
    use serde::de::{DeserializeSeed, Error as _, MapAccess, SeqAccess, Visitor};
    use std::cell::RefCell;
    struct Seed<'r> {
        path: String,
        found: &'r RefCell<Option<String>>,
    }
    impl<'de> DeserializeSeed<'de> for Seed<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Seed<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> std::result::Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> std::result::Result<(), A::Error> {
            let mut i = 0;
            while s
                .next_element_seed(Seed {
                    path: format!("{}[{i}]", self.path),
                    found: self.found,
                })?
                .is_some()
            {
                i += 1;
            }
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(k) = m.next_key::<String>()? {
                let path = match self.path.as_str() {
                    "" => k.clone(),
                    p => format!("{p}.{k}"),
                };
                if !seen.insert(k) {
                    *self.found.borrow_mut() = Some(path);
                    return Err(A::Error::custom("a duplicate key"));
                }
                m.next_value_seed(Seed {
                    path,
                    found: self.found,
                })?;
            }
            Ok(())
        }
    }
    let found = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let _ = Seed {
        path: String::new(),
        found: &found,
    }
    .deserialize(&mut de);
    found.into_inner()
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

    /// A non-negative integer of at most 2^40 (no count in a config is
    /// larger; a bigger one would wrap or saturate where it is used).
    fn uint(&self, path: &str, v: &J) -> Result<i64> {
        const MAX: u64 = 1 << 40;
        let u = match v.as_u64() {
            Some(u) => Some(u),
            None => v
                .as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                .map(|f| if f > MAX as f64 { u64::MAX } else { f as u64 }),
        };
        match u {
            Some(u) if u <= MAX => Ok(u as i64),
            Some(_) => Err(self.err(path, &format!("{v} is larger than any run needs (2^40)"))),
            None => Err(self.err(path, &format!("must be a non-negative integer, not {v}"))),
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

    /// [`Self::int`] for a count that must be at least 1 (a batch size).
    fn count(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        if !is_auto(v) && self.uint(path, v)? == 0 {
            return Err(self.err(path, "must be at least 1, not 0"));
        }
        self.int(path, v, to)
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
}
