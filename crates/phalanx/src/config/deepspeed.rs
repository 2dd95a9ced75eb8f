//! DeepSpeed JSON configs (`ds_config.json`), translated into the same
//! `section.key` table a TOML file gives, so that `--set` overrides apply on
//! top and every later check is shared.
//!
//! Every key is accounted for: a key Phalanx maps is translated; a key
//! DeepSpeed has but that has no effect here is accepted with a warning
//! naming it; any other key is an error naming its JSON path. `"auto"`
//! values (filled in by Hugging Face's launcher) are errors.
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

use super::{ConfigError, Precision, Recompute, Result, TrainConfig};
use serde_json::Value as J;
use toml::Value as T;

/// What can only be settled once the model is known.
#[derive(Debug, Default)]
pub(crate) struct Extra {
    /// `None`: leave checkpointing alone; `Some(None)`: every block;
    /// `Some(Some(n))`: about n checkpoints.
    recompute: Option<Option<usize>>,
}

impl Extra {
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
) -> Result<(toml::Table, Extra)> {
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
    };
    tx.no_auto(&json, "")?;
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
            "train_batch_size" => tx.int(k, v, "train.global_batch_size")?,
            "train_micro_batch_size_per_gpu" => tx.int(k, v, "train.micro_batch_size")?,
            "gradient_accumulation_steps" => tx.int(k, v, "train.grad_accum_steps")?,
            "steps_per_print" => tx.int(k, v, "log.interval")?,
            "gradient_clipping" => tx.num(k, v, "optim.grad_clip")?,
            "fp16" => tx.fp16(v)?,
            "bf16" | "bfloat16" => tx.section(k, v, |tx, key, path, v| match key {
                "enabled" => tx.boolean(path, v, "bf16.enabled"),
                _ => Err(tx.unknown(path)),
            })?,
            "amp" => return Err(tx.err(
                k,
                "(NVIDIA Apex AMP) is not implemented in Phalanx; use \"bf16\" or \"fp16\" instead",
            )),
            "zero_optimization" => tx.zero(v)?,
            "optimizer" => {} // above
            "scheduler" => tx.scheduler(v)?,
            "activation_checkpointing" => tx.checkpointing(v)?,
            "communication_data_type" => {
                let p: Precision = tx
                    .string(k, v)?
                    .parse()
                    .map_err(|e: String| tx.err(k, &e))?;
                tx.set("train.reduce_dtype", T::String(p.name().into()));
            }
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
                tx.warn(k, "Phalanx logs step times with log.interval / log.json")
            }
            "zero_allow_untested_optimizer" | "zero_force_ds_cpu_optimizer" => {
                tx.warn(k, "Phalanx's ZeRO runs with every optimizer it has")
            }
            "tensorboard" | "wandb" | "csv_monitor" | "comms_logger" | "flops_profiler"
            | "dump_state" => tx.warn(k, "Phalanx writes metrics to log.json instead"),
            _ => return Err(tx.unknown(k)),
        }
    }
    Ok((tx.out, tx.extra))
}

struct Tx<'a> {
    label: &'a str,
    out: toml::Table,
    warnings: &'a mut Vec<String>,
    extra: Extra,
    /// optimizer.params.lr, when given.
    explicit_lr: Option<f64>,
}

type Handler<'a> = fn(&mut Tx<'a>, &str, &str, &J) -> Result<()>;

impl<'a> Tx<'a> {
    fn err(&self, path: &str, msg: &str) -> ConfigError {
        ConfigError(format!("{}: DeepSpeed key \"{path}\" {msg}", self.label))
    }

