//! Distributed checkpoints, as PyTorch's DCP: every rank writes only what it
//! owns, in parallel, to one safetensors file; rank 0 writes one
//! `metadata.json` that names every global tensor (shape) and, for each
//! saved piece, its file, key and [`region::Region`] of the global tensor.
//! The layout that saved (dp, pp, tp, ZeRO stage) is recorded but a loader
//! does not need it: each rank of any layout reads, memory-mapped, only the
//! pieces that overlap what it owns.
//!
//! A checkpoint directory `step-00000042/` holds `metadata.json` and
//! `rank-00000.safetensors`, … It is written as `.tmp-step-00000042-<nonce>/`
//! and renamed into place once every rank's file is complete, fsynced and
//! hashed (sha256 in the metadata); the `latest` file beside the
//! checkpoints is replaced last. A run killed during a save leaves at most a
//! `.tmp-*` directory, never a checkpoint that looks complete (tests show
//! it with the `PHALANX_FAULT=exit-in-save:STEP` hook, see
//! [`crate::fault`]).
//!
//! Recovery: a worker group restarted by `phalanx run --max-restarts`
//! (`PHALANX_RESTART_COUNT` or `TORCHELASTIC_RESTART_COUNT` > 0) resumes
//! from the newest checkpoint that verifies ([`list`], checked by every
//! rank for its share of the files), skipping broken ones with a warning.
//!
//! ```no_run
//! # fn demo(trainer: &mut phalanx::trainer::Trainer) -> phalanx::Result<()> {
//! let dir = phalanx::checkpoint::find(std::path::Path::new("runs/checkpoints"))?;
//! # Ok(()) }
//! ```

pub mod lock;
pub mod read;
pub mod region;
pub mod rotate;
pub mod validate;
pub mod write;

pub use read::{find, find_latest_unverified, incomplete, list, Reader};
pub use write::Header;
pub use write::{AsyncWriter, Snapshot};

use crate::engine::{Layout, ParamInfo};
use region::Region;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of the on-disk format.
pub const FORMAT: &str = "phalanx-checkpoint/1";

/// Where a rank's local parameter sits in its global tensor: the global
/// shape, and the local tensor as a stack of row blocks, each a box of the
/// global tensor (`(local rows, global offsets of the block)`). Local rows
/// in no block (tensor-parallel padding) are not saved or loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    pub shape: Vec<usize>,
    pub blocks: Vec<(std::ops::Range<usize>, Vec<usize>)>,
}

impl Placed {
    /// A local parameter that is the whole global tensor.
    pub fn whole(shape: &[usize]) -> Placed {
        let rows = shape.first().copied().unwrap_or(1);
        Placed {
            shape: shape.to_vec(),
            blocks: vec![(0..rows, vec![0; shape.len()])],
        }
    }
}

/// How a layout's local parameters map to global tensors.
pub trait Placement: Send + Sync {
    fn place(&self, p: &ParamInfo) -> Placed;
}

/// Local parameters are whole global tensors (no tensor parallelism).
pub struct Whole;

impl Placement for Whole {
    fn place(&self, p: &ParamInfo) -> Placed {
        Placed::whole(&p.shape)
    }
}

/// The regions of global tensors that flat range `range` of `layout` covers:
/// (parameter index, region, positions in `range` it comes from).
pub fn regions_of(
    layout: &Layout,
    placement: &dyn Placement,
    range: &std::ops::Range<usize>,
) -> Vec<(usize, Region, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (k, p) in layout.params().iter().enumerate() {
        let pr = p.range();
        let (lo, hi) = (pr.start.max(range.start), pr.end.min(range.end));
        if lo >= hi {
            continue;
        }
        let placed = placement.place(p);
        // Elements per local row.
        let stride: usize = p.shape.iter().skip(1).product();
        for (rows, offsets) in placed.blocks {
            // The block's span of the flat buffer, cut to [lo, hi).
            let (bs, be) = (pr.start + rows.start * stride, pr.start + rows.end * stride);
            let (a, b) = (bs.max(lo), be.min(hi));
            if a >= b {
                continue;
            }
            let mut sizes = p.shape.clone();
            if let Some(s) = sizes.first_mut() {
                *s = rows.len();
            }
            out.push((
                k,
                Region {
                    shape: placed.shape.clone(),
                    offsets,
                    sizes,
                    flat: a - bs..b - bs,
                },
                a - range.start..b - range.start,
            ));
        }
    }
    out
}

/// One saved piece: `values` of `kind` ("param" or an optimizer buffer)
/// for `region` of tensor `tensor`, under `key` in file `file`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub file: usize,
    pub key: String,
    pub tensor: String,
    pub kind: String,
    pub region: Region,
}

