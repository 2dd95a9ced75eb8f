//! Distributed checkpoints to and from Hugging Face files (what PyTorch's
//! `dcp_to_torch_save` / DeepSpeed's `zero_to_fp32` do), for every family:
//! the recorded `model.arch` picks the family, hence the model's engine and
//! HF layout.
//!
//! - [`export`]: the whole model of a checkpoint saved by any layout (DDP,
//!   ZeRO shards, tensor or pipeline parallel), gathered into a one-rank
//!   engine and written in the family's HF layout. The model's shape comes
//!   from the run config the checkpoint records.
//! - [`import`]: an HF file as a checkpoint of step 0 holding parameters
//!   only: a run resuming from it starts its optimizer fresh.
//!
//! ```no_run
//! use phalanx_models::dcp;
//! use std::path::Path;
//! let dir = phalanx::checkpoint::find(Path::new("runs/checkpoints")).unwrap();
//! let reader = phalanx::checkpoint::Reader::open(&dir).unwrap();
//! dcp::export(&reader, Path::new("model.safetensors")).unwrap();
//! let cfg = dcp::config_of(&reader.meta).unwrap();
//! dcp::import(&cfg, Path::new("model.safetensors"), Path::new("imported")).unwrap();
//! ```

use crate::{family, train};
use phalanx::checkpoint::write::{self, Header, Snapshot};
use phalanx::checkpoint::{Metadata, Reader, SavedLayout, Whole};
use phalanx::config::TrainConfig;
use phalanx::engine::Engine;
use phalanx::strategy::state::StateRange;
use phalanx::{Error, Result};
use std::path::{Path, PathBuf};

/// What [`import`] records as the saving strategy.
pub const IMPORTED: &str = "imported from Hugging Face";

/// The model part of the run config a checkpoint records (its `model`
/// section and `data.tokenizer`), as `section.key=value` overrides.
pub fn model_overrides(meta: &Metadata) -> Result<Vec<String>> {
    overrides_of(&meta.config)
}

/// [`model_overrides`] of a saved config's TOML.
fn overrides_of(config: &str) -> Result<Vec<String>> {
    let table: toml::Table = config
        .parse()
        .map_err(|e| Error::Check(format!("the checkpoint's config does not parse: {e}")))?;
    let model = table
        .get("model")
        .and_then(|m| m.as_table())
        .ok_or_else(|| Error::Check("the checkpoint's config has no [model] section".into()))?;
    // Llama 3's scaling parameters a run without that scaling carried
    // (ignored by it, refused now): its model is the one without them.
    let unscaled = model
        .get("rope_scaling")
        .and_then(|v| v.as_str())
        .is_none_or(|s| s == "none");
    let ignored = |k: &str| {
        unscaled
            && matches!(
                k,
                "rope_factor"
                    | "rope_low_freq_factor"
                    | "rope_high_freq_factor"
                    | "rope_original_max_position"
            )
    };
    let mut out: Vec<String> = model
        .iter()
        .filter(|(k, _)| !ignored(k))
        .map(|(k, v)| format!("model.{k}={v}"))
        .collect();
    if let Some(t) = table
        .get("data")
        .and_then(|d| d.get("tokenizer"))
        .and_then(|t| t.as_str())
    {
        out.push(format!("data.tokenizer={}", toml::Value::from(t)));
    }
    Ok(out)
}

/// A config for the model a checkpoint holds (its recorded model section,
/// everything else default).
pub fn config_of(meta: &Metadata) -> Result<TrainConfig> {
    let sets = model_overrides(meta)?;
    family::build(None, &sets)
        .map_err(|e| Error::Check(format!("the checkpoint's model config: {e}")))
}

