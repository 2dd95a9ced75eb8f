//! DeepSpeed JSON configs and the new typed keys: configs are built only,
//! nothing trains. Includes Hugging Face Trainer-style configs whose values
//! are `"auto"`: each resolves to Phalanx's own setting for the key (its
//! default, or `--set`'s), with the printed summary of what each became.

use phalanx::config::{
    ConfigError, LrScheduleKind, ModelFacts, ModelSchema, OptimName, Precision, Recompute,
    TrainConfig,
};
use phalanx::optim::schedule::WarmupType;
use phalanx::optim::LrSchedule;
use std::path::{Path, PathBuf};

fn tmp(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("phalanx-cfg-ds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn set(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

fn json(name: &str, text: &str) -> Result<(TrainConfig, Vec<String>), String> {
    TrainConfig::build_with_warnings(Some(&tmp(name, text)), &[]).map_err(|e| e.to_string())
}

/// A model section with 4 layers and no keys.
struct FourLayers;

impl ModelSchema for FourLayers {
    fn section(&self, _: Option<&str>) -> Result<toml::Table, ConfigError> {
        Ok(toml::Table::new())
    }
    fn check(&self, _: &toml::Table) -> Result<ModelFacts, ConfigError> {
        Ok(ModelFacts {
            seq_len: None,
            n_layer: Some(4),
        })
    }
}

fn err(name: &str, text: &str) -> String {
    json(name, text).unwrap_err()
}

const TUTORIAL: &str = r#"{
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.00015, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.00015, "warmup_num_steps": 1000}},
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": true, "overlap_comm": true}
}"#;

const TUTORIAL_TOML: &str = r#"
[train]
global_batch_size = 16
micro_batch_size = 4
grad_accum_steps = 2
[optim]
name = "adamw"
lr = 0.00015
betas = [0.8, 0.999]
eps = 1e-8
weight_decay = 3e-7
grad_clip = 1.0
schedule = "warmup_constant"
warmup_min_lr = 0
warmup_steps = 1000
warmup_type = "log"
[fp16]
enabled = true
loss_scale = 0
initial_scale_power = 16
loss_scale_window = 1000
hysteresis = 2
min_loss_scale = 1
[zero_optimization]
stage = 2
contiguous_gradients = true
overlap_comm = true
[zero_optimization.offload_optimizer]
device = "cpu"
"#;

#[test]
fn tutorial_json_equals_toml() {
    let (j, warnings) = json("tutorial.json", TUTORIAL).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    let t = TrainConfig::build(Some(&tmp("tutorial.toml", TUTORIAL_TOML)), &[]).unwrap();
    assert_eq!(j, t);
    assert_eq!(j.precision(), Precision::Fp16);
    assert_eq!(j.sharding().unwrap().stage, 2);
    assert_eq!(j.dp_for_world(2).unwrap(), 2);
    assert!(j.dp_for_world(4).is_err());
    let s = LrSchedule::from_config(&j.optim, j.train.steps);
    assert_eq!(s.lr(0), 0.0);
    assert_eq!(s.lr(5000), 0.00015);
    assert!((s.lr(99) - 0.00015 * (100f32.ln() / 1000f32.ln())).abs() < 1e-9);
}

#[test]
fn shipped_example_json_equals_toml() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let (j, warnings) =
        TrainConfig::build_with_warnings(Some(&root.join("ds_config.json")), &[]).unwrap();
    let t = TrainConfig::build(Some(&root.join("ds_config.toml")), &[]).unwrap();
    assert_eq!(j, t);
    // pin_memory and allgather_bucket_size are accepted with a warning each.
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings
        .iter()
        .any(|w| w.contains("zero_optimization.offload_optimizer.pin_memory")));
    assert!(warnings
        .iter()
        .any(|w| w.contains("zero_optimization.allgather_bucket_size")));
    assert_eq!(j.bucket_bytes(), 2_000_000_000);
    assert_eq!(j.log.interval, 10);
}

#[test]
fn set_overrides_win_over_json() {
    let p = tmp("over.json", TUTORIAL);
    let c = TrainConfig::build(
        Some(&p),
        &set(&["optim.lr=0.5", "zero_optimization.stage=1"]),
    )
    .unwrap();
    assert_eq!(c.optim.lr, 0.5);
    assert_eq!(c.zero_optimization.stage, 1);
}

#[test]
fn unknown_key_errors_with_its_path() {
    let e = err(
        "unknown.json",
        r#"{"zero_optimization": {"stage": 1, "foo": 3}}"#,
    );
    assert!(
        e.contains("unknown DeepSpeed key \"zero_optimization.foo\""),
        "{e}"
    );
    assert!(e.contains("unknown.json"), "{e}");
    let e = err("unknown2.json", r#"{"train_batch_sise": 8}"#);
    assert!(e.contains("\"train_batch_sise\""), "{e}");
    let e = err(
        "unknown3.json",
        r#"{"optimizer": {"type": "Lamb", "params": {}}}"#,
    );
    assert!(e.contains("optimizer.type") && e.contains("Lamb"), "{e}");
    let e = err("unknown4.json", r#"{"amp": {"enabled": true}}"#);
    assert!(e.contains("\"amp\"") && e.contains("bf16"), "{e}");
    let e = err(
        "unknown5.json",
        r#"{"fp16": {"enabled": true, "consecutive_hysteresis": true}}"#,
    );
    assert!(e.contains("fp16.consecutive_hysteresis"), "{e}");
}

#[test]
fn no_effect_keys_warn_once_with_their_name() {
    let (_, w) = json(
        "warn.json",
        r#"{"wall_clock_breakdown": true, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
            "stage3_param_persistence_threshold": 1e5}, "activation_checkpointing": {"profile": true}}"#,
    )
    .unwrap();
    for key in [
        "\"wall_clock_breakdown\"",
        "\"zero_optimization.stage3_max_live_parameters\"",
        "\"zero_optimization.stage3_param_persistence_threshold\"",
        "\"activation_checkpointing.profile\"",
    ] {
        assert_eq!(
            w.iter().filter(|w| w.contains(key)).count(),
            1,
            "{key}: {w:?}"
        );
    }
    // Hugging Face's ZeRO-3 NVMe template: "aio" tunes DeepSpeed's async
    // I/O; the whole optimizer offloaded (ratio 1) is what Phalanx does.
    let (_, w) = json(
        "nvme.json",
        r#"{"aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": false, "overlap_events": true},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
            "nvme_path": "/local_nvme", "ratio": 1.0}}}"#,
    )
    .unwrap();
    assert_eq!(
        w.iter().filter(|w| w.contains("\"aio\"")).count(),
        1,
        "{w:?}"
    );
    assert!(!w.iter().any(|w| w.contains("ratio")), "{w:?}");
    let e = err(
        "ratio.json",
        r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}"#,
    );
    assert!(
        e.contains("zero_optimization.offload_optimizer.ratio") && e.contains("partial offload"),
        "{e}"
    );
}

