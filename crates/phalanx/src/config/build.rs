//! Building a [`TrainConfig`]: defaults <- model preset <- file (TOML or
//! a DeepSpeed JSON) <- `section.key=value` overrides, then validation;
//! the warnings and notes said once per job.

use super::{batch, deepspeed, merge, ConfigError, ModelSchema, NoModel, Result, TrainConfig};
use std::path::Path;

/// Set by a launcher for the ranks it starts: the config's warnings and
/// notes it printed already, one per line (rank 0 prints the others).
pub const CONFIG_SAID: &str = "PHALANX_CONFIG_SAID";

/// What [`TrainConfig::build_for`] said in this process.
static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl TrainConfig {
    /// [`TrainConfig::build_for`] without a model section ([`NoModel`]).
    pub fn build(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig> {
        Self::build_for(&NoModel, file, overrides)
    }

    /// [`TrainConfig::build`], returning the warnings instead of printing them.
    pub fn build_with_warnings(
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<(TrainConfig, Vec<String>)> {
        Self::build_with_warnings_for(&NoModel, file, overrides)
    }

    /// Defaults <- model preset <- file <- `section.key=value` overrides,
    /// then validation; `model` is the section `schema` defines. A file named `*.json` is a DeepSpeed config
    /// (translated to the same keys, see the `deepspeed` module); any other
    /// is TOML. Warnings (DeepSpeed keys accepted without effect) are
    /// printed to stderr (by rank 0 only inside a job);
    /// [`TrainConfig::build_with_warnings_for`] returns them.
    pub fn build_for(
        schema: &dyn ModelSchema,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<TrainConfig> {
        let (cfg, warnings) = Self::build_with_warnings_for(schema, file, overrides)?;
        // Inside a job every rank builds the config: rank 0 speaks for all
        // (torchrun's, mpirun's or srun's rank), but not again what the
        // launcher of `phalanx train` said before it started the ranks
        // (`CONFIG_SAID`; the ranks, inside the job, may have more to say).
        if phalanx_comm::JobSizes::from_env().map_or(true, |j| j.rank == 0) {
            let before = std::env::var(CONFIG_SAID).unwrap_or_default();
            let lines = warnings
                .iter()
                .map(|w| format!("warning: {w}"))
                .chain(cfg.notes().into_iter().map(|n| format!("note: {n}")));
            let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
            for l in lines {
                if !before.lines().any(|b| b == l) {
                    eprintln!("{l}");
                }
                said.push(l);
            }
        }
        Ok(cfg)
    }

    /// The warnings and notes [`TrainConfig::build_for`] said in this
    /// process: those it printed, and those it held back because the
    /// launcher had printed them already (`CONFIG_SAID`). A launcher passes
    /// them to its ranks as `CONFIG_SAID`.
    pub fn said() -> Vec<String> {
        SAID.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// [`TrainConfig::build_for`], returning the warnings instead of printing them.
    pub fn build_with_warnings_for(
        schema: &dyn ModelSchema,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<(TrainConfig, Vec<String>)> {
        let mut table = toml::Table::new();
        let mut warnings = Vec::new();
        let mut ds = deepspeed::Extra::default();
        let mut autos = deepspeed::Autos::default();
        if let Some(p) = file {
            let text = crate::fsutil::read_text_capped("config file", p, crate::fsutil::CONFIG_CAP)
                .map_err(|e| ConfigError(format!("cannot read it: {e}")))?;
            // A DeepSpeed file by its name, or by its content where the
            // name says nothing (`ds_config` with no extension): no TOML
            // document starts with `{`.
            if p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("json"))
                || text.trim_start().starts_with('{')
            {
                (table, ds, autos) =
                    deepspeed::translate(&text, &p.display().to_string(), &mut warnings)?;
            } else {
                table = text
                    .parse::<toml::Table>()
                    .map_err(|e| ConfigError(format!("{}: {e}", p.display())))?;
            }
        }
        for o in overrides {
            merge::apply_override(&mut table, o)?;
        }
        let derive = batch::Derive::from_table(&table);
        let data_path_given = table.get("data").and_then(|t| t.get("path")).is_some();
        let recompute_given = table
            .get("train")
            .and_then(|t| t.get("activation_checkpointing"))
            .is_some();
        let optim_given: Vec<String> = table
            .get("optim")
            .and_then(|t| t.as_table())
            .map_or_else(Vec::new, |t| t.keys().cloned().collect());
        // The preset (and architecture) is read first so that explicit model
        // keys win over it.
        let given = table.get("model").and_then(|m| m.as_table());
        let base = TrainConfig {
            model: schema.section_for(given)?,
            ..TrainConfig::default()
        };
        let mut merged = toml::Table::try_from(&base).map_err(|e| ConfigError(e.to_string()))?;
        merge::merge(&mut merged, table, "")?;
        // serde_path_to_error names the key of a value of the wrong type or
        // range (`monitor.prometheus_port: invalid value 65536…`).
        let mut cfg: TrainConfig = serde_path_to_error::deserialize(toml::Value::Table(merged))
            .map_err(|e| ConfigError(format!("{}: {}", e.path(), e.inner().message())))?;
        if data_path_given && !cfg.data.sources.is_empty() {
            // Also where it names the default, which validate cannot tell
            // from no `data.path` at all.
            return Err(cfg.data.path_and_sources());
        }
        cfg.derive = derive;
        cfg.ds_auto = autos;
        cfg.model_facts = schema.check(&cfg.model)?;
        if !recompute_given {
            ds.apply_recompute(&mut cfg, &mut warnings);
        }
        ds.check_length(&cfg, &mut warnings);
        ds.apply_lr_ratios(&mut cfg, |k| optim_given.iter().any(|g| g == k));
        cfg.validate()?;
        cfg.resolve_batch_from_env()?;
        Ok((cfg, warnings))
    }
}
