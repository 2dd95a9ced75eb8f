//! Reading a checkpoint into any layout: [`find`] picks a complete
//! checkpoint, [`Reader`] checks it (metadata, file sizes, checksums of the
//! files it reads) and fills any flat range of a rank's layout from the
//! saved pieces that overlap it, memory-mapped.

use super::region::copy_overlap;
use super::{regions_of, Metadata, Placement};
use crate::engine::Layout;
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ops::Range;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Whether `dir` is a checkpoint (it holds `metadata.json`).
fn is_checkpoint(dir: &Path) -> bool {
    dir.join("metadata.json").is_file()
}

/// The `step-N` directories under `root` (names as Phalanx writes them
/// only: `step-NNNNNNNN`; a user's copy `step-00001000-best/` is not one
/// of the run's) that pass `keep`, as (step, path), newest step first by
/// number (past 8 digits, text order is wrong).
fn step_dirs(root: &Path, keep: impl Fn(&Path) -> bool) -> Vec<(usize, PathBuf)> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter_map(|p| {
                    let step = super::rotate::step_of_name(p.file_name()?.to_str()?)?;
                    keep(&p).then_some((step, p))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.reverse();
    v
}

/// The complete checkpoints under `root`, newest first.
fn candidates(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = step_dirs(root, is_checkpoint)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    // `latest` first, when it names one of them, after those committed
    // since it was written: a save renames its checkpoint into place and
    // then points `latest` at it, so a process killed between the two (or
    // a `latest` that could not be written, which is kept as it was)
    // leaves complete checkpoints whose metadata says they came `after`
    // what `latest` still names, written after `latest` was; the highest
    // of them is the newest. A step of another line (an older run's, past
    // the step this one resumed from) is not after it, and one that
    // `latest` was set back past by hand was written before it: both stay
    // behind it. (Both tests: a copy that does not keep file times
    // scrambles them, and `after` alone cannot tell a hand edit.) A resume
    // points `latest` at what it resumed (`mark_resumed`), so the saves
    // after it are `after` it.
    let latest = root.join("latest");
    if let Some(l) = latest_name(root) {
        if let Some(i) = v
            .iter()
            .position(|p| p.file_name().is_some_and(|n| *n == *l))
        {
            let written = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            let since = written(&latest);
            let after = |p: &Path| -> Option<String> {
                let text = crate::fsutil::read_text_capped(
                    "checkpoint metadata",
                    &p.join("metadata.json"),
                    crate::fsutil::METADATA_CAP,
                )
                .ok()?;
                let m: serde_json::Value = serde_json::from_str(&text).ok()?;
                m.get("after")?.as_str().map(str::to_string)
            };
            let since_latest = |p: &Path| {
                after(p).as_deref() == Some(l.as_str())
                    && match (since, written(&p.join("metadata.json"))) {
                        (Some(l), Some(m)) => m >= l,
                        _ => true,
                    }
            };
            // Newest first (v is), `latest` next.
            let (mut first, mut rest) = (Vec::new(), Vec::new());
            for (k, p) in v.iter().enumerate() {
                if k != i {
                    if since_latest(p) {
                        first.push(p.clone());
                    } else {
                        rest.push(p.clone());
                    }
                }
            }
            first.push(v[i].clone());
            v = first.into_iter().chain(rest).collect();
        }
    }
    v
}

/// The checkpoint name `latest` under `root` holds (the last component of
/// what it says: `step-00000300/` or a path written by hand name it too).
pub fn latest_name(root: &Path) -> Option<String> {
    let l = crate::fsutil::read_text_capped("latest", &root.join("latest"), 4096).ok()?;
    Path::new(l.trim())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
}

/// The checkpoint `path` names: itself if it is one, else the latest
/// complete one in it (an error if there is none).
pub fn find(path: &Path) -> Result<PathBuf> {
    if is_checkpoint(path) {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(Error::Check(format!(
            "{}: no such checkpoint or checkpoint directory",
            path.display()
        )));
    }
    candidates(path).into_iter().next().ok_or_else(|| {
        Error::Check(format!(
            "{}: no complete checkpoint in it (step-*/metadata.json)",
            path.display()
        ))
    })
}

/// The checkpoints under `root`, newest first (`latest` first when it
/// names one of them), complete ones only (`step-*` with a metadata file).
pub fn list(root: &Path) -> Vec<PathBuf> {
    candidates(root)
}

/// The `step-N` directories under `root` without a `metadata.json`, as
/// (step, path), newest first: never a save of Phalanx's (it renames a
/// checkpoint into place whole), so a damaged one, skipped by [`list`].
pub fn incomplete(root: &Path) -> Vec<(usize, PathBuf)> {
    step_dirs(root, |p| p.is_dir() && !is_checkpoint(p))
}

/// The newest checkpoint under `root` whose metadata opens and whose files
/// have the sizes it records, without reading the files (what a caller
/// needs when it only reads the metadata, or verifies the files itself).
pub fn find_latest_unverified(root: &Path) -> Option<(PathBuf, Reader)> {
    candidates(root)
        .into_iter()
        .find_map(|c| Reader::open(&c).ok().map(|r| (c, r)))
}

/// Whether the file `info` names under `dir` has the sha256 it records
/// (read through, not mapped: what `inspect` checks of the files whose
/// size is right when another's is not and the checkpoint does not open).
pub fn sha_matches(dir: &Path, info: &super::FileInfo) -> std::io::Result<bool> {
    let mut f = open_regular(&dir.join(&info.name))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(super::write::hex(&h.finalize()) == info.sha256)
}

/// Open a checkpoint file for reading, non-blocking and regular files
/// only: a FIFO put in a file's place (since it was verified) must not
/// block the open or the read. Anything else is `InvalidInput`.
fn open_regular(p: &Path) -> std::io::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(p)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// A verified rank file: its bytes and each key's byte range (1-D f32
/// tensors only: nothing else is a checkpoint piece).
struct MappedFile {
    map: memmap2::Mmap,
    index: HashMap<String, Range<usize>>,
}

/// An open checkpoint.
pub struct Reader {
    dir: PathBuf,
    pub meta: Metadata,
    /// Entries by (tensor, kind).
    by_tensor: HashMap<(String, String), Vec<usize>>,
    /// Entries by file.
    by_file: Vec<Vec<usize>>,
    /// Files mapped (and verified, and their keys indexed) so far.
    mapped: Mutex<HashMap<usize, std::sync::Arc<MappedFile>>>,
}

impl Reader {
    /// Read and check the metadata, and that every file has its size.
    pub fn open(dir: &Path) -> Result<Reader> {
        let mp = dir.join("metadata.json");
        let text = crate::fsutil::read_text_capped(
            "checkpoint metadata",
            &mp,
            crate::fsutil::METADATA_CAP,
        )
        .map_err(Error::Check)?;
        let meta = Metadata::parse_fields(&text)
            .map_err(|e| Error::Check(format!("{}: {e}", dir.display())))?;
        meta.verify_files(dir).map_err(Error::Check)?;
        let mut by_tensor: HashMap<(String, String), Vec<usize>> = HashMap::new();
        let mut by_file = vec![Vec::new(); meta.files.len()];
        for (i, e) in meta.entries.iter().enumerate() {
            by_tensor
                .entry((e.tensor.clone(), e.kind.clone()))
                .or_default()
                .push(i);
            by_file[e.file].push(i);
        }
        Ok(Reader {
            dir: dir.to_path_buf(),
            meta,
            by_tensor,
            by_file,
            mapped: Mutex::new(HashMap::new()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// File `i`, memory-mapped, its checksum verified and its header read
    /// on first use.
    fn file(&self, i: usize) -> Result<std::sync::Arc<MappedFile>> {
        if let Some(m) = self.mapped.lock().unwrap().get(&i) {
            return Ok(m.clone());
        }
        let info = &self.meta.files[i];
        let p = self.dir.join(&info.name);
        let f = open_regular(&p).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => Error::Check(format!(
                "checkpoint file {} is not a regular file",
                p.display()
            )),
            _ => Error::Check(format!("{}: {e}", p.display())),
        })?;
        // Safety: checkpoint files are written once and never modified.
        let m = unsafe { memmap2::Mmap::map(&f) }
            .map_err(|e| Error::Check(format!("{}: {e}", p.display())))?;
        let sum = super::write::hex(&Sha256::digest(&m[..]));
        if m.len() as u64 != info.bytes || sum != info.sha256 {
            return Err(Error::Check(format!(
                "checkpoint file {} is corrupt: its sha256 is {sum}, the metadata says {}",
                p.display(),
                info.sha256
            )));
        }
        // The header, once: each key's byte range.
        let (n, header) = safetensors::SafeTensors::read_metadata(&m[..])
            .map_err(|err| Error::Check(format!("{}: {err}", p.display())))?;
        let index = header
            .tensors()
            .into_iter()
            .filter(|(_, t)| t.dtype == safetensors::Dtype::F32 && t.shape.len() == 1)
            .map(|(k, t)| (k, 8 + n + t.data_offsets.0..8 + n + t.data_offsets.1))
            .collect();
        // Every piece the metadata places in this file is there, with its
        // size: what a resume reads, checked when the file is verified.
        for &j in &self.by_file[i] {
            let e = &self.meta.entries[j];
            let field = || format!("entries[{j}].key");
            check_key(&index, &p, field, &e.key, e.region.len())?;
        }
        for (j, e) in self.meta.rank_state.iter().enumerate() {
            if e.rank == i {
                let key = super::write::rank_state_key(&e.name);
                let field = || format!("rank_state[{j}].name");
                check_key(&index, &p, field, &key, e.len)?;
            }
        }
        let f = std::sync::Arc::new(MappedFile { map: m, index });
        self.mapped.lock().unwrap().insert(i, f.clone());
        Ok(f)
    }

    /// Verify file `i`'s checksum (an error naming the file).
    pub fn verify(&self, i: usize) -> Result<()> {
        self.file(i).map(|_| ())
    }

    /// Verify every file's checksum.
    pub fn verify_all(&self) -> Result<()> {
        (0..self.meta.files.len()).try_for_each(|i| self.verify(i))
    }

    /// The values of one entry.
    fn values(&self, entry: usize) -> Result<Vec<f32>> {
        let e = &self.meta.entries[entry];
        let f = self.file(e.file)?;
        let bytes = f
            .index
            .get(&e.key)
            .and_then(|r| f.map.get(r.clone()))
            .filter(|b| b.len() == e.region.len() * 4)
            .ok_or_else(|| {
                Error::Check(format!(
                    "{}: entry {} is missing, or not {} f32 values",
                    self.dir.join(&self.meta.files[e.file].name).display(),
                    e.key,
                    e.region.len()
                ))
            })?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }

    /// Rank `rank`'s own state ([`super::RankEntry`]), by name, in the
    /// order it was saved (empty if it saved none).
    pub fn rank_state(&self, rank: usize) -> Result<Vec<(String, Vec<f32>)>> {
        let mut out = Vec::new();
        for e in self.meta.rank_state.iter().filter(|e| e.rank == rank) {
            let f = self.file(e.rank)?;
            let key = super::write::rank_state_key(&e.name);
            let bytes = f
                .index
                .get(&key)
                .and_then(|r| f.map.get(r.clone()))
                .filter(|b| b.len() == e.len * 4)
                .ok_or_else(|| {
                    Error::Check(format!(
                        "{}: {key} is missing, or not {} f32 values",
                        self.dir.join(&self.meta.files[e.rank].name).display(),
                        e.len
                    ))
                })?;
            let v = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            out.push((e.name.clone(), v));
        }
        Ok(out)
    }

    /// Whether the checkpoint holds any `kind` ("param", `exp_avg`, …).
    pub fn has_kind(&self, kind: &str) -> bool {
        self.meta.entries.iter().any(|e| e.kind == kind)
    }

    /// Check that every parameter of `layout` (placed by `placement`) is a
    /// tensor of the checkpoint with the same global shape, and that the
    /// checkpoint holds no tensor the model lacks (a deeper model's layer).
    pub fn check_model(&self, layout: &Layout, placement: &dyn Placement) -> Result<()> {
        if let Some(extra) = self.meta.tensors.keys().find(|t| layout.find(t).is_none()) {
            return Err(Error::Check(format!(
                "checkpoint {} holds tensor `{extra}`, which this model does not have (a different model?)",
                self.dir.display()
            )));
        }
        for p in layout.params() {
            let shape = placement.place(p).shape;
            match self.meta.tensors.get(&p.name) {
                None => {
                    return Err(Error::Check(format!(
                        "checkpoint {} has no tensor `{}` (a different model?)",
                        self.dir.display(),
                        p.name
                    )))
                }
                Some(s) if *s != shape => {
                    return Err(Error::Check(format!(
                        "checkpoint {}: tensor `{}` has shape {s:?}, this model's is {shape:?}",
                        self.dir.display(),
                        p.name
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The values of `kind` for flat range `range` of `layout`, assembled
    /// from every saved piece that overlaps it; `None` if the checkpoint
    /// holds no `kind` at all. Every value must be found.
    pub fn fill(
        &self,
        layout: &Layout,
        placement: &dyn Placement,
        range: Range<usize>,
        kind: &str,
    ) -> Result<Option<Vec<f32>>> {
        if !self.has_kind(kind) {
            return Ok(None);
        }
        let mut out = vec![0f32; range.len()];
        let mut cache: HashMap<usize, Vec<f32>> = HashMap::new();
        for (k, region, at) in regions_of(layout, placement, &range) {
            let name = &layout.params()[k].name;
            let want = region.runs();
            let mut got = 0;
            let key = (name.clone(), kind.to_string());
            for &i in self
                .by_tensor
                .get(&key)
                .map(|v| v.as_slice())
                .unwrap_or(&[])
            {
                let e = &self.meta.entries[i];
                if e.region.shape != region.shape {
                    return Err(Error::Check(format!(
                        "checkpoint: tensor `{name}` has shape {:?}, this model's is {:?}",
                        e.region.shape, region.shape
                    )));
                }
                let have = e.region.runs();
                // Only read pieces that overlap.
                if !overlaps(&have, &want) {
                    continue;
                }
                if let std::collections::hash_map::Entry::Vacant(v) = cache.entry(i) {
                    v.insert(self.values(i)?);
                }
                got += copy_overlap(&have, &cache[&i], &want, &mut out[at.clone()]);
            }
            if got != region.len() {
                return Err(Error::Check(format!(
                    "checkpoint {}: the metadata.json entries of {kind} of `{name}` cover {got} \
                     of the {} values this rank needs",
                    self.dir.display(),
                    region.len()
                )));
            }
        }
        Ok(Some(out))
    }
}

/// That `key` is in a rank file's header as `len` f32 values.
fn check_key(
    index: &HashMap<String, Range<usize>>,
    file: &Path,
    field: impl Fn() -> String,
    key: &str,
    len: usize,
) -> Result<()> {
    match index.get(key) {
        Some(r) if r.len() == len * 4 => Ok(()),
        Some(r) => Err(Error::Check(format!(
            "{}: {key} holds {} f32 values, metadata.json ({}) says {len}",
            file.display(),
            r.len() / 4,
            field()
        ))),
        None => Err(Error::Check(format!(
            "{}: {key} is missing (metadata.json {} names it)",
            file.display(),
            field()
        ))),
    }
}

fn overlaps(a: &[(usize, usize, usize)], b: &[(usize, usize, usize)]) -> bool {
    let (Some(a0), Some(a1), Some(b0), Some(b1)) = (a.first(), a.last(), b.first(), b.last())
    else {
        return false;
    };
    a0.0 < b1.0 + b1.2 && b0.0 < a1.0 + a1.2
}
