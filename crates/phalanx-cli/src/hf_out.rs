//! Writing Hugging Face files into a directory that may hold someone
//! else's: `--save-final` and `checkpoint convert` write `config.json`
//! (and, with a `tokenizer.json` tokenizer, `tokenizer.json`) beside the
//! weights. An existing `config.json` is replaced only when it describes
//! the model being written (same family and shape: a re-run, or an
//! earlier save of the same model); another model's `config.json`, one
//! that does not parse, or a `tokenizer.json` with no `config.json` of
//! ours beside it and other bytes than the one we copy, is refused naming
//! the file, unless `--force` is given.

use phalanx::config::TrainConfig;
use phalanx_models::family;
use std::path::Path;

/// The most of an existing `config.json` read to judge it (a real one is a
/// few KiB).
const CONFIG_CAP: u64 = 1 << 20;

/// The shape a summary compares by (the context is not fixed by every
/// family's weights, and the parameter count follows from it).
fn shape(s: &family::ModelSummary) -> impl PartialEq + std::fmt::Debug {
    (
        s.title,
        s.n_layer,
        s.n_head,
        s.n_kv_head,
        s.n_embd,
        s.mlp,
        s.vocab_size,
    )
}

/// What the `config.json` text describes, when it is a model of a family
/// this build reads: its summary.
fn described(text: &str) -> Result<family::ModelSummary, String> {
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let f = family::for_hf_config(&json).map_err(|e| e.0)?;
    let keys = f.hf_keys(&json).map_err(|e| e.to_string())?;
    let sets: Vec<String> = keys
        .iter()
        .map(|k| format!("model.{}={}", k.key, k.value))
        .collect();
    let cfg = family::build(None, &sets).map_err(|e| e.to_string())?;
    f.summary(&cfg).map_err(|e| e.to_string())
}

/// Check that writing the model of `cfg` into `dir` (as `flag` does)
/// replaces nothing that is not ours to replace (see the module docs);
/// `tokenizer`: the `tokenizer.json` that will be copied beside it.
pub fn check_dir(
    dir: &Path,
    cfg: &TrainConfig,
    tokenizer: Option<&Path>,
    flag: &str,
    force: bool,
) -> Result<(), String> {
    // The tokenizer is copied beside the weights last: a source that is
    // not there would fail the write after the weights (checked first,
    // even with --force).
    if let Some(src) = tokenizer {
        let src = phalanx_models::hf_tokenizer::json_path(src);
        if !src.is_file() {
            return Err(format!(
                "data.tokenizer {}: no such tokenizer.json, and it is saved beside the weights \
                 (a relative path is read from the current directory: run from where training \
                 ran)",
                src.display()
            ));
        }
    }
    if force {
        return Ok(());
    }
    let ours = family::of(cfg)
        .and_then(|f| {
            f.summary(cfg)
                .map_err(|e| phalanx::config::ConfigError(e.to_string()))
        })
        .map_err(|e| e.to_string())?;
    let cj = dir.join("config.json");
    if cj.exists() {
        let text = read_capped(&cj)?;
        return match described(&text) {
            Ok(s) if shape(&s) == shape(&ours) => Ok(()),
            Ok(s) => Err(format!(
                "{flag}: {} describes another model ({}: {}), not the one this writes ({}: {}); \
                 write elsewhere, or pass --force to replace it",
                cj.display(),
                s.title,
                s.shape(),
                ours.title,
                ours.shape()
            )),
            Err(e) => Err(format!(
                "{flag}: {} is not a config.json of a model Phalanx writes ({e}); write \
                 elsewhere, or pass --force to replace it",
                cj.display()
            )),
        };
    }
    let (Some(src), tj) = (tokenizer, dir.join("tokenizer.json")) else {
        return Ok(());
    };
    if tj.exists() {
        let src = phalanx_models::hf_tokenizer::json_path(src);
        let same = std::fs::read(&src).ok() == std::fs::read(&tj).ok();
        if !same {
            return Err(format!(
                "{flag}: {} exists, with no config.json of this model beside it, and differs \
                 from data.tokenizer {}; write elsewhere, or pass --force to replace it",
                tj.display(),
                src.display()
            ));
        }
    }
    Ok(())
}

fn read_capped(p: &Path) -> Result<String, String> {
    use std::io::Read;
    let f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let mut s = String::new();
    f.take(CONFIG_CAP + 1)
        .read_to_string(&mut s)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    if s.len() as u64 > CONFIG_CAP {
        return Err(format!(
            "{} is over {CONFIG_CAP} bytes: not a config.json Phalanx writes",
            p.display()
        ));
    }
    Ok(s)
}
