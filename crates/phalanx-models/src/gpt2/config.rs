//! GPT-2 hyper-parameters, presets, and the `model` section of a training
//! config.
//!
//! - `gpt-tiny`: 4 layers, 4 heads, 128 wide, byte vocabulary (256), context
//!   128: ~0.84M parameters, trains visibly in a couple of minutes on 2 cores.
//! - `gpt-10m`: 6/6/384, byte vocabulary, context 256 (about 10M parameters).
//! - `gpt-50m`: 8/12/768, byte vocabulary, context 256 (about 57M).
//! - `gpt2-124m`: the original GPT-2 small (12/12/768, 50257, 1024).
//!
//! ```
//! use phalanx_models::gpt2::Gpt2Config;
//! let c = Gpt2Config::preset("gpt2-124m").unwrap();
//! assert_eq!(c.num_params(), 124_439_808); // HF's count, wte tied with lm_head
//! ```
//!
//! A training config with GPT-2's `model` section ([`build`]): the preset
//! fills every key, keys given in the file or with `--set` override it.
//!
//! ```
//! use phalanx_models::gpt2::config::{self, Gpt2Section};
//! let cfg = config::build(None, &["model.preset=gpt-10m".into(), "model.n_layer=2".into()]).unwrap();
//! let m = Gpt2Section::of(&cfg).unwrap();
//! assert_eq!((m.preset.as_str(), m.n_layer, m.n_embd), ("gpt-10m", 2, 384));
//! assert_eq!(cfg.seq_len(), Some(256));
//! let e = config::build(None, &["model.n_layers=2".into()]).unwrap_err().to_string();
//! assert!(e.contains("unknown key `model.n_layers`"), "{e}");
//! ```

use candle_core::{bail, Result};
use phalanx::config::{ConfigError, ModelFacts, ModelSchema, TrainConfig};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt2Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    /// Context length (number of learned positions).
    pub block_size: usize,
}

impl Gpt2Config {
    /// The presets' names (`gpt2` is also accepted for `gpt2-124m`).
    pub const PRESETS: [&'static str; 4] = ["gpt-tiny", "gpt-10m", "gpt-50m", "gpt2-124m"];

    pub fn gpt_tiny() -> Self {
        Self::new(4, 4, 128, 256, 128)
    }

    pub fn gpt2_124m() -> Self {
        Self::new(12, 12, 768, 50257, 1024)
    }

    pub fn new(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        vocab_size: usize,
        block_size: usize,
    ) -> Self {
        Self {
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            block_size,
        }
    }

    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "gpt-tiny" => Ok(Self::gpt_tiny()),
            // About 10M parameters with a byte vocabulary.
            "gpt-10m" => Ok(Self::new(6, 6, 384, 256, 256)),
            // About 57M parameters with a byte vocabulary (for "at least 50M" runs).
            "gpt-50m" => Ok(Self::new(8, 12, 768, 256, 256)),
            "gpt2-124m" | "gpt2" => Ok(Self::gpt2_124m()),
            _ => bail!("unknown GPT-2 preset `{name}` (known: {:?})", Self::PRESETS),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    pub fn validate(&self) -> Result<()> {
        if self.n_layer == 0 || self.n_head == 0 || self.vocab_size == 0 || self.block_size == 0 {
            bail!("GPT-2 config has a zero size: {self:?}")
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            bail!(
                "n_embd {} is not divisible by n_head {}",
                self.n_embd,
                self.n_head
            )
        }
        Ok(())
    }

    /// Parameters, counting the tied wte/lm_head once.
    pub fn num_params(&self) -> usize {
        // In f64, saturated: absurd sizes give a huge count, not a wrapped one.
        let f = |x: usize| x as f64;
        let (c, l) = (f(self.n_embd), f(self.n_layer));
        let per_layer = 2.0 * 2.0 * c    // ln_1, ln_2
            + 3.0 * c * c + 3.0 * c      // attn.c_attn
            + c * c + c                  // attn.c_proj
            + 4.0 * c * c + 4.0 * c      // mlp.c_fc
            + 4.0 * c * c + c; // mlp.c_proj
        (f(self.vocab_size) * c + f(self.block_size) * c + l * per_layer + 2.0 * c) as usize
    }

    /// The planner's description of this model with samples of `seq_len`
    /// tokens (`phalanx plan`, and the FLOPs per token behind MFU): its
    /// parameters as its blocks declare them, whole and on every tp size
    /// they accept ([`crate::common::plan`]).
    pub fn plan_shape(&self, seq_len: usize) -> Result<phalanx::plan::ModelShape> {
        let params =
            crate::common::plan::declare(self.n_head, |tp| super::blocks_tp(self, tp.cloned()))?;
        Ok(phalanx::plan::ModelShape::gpt2(
            self.n_layer,
            self.n_head,
            self.n_embd,
            self.vocab_size,
            seq_len,
        )
        .with_params(params))
    }
}

/// The default `model.preset`.
pub const DEFAULT_PRESET: &str = "gpt-tiny";

/// GPT-2's `model` section of a training config: `preset` fills every
/// field; fields given explicitly (in the file or with `--set`) override it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpt2Section {
    pub preset: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    /// Context length T.
    pub block_size: usize,
}

