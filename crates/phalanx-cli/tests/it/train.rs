//! `phalanx train` and `phalanx generate` end to end, as a user runs them.

use crate::common;
use common::*;

use std::process::Command;

fn tmpdir(name: &str) -> ScratchDir {
    fresh_dir("phalanx-test", name)
}

/// Validation every 10 steps on 2 batches, on top of the small model.
const EVAL: &[&str] = &[
    "--set",
    "train.eval_interval=10",
    "--set",
    "train.eval_batches=2",
];

fn train(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("train")
        .args(SMALL)
        .args(EVAL)
        .args(args)
        .current_dir(repo())
        .env_remove("RANK")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn json_log_has_one_object_per_step() {
    let d = tmpdir("json");
    let log = d.join("log.jsonl");
    let (code, out, err) = train(&[
        "--nproc-per-node",
        "2",
        "--set",
        "train.steps=12",
        "--log-json",
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("[rank 0] [") && out.contains("tok/s") && out.contains("val "),
        "{out}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    for (k, v) in lines.iter().enumerate() {
        assert_eq!(v["step"].as_u64(), Some(k as u64));
        for key in ["loss", "lr", "tokens_per_s", "step_ms"] {
            assert!(
                v[key].as_f64().is_some_and(|x| x.is_finite() && x > 0.0),
                "{key} in {v}"
            );
        }
    }
    // The first step carries each rank's memory report.
    let mem = lines[0]["memory"]
        .as_array()
        .expect("memory report at step 1");
    assert_eq!(mem.len(), 2);
    assert!(mem[1]["params"].as_u64().unwrap() > 0 && mem[1]["peak_rss"].as_u64().unwrap() > 0);
    // Byte-level start: ln(256) = 5.55; the loss falls.
    let first = lines[0]["loss"].as_f64().unwrap();
    let last = lines[11]["loss"].as_f64().unwrap();
    assert!(
        (first - 256f64.ln()).abs() < 0.5 && last < first - 0.5,
        "{first} -> {last}"
    );
    assert!(lines[9]["val_loss"].as_f64().is_some());
}

#[test]
fn save_generate_and_init_from() {
    let d = tmpdir("save");
    let model = d.join("model.safetensors");
    let plot = d.join("loss.svg");
    let plot_set = format!("log.plot=\"{}\"", plot.display());
    let (code, out, err) = train(&[
        "--nproc-per-node",
        "1",
        "--set",
        "train.steps=40",
        "--save-final",
        model.to_str().unwrap(),
        "--set",
        &plot_set,
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(model.exists() && d.join("config.json").exists());
    assert!(std::fs::read_to_string(&plot)
        .unwrap()
        .contains("<polyline"));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["n_embd"], 32);
    assert_eq!(cfg["model_type"], "gpt2");

    // Sampling reads the shape from config.json.
    let g = Command::new(BIN)
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "And God said",
            "--tokens",
            "40",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&g.stdout);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    assert!(
        text.starts_with("And God said") && text.len() > "And God said".len() + 10,
        "{text}"
    );

    // Starting from the saved weights starts from a trained loss.
    let log = d.join("init.jsonl");
    let (code, out, err) = train(&[
        "--nproc-per-node",
        "1",
        "--set",
        "train.steps=1",
        "--init-from",
        model.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert!(v["loss"].as_f64().unwrap() < 4.0, "{v}");
}

#[test]
fn bad_config_is_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (&["--set", "train.stepz=3"], "unknown key `train.stepz`"),
        (
            &["--set", "train.steps=many"],
            "`train.steps` expects an integer",
        ),
        (&["--set", "nosuch.key=1"], "unknown key `nosuch`"),
        (
            &["--set", "model.preset=\"gpt-huge\""],
            "unknown model.preset",
        ),
        (&["--set", "model.n_head=3"], "divisible by model.n_head"),
        (
            &["--set", "parallel.dp=3", "--nproc-per-node", "2"],
            "parallel.dp = 3",
        ),
        (
            &["--set", "optim.name=\"lion\""],
            r#"optim.name must be "adamw", "adam" or "sgd", not "lion""#,
        ),
        (
            &["--set", "zero_optimization.stage=4"],
            "zero_optimization.stage must be 0 to 3",
        ),
        (
            &[
                "--set",
                "parallel.sharding_strategy=FULL_SHARD",
                "--set",
                "zero_optimization.stage=2",
            ],
            "means ZeRO stage 3",
        ),
        (
            &["--set", "parallel.sharding_strategy=PARTIAL"],
            r#"parallel.sharding_strategy must be "FULL_SHARD""#,
        ),
        (
            &["--set", "zero_optimization.offload_optimizer.device=tape"],
            r#"zero_optimization.offload_optimizer.device must be "none", "cpu" or "nvme", not "tape""#,
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = train(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
    }
}

#[test]
fn bad_data_and_weights_are_clear_errors() {
    let d = tmpdir("bad");
    let short = d.join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let set = format!("data.path=\"{}\"", short.display());
    let (code, _, err) = train(&["--nproc-per-node", "1", "--set", &set]);
    assert_eq!(code, 1);
    eprintln!("{err}");
    assert!(
        err.contains("phalanx train: error") && err.contains("short.txt"),
        "{err}"
    );

    // A safetensors file without the model's tensors (as large as the
    // model, or its size alone would refuse it, see checkpoint_cmd.rs).
    let bogus = d.join("bogus.safetensors");
    let t = candle_core::Tensor::zeros(
        (200, 200),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("something.else".to_string(), t)]),
        &bogus,
    )
    .unwrap();
    let (code, _, err) = train(&[
        "--nproc-per-node",
        "1",
        "--init-from",
        bogus.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bogus.safetensors: missing tensor `transformer."),
        "{err}"
    );
    assert!(
        !err.contains("candle_core::error"),
        "no backtrace for users: {err}"
    );
}

#[test]
fn pipeline_training_prints_the_bubble_and_writes_a_trace() {
    let d = tmpdir("pp");
    let trace = d.join("trace.json");
    let (code, out, err) = train(&[
        "--nproc-per-node",
        "2",
        "--set",
        "parallel.pp=2",
        "--set",
        "train.grad_accum_steps=4",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.steps=3",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("pipeline 1f1b: p = 2, m = 4; measured bubble per rank ["),
        "{out}"
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    // Both ranks' forwards and backwards are in it.
    for pid in [0, 1] {
        for kind in ["F", "B"] {
            assert!(
                events
                    .iter()
                    .any(|e| e["pid"] == pid
                        && e["name"].as_str().is_some_and(|n| n.starts_with(kind))),
                "rank {pid} {kind} missing"
            );
        }
    }
}

#[test]
fn schedule_command_prints_a_valid_table() {
    let out = Command::new(BIN)
        .args([
            "schedule",
            "--schedule",
            "gpipe",
            "--pp",
            "2",
            "--micro-batches",
            "3",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("rank 0: F0 F1 F2 B0 B1 B2") || text.contains("rank 0: F0 F1 F2 B2 B1 B0"),
        "{text}"
    );
    assert!(
        text.contains("valid; simulated bubble per rank [0.250, 0.250]"),
        "{text}"
    );
    let bad = Command::new(BIN)
        .args(["schedule", "--schedule", "zigzag"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    // Sizes whose table would not fit (or whose product overflows) are
    // refused naming the arguments, not a panic or an allocation failure.
    for (schedule, pp, m) in [
        ("1f1b", "18446744073709551615", "1"),
        ("interleaved:18446744073709551615", "2", "2"),
        ("1f1b", "2000", "2000"),
    ] {
        let out = Command::new(BIN)
            .args(["schedule", "--schedule", schedule])
            .args(["--pp", pp, "--micro-batches", m])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{schedule} {pp} {m}: {err}");
        assert!(
            err.contains(&format!("--pp {pp} x")) && err.contains("more than a printed table"),
            "{err}"
        );
    }
}
