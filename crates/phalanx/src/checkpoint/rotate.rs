//! The directory of checkpoints: which entries are Phalanx's to delete
//! (rotation by `checkpoint.keep`, leftovers of interrupted saves), and
//! `latest`, replaced whole.
//!
//! Rotation deletes only what it recognises as a checkpoint Phalanx wrote:
//! the exact name [`super::step_dir_name`] gives (`step-` and at least 8
//! digits) and a `metadata.json` that parses as Phalanx's, of that step. A
//! user's `step-1/`, `step-00000001-notes/` or a step directory without
//! (or with an unreadable) `metadata.json` is never touched. Leftovers
//! (`.tmp-step-*`, `.old-step-*`) are removed only while this process
//! holds the directory's lock ([`super::lock`]): otherwise they may be
//! another run's save in flight.

use std::path::Path;

/// The step of a checkpoint directory name as Phalanx writes it, if `name`
/// is exactly one.
pub fn step_of_name(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: usize = digits.parse().ok()?;
    (super::step_dir_name(step) == name).then_some(step)
}

/// The step of `dir` if it is a checkpoint Phalanx wrote (see the module
/// docs), else `None`.
pub fn phalanx_checkpoint(dir: &Path) -> Option<usize> {
    let step = step_of_name(dir.file_name()?.to_str()?)?;
    let md = dir.symlink_metadata().ok()?;
    if !md.is_dir() {
        return None;
    }
    let meta = metadata_fields(dir)?;
    (meta.step == step).then_some(step)
}

/// The metadata of the checkpoint `dir`, its fields checked, if it holds
/// one that parses (whatever the directory's name). The fields only: the
/// overlap check walks the entries' rows, which a metadata.json alone may
/// claim by the trillion (this runs at every save, over every step
/// directory).
pub fn metadata_fields(dir: &Path) -> Option<super::Metadata> {
    let text = crate::fsutil::read_text_capped(
        "checkpoint metadata",
        &dir.join("metadata.json"),
        crate::fsutil::METADATA_CAP,
    )
    .ok()?;
    super::Metadata::parse_fields(&text).ok()
}

/// Remove all but the newest `keep` (at least 1) checkpoints under `root`
/// that Phalanx wrote (never `current`), and, while this process holds the
/// directory's lock, leftovers of interrupted saves. Only checkpoints of
/// steps up to `current`'s count: higher ones belong to another run in the
/// same directory (or to this run's future, when it was resumed from an
/// earlier step), and deleting this run's saves in their favour would lose
/// the run being written (its `latest` is `current`).
pub fn prune(root: &Path, current: &str, keep: usize) {
    // An `.old-step-N` without its `step-N` is the only copy: back first.
    recover_replaced(root);
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    let locked = super::lock::held(root);
    let mut steps: Vec<(usize, std::path::PathBuf)> = Vec::new();
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if let Some(s) = phalanx_checkpoint(&e.path()) {
            steps.push((s, e.path()));
        } else if locked && (n.starts_with(".tmp-step-") || n.starts_with(".old-step-")) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    // By step, not by name: names past 8 digits sort wrong as text.
    steps.sort();
    if let Some(cur) = steps
        .iter()
        .find(|(_, p)| p.file_name().is_some_and(|n| n == current))
        .map(|(s, _)| *s)
    {
        steps.retain(|(s, _)| *s <= cur);
    }
    let keep = keep.max(1);
    if steps.len() > keep {
        for (_, p) in &steps[..steps.len() - keep] {
            if p.file_name().is_some_and(|n| n != current) {
                let _ = std::fs::remove_dir_all(p);
            }
        }
    }
}

/// Put back the checkpoints a save moved aside to replace and never
/// replaced (`.old-step-N` without `step-N`: the process was killed
/// between the save's two renames), while this process holds `root`'s
/// lock; before a resume lists what there is. Returns their names.
pub fn recover_replaced(root: &Path) -> Vec<String> {
    let mut back = Vec::new();
    if !super::lock::held(root) {
        return back;
    }
    let Ok(rd) = std::fs::read_dir(root) else {
        return back;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if let Some(name) = n.strip_prefix(".old-") {
            let dst = root.join(name);
            if name.starts_with("step-") && !dst.exists() && std::fs::rename(e.path(), &dst).is_ok()
            {
                back.push(name.to_string());
            }
        }
    }
    back
}

/// Point `root/latest` at checkpoint `name`, whole or not at all: through
/// [`crate::fsutil::write_atomic`], whose temporary is removed on every
/// error (a full disk used to leave a 0-byte `.latest.tmp`).
pub fn write_latest(root: &Path, name: &str) -> std::io::Result<()> {
    crate::fsutil::write_atomic(&root.join("latest"), format!("{name}\n").as_bytes())
}
