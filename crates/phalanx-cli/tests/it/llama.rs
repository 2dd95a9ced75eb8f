//! `phalanx train` / `generate` / `checkpoint` with `model.arch = llama`, as
//! a user runs them: 2 ranks (DDP, then tp 2) with the HF layout saved and
//! loaded back, greedy generation from the saved directory, a checkpoint
//! converted back to HF.

use crate::common;
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
    // A checkpoint of another shape: named before launching.
    let d = fresh_dir("phalanx-llama-cli", "shape");
    std::fs::write(
        d.join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048}"#,
    )
    .unwrap();
    std::fs::write(d.join("model.safetensors"), b"").unwrap();
    // (The config.json sets the shape; an explicit key that disagrees is
    // refused, naming both values.)
    let (code, _, err) = phalanx(&[
        "train",
        "--set",
        "model.arch=llama",
        "--set",
        "model.n_layer=4",
        "--init-from",
        d.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("num_hidden_layers = 22 but model.n_layer = 4"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A word-level `tokenizer.json` of 6 words (ids 0-5, 0 unknown).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "in": 1, "the": 2, "beginning": 3, "god": 4, "created": 5}}
}"#;

#[test]
fn tokenize_train_and_generate_with_a_tokenizer_json() {
    let d = fresh_dir("phalanx-llama-cli", "tok");
    std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    let text = "in the beginning god created the\n".repeat(300);
    std::fs::write(d.join("text.txt"), &text).unwrap();
    let bin = d.join("text.bin");
    let (code, out, err) = phalanx(&[
        "tokenize",
        "--tokenizer",
        d.to_str().unwrap(),
        d.join("text.txt").to_str().unwrap(),
        bin.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("1800 tokens, vocabulary 6, 16 bits per token"),
        "{out}"
    );
    // llm.c header: magic 20240520, version 1, 1800 uint16 tokens.
    let b = std::fs::read(&bin).unwrap();
    let word = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!((word(0), word(1), word(2)), (20240520, 1, 1800));
    let tok = |i: usize| u16::from_le_bytes([b[1024 + 2 * i], b[1025 + 2 * i]]);
    assert_eq!((0..6).map(tok).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 2]);
    // Train a 6-word Llama on it, then generate through the tokenizer.json
    // beside the saved model: it has learned the sentence.
    let model = d.join("model");
    let (code, out, err) = train(&[
        "--set",
        "model.vocab_size=6",
        "--set",
        "model.block_size=12",
        "--set",
        &format!("data.path=\"{}\"", bin.display()),
        "--set",
        "train.steps=40",
        "--set",
        "optim.lr=0.01",
        "--save-final",
        model.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    std::fs::copy(d.join("tokenizer.json"), model.join("tokenizer.json")).unwrap();
    let (code, out, err) = phalanx(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "in the beginning",
        "--tokens",
        "3",
        "--temperature",
        "0",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("god created the"), "{out}");
    // Generation stops at the end-of-text token ("created" renamed "</s>",
    // id 5, in the tokenizer beside the model), unless --ignore-eos.
    std::fs::write(
        model.join("tokenizer.json"),
        TOKENIZER.replace("\"created\"", "\"</s>\""),
    )
    .unwrap();
    let gen3 = |extra: &[&str]| {
        let m = model.to_str().unwrap();
        let mut args = vec!["generate", "--model", m, "--prompt", "in the beginning"];
        args.extend(["--tokens", "3", "--temperature", "0"]);
        args.extend(extra);
        phalanx(&args)
    };
    let (code, out, err) = gen3(&[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out.trim_end(), "in the beginning god", "{out}");
    let (code, out, err) = gen3(&["--ignore-eos"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("god </s> the"), "{out}");
    // A downloaded model (no tokenizer recorded) without a tokenizer.json
    // beside it: an error naming the setting, not bytes from a 6-word model.
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let cj = model.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cj).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("phalanx_tokenizer");
    std::fs::write(&cj, v.to_string()).unwrap();
    let (code, out, err) = gen3(&[]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("no tokenizer") && err.contains("--set data.tokenizer"),
        "{err}"
    );
    // Fine-tuning that downloaded model with its tokenizer.json beside it
    // reads the text through that tokenizer (it trained on bytes, ids the
    // model does not know as words), unless --set names another.
    std::fs::write(model.join("tokenizer.json"), TOKENIZER).unwrap();
    let tune = |extra: &[&str]| {
        let mut a = vec!["--init-from", model.to_str().unwrap()];
        a.extend(["--set", "train.steps=1", "--nproc-per-node", "1"]);
        let data = format!("data.path=\"{}\"", d.join("text.txt").display());
        let mut a: Vec<String> = a.iter().map(|s| s.to_string()).collect();
        a.extend(["--set".to_string(), data]);
        a.extend(extra.iter().map(|s| s.to_string()));
        let mut full = vec!["train".to_string()];
        full.extend(a);
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        phalanx(&refs)
    };
    let (code, out, err) = tune(&[]);
    assert_eq!(code, 0, "{out}\n{err}");
    let beside = model
        .join("tokenizer.json")
        .canonicalize()
        .unwrap()
        .display()
        .to_string();
    assert!(
        out.contains(&format!("({beside} tokenizer): 1764 train / 36 val tokens")),
        "{out}"
    );
    // Named, the byte tokenizer is taken (and its ids refused by the
    // 6-word model).
    let (code, out, err) = tune(&["--set", "data.tokenizer=\"byte\""]);
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("out of range for the model's vocab_size 6"),
        "{err}"
    );
    // A --bos the tokenizer does not have is named.
    let (code, _, err) = phalanx(&[
        "tokenize",
        "--tokenizer",
        d.join("tokenizer.json").to_str().unwrap(),
        "--bos",
        "<s>",
        d.join("text.txt").to_str().unwrap(),
        d.join("x.bin").to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("--bos \"<s>\" is not a token"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}
