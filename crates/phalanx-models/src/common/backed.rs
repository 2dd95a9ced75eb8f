//! A model's size, as its config says, checked against the files that
//! hold its weights before anything is allocated (issue 27, item 10): a
//! `config.json` or a checkpoint's config with a huge shape is refused
//! with an error naming both sizes, instead of aborting on a failed
//! allocation of terabytes.
//!
//! ```
//! let cfg = phalanx_models::family::build(None, &[]).unwrap();
//! // The default model does not fit in 1 KB of weights.
//! let e = phalanx_models::common::backed::check(&cfg, 1024, 2, "w.safetensors").unwrap_err();
//! assert!(e.to_string().contains("w.safetensors"), "{e}");
//! ```

use crate::family;
use phalanx::config::TrainConfig;
use phalanx::{Error, Result};
use std::path::Path;

/// That the model `cfg` describes can be held in `bytes` of weights stored
/// with at least `bytes_per_param` bytes each (2 for Hugging Face files,
/// which may be bf16; 4 for Phalanx checkpoints); `what` names the files.
pub fn check(cfg: &TrainConfig, bytes: u64, bytes_per_param: u64, what: &str) -> Result<()> {
    let s = family::of(cfg)?.summary(cfg)?;
    let need = (s.num_params as u64).saturating_mul(bytes_per_param);
    if need > bytes {
        return Err(Error::Check(format!(
            "{what}: the model config ({}) needs at least {need} bytes of weights, but the files \
             hold {bytes} bytes: the config does not describe these weights (refused before \
             allocating the model)",
            s.line()
        )));
    }
    Ok(())
}

/// The bytes of the safetensors files of a Hugging Face model given as a
/// file, an index or a directory.
pub fn hf_bytes(path: &Path) -> Result<u64> {
    let (files, _) = super::hf::resolve(path)?;
    let mut total = 0u64;
    for f in files {
        let m = std::fs::metadata(&f).map_err(|e| Error::Check(format!("{}: {e}", f.display())))?;
        total = total.saturating_add(m.len());
    }
    Ok(total)
}

/// [`check`] for a Hugging Face model at `path`.
pub fn check_hf(cfg: &TrainConfig, path: &Path) -> Result<()> {
    check(cfg, hf_bytes(path)?, 2, &path.display().to_string())
}
