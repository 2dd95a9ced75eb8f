//! Hugging Face checkpoint files, whatever the family: finding the
//! safetensors of a checkpoint given as a file, an index or a directory,
//! its `config.json`, and writing tensors in HF's layout (one
//! `model.safetensors`, or shards with `model.safetensors.index.json` as
//! `save_pretrained` does past its shard size).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{bail, Result, Tensor};
use serde_json::{json, Value};

/// An engine's parameters by name, as CPU f32 tensors (engine names and
/// orientation: Llama's and Qwen2's are HF's).
pub fn engine_tensors(engine: &phalanx::engine::Engine) -> Result<HashMap<String, Tensor>> {
    engine
        .layout()
        .params()
        .iter()
        .map(|p| Ok((p.name.clone(), engine.param_tensor(&p.name)?)))
        .collect()
}

/// Every parameter of the engine, in layout order: its name, its shape,
/// and whether the engine holds any of it (a pipeline stage holds only its
/// blocks'; a load reads only those, and checks the others by shape).
pub fn params_held(engine: &phalanx::engine::Engine) -> Vec<(String, Vec<usize>, bool)> {
    let held = engine.held().map(|h| h.to_vec());
    engine
        .layout()
        .params()
        .iter()
        .map(|p| {
            let r = p.range();
            let needed = held
                .as_ref()
                .is_none_or(|h| h.iter().any(|k| k.start < r.end && r.start < k.end));
            (p.name.clone(), p.shape.clone(), needed)
        })
        .collect()
}

/// The index file of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";
/// The single-file checkpoint.
pub const SINGLE: &str = "model.safetensors";
/// HF's default `max_shard_size` (5 GB).
pub const DEFAULT_SHARD_BYTES: usize = 5_000_000_000;

fn msg(p: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", p.display()))
}

/// The safetensors files of a checkpoint given as a file, an index or a
/// directory, and the directory (where `config.json` would be).
pub fn resolve(path: &Path) -> Result<(Vec<PathBuf>, PathBuf)> {
    let (index, single) = if path.is_dir() {
        (path.join(INDEX), path.join(SINGLE))
    } else if path.to_string_lossy().ends_with(".json") {
        (path.to_path_buf(), PathBuf::new())
    } else {
        return Ok((vec![path.to_path_buf()], model_dir(path)));
    };
    let dir = index.parent().unwrap_or(Path::new(".")).to_path_buf();
    // A directory holding both is read as transformers reads it:
    // `model.safetensors` first.
    if path.is_dir() && single.is_file() {
        return Ok((vec![single], dir));
    }
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| msg(&index, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| msg(&index, e))?;
        let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
            bail!("{}: no `weight_map` object", index.display())
        };
        let mut files: Vec<String> = map
            .values()
            .map(|f| f.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| msg(&index, "weight_map values must be file names"))?;
        files.sort();
        files.dedup();
        let mut out = Vec::new();
        for f in files {
            if f.contains('/') || f.contains("..") {
                bail!(
                    "{}: shard name {f:?} must be a file beside the index",
                    index.display()
                )
            }
            out.push(dir.join(f));
        }
        return Ok((out, dir));
    }
    if single.is_file() {
        return Ok((vec![single], dir));
    }
    if ["pytorch_model.bin", "pytorch_model.bin.index.json"]
        .iter()
        .any(|b| dir.join(b).is_file())
    {
        bail!(
            "{}: neither {INDEX} nor {SINGLE} found, only PyTorch pickles (pytorch_model.bin), \
             which Phalanx does not read; convert them with transformers \
             (`from_pretrained(...).save_pretrained(DIR, safe_serialization=True)`)",
            path.display()
        )
    }
    bail!("{}: neither {INDEX} nor {SINGLE} found", path.display())
}

/// The header metadata transformers writes and reads (`{"format": "pt"}`;
/// its versions before 4.48.2 fail on a file without metadata).
pub fn pt_metadata() -> Option<HashMap<String, String>> {
    Some(HashMap::from([("format".to_string(), "pt".to_string())]))
}

/// The directory a model path's `config.json` (and `tokenizer.json`) sit
/// in: the path itself if it is a directory, else the one holding it.
pub fn model_dir(path: &Path) -> PathBuf {
    if path.is_dir() {
        return path.to_path_buf();
    }
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `config.json` of a checkpoint directory, if there is one.
pub fn read_config(dir: &Path) -> Result<Option<Value>> {
    let p = dir.join("config.json");
    if !p.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&p).map_err(|e| msg(&p, e))?;
    let v = serde_json::from_str(&text).map_err(|e| msg(&p, e))?;
    Ok(Some(v))
}

