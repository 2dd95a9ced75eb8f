//! Writing a checkpoint: each rank's staging copy ([`Snapshot`]) becomes one
//! safetensors file, written in parallel; rank 0 then writes the metadata
//! and renames the directory into place (see the module docs). [`save`] is
//! collective over its group; [`AsyncWriter`] runs it on a thread of its
//! own (DCP's `async_save`), over a group of its own, so training goes on.

use super::{rank_file_name, regions_of, step_dir_name, Entry, FileInfo, Metadata, Placement};
use crate::engine::Layout;
use crate::error::{Error, Result};
use crate::strategy::state::StateRange;
use phalanx_comm::ProcessGroup;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One rank's share of a checkpoint, copied out of training.
pub struct Snapshot {
    /// (key, tensor, kind, region, values)
    pieces: Vec<(String, String, String, super::region::Region, Vec<f32>)>,
    tensors: BTreeMap<String, Vec<usize>>,
    optimizer: Option<(String, u64)>,
    /// This rank's own state that belongs to no tensor (a communication
    /// hook's residuals and counters): (name, values).
    rank_state: Vec<(String, Vec<f32>)>,
}

impl Snapshot {
    /// Cut the state ranges into per-tensor pieces.
    pub fn new(layout: &Layout, placement: &dyn Placement, ranges: &[StateRange]) -> Snapshot {
        let mut pieces = Vec::new();
        let mut tensors = BTreeMap::new();
        for p in layout.params() {
            tensors.insert(p.name.clone(), placement.place(p).shape);
        }
        let mut optimizer = None;
        for s in ranges {
            optimizer.get_or_insert((s.optim_kind.to_string(), s.optim_step));
            for (k, region, at) in regions_of(layout, placement, &s.range) {
                let name = &layout.params()[k].name;
                let mut add = |kind: &str, values: &[f32]| {
                    // A group's own state goes under its group's kinds.
                    let kind = match s.group {
                        Some(g) => crate::strategy::state::group_kind(g, kind),
                        None => kind.to_string(),
                    };
                    let key = format!("{kind}/{}", pieces.len());
                    pieces.push((
                        key,
                        name.clone(),
                        kind,
                        region.clone(),
                        values[at.clone()].to_vec(),
                    ));
                };
                add("param", &s.params);
                for (kind, v) in &s.optim {
                    add(kind, v);
                }
            }
        }
        Snapshot {
            pieces,
            tensors,
            optimizer,
            rank_state: Vec::new(),
        }
    }

    /// Add this rank's own state that belongs to no tensor (see
    /// [`super::RankEntry`]): a communication hook's, for an exact resume
    /// on the same layout.
    pub fn with_rank_state(mut self, state: Vec<(String, Vec<f32>)>) -> Snapshot {
        self.rank_state = state;
        self
    }

    /// The same pieces, recorded as holding no optimizer state (a
    /// parameters-only checkpoint, e.g. imported weights: a run loading it
    /// starts its optimizer fresh).
    pub fn without_optimizer(mut self) -> Snapshot {
        self.optimizer = None;
        self
    }

    /// Bytes of values held.
    pub fn bytes(&self) -> usize {
        let rank: usize = self.rank_state.iter().map(|(_, v)| v.len() * 4).sum();
        self.pieces.iter().map(|p| p.4.len() * 4).sum::<usize>() + rank
    }
}

/// What every rank reports to rank 0 after writing its file.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    error: Option<String>,
    file: Option<FileInfo>,
    entries: Vec<Entry>,
    tensors: BTreeMap<String, Vec<usize>>,
    optimizer: Option<(String, u64)>,
    #[serde(default)]
    rank_state: Vec<super::RankEntry>,
}

/// The safetensors key of a rank's own state `name`.
pub(crate) fn rank_state_key(name: &str) -> String {
    format!("rank_state/{name}")
}

