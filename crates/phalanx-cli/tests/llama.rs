//! `phalanx train` / `generate` / `checkpoint` with `model.arch = llama`, as
//! a user runs them: 2 ranks (DDP, then tp 2) with the HF layout saved and
//! loaded back, greedy generation from the saved directory, a checkpoint
//! converted back to HF.

mod common;
use common::*;

use std::process::Command;

const LLAMA: &[&str] = &[
    "--set",
    "model.arch=llama",
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.intermediate_size=48",
    "--set",
    "model.block_size=32",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "train.eval_interval=0",
    "--set",
    "log.interval=1",
    "--set",
    "log.plot=\"\"",
    "--set",
    "log.report=\"\"",
];

fn phalanx(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
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

fn train(extra: &[&str]) -> (i32, String, String) {
    let mut a = vec!["train", "--nproc-per-node", "2"];
    a.extend_from_slice(LLAMA);
    a.extend_from_slice(extra);
    phalanx(&a)
}

#[test]
fn train_save_load_generate_and_convert() {
    let d = fresh_dir("phalanx-llama-cli", "e2e");
    let first = d.join("first");
    let ck = d.join("ck");
    let (code, out, err) = train(&[
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.interval=4",
        "--set",
        &format!("checkpoint.dir=\"{}\"", ck.display()),
        "--save-final",
        first.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("Llama: 2 layers, 4 heads / 2 kv heads, 32 wide, MLP 48"),
        "{out}"
    );
    assert!(out.contains("Hugging Face Llama layout"), "{out}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(first.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["num_key_value_heads"], 2);

    // Continue from the saved directory under tensor parallelism.
    let second = d.join("second.safetensors");
    let (code, out, err) = train(&[
        "--set",
        "train.steps=2",
        "--set",
        "parallel.tp=2",
        "--init-from",
        first.to_str().unwrap(),
        "--save-final",
        second.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(d.join("config.json").is_file());

    // Greedy generation is deterministic and reads config.json.
    let gen = |seed: &str| {
        let (code, out, err) = phalanx(&[
            "generate",
            "--model",
            first.to_str().unwrap(),
            "--prompt",
            "In the",
            "--tokens",
            "40",
            "--temperature",
            "0",
            "--seed",
            seed,
        ]);
        assert_eq!(code, 0, "{out}\n{err}");
        out
    };
    let a = gen("1");
    assert!(a.starts_with("In the") && a.len() > "In the".len(), "{a}");
    assert_eq!(a, gen("2"));

    // The run's checkpoint converts back to the same HF tensors.
    let conv = d.join("conv");
    let step = ck.join("step-00000004");
    let (code, out, err) = phalanx(&[
        "checkpoint",
        "convert",
        step.to_str().unwrap(),
        conv.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Hugging Face Llama 2 layer(s)"), "{out}");
    let dev = candle_core::Device::Cpu;
    let a = candle_core::safetensors::load(first.join("model.safetensors"), &dev).unwrap();
    let b = candle_core::safetensors::load(conv.join("model.safetensors"), &dev).unwrap();
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        let x: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = b[k].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(x, y, "{k}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn arch_errors_are_named_before_any_rank_starts() {
    let (code, _, err) = phalanx(&[
        "train",
        "--set",
        "model.arch=llama",
        "--set",
        "model.n_layers=2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown key `model.n_layers`"), "{err}");
    let (code, _, err) = phalanx(&[
        "train",
        "--set",
        "model.preset=llama-tiny",
        "--set",
        "model.arch=gpt2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("is a Llama preset"), "{err}");
}