/// The shipped Hugging Face Trainer-style config: ZeRO-2 with optimizer
/// offload, AdamW, WarmupDecayLR, fp16 / bf16 "auto", every number "auto".
fn trainer_style() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/ds_config_auto.json")
}

/// What `examples/ds_config_auto.json` says besides its autos, in TOML.
const TRAINER_STYLE_EXPLICIT: &str = r#"
[log]
interval = 10
[optim]
name = "adamw"
schedule = "warmup_linear"
warmup_type = "log"
[fp16]
loss_scale = 0
loss_scale_window = 1000
initial_scale_power = 16
hysteresis = 2
min_loss_scale = 1
[zero_optimization]
stage = 2
overlap_comm = true
contiguous_gradients = true
[zero_optimization.offload_optimizer]
device = "cpu"
"#;

fn auto_lines(c: &TrainConfig, dp: usize) -> Vec<String> {
    c.deepspeed_auto(dp).iter().map(|a| a.to_string()).collect()
}

#[test]
fn trainer_style_autos_resolve_to_phalanx_settings() {
    let (c, _) = TrainConfig::build_with_warnings(Some(&trainer_style()), &[]).unwrap();
    // Every "auto" is what Phalanx has without the key: the config equals
    // the file's explicit keys alone, written as TOML.
    let t = TrainConfig::build(Some(&tmp("explicit.toml", TRAINER_STYLE_EXPLICIT)), &[]).unwrap();
    assert_eq!(c.to_toml(), t.to_toml());
    // ... which is Phalanx's defaults, not DeepSpeed's for omitted keys.
    let d = TrainConfig::build(None, &[]).unwrap();
    assert_eq!(c.optim.grad_clip, d.optim.grad_clip);
    assert_ne!(c.optim.grad_clip, 0.0);
    assert_eq!(
        (c.optim.lr, c.optim.betas, c.optim.eps, c.optim.weight_decay),
        (d.optim.lr, d.optim.betas, d.optim.eps, d.optim.weight_decay)
    );
    assert_eq!(
        (
            c.optim.warmup_steps,
            c.optim.warmup_min_lr,
            c.optim.min_lr,
            c.optim.decay_steps
        ),
        (
            d.optim.warmup_steps,
            d.optim.warmup_min_lr,
            d.optim.min_lr,
            d.optim.decay_steps
        )
    );
    assert_eq!(c.optim.schedule, LrScheduleKind::WarmupLinear);
    assert_eq!(c.precision(), d.precision());
    assert_eq!(c.bucket_bytes(), d.bucket_bytes());
    assert_eq!(c.batch_for_dp(2).unwrap(), d.batch_for_dp(2).unwrap());
    assert_eq!(c.dp_for_world(2).unwrap(), 2);
    // What each became, as `phalanx train` prints it.
    let lines = auto_lines(&c, 2);
    let want = [
        "bf16.enabled = false (train.precision = fp32)".to_string(),
        "fp16.enabled = false (train.precision = fp32)".into(),
        "gradient_accumulation_steps = 1 (train.grad_accum_steps)".into(),
        "gradient_clipping = 1.0 (optim.grad_clip)".into(),
        "optimizer.params.betas = [0.9, 0.95] (optim.betas)".into(),
        "optimizer.params.eps = 1e-8 (optim.eps)".into(),
        "optimizer.params.lr = 0.003 (optim.lr)".into(),
        "optimizer.params.weight_decay = 0.1 (optim.weight_decay)".into(),
        "scheduler.params.total_num_steps = 600 (optim.decay_steps = 0: train.steps)".into(),
        "scheduler.params.warmup_max_lr = 0.003 (optim.lr)".into(),
        "scheduler.params.warmup_min_lr = 0.0 (optim.warmup_min_lr; optim.min_lr = 0.0003)".into(),
        "scheduler.params.warmup_num_steps = 20 (optim.warmup_steps)".into(),
        "train_batch_size = 16 (train.micro_batch_size 8 x dp 2 x train.grad_accum_steps 1)".into(),
        "train_micro_batch_size_per_gpu = 8 (train.micro_batch_size)".into(),
        format!(
            "zero_optimization.reduce_bucket_size = {} (elements of parallel.bucket_mb = 25.0)",
            (25 << 20) / 4
        ),
    ];
    assert_eq!(lines, want);
    let s = c.deepspeed_auto_summary(2).unwrap();
    assert!(s.starts_with("DeepSpeed \"auto\" values in "), "{s}");
    assert!(s.contains("ds_config_auto.json"), "{s}");
    assert_eq!(s.lines().count(), want.len() + 1, "{s}");
    // A config without autos has nothing to print.
    let (plain, _) = json("plain.json", TUTORIAL).unwrap();
    assert!(plain.deepspeed_auto(2).is_empty());
    assert_eq!(plain.deepspeed_auto_summary(2), None);
}