/// The whole model of a checkpoint of any layout, in a one-rank (fp32)
/// engine built for `cfg`. A checkpoint of another model is refused naming
/// the first tensor that differs.
pub fn gather(reader: &Reader, cfg: &TrainConfig) -> Result<Engine> {
    let bytes = reader.meta.files.iter().map(|f| f.bytes).sum();
    crate::common::backed::check(cfg, bytes, 4, &reader.dir().display().to_string())?;
    let mut engine = train::build_engine(cfg)?;
    let layout = engine.layout().clone();
    reader.check_model(&layout, &Whole)?;
    let n = engine.num_params();
    let values = reader
        .fill(&layout, &Whole, 0..n, "param")?
        .ok_or_else(|| {
            Error::Check(format!(
                "checkpoint {} holds no parameters",
                reader.dir().display()
            ))
        })?;
    engine.params_flat_mut().copy_from_slice(&values);
    Ok(engine)
}

/// Write the checkpoint's model in its family's HF layout (GPT-2: one
/// safetensors file, Conv1D weights transposed; Llama, Qwen2: a directory
/// or a file), `config.json` beside it, atomically. Returns the config it
/// was built with.
pub fn export(reader: &Reader, out: &Path) -> Result<TrainConfig> {
    let cfg = config_of(&reader.meta)?;
    let engine = gather(reader, &cfg)?;
    train::save(&train::named_params(&engine)?, &cfg, out)?;
    Ok(cfg)
}

/// Write the HF file `input` (the model `cfg` describes) as a checkpoint of
/// step 0 under `root` holding parameters only, and point `root/latest` at
/// it. Other checkpoints under `root` are kept. Returns its directory.
pub fn import(cfg: &TrainConfig, input: &Path, root: &Path) -> Result<PathBuf> {
    crate::common::backed::check_hf(cfg, input)?;
    let mut engine = train::build_engine(cfg)?;
    family::of(cfg)?
        .load_hf(&mut engine, cfg, input)
        .map_err(|e| Error::Check(format!("{}: {e}", input.display())))?;
    let layout = engine.layout().clone();
    let state = StateRange {
        range: 0..engine.num_params(),
        params: engine.params_flat().to_vec(),
        optim: Vec::new(),
        optim_kind: "none",
        optim_step: 0,
        group: None,
    };
    let snap = Snapshot::new(&layout, &Whole, &[state]).without_optimizer();
    let header = Header {
        step: 0,
        layout: SavedLayout {
            world: 1,
            dp: 1,
            pp: 1,
            tp: 1,
            zero_stage: 0,
            strategy: IMPORTED.into(),
        },
        precision: cfg.precision().to_string(),
        loss_scaler: phalanx::trainer::loss_scaler(cfg),
        global_batch: cfg.global_batch(1),
        samples_consumed: 0,
        data: None,
        config: cfg.to_toml(),
        job: None,
    };
    let root = root.to_path_buf();
    // `save` is collective: run it over a group of one.
    let mut results = phalanx_comm::threads::run_with(
        1,
        phalanx_comm::Config::from_env(),
        std::time::Duration::from_secs(24 * 3600),
        move |pg| Ok(write::save(&pg, &root, &snap, &header, usize::MAX)),
    );
    results.pop().expect("one rank")?
}

#[cfg(test)]
mod tests {
    #[test]
    fn scaling_keys_a_run_without_scaling_ignored_are_left_out() {
        let saved = "[model]\narch = \"llama\"\nrope_scaling = \"none\"\nrope_factor = 32.0\nrope_theta = 10000.0\n";
        let sets = super::overrides_of(saved).unwrap();
        assert!(
            sets.iter().all(|s| !s.starts_with("model.rope_factor")),
            "{sets:?}"
        );
        assert!(
            sets.iter().any(|s| s.starts_with("model.rope_theta")),
            "{sets:?}"
        );
        let scaled = saved.replace("\"none\"", "\"llama3\"");
        let sets = super::overrides_of(&scaled).unwrap();
        assert!(
            sets.iter().any(|s| s.starts_with("model.rope_factor")),
            "{sets:?}"
        );
    }
}