/// Write HF tensors in HF layout under `path`: a directory (created) that
/// gets `model.safetensors` (or shards + index past `max_shard_bytes`) and
/// `config.json`; a path ending in `.safetensors` is that file, with
/// `config.json` beside it (never sharded). Files are written atomically.
/// Returns the files written.
pub fn save(
    tensors: &HashMap<String, Tensor>,
    config_json: &Value,
    path: &Path,
    max_shard_bytes: usize,
) -> Result<Vec<PathBuf>> {
    let single_file = path.to_string_lossy().ends_with(".safetensors");
    let dir = if single_file {
        path.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    } else {
        path.to_path_buf()
    };
    std::fs::create_dir_all(&dir).map_err(|e| msg(&dir, e))?;
    // Sorted by name, then cut into shards by size (every shard non-empty).
    let mut sorted: Vec<(&String, &Tensor)> = tensors.iter().collect();
    sorted.sort_by_key(|(n, _)| *n);
    let mut shards: Vec<Vec<(&String, &Tensor)>> = vec![vec![]];
    let mut size = 0;
    for (n, t) in sorted {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        let cur = shards.last_mut().expect("one shard");
        if !single_file && !cur.is_empty() && size + bytes > max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += bytes;
        shards.last_mut().expect("one shard").push((n, t));
    }
    let write = |p: &Path, items: &[(&String, &Tensor)]| -> Result<()> {
        let bytes =
            safetensors::serialize(items.iter().copied(), pt_metadata()).map_err(|e| msg(p, e))?;
        phalanx::fsutil::write_atomic(p, &bytes).map_err(|e| msg(p, e))
    };
    // What a save to this directory left before: removed once the new
    // files are in place (a directory keeps one layout: a stale index
    // would win over a new model.safetensors when loading). Never first:
    // a kill or a full disk midway must leave a loadable model.
    // A single file written as the directory's `model.safetensors` goes
    // the same way (its index would otherwise still win in the directory;
    // an index there that does not parse is left as it is). A file of
    // another name is not the directory's model: what is there stays.
    let mut before = if !single_file {
        previous(&dir)?
    } else if path.file_name().is_some_and(|n| n == SINGLE) {
        previous(&dir).unwrap_or_default()
    } else {
        Vec::new()
    };
    // Shards are named by their count (`model-00001-of-00002`): where this
    // save replaces a shard the old index names, that index goes first, so
    // that a failure midway leaves no index naming old and new shards
    // together (a model that loads, and is neither).
    let index = dir.join(INDEX);
    if shards.len() > 1 && before.contains(&index) {
        let n = shards.len();
        let collides = (1..=n)
            .map(|k| dir.join(format!("model-{k:05}-of-{n:05}.safetensors")))
            .any(|p| before.contains(&p));
        if collides {
            std::fs::remove_file(&index).map_err(|e| msg(&index, e))?;
            before.retain(|p| p != &index);
        }
    }
    let mut written = Vec::new();
    let wrote = (|| -> Result<()> {
        if shards.len() == 1 {
            let p = if single_file {
                path.to_path_buf()
            } else {
                dir.join(SINGLE)
            };
            write(&p, &shards[0])?;
            written.push(p);
            return Ok(());
        }
        let n = shards.len();
        let mut map = BTreeMap::new();
        let mut total = 0;
        for (k, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            for (t, v) in shard {
                map.insert(t.to_string(), name.clone());
                total += v.elem_count() * v.dtype().size_in_bytes();
            }
            let p = dir.join(&name);
            write(&p, shard)?;
            written.push(p);
        }
        // The index last: until it is replaced, the old one names the old
        // model.
        let index = json!({ "metadata": { "total_size": total }, "weight_map": map });
        let p = dir.join(INDEX);
        phalanx::fsutil::write_atomic(&p, serde_json::to_string_pretty(&index).unwrap().as_bytes())
            .map_err(|e| msg(&p, e))?;
        written.push(p);
        Ok(())
    })();
    if let Err(e) = wrote {
        // No orphans: what this save added goes, what was there stays.
        for p in written.iter().filter(|p| !before.contains(p)) {
            let _ = std::fs::remove_file(p);
        }
        return Err(e);
    }
    for p in before.iter().filter(|p| !written.contains(p)) {
        match std::fs::remove_file(p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(msg(p, e)),
            _ => {}
        }
    }
    let p = dir.join("config.json");
    let text = serde_json::to_string_pretty(config_json).unwrap();
    phalanx::fsutil::write_atomic(&p, text.as_bytes()).map_err(|e| msg(&p, e))?;
    written.push(p);
    Ok(written)
}

/// The files of a model saved in `dir` before: `model.safetensors`, and
/// the index with the shards it names (nothing else in the directory).
fn previous(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if dir.join(INDEX).is_file() {
        out.extend(resolve(&dir.join(INDEX))?.0);
        out.push(dir.join(INDEX));
    }
    if dir.join(SINGLE).is_file() {
        out.push(dir.join(SINGLE));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_with_both_layouts_reads_the_single_file_as_transformers_does() {
        let d = std::env::temp_dir().join(format!("phalanx-hf-both-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let index = json!({"weight_map": {"w": "model-00001-of-00001.safetensors"}});
        std::fs::write(d.join(INDEX), index.to_string()).unwrap();
        let shard = d.join("model-00001-of-00001.safetensors");
        assert_eq!(resolve(&d).unwrap().0, vec![shard.clone()]);
        std::fs::write(d.join(SINGLE), b"").unwrap();
        assert_eq!(resolve(&d).unwrap().0, vec![d.join(SINGLE)]);
        // The index named itself is still the index.
        assert_eq!(resolve(&d.join(INDEX)).unwrap().0, vec![shard]);
        // Only PyTorch's pickles: named, with the way to convert them.
        for f in [INDEX, SINGLE] {
            std::fs::remove_file(d.join(f)).unwrap();
        }
        std::fs::write(d.join("pytorch_model.bin"), b"").unwrap();
        let e = resolve(&d).unwrap_err().to_string();
        assert!(
            e.contains("pytorch_model.bin") && e.contains("save_pretrained"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
