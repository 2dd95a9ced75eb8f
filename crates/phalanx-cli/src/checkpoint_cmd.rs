//! `phalanx checkpoint`: look into, convert and import distributed
//! checkpoints (PyTorch DCP's `format_utils`, DeepSpeed's `zero_to_fp32`).
//!
//! - `inspect PATH`: what a checkpoint holds and whether it is whole: every
//!   file present with its size, every tensor's state fully covered, every
//!   checksum right (exit 1 naming the file otherwise); `--json` for tools.
//! - `convert PATH OUT`: the model of a checkpoint of any layout in its
//!   family's Hugging Face layout (the family and shape come from the run
//!   config the checkpoint records).
//! - `from-hf IN OUT_DIR`: HF weights (a file or a directory; their
//!   `config.json` picks the family and the shape) as a checkpoint of step
//!   0 holding parameters only, to `phalanx train --resume OUT_DIR`.

use clap::Subcommand;
use phalanx::checkpoint::{self, Metadata, Reader};
use phalanx::{Error, Result};
use phalanx_models::{dcp, family};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug, Clone)]
pub enum CheckpointCmd {
    /// Summarise a checkpoint (or the latest complete one in a directory)
    /// and verify it: files, sizes, coverage of every tensor, sha256.
    Inspect {
        /// A checkpoint (`step-N/`) or a directory of checkpoints.
        path: PathBuf,
        /// List every tensor with its shape.
        #[arg(long)]
        tensors: bool,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Gather a checkpoint's model (saved by any layout) into Hugging Face
    /// weights of its family (GPT-2: one safetensors file; Llama, Qwen2: a
    /// directory or a file), with config.json beside them.
    Convert {
        /// A checkpoint (`step-N/`) or a directory of checkpoints.
        path: PathBuf,
        /// The safetensors file (or, Llama and Qwen2, directory) to write.
        out: PathBuf,
        /// Replace OUT if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Turn Hugging Face weights into a checkpoint of step 0 with
    /// parameters only (a run resuming from it starts its optimizer fresh).
    #[command(name = "from-hf")]
    FromHf {
        /// The HF weights (a file, an index or a directory). `config.json`
        /// beside them, if present, gives the family and the model's shape
        /// (--config / --set keys that disagree with it are errors);
        /// otherwise --config / --set do.
        input: PathBuf,
        /// The checkpoint directory to write `step-00000000/` and `latest` in.
        out_dir: PathBuf,
        /// A training config (TOML, or a DeepSpeed .json) for the model.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one key, e.g. `--set model.n_layer=2` (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        /// Write even if OUT_DIR already holds checkpoints (they are kept;
        /// `latest` then names the imported one).
        #[arg(long)]
        force: bool,
    },
}

pub fn main(cmd: &CheckpointCmd) -> i32 {
    let (name, res) = match cmd {
        CheckpointCmd::Inspect {
            path,
            tensors,
            json,
        } => ("inspect", inspect(path, *tensors, *json)),
        CheckpointCmd::Convert { path, out, force } => ("convert", convert(path, out, *force)),
        CheckpointCmd::FromHf {
            input,
            out_dir,
            config,
            set,
            force,
        } => (
            "from-hf",
            from_hf(input, out_dir, config.as_deref(), set, *force),
        ),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("phalanx checkpoint {name}: error: {e}");
            1
        }
    }
}

/// The checkpoint `path` names (itself, or the latest complete one in it).
fn locate(path: &Path) -> Result<PathBuf> {
    checkpoint::find(path)
}

use crate::outputs::resolve as resolved;

/// How much of every tensor the entries of each kind cover: (kind, the
/// tensors it does not fully cover: name, values covered, values in it).
type Coverage = Vec<(String, Vec<(String, usize, usize)>)>;

fn coverage(meta: &Metadata) -> Coverage {
    let mut runs: BTreeMap<(&str, &str), Vec<(usize, usize)>> = BTreeMap::new();
    for e in &meta.entries {
        let v = runs
            .entry((e.kind.as_str(), e.tensor.as_str()))
            .or_default();
        v.extend(e.region.runs().into_iter().map(|(g, _, n)| (g, g + n)));
    }
    let kinds: std::collections::BTreeSet<&str> =
        meta.entries.iter().map(|e| e.kind.as_str()).collect();
    let mut out = Vec::new();
    for kind in kinds {
        let mut missing = Vec::new();
        for (name, shape) in &meta.tensors {
            let total: usize = shape.iter().product();
            let mut v = runs.remove(&(kind, name.as_str())).unwrap_or_default();
            v.sort_unstable();
            // The union of the runs, clipped to the tensor.
            let (mut covered, mut end) = (0usize, 0usize);
            for (a, b) in v {
                let (a, b) = (a.max(end), b.min(total));
                if b > a {
                    covered += b - a;
                    end = b;
                }
            }
            if covered != total {
                missing.push((name.clone(), covered, total));
            }
        }
        out.push((kind.to_string(), missing));
    }
    // Parameters first, then the optimizer's buffers.
    out.sort_by_key(|(k, _)| (k != "param", k.clone()));
    out
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

fn inspect(path: &Path, list_tensors: bool, as_json: bool) -> Result<i32> {
    let dir = locate(path)?;
    let mp = dir.join("metadata.json");
    let text = phalanx::fsutil::read_text_capped(
        "checkpoint metadata",
        &mp,
        phalanx::fsutil::METADATA_CAP,
    )
    .map_err(Error::Check)?;
    let meta = Metadata::parse_fields(&text)
        .map_err(|e| Error::Check(format!("{}: {e}", dir.display())))?;

    // Files as the metadata lists them, against what is on disk.
    let on_disk: Vec<Option<u64>> = meta
        .files
        .iter()
        .map(|f| std::fs::metadata(dir.join(&f.name)).ok().map(|m| m.len()))
        .collect();
    // Coverage walks every row the entries span, which only files of the
    // sizes the metadata claims bound: with a size wrong (reported below)
    // the kinds are listed, their coverage not computed.
    let sizes_ok = meta
        .files
        .iter()
        .zip(&on_disk)
        .all(|(f, d)| *d == Some(f.bytes));
    let cover = if sizes_ok {
        coverage(&meta)
    } else {
        let kinds: std::collections::BTreeSet<&str> =
            meta.entries.iter().map(|e| e.kind.as_str()).collect();
        kinds
            .into_iter()
            .map(|k| (k.to_string(), Vec::new()))
            .collect()
    };
    let incomplete: Vec<String> = cover
        .iter()
        .flat_map(|(kind, miss)| {
            miss.iter()
                .map(move |(t, got, n)| format!("{kind} of `{t}` covers {got} of its {n} values"))
        })
        .collect();
    let params: usize = meta
        .tensors
        .values()
        .map(|s| s.iter().product::<usize>())
        .sum();
    // The loader's own checks: sizes (open), then every file's sha256.
    let mut problems: Vec<String> = Vec::new();
    // Per file: whether its sha256 matches (None: not checked, as when a
    // file is missing or has the wrong size).
    let mut sha_ok: Vec<Option<bool>> = vec![None; meta.files.len()];
    match Reader::open(&dir) {
        Ok(r) => {
            for (i, good) in sha_ok.iter_mut().enumerate() {
                let res = r.verify(i);
                *good = Some(res.is_ok());
                if let Err(e) = res {
                    problems.push(e.to_string());
                }
            }
        }
        Err(e) => {
            problems.push(e.to_string());
            // The files of the right size are checked all the same: one
            // of them corrupt too must not look sound beside the one named.
            for (i, good) in sha_ok.iter_mut().enumerate() {
                let f = &meta.files[i];
                if on_disk[i] == Some(f.bytes) {
                    let p = dir.join(&f.name);
                    match phalanx::checkpoint::read::sha_matches(&dir, f) {
                        Ok(same) => {
                            *good = Some(same);
                            if !same {
                                problems.push(format!(
                                    "checkpoint file {} is corrupt: its sha256 differs from the \
                                     metadata's",
                                    p.display()
                                ));
                            }
                        }
                        Err(e) => problems.push(format!("cannot read {}: {e}", p.display())),
                    }
                }
            }
        }
    }
    let verified = problems.is_empty();
    let has_params = cover.iter().any(|(k, _)| k == "param");
    if !has_params {
        problems.push("it holds no parameters".into());
    }
    problems.extend(incomplete.iter().cloned());
    let cfg_of = dcp::config_of(&meta).ok();
    // The model config is covered by no sha256: one that contradicts the
    // tensors would load as another model (convert and generate refuse it).
    let described = cfg_of
        .as_ref()
        .and_then(|c| family::of(c).ok()?.summary(c).ok())
        .map(|s| s.num_params);
    if let Some(n) = described.filter(|&n| n != params) {
        problems.push(format!(
            "the metadata's model config describes {n} parameters, its tensors hold {params}: \
             the config does not match the tensors"
        ));
    }
    let ok = problems.is_empty();
    let model = cfg_of
        .as_ref()
        .map(|c| serde_json::to_value(&c.model).expect("serialises"));
    let model_line = cfg_of.as_ref().and_then(|c| describe(c).ok());
    let total_bytes: u64 = meta.files.iter().map(|f| f.bytes).sum();

    if as_json {
        let files: Vec<serde_json::Value> = meta
            .files
            .iter()
            .zip(&on_disk)
            .zip(&sha_ok)
            .map(|((f, d), good)| {
                json!({"name": f.name, "bytes": f.bytes, "on_disk": d, "sha256": f.sha256, "sha256_ok": good})
            })
            .collect();
        let summary = json!({
            "path": dir,
            "format": meta.format,
            "step": meta.step,
            "layout": meta.layout,
            "precision": meta.precision,
            "optimizer": meta.optimizer.as_ref().map(|(k, s)| json!({"kind": k, "steps": s})),
            "loss_scale": meta.loss_scaler.scale(),
            "samples_consumed": meta.samples_consumed,
            "global_batch": meta.global_batch,
            "model": model,
            "num_tensors": meta.tensors.len(),
            "parameters": params,
            "tensors": meta.tensors,
            "state": cover.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            "files": files,
            "bytes": total_bytes,
            // Coverage is computed only when the files' sizes agree.
            "complete": sizes_ok && incomplete.is_empty() && has_params,
            "verified": verified,
            "ok": ok,
            "problems": problems,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).expect("serialises")
        );
        return Ok(if ok { 0 } else { 1 });
    }

    let l = &meta.layout;
    println!("checkpoint {}", dir.display());
    println!(
        "  step             {} ({} samples consumed, global batch {})",
        meta.step, meta.samples_consumed, meta.global_batch
    );
    println!(
        "  saved by         {} on {} rank(s): dp {} x pp {} x tp {}, ZeRO stage {}",
        l.strategy, l.world, l.dp, l.pp, l.tp, l.zero_stage
    );
    println!(
        "  precision        {}, loss scale {}",
        meta.precision,
        meta.loss_scaler.scale()
    );
    match &meta.optimizer {
        Some((k, s)) => println!("  optimizer        {k}, {s} step(s) applied"),
        None => println!("  optimizer        none saved (a run loading it starts fresh)"),
    }
    if let Some(m) = &model_line {
        println!("  model            {m}");
    }
    println!(
        "  tensors          {} ({params} parameters)",
        meta.tensors.len()
    );
    if list_tensors {
        let w = meta.tensors.keys().map(|k| k.len()).max().unwrap_or(0);
        for (name, shape) in &meta.tensors {
            println!("    {name:<w$}  {shape:?}");
        }
    }
    println!(
        "  state            {}",
        cover
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  files            {} ({})",
        meta.files.len(),
        human(total_bytes)
    );
    for ((f, d), good) in meta.files.iter().zip(&on_disk).zip(&sha_ok) {
        let status = match d {
            None => "  MISSING".to_string(),
            Some(n) if *n != f.bytes => format!("  WRONG SIZE: {n} bytes on disk"),
            Some(_) if *good == Some(false) => "  CORRUPT: sha256 differs".to_string(),
            Some(_) => String::new(),
        };
        println!("    {}  {} bytes{status}", f.name, f.bytes);
    }
    if ok {
        println!(
            "  verified         complete: every tensor's state fully covered, every file's size and sha256 match"
        );
        Ok(0)
    } else {
        println!("  verified         NO");
        for p in &problems {
            eprintln!("phalanx checkpoint inspect: error: {p}");
        }
        Ok(1)
    }
}

fn convert(path: &Path, out: &Path, force: bool) -> Result<i32> {
    let dir = locate(path)?;
    let out_r = resolved(out);
    // The checkpoint, the directory given, and the directory of checkpoints
    // the checkpoint sits in.
    let root = dir.parent().map(resolved);
    for inside in [resolved(path), resolved(&dir)].into_iter().chain(root) {
        if out_r.starts_with(&inside) {
            eprintln!(
                "phalanx checkpoint convert: {} is inside the checkpoint directory {}; write it elsewhere",
                out.display(),
                inside.display()
            );
            return Ok(2);
        }
    }
    let reader = Reader::open(&dir)?;
    // What will be written (the weights, config.json beside them) against
    // the checkpoint read (a link into it included), and another model's
    // config.json in the way.
    let model = dcp::config_of(&reader.meta)?;
    let weights = family::of(&model)?.hf_weights_file(out);
    if weights.is_dir() {
        eprintln!(
            "phalanx checkpoint convert: {} is a directory; this model is written as one file \
             (name a .safetensors file in it)",
            out.display()
        );
        return Ok(2);
    }
    // An existing OUT (a file, or a directory holding a model: one file,
    // or an index and its shards) is replaced only with --force.
    if out.exists() && !force {
        eprintln!(
            "phalanx checkpoint convert: {} exists (--force replaces it)",
            out.display()
        );
        return Ok(2);
    }
    let hdir = phalanx_models::common::hf::model_dir(&weights);
    let mut io = crate::outputs::Io::new();
    io.output("OUT", &weights)
        .output("OUT's config.json", &hdir.join("config.json"))
        .checkpoint_input("checkpoint PATH", &dir);
    let tok = model.data.tokenizer.json_path();
    if let Err(m) = io
        .check()
        .and_then(|()| crate::hf_out::check_dir(&hdir, &model, tok, "OUT", force))
    {
        eprintln!("phalanx checkpoint convert: {m}");
        return Ok(2);
    }
    reader.verify_all()?;
    let cfg = dcp::export(&reader, out)?;
    println!(
        "wrote {} (Hugging Face {}; config.json beside it) from {} (step {})",
        out.display(),
        describe(&cfg)?,
        dir.display(),
        reader.meta.step
    );
    Ok(0)
}

fn from_hf(
    input: &Path,
    out_dir: &Path,
    config: Option<&Path>,
    set: &[String],
    force: bool,
) -> Result<i32> {
    // (HF weights may be a directory or a sharded index.)
    if !input.exists() {
        return Err(Error::Check(format!("{}: no such file", input.display())));
    }
    let held: Vec<String> = std::fs::read_dir(out_dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step-"))
                .collect()
        })
        .unwrap_or_default();
    if !held.is_empty() && !force {
        eprintln!(
            "phalanx checkpoint from-hf: {} already holds checkpoints ({}); choose another directory or pass --force",
            out_dir.display(),
            held.join(", ")
        );
        return Ok(2);
    }
    // OUT_DIR is neither the model read nor in its directory (a checkpoint
    // there would be what `generate --model DIR` loads, not the weights),
    // nor inside a checkpoint.
    let mut io = crate::outputs::Io::new();
    io.input("INPUT", input)
        .checkpoint_output("OUT_DIR", out_dir);
    let resolved = crate::outputs::resolve(out_dir);
    let model_dir = phalanx_models::common::hf::model_dir(input);
    let beside = (resolved == crate::outputs::resolve(&model_dir)).then(|| {
        format!(
            "OUT_DIR {} is INPUT's directory: `generate --model` there would load the \
             checkpoint, not the weights; give a directory of its own",
            out_dir.display()
        )
    });
    // (A checkpoint's metadata, not any file of that common name.)
    let is_checkpoint = |d: &Path| checkpoint::rotate::metadata_fields(d).is_some();
    let inside_checkpoint = resolved.ancestors().find(|a| is_checkpoint(a)).map(|c| {
        let how = if c == resolved { "is" } else { "is inside" };
        format!(
            "OUT_DIR {} {how} the checkpoint {}: give a directory of its own",
            out_dir.display(),
            c.display()
        )
    });
    let refused = io.check().err().or(beside).or(inside_checkpoint);
    if let Some(m) = refused {
        eprintln!("phalanx checkpoint from-hf: {m}");
        return Ok(2);
    }
    // The config first: a mistake there leaves nothing behind.
    let mut sets = crate::generate::default_tokenizer_sets(input, config, set)?;
    sets.extend(set.iter().cloned());
    let (cfg, _) = family::build_for_hf(config, &sets, input)?;
    // No run may be writing OUT_DIR meanwhile (see checkpoint::lock).
    let made = !out_dir.exists();
    checkpoint::lock::lock(out_dir, "OUT_DIR")?;
    let dir = match dcp::import(&cfg, input, out_dir) {
        Ok(d) => d,
        Err(e) => {
            // A directory made here for nothing goes again (the lock file
            // is all it holds: the import writes whole or not at all).
            let only_lock = |d: &Path| {
                std::fs::read_dir(d).is_ok_and(|rd| {
                    rd.flatten()
                        .all(|e| e.file_name() == checkpoint::lock::LOCK_FILE)
                })
            };
            if made && only_lock(out_dir) {
                let _ = std::fs::remove_file(out_dir.join(checkpoint::lock::LOCK_FILE));
                let _ = std::fs::remove_dir(out_dir);
            }
            return Err(e);
        }
    };
    println!(
        "wrote {} (step 0, {}, no optimizer state: a run resuming from it starts its optimizer fresh); \
         continue with `phalanx train --resume {}`",
        dir.display(),
        describe(&cfg)?,
        out_dir.display()
    );
    Ok(0)
}

/// One line naming the model of a config (any family).
fn describe(cfg: &phalanx::config::TrainConfig) -> Result<String> {
    Ok(family::of(cfg)?.summary(cfg)?.line())
}
