//! Llama as a [`ModelFamily`] (`model.arch = "llama"`), and the way any
//! family built on Llama's layers becomes one: it says what it names and
//! reads differently ([`LlamaDialect`]: names, presets, `config.json`) and
//! [`OnLlama`] does the rest with Llama's blocks, placements, HF files and
//! KV-cache generation.

use super::config::{LlamaConfig, LlamaSection};
use super::{generate, hf, hf_config, tp};
use crate::common::generate::Decoder;
use crate::family::{FamilyNames, HfKey, ModelFamily, ModelSummary};
use candle_core::Tensor;
use phalanx::config::{ConfigError, ModelFacts, TrainConfig};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::plan::ModelShape;
use phalanx::tp::Tp;
use phalanx::Result;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a family built on Llama's layers says for itself.
pub trait LlamaDialect: Send + Sync {
    /// Its names (`model.arch`, HF's `model_type` / `architectures`, presets).
    fn names(&self) -> &'static FamilyNames;
    /// The model of preset `name` (None: not one of this family's).
    fn preset(&self, name: &str) -> Option<LlamaConfig>;
    /// The family's features the `model` section does not set (Qwen2's
    /// q / k / v biases), on the section's model.
    fn fixed(&self, m: LlamaConfig) -> LlamaConfig {
        m
    }
    /// The `model.*` values a `config.json` gives (`arch` first).
    fn hf_keys(&self, config: &Value) -> candle_core::Result<Vec<HfKey>>;
    /// Check a `config.json` against the model; errors name both keys.
    fn check_config(&self, config: &Value, m: &LlamaConfig) -> candle_core::Result<()>;
    /// The `config.json` written beside saved weights.
    fn config_json(&self, m: &LlamaConfig, tokenizer: &str) -> Value;
}

/// The [`ModelFamily`] of a family on Llama's layers.
pub struct OnLlama(pub &'static dyn LlamaDialect);

/// Llama: `LlamaForCausalLM`.
pub struct Llama;

/// The Llama family, as the registry holds it.
pub static LLAMA: OnLlama = OnLlama(&Llama);

/// The model of a Llama config.
pub fn model_config(cfg: &TrainConfig) -> Result<LlamaConfig> {
    LLAMA.model(cfg)
}

/// The summary of a Llama-layer model (Llama, and families built on its
/// layers).
pub fn summary(title: &'static str, m: &LlamaConfig) -> ModelSummary {
    ModelSummary {
        title,
        n_layer: m.n_layer,
        n_head: m.n_head,
        n_kv_head: Some(m.n_kv_head),
        n_embd: m.n_embd,
        mlp: Some(m.intermediate_size),
        vocab_size: m.vocab_size,
        block_size: m.block_size,
        num_params: m.num_params(),
    }
}

/// Where HF-layout saving writes the weights for `path`: the file, or
/// `model.safetensors` in the directory.
pub fn weights_file(path: &Path) -> PathBuf {
    if path.to_string_lossy().ends_with(".safetensors") {
        path.to_path_buf()
    } else {
        path.join(crate::common::hf::SINGLE)
    }
}

/// Save in HF layout (see [`hf::save`]) with `config_json`; returns the
/// directory written.
pub fn save_with(
    tensors: &HashMap<String, Tensor>,
    config_json: &Value,
    path: &Path,
) -> Result<PathBuf> {
    let files = crate::common::hf::save(tensors, config_json, path, hf::DEFAULT_SHARD_BYTES)?;
    Ok(match files.first() {
        Some(f) => crate::common::hf::model_dir(f),
        None => path.to_path_buf(),
    })
}

static NAMES: FamilyNames = FamilyNames {
    arch: "llama",
    title: "Llama",
    hf_model_types: &["llama"],
    hf_architectures: &["LlamaForCausalLM"],
    presets: &LlamaConfig::PRESETS,
    default_preset: LlamaConfig::DEFAULT_PRESET,
};

impl LlamaDialect for Llama {
    fn names(&self) -> &'static FamilyNames {
        &NAMES
    }

    fn preset(&self, name: &str) -> Option<LlamaConfig> {
        LlamaConfig::preset(name).ok()
    }

    fn hf_keys(&self, config: &Value) -> candle_core::Result<Vec<HfKey>> {
        hf_config::hf_keys(config)
    }

    fn check_config(&self, config: &Value, m: &LlamaConfig) -> candle_core::Result<()> {
        hf::check_config(config, m)
    }

    fn config_json(&self, m: &LlamaConfig, tokenizer: &str) -> Value {
        hf::config_json(m, tokenizer)
    }
}

