//! The directory of checkpoints (issue 27, items 6, 8, 24): rotation
//! deletes only checkpoints Phalanx wrote, leftovers only under the lock,
//! a second run is refused naming the holder, and `latest` is replaced
//! whole with no temporary left on an error.

use phalanx::checkpoint::{lock, rotate, step_dir_name};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

fn fresh(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("phalanx-ckdir-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `metadata.json` as Phalanx writes it, of `step`.
fn metadata(step: usize) -> String {
    serde_json::json!({
        "format": phalanx::checkpoint::FORMAT,
        "step": step,
        "layout": {"world": 1, "dp": 1, "pp": 1, "tp": 1, "zero_stage": 0, "strategy": "ddp"},
        "precision": "fp32",
        "optimizer": null,
        "loss_scaler": {"scale": 1.0, "dynamic": null, "skips": false},
        "samples_consumed": 0,
        "global_batch": 8,
        "rng": "none",
        "config": "",
        "tensors": {},
        "files": [{"name": "rank-00000.safetensors", "bytes": 0, "sha256": "0".repeat(64)}],
        "entries": []
    })
    .to_string()
}

fn dir_with(root: &Path, name: &str, meta: Option<&str>) {
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    if let Some(m) = meta {
        std::fs::write(d.join("metadata.json"), m).unwrap();
    }
}

#[test]
fn rotation_deletes_only_checkpoints_phalanx_wrote() {
    let root = fresh("rotate");
    for s in 1..=4 {
        dir_with(&root, &step_dir_name(s), Some(&metadata(s)));
    }
    // (name, metadata.json): a user's directories that look like steps.
    let keep: &[(&str, Option<String>)] = &[
        ("step-1", Some(metadata(1))),
        ("step-00000001-notes", Some(metadata(1))),
        ("step-00000006", None),
        ("step-0000000x", Some(metadata(0))),
        ("step-00000000 ", Some(metadata(0))),
        ("step-00000000.bak", Some(metadata(0))),
        // metadata of another step, or not Phalanx's
        (&step_dir_name(0), Some(metadata(7))),
        ("step-00000005", Some("{\"format\": \"mine\"}".into())),
    ];
    for (n, m) in keep {
        dir_with(&root, n, m.as_deref());
    }
    // Not locked: another run's save may be in flight here.
    dir_with(&root, ".tmp-step-00000009-00ff", None);
    rotate::prune(&root, &step_dir_name(4), 2);
    for s in 1..=2 {
        assert!(!root.join(step_dir_name(s)).exists(), "step {s} kept");
    }
    for s in 3..=4 {
        assert!(root.join(step_dir_name(s)).exists(), "step {s} deleted");
    }
    for (n, _) in keep {
        assert!(root.join(n).exists(), "{n} was deleted");
    }
    assert!(
        root.join(".tmp-step-00000009-00ff").exists(),
        "a .tmp deleted without the lock"
    );
    // Under the lock, nothing else writes here: leftovers go.
    lock::lock(&root, "checkpoint.dir").unwrap();
    rotate::prune(&root, &step_dir_name(4), 2);
    assert!(!root.join(".tmp-step-00000009-00ff").exists());
    // Steps past 8 digits sort by number, not text.
    dir_with(
        &root,
        &step_dir_name(123_456_789),
        Some(&metadata(123_456_789)),
    );
    rotate::prune(&root, &step_dir_name(123_456_789), 1);
    assert!(root.join(step_dir_name(123_456_789)).exists());
    assert!(!root.join(step_dir_name(4)).exists());
    let _ = std::fs::remove_dir_all(&root);
}

/// A run writing into a directory that holds another run's later steps
/// (or resumed from an earlier step of its own) rotates its own saves: the
/// higher steps stay, and never cost it the checkpoints it is writing.
#[test]
fn rotation_keeps_the_run_being_written_over_higher_steps() {
    let root = fresh("rotate-higher");
    for s in [500, 600, 50, 100, 200] {
        dir_with(&root, &step_dir_name(s), Some(&metadata(s)));
    }
    rotate::prune(&root, &step_dir_name(200), 2);
    for s in [500, 600, 100, 200] {
        assert!(root.join(step_dir_name(s)).exists(), "step {s} deleted");
    }
    assert!(!root.join(step_dir_name(50)).exists(), "step 50 kept");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn names_rotation_recognises() {
    let cases: &[(&str, Option<usize>)] = &[
        ("step-00000001", Some(1)),
        ("step-123456789", Some(123_456_789)),
        ("step-1", None),
        ("step-00000001-notes", None),
        ("step-000000001", None),
        ("step-+0000001", None),
        ("step-", None),
        ("xstep-00000001", None),
    ];
    for (n, want) in cases {
        assert_eq!(rotate::step_of_name(n), *want, "{n}");
    }
}

#[test]
fn a_held_directory_is_refused_naming_the_holder() {
    let root = fresh("lock");
    let p = root.join(lock::LOCK_FILE);
    std::fs::write(&p, "pid 4242 on otherhost\n").unwrap();
    // Another holder: an open file description of our own, locked.
    let f = std::fs::File::open(&p).unwrap();
    assert_eq!(
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let e = lock::lock(&root, "checkpoint.dir").unwrap_err().to_string();
    assert!(
        e.contains("pid 4242 on otherhost") && e.contains("checkpoint.dir"),
        "{e}"
    );
    assert!(!lock::held(&root));
    drop(f);
    // Released (as when that run ends, however): ours, and we say who we are.
    lock::lock(&root, "checkpoint.dir").unwrap();
    assert!(lock::held(&root));
    let who = std::fs::read_to_string(&p).unwrap();
    assert!(
        who.contains(&format!("pid {}", std::process::id())),
        "{who}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn latest_is_replaced_whole_and_leaves_no_temporary_on_error() {
    let root = fresh("latest");
    rotate::write_latest(&root, "step-00000001").unwrap();
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-00000001\n"
    );
    // A rename that fails (latest is a non-empty directory) after the
    // contents were written: the old writer left `.latest.tmp` here.
    std::fs::remove_file(root.join("latest")).unwrap();
    std::fs::create_dir_all(root.join("latest/x")).unwrap();
    assert!(rotate::write_latest(&root, "step-00000002").is_err());
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["latest"], "a temporary was left: {names:?}");
    let _ = std::fs::remove_dir_all(&root);
}

/// A checkpoint's file names are plain names inside it (issue 27, item
/// 12): `metadata.json` naming `../x`, an absolute path or a path with a
/// separator is refused naming the name, before any file is opened.
#[test]
fn metadata_naming_files_outside_the_checkpoint_is_refused() {
    let with_file = |name: &str| {
        let mut m: serde_json::Value = serde_json::from_str(&metadata(2)).unwrap();
        m["files"] = serde_json::json!([{"name": name, "bytes": 0, "sha256": "0".repeat(64)}]);
        m.to_string()
    };
    let ok = phalanx::checkpoint::Metadata::parse(&with_file("rank-00000.safetensors"));
    assert!(ok.is_ok(), "{ok:?}");
    for bad in ["../x", "/etc/passwd", "a/b", "..", ".", "", "a\\b"] {
        let e = phalanx::checkpoint::Metadata::parse(&with_file(bad)).unwrap_err();
        assert!(
            e.contains("not a plain file name") && e.contains(&format!("{bad:?}")),
            "{bad:?}: {e}"
        );
    }
}

/// A metadata.json that claims a file of 2 TiB and a region of 2^39 rows
/// (each check of the fields passes) is refused on its file's real size
/// before any per-row work: the overlap check (and `checkpoint inspect`'s
/// coverage) would have held one run per row, terabytes. Rotation reads
/// the fields only, so such a directory cannot stop later saves either.
#[test]
fn metadata_claiming_more_rows_than_its_files_hold_is_refused_at_once() {
    let root = fresh("claims");
    let rows: u64 = 1 << 39;
    let mut m: serde_json::Value = serde_json::from_str(&metadata(3)).unwrap();
    m["tensors"] = serde_json::json!({"w": [rows, 2]});
    m["files"] = serde_json::json!([{"name": "rank-00000.safetensors", "bytes": 4 * rows, "sha256": "0".repeat(64)}]);
    m["entries"] = serde_json::json!([{
        "tensor": "w", "kind": "param", "file": 0, "key": "w",
        "region": {"shape": [rows, 2], "offsets": [0, 0], "sizes": [rows, 1], "flat": {"start": 0, "end": rows}}
    }]);
    let text = m.to_string();
    phalanx::checkpoint::Metadata::parse_fields(&text).expect("every field is in range");
    let d = root.join(step_dir_name(3));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("metadata.json"), &text).unwrap();
    std::fs::write(d.join("rank-00000.safetensors"), b"tiny").unwrap();
    let e = phalanx::checkpoint::Reader::open(&d)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("is 4 bytes") && e.contains("truncated or replaced"),
        "{e}"
    );
    // Rotation sees a checkpoint of step 3 and prunes it behind a newer one.
    dir_with(&root, &step_dir_name(4), Some(&metadata(4)));
    rotate::prune(&root, &step_dir_name(4), 1);
    assert!(!d.exists());
    let _ = std::fs::remove_dir_all(&root);
}

/// A save killed between moving a same-step checkpoint aside and renaming
/// its replacement in leaves the old one as `.old-step-N` only: it is put
/// back under the lock (by a resume, or the next save's rotation), where
/// it used to be deleted as a leftover. An `.old-*` beside its step (the
/// save finished) is still removed.
#[test]
fn a_checkpoint_moved_aside_and_never_replaced_is_put_back() {
    let root = fresh("old-aside");
    let old = |s: usize| format!(".old-{}", step_dir_name(s));
    dir_with(&root, &old(200), Some(&metadata(200)));
    dir_with(&root, &step_dir_name(100), Some(&metadata(100)));
    dir_with(&root, &old(100), Some(&metadata(100)));
    // Not locked: another run's save may be between its renames.
    assert!(rotate::recover_replaced(&root).is_empty());
    rotate::prune(&root, &step_dir_name(100), 5);
    assert!(root.join(old(200)).exists());
    lock::lock(&root, "checkpoint.dir").unwrap();
    assert_eq!(rotate::recover_replaced(&root), vec![step_dir_name(200)]);
    assert!(rotate::phalanx_checkpoint(&root.join(step_dir_name(200))) == Some(200));
    // Killed again the same way: the next save's rotation puts it back.
    std::fs::rename(root.join(step_dir_name(200)), root.join(old(200))).unwrap();
    rotate::prune(&root, &step_dir_name(100), 5);
    assert!(root.join(step_dir_name(200)).exists(), "step 200 lost");
    assert!(!root.join(old(200)).exists());
    assert!(!root.join(old(100)).exists(), "a finished save's .old kept");
    let _ = std::fs::remove_dir_all(&root);
}

/// A rank file that is a FIFO (an archive can carry one) is refused when
/// the checkpoint opens: reading it would block `inspect` and a resume.
#[test]
fn a_rank_file_that_is_not_a_regular_file_is_refused() {
    let root = fresh("fifo");
    let d = root.join(step_dir_name(5));
    dir_with(&root, &step_dir_name(5), Some(&metadata(5)));
    let fifo = d.join("rank-00000.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = phalanx::checkpoint::Reader::open(&d)
        .err()
        .expect("a FIFO rank file opened")
        .to_string();
    assert!(e.contains("not a regular file"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

/// `--resume DIR` and `--resume auto` choose among the run's own names,
/// newest step by number: a user's copy `step-00001000-best/` (which sorts
/// first as text) is not one, nor is text order right past 8 digits.
#[test]
fn a_directory_resumes_its_newest_step_by_its_own_names() {
    let root = fresh("find");
    dir_with(&root, &step_dir_name(1000), Some(&metadata(1000)));
    dir_with(&root, "step-00001000-best", Some(&metadata(1000)));
    dir_with(&root, &step_dir_name(999), Some(&metadata(999)));
    let found = phalanx::checkpoint::find(&root).unwrap();
    assert_eq!(found, root.join(step_dir_name(1000)));
    dir_with(
        &root,
        &step_dir_name(123_456_789),
        Some(&metadata(123_456_789)),
    );
    dir_with(&root, "step-99999999", Some(&metadata(99_999_999)));
    let found = phalanx::checkpoint::find(&root).unwrap();
    assert_eq!(found, root.join(step_dir_name(123_456_789)));
    let _ = std::fs::remove_dir_all(&root);
}

/// `latest` names the checkpoint to resume, unless steps were committed
/// after what it names (saves killed between their rename and `latest`,
/// or a `latest` that could not be written; their metadata says `after`,
/// and is newer than `latest`): those come first, highest first. A newer
/// step of another line (an older run's) stays behind `latest`, as do
/// steps `latest` was set back past by hand (`latest` is newer).
#[test]
fn steps_committed_after_latest_come_first() {
    let root = fresh("latest-stale");
    let after = |step: usize, prev: &str| {
        let mut m: serde_json::Value = serde_json::from_str(&metadata(step)).unwrap();
        m["after"] = prev.into();
        m.to_string()
    };
    dir_with(&root, &step_dir_name(8), Some(&metadata(8)));
    // An abandoned line: 12 came after 10, which is gone.
    dir_with(
        &root,
        &step_dir_name(12),
        Some(&after(12, &step_dir_name(10))),
    );
    // This line: 9 and 14 after 8 (`latest` never updated past it).
    dir_with(&root, &step_dir_name(9), Some(&after(9, &step_dir_name(8))));
    dir_with(
        &root,
        &step_dir_name(14),
        Some(&after(14, &step_dir_name(8))),
    );
    // `latest` as written by hand (a trailing slash) names step 8 too.
    std::fs::write(root.join("latest"), format!("{}/\n", step_dir_name(8))).unwrap();
    let at = |name: &str, secs: u64| {
        let f = std::fs::File::options()
            .write(true)
            .open(root.join(name))
            .unwrap();
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000 + secs);
        f.set_modified(t).unwrap();
    };
    // `latest` was written before the steps after it.
    at("latest", 0);
    let names = || -> Vec<String> {
        phalanx::checkpoint::list(&root)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(
        names(),
        [
            step_dir_name(14),
            step_dir_name(9),
            step_dir_name(8),
            step_dir_name(12)
        ]
    );
    assert_eq!(
        phalanx::checkpoint::find(&root).unwrap(),
        root.join(step_dir_name(14))
    );
    // `latest` set back by hand to step 8 after 9 and 14 were written: a
    // rollback, which they do not undo.
    at("latest", 4_000_000_000);
    assert_eq!(
        names(),
        [
            step_dir_name(8),
            step_dir_name(14),
            step_dir_name(12),
            step_dir_name(9)
        ]
    );
    at("latest", 0);
    // Without them, `latest` wins over the newer step 12.
    for s in [9, 14] {
        std::fs::remove_dir_all(root.join(step_dir_name(s))).unwrap();
    }
    assert_eq!(
        phalanx::checkpoint::find(&root).unwrap(),
        root.join(step_dir_name(8))
    );
    let _ = std::fs::remove_dir_all(&root);
}