/// Write `bytes` to `path` and fsync it.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// This rank's file and manifest.
fn write_rank(dir: &Path, rank: usize, snap: &Snapshot) -> std::result::Result<Manifest, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let name = rank_file_name(rank);
    // The tensors' pieces, then the rank's own state.
    let arrays: Vec<(String, &[f32])> = snap
        .pieces
        .iter()
        .map(|p| (p.0.clone(), p.4.as_slice()))
        .chain(
            snap.rank_state
                .iter()
                .map(|(n, v)| (rank_state_key(n), v.as_slice())),
        )
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = arrays
        .iter()
        .map(|(key, v)| {
            let b = bytemuck::cast_slice::<f32, u8>(v);
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![v.len()], b)
                .map(|t| (key.clone(), t))
                .map_err(|e| e.to_string())
        })
        .collect::<std::result::Result<_, _>>()?;
    let data = safetensors::serialize(views, None).map_err(|e| e.to_string())?;
    let path = dir.join(&name);
    write_synced(&path, &data).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let file = FileInfo {
        name,
        bytes: data.len() as u64,
        sha256: hex(&Sha256::digest(&data)),
    };
    let entries = snap
        .pieces
        .iter()
        .map(|p| Entry {
            file: rank,
            key: p.0.clone(),
            tensor: p.1.clone(),
            kind: p.2.clone(),
            region: p.3.clone(),
        })
        .collect();
    Ok(Manifest {
        error: None,
        file: Some(file),
        entries,
        tensors: snap.tensors.clone(),
        optimizer: snap.optimizer.clone(),
        rank_state: snap
            .rank_state
            .iter()
            .map(|(n, v)| super::RankEntry {
                rank,
                name: n.clone(),
                len: v.len(),
            })
            .collect(),
    })
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// All-gather byte strings (packed 8 to an i64) on every rank.
fn all_gather_bytes(pg: &ProcessGroup, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut lens = vec![0i64; pg.size()];
    pg.all_gather(&[mine.len() as i64], &mut lens)?;
    let words = |n: usize| n.div_ceil(8);
    let mut padded = mine.to_vec();
    padded.resize(words(mine.len()) * 8, 0);
    let packed: Vec<i64> = padded
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let counts: Vec<usize> = lens.iter().map(|&n| words(n as usize)).collect();
    let mut all = vec![0i64; counts.iter().sum()];
    pg.all_gather_v(&packed, &counts, &mut all)?;
    let bytes: Vec<u8> = all.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut out = Vec::new();
    let mut at = 0;
    for (&n, &w) in lens.iter().zip(&counts) {
        out.push(bytes[at..at + n as usize].to_vec());
        at += w * 8;
    }
    Ok(out)
}

/// What goes into the metadata besides the pieces.
#[derive(Clone)]
pub struct Header {
    pub step: usize,
    pub layout: super::SavedLayout,
    pub precision: String,
    pub loss_scaler: crate::precision::LossScaler,
    pub global_batch: usize,
    /// The global sample index the next step starts at (step x global
    /// batch, unless a resume changed the batch).
    pub samples_consumed: u64,
    /// The data fingerprint and stream positions (see `crate::data::DataState`).
    pub data: Option<crate::data::DataState>,
    pub config: String,
    /// The saving job's id ([`crate::fault::job_id`]), where known.
    pub job: Option<String>,
}

/// Write a checkpoint of `snap` under `root` (collective over `pg`, every
/// rank of the job): returns the checkpoint's directory on every rank, or
/// the same error everywhere. Keeps the newest `keep` checkpoints.
pub fn save(
    pg: &ProcessGroup,
    root: &Path,
    snap: &Snapshot,
    header: &Header,
    keep: usize,
) -> Result<PathBuf> {
    let mut nonce = [i64::from_le_bytes(
        phalanx_comm::wire::random_bytes(8)
            .try_into()
            .expect("8 bytes"),
    ) & i64::MAX];
    pg.broadcast(&mut nonce, 0)?;
    let name = step_dir_name(header.step);
    let tmp = root.join(format!(".tmp-{name}-{:016x}", nonce[0]));
    let manifest = write_rank(&tmp, pg.rank(), snap).unwrap_or_else(|e| Manifest {
        error: Some(e),
        file: None,
        entries: Vec::new(),
        tensors: BTreeMap::new(),
        optimizer: None,
        rank_state: Vec::new(),
    });
    if let (true, Some(f)) = (crate::fault::unshared_checkpoint(pg.rank()), &manifest.file) {
        let _ = std::fs::remove_file(tmp.join(&f.name));
    }
    let mine = serde_json::to_vec(&manifest).expect("manifest serialises");
    let all = match all_gather_bytes(pg, &mine) {
        Ok(all) => all,
        Err(e) => {
            // A peer is gone: rank 0 removes what every rank wrote (a
            // whole checkpoint's size) rather than leave it to a later
            // run's prune.
            if pg.rank() == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Err(e);
        }
    };
    let mut status = [0i64];
    let mut outcome: Result<PathBuf> = Err(Error::Check("checkpoint not written".into()));
    if pg.rank() == 0 {
        outcome = commit(root, &tmp, &name, header, &all, keep);
        if outcome.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
            status[0] = 1;
        }
    }
    pg.broadcast(&mut status, 0)?;
    match (pg.rank(), status[0]) {
        (0, _) => outcome,
        (_, 0) => Ok(root.join(&name)),
        _ => Err(Error::Check(format!(
            "checkpoint of step {} under {} failed (rank 0 has the reason)",
            header.step,
            root.display()
        ))),
    }
}

