//! `phalanx train` with DeepSpeed JSON configs: `--config FILE.json`,
//! `--deepspeed_config` / `--deepspeed-config`, and a Hugging Face
//! Trainer-style config full of `"auto"`, which trains and prints what each
//! auto became once.

use crate::common;
use common::*;

use std::process::Command;

fn phalanx(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(repo())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn json_config_by_every_flag_prints_the_same_config() {
    let toml = phalanx(&[
        "train",
        "--config",
        "examples/ds_config.toml",
        "--print-config",
    ]);
    assert_eq!(toml.0, 0, "{}", toml.2);
    assert!(toml.1.contains("global_batch_size = 16"), "{}", toml.1);
    for flag in ["--config", "--deepspeed_config", "--deepspeed-config"] {
        let (code, out, err) =
            phalanx(&["train", flag, "examples/ds_config.json", "--print-config"]);
        assert_eq!(code, 0, "{flag}: {err}");
        assert_eq!(out, toml.1, "{flag}");
        // The no-effect keys are named on stderr.
        assert!(
            err.contains("zero_optimization.allgather_bucket_size"),
            "{flag}: {err}"
        );
    }
}

#[test]
fn config_and_deepspeed_config_together_is_an_error() {
    let (code, _, err) = phalanx(&[
        "train",
        "--config",
        "examples/ds_config.toml",
        "--deepspeed-config",
        "examples/ds_config.json",
        "--print-config",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--config") && err.contains("deepspeed"),
        "{err}"
    );
}

#[test]
fn bad_json_key_and_batch_identity_fail_before_launch() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "test-ds");
    let bad = d.join("bad.json");
    std::fs::write(&bad, r#"{"zero_optimization": {"stage": 2, "foo": 1}}"#).unwrap();
    let (code, _, err) = phalanx(&["train", "--deepspeed_config", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"zero_optimization.foo\""), "{err}");
    // 16 = 4 x 2 x 2 needs dp 2; 3 ranks break DeepSpeed's identity.
    let (code, _, err) = phalanx(&[
        "train",
        "--deepspeed-config",
        "examples/ds_config.json",
        "--nproc-per-node",
        "3",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("16 != 4 * 2 * 3"), "{err}");
}

#[test]
fn trains_from_the_example_ds_config() {
    let (code, out, err) = train_3_steps("examples/ds_config.json", &["--set", "log.plot=\"\""]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("done: 3 steps"), "{out}");
}

#[test]
fn trains_from_a_config_full_of_auto_and_prints_what_each_became() {
    let (code, out, err) = train_3_steps(
        "examples/ds_config_auto.json",
        &[
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "optim.lr=0.002",
            "--set",
            "log.plot=\"\"",
        ],
    );
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("done: 3 steps"), "{out}");
    // Printed once (by rank 0), before training, with --set's values winning.
    assert_eq!(
        out.matches("DeepSpeed \"auto\" values in examples/ds_config_auto.json")
            .count(),
        1,
        "{out}"
    );
    assert!(
        out.find("DeepSpeed \"auto\"") < out.find("done: 3 steps"),
        "{out}"
    );
    for line in [
        "  optimizer.params.lr = 0.002 (optim.lr)",
        "  scheduler.params.warmup_max_lr = 0.002 (optim.lr)",
        "  gradient_clipping = 1.0 (optim.grad_clip)",
        "  train_batch_size = 4 (train.micro_batch_size 2 x dp 2 x train.grad_accum_steps 1)",
        "  train_micro_batch_size_per_gpu = 2 (train.micro_batch_size)",
        "  scheduler.params.total_num_steps = 3 (optim.decay_steps = 0: train.steps)",
        "  bf16.enabled = false (train.precision = fp32)",
    ] {
        // The launcher prefixes each line of a rank with its rank.
        assert!(
            out.lines()
                .any(|l| l.trim_start_matches("[rank 0] ") == line),
            "{line:?} in:\n{out}"
        );
    }
}

/// `phalanx train` from a DeepSpeed config on 2 ranks: 3 steps of a tiny
/// model, without evaluation, then `extra`.
fn train_3_steps(ds_config: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "train",
        "--deepspeed-config",
        ds_config,
        "--nproc-per-node",
        "2",
        "--set",
        "model.n_layer=1",
        "--set",
        "model.n_head=2",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.block_size=32",
        "--set",
        "train.steps=3",
        "--set",
        "train.eval_interval=0",
    ];
    args.extend_from_slice(extra);
    phalanx(&args)
}

/// torchtitan's spelling of an override, `--section.key=value` or
/// `--section.key value`, is `--set section.key=value`, in order with the
/// `--set`s; a flag of no config section stays an unknown flag.
#[test]
fn section_key_flags_are_overrides() {
    let (code, out, err) = phalanx(&[
        "train",
        "--train.steps=3",
        "--optim.lr",
        "0.01",
        "--set",
        "log.interval=2",
        "--log.interval=4",
        "--print-config",
    ]);
    assert_eq!(code, 0, "{err}");
    for want in ["steps = 3", "lr = 0.01", "interval = 4"] {
        assert!(out.lines().any(|l| l == want), "{want}: {out}");
    }
    // A flag alone, or before another flag, is a boolean set true.
    let (code, out, err) = phalanx(&["train", "--checkpoint.async", "--print-config"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l == "async = true"), "{out}");
    let (code, _, err) = phalanx(&["train", "--nosuch.key=1", "--print-config"]);
    assert_ne!(code, 0);
    assert!(err.contains("--nosuch.key"), "{err}");
    let (code, _, err) = phalanx(&["train", "--train.nosuch=1", "--print-config"]);
    assert_ne!(code, 0);
    assert!(err.contains("train.nosuch"), "{err}");
}