#[test]
fn set_wins_over_auto() {
    let c = TrainConfig::build(
        Some(&trainer_style()),
        &set(&[
            "optim.lr=0.01",
            "optim.betas=[0.8, 0.9]",
            "optim.grad_clip=0.5",
            "optim.warmup_steps=7",
            "optim.decay_steps=50",
            "optim.min_lr=0.001",
            "train.micro_batch_size=2",
            "train.grad_accum_steps=4",
            "bf16.enabled=true",
            "zero_optimization.reduce_bucket_size=1000",
        ]),
    )
    .unwrap();
    assert_eq!(c.optim.lr, 0.01);
    assert_eq!(c.optim.betas, [0.8, 0.9]);
    assert_eq!(c.optim.grad_clip, 0.5);
    assert_eq!((c.optim.warmup_steps, c.optim.decay_steps), (7, 50));
    assert_eq!(c.optim.min_lr, 0.001);
    assert_eq!(c.precision(), Precision::Bf16);
    assert_eq!(c.bucket_bytes(), 4000);
    assert_eq!(c.batch_for_dp(2).unwrap(), (2, 4));
    let lines = auto_lines(&c, 2);
    for want in [
        "optimizer.params.lr = 0.01 (optim.lr)",
        "scheduler.params.warmup_max_lr = 0.01 (optim.lr)",
        "optimizer.params.betas = [0.8, 0.9] (optim.betas)",
        "gradient_clipping = 0.5 (optim.grad_clip)",
        "scheduler.params.warmup_num_steps = 7 (optim.warmup_steps)",
        "scheduler.params.total_num_steps = 50 (optim.decay_steps)",
        "scheduler.params.warmup_min_lr = 0.0 (optim.warmup_min_lr; optim.min_lr = 0.001)",
        "train_batch_size = 16 (train.micro_batch_size 2 x dp 2 x train.grad_accum_steps 4)",
        "bf16.enabled = true (train.precision = bf16)",
        "fp16.enabled = false (train.precision = bf16)",
        "zero_optimization.reduce_bucket_size = 1000 (zero_optimization.reduce_bucket_size)",
    ] {
        assert!(lines.iter().any(|l| l == want), "{want}: {lines:#?}");
    }
    // An explicit optimizer lr is what an auto warmup_max_lr takes, and
    // --set wins over both.
    let p = tmp(
        "lr_explicit.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.0002}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 5}}}"#,
    );
    let (c, w) = TrainConfig::build_with_warnings(Some(&p), &[]).unwrap();
    assert_eq!(c.optim.lr, 0.0002);
    assert!(!w.iter().any(|w| w.contains("replaces")), "{w:?}");
    let c = TrainConfig::build(Some(&p), &set(&["optim.lr=0.5"])).unwrap();
    assert_eq!(c.optim.lr, 0.5);
}

#[test]
fn zero3_autos_and_knobs_without_a_setting() {
    let (c, w) = json(
        "zero3_auto.json",
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "adam_w_mode": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
            "bf16": {"enabled": "auto"}, "amp": {"enabled": "auto", "opt_level": "auto"},
            "zero_optimization": {"stage": 3, "overlap_comm": true, "stage3_prefetch_bucket_size": "auto",
              "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
              "stage3_max_live_parameters": 1e9}}"#,
    )
    .unwrap();
    // The knobs Phalanx has no setting for are named in the summary, not warned about.
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("stage3_max_live_parameters"), "{w:?}");
    assert_eq!(c.zero_optimization.stage3_prefetch_bucket_size, 0.0);
    assert_eq!(c.optim.schedule, LrScheduleKind::WarmupConstant);
    // train_batch_size given, micro and accum auto: as if absent, micro is derived.
    assert_eq!(c.batch_for_dp(2).unwrap(), (4, 1));
    let lines = auto_lines(&c, 2);
    for want in [
        "train_micro_batch_size_per_gpu = 4 (train.micro_batch_size (derived from train.global_batch_size))",
        "gradient_accumulation_steps = 1 (train.grad_accum_steps)",
        "optimizer.params.adam_w_mode = true (the only value Phalanx has)",
        "amp.enabled = false (Phalanx has no NVIDIA Apex AMP; bf16 / fp16 are its mixed precision)",
        "zero_optimization.stage3_prefetch_bucket_size = 0 (ZeRO-3 gathers parallel.forward_prefetch = 1 block(s) ahead)",
        "scheduler.params.warmup_min_lr = 0.0 (optim.warmup_min_lr)",
    ] {
        assert!(lines.iter().any(|l| l == want), "{want}: {lines:#?}");
    }
    for key in [
        "amp.opt_level",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("{key}: ignored (no effect in Phalanx"))),
            "{key}: {lines:#?}"
        );
    }
    // The batch identity still holds with autos resolved: 8 != 4 * 1 * 3.
    assert!(c.dp_for_world(3).is_err());
    let c = TrainConfig::build(
        Some(&tmp(
            "zero3_auto_mismatch.json",
            r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto"}"#,
        )),
        &set(&["train.micro_batch_size=4", "train.grad_accum_steps=1"]),
    )
    .unwrap();
    let e = c.dp_for_world(2).unwrap_err().to_string();
    assert!(e.contains("10 != 4 * 1 * 2"), "{e}");
}

