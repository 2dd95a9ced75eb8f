//! Qwen2 against Hugging Face transformers on one rank: fixtures made once
//! by `tests/fixtures/make_qwen2_fixture.py` (tiny `Qwen2ForCausalLM`s in
//! float64, weights rounded to f32, q / k / v biases and norms away from
//! their initial values) are loaded by Phalanx, which must give the same
//! logits, training losses and final parameters (biases included: GQA with
//! a tied head and AdamW with weight decay; GQA untied with SGD), and
//! save the same file and `config.json` keys back. `config.json` features
//! not built are refused.

use crate::fixture;
use candle_core::{Device, Tensor};
use fixture::*;
use phalanx::engine::{Engine, EngineConfig};
use phalanx_models::llama::{self, LlamaConfig};
use phalanx_models::qwen2;
use std::collections::HashMap;

const CASES: [&str; 2] = ["qwen2_tied_gqa", "qwen2_untied"];

fn load(case: &str) -> (LlamaConfig, Engine, HashMap<String, Tensor>) {
    let cfg = qwen2::hf::config_from_json(&hf_config(case)).unwrap();
    let mut e = llama::engine(&cfg, &Device::Cpu, EngineConfig::default()).unwrap();
    qwen2::hf::load(&mut e, &cfg, dir(case)).unwrap();
    let expected = expected(case);
    (cfg, e, expected)
}

#[test]
fn config_json_reads_as_qwen2() {
    let c = qwen2::hf::config_from_json(&hf_config("qwen2_tied_gqa")).unwrap();
    assert!(c.qkv_bias && c.tie_word_embeddings);
    assert_eq!((c.n_head, c.n_kv_head, c.n_embd), (4, 2, 32));
    assert_eq!((c.rope_theta, c.rms_norm_eps), (1e6, 1e-6));
    let c = qwen2::hf::config_from_json(&hf_config("qwen2_untied")).unwrap();
    assert!(c.qkv_bias && !c.tie_word_embeddings);
    assert_eq!((c.n_kv_head, c.rope_theta), (2, 50000.0));
    // The biases are parameters, named as HF names them.
    let names = llama::hf::names(&c);
    for s in ["q_proj", "k_proj", "v_proj"] {
        assert!(names.contains(&format!("model.layers.1.self_attn.{s}.bias")));
    }
    assert!(!names.contains("model.layers.0.self_attn.o_proj.bias"));
}

#[test]
fn logits_match_transformers() {
    for case in CASES {
        let (cfg, e, expected) = load(case);
        let (x, _) = batch(&expected, 0);
        let ours = e.forward(&x).unwrap(); // (B, T, V)
        let want = &expected["logits"];
        assert_eq!(ours.dims(), want.dims(), "{case}");
        let err = rel_max(&f64s(&ours), &f64s(want));
        println!(
            "{case}: logits max rel err {err:e} ({} params)",
            cfg.num_params()
        );
        assert!(err < 1e-5, "{case}: logits differ by {err:e}");
        // The biases matter: without them, other logits.
        let mut plain = cfg;
        plain.qkv_bias = false;
        let mut p = llama::engine(&plain, &Device::Cpu, EngineConfig::default()).unwrap();
        for q in p.layout().params().to_vec() {
            let v = e.param(&q.name).unwrap().to_vec();
            p.param_mut(&q.name).unwrap().copy_from_slice(&v);
        }
        let other = rel_max(&f64s(&p.forward(&x).unwrap()), &f64s(want));
        assert!(other > 1e-3, "{case}: without biases as close: {other:e}");
    }
}

/// The final parameters' tolerance (max-relative): 2e-5, as Llama's, but
/// 5e-3 for the k bias under AdamW (on one rank it is off by 3e-4; the
/// parallel layouts' other summation orders reach 1.2e-3). Rotary's lowest-frequency pairs (at
/// θ = 1e6 and head size 8, one turns by under 4e-4 rad over the context) add nearly the same
/// q·b to every key's score, which softmax cancels: those elements of the
/// k bias's gradient are near zero, their f32 rounding is a large part of
/// them, and AdamW's normalisation turns it into steps transformers' f64
/// does not take (GPT-2's k bias, exactly zero in exact arithmetic, is
/// compared loosely for the same reason). SGD compares it at 2e-5.
fn tolerance(adamw: bool, name: &str) -> f64 {
    if adamw && name.ends_with("k_proj.bias") {
        5e-3
    } else {
        2e-5
    }
}

