//! Shared by the tests against Hugging Face transformers fixtures
//! (`tests/fixtures/*`, made by the `make_*_fixture.py` scripts): the
//! fixture's files, its float64 values, and the max-relative distance the
//! tests compare with.

#![allow(dead_code)]

use candle_core::{DType, Tensor};
use phalanx::engine::Engine;
use phalanx::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use std::collections::HashMap;
use std::path::PathBuf;

/// The directory of fixture `case`.
pub fn dir(case: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).join(case)
}

/// The fixture's `config.json`.
pub fn hf_config(case: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dir(case).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture's recorded values (`expected.safetensors`: batches, logits,
/// losses, final parameters).
pub fn expected(case: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        dir(case).join("expected.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap()
}

pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// max |a - b| / max |b|.
pub fn rel_max(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Step `k`'s (inputs, targets) as the fixture recorded them.
pub fn batch(expected: &HashMap<String, Tensor>, k: usize) -> (Tensor, Tensor) {
    let get = |n: &str| expected[n].get(k).unwrap().to_dtype(DType::U32).unwrap();
    (get("inputs"), get("targets"))
}

/// Train `e` on the fixture's batches as the fixture script did (AdamW
/// betas (0.9, 0.95), eps 1e-8, decay 0.1, lr 3e-3; or plain SGD at lr
/// 0.5), asserting every step's loss within 1e-5 of transformers'.
pub fn train_as_recorded(
    case: &str,
    e: &mut Engine,
    expected: &HashMap<String, Tensor>,
    adamw: bool,
) {
    let losses = f64s(&expected["losses"]);
    let n = e.num_params();
    let mut opt: Box<dyn Optimizer> = if adamw {
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        Box::new(AdamW::new(c, e.layout(), 0..n, e.ledger()))
    } else {
        Box::new(Sgd::new(SgdConfig::default(), e.layout(), 0..n, e.ledger()))
    };
    let lr = if adamw { 3e-3 } else { 0.5 };
    for (k, want) in losses.iter().enumerate() {
        let (x, y) = batch(expected, k);
        e.zero_grad();
        let loss = e.forward_backward(&x, &y, 1.0).unwrap() as f64;
        println!("{case} step {k}: loss {loss:.7} (transformers {want:.7})");
        assert!(
            ((loss - want) / want).abs() < 1e-5,
            "{case} step {k}: loss {loss} vs {want}"
        );
        let (p, g) = e.params_and_grads_mut();
        opt.step(p, g, lr, 1.0);
    }
}

/// Every parameter's max-relative distance to the fixture's final one.
pub fn final_errors(e: &Engine, expected: &HashMap<String, Tensor>) -> Vec<(String, f64)> {
    e.layout()
        .params()
        .iter()
        .map(|p| {
            let want = f64s(&expected[&format!("final.{}", p.name)]);
            let ours: Vec<f64> = e
                .param(&p.name)
                .unwrap()
                .iter()
                .map(|&v| v as f64)
                .collect();
            (p.name.clone(), rel_max(&ours, &want))
        })
        .collect()
}

/// A directory saved from fixture `case`'s engine holds the fixture's
/// `model.safetensors` again (same names, shapes and values) and a
/// `config.json` whose `keys` equal the fixture's; returns that config.
pub fn assert_saved_as_fixture(
    case: &str,
    saved_dir: &std::path::Path,
    keys: &[&str],
) -> serde_json::Value {
    let load = |p: PathBuf| candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
    let orig = load(dir(case).join("model.safetensors"));
    let saved = load(saved_dir.join("model.safetensors"));
    let mut a: Vec<_> = orig.keys().collect();
    let mut b: Vec<_> = saved.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "{case}: tensor names");
    for (name, t) in &orig {
        assert_eq!(t.dims(), saved[name].dims(), "{name}");
        assert_eq!(f64s(t), f64s(&saved[name]), "{case} {name}: values");
    }
    // config.json: every model key transformers wrote comes back equal.
    let text = std::fs::read_to_string(saved_dir.join("config.json")).unwrap();
    let ours: serde_json::Value = serde_json::from_str(&text).unwrap();
    let theirs = hf_config(case);
    for k in keys {
        assert_eq!(ours[*k], theirs[*k], "{case}: config.json {k}");
    }
    ours
}
