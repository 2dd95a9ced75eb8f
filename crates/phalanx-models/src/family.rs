//! Model families and their registry.
//!
//! A family (GPT-2, Llama, Qwen2) implements [`ModelFamily`]: its name (the
//! `model.arch` value), its `model` section and presets, its blocks for the
//! engine (whole and on one tensor-parallel rank) and their placements,
//! Hugging Face weights and `config.json` in and out (the `model_type` /
//! `architectures` it answers to), generation, and the planner's shape
//! (whence the FLOPs behind MFU). Everything else (the training path in
//! [`crate::train`], distributed checkpoints in [`crate::dcp`], the CLI)
//! looks the family up here, by name ([`get`], [`of`] a config), by a
//! Hugging Face `config.json` ([`for_hf_config`]) or by preset, and never
//! names one. Adding a family is one folder and one line in [`all`].
//!
//! The family of a config is `model.arch` when given, else the family of
//! `model.preset`, else GPT-2. Its default preset fills the section; a
//! preset of another family is an error naming both.
//!
//! ```
//! use phalanx_models::family;
//! let cfg = family::build(None, &["model.arch=llama".into(), "model.n_kv_head=4".into()]).unwrap();
//! assert_eq!(family::of(&cfg).unwrap().name(), "llama");
//! assert_eq!(cfg.model["preset"].as_str(), Some("llama-tiny"));
//! let gpt = family::build(None, &[]).unwrap();
//! assert_eq!(family::of(&gpt).unwrap().title(), "GPT-2");
//! let e = family::build(None, &["model.arch=gpt2".into(), "model.preset=llama-tiny".into()]);
//! assert!(e.unwrap_err().to_string().contains("is a Llama preset"));
//! let hf = serde_json::json!({"architectures": ["LlamaForCausalLM"]});
//! assert_eq!(family::for_hf_config(&hf).unwrap().name(), "llama");
//! let qwen = serde_json::json!({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]});
//! assert_eq!(family::for_hf_config(&qwen).unwrap().name(), "qwen2");
//! ```

use crate::common::generate::{Decoder, FullForward};
use candle_core::Tensor;
use phalanx::config::{ConfigError, ModelFacts, ModelSchema, TrainConfig};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::plan::ModelShape;
use phalanx::tp::Tp;
use phalanx::Result;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

type CResult<T> = std::result::Result<T, ConfigError>;

/// What a model family tells the rest of Phalanx. Every method that takes
/// a [`TrainConfig`] reads the family's own `model` section of it (a
/// config whose [`of`] is this family).
pub trait ModelFamily: Send + Sync {
    // ------------------------------------------------------------ identity

    /// Its names: `model.arch`, HF's `model_type` / `architectures`,
    /// presets.
    fn names(&self) -> &'static FamilyNames;

