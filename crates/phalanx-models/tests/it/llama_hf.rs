//! Llama against Hugging Face transformers: fixtures made once by
//! `tests/fixtures/make_llama_fixture.py` (a tiny `LlamaForCausalLM` in
//! float64, weights rounded to f32) are loaded by Phalanx, which must give
//! the same logits and the same training losses and final parameters
//! (AdamW with weight decay and GQA + untied head; SGD with a tied head and
//! multi-head attention; SGD with Llama 3 rotary scaling), and save the
//! same file back.

use crate::fixture;
use candle_core::{Device, Tensor};
use fixture::*;
use phalanx::engine::{Engine, EngineConfig};
use phalanx_models::llama::config::RopeScaling;
use phalanx_models::llama::{self, hf, LlamaConfig};
use std::collections::HashMap;

fn load(case: &str) -> (LlamaConfig, Engine, HashMap<String, Tensor>) {
    let cfg = hf::config_from_json(&hf_config(case)).unwrap();
    let mut e = llama::engine(&cfg, &Device::Cpu, EngineConfig::default()).unwrap();
    hf::load(&mut e, &cfg, dir(case)).unwrap();
    let expected = expected(case);
    (cfg, e, expected)
}

#[test]
fn logits_match_transformers() {
    for case in [
        "llama_gqa",
        "llama_tied_mha",
        "llama3_scaled",
        "llama_head_dim",
    ] {
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
        if case == "llama3_scaled" {
            // The scaling matters here: unscaled rotary gives other logits.
            let mut plain = cfg;
            plain.rope_scaling = RopeScaling::None;
            let mut p = llama::engine(&plain, &Device::Cpu, EngineConfig::default()).unwrap();
            p.params_flat_mut().copy_from_slice(e.params_flat());
            let other = rel_max(&f64s(&p.forward(&x).unwrap()), &f64s(want));
            assert!(other > 1e-3, "unscaled rotary is as close: {other:e}");
        }
    }
}

#[test]
fn training_matches_transformers() {
    for case in [
        "llama_gqa",
        "llama_tied_mha",
        "llama3_scaled",
        "llama_head_dim",
    ] {
        let (_cfg, mut e, expected) = load(case);
        train_as_recorded(case, &mut e, &expected, case == "llama_gqa");
        let mut worst = 0f64;
        for (name, err) in final_errors(&e, &expected) {
            worst = worst.max(err);
            assert!(
                err < 2e-5,
                "{case} {name}: final parameters differ by {err:e}"
            );
        }
        println!("{case}: final parameters max rel err {worst:e}");
    }
}