impl Gpt2Section {
    /// The section of a preset.
    pub fn preset(name: &str) -> std::result::Result<Gpt2Section, ConfigError> {
        let c = Gpt2Config::preset(name).map_err(|_| {
            ConfigError(format!(
                "unknown model.preset {name:?}; choose one of {:?}",
                Gpt2Config::PRESETS
            ))
        })?;
        Ok(Gpt2Section {
            preset: name.to_string(),
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_embd: c.n_embd,
            vocab_size: c.vocab_size,
            block_size: c.block_size,
        })
    }

    /// The section of a config built with [`build`] (or [`Gpt2Schema`]).
    pub fn of(cfg: &TrainConfig) -> std::result::Result<Gpt2Section, ConfigError> {
        Self::from_table(&cfg.model)
    }

    fn from_table(t: &toml::Table) -> std::result::Result<Gpt2Section, ConfigError> {
        // A section built by `crate::arch` names its architecture.
        let mut t = t.clone();
        match t.remove("arch") {
            None => {}
            Some(toml::Value::String(a)) if a == "gpt2" => {}
            Some(a) => return Err(ConfigError(format!("model.arch = {a}: not a GPT-2 config"))),
        }
        toml::Value::Table(t)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError(format!("model: {}", e.message())))
    }

    /// The model's hyper-parameters.
    pub fn model(&self) -> Gpt2Config {
        Gpt2Config::new(
            self.n_layer,
            self.n_head,
            self.n_embd,
            self.vocab_size,
            self.block_size,
        )
    }

    /// Sizes positive, heads dividing the width; errors name the keys.
    pub fn check(&self) -> std::result::Result<(), ConfigError> {
        if self.n_layer == 0
            || self.n_head == 0
            || self.n_embd == 0
            || self.vocab_size == 0
            || self.block_size == 0
        {
            return Err(ConfigError(format!(
                "model sizes must be positive: {self:?}"
            )));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(ConfigError(format!(
                "model.n_embd ({}) must be divisible by model.n_head ({})",
                self.n_embd, self.n_head
            )));
        }
        Ok(())
    }
}

/// GPT-2's `model` section for [`TrainConfig::build_for`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Gpt2Schema;

impl ModelSchema for Gpt2Schema {
    fn section(&self, preset: Option<&str>) -> std::result::Result<toml::Table, ConfigError> {
        let s = Gpt2Section::preset(preset.unwrap_or(DEFAULT_PRESET))?;
        toml::Table::try_from(&s).map_err(|e| ConfigError(e.to_string()))
    }

    fn check(&self, t: &toml::Table) -> std::result::Result<ModelFacts, ConfigError> {
        let s = Gpt2Section::from_table(t)?;
        s.check()?;
        Ok(ModelFacts {
            seq_len: Some(s.block_size),
            n_layer: Some(s.n_layer),
        })
    }
}

/// A training config with GPT-2's `model` section: defaults <- preset <-
/// file <- `--set` overrides (see [`TrainConfig::build_for`]).
pub fn build(
    file: Option<&Path>,
    overrides: &[String],
) -> std::result::Result<TrainConfig, ConfigError> {
    TrainConfig::build_for(&Gpt2Schema, file, overrides)
}

/// [`build`], returning the warnings instead of printing them.
pub fn build_with_warnings(
    file: Option<&Path>,
    overrides: &[String],
) -> std::result::Result<(TrainConfig, Vec<String>), ConfigError> {
    TrainConfig::build_with_warnings_for(&Gpt2Schema, file, overrides)
}
