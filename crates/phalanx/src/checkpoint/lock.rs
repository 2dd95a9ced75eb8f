//! One run at a time per checkpoint directory: rank 0 takes an advisory
//! `flock` on `.phalanx.lock` inside `checkpoint.dir` before training
//! starts and holds it until its process exits (the kernel drops it then,
//! also on SIGKILL, so a crashed run never leaves it stale). A second run
//! pointed at the same directory is refused naming the holder (pid and
//! host, written into the file), instead of one run's rotation and
//! cleanup deleting the other's checkpoints and in-flight `.tmp-step-*`.
//!
//! The lock is per process: a process that already holds a directory's
//! lock (several trainers in one test process) takes it again freely.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The lock file's name inside a checkpoint directory.
pub const LOCK_FILE: &str = ".phalanx.lock";

/// The directories this process holds (canonical path, the open lock file).
static HELD: Mutex<Vec<(PathBuf, std::fs::File)>> = Mutex::new(Vec::new());

/// This host's name, for the holder line.
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "an unknown host".into();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Take `dir`'s lock for the rest of this process (creating `dir`);
/// `key` names the setting in errors (`checkpoint.dir`).
pub fn lock(dir: &Path, key: &str) -> Result<()> {
    let io = |e: std::io::Error| Error::Io(format!("{key} {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let canon = dir.canonicalize().map_err(io)?;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    if held.iter().any(|(d, _)| *d == canon) {
        return Ok(());
    }
    let p = canon.join(LOCK_FILE);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .map_err(|e| {
            Error::Io(format!(
                "{key} {}: lock file {}: {e}",
                dir.display(),
                p.display()
            ))
        })?;
    // SAFETY: flock on a descriptor `f` owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::Io(format!(
                "{key} {}: cannot lock {}: {e}",
                dir.display(),
                p.display()
            )));
        }
        let mut who = String::new();
        let _ = (&f).take(256).read_to_string(&mut who);
        let who = match who.trim() {
            "" => "a process that has not said who it is".to_string(),
            w => w.to_string(),
        };
        return Err(Error::Check(format!(
            "{key} {} is in use by another run ({who}; lock file {}): two runs writing one \
             checkpoint directory would delete each other's checkpoints. Give this run its own \
             {key}, or wait for that run to end",
            dir.display(),
            p.display()
        )));
    }
    // Say who holds it, for the error above.
    let line = format!("pid {} on {}\n", std::process::id(), host());
    let _ = f.set_len(0).and_then(|()| f.write_all(line.as_bytes()));
    held.push((canon, f));
    Ok(())
}

/// Whether this process holds `dir`'s lock (so nothing else writes there).
pub fn held(dir: &Path) -> bool {
    let Ok(canon) = dir.canonicalize() else {
        return false;
    };
    let held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    held.iter().any(|(d, _)| *d == canon)
}
