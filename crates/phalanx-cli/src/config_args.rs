//! The config flags `phalanx train` and `phalanx plan` share: a TOML or
//! DeepSpeed JSON file and `--set section.key=value` overrides.

use clap::Args;
use phalanx::config::TrainConfig;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// A TOML file of the config's sections (model, data, train, optim,
    /// parallel, log, ...; `--print-config` shows them all), or a
    /// DeepSpeed config (a `.json` file).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A DeepSpeed config (ds_config.json); the same as `--config FILE.json`.
    #[arg(
        long = "deepspeed-config",
        visible_alias = "deepspeed_config",
        value_name = "FILE",
        conflicts_with = "config"
    )]
    pub deepspeed_config: Option<PathBuf>,
    /// Override one key, e.g. `--set train.steps=100` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
}

impl ConfigArgs {
    /// The config file given, TOML or DeepSpeed.
    pub fn file(&self) -> Option<&std::path::Path> {
        self.config.as_deref().or(self.deepspeed_config.as_deref())
    }

    /// The config the flags describe (the model section of `model.arch`).
    pub fn build(&self) -> Result<TrainConfig, phalanx::config::ConfigError> {
        phalanx_models::family::build(self.file(), &self.set)
    }
}