/// Rank 0: check every rank's manifest, write the metadata, rename into
/// place, update `latest`, prune.
fn commit(
    root: &Path,
    tmp: &Path,
    name: &str,
    header: &Header,
    all: &[Vec<u8>],
    keep: usize,
) -> Result<PathBuf> {
    let mut files = Vec::new();
    let mut entries = Vec::new();
    let mut tensors = BTreeMap::new();
    let mut optimizer = None;
    let mut rank_state = Vec::new();
    for (r, bytes) in all.iter().enumerate() {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::Check(format!("checkpoint manifest of rank {r}: {e}")))?;
        if let Some(e) = m.error {
            return Err(Error::Io(format!("checkpoint: rank {r}: {e}")));
        }
        files.push(m.file.expect("a file when no error"));
        entries.extend(m.entries);
        rank_state.extend(m.rank_state);
        for (t, s) in m.tensors {
            if let Some(prev) = tensors.insert(t.clone(), s.clone()) {
                if prev != s {
                    return Err(Error::Check(format!(
                        "checkpoint: ranks disagree on the shape of {t}: {prev:?} vs {s:?}"
                    )));
                }
            }
        }
        if m.optimizer.is_some() {
            optimizer = m.optimizer;
        }
    }
    // Every rank's file must be here, with the size its rank wrote: a
    // checkpoint.dir that is not shared across nodes leaves the other
    // nodes' files on their own disks, and every save would "succeed"
    // while none could be loaded (and rotation would delete the good ones).
    for (r, f) in files.iter().enumerate() {
        let p = tmp.join(&f.name);
        match std::fs::metadata(&p) {
            Ok(m) if m.len() == f.bytes => {}
            found => {
                return Err(Error::Io(format!(
                    "checkpoint: rank {r} wrote {} ({} bytes), but rank 0 finds {}: is \
                     checkpoint.dir ({}) on a file system every node shares?",
                    f.name,
                    f.bytes,
                    match found {
                        Ok(m) => format!("{} bytes there", m.len()),
                        Err(e) => format!("no such file in {} ({e})", tmp.display()),
                    },
                    root.display()
                )));
            }
        }
    }
    let meta = Metadata {
        format: super::FORMAT.into(),
        step: header.step,
        layout: header.layout.clone(),
        precision: header.precision.clone(),
        optimizer,
        loss_scaler: header.loss_scaler,
        samples_consumed: header.samples_consumed,
        data: header.data.clone(),
        global_batch: header.global_batch,
        rng: "none: initialisation and batch order are seeded by the config; no dropout".into(),
        config: header.config.clone(),
        tensors,
        files,
        entries,
        rank_state,
        job: header.job.clone(),
        after: super::read::latest_name(root),
    };
    let io = |what: &str, p: &Path, e: std::io::Error| {
        Error::Io(format!("checkpoint: {what} {}: {e}", p.display()))
    };
    let text = serde_json::to_vec_pretty(&meta).expect("metadata serialises");
    let mp = tmp.join("metadata.json");
    write_synced(&mp, &text).map_err(|e| io("cannot write", &mp, e))?;
    sync_dir(tmp).map_err(|e| io("cannot sync", tmp, e))?;
    // Test hook (`PHALANX_FAULT=exit-in-save:STEP`): die here, with every
    // file written and nothing renamed, to show that a killed save leaves
    // no checkpoint that looks complete.
    crate::fault::in_save(header.step);
    let dst = root.join(name);
    if dst.exists() && super::rotate::phalanx_checkpoint(&dst).is_none() {
        // One of ours whose metadata no longer reads (a resume skipped it
        // for that): keep it, aside, rather than fail this save and every
        // retry of it. Anything else is not ours to move.
        if !looks_like_ours(&dst) {
            return Err(Error::Check(format!(
                "checkpoint: {} exists and is not a checkpoint Phalanx wrote: not replacing it",
                dst.display()
            )));
        }
        let aside = root.join(format!(".broken-{name}-{}", crate::fsutil::random_hex()));
        std::fs::rename(&dst, &aside).map_err(|e| io("cannot move aside", &dst, e))?;
        eprintln!(
            "warning: checkpoint {} did not verify; kept as {} and replaced by this save",
            dst.display(),
            aside.display()
        );
    }
    // A checkpoint of the same step from an earlier run is moved aside,
    // and deleted only once the new one is in place: a kill or a failed
    // rename in between leaves the old one (put back, or as `.old-*`,
    // which the next resume or save puts back: `rotate::recover_replaced`),
    // never neither.
    let old = root.join(format!(".old-{name}"));
    let replaced = dst.exists();
    if replaced {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&dst, &old).map_err(|e| io("cannot move aside", &dst, e))?;
    }
    if let Err(e) = std::fs::rename(tmp, &dst) {
        if replaced {
            let _ = std::fs::rename(&old, &dst);
        }
        return Err(io("cannot rename into", &dst, e));
    }
    // The checkpoint is complete and in place from here: what fails now
    // (a full disk for `latest`) is a warning, not a failed save that
    // would end the run with its newest checkpoint written.
    let warn = |what: &str, p: &Path, e: std::io::Error| {
        eprintln!(
            "warning: checkpoint {} is saved, but {what} {}: {e}",
            dst.display(),
            p.display()
        )
    };
    match sync_dir(root) {
        // The rename is durable: the replaced copy can go.
        Ok(()) if replaced => {
            let _ = std::fs::remove_dir_all(&old);
        }
        Ok(()) => {}
        // Kept (`.old-step-N`) until a sync makes the new one durable.
        Err(e) => warn("cannot sync", root, e),
    }
    crate::fault::after_rename(header.step);
    match super::rotate::write_latest(root, name) {
        Ok(()) => {
            if let Err(e) = sync_dir(root) {
                warn("cannot sync", root, e);
            }
        }
        // The old `latest` stays (written whole or not at all): this
        // checkpoint's metadata says it came after what `latest` names, so
        // a resume takes it first all the same (see `read::list`).
        Err(e) => warn(
            "`latest` was left as it was (a resume takes the newest checkpoint saved after what \
             it names): cannot update",
            &root.join("latest"),
            e,
        ),
    }
    super::rotate::prune(root, name, keep);
    Ok(dst)
}

