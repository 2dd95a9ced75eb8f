//! Shared by the tests against Hugging Face transformers fixtures
//! (`tests/fixtures/*`, made by the `make_*_fixture.py` scripts): the
//! fixture's files, its float64 values, and the max-relative distance the
//! tests compare with.

#![allow(dead_code)]

use candle_core::{DType, Tensor};
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