impl OnLlama {
    /// The model of a config of this family.
    pub fn model(&self, cfg: &TrainConfig) -> Result<LlamaConfig> {
        let s = LlamaSection::from_table_as(&cfg.model, self.name())?;
        Ok(self.0.fixed(s.model()))
    }
}

impl ModelFamily for OnLlama {
    fn names(&self) -> &'static FamilyNames {
        self.0.names()
    }

    fn section(&self, preset: &str) -> std::result::Result<toml::Table, ConfigError> {
        let m = self.0.preset(preset).ok_or_else(|| {
            ConfigError(format!(
                "unknown model.preset {preset:?} for model.arch = {:?}; choose one of {:?}",
                self.name(),
                self.names().presets
            ))
        })?;
        let s = LlamaSection::of_model(self.name(), preset, &m);
        toml::Table::try_from(&s).map_err(|e| ConfigError(e.to_string()))
    }

    fn check(&self, t: &toml::Table) -> std::result::Result<ModelFacts, ConfigError> {
        LlamaSection::facts_as(t, self.name())
    }

    fn summary(&self, cfg: &TrainConfig) -> Result<ModelSummary> {
        Ok(summary(self.title(), &self.model(cfg)?))
    }

    fn blocks(&self, cfg: &TrainConfig) -> Result<Vec<Box<dyn Block>>> {
        Ok(super::blocks(&self.model(cfg)?)?)
    }

    fn tp_blocks(&self, cfg: &TrainConfig, t: &Tp) -> Result<Vec<Box<dyn Block>>> {
        Ok(tp::blocks_tp(&self.model(cfg)?, t)?)
    }

    fn tp_load(
        &self,
        cfg: &TrainConfig,
        t: &Tp,
        ecfg: EngineConfig,
        path: &Path,
    ) -> Result<Engine> {
        let check = |v: &Value, m: &LlamaConfig| self.0.check_config(v, m);
        Ok(tp::load_engine_with(
            &self.model(cfg)?,
            t,
            ecfg,
            &cfg.device()?,
            path,
            &check,
        )?)
    }

    fn hf_keys(&self, config: &Value) -> Result<Vec<HfKey>> {
        Ok(self.0.hf_keys(config)?)
    }

    /// The `config.json` beside the weights, checked against the config.
    fn check_hf(&self, cfg: &TrainConfig, path: &Path) -> Result<()> {
        let (_files, dir) = hf::resolve(path)?;
        if let Some(v) = hf::read_config(&dir)? {
            self.0.check_config(&v, &self.model(cfg)?)?;
        }
        Ok(())
    }

    fn load_hf(&self, engine: &mut Engine, cfg: &TrainConfig, path: &Path) -> Result<()> {
        let check = |v: &Value, m: &LlamaConfig| self.0.check_config(v, m);
        Ok(hf::load_with(engine, &self.model(cfg)?, path, &check)?)
    }

    /// A directory (`model.safetensors`, or shards of 5 GB and an index),
    /// or a `.safetensors` file, with `config.json`.
    fn save_hf(
        &self,
        tensors: &HashMap<String, Tensor>,
        cfg: &TrainConfig,
        path: &Path,
    ) -> Result<PathBuf> {
        let mut json = self
            .0
            .config_json(&self.model(cfg)?, &cfg.data.tokenizer.to_string());
        let s = LlamaSection::from_table_as(&cfg.model, self.name())?;
        json["max_position_embeddings"] = s.exported_context().into();
        crate::hf_tokenizer::set_special_ids(&mut json, &cfg.data.tokenizer)?;
        save_with(tensors, &json, path)
    }

    fn hf_weights_file(&self, path: &Path) -> PathBuf {
        weights_file(path)
    }

    /// Generation with a KV cache.
    fn decoder<'a>(&self, engine: &'a Engine, cfg: &TrainConfig) -> Result<Box<dyn Decoder + 'a>> {
        Ok(Box::new(generate::CachedDecoder::new(
            engine,
            &self.model(cfg)?,
        )?))
    }

    fn plan_shape(&self, cfg: &TrainConfig, seq_len: usize) -> Result<ModelShape> {
        Ok(self.model(cfg)?.plan_shape(seq_len)?)
    }
}
