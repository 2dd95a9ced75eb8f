//! Hugging Face safetensors import / export of GPT-2.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use phalanx::engine::{Engine, EngineConfig};
use phalanx_models::gpt2::{self, hf, Gpt2Config};

fn cfg() -> Gpt2Config {
    Gpt2Config::new(2, 2, 8, 20, 6)
}

fn engine(seed: u64) -> Engine {
    let ecfg = EngineConfig {
        seed,
        ..Default::default()
    };
    gpt2::engine(&cfg(), &Device::Cpu, ecfg).unwrap()
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "phalanx-hf-{}-{name}.safetensors",
        std::process::id()
    ))
}

fn import_err(tensors: HashMap<String, Tensor>) -> String {
    hf::import_tensors(&mut engine(1), tensors)
        .unwrap_err()
        .to_string()
}

#[test]
fn round_trip_through_a_file() {
    let a = engine(1);
    let mut b = engine(2);
    assert_ne!(a.params_flat(), b.params_flat());
    let path = tmp("roundtrip");
    hf::save_safetensors(&a, &path).unwrap();
    hf::load_safetensors(&mut b, &path).unwrap();
    // transformers' header metadata (older versions fail without it).
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let format = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format").cloned());
    assert_eq!(format.as_deref(), Some("pt"));
    std::fs::remove_file(&path).unwrap();
    assert_eq!(a.params_flat(), b.params_flat());
    // Same weights, same function.
    let x = Tensor::new(&[[1u32, 5, 7, 19]], &Device::Cpu).unwrap();
    let (la, lb) = (a.forward(&x).unwrap(), b.forward(&x).unwrap());
    let diff = (la - lb)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
}

#[test]
fn export_has_hf_names_and_no_lm_head() {
    let t = hf::export_tensors(&engine(1)).unwrap();
    let c = cfg();
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    assert_eq!(names.len(), 2 + 12 * c.n_layer + 2);
    assert!(!t.contains_key("lm_head.weight"));
    assert_eq!(
        t["transformer.wte.weight"].dims(),
        &[c.vocab_size, c.n_embd]
    );
    assert_eq!(
        t["transformer.wpe.weight"].dims(),
        &[c.block_size, c.n_embd]
    );
    // Conv1D weights are (in, out).
    assert_eq!(
        t["transformer.h.0.attn.c_attn.weight"].dims(),
        &[c.n_embd, 3 * c.n_embd]
    );
    assert_eq!(
        t["transformer.h.0.attn.c_proj.weight"].dims(),
        &[c.n_embd, c.n_embd]
    );
    assert_eq!(
        t["transformer.h.1.mlp.c_fc.weight"].dims(),
        &[c.n_embd, 4 * c.n_embd]
    );
    assert_eq!(
        t["transformer.h.1.mlp.c_proj.weight"].dims(),
        &[4 * c.n_embd, c.n_embd]
    );
    assert_eq!(t["transformer.h.1.mlp.c_proj.bias"].dims(), &[c.n_embd]);
}

#[test]
fn conv1d_weights_are_transposed() {
    let c = cfg().n_embd;
    let name = "transformer.h.1.mlp.c_fc.weight";
    // Engine layout (out = 4C, in = C): value at [o][i] = 100 o + i.
    let mut e = engine(1);
    for (k, v) in e.param_mut(name).unwrap().iter_mut().enumerate() {
        let (o, i) = (k / c, k % c);
        *v = (100 * o + i) as f32;
    }
    let t = hf::export_tensors(&e).unwrap();
    let hf_w = t[name].to_vec2::<f32>().unwrap(); // (in, out)
    assert_eq!((hf_w.len(), hf_w[0].len()), (c, 4 * c));
    assert_eq!(hf_w[3][17], (100 * 17 + 3) as f32);
    // And back: a hand-made HF tensor hf[i][o] = 1000 i + o lands at engine [o][i].
    let mut tensors = hf::export_tensors(&engine(1)).unwrap();
    let hand: Vec<f32> = (0..c * 4 * c)
        .map(|k| (1000 * (k / (4 * c)) + k % (4 * c)) as f32)
        .collect();
    tensors.insert(
        name.to_string(),
        Tensor::from_vec(hand, (c, 4 * c), &Device::Cpu).unwrap(),
    );
    let mut f = engine(2);
    hf::import_tensors(&mut f, tensors).unwrap();
    let w = f.param(name).unwrap();
    let (o, i) = (29, 5);
    assert_eq!(w[o * c + i], (1000 * i + o) as f32);
}

