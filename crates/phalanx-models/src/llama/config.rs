//! Llama hyper-parameters, presets, and the Llama `model` section of a
//! training config (`model.arch = "llama"`).
//!
//! - `llama-tiny`: 4 layers, 4 query heads over 2 key/value heads, 128 wide,
//!   MLP 352, byte vocabulary (256), context 128: 803,968 parameters.
//! - `llama-60m`: 8 layers, 12 heads over 4 key/value heads, 768 wide, MLP
//!   2560, byte vocabulary, context 256: 60,175,104 parameters.
//! - `tinyllama-1.1b`: TinyLlama-1.1B's shapes (22 layers, 32 heads over 4
//!   key/value heads, 2048 wide, MLP 5632, vocabulary 32000, context 2048):
//!   1,100,048,384 parameters, the count HF reports for that checkpoint.
//!
//! ```
//! use phalanx_models::llama::LlamaConfig;
//! let c = LlamaConfig::preset("tinyllama-1.1b").unwrap();
//! assert_eq!(c.num_params(), 1_100_048_384);
//! assert_eq!(c.head_dim(), 64);
//! ```

use candle_core::{bail, Result};
use phalanx::config::{ConfigError, ModelFacts};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention); `n_head` for multi-head.
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// The SwiGLU MLP's hidden width.
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Context length (rotary positions need no table, so this only bounds T).
    pub block_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// `lm_head` shares `embed_tokens`' matrix.
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// The presets' names.
    pub const PRESETS: [&'static str; 3] = ["llama-tiny", "llama-60m", "tinyllama-1.1b"];

    /// The default preset of `model.arch = "llama"`.
    pub const DEFAULT_PRESET: &'static str = "llama-tiny";

    /// A config with Llama's defaults for theta (10000), eps (1e-5) and an
    /// untied head.
    pub fn new(
        n_layer: usize,
        n_head: usize,
        n_kv_head: usize,
        n_embd: usize,
        intermediate_size: usize,
        vocab_size: usize,
        block_size: usize,
    ) -> Self {
        Self {
            n_layer,
            n_head,
            n_kv_head,
            n_embd,
            intermediate_size,
            vocab_size,
            block_size,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
        }
    }

    pub fn llama_tiny() -> Self {
        Self::new(4, 4, 2, 128, 352, 256, 128)
    }

    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "llama-tiny" => Ok(Self::llama_tiny()),
            "llama-60m" => Ok(Self::new(8, 12, 4, 768, 2560, 256, 256)),
            "tinyllama-1.1b" => Ok(Self::new(22, 32, 4, 2048, 5632, 32000, 2048)),
            _ => bail!("unknown Llama preset `{name}` (known: {:?})", Self::PRESETS),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Query heads per key/value head.
    pub fn n_rep(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    /// Width of the k (and v) projection: n_kv_head * head_dim.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim()
    }

    pub fn validate(&self) -> Result<()> {
        if let Err(e) = self.check() {
            bail!("{}", e.0)
        }
        Ok(())
    }

    /// Sizes positive, heads dividing the width, key/value heads dividing
    /// the query heads, an even head size (rotary pairs); errors name the
    /// keys.
    pub fn check(&self) -> std::result::Result<(), ConfigError> {
        let err = |m: String| Err(ConfigError(m));
        if [
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.n_embd,
            self.intermediate_size,
            self.vocab_size,
            self.block_size,
        ]
        .contains(&0)
        {
            return err(format!("model sizes must be positive: {self:?}"));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return err(format!(
                "model.n_embd ({}) must be divisible by model.n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return err(format!(
                "model.n_head ({}) must be a multiple of model.n_kv_head ({}) (grouped-query attention)",
                self.n_head, self.n_kv_head
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return err(format!(
                "the head size model.n_embd / model.n_head = {} must be even (rotary embeddings rotate pairs)",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return err(format!(
                "model.rope_theta must be positive, not {}",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return err(format!(
                "model.rms_norm_eps must be positive, not {}",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// Parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        let (c, kv, m) = (self.n_embd, self.kv_dim(), self.intermediate_size);
        let per_layer = 2 * c            // input_layernorm, post_attention_layernorm
            + 2 * c * c                  // q_proj, o_proj
            + 2 * kv * c                 // k_proj, v_proj
            + 3 * c * m; // gate_proj, up_proj, down_proj
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * c
        };
        self.vocab_size * c + self.n_layer * per_layer + c + head
    }
}

/// Llama's `model` section: `preset` fills every field; fields given
/// explicitly (in the file or with `--set`) override it. `arch` is always
/// `"llama"` here (see [`crate::arch`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaSection {
    pub arch: String,
    pub preset: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Context length T.
    pub block_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
}

impl LlamaSection {
    /// The section of a preset.
    pub fn preset(name: &str) -> std::result::Result<LlamaSection, ConfigError> {
        let c = LlamaConfig::preset(name).map_err(|_| {
            ConfigError(format!(
                "unknown model.preset {name:?} for model.arch = \"llama\"; choose one of {:?}",
                LlamaConfig::PRESETS
            ))
        })?;
        Ok(LlamaSection {
            arch: "llama".into(),
            preset: name.to_string(),
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_kv_head: c.n_kv_head,
            n_embd: c.n_embd,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            block_size: c.block_size,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_norm_eps,
            tie_word_embeddings: c.tie_word_embeddings,
        })
    }

    /// The section of a config built with [`crate::arch::build`].
    pub fn of(cfg: &phalanx::config::TrainConfig) -> std::result::Result<Self, ConfigError> {
        Self::from_table(&cfg.model)
    }

    pub(crate) fn from_table(t: &toml::Table) -> std::result::Result<Self, ConfigError> {
        // The architecture first: a GPT-2 section lacks Llama's keys.
        let arch = t.get("arch").and_then(|a| a.as_str()).unwrap_or("gpt2");
        if arch != "llama" {
            return Err(ConfigError(format!(
                "model.arch = {arch:?}: not a Llama config"
            )));
        }
        toml::Value::Table(t.clone())
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError(format!("model: {}", e.message())))
    }

    /// The model's hyper-parameters.
    pub fn model(&self) -> LlamaConfig {
        LlamaConfig {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            n_embd: self.n_embd,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            rope_theta: self.rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
        }
    }

    /// What the library needs to know, after the checks.
    pub(crate) fn facts(t: &toml::Table) -> std::result::Result<ModelFacts, ConfigError> {
        let s = Self::from_table(t)?;
        s.model().check()?;
        Ok(ModelFacts {
            seq_len: Some(s.block_size),
            n_layer: Some(s.n_layer),
        })
    }
}
