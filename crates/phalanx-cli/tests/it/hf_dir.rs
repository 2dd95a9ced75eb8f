//! A Hugging Face directory is enough: for every family, a directory that
//! holds only `model.safetensors` and `config.json` (saved by
//! `--save-final`, copied alone) trains with `--init-from DIR`, generates
//! with `generate --model DIR` and imports with `checkpoint from-hf DIR`,
//! without any `--set model.*`: the `config.json` picks the family and the
//! shape. An explicit `--set model.KEY` that the weights fix and that
//! disagrees is refused naming both values; one they do not fix (a rotary
//! model's context) wins.

use crate::common;
use common::*;

use std::path::Path;

/// Flags of every run that are not the model's.
const RUN: &[&str] = &[
    "--nproc-per-node",
    "1",
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

fn train(model: &[&str], extra: &[&str]) -> (i32, String, String) {
    let mut a = vec!["train"];
    a.extend_from_slice(RUN);
    a.extend_from_slice(model);
    a.extend_from_slice(extra);
    phalanx(&a)
}

/// The first loss a run logs (`--log-json`).
fn first_loss(log: &Path) -> f64 {
    let text = std::fs::read_to_string(log).unwrap();
    let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    v["loss"].as_f64().unwrap()
}

/// Per family: the flags of a small model, the line the banner prints for
/// it (its shape, as config.json must give it back), and the `--set` that
/// contradicts its config.json with the error it must name.
struct Case {
    name: &'static str,
    flags: &'static [&'static str],
    banner: &'static str,
    conflict: &'static str,
    conflict_error: &'static str,
}

const CASES: &[Case] = &[
    Case {
        name: "gpt2",
        flags: &[
            "--set",
            "model.n_layer=2",
            "--set",
            "model.n_head=2",
            "--set",
            "model.n_embd=32",
            "--set",
            "model.block_size=32",
        ],
        banner: "(GPT-2: 2 layers, 2 heads, 32 wide, vocab 256, context 32,",
        conflict: "model.n_embd=64",
        conflict_error: "config.json has n_embd = 32 but model.n_embd = 64",
    },
    Case {
        name: "llama",
        flags: &[
            "--set",
            "model.arch=llama",
            "--set",
            "model.n_layer=2",
            "--set",
            "model.n_kv_head=1",
            "--set",
            "model.n_embd=32",
            "--set",
            "model.intermediate_size=48",
            "--set",
            "model.block_size=32",
            "--set",
            "model.tie_word_embeddings=true",
        ],
        banner: "(Llama: 2 layers, 4 heads / 1 kv heads, 32 wide, MLP 48, vocab 256, context 32,",
        conflict: "model.n_kv_head=2",
        conflict_error: "config.json has num_key_value_heads = 1 but model.n_kv_head = 2",
    },
    Case {
        name: "qwen2",
        flags: &[
            "--set",
            "model.arch=qwen2",
            "--set",
            "model.n_layer=2",
            "--set",
            "model.n_embd=32",
            "--set",
            "model.intermediate_size=48",
            "--set",
            "model.block_size=32",
            "--set",
            "model.rope_theta=50000.0",
        ],
        banner: "(Qwen2: 2 layers, 4 heads / 2 kv heads, 32 wide, MLP 48, vocab 256, context 32,",
        conflict: "model.rope_theta=1e6",
        conflict_error: "config.json has rope_theta = 50000.0 but model.rope_theta = 1000000.0",
    },
];

#[test]
fn a_directory_with_weights_and_config_json_is_enough_for_every_family() {
    let d = fresh_dir("phalanx-hf-dir", "all");
    for case in CASES {
        let saved = d.join(format!("{}-saved", case.name));
        let save_path = if case.name == "gpt2" {
            saved.join("model.safetensors")
        } else {
            saved.clone()
        };
        let (code, out, err) = train(
            case.flags,
            &[
                "--set",
                "train.steps=30",
                "--set",
                "optim.lr=0.01",
                "--save-final",
                save_path.to_str().unwrap(),
            ],
        );
        assert_eq!(code, 0, "{}: {out}\n{err}", case.name);
        assert!(out.contains(case.banner), "{}: {out}", case.name);
        // Only the weights and config.json, in a directory of their own.
        let hf = d.join(case.name);
        std::fs::create_dir_all(&hf).unwrap();
        for f in ["model.safetensors", "config.json"] {
            std::fs::copy(saved.join(f), hf.join(f)).unwrap();
        }
        let hf_s = hf.to_str().unwrap();

        // Train from it, no model key given: the shape is config.json's, and
        // the first loss is the trained model's.
        let log = d.join(format!("{}.jsonl", case.name));
        let (code, out, err) = train(
            &[],
            &[
                "--set",
                "train.steps=1",
                "--init-from",
                hf_s,
                "--log-json",
                log.to_str().unwrap(),
            ],
        );
        assert_eq!(code, 0, "{}: {out}\n{err}", case.name);
        assert!(out.contains(case.banner), "{}: {out}", case.name);
        assert!(
            out.contains(&format!("model {}", hf.join("config.json").display())),
            "{}: {out}",
            case.name
        );
        let loss = first_loss(&log);
        assert!(
            loss < 256f64.ln() - 1.0,
            "{}: starts from loss {loss}, not the saved model's",
            case.name
        );

        // A key the weights fix, given otherwise: refused before any rank
        // starts, naming both values.
        let (code, out, err) = train(&["--set", case.conflict], &["--init-from", hf_s]);
        assert_eq!(code, 2, "{}: {out}\n{err}", case.name);
        assert!(err.contains(case.conflict_error), "{}: {err}", case.name);
        assert!(!out.contains("step "), "{}: no training", case.name);

        // Generation and import read the same directory.
        let (code, out, err) = phalanx(&[
            "generate",
            "--model",
            hf_s,
            "--prompt",
            "In the",
            "--tokens",
            "8",
            "--temperature",
            "0",
        ]);
        assert_eq!(code, 0, "{}: {out}\n{err}", case.name);
        assert!(out.starts_with("In the"), "{}: {out}", case.name);
        let imported = d.join(format!("{}-imported", case.name));
        let (code, out, err) =
            phalanx(&["checkpoint", "from-hf", hf_s, imported.to_str().unwrap()]);
        assert_eq!(code, 0, "{}: {out}\n{err}", case.name);
        assert!(out.contains("wrote"), "{}: {out}", case.name);
    }

    // A rotary model's context is not fixed by its weights: an explicit
    // block_size wins over max_position_embeddings.
    let (code, out, err) = train(
        &["--set", "model.block_size=16"],
        &[
            "--set",
            "train.steps=1",
            "--init-from",
            d.join("llama").to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("MLP 48, vocab 256, context 16,"), "{out}");
    // A config.json of a family not built is named.
    let other = d.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        d.join("llama/model.safetensors"),
        other.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        other.join("config.json"),
        r#"{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}"#,
    )
    .unwrap();
    let (code, _, err) = train(&[], &["--init-from", other.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model_type \"mamba\"") && err.contains("LlamaForCausalLM"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