    fn unknown(&self, path: &str) -> ConfigError {
        ConfigError(format!("{}: unknown DeepSpeed key \"{path}\"", self.label))
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

    fn get(&self, key: &str) -> Option<&T> {
        let mut parts = key.split('.');
        let mut v = self.out.get(parts.next()?)?;
        for p in parts {
            v = v.get(p)?;
        }
        Some(v)
    }

    /// `"auto"` anywhere is an error naming its path.
    fn no_auto(&self, v: &J, path: &str) -> Result<()> {
        match v {
            J::String(s) if s.eq_ignore_ascii_case("auto") => Err(self.err(
                path,
                "is \"auto\": that needs a launcher (Hugging Face Trainer / Accelerate) that fills it in; \
                 give a value",
            )),
            J::Object(m) => m.iter().try_for_each(|(k, v)| {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                self.no_auto(v, &p)
            }),
            _ => Ok(()),
        }
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
        let i = self.uint(path, v)?;
        self.set(to, T::Integer(i));
        Ok(())
    }

    fn num(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        let f = self.float(path, v)?;
        self.set(to, T::Float(f));
        Ok(())
    }

    fn boolean(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        let b = self.boolean_value(path, v)?;
        self.set(to, T::Boolean(b));
        Ok(())
    }

    fn text(&mut self, path: &str, v: &J, to: &str) -> Result<()> {
        let s = self.string(path, v)?;
        self.set(to, T::String(s));
        Ok(())
    }

    /// A key DeepSpeed allows several values for, of which Phalanx has one.
    fn only(&self, path: &str, v: &J, ok: bool) -> Result<()> {
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

    fn zero(&mut self, v: &J) -> Result<()> {
        self.section("zero_optimization", v, |tx, key, p, v| match key {
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
                            tx.warn(p, "pinned host memory matters for GPU copies; on CPU the state is already in host memory");
                            Ok(())
                        }
                        "buffer_count" | "buffer_size" | "max_in_cpu" | "fast_init" => {
                            tx.warn(p, "Phalanx streams offloaded state in fixed-size chunks");
                            Ok(())
                        }
                        _ => Err(tx.unknown(p)),
                    }
                })
            }
            "overlap_comm" => tx.boolean(p, v, "zero_optimization.overlap_comm"),
            "contiguous_gradients" => tx.boolean(p, v, "zero_optimization.contiguous_gradients"),
            "reduce_bucket_size" => tx.num(p, v, "zero_optimization.reduce_bucket_size"),
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
                tx.warn(p, "Phalanx gathers parameters per block");
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
                tx.warn(p, "Phalanx shards and gathers whole blocks; this tuning knob does not apply");
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
            Some(t) => self.string("optimizer.type", t)?,
            None => return Err(self.err("optimizer", "needs a \"type\"")),
        };
        let name = match ty.to_ascii_lowercase().as_str() {
            "adamw" => "adamw",
            "adam" => "adam",
            "sgd" => "sgd",
            _ => {
                return Err(self.err(
                    "optimizer.type",
                    &format!("= {ty:?} is not an optimizer Phalanx has (AdamW, Adam or SGD)"),
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
        for (k, v) in m {
            match k.as_str() {
                "type" => {}
                "params" => self.section("optimizer.params", v, |tx, key, p, v| match key {
                    "lr" => {
                        tx.explicit_lr = Some(tx.float(p, v)?);
                        tx.num(p, v, "optim.lr")
                    }
                    "eps" => tx.num(p, v, "optim.eps"),
                    "weight_decay" => tx.num(p, v, "optim.weight_decay"),
                    "momentum" => tx.num(p, v, "optim.momentum"),
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
                        tx.warn(p, "Phalanx has one fused AdamW loop");
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
        let ty = match m.get("type") {
            Some(t) => self.string("scheduler.type", t)?,
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
        let allowed: &[&str] = match ty.as_str() {
            "WarmupLR" => &["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"],
            "WarmupDecayLR" => &[
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
                "total_num_steps",
            ],
            "WarmupCosineLR" => &[
                "total_num_steps",
                "warmup_min_ratio",
                "cos_min_ratio",
                "warmup_num_steps",
                "warmup_type",
            ],
            _ => {
                return Err(self.err(
                    "scheduler.type",
                    &format!("= {ty:?} is not a schedule Phalanx has (WarmupLR, WarmupDecayLR or WarmupCosineLR)"),
                ))
            }
        };
        for (k, v) in params {
            let start_over = k == "last_batch_iteration" && v.as_i64() == Some(-1);
            if !(allowed.contains(&k.as_str()) || start_over) {
                return Err(self.unknown(&format!("scheduler.params.{k}")));
            }
        }
        let p = |k: &str| params.get(k).filter(|v| !v.is_null());
        let path = |k: &str| format!("scheduler.params.{k}");
        let num_or = |tx: &Self, k: &str, d: f64| p(k).map_or(Ok(d), |v| tx.float(&path(k), v));
        let warmup =
            p("warmup_num_steps").map_or(Ok(1000), |v| self.uint(&path("warmup_num_steps"), v))?;
        let wtype = p("warmup_type").map_or(Ok("log".to_string()), |v| {
            self.string(&path("warmup_type"), v)
        })?;
        if !matches!(wtype.as_str(), "linear" | "log") {
            return Err(self.err(
                &path("warmup_type"),
                &format!("= {wtype:?} is not \"linear\" or \"log\""),
            ));
        }
        self.set("optim.warmup_steps", T::Integer(warmup));
        self.set("optim.warmup_type", T::String(wtype));
        let total = match p("total_num_steps") {
            Some(v) => Some(self.uint(&path("total_num_steps"), v)?),
            None => None,
        };
        if ty == "WarmupCosineLR" {
            let lr = self.get("optim.lr").and_then(T::as_float).unwrap_or(3e-3);
            let cos_min = num_or(self, "cos_min_ratio", 1e-4)?;
            let warm_min = num_or(self, "warmup_min_ratio", 0.0)?;
            self.set("optim.schedule", T::String("cosine".into()));
            self.set("optim.min_lr", T::Float(lr * cos_min));
            self.set("optim.warmup_min_lr", T::Float(lr * warm_min));
            let total = total.ok_or_else(|| {
                self.err(
                    "scheduler.params",
                    "of WarmupCosineLR needs total_num_steps",
                )
            })?;
            self.set("optim.decay_steps", T::Integer(total));
            return Ok(());
        }
        let min_lr = num_or(self, "warmup_min_lr", 0.0)?;
        let max_lr = num_or(self, "warmup_max_lr", 1e-3)?;
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
        self.set("optim.warmup_min_lr", T::Float(min_lr));
        if ty == "WarmupLR" {
            self.set("optim.schedule", T::String("warmup_constant".into()));
        } else {
            let total = total.ok_or_else(|| {
                self.err("scheduler.params", "of WarmupDecayLR needs total_num_steps")
            })?;
            self.set("optim.schedule", T::String("warmup_linear".into()));
            self.set("optim.min_lr", T::Float(min_lr));
            self.set("optim.decay_steps", T::Integer(total));
        }
        Ok(())
    }

    fn checkpointing(&mut self, v: &J) -> Result<()> {
        self.section("activation_checkpointing", v, |tx, key, p, v| match key {
            "partition_activations" | "cpu_checkpointing" => {
                let b = tx.boolean_value(p, v)?;
                tx.set(&format!("activation_checkpointing.{key}"), T::Boolean(b));
                if b && tx.extra.recompute.is_none() {
                    tx.extra.recompute = Some(None);
                }
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
                tx.warn(
                    p,
                    "Phalanx saves one block input per checkpoint, contiguous already",
                );
                Ok(())
            }
            _ => Err(tx.unknown(p)),
        })
    }
}
