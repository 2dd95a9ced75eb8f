//! Shared by the CLI tests: the binary, the repository, fresh temporary
//! directories, and the flags of a small model that trains in a second.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub const BIN: &str = env!("CARGO_BIN_EXE_phalanx");

/// The repository root (the default corpus is at `data/corpus.txt` there).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Run the binary in the repository: (exit code, stdout, stderr).
pub fn phalanx(args: &[&str]) -> (i32, String, String) {
    let o = std::process::Command::new(BIN)
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A fresh, empty directory for one test (`prefix-name-pid`).
pub fn fresh_dir(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{prefix}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small model so that the end-to-end runs take a second.
pub const SMALL: &[&str] = &[
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_head=2",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=32",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "train.eval_interval=0",
    "--set",
    "log.plot=\"\"",
    "--set",
    "log.report=\"\"",
];