#[test]
fn auto_types_and_cosine_ratios_take_the_final_lr() {
    // "auto" optimizer and scheduler types are Phalanx's own.
    let p = tmp(
        "types_auto.json",
        r#"{"optimizer": {"type": "auto", "params": {"lr": 0.01}},
            "scheduler": {"type": "auto", "params": {"warmup_num_steps": 5, "total_num_steps": "auto"}}}"#,
    );
    let d = TrainConfig::build(None, &[]).unwrap();
    let c = TrainConfig::build(Some(&p), &[]).unwrap();
    assert_eq!(c.optim.name, d.optim.name);
    assert_eq!(c.optim.schedule, d.optim.schedule);
    assert_eq!((c.optim.lr, c.optim.warmup_steps), (0.01, 5));
    assert_eq!(
        (c.optim.weight_decay, c.optim.betas, c.optim.warmup_type),
        (d.optim.weight_decay, d.optim.betas, d.optim.warmup_type)
    );
    let c = TrainConfig::build(Some(&p), &set(&["optim.name=sgd"])).unwrap();
    assert_eq!(c.optim.name, OptimName::Sgd);
    // WarmupCosineLR's cos_min_ratio scales the lr the run uses.
    let p = tmp(
        "cos_auto.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "cos_min_ratio": 0.1,
            "warmup_num_steps": "auto"}}}"#,
    );
    let c = TrainConfig::build(Some(&p), &set(&["optim.lr=0.02"])).unwrap();
    assert_eq!(c.optim.schedule, LrScheduleKind::Cosine);
    assert!((c.optim.min_lr - 0.002).abs() < 1e-12, "{}", c.optim.min_lr);
    assert_eq!(c.optim.decay_steps, 0);
    let c = TrainConfig::build(Some(&p), &set(&["optim.lr=0.02", "optim.min_lr=0.005"])).unwrap();
    assert_eq!(c.optim.min_lr, 0.005);
    // A ratio outside [0, 1] is refused under its own key, not as the
    // optim.min_lr it would derive.
    for (k, r, range) in [
        ("cos_min_ratio", "-1", "between 0 and 1"),
        ("cos_min_ratio", "2", "between 0 and 1"),
        ("warmup_min_ratio", "-0.5", "at least 0"),
    ] {
        let p = tmp(
            &format!("cos_bad_{k}.json"),
            &format!(
                r#"{{"optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
                "scheduler": {{"type": "WarmupCosineLR", "params": {{"total_num_steps": 8, "{k}": {r}}}}}}}"#
            ),
        );
        let e = TrainConfig::build(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "DeepSpeed key \"scheduler.params.{k}\" must be {range}"
            )),
            "{e}"
        );
    }
}

#[test]
fn what_auto_cannot_mean_is_an_error_naming_the_key() {
    // A string that is not "auto" where a number is expected.
    let e = err(
        "auto_bad1.json",
        r#"{"train_micro_batch_size_per_gpu": "eight"}"#,
    );
    assert!(
        e.contains("\"train_micro_batch_size_per_gpu\"") && e.contains("\"eight\""),
        "{e}"
    );
    let e = err(
        "auto_bad2.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": "1e-4"}}}"#,
    );
    assert!(
        e.contains("\"optimizer.params.lr\"") && e.contains("must be a number"),
        "{e}"
    );
    let e = err("auto_bad3.json", r#"{"gradient_clipping": "Auto-ish"}"#);
    assert!(e.contains("\"gradient_clipping\""), "{e}");
    // A cosine ratio cannot be read without the scheduler's type.
    let e = err(
        "auto_bad4.json",
        r#"{"scheduler": {"type": "auto", "params": {"cos_min_ratio": 0.1}}}"#,
    );
    assert!(e.contains("\"scheduler.params.cos_min_ratio\""), "{e}");
    // "auto" does not make an unknown key known, nor Apex AMP available.
    let e = err("auto_bad5.json", r#"{"train_batch_sise": "auto"}"#);
    assert!(
        e.contains("unknown DeepSpeed key \"train_batch_sise\""),
        "{e}"
    );
    let e = err(
        "auto_bad6.json",
        r#"{"amp": {"enabled": true, "opt_level": "auto"}}"#,
    );
    assert!(e.contains("\"amp\"") && e.contains("bf16"), "{e}");
}

#[test]
fn batch_identity_is_checked_like_deepspeed() {
    let (c, _) = json(
        "mismatch.json",
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}"#,
    )
    .unwrap();
    let e = c.dp_for_world(2).unwrap_err().to_string();
    for n in ["10", "4", "2"] {
        assert!(e.contains(n), "{e}");
    }
    assert!(e.contains("10 != 4 * 2 * 2"), "{e}");
}