    /// The `model.arch` value (`"gpt2"`).
    fn name(&self) -> &'static str {
        self.names().arch
    }

    /// The name people use (`"GPT-2"`), for messages.
    fn title(&self) -> &'static str {
        self.names().title
    }

    // ------------------------------------------------------ config section

    /// Whether `preset` is one of this family's (aliases included).
    fn has_preset(&self, preset: &str) -> bool {
        self.names().presets.contains(&preset)
    }

    /// The whole `model` section of `preset`: every key the section
    /// accepts, `arch` included.
    fn section(&self, preset: &str) -> CResult<toml::Table>;

    /// Check a merged section; errors name `model.KEY`.
    fn check(&self, section: &toml::Table) -> CResult<ModelFacts>;

    /// The model's shape, for the CLI's one-line descriptions.
    fn summary(&self, cfg: &TrainConfig) -> Result<ModelSummary>;

    // ------------------------------------------------------------- blocks

    /// The blocks of the whole model (embedding, layers, head).
    fn blocks(&self, cfg: &TrainConfig) -> Result<Vec<Box<dyn Block>>>;

    /// The blocks of one tensor-parallel rank; each declares its
    /// parameters' placements (`phalanx::placement`), from which
    /// the slices, gathering and checkpoint regions follow.
    fn tp_blocks(&self, cfg: &TrainConfig, tp: &Tp) -> Result<Vec<Box<dyn Block>>>;

    /// A tensor-parallel rank's engine with its slices of the HF weights at
    /// `path` (the whole file's names and shapes checked, as a one-rank
    /// load does).
    fn tp_load(
        &self,
        cfg: &TrainConfig,
        tp: &Tp,
        ecfg: EngineConfig,
        path: &Path,
    ) -> Result<Engine>;

    // ------------------------------------------------------- Hugging Face

    /// The `model.*` values an HF `config.json` gives (`arch` first);
    /// features the family does not build are refused, naming the key.
    fn hf_keys(&self, config: &Value) -> Result<Vec<HfKey>>;

    /// Check HF weights at `path` (their `config.json`) against the config
    /// before any rank starts; by default nothing is checked.
    fn check_hf(&self, _cfg: &TrainConfig, _path: &Path) -> Result<()> {
        Ok(())
    }

    /// Load HF weights (a file, or a directory holding them) into a
    /// one-rank engine or a pipeline stage (which reads its own tensors).
    fn load_hf(&self, engine: &mut Engine, cfg: &TrainConfig, path: &Path) -> Result<()>;

    /// Write the whole model (engine names and orientation, every
    /// parameter) in HF layout at `path`, with its `config.json`; returns
    /// the directory written to (where a `tokenizer.json` goes).
    fn save_hf(
        &self,
        tensors: &HashMap<String, Tensor>,
        cfg: &TrainConfig,
        path: &Path,
    ) -> Result<PathBuf>;

    /// The weight file [`ModelFamily::save_hf`] writes for `path`.
    fn hf_weights_file(&self, path: &Path) -> PathBuf;

    // --------------------------------------------------------- generation

    /// The decoder generation runs on; by default a full forward of the
    /// latest `block_size` tokens per token.
    fn decoder<'a>(&self, engine: &'a Engine, cfg: &TrainConfig) -> Result<Box<dyn Decoder + 'a>> {
        let context = self.summary(cfg)?.block_size;
        Ok(Box::new(FullForward { engine, context }))
    }

    /// Whether a `tokenizer.json` beside downloaded weights is the one to
    /// generate with (else `data.tokenizer`).
    fn tokenizer_beside(&self) -> bool {
        true
    }

    /// The `data.tokenizer` a downloaded checkpoint's `config.json` implies
    /// when Phalanx did not record one (`phalanx_tokenizer`); none by
    /// default.
    fn hf_default_tokenizer(&self, _config: &Value) -> Option<String> {
        None
    }

    // ------------------------------------------------------------ planner

    /// The planner's description of the model with samples of `seq_len`
    /// tokens (`phalanx plan`, and the FLOPs per token behind MFU), with
    /// the parameters its blocks declare at every tp size they accept
    /// ([`crate::common::plan::declare`]).
    fn plan_shape(&self, cfg: &TrainConfig, seq_len: usize) -> Result<ModelShape>;
}

/// The names of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyNames {
    /// The `model.arch` value.
    pub arch: &'static str,
    /// The name people use, for messages.
    pub title: &'static str,
    /// The `model_type` values of the `config.json`s it reads.
    pub hf_model_types: &'static [&'static str],
    /// The `architectures` it answers to (`"LlamaForCausalLM"`).
    pub hf_architectures: &'static [&'static str],
    pub presets: &'static [&'static str],
    /// The preset a section starts from when none is named.
    pub default_preset: &'static str,
}

/// A model's shape in a few numbers, for one-line descriptions.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSummary {
    pub title: &'static str,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads, for families with grouped-query attention.
    pub n_kv_head: Option<usize>,
    pub n_embd: usize,
    /// The MLP's hidden width, for families that set it apart.
    pub mlp: Option<usize>,
    pub vocab_size: usize,
    /// Context length T.
    pub block_size: usize,
    pub num_params: usize,
}