#[test]
fn training_matches_transformers() {
    for case in CASES {
        let (_cfg, mut e, expected) = load(case);
        let adamw = case == "qwen2_tied_gqa";
        train_as_recorded(case, &mut e, &expected, adamw);
        let mut worst = 0f64;
        for (name, err) in final_errors(&e, &expected) {
            let tol = tolerance(adamw, &name);
            if tol == 2e-5 {
                worst = worst.max(err);
            }
            assert!(
                err < tol,
                "{case} {name}: final parameters differ by {err:e}"
            );
        }
        println!("{case}: final parameters max rel err {worst:e}");
    }
}

#[test]
fn save_writes_back_the_same_file_and_config() {
    for case in CASES {
        let (cfg, e, _) = load(case);
        let tmp =
            std::env::temp_dir().join(format!("phalanx-qwen2-save-{case}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let t = llama::hf::export_tensors(&e).unwrap();
        let json = qwen2::hf::config_json(&cfg, "byte");
        phalanx_models::common::hf::save(&t, &json, &tmp, llama::hf::DEFAULT_SHARD_BYTES).unwrap();
        let ours = assert_saved_as_fixture(
            case,
            &tmp,
            &[
                "model_type",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "rms_norm_eps",
                "tie_word_embeddings",
                "hidden_act",
                "max_position_embeddings",
                "use_sliding_window",
            ],
        );
        assert_eq!(
            ours["architectures"],
            serde_json::json!(["Qwen2ForCausalLM"])
        );
        assert_eq!(
            llama::hf::rope_theta(&ours).unwrap(),
            llama::hf::rope_theta(&hf_config(case)).unwrap(),
            "{case}: rope_theta"
        );
        let cfg2 = qwen2::hf::config_from_json(&ours).unwrap();
        assert_eq!(cfg2, cfg);
        let mut e2 = llama::engine(
            &cfg,
            &Device::Cpu,
            EngineConfig {
                seed: 9,
                ..Default::default()
            },
        )
        .unwrap();
        qwen2::hf::load(&mut e2, &cfg, &tmp).unwrap();
        assert_eq!(e2.params_flat(), e.params_flat());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}

#[test]
fn mismatches_and_features_not_built_are_errors() {
    let good = qwen2::hf::config_from_json(&hf_config("qwen2_tied_gqa")).unwrap();
    let mut e = llama::engine(&good, &Device::Cpu, EngineConfig::default()).unwrap();
    let mut other = good;
    other.n_kv_head = 4;
    let err = qwen2::hf::load(&mut e, &other, dir("qwen2_tied_gqa"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("num_key_value_heads = 2 but model.n_kv_head = 4"),
        "{err}"
    );
    // Qwen2's weights are not a Llama's: the Llama check names model_type,
    // and a Llama config misses the biases.
    let err = llama::hf::load(&mut e, &good, dir("qwen2_tied_gqa"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("model_type \"qwen2\", not \"llama\""), "{err}");
    let mut no_bias = good;
    no_bias.qkv_bias = false;
    let mut e2 = llama::engine(&no_bias, &Device::Cpu, EngineConfig::default()).unwrap();
    let err = qwen2::hf::load(&mut e2, &no_bias, dir("qwen2_tied_gqa"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tensors not in this model") && err.contains("proj.bias"),
        "{err}"
    );
    // Sliding-window attention is refused; the window Qwen2.5 configs name
    // but do not use is not.
    let mut v = hf_config("qwen2_tied_gqa");
    v["use_sliding_window"] = serde_json::json!(true);
    v["sliding_window"] = serde_json::json!(8);
    v["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
    let err = qwen2::hf::config_from_json(&v).unwrap_err().to_string();
    assert!(err.contains("sliding-window attention"), "{err}");
    v["use_sliding_window"] = serde_json::json!(false);
    qwen2::hf::config_from_json(&v).unwrap();
    v["hidden_act"] = serde_json::json!("gelu");
    let err = qwen2::hf::config_from_json(&v).unwrap_err().to_string();
    assert!(err.contains("hidden_act \"gelu\" is not built"), "{err}");
    // Omitted keys take Qwen2Config's defaults (eps 1e-6, theta 10000).
    let mut v = hf_config("qwen2_tied_gqa");
    let o = v.as_object_mut().unwrap();
    o.remove("rms_norm_eps");
    o.remove("rope_parameters");
    let c = qwen2::hf::config_from_json(&v).unwrap();
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 10000.0));
}
