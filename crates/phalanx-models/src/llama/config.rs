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
//! - `llama-3.2-1b`: Llama 3.2 1B's shapes (16 layers, 32 heads over 8 kv
//!   heads, 2048 wide, MLP 8192, vocabulary 128256, context 131072, theta
//!   500000 with Llama 3 rope scaling, tied head): 1,235,814,400 parameters.
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
    /// Size of one attention head; 0: n_embd / n_head (HF's `head_dim`,
    /// which some checkpoints set otherwise, e.g. Minitron's 128 at 3072 wide).
    pub head_size: usize,
    /// The SwiGLU MLP's hidden width.
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Context length (rotary positions need no table, so this only bounds T).
    pub block_size: usize,
    pub rope_theta: f64,
    /// Rotary frequency scaling (Llama 3.1 / 3.2's `rope_scaling`).
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f64,
    /// `lm_head` shares `embed_tokens`' matrix.
    pub tie_word_embeddings: bool,
    /// q, k and v projections have biases (Qwen2's layer; Llama's has none).
    pub qkv_bias: bool,
}

/// HF's `rope_scaling`: none (`rope_type = "default"`) or Llama 3's
/// (`"llama3"`: low frequencies divided by `factor`, high ones kept, the
/// band between interpolated).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    },
}

impl LlamaConfig {
    /// The rotary inverse frequencies (d/2 of them), in f32 as HF computes
    /// them (`_compute_default_rope_parameters`, `_compute_llama3_parameters`).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim();
        let base: Vec<f32> = (0..d / 2)
            .map(|i| super::blocks::inv_freq(i, d, self.rope_theta))
            .collect();
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } = self.rope_scaling
        else {
            return base;
        };
        let (f, lo, hi, old) = (
            factor as f32,
            low_freq_factor as f32,
            high_freq_factor as f32,
            original_max_position as f32,
        );
        let (low_wavelen, high_wavelen) = (old / lo, old / hi);
        base.into_iter()
            .map(|inv| {
                let wavelen = 2.0 * std::f32::consts::PI / inv;
                let scaled = if wavelen > low_wavelen { inv / f } else { inv };
                // HF's `~(wavelen < high) * ~(wavelen > low)` (wavelengths are finite).
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                if medium {
                    let smooth = (old / wavelen - lo) / (hi - lo);
                    (1.0 - smooth) * scaled / f + smooth * scaled
                } else {
                    scaled
                }
            })
            .collect()
    }
}

