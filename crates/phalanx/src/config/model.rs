//! The `model` section belongs to the crate that defines the model: the
//! library keeps it as a TOML table and learns what it needs of it (the
//! sequence length, the number of layers) through [`ModelSchema`].
//!
//! A model crate implements [`ModelSchema`] and builds configs with
//! [`TrainConfig::build_for`](super::TrainConfig::build_for); the section is
//! then filled with the same precedence as every other one: the schema's
//! defaults <- the preset named by `model.preset` <- the file <- `--set`,
//! with unknown keys and wrong types errors naming `model.KEY`.
//! [`TrainConfig::build`](super::TrainConfig::build) uses [`NoModel`]: a
//! model-agnostic config whose `model` section is empty.
//!
//! ```
//! use phalanx::config::{ConfigError, ModelFacts, ModelSchema, TrainConfig};
//! /// A model with one key, `model.layers`.
//! struct Mlp;
//! impl ModelSchema for Mlp {
//!     fn section(&self, preset: Option<&str>) -> Result<toml::Table, ConfigError> {
//!         let layers = match preset {
//!             None | Some("small") => 2,
//!             Some("big") => 8,
//!             Some(p) => return Err(ConfigError(format!("unknown model.preset {p:?}"))),
//!         };
//!         Ok(toml::toml! { preset = "small" layers = layers })
//!     }
//!     fn check(&self, m: &toml::Table) -> Result<ModelFacts, ConfigError> {
//!         let n_layer = m["layers"].as_integer().unwrap() as usize;
//!         Ok(ModelFacts { seq_len: None, n_layer: Some(n_layer) })
//!     }
//! }
//! let c = TrainConfig::build_for(&Mlp, None, &["model.preset=big".into()]).unwrap();
//! assert_eq!(c.model["layers"].as_integer(), Some(8));
//! let e = TrainConfig::build_for(&Mlp, None, &["model.width=3".into()]).unwrap_err();
//! assert!(e.to_string().contains("unknown key `model.width`"));
//! assert!(TrainConfig::build(None, &["model.layers=3".into()]).is_err());
//! ```

use super::{ConfigError, Result};

/// What the library needs to know of a model's section.
pub trait ModelSchema {
    /// The whole section for `preset` (`None`: the default preset): every
    /// key the section accepts, with its value. Unknown presets are errors.
    fn section(&self, preset: Option<&str>) -> Result<toml::Table>;

    /// The whole section for what the file and the overrides give (`given`:
    /// their `model` table, if any). By default the section of its
    /// `preset`; a schema covering several architectures (e.g. one chosen by
    /// `model.arch`) overrides it to pick the architecture's default preset.
    fn section_for(&self, given: Option<&toml::Table>) -> Result<toml::Table> {
        self.section(given.and_then(|m| m.get("preset")).and_then(|p| p.as_str()))
    }

    /// Check the merged section (its keys and types are already those of
    /// [`ModelSchema::section`]); errors name `model.KEY`.
    fn check(&self, section: &toml::Table) -> Result<ModelFacts>;
}

/// What the library uses of the model section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelFacts {
    /// Tokens per sample the model takes (checked against the data).
    pub seq_len: Option<usize>,
    /// Layers (DeepSpeed's `activation_checkpointing.number_checkpoints`
    /// is resolved against it).
    pub n_layer: Option<usize>,
}

/// No model section: the config of a model built outside a model crate.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoModel;

impl ModelSchema for NoModel {
    fn section(&self, preset: Option<&str>) -> Result<toml::Table> {
        match preset {
            None => Ok(toml::Table::new()),
            Some(p) => Err(ConfigError(format!(
                "model.preset = {p:?}: this config has no model section (a model crate builds \
                 configs with its own, e.g. phalanx_models::gpt2::config::build)"
            ))),
        }
    }

    fn check(&self, _: &toml::Table) -> Result<ModelFacts> {
        Ok(ModelFacts::default())
    }
}