/// State of one rank that belongs to no tensor and cannot be resharded (a
/// communication hook's error-feedback residuals, warm starts and
/// counters): `len` f32 values under `rank_state/{name}` in rank `rank`'s
/// file. Only the same rank of the same layout can load it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankEntry {
    pub rank: usize,
    pub name: String,
    pub len: usize,
}

/// A rank file: name, size and sha256 (hex).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

/// How the saving job was laid out (informational: loading needs none of it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedLayout {
    pub world: usize,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub zero_stage: u8,
    pub strategy: String,
}

/// `metadata.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub format: String,
    /// Optimizer steps completed: a resumed run starts at this step index.
    pub step: usize,
    pub layout: SavedLayout,
    pub precision: String,
    /// The optimizer (`adamw`, `sgd`) and its step count (steps applied:
    /// skipped fp16 steps are not counted), if its state was saved.
    pub optimizer: Option<(String, u64)>,
    /// The loss scaler (scale and history).
    pub loss_scaler: crate::precision::LossScaler,
    /// Samples of the training split consumed (step x global batch); the
    /// batch order is a function of the step, so this is the data position.
    pub samples_consumed: u64,
    pub global_batch: usize,
    /// What decides the samples (checked on resume) and where text
    /// streams stood; absent in older checkpoints and imported weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::data::DataState>,
    /// No training-time random state exists (initialisation and the batch
    /// order are seeded by the config; no dropout): said here, not guessed.
    pub rng: String,
    /// The run's config (TOML).
    pub config: String,
    /// Every global tensor: name -> shape.
    pub tensors: BTreeMap<String, Vec<usize>>,
    pub files: Vec<FileInfo>,
    pub entries: Vec<Entry>,
    /// Every rank's own state (absent in checkpoints without any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_state: Vec<RankEntry>,
    /// The launcher's id of the job that saved it ([`crate::fault::job_id`]),
    /// where one was known: a restarted attempt resumes only its own job's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// What `latest` named when this checkpoint was committed, before it
    /// was pointed here: a save killed between its rename and `latest`
    /// leaves a checkpoint `after` what `latest` still names, which a
    /// resume takes first (see `read::list`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

impl Metadata {
    /// Parse and check `metadata.json` text: every field and that no two
    /// entries overlap (see [`validate`]); an error names the field. For a
    /// checkpoint on disk use [`Metadata::parse_fields`] and
    /// [`Metadata::verify_files`], which check the files' sizes before the
    /// overlaps (whose memory only the real bytes bound).
    pub fn parse(text: &str) -> Result<Metadata, String> {
        let m = Metadata::parse_fields(text)?;
        validate::overlaps(&m.entries)?;
        Ok(m)
    }

    /// Every field of `metadata.json` text checked, but not yet the
    /// overlaps of its entries.
    pub fn parse_fields(text: &str) -> Result<Metadata, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let m: Metadata = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            if path == "." {
                format!("metadata.json: {}", e.inner())
            } else {
                format!("metadata.json: {path}: {}", e.inner())
            }
        })?;
        if m.format != FORMAT {
            return Err(format!(
                "metadata.json: format {:?}, this build reads {FORMAT:?}",
                m.format
            ));
        }
        validate::check(&m)?;
        Ok(m)
    }

    /// The files in `dir` have the sizes this metadata gives them, and
    /// then no two entries overlap.
    pub fn verify_files(&self, dir: &std::path::Path) -> Result<(), String> {
        for (i, f) in self.files.iter().enumerate() {
            let p = dir.join(&f.name);
            let md = std::fs::metadata(&p).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    format!(
                        "checkpoint file {} is missing (metadata.json files[{i}].name lists it)",
                        p.display()
                    )
                } else {
                    format!("checkpoint file {}: {e}", p.display())
                }
            })?;
            // A FIFO or device (an archive can carry one) would block or
            // never end when read.
            if !md.is_file() {
                return Err(format!(
                    "checkpoint file {} is not a regular file (metadata.json files[{i}].name)",
                    p.display()
                ));
            }
            let len = md.len();
            if len != f.bytes {
                return Err(format!(
                    "checkpoint file {} is {len} bytes, metadata.json files[{i}].bytes says {} \
                     (truncated or replaced)",
                    p.display(),
                    f.bytes
                ));
            }
        }
        validate::overlaps(&self.entries).map_err(|e| format!("{}: {e}", dir.display()))
    }
}

/// Whether `name` names a file directly inside a directory: not empty, no
/// separator, not `.` or `..`, no NUL.
pub fn plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// The name of the checkpoint of `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// The file rank `r` writes.
pub fn rank_file_name(r: usize) -> String {
    format!("rank-{r:05}.safetensors")
}