#[test]
fn accepts_hf_file_variants() {
    // No `transformer.` prefix, lm_head present, causal-mask buffers present, f16.
    let a = engine(1);
    let c = cfg();
    let mut t: HashMap<String, Tensor> = hf::export_tensors(&a)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches("transformer.").to_string(), v))
        .collect();
    t.insert("lm_head.weight".into(), t["wte.weight"].clone());
    for i in 0..c.n_layer {
        let mask =
            Tensor::ones((1, 1, c.block_size, c.block_size), DType::F32, &Device::Cpu).unwrap();
        t.insert(format!("h.{i}.attn.bias"), mask);
        t.insert(
            format!("h.{i}.attn.masked_bias"),
            Tensor::new(-1e4f32, &Device::Cpu).unwrap(),
        );
    }
    let path = tmp("variants");
    let t16: HashMap<String, Tensor> = t
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::F16).unwrap()))
        .collect();
    candle_core::safetensors::save(&t16, &path).unwrap();
    let mut b = engine(2);
    hf::load_safetensors(&mut b, &path).unwrap();
    std::fs::remove_file(&path).unwrap();
    for (x, y) in a.params_flat().iter().zip(b.params_flat()) {
        assert!((x - y).abs() <= 1e-3 * x.abs().max(1e-2), "{x} vs {y}");
    }
    // f32 without prefix: exact.
    let mut c2 = engine(3);
    hf::import_tensors(&mut c2, t).unwrap();
    assert_eq!(a.params_flat(), c2.params_flat());
}

#[test]
fn missing_tensor_is_named() {
    let mut t = hf::export_tensors(&engine(1)).unwrap();
    t.remove("transformer.h.1.ln_2.bias");
    let err = import_err(t);
    assert!(
        err.contains("missing tensor `transformer.h.1.ln_2.bias`"),
        "{err}"
    );
    assert!(err.contains("[8]"), "{err}");
}

#[test]
fn misshaped_tensor_is_named_with_shapes() {
    let mut t = hf::export_tensors(&engine(1)).unwrap();
    // A Linear-layout (out, in) weight where HF's Conv1D (in, out) is expected.
    let wrong = Tensor::zeros((24, 8), DType::F32, &Device::Cpu).unwrap();
    t.insert("transformer.h.0.attn.c_attn.weight".into(), wrong);
    let err = import_err(t);
    assert!(err.contains("transformer.h.0.attn.c_attn.weight"), "{err}");
    assert!(
        err.contains("expected shape [8, 24], found [24, 8]"),
        "{err}"
    );
}

#[test]
fn unknown_tensors_and_bad_lm_head_are_errors() {
    let mut t = hf::export_tensors(&engine(1)).unwrap();
    t.insert(
        "transformer.h.7.ln_1.weight".into(),
        Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap(),
    );
    let err = import_err(t);
    assert!(err.contains("transformer.h.7.ln_1.weight"), "{err}");

    let mut t = hf::export_tensors(&engine(1)).unwrap();
    t.insert(
        "lm_head.weight".into(),
        Tensor::zeros((3, 8), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = import_err(t);
    assert!(
        err.contains("lm_head.weight") && err.contains("[20, 8]"),
        "{err}"
    );

    let err = hf::load_safetensors(&mut engine(1), "/nonexistent/model.safetensors")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/model.safetensors"), "{err}");
}

/// One set of rules for every layout: an integer tensor and a tensor the
/// model lacks are refused by the whole-model load and by the tensor-
/// parallel load alike, naming the tensor.
#[test]
fn the_same_file_rules_under_tp_1_and_tp_2() {
    let cases: Vec<(&str, Tensor)> = vec![
        (
            "transformer.ln_f.weight",
            Tensor::zeros(8, DType::I64, &Device::Cpu).unwrap(),
        ),
        (
            "transformer.h.7.ln_1.weight",
            Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap(),
        ),
    ];
    for (i, (name, bad)) in cases.into_iter().enumerate() {
        let mut t = hf::export_tensors(&engine(1)).unwrap();
        t.insert(name.to_string(), bad);
        let path = tmp(&format!("rules{i}"));
        candle_core::safetensors::save(&t, &path).unwrap();
        let whole = hf::load_safetensors(&mut engine(1), &path)
            .unwrap_err()
            .to_string();
        assert!(whole.contains(name), "tp 1: {whole}");
        let p = path.clone();
        let errs = phalanx_comm::threads::run(2, move |pg| {
            let t = phalanx::tp::Tp::new(pg, false);
            gpt2::tp::load_engine(
                &cfg(),
                &t,
                EngineConfig::default(),
                &candle_core::Device::Cpu,
                &p,
            )
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
        });
        for e in errs {
            assert!(e.contains(name), "tp 2: {e}");
        }
        let _ = std::fs::remove_file(&path);
    }
}