impl ModelSummary {
    /// `4 layers, 4 heads / 2 kv heads, 128 wide, MLP 352, vocab 256, context 128`.
    pub fn shape(&self) -> String {
        let mut s = format!("{} layers, {} heads", self.n_layer, self.n_head);
        if let Some(kv) = self.n_kv_head {
            s += &format!(" / {kv} kv heads");
        }
        s += &format!(", {} wide", self.n_embd);
        if let Some(m) = self.mlp {
            s += &format!(", MLP {m}");
        }
        s + &format!(", vocab {}, context {}", self.vocab_size, self.block_size)
    }

    /// `Llama 2 layer(s), 4 head(s) / 2 kv head(s), 32 wide, MLP 48, vocab
    /// 256, context 32: 25,920 parameters` (the checkpoint tools' line).
    pub fn line(&self) -> String {
        let mut s = format!(
            "{} {} layer(s), {} head(s)",
            self.title, self.n_layer, self.n_head
        );
        if let Some(kv) = self.n_kv_head {
            s += &format!(" / {kv} kv head(s)");
        }
        s += &format!(", {} wide", self.n_embd);
        if let Some(m) = self.mlp {
            s += &format!(", MLP {m}");
        }
        s + &format!(
            ", vocab {}, context {}: {} parameters",
            self.vocab_size, self.block_size, self.num_params
        )
    }
}

/// One `model.*` value read from an HF `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfKey {
    /// The key in the `model` section (`n_layer`).
    pub key: &'static str,
    pub value: toml::Value,
    /// Where it comes from in `config.json` (`num_hidden_layers`).
    pub hf_key: &'static str,
    /// A shape the weights fix: given explicitly with another value, it is
    /// an error. Not strict (e.g. a rotary model's context): the value
    /// given wins.
    pub strict: bool,
}

impl HfKey {
    pub fn strict(key: &'static str, hf_key: &'static str, value: impl Into<toml::Value>) -> Self {
        HfKey {
            key,
            value: value.into(),
            hf_key,
            strict: true,
        }
    }

    pub fn soft(key: &'static str, hf_key: &'static str, value: impl Into<toml::Value>) -> Self {
        HfKey {
            strict: false,
            ..Self::strict(key, hf_key, value)
        }
    }
}

// ------------------------------------------------------------- registry

/// Every family, in the order `model.arch` lists them; the first is the
/// default. One line per family.
static FAMILIES: [&dyn ModelFamily; 3] = [
    &crate::gpt2::Gpt2Family,
    &crate::llama::LLAMA,
    &crate::qwen2::QWEN2,
];

/// Every family this crate builds.
pub fn all() -> &'static [&'static dyn ModelFamily] {
    &FAMILIES
}

/// The family of a config without `model.arch` (GPT-2).
pub fn default_family() -> &'static dyn ModelFamily {
    FAMILIES[0]
}

fn arch_names() -> Vec<&'static str> {
    all().iter().map(|f| f.name()).collect()
}

/// The family named `name` (a `model.arch` value).
pub fn get(name: &str) -> CResult<&'static dyn ModelFamily> {
    all()
        .iter()
        .copied()
        .find(|f| f.name() == name)
        .ok_or_else(|| {
            ConfigError(format!(
                "unknown model.arch {name:?}; choose one of {:?}",
                arch_names()
            ))
        })
}

/// The family of a config built with [`build`] (a section without `arch`,
/// as [`crate::gpt2::config::build`] makes, is GPT-2's).
pub fn of(cfg: &TrainConfig) -> CResult<&'static dyn ModelFamily> {
    of_table(&cfg.model)
}

fn of_table(t: &toml::Table) -> CResult<&'static dyn ModelFamily> {
    match t.get("arch") {
        None => Ok(default_family()),
        Some(v) => get(v
            .as_str()
            .ok_or_else(|| ConfigError(format!("model.arch must be a string, not {v}")))?),
    }
}