/// At most one checkpoint in flight, written by a thread of its own over
/// its own process group: the step only pays for the staging copy. The next
/// submission (or [`AsyncWriter::wait`]) waits for the previous one and
/// returns its error, if it failed.
pub struct AsyncWriter {
    pg: ProcessGroup,
    inflight: Option<std::thread::JoinHandle<Result<PathBuf>>>,
}

impl AsyncWriter {
    /// `pg`: a group of every rank used for nothing else.
    pub fn new(pg: ProcessGroup) -> AsyncWriter {
        AsyncWriter { pg, inflight: None }
    }

    /// Start writing `snap` after the previous save has finished.
    pub fn submit(
        &mut self,
        root: PathBuf,
        snap: Snapshot,
        header: Header,
        keep: usize,
    ) -> Result<Option<PathBuf>> {
        let prev = self.wait()?;
        let pg = self.pg.clone();
        self.inflight = Some(
            std::thread::Builder::new()
                .name("phalanx-checkpoint".into())
                .spawn(move || save(&pg, &root, &snap, &header, keep))
                .map_err(|e| Error::Io(format!("checkpoint thread: {e}")))?,
        );
        Ok(prev)
    }

    /// Wait for the save in flight, if any.
    pub fn wait(&mut self) -> Result<Option<PathBuf>> {
        match self.inflight.take() {
            None => Ok(None),
            Some(h) => match h.join() {
                Ok(r) => r.map(Some),
                Err(_) => Err(Error::Check("the checkpoint thread panicked".into())),
            },
        }
    }

    pub fn in_flight(&self) -> bool {
        self.inflight.is_some()
    }
}

impl Drop for AsyncWriter {
    fn drop(&mut self) {
        // Never leave a writer behind the run: finish (errors were the
        // caller's to collect with `wait`).
        let _ = self.wait();
    }
}

/// A directory holding only what a save writes (`metadata.json`,
/// `rank-NNNNN.safetensors`) and nothing else: a checkpoint of ours, even
/// when its metadata is damaged.
fn looks_like_ours(dir: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut any = false;
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        let ours = n == "metadata.json"
            || n.strip_prefix("rank-")
                .and_then(|r| r.strip_suffix(".safetensors"))
                .is_some_and(|r| r.len() >= 5 && r.bytes().all(|b| b.is_ascii_digit()));
        if !ours || !e.file_type().is_ok_and(|t| t.is_file()) {
            return false;
        }
        any = true;
    }
    any
}
