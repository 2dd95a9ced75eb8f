//! Qwen2 as a family on Llama's layers (`model.arch = "qwen2"`).

use super::{config, hf};
use crate::family::{FamilyNames, HfKey};
use crate::llama::family::{LlamaDialect, OnLlama};
use crate::llama::LlamaConfig;
use phalanx::config::TrainConfig;
use serde_json::Value;

/// Qwen2: `Qwen2ForCausalLM`.
pub struct Qwen2;

/// The Qwen2 family, as the registry holds it.
pub static QWEN2: OnLlama = OnLlama(&Qwen2);

/// The model of a Qwen2 config (`qkv_bias` set).
pub fn model_config(cfg: &TrainConfig) -> phalanx::Result<LlamaConfig> {
    QWEN2.model(cfg)
}

static NAMES: FamilyNames = FamilyNames {
    arch: "qwen2",
    title: "Qwen2",
    hf_model_types: &["qwen2"],
    hf_architectures: &["Qwen2ForCausalLM"],
    presets: &config::PRESETS,
    default_preset: config::DEFAULT_PRESET,
};

impl LlamaDialect for Qwen2 {
    fn names(&self) -> &'static FamilyNames {
        &NAMES
    }

    fn preset(&self, name: &str) -> Option<LlamaConfig> {
        config::preset(name)
    }

    /// Every Qwen2 layer has q / k / v biases.
    fn fixed(&self, m: LlamaConfig) -> LlamaConfig {
        LlamaConfig {
            qkv_bias: true,
            ..m
        }
    }

    fn hf_keys(&self, v: &Value) -> candle_core::Result<Vec<HfKey>> {
        hf::hf_keys(v)
    }

    fn check_config(&self, v: &Value, m: &LlamaConfig) -> candle_core::Result<()> {
        hf::check_config(v, m)
    }

    fn config_json(&self, m: &LlamaConfig, tokenizer: &str) -> Value {
        hf::config_json(m, tokenizer)
    }
}
