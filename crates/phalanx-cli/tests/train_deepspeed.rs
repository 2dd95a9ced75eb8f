//! `phalanx train` with DeepSpeed JSON configs: `--config FILE.json`,
//! `--deepspeed_config` / `--deepspeed-config`.

mod common;
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
    let d = std::env::temp_dir().join(format!("phalanx-test-ds-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
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
    let (code, out, err) = phalanx(&[
        "train",
        "--deepspeed-config",
        "examples/ds_config.json",
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
        "--set",
        "log.plot=\"\"",
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("done: 3 steps"), "{out}");
}
