//! `model.arch`: the training config's model section for every architecture
//! this crate builds (`"gpt2"`, the default, or `"llama"`).
//!
//! The architecture is taken from `model.arch` when given, else from the
//! preset's name (a Llama preset implies `arch = "llama"`), else GPT-2. Its
//! default preset fills the section (`gpt-tiny`, `llama-tiny`); a preset of
//! the other architecture is an error naming both.
//!
//! ```
//! use phalanx_models::arch::{self, Arch};
//! let cfg = arch::build(None, &["model.arch=llama".into(), "model.n_kv_head=4".into()]).unwrap();
//! assert_eq!(Arch::of(&cfg).unwrap(), Arch::Llama);
//! assert_eq!(cfg.model["preset"].as_str(), Some("llama-tiny"));
//! let gpt = arch::build(None, &[]).unwrap();
//! assert_eq!(Arch::of(&gpt).unwrap(), Arch::Gpt2);
//! let e = arch::build(None, &["model.arch=gpt2".into(), "model.preset=llama-tiny".into()]);
//! assert!(e.unwrap_err().to_string().contains("is a Llama preset"));
//! ```

use crate::gpt2::config::{Gpt2Schema, Gpt2Section};
use crate::llama::config::{LlamaConfig, LlamaSection};
use phalanx::config::{ConfigError, ModelFacts, ModelSchema, TrainConfig};
use phalanx::plan::ModelShape;
use std::path::Path;

type CResult<T> = std::result::Result<T, ConfigError>;

/// The architectures `model.arch` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Gpt2,
    Llama,
}

impl Arch {
    pub const NAMES: [&'static str; 2] = ["gpt2", "llama"];

    pub fn parse(s: &str) -> CResult<Arch> {
        match s {
            "gpt2" => Ok(Arch::Gpt2),
            "llama" => Ok(Arch::Llama),
            _ => Err(ConfigError(format!(
                "unknown model.arch {s:?}; choose one of {:?}",
                Self::NAMES
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
        }
    }

    /// The architecture of a config built with [`build`] (a section without
    /// `arch`, as [`crate::gpt2::config::build`] makes, is GPT-2).
    pub fn of(cfg: &TrainConfig) -> CResult<Arch> {
        Self::of_table(&cfg.model)
    }

    fn of_table(t: &toml::Table) -> CResult<Arch> {
        match t.get("arch") {
            None => Ok(Arch::Gpt2),
            Some(v) => Self::parse(
                v.as_str()
                    .ok_or_else(|| ConfigError(format!("model.arch must be a string, not {v}")))?,
            ),
        }
    }

    /// The architecture a preset belongs to.
    fn of_preset(p: &str) -> Arch {
        if LlamaConfig::PRESETS.contains(&p) {
            Arch::Llama
        } else {
            Arch::Gpt2
        }
    }
}

/// Every architecture's `model` section for [`TrainConfig::build_for`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelsSchema;

impl ModelSchema for ModelsSchema {
    fn section(&self, preset: Option<&str>) -> CResult<toml::Table> {
        let arch = preset.map_or(Arch::Gpt2, Arch::of_preset);
        section(arch, preset)
    }

    fn section_for(&self, given: Option<&toml::Table>) -> CResult<toml::Table> {
        let preset = given.and_then(|m| m.get("preset")).and_then(|p| p.as_str());
        let arch = match given.filter(|m| m.contains_key("arch")) {
            Some(m) => Arch::of_table(m)?,
            None => preset.map_or(Arch::Gpt2, Arch::of_preset),
        };
        if let Some(p) = preset {
            let belongs = Arch::of_preset(p);
            if belongs == Arch::Llama && arch != Arch::Llama {
                return Err(ConfigError(format!(
                    "model.preset {p:?} is a Llama preset but model.arch = {:?}",
                    arch.name()
                )));
            }
        }
        section(arch, preset)
    }

    fn check(&self, t: &toml::Table) -> CResult<ModelFacts> {
        match Arch::of_table(t)? {
            Arch::Gpt2 => {
                let mut t = t.clone();
                t.remove("arch");
                Gpt2Schema.check(&t)
            }
            Arch::Llama => LlamaSection::facts(t),
        }
    }
}

fn section(arch: Arch, preset: Option<&str>) -> CResult<toml::Table> {
    match arch {
        Arch::Gpt2 => {
            if let Some(p) = preset.filter(|p| Gpt2Section::preset(p).is_err()) {
                return Err(ConfigError(format!(
                    "unknown model.preset {p:?} for model.arch = \"gpt2\"; choose one of {:?} \
                     (or set model.arch = \"llama\" for {:?})",
                    crate::gpt2::Gpt2Config::PRESETS,
                    LlamaConfig::PRESETS
                )));
            }
            let mut t = Gpt2Schema.section(preset)?;
            t.insert("arch".into(), "gpt2".into());
            Ok(t)
        }
        Arch::Llama => {
            let s = LlamaSection::preset(preset.unwrap_or(LlamaConfig::DEFAULT_PRESET))?;
            toml::Table::try_from(&s).map_err(|e| ConfigError(e.to_string()))
        }
    }
}

/// The planner's description of a config's model, either architecture
/// (`phalanx plan`; the FLOPs per token behind MFU), with samples of
/// `model.block_size` tokens.
pub fn plan_shape(cfg: &TrainConfig) -> CResult<ModelShape> {
    match Arch::of(cfg)? {
        Arch::Gpt2 => {
            let s = Gpt2Section::of(cfg)?;
            Ok(ModelShape::gpt2(
                s.n_layer,
                s.n_head,
                s.n_embd,
                s.vocab_size,
                s.block_size,
            ))
        }
        Arch::Llama => {
            let m = LlamaSection::of(cfg)?.model();
            Ok(m.plan_shape(m.block_size))
        }
    }
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