#[test]
fn save_writes_back_the_same_file_and_config() {
    for case in [
        "llama_gqa",
        "llama_tied_mha",
        "llama3_scaled",
        "llama_head_dim",
    ] {
        let (cfg, e, _) = load(case);
        let tmp =
            std::env::temp_dir().join(format!("phalanx-llama-save-{case}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let t = hf::export_tensors(&e).unwrap();
        hf::save(&t, &cfg, "byte", &tmp, hf::DEFAULT_SHARD_BYTES).unwrap();
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
                "head_dim",
                "max_position_embeddings",
            ],
        );
        assert_eq!(
            hf::rope_theta(&ours).unwrap(),
            hf::rope_theta(&hf_config(case)).unwrap(),
            "{case}: rope_theta"
        );
        // And the saved directory loads into a fresh engine identically.
        let cfg2 = hf::config_from_json(&ours).unwrap();
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
        hf::load(&mut e2, &cfg, &tmp).unwrap();
        assert_eq!(e2.params_flat(), e.params_flat());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}

#[test]
fn sharded_layout_round_trips() {
    let (cfg, e, _) = load("llama_gqa");
    let tmp = std::env::temp_dir().join(format!("phalanx-llama-shards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let t = hf::export_tensors(&e).unwrap();
    // ~20 KB shards: several files and an index.
    let files = hf::save(&t, &cfg, "byte", &tmp, 20_000).unwrap();
    assert!(files.len() > 4, "{files:?}");
    assert!(tmp.join(hf::INDEX).is_file());
    assert!(!tmp.join(hf::SINGLE).exists());
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.join(hf::INDEX)).unwrap()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), t.len());
    for via in [tmp.clone(), tmp.join(hf::INDEX)] {
        let mut e2 = llama::engine(
            &cfg,
            &Device::Cpu,
            EngineConfig {
                seed: 3,
                ..Default::default()
            },
        )
        .unwrap();
        hf::load(&mut e2, &cfg, &via).unwrap();
        assert_eq!(e2.params_flat(), e.params_flat(), "{via:?}");
    }
    // Saving the same directory as one file replaces the sharded layout
    // (a stale index would otherwise win), and back.
    hf::save(&t, &cfg, "byte", &tmp, hf::DEFAULT_SHARD_BYTES).unwrap();
    assert!(!tmp.join(hf::INDEX).exists() && !files[0].exists());
    let files = hf::save(&t, &cfg, "byte", &tmp, 20_000).unwrap();
    assert!(!tmp.join(hf::SINGLE).exists() && tmp.join(hf::INDEX).is_file());
    // A file of another name beside them is no replacement: the sharded
    // model stays.
    hf::save(&t, &cfg, "byte", &tmp.join("other.safetensors"), 20_000).unwrap();
    assert!(tmp.join(hf::INDEX).is_file() && files.iter().all(|f| f.exists()));
    std::fs::remove_file(tmp.join("other.safetensors")).unwrap();
    // The directory's model.safetensors replaces the sharded layout.
    hf::save(&t, &cfg, "byte", &tmp.join(hf::SINGLE), 20_000).unwrap();
    assert!(!tmp.join(hf::INDEX).exists() && !files[0].exists());
    assert!(tmp.join(hf::SINGLE).is_file());
    // A save that fails midway over shards of the same names leaves no
    // index naming old and new shards together: the last shard cannot be
    // replaced (a directory stands in its place).
    let files = hf::save(&t, &cfg, "byte", &tmp, 20_000).unwrap();
    let last = files
        .iter()
        .rfind(|p| p.to_string_lossy().ends_with(".safetensors"))
        .unwrap()
        .clone();
    std::fs::remove_file(&last).unwrap();
    std::fs::create_dir(&last).unwrap();
    assert!(hf::save(&t, &cfg, "byte", &tmp, 20_000).is_err());
    assert!(!tmp.join(hf::INDEX).exists());
    let mut e4 = llama::engine(&cfg, &Device::Cpu, EngineConfig::default()).unwrap();
    assert!(
        hf::load(&mut e4, &cfg, &tmp).is_err(),
        "no mixed model loads"
    );
    std::fs::remove_dir(&last).unwrap();
    let files = hf::save(&t, &cfg, "byte", &tmp, 20_000).unwrap();
    // A missing shard is named.
    std::fs::remove_file(&files[1]).unwrap();
    let mut e3 = llama::engine(&cfg, &Device::Cpu, EngineConfig::default()).unwrap();
    let err = hf::load(&mut e3, &cfg, &tmp).unwrap_err().to_string();
    assert!(err.contains("is missing"), "{err}");
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A tensor in two shards is refused by the one-rank and the
/// tensor-parallel load alike (either copy could be taken).
#[test]
fn a_tensor_in_two_shards_is_refused_under_tp_too() {
    let (cfg, e, _) = load("llama_gqa");
    let tmp = std::env::temp_dir().join(format!("phalanx-llama-dup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let t = hf::export_tensors(&e).unwrap();
    let files = hf::save(&t, &cfg, "byte", &tmp, 20_000).unwrap();
    let shard = files
        .iter()
        .find(|f| f.to_string_lossy().ends_with(".safetensors"))
        .unwrap();
    let mut first = candle_core::safetensors::load(shard, &Device::Cpu).unwrap();
    let other = t.keys().find(|k| !first.contains_key(*k)).unwrap().clone();
    first.insert(other.clone(), t[&other].clone());
    candle_core::safetensors::save(&first, shard).unwrap();
    let mut e1 = llama::engine(&cfg, &Device::Cpu, EngineConfig::default()).unwrap();
    let err = hf::load(&mut e1, &cfg, &tmp).unwrap_err().to_string();
    assert!(err.contains("more than one"), "tp 1: {err}");
    let dir = tmp.clone();
    let errs = phalanx_comm::threads::run(2, move |pg| {
        let tp = phalanx::tp::Tp::new(pg, false);
        llama::tp::load_engine(&cfg, &tp, EngineConfig::default(), &Device::Cpu, &dir)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    });
    for e in errs {
        assert!(
            e.contains("more than one") && e.contains(&other),
            "tp 2: {e}"
        );
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn mismatches_are_errors_naming_the_key() {
    let good = hf::config_from_json(&hf_config("llama_gqa")).unwrap();
    let mut e = llama::engine(&good, &Device::Cpu, EngineConfig::default()).unwrap();
    // A config asking for another kv-head count than config.json says.
    let mut other = good;
    other.n_kv_head = 4;
    let err = hf::load(&mut e, &other, dir("llama_gqa"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("num_key_value_heads = 2 but model.n_kv_head = 4"),
        "{err}"
    );
    // Tied model on untied weights: lm_head.weight is foreign.
    let mut tied = good;
    tied.tie_word_embeddings = true;
    let err = hf::load(&mut e, &tied, dir("llama_gqa"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tie_word_embeddings = false but model.tie_word_embeddings = true"),
        "{err}"
    );
    // Features not built are refused, not ignored.
    let mut v = hf_config("llama_gqa");
    v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 8.0});
    let err = hf::config_from_json(&v).unwrap_err().to_string();
    assert!(err.contains("rope_type \"yarn\" is not built"), "{err}");
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    let err = hf::config_from_json(&v).unwrap_err().to_string();
    assert!(err.contains("llama3 without `low_freq_factor`"), "{err}");
    // A scaled checkpoint into an unscaled model config.
    let mut unscaled = hf::config_from_json(&hf_config("llama3_scaled")).unwrap();
    unscaled.rope_scaling = RopeScaling::None;
    let mut e3 = llama::engine(&unscaled, &Device::Cpu, EngineConfig::default()).unwrap();
    let err = hf::load(&mut e3, &unscaled, dir("llama3_scaled"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config.json has") && err.contains("model.rope_scaling"),
        "{err}"
    );
    // An omitted rms_norm_eps is transformers' LlamaConfig default, 1e-6.
    let mut v = hf_config("llama_gqa");
    v.as_object_mut().unwrap().remove("rms_norm_eps");
    assert_eq!(hf::config_from_json(&v).unwrap().rms_norm_eps, 1e-6);
    // An omitted rope_theta (Llama 2's files) is its default, 10000, and a
    // model config asking for another is refused, not loaded silently;
    // a null one does not hide transformers 5's rope_parameters.
    let mut v = hf_config("llama_gqa");
    for k in ["rope_theta", "rope_parameters"] {
        v.as_object_mut().unwrap().remove(k);
    }
    assert_eq!(hf::config_from_json(&v).unwrap().rope_theta, 10000.0);
    let mut other = hf::config_from_json(&v).unwrap();
    other.rope_theta = 500000.0;
    let err = hf::check_config(&v, &other).unwrap_err().to_string();
    assert!(
        err.contains("rope_theta = 10000 but model.rope_theta = 500000"),
        "{err}"
    );
    v["rope_theta"] = serde_json::Value::Null;
    v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    assert_eq!(hf::config_from_json(&v).unwrap().rope_theta, 500000.0);
    let mut v = hf_config("llama_gqa");
    v["attention_bias"] = serde_json::json!(true);
    let err = hf::config_from_json(&v).unwrap_err().to_string();
    assert!(err.contains("attention_bias = true is not built"), "{err}");
    // A weight file without config.json: shapes are still checked by name.
    let tmp = std::env::temp_dir().join(format!("phalanx-llama-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(
        dir("llama_gqa").join("model.safetensors"),
        tmp.join("model.safetensors"),
    )
    .unwrap();
    let mut wide = good;
    wide.intermediate_size = 64;
    let mut e = llama::engine(&wide, &Device::Cpu, EngineConfig::default()).unwrap();
    let err = hf::load(&mut e, &wide, tmp.join("model.safetensors"))
        .unwrap_err()
        .to_string();
    // (down_proj comes first in the layout: (C, M) = (32, 64) wanted.)
    assert!(
        err.contains("mlp.down_proj.weight`: expected shape [32, 64], found [32, 56]"),
        "{err}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A model imported with a longer context than it trains at exports its
/// own context (`max_position_embeddings`), not the training block size.
#[test]
fn a_shorter_training_context_exports_the_imported_one() {
    use phalanx_models::family;
    let case = "llama_gqa";
    let (_, e, _) = load(case);
    let t = hf::export_tensors(&e).unwrap();
    let imported = hf_config(case)["max_position_embeddings"].as_u64().unwrap();
    let tmp = std::env::temp_dir().join(format!("phalanx-ctx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    // Shorter: the imported context; longer: the one trained at.
    for (block, want) in [(imported / 2, imported), (imported * 2, imported * 2)] {
        let sets = [format!("model.block_size={block}")];
        let (cfg, _) = family::build_for_hf(None, &sets, &dir(case)).unwrap();
        let f = family::of(&cfg).unwrap();
        assert_eq!(f.summary(&cfg).unwrap().block_size as u64, block);
        f.save_hf(&t, &cfg, &tmp).unwrap();
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tmp.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(saved["max_position_embeddings"], want, "block_size {block}");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}