#[test]
fn the_missing_batch_number_is_derived() {
    // train_batch_size + micro: accum derived.
    let (mut c, _) = json(
        "derive_accum.json",
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#,
    )
    .unwrap();
    assert_eq!(c.batch_for_dp(2).unwrap(), (4, 4));
    assert_eq!(c.dp_for_world(4).unwrap(), 4);
    c.resolve_batch(4).unwrap();
    assert_eq!((c.train.micro_batch_size, c.train.grad_accum_steps), (4, 2));
    assert_eq!(c.global_batch(4), 32);
    // train_batch_size + accum: micro derived.
    let (c, _) = json(
        "derive_micro.json",
        r#"{"train_batch_size": 32, "gradient_accumulation_steps": 4}"#,
    )
    .unwrap();
    assert_eq!(c.batch_for_dp(2).unwrap(), (4, 4));
    // train_batch_size alone: accum 1, micro derived.
    let (c, _) = json("derive_alone.json", r#"{"train_batch_size": 24}"#).unwrap();
    assert_eq!(c.batch_for_dp(3).unwrap(), (8, 1));
    let e = c.dp_for_world(5).unwrap_err().to_string();
    assert!(e.contains("24") && e.contains("5"), "{e}");
    // The same rule holds in TOML / --set.
    let c = TrainConfig::build(
        None,
        &set(&["train.global_batch_size=16", "train.grad_accum_steps=2"]),
    )
    .unwrap();
    assert_eq!(c.batch_for_dp(2).unwrap(), (4, 2));
}

#[test]
fn recompute_parses_from_set_and_toml() {
    let r = |v: &str| {
        TrainConfig::build(None, &[format!("train.activation_checkpointing={v}")])
            .map(|c| c.recompute())
            .map_err(|e| e.to_string())
    };
    assert_eq!(r("none").unwrap(), Recompute::None);
    assert_eq!(r("full").unwrap(), Recompute::Full);
    assert_eq!(r("\"full\"").unwrap(), Recompute::Full);
    assert_eq!(r("2").unwrap(), Recompute::Every(2));
    assert_eq!(r("\"3\"").unwrap(), Recompute::Every(3));
    assert_eq!(r("1").unwrap(), Recompute::Full);
    for bad in ["0", "half", "-1"] {
        let e = r(bad).unwrap_err();
        assert!(e.contains("train.activation_checkpointing"), "{bad}: {e}");
    }
    let toml = |v: &str| {
        let p = tmp(
            "recompute.toml",
            &format!("[train]\nactivation_checkpointing = {v}\n"),
        );
        TrainConfig::build(Some(&p), &[])
            .map(|c| c.recompute())
            .map_err(|e| e.to_string())
    };
    assert_eq!(toml("2").unwrap(), Recompute::Every(2));
    assert_eq!(toml("\"full\"").unwrap(), Recompute::Full);
    assert_eq!(toml("\"none\"").unwrap(), Recompute::None);
    assert!(toml("0")
        .unwrap_err()
        .contains("train.activation_checkpointing"));
    assert!(toml("\"half\"")
        .unwrap_err()
        .contains("train.activation_checkpointing"));
    // Every(k): blocks 0, k, 2k, ...
    let e = Recompute::Every(2);
    assert_eq!(
        (0..5).filter(|&b| e.recomputes(b)).collect::<Vec<_>>(),
        [0, 2, 4]
    );
    // Round trip through the printed TOML.
    let c = TrainConfig::build(None, &set(&["train.activation_checkpointing=2"])).unwrap();
    let back = TrainConfig::build(Some(&tmp("roundtrip.toml", &c.to_toml())), &[]).unwrap();
    assert_eq!(back, c);
}

#[test]
fn deepspeed_checkpointing_section_turns_recompute_on() {
    let (c, _) = json(
        "ckpt.json",
        r#"{"activation_checkpointing": {"partition_activations": true}}"#,
    )
    .unwrap();
    assert_eq!(c.recompute(), Recompute::Full);
    assert!(c.activation_checkpointing.partition_activations);
    // A model of 4 layers: 2 checkpoints = every 2nd block.
    let p = tmp(
        "ckpt2.json",
        r#"{"activation_checkpointing": {"number_checkpoints": 2}}"#,
    );
    let c = TrainConfig::build_for(&FourLayers, Some(&p), &[]).unwrap();
    assert_eq!(c.recompute(), Recompute::Every(2));
    // Without a model section the layer count is unknown: every block, said.
    let (c, w) = json(
        "ckpt2b.json",
        r#"{"activation_checkpointing": {"number_checkpoints": 2}}"#,
    )
    .unwrap();
    assert_eq!(c.recompute(), Recompute::Full);
    assert!(w.iter().any(|w| w.contains("number_checkpoints")), "{w:?}");
    // An explicit key wins.
    let p = tmp(
        "ckpt3.json",
        r#"{"activation_checkpointing": {"number_checkpoints": 2}}"#,
    );
    let c = TrainConfig::build(Some(&p), &set(&["train.activation_checkpointing=none"])).unwrap();
    assert_eq!(c.recompute(), Recompute::None);
    // A flag the file set and `--set` turned off again turns nothing on.
    let p = tmp(
        "ckpt4.json",
        r#"{"activation_checkpointing": {"partition_activations": true}}"#,
    );
    let c = TrainConfig::build(
        Some(&p),
        &set(&["activation_checkpointing.partition_activations=false"]),
    )
    .unwrap();
    assert_eq!(c.recompute(), Recompute::None);
    // The flags alone in TOML or --set: a note that they do nothing.
    let c = TrainConfig::build(
        None,
        &set(&["activation_checkpointing.partition_activations=true"]),
    )
    .unwrap();
    assert!(
        c.notes().iter().any(|n| n.contains("no effect")),
        "{:?}",
        c.notes()
    );
}

#[test]
fn a_deepspeed_file_without_the_json_extension_is_read_as_json() {
    let (c, _) = json("ds_config", r#"{"train_micro_batch_size_per_gpu": 3}"#).unwrap();
    assert_eq!(c.train.micro_batch_size, 3);
}

#[test]
fn settings_that_would_do_nothing_or_fail_later_are_refused() {
    let e = |sets: &[&str]| {
        TrainConfig::build(None, &set(sets))
            .unwrap_err()
            .to_string()
    };
    let m = e(&[
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved",
        "parallel.pp_virtual_stages=1",
    ]);
    assert!(m.contains("parallel.pp_virtual_stages = 1"), "{m}");
    let m = e(&[
        "train.device=cuda",
        "activation_checkpointing.cpu_checkpointing=true",
    ]);
    assert!(
        m.contains("activation_checkpointing.cpu_checkpointing"),
        "{m}"
    );
}

#[test]
fn precision_from_sections() {
    let c = TrainConfig::build(None, &set(&["fp16.enabled=true"])).unwrap();
    assert_eq!(c.precision(), Precision::Fp16);
    let c = TrainConfig::build(None, &set(&["bf16.enabled=true"])).unwrap();
    assert_eq!(c.precision(), Precision::Bf16);
    let c = TrainConfig::build(None, &set(&["train.precision=bfloat16"])).unwrap();
    assert_eq!(c.precision(), Precision::Bf16);
    assert_eq!(
        TrainConfig::build(None, &[]).unwrap().precision(),
        Precision::Fp32
    );
    let e = TrainConfig::build(None, &set(&["fp16.enabled=true", "bf16.enabled=true"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fp16.enabled") && e.contains("bf16.enabled"),
        "{e}"
    );
    let e = TrainConfig::build(None, &set(&["train.precision=bf16", "fp16.enabled=true"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.precision") && e.contains("fp16.enabled"),
        "{e}"
    );
    let e = TrainConfig::build(None, &set(&["train.precision=fp8"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.precision"), "{e}");
    let (c, _) = json(
        "comm.json",
        r#"{"communication_data_type": "bf16", "bf16": {"enabled": true}}"#,
    )
    .unwrap();
    assert_eq!(
        (c.train.reduce_dtype, c.precision()),
        (Precision::Bf16, Precision::Bf16)
    );
}

#[test]
fn validation_of_new_keys() {
    let e = |s: &[&str]| TrainConfig::build(None, &set(s)).unwrap_err().to_string();
    assert!(e(&["zero_optimization.offload_param.device=cpu"]).contains("stage 3"));
    assert!(e(&["zero_optimization.offload_param.device=disk"]).contains("offload_param.device"));
    assert!(e(&["fp16.hysteresis=0"]).contains("fp16.hysteresis"));
    assert!(e(&["fp16.loss_scale_window=0"]).contains("fp16.loss_scale_window"));
    assert!(e(&["fp16.min_loss_scale=0"]).contains("fp16.min_loss_scale"));
    assert!(e(&["fp16.loss_scale=-1"]).contains("fp16.loss_scale"));
    assert!(e(&["optim.warmup_type=exp"]).contains("optim.warmup_type"));
    assert!(e(&["optim.schedule=onecycle"]).contains("optim.schedule"));
    let c = TrainConfig::build(
        None,
        &set(&[
            "zero_optimization.stage=3",
            "zero_optimization.offload_param.device=nvme",
        ]),
    )
    .unwrap();
    assert_eq!(c.param_offload_dir(), Some(PathBuf::from("runs/offload")));
    assert_eq!(c.zero_optimization.offload_param.buffer_size, 1 << 20);
    assert!(e(&[
        "zero_optimization.stage=3",
        "zero_optimization.offload_param.buffer_size=0"
    ])
    .contains("offload_param.buffer_size"));
    // DeepSpeed's offload_param.buffer_size is the streamed chunk.
    let (c, _) = json(
        "param_offload.json",
        r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_size": 4096}}}"#,
    ).unwrap();
    assert_eq!(c.zero_optimization.offload_param.buffer_size, 4096);
    assert_eq!(c.param_offload_dir(), Some(PathBuf::from("/tmp/x")));
    let c = TrainConfig::build(None, &set(&["optim.name=adam"])).unwrap();
    assert_eq!(c.optim.name, OptimName::Adam);
    assert_eq!(c.bucket_bytes(), 25 << 20);
}

#[test]
fn schedules_follow_deepspeed_formulas() {
    // WarmupDecayLR from JSON: warmup_min_lr 0.001 -> 0.01 over 10 steps, decay to 0.001 at 110.
    let (c, _) = json(
        "decay.json",
        r#"{"optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
            "warmup_num_steps": 10, "total_num_steps": 110, "warmup_type": "linear"}}}"#,
    )
    .unwrap();
    assert_eq!(c.optim.name, OptimName::Adam);
    assert_eq!(c.optim.weight_decay, 0.0); // FusedAdam's default
    let s = LrSchedule::from_config(&c.optim, c.train.steps);
    let ds = |step: usize| {
        // DeepSpeed: min + (max - min) * gamma.
        let gamma = if step < 10 {
            step as f64 / 10.0
        } else {
            ((110.0 - step as f64) / 100.0).max(0.0)
        };
        0.001 + 0.009 * gamma
    };
    for step in [0, 1, 5, 9, 10, 11, 60, 109, 110, 500] {
        assert!(
            (s.lr(step) as f64 - ds(step)).abs() < 1e-7,
            "step {step}: {} vs {}",
            s.lr(step),
            ds(step)
        );
    }
    // WarmupLR's log warmup: min + (max - min) ln(s + 1) / ln(warmup).
    let w = LrSchedule::WarmupConstant {
        warmup_min_lr: 0.0,
        max_lr: 1.0,
        warmup: 100,
        warmup_type: WarmupType::Log,
    };
    for step in [0, 1, 9, 50, 99] {
        let want = ((step + 1) as f64).ln() / 100f64.ln();
        assert!((w.lr(step) as f64 - want).abs() < 1e-6);
    }
    assert_eq!(w.lr(100), 1.0);
    // The scheduler's warmup_max_lr wins over optimizer.params.lr, with a warning.
    let (c, warn) = json(
        "lrwins.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01}}}"#,
    )
    .unwrap();
    assert_eq!(c.optim.lr, 0.01);
    assert!(warn.iter().any(|w| w.contains("warmup_max_lr")), "{warn:?}");
    // WarmupCosineLR -> cosine with min_lr = lr * cos_min_ratio.
    let (c, _) = json(
        "cos.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 200, "cos_min_ratio": 0.1,
            "warmup_num_steps": 10, "warmup_type": "linear"}}}"#,
    )
    .unwrap();
    assert_eq!(
        (c.optim.schedule, c.optim.decay_steps),
        (LrScheduleKind::Cosine, 200)
    );
    assert!((c.optim.min_lr - 0.001).abs() < 1e-12);
    // Cosine from a default config keeps its old numbers.
    let c = TrainConfig::build(None, &[]).unwrap();
    let s = LrSchedule::from_config(&c.optim, c.train.steps);
    let old = LrSchedule::WarmupCosine {
        max_lr: c.optim.lr as f32,
        min_lr: c.optim.min_lr as f32,
        warmup: c.optim.warmup_steps,
        decay_steps: c.train.steps.max(c.optim.warmup_steps + 1),
    };
    assert_eq!(s, old);
}

#[test]
fn json_without_scheduler_or_clipping_takes_deepspeed_defaults() {
    let (c, _) = json("bare.json", r#"{"train_micro_batch_size_per_gpu": 2}"#).unwrap();
    assert_eq!(c.optim.schedule, LrScheduleKind::Constant);
    assert_eq!(c.optim.grad_clip, 0.0);
    assert_eq!(c.train.micro_batch_size, 2);
}

#[test]
fn stage3_max_reuse_distance_is_taken_not_ignored() {
    let (cfg, warnings) = json(
        "reuse.json",
        r#"{"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9}}"#,
    )
    .unwrap();
    assert_eq!(cfg.zero_optimization.stage3_max_reuse_distance, 1e9);
    assert!(
        !warnings
            .iter()
            .any(|w| w.contains("stage3_max_reuse_distance")),
        "{warnings:?}"
    );
    let e = json(
        "reuse-bad.json",
        r#"{"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": -1}}"#,
    )
    .unwrap_err();
    assert!(e.contains("stage3_max_reuse_distance"), "{e}");
}

/// A derived accumulation meets the same checks as a given one: top-k
/// under ZeRO-2 with accum 4 derived from the global batch is refused when
/// the batch is resolved, as `train.grad_accum_steps=4` is when built.
#[test]
fn a_derived_accumulation_is_validated_like_a_given_one() {
    let mut c = TrainConfig::build(
        None,
        &set(&[
            "zero_optimization.stage=2",
            "parallel.comm_hook=\"topk\"",
            "train.global_batch_size=32",
            "train.micro_batch_size=4",
        ]),
    )
    .unwrap();
    let e = c.resolve_batch(2).unwrap_err().to_string();
    assert!(e.contains("train.grad_accum_steps = 4"), "{e}");
}

/// Values that pass as f64 but break the f32 optimizer or the scaler's
/// checkpoint, and counts that size an allocation, are refused naming the key.
#[test]
fn values_the_run_could_not_use_are_refused_naming_the_key() {
    for (s, key) in [
        ("optim.betas=[0.9, 0.99999999]", "optim.betas[1]"),
        ("optim.eps=1e-50", "optim.eps"),
        // Finite in f64, infinite in the optimizer's f32.
        ("optim.lr=1e39", "optim.lr = 1e39 is infinite in f32"),
        (
            "optim.weight_decay=1e39",
            "optim.weight_decay = 1e39 is infinite in f32",
        ),
        ("fp16.loss_scale=inf", "fp16.loss_scale"),
        ("fp16.min_loss_scale=1e300", "fp16.min_loss_scale"),
        (
            "fp16.loss_scale_window=2000000000000",
            "fp16.loss_scale_window",
        ),
        ("data.prefetch=1000000000000", "data.prefetch"),
        ("data.loader_threads=1000000", "data.loader_threads"),
        (
            "parallel.pp_schedule=\"interleaved:1000000000000\"",
            "parallel.pp x the interleaved",
        ),
    ] {
        let e = TrainConfig::build(None, &set(&[s]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{s}: {e}");
    }
}

/// Settings accepted but doing nothing beside the others get a note (rank 0
/// prints them); ZeRO++'s int8 gradients and a reduce dtype both choosing
/// the wire format is an error.
#[test]
fn settings_without_effect_get_a_note() {
    let notes = |s: &[&str]| {
        TrainConfig::build(None, &set(s))
            .unwrap()
            .notes()
            .join("\n")
    };
    assert_eq!(notes(&[]), "", "the defaults need no note");
    for (s, want) in [
        (
            &["train.steps=10", "optim.warmup_steps=20"][..],
            "never reaches optim.lr",
        ),
        (
            &["optim.warmup_steps=100", "optim.decay_steps=50"],
            "no decay phase",
        ),
        (
            &["parallel.sequence_parallel=true"],
            "no effect with parallel.tp = 1",
        ),
        (
            &[
                "zero_optimization.stage=3",
                "train.activation_checkpointing=2",
            ],
            "every block is recomputed",
        ),
        (
            &[
                "zero_optimization.stage=1",
                "parallel.check_params_every=10",
            ],
            "no effect under ZeRO stage 1",
        ),
        (&["train.reduce_dtype=\"fp16\""], "reduced in fp16"),
        (&["parallel.comm_hook=\"fp16\""], "without a loss scale"),
        (
            &[
                "optim.schedule=\"constant\"",
                "optim.warmup_steps=100",
                "train.steps=10",
            ],
            "has no warm-up: optim.warmup_steps = 100 is not used",
        ),
        (
            &["optim.schedule=\"warmup_constant\"", "optim.decay_steps=50"],
            "optim.decay_steps = 50 has no effect",
        ),
        (
            &["parallel.hybrid_shard_size=2"],
            "without parallel.sharding_strategy",
        ),
        (
            &[
                "zero_optimization.stage=3",
                "zero_optimization.reduce_bucket_size=5e8",
            ],
            "no effect under ZeRO-3",
        ),
        (
            &["zero_optimization.stage=2", "parallel.forward_prefetch=4"],
            "no effect under ZeRO stage 2",
        ),
        (&["parallel.backward_prefetch=2"], "no effect under DDP"),
        (
            &["optim.name=\"sgd\"", "optim.betas=[0.9, 0.99]"],
            "with optim.name = \"sgd\"",
        ),
        (&["optim.momentum=0.5"], "optim.momentum has no effect"),
        (&["checkpoint.async=true"], "checkpoint.interval = 0"),
        (&["parallel.pp=4"], "the bubble"),
        (&["parallel.pp_schedule=\"gpipe\""], "with parallel.pp = 1"),
        (
            &["train.precision=\"bf16\"", "fp16.loss_scale=128"],
            "fp16.* (loss scaling) has no effect in bf16 training",
        ),
        (
            &["parallel.pp=2", "parallel.check_params_every=1"],
            "no effect under pipeline parallelism",
        ),
        (
            &["parallel.pp=2", "parallel.pp_virtual_stages=4"],
            "pp_virtual_stages = 4 has no effect with parallel.pp_schedule = 1f1b",
        ),
        (
            &[
                "parallel.pp=2",
                "parallel.pp_virtual_stages=4",
                "parallel.pp_schedule=\"interleaved:3\"",
            ],
            "interleaved:3 gives its own chunk count",
        ),
        (
            &[
                "parallel.pp=4",
                "parallel.pp_schedule=\"interleaved\"",
                "train.grad_accum_steps=5",
            ],
            "not a multiple of parallel.pp = 4",
        ),
    ] {
        let n = notes(s);
        assert!(n.contains(want), "{s:?}: {n:?}");
    }
    // The notes of a pipeline layout name only what applies.
    let n = notes(&["parallel.pp=2", "parallel.check_params_every=1"]);
    assert!(!n.contains("ZeRO stage 0"), "{n}");
    let n = notes(&[
        "parallel.pp=4",
        "parallel.pp_schedule=\"interleaved\"",
        "train.grad_accum_steps=8",
        "parallel.pp_virtual_stages=3",
    ]);
    assert!(
        !n.contains("not a multiple") && !n.contains("pp_virtual_stages"),
        "{n}"
    );
    let n = notes(&[
        "parallel.pp=2",
        "parallel.pp_schedule=\"interleaved:4\"",
        "parallel.pp_virtual_stages=4",
    ]);
    assert!(
        !n.contains("pp_virtual_stages"),
        "a consistent setting: {n}"
    );
    // Fewer micro-batches than stages, but the count is still to derive.
    let n = notes(&[
        "parallel.pp=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=1",
    ]);
    assert!(!n.contains("the bubble"), "{n}");
    // The micro-batch derived instead, the accumulation is final.
    let n = notes(&[
        "parallel.pp=4",
        "train.global_batch_size=16",
        "train.grad_accum_steps=1",
    ]);
    assert!(n.contains("the bubble"), "{n}");
    // The warm-up note of a warming schedule is not the constant one's.
    let n = notes(&["optim.warmup_steps=100", "train.steps=10"]);
    assert!(
        n.contains("never reaches optim.lr") && !n.contains("no warm-up"),
        "{n}"
    );
    // A warm-up as long as the run: cosine's `(s + 1) / W` reaches optim.lr
    // at the last step (no note), warmup_constant's `s / W` does not.
    let n = notes(&["optim.warmup_steps=4", "train.steps=4"]);
    assert!(!n.contains("never reaches optim.lr"), "{n}");
    let n = notes(&[
        "optim.warmup_steps=4",
        "train.steps=4",
        "optim.schedule=\"warmup_constant\"",
    ]);
    assert!(n.contains("never reaches optim.lr"), "{n}");
    // Validation asked for over no batches is refused.
    let e = TrainConfig::build(None, &set(&["train.eval_batches=0"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.eval_batches = 0 evaluates nothing"),
        "{e}"
    );
    TrainConfig::build(
        None,
        &set(&["train.eval_batches=0", "train.eval_interval=0"]),
    )
    .unwrap();
    let e = TrainConfig::build(
        None,
        &set(&[
            "zero_optimization.stage=3",
            "zero_optimization.zero_quantized_gradients=true",
            "train.reduce_dtype=\"bf16\"",
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("zero_quantized_gradients"), "{e}");
}

/// What DeepSpeed refuses or would run otherwise is refused or said: a
/// key given twice, a parameter the optimizer does not take, a file
/// without an optimizer or batch numbers; torch_adam's weight decay,
/// at least 2 warmup steps, a schedule longer than the run.
#[test]
fn a_deepspeed_file_does_not_train_other_than_it_says_silently() {
    for (name, text, want) in [
        (
            "dup_top.json",
            r#"{"train_batch_size": 8, "gradient_clipping": 1.0, "gradient_clipping": 0.0}"#,
            "\"gradient_clipping\" is given twice",
        ),
        (
            "dup_nested.json",
            r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "lr": 1e-2}}}"#,
            "\"optimizer.params.lr\" is given twice",
        ),
        (
            "adam_momentum.json",
            r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"momentum": 0.5}}}"#,
            "\"optimizer.params.momentum\" is not a parameter of Adam / AdamW",
        ),
        (
            "sgd_betas.json",
            r#"{"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}"#,
            "\"optimizer.params.betas\" is not a parameter of SGD",
        ),
    ] {
        let e = err(name, text);
        assert!(e.contains(want), "{name}: {e}");
    }
    let warned = |name: &str, text: &str, want: &str| {
        let (_, w) = json(name, text).unwrap();
        assert!(w.iter().any(|w| w.contains(want)), "{name}: {w:?}");
    };
    warned(
        "no_opt.json",
        r#"{"train_batch_size": 8}"#,
        "no DeepSpeed \"optimizer\" section",
    );
    warned(
        "no_batch.json",
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}"#,
        "neither train_batch_size nor train_micro_batch_size_per_gpu",
    );
    warned(
        "long.json",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW"},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}}"#,
        "total_num_steps\" = 1000 is the schedule's length",
    );
    let p = tmp(
        "same_length.json",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW"},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}}"#,
    );
    let (_, w) = TrainConfig::build_with_warnings(Some(&p), &set(&["train.steps=1000"])).unwrap();
    assert!(!w.iter().any(|w| w.contains("total_num_steps")), "{w:?}");
    let (c, _) = json(
        "torch_adam.json",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"torch_adam": true}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}"#,
    )
    .unwrap();
    assert_eq!(c.optim.weight_decay, 0.01);
    assert_eq!(c.optim.warmup_steps, 2);
}
