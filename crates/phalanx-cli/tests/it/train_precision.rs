//! `phalanx train` with mixed precision, as a user runs it: an fp16 run
//! whose initial loss scale is far too large overflows, skips those steps
//! on every rank, lowers the scale, and then trains; the JSON log and the
//! progress line say so.

use crate::common;
use common::*;

use std::process::Command;

#[test]
fn fp16_overflow_skips_steps_lowers_the_scale_and_logs_it() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "test-fp16");
    let log = d.join("log.jsonl");
    let sets = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.micro_batch_size=4",
        "train.steps=14",
        "train.eval_interval=0",
        "log.plot=\"\"",
        "log.interval=1",
        "train.precision=fp16",
        // 2^24 times the gradients overflows fp16 (max 65504).
        "fp16.initial_scale_power=24",
        "fp16.hysteresis=1",
    ];
    let mut cmd = Command::new(BIN);
    cmd.args(["train", "--nproc-per-node", "2", "--log-json"])
        .arg(&log)
        .current_dir(repo())
        .env_remove("RANK");
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("skipped: inf/NaN gradients, scale lowered to 8388608"),
        "{stdout}"
    );
    assert!(
        stdout.contains("steps skipped (inf/NaN gradients)"),
        "{stdout}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 14);
    let scale: Vec<f64> = lines
        .iter()
        .map(|v| v["loss_scale"].as_f64().unwrap())
        .collect();
    let skipped: Vec<bool> = lines.iter().map(|v| v["skipped"] == true).collect();
    assert_eq!(scale[0], (1u64 << 24) as f64);
    assert!(skipped[0], "2^24 must overflow: {scale:?}");
    // Each skip halves the scale; once it fits, steps run and the scale
    // stays (the window of 1000 clean steps is far away).
    let first_ok = skipped.iter().position(|s| !s).expect("a step ran");
    assert!(skipped[first_ok..].iter().all(|s| !s), "{skipped:?}");
    for k in 1..lines.len() {
        let want = if skipped[k - 1] {
            scale[k - 1] / 2.0
        } else {
            scale[k - 1]
        };
        assert_eq!(scale[k], want, "step {k}: {scale:?}");
    }
    let (l0, l1) = (
        lines[first_ok]["loss"].as_f64().unwrap(),
        lines[13]["loss"].as_f64().unwrap(),
    );
    assert!(l1.is_finite() && l1 < l0, "loss {l0} -> {l1}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `phalanx train` of a tiny model in fp16 on one rank, logging every
/// step, with `sets` beside.
fn fp16_train(sets: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["train", "--nproc-per-node", "1"])
        .current_dir(repo())
        .env_remove("RANK");
    let tiny = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.micro_batch_size=4",
        "train.eval_interval=0",
        "log.plot=\"\"",
        "log.report=\"\"",
        "log.interval=1",
        "train.precision=fp16",
    ];
    for s in tiny.iter().chain(sets) {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Hysteresis keeps the scale at the first overflow (and the progress line
/// says so, not "lowered"); a scale stuck at fp16.min_loss_scale ends the
/// run after 3 overflows there, and the JSON log holds the third (it used
/// to end before that step was logged).
#[test]
fn hysteresis_keeps_the_scale_and_the_step_at_the_floor_is_logged() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "test-fp16-floor");
    let log = d.join("log.jsonl");
    let out = fp16_train(&[
        "train.steps=12",
        "fp16.initial_scale_power=30",
        "fp16.hysteresis=2",
        "fp16.min_loss_scale=268435456",
    ])
    .arg("--log-json")
    .arg(&log)
    .output()
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("3 steps in a row were skipped at it"),
        "{stderr}"
    );
    assert!(stdout.contains("scale kept (fp16.hysteresis)"), "{stdout}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The first overflow keeps 2^30 (hysteresis 2), then halving reaches
    // the floor 2^28; every step overflows.
    assert_eq!(lines[0]["loss_scale"], 1073741824.0);
    assert_eq!(lines[1]["loss_scale"], 1073741824.0);
    let at_floor = lines
        .iter()
        .filter(|v| v["skipped"] == true && v["loss_scale"] == 268435456.0)
        .count();
    assert_eq!(at_floor, 3, "the step that ended the run is logged");
    let _ = std::fs::remove_dir_all(&d);
}

/// At the default floor, scale 1, the progress line still shows the scale
/// and says what kept it (it used to drop both at 1, as under fp32).
#[test]
fn the_scale_at_one_is_shown_and_what_kept_it_said() {
    let out = fp16_train(&[
        "train.steps=6",
        "fp16.initial_scale_power=0",
        "optim.lr=1e30",
        "optim.schedule=\"constant\"",
        "optim.warmup_steps=0",
        "optim.grad_clip=0",
    ])
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(
            "| scale 1 | skipped: inf/NaN gradients, scale kept (at fp16.min_loss_scale)"
        ),
        "{stdout}"
    );
}

/// A compression hook with one data-parallel rank reduces nothing: said.
#[test]
fn a_hook_with_one_data_parallel_rank_is_noted() {
    let out = Command::new(BIN)
        .args(["train", "--nproc-per-node", "1"])
        .args([
            "--set",
            "parallel.comm_hook=\"int8\"",
            "--set",
            "train.steps=1",
        ])
        .args(["--set", "model.n_layer=1", "--set", "log.plot=\"\""])
        .current_dir(repo())
        .env_remove("RANK")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("parallel.comm_hook = \"int8\": the data-parallel group has one rank"),
        "{err}"
    );
}