impl LlamaConfig {
    /// The presets' names.
    pub const PRESETS: [&'static str; 4] =
        ["llama-tiny", "llama-60m", "tinyllama-1.1b", "llama-3.2-1b"];

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
            head_size: 0,
            intermediate_size,
            vocab_size,
            block_size,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: false,
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
            "llama-3.2-1b" => Ok(Self {
                rope_theta: 500000.0,
                rope_scaling: RopeScaling::Llama3 {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position: 8192,
                },
                tie_word_embeddings: true,
                ..Self::new(16, 32, 8, 2048, 8192, 128256, 131072)
            }),
            _ => bail!("unknown Llama preset `{name}` (known: {:?})", Self::PRESETS),
        }
    }

    /// Size of one attention head (`model.head_dim`, else n_embd / n_head).
    pub fn head_dim(&self) -> usize {
        if self.head_size > 0 {
            self.head_size
        } else {
            self.n_embd / self.n_head
        }
    }

    /// Width of the q projection and of o_proj's input: n_head * head_dim.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim()
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
        if self.head_size == 0 && !self.n_embd.is_multiple_of(self.n_head) {
            return err(format!(
                "model.n_embd ({}) must be divisible by model.n_head ({}) (or set model.head_dim)",
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
                "the head size (model.head_dim, or model.n_embd / model.n_head) = {} must be even (rotary embeddings rotate pairs)",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return err(format!(
                "model.rope_theta must be positive, not {}",
                self.rope_theta
            ));
        }
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } = self.rope_scaling
        {
            if !(factor >= 1.0 && low_freq_factor > 0.0 && high_freq_factor > low_freq_factor)
                || original_max_position == 0
            {
                return err(format!(
                    "model.rope_factor ({factor}) must be >= 1, model.rope_high_freq_factor \
                     ({high_freq_factor}) > model.rope_low_freq_factor ({low_freq_factor}) > 0, \
                     model.rope_original_max_position ({original_max_position}) > 0"
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return err(format!(
                "model.rms_norm_eps must be positive, not {}",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// Parameters (a tied head counted once). Counted in f64 and saturated,
    /// so that a config of absurd sizes gives a huge count (refused by the
    /// size checks) rather than a wrapped small one.
    pub fn num_params(&self) -> usize {
        let f = |x: usize| x as f64;
        let hd = if self.head_size > 0 {
            f(self.head_size)
        } else {
            f(self.n_embd.checked_div(self.n_head).unwrap_or(0))
        };
        let (c, q, kv, m) = (
            f(self.n_embd),
            f(self.n_head) * hd,
            f(self.n_kv_head) * hd,
            f(self.intermediate_size),
        );
        let per_layer = 2.0 * c          // input_layernorm, post_attention_layernorm
            + 2.0 * q * c                // q_proj, o_proj
            + 2.0 * kv * c               // k_proj, v_proj
            + 3.0 * c * m // gate_proj, up_proj, down_proj
            + if self.qkv_bias { q + 2.0 * kv } else { 0.0 };
        let head = if self.tie_word_embeddings {
            0.0
        } else {
            f(self.vocab_size) * c
        };
        (f(self.vocab_size) * c + f(self.n_layer) * per_layer + c + head) as usize
    }
}

impl LlamaConfig {
    /// The planner's description of this model with samples of `seq_len`
    /// tokens (`phalanx plan`, and the FLOPs per token behind MFU): its
    /// parameters as its blocks declare them, whole and on every tp size
    /// they accept ([`crate::common::plan`]).
    pub fn plan_shape(&self, seq_len: usize) -> Result<phalanx::plan::ModelShape> {
        let params = crate::common::plan::declare(self.n_head, |tp| match tp {
            None => super::blocks(self),
            Some(t) => super::tp::blocks_tp(self, t),
        })?;
        Ok(phalanx::plan::ModelShape::llama(
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.n_embd,
            self.head_dim(),
            self.intermediate_size,
            self.vocab_size,
            seq_len,
        )
        .with_params(params))
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
    /// 0: n_embd / n_head.
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Context length T.
    pub block_size: usize,
    pub rope_theta: f64,
    /// `"none"` or `"llama3"` (then the four `rope_*` keys below apply).
    pub rope_scaling: String,
    pub rope_factor: f64,
    pub rope_low_freq_factor: f64,
    pub rope_high_freq_factor: f64,
    pub rope_original_max_position: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    /// The context an exported `config.json` records when it exceeds
    /// `block_size` (0: `block_size`): a model imported with a longer
    /// context than it trains at (`--init-from` sets it from the
    /// `config.json`) keeps its own in `--save-final` and `checkpoint
    /// convert`. Rotary positions fix no context in the weights.
    #[serde(default)]
    pub max_position_embeddings: usize,
}

/// Llama 3's scaling parameters, the section's defaults when none is set.
const LLAMA3_DEFAULTS: (f64, f64, f64, usize) = (8.0, 1.0, 4.0, 8192);

impl LlamaSection {
    /// The section of a preset.
    pub fn preset(name: &str) -> std::result::Result<LlamaSection, ConfigError> {
        let c = LlamaConfig::preset(name).map_err(|_| {
            ConfigError(format!(
                "unknown model.preset {name:?} for model.arch = \"llama\"; choose one of {:?}",
                LlamaConfig::PRESETS
            ))
        })?;
        Ok(Self::of_model("llama", name, &c))
    }

    /// The section of family `arch`'s preset `name`, whose model is `c`.
    pub fn of_model(arch: &str, name: &str, c: &LlamaConfig) -> LlamaSection {
        let (f, lo, hi, old) = match c.rope_scaling {
            RopeScaling::None => LLAMA3_DEFAULTS,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => (
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            ),
        };
        LlamaSection {
            arch: arch.into(),
            preset: name.to_string(),
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_kv_head: c.n_kv_head,
            n_embd: c.n_embd,
            head_dim: c.head_size,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            block_size: c.block_size,
            rope_theta: c.rope_theta,
            rope_scaling: match c.rope_scaling {
                RopeScaling::None => "none".into(),
                RopeScaling::Llama3 { .. } => "llama3".into(),
            },
            rope_factor: f,
            rope_low_freq_factor: lo,
            rope_high_freq_factor: hi,
            rope_original_max_position: old,
            rms_norm_eps: c.rms_norm_eps,
            tie_word_embeddings: c.tie_word_embeddings,
            max_position_embeddings: 0,
        }
    }

    /// The context an exported `config.json` records (see
    /// [`LlamaSection::max_position_embeddings`]).
    pub fn exported_context(&self) -> usize {
        self.block_size.max(self.max_position_embeddings)
    }

    /// The section of a config built with [`crate::arch::build`].
    pub fn of(cfg: &phalanx::config::TrainConfig) -> std::result::Result<Self, ConfigError> {
        Self::from_table(&cfg.model)
    }

    pub(crate) fn from_table(t: &toml::Table) -> std::result::Result<Self, ConfigError> {
        Self::from_table_as(t, "llama")
    }

    /// The section of a family on Llama's layers (`model.arch = family`).
    pub(crate) fn from_table_as(
        t: &toml::Table,
        family: &str,
    ) -> std::result::Result<Self, ConfigError> {
        // The architecture first: a GPT-2 section lacks Llama's keys.
        let arch = t.get("arch").and_then(|a| a.as_str()).unwrap_or("gpt2");
        if arch != family {
            let name = if family == "llama" { "Llama" } else { family };
            return Err(ConfigError(format!(
                "model.arch = {arch:?}: not a {name} config"
            )));
        }
        toml::Value::Table(t.clone())
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError(format!("model: {}", e.message())))
    }

    /// The model's hyper-parameters (`rope_scaling` must be known: see
    /// [`LlamaSection::check`]; an unknown one reads as none here).
    pub fn model(&self) -> LlamaConfig {
        let rope_scaling = match self.rope_scaling.as_str() {
            "llama3" => RopeScaling::Llama3 {
                factor: self.rope_factor,
                low_freq_factor: self.rope_low_freq_factor,
                high_freq_factor: self.rope_high_freq_factor,
                original_max_position: self.rope_original_max_position,
            },
            _ => RopeScaling::None,
        };
        LlamaConfig {
            rope_scaling,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            n_embd: self.n_embd,
            head_size: self.head_dim,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            rope_theta: self.rope_theta,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: false,
        }
    }

    /// What the library needs to know, after the checks.
    pub(crate) fn facts_as(
        t: &toml::Table,
        family: &str,
    ) -> std::result::Result<ModelFacts, ConfigError> {
        let s = Self::from_table_as(t, family)?;
        if !["none", "llama3"].contains(&s.rope_scaling.as_str()) {
            return Err(ConfigError(format!(
                "model.rope_scaling {:?}: choose \"none\" or \"llama3\" (other scalings are not built for model.arch = {family} yet)",
                s.rope_scaling
            )));
        }
        let given = (
            s.rope_factor,
            s.rope_low_freq_factor,
            s.rope_high_freq_factor,
            s.rope_original_max_position,
        );
        if s.rope_scaling == "none" && given != LLAMA3_DEFAULTS {
            // They would be ignored: the scaling they shape is off.
            return Err(ConfigError(format!(
                "model.rope_factor / rope_low_freq_factor / rope_high_freq_factor / \
                 rope_original_max_position = {given:?} are Llama 3's scaling's parameters, and \
                 model.rope_scaling = \"none\": set model.rope_scaling = \"llama3\" to use them"
            )));
        }
        s.model().check()?;
        Ok(ModelFacts {
            seq_len: Some(s.block_size),
            n_layer: Some(s.n_layer),
        })
    }
}
