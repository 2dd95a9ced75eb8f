//! The DeepSpeed config's nested sections, key by key: `fp16`, `amp`,
//! `zero_optimization` (with its offload subsections), `optimizer`,
//! `scheduler` and `activation_checkpointing`. Each is a method on the
//! parent module's translator ([`Tx`]), called from its top-level table;
//! apart from it because these tables are most of the mapping.

use super::auto::{is_auto, Via};
use super::{Result, Tx};
use crate::config::Precision;
use serde_json::Value as J;
use toml::Value as T;

impl Tx<'_> {
    pub(super) fn fp16(&mut self, v: &J) -> Result<()> {
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
    pub(super) fn amp(&mut self, v: &J) -> Result<()> {
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

    pub(super) fn zero(&mut self, v: &J) -> Result<()> {
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
                        // ZeRO-Offload++'s partial offload of the optimizer.
                        "ratio" if p.contains("offload_optimizer") => {
                            if tx.float(p, v)? != 1.0 {
                                return Err(tx.err(
                                    p,
                                    "a partial offload is not built: Phalanx offloads all \
                                     of the optimizer state or none (give 1, or leave it out)",
                                ));
                            }
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
            "overlap_comm" => {
                if v.as_bool() == Some(false) {
                    tx.warn(
                        p,
                        "Phalanx always overlaps the gradient reduction with the backward",
                    );
                }
                tx.boolean(p, v, "zero_optimization.overlap_comm")
            }
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
            "stage3_max_reuse_distance" => {
                tx.num(p, v, "zero_optimization.stage3_max_reuse_distance")
            }
            "stage3_param_persistence_threshold"
            | "stage3_max_live_parameters"
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

    pub(super) fn optimizer(&mut self, v: &J) -> Result<()> {
        let J::Object(m) = v else {
            return Err(self.err("optimizer", &format!("must be an object, not {v}")));
        };
        let ty = match m.get("type") {
            Some(t) if is_auto(t) => None,
            Some(t) => Some(self.string("optimizer.type", t)?),
            None => return Err(self.err("optimizer", "needs a \"type\"")),
        };
        // ("auto": Phalanx's optim.name, known only once merged.)
        let typed = ty.is_some();
        let sgd = ty.as_deref().is_some_and(|t| t.eq_ignore_ascii_case("sgd"));
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
                "params" => {
                    let J::Object(pm) = v else {
                        return Err(
                            self.err("optimizer.params", &format!("must be an object, not {v}"))
                        );
                    };
                    let (mut wd_given, mut torch_adam) = (false, false);
                    for (key, v) in pm.iter().filter(|(_, v)| !v.is_null()) {
                        let p = &format!("optimizer.params.{key}");
                        let tx = &mut *self;
                        match key.as_str() {
                            "lr" => {
                                if !is_auto(v) {
                                    tx.explicit_lr = Some(tx.float(p, v)?);
                                }
                                tx.num(p, v, "optim.lr")?
                            }
                            // (Keys the chosen optimizer does not take:
                            // DeepSpeed's constructor call fails on them.)
                            "eps" | "betas" if typed && sgd => {
                                return Err(tx.err(p, "is not a parameter of SGD"))
                            }
                            "momentum" if typed && !sgd => {
                                return Err(tx.err(p, "is not a parameter of Adam / AdamW"))
                            }
                            "eps" => tx.num(p, v, "optim.eps")?,
                            "weight_decay" => {
                                wd_given = true;
                                tx.num(p, v, "optim.weight_decay")?
                            }
                            "momentum" => tx.num(p, v, "optim.momentum")?,
                            "betas" if is_auto(v) => tx.auto(p, Via::Key("optim.betas".into())),
                            "betas" => {
                                let b = v.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                                    tx.err(
                                        p,
                                        &format!("must be two numbers [beta1, beta2], not {v}"),
                                    )
                                })?;
                                let b = [tx.float(p, &b[0])?, tx.float(p, &b[1])?];
                                tx.set(
                                    "optim.betas",
                                    T::Array(vec![T::Float(b[0]), T::Float(b[1])]),
                                );
                            }
                            "adam_w_mode" | "bias_correction" => tx.only(p, v, true)?,
                            "amsgrad" | "nesterov" => tx.only(p, v, false)?,
                            "torch_adam" | "fused" => {
                                torch_adam |= key == "torch_adam" && v.as_bool() == Some(true);
                                tx.no_effect(
                                    p,
                                    v,
                                    "Phalanx has one fused AdamW loop; torch_adam's default \
                                     weight_decay, torch's 0.01, is taken where none is given",
                                );
                            }
                            _ => return Err(tx.unknown(p)),
                        }
                    }
                    if torch_adam && !wd_given && !sgd {
                        // torch.optim.AdamW's default, not FusedAdam's 0.
                        self.set("optim.weight_decay", T::Float(0.01));
                    }
                }
                _ => return Err(self.unknown(&format!("optimizer.{k}"))),
            }
        }
        Ok(())
    }

    pub(super) fn scheduler(&mut self, v: &J) -> Result<()> {
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
                // DeepSpeed's schedulers warm up over at least 2 steps.
                let n = self.uint(&path("warmup_num_steps"), v)?.max(2);
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
                self.extra.total_num_steps = Some(n as usize);
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
                        // A multiple of the lr: below 0 (or, for the
                        // floor, above 1) the derived optim.{to} would be
                        // refused under a key the file does not have.
                        let (top, range) = if k == "cos_min_ratio" {
                            (1.0, "between 0 and 1")
                        } else {
                            (f64::MAX, "at least 0")
                        };
                        if !(0.0..=top).contains(&r) {
                            return Err(self.err(
                                &path(k),
                                &format!("must be {range} (a multiple of the lr), not {r}"),
                            ));
                        }
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

    pub(super) fn checkpointing(&mut self, v: &J) -> Result<()> {
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