/// The family a preset belongs to.
pub fn for_preset(preset: &str) -> Option<&'static dyn ModelFamily> {
    all().iter().copied().find(|f| f.has_preset(preset))
}

/// The family of an HF `config.json`: by `model_type`, else by
/// `architectures`, as `AutoModelForCausalLM` picks its class.
pub fn for_hf_config(config: &Value) -> CResult<&'static dyn ModelFamily> {
    let known = || {
        all()
            .iter()
            .map(|f| format!("{} ({})", f.name(), f.names().hf_architectures.join(", ")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let archs: Vec<&str> = config
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    if let Some(t) = config.get("model_type").and_then(|t| t.as_str()) {
        return all()
            .iter()
            .copied()
            .find(|f| f.names().hf_model_types.contains(&t))
            .ok_or_else(|| {
                ConfigError(format!(
                    "config.json: model_type {t:?} (architectures {archs:?}) is not a family \
                     Phalanx builds; known: {}",
                    known()
                ))
            });
    }
    all()
        .iter()
        .copied()
        .find(|f| archs.iter().any(|a| f.names().hf_architectures.contains(a)))
        .ok_or_else(|| {
            ConfigError(format!(
                "config.json names no model_type, and architectures {archs:?} are not a family \
                 Phalanx builds; known: {}",
                known()
            ))
        })
}

// ------------------------------------------------------ the model section

/// Every family's `model` section for [`TrainConfig::build_for`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelsSchema;

impl ModelSchema for ModelsSchema {
    fn section(&self, preset: Option<&str>) -> CResult<toml::Table> {
        let family = preset.and_then(for_preset).unwrap_or(default_family());
        section(family, preset)
    }

    fn section_for(&self, given: Option<&toml::Table>) -> CResult<toml::Table> {
        let preset = given.and_then(|m| m.get("preset")).and_then(|p| p.as_str());
        let family = match given.filter(|m| m.contains_key("arch")) {
            Some(m) => of_table(m)?,
            None => preset.and_then(for_preset).unwrap_or(default_family()),
        };
        section(family, preset)
    }

    fn check(&self, t: &toml::Table) -> CResult<ModelFacts> {
        of_table(t)?.check(t)
    }
}

fn section(family: &dyn ModelFamily, preset: Option<&str>) -> CResult<toml::Table> {
    let p = preset.unwrap_or(family.names().default_preset);
    if !family.has_preset(p) {
        let other = for_preset(p)
            .map(|o| {
                format!(
                    " ({p:?} is a {} preset: model.arch = {:?})",
                    o.title(),
                    o.name()
                )
            })
            .unwrap_or_default();
        return Err(ConfigError(format!(
            "unknown model.preset {p:?} for model.arch = {:?}{other}; choose one of {:?}",
            family.name(),
            family.names().presets
        )));
    }
    family.section(p)
}

/// A training config with the `model` section of `model.arch`: defaults <-
/// preset <- file <- `--set` overrides (see [`TrainConfig::build_for`]).
pub fn build(file: Option<&Path>, overrides: &[String]) -> CResult<TrainConfig> {
    TrainConfig::build_for(&ModelsSchema, file, overrides)
}

/// [`build`], returning the warnings instead of printing them.
pub fn build_with_warnings(
    file: Option<&Path>,
    overrides: &[String],
) -> CResult<(TrainConfig, Vec<String>)> {
    TrainConfig::build_with_warnings_for(&ModelsSchema, file, overrides)
}

/// The planner's description of a config's model, any family (`phalanx
/// plan`; the FLOPs per token behind MFU), with samples of
/// `model.block_size` tokens.
pub fn plan_shape(cfg: &TrainConfig) -> Result<ModelShape> {
    let f = of(cfg)?;
    let t = f.summary(cfg)?.block_size;
    f.plan_shape(cfg, t)
}

// ----------------------------------------------- a Hugging Face directory

/// The `config.json` of HF weights at `path` (a directory, or a file in
/// one), if there is one.
pub fn hf_config_path(path: &Path) -> Option<PathBuf> {
    let p = crate::common::hf::model_dir(path).join("config.json");
    p.is_file().then_some(p)
}

/// A training config for HF weights at `weights` (a directory, a
/// `model.safetensors` or an index): when a `config.json` sits there, it
/// picks the family (`model_type` / `architectures`) and sets the model's
/// shape, as `AutoModelForCausalLM.from_pretrained` does; the file and the
/// overrides give the rest. A `model.*` key given explicitly (in the file
/// or with `--set`) wins where the weights do not fix it (a rotary model's
/// context); where they do, another value is an error naming both.
/// Without a `config.json`, this is [`build`].
///
/// Returns the config and the `config.json` read.
pub fn build_for_hf(
    file: Option<&Path>,
    overrides: &[String],
    weights: &Path,
) -> Result<(TrainConfig, Option<PathBuf>)> {
    let Some(cj) = hf_config_path(weights) else {
        return Ok((build(file, overrides)?, None));
    };
    let bad = |e: String| phalanx::Error::Check(format!("{}: {e}", cj.display()));
    let text = phalanx::fsutil::read_text_capped("config.json", &cj, phalanx::fsutil::CONFIG_CAP)
        .map_err(bad)?;
    let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let family = for_hf_config(&json).map_err(|e| bad(e.0))?;
    let keys = family.hf_keys(&json).map_err(|e| bad(e.to_string()))?;
    let explicit = explicit_keys(file, overrides, "model")?;
    let mut sets = Vec::new();
    for k in &keys {
        match explicit.get(k.key) {
            None => sets.push(format!("model.{}={}", k.key, k.value)),
            Some((v, place)) if k.strict && !same_value(v, &k.value) => {
                return Err(bad(format!(
                    "config.json has {} = {} but model.{} = {v} ({place}); the weights are of \
                     the config.json's shape (drop model.{} to use it)",
                    k.hf_key, k.value, k.key, k.key
                )))
            }
            Some(_) => {}
        }
    }
    sets.extend(overrides.iter().cloned());
    Ok((build(file, &sets)?, Some(cj)))
}

/// The keys of `section` given explicitly: in the file's `[section]`
/// table (a TOML file) and by `--set section.KEY=VALUE` (later ones win),
/// with where.
pub fn explicit_keys(
    file: Option<&Path>,
    overrides: &[String],
    section: &str,
) -> Result<HashMap<String, (toml::Value, &'static str)>> {
    let mut out = HashMap::new();
    if let Some(p) = file.filter(|p| {
        !p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
    }) {
        let text = phalanx::fsutil::read_text_capped("config file", p, phalanx::fsutil::CONFIG_CAP)
            .map_err(|e| ConfigError(format!("cannot read it: {e}")))?;
        let t: toml::Table = text
            .parse()
            .map_err(|e| ConfigError(format!("{}: {e}", p.display())))?;
        if let Some(m) = t.get(section).and_then(|m| m.as_table()) {
            for (k, v) in m {
                out.insert(k.clone(), (v.clone(), "in the config file"));
            }
        }
    }
    for o in overrides {
        let Some((key, value)) = o.split_once('=') else {
            continue;
        };
        let Some(k) = key
            .trim()
            .strip_prefix(section)
            .and_then(|k| k.strip_prefix('.'))
        else {
            continue;
        };
        // Read as `TrainConfig::build` reads an override: a TOML value, else a string.
        let v = format!("v = {}", value.trim())
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.trim().to_string()));
        out.insert(k.to_string(), (v, "given with --set"));
    }
    Ok(out)
}

/// Equal values, numbers compared as numbers (`1000000` = `1e6`).
fn same_value(a: &toml::Value, b: &toml::Value) -> bool {
    use toml::Value as V;
    let num = |v: &V| match v {
        V::Integer(i) => Some(*i as f64),
        V::Float(f) => Some(*f),
        _ => None,
    };
    match (num(a), num(b)) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1.0),
        _ => a == b,
    }
}
