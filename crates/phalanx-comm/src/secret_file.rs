//! The secret of a single-host job started without `PHALANX_SECRET` (by
//! torchrun, mpirun or srun; `phalanx run` makes one for its workers).
//!
//! It used to be `phalanx-job-<jobid>-127.0.0.1-<port>`, which any local
//! user can compute, and so join the job or read its store. Now rank 0
//! makes a random secret and writes it to a file only this user can read:
//!
//! - the directory is `$XDG_RUNTIME_DIR/phalanx` (when `XDG_RUNTIME_DIR` is
//!   a directory of this user's that nobody else may enter), else
//!   `<temp dir>/phalanx-<uid>`; either is created with mode 0700, and used
//!   only if it is a real directory (not a link), owned by this user, with
//!   no access for group or others — another user who created it first
//!   makes the job fail, naming the directory, rather than see the secret;
//! - the file is `job-<hash>.secret`, the hash of what identifies the job
//!   on this host (the launcher's job id and attempt, the store's address
//!   and port), written with mode 0600 through a temporary and a rename so
//!   a reader never sees half of it; readers check its owner and mode too;
//! - the other ranks wait for the file (up to the set-up timeout) and read
//!   it. A file left by an earlier job with the same identity may be read
//!   before rank 0 replaces it: its secret fails the handshake with the
//!   store (or, under torchrun's agent store, does not match the
//!   fingerprint rank 0 publishes there), and the rank reads the file again;
//! - rank 0 removes the file when its process group is dropped.

use crate::error::{invalid, CommError, Result};
use crate::wire;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Why `dir` is not a private directory of this user, if it is not.
fn not_private(dir: &Path) -> Option<String> {
    let m = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) => return Some(format!("cannot inspect it: {e}")),
    };
    if !m.file_type().is_dir() {
        return Some("it is not a directory (or is a symbolic link)".into());
    }
    if m.uid() != uid() {
        return Some(format!("it belongs to uid {}, not {}", m.uid(), uid()));
    }
    if m.mode() & 0o077 != 0 {
        return Some(format!(
            "its mode is {:o}: group or others have access",
            m.mode() & 0o777
        ));
    }
    None
}

/// Create `dir` with mode 0700 if it is missing, then check it is ours.
fn private_dir(dir: PathBuf) -> Result<PathBuf> {
    let mut b = std::fs::DirBuilder::new();
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    match b.create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(CommError::Io(format!(
                "cannot create {} for the job secret: {e}",
                dir.display()
            )))
        }
    }
    match not_private(&dir) {
        None => Ok(dir),
        Some(why) => Err(invalid!(
            "{} cannot hold the job secret: {why}. Remove it, or export a \
             PHALANX_SECRET to every rank (`export PHALANX_SECRET=$(openssl rand -hex 32)`)",
            dir.display()
        )),
    }
}

/// This user's runtime directory for job secrets (see the module docs);
/// created and checked when a secret is written or read, not here.
pub fn runtime_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|x| !x.is_empty()) {
        let x = PathBuf::from(x);
        if not_private(&x).is_none() {
            return x.join("phalanx");
        }
    }
    std::env::temp_dir().join(format!("phalanx-{}", uid()))
}

/// Where the secret of the job identified by `job` lives.
pub fn path_for(job: &str) -> PathBuf {
    let h = Sha256::digest(job.as_bytes());
    runtime_dir().join(format!("job-{}.secret", &wire::to_hex(&h)[..32]))
}

fn parent(path: &Path) -> PathBuf {
    path.parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Rank 0: a fresh random secret, written to `path` (0600, whole).
pub fn create(path: &Path) -> Result<Vec<u8>> {
    private_dir(parent(path))?;
    let secret = wire::random_bytes(32);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        // The umask cannot have widened it, but say so explicitly.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(wire::to_hex(&secret).as_bytes())?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        CommError::Io(format!(
            "cannot write the job secret {}: {e}",
            path.display()
        ))
    })?;
    Ok(secret)
}

/// The secret in `path`, if the file is there; refused unless it is a
/// regular file of this user's that nobody else may read.
pub fn read(path: &Path) -> Result<Option<Vec<u8>>> {
    let dir = parent(path);
    if !dir.exists() {
        return Ok(None); // rank 0 has not made it yet
    }
    if let Some(why) = not_private(&dir) {
        return Err(invalid!(
            "{} cannot hold the job secret: {why}. Remove it, or export a \
             PHALANX_SECRET to every rank",
            dir.display()
        ));
    }
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CommError::Io(format!("{}: {e}", path.display()))),
    };
    if !m.file_type().is_file() || m.uid() != uid() || m.mode() & 0o077 != 0 {
        return Err(invalid!(
            "{} is not a private file of this user (uid {}, mode {:o}): remove it",
            path.display(),
            m.uid(),
            m.mode() & 0o777
        ));
    }
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        // Replaced between the two calls: read it next time.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CommError::Io(format!("{}: {e}", path.display()))),
    };
    wire::from_hex(text.trim())
        .map(Some)
        .ok_or_else(|| invalid!("{} does not hold a hex secret", path.display()))
}

/// Wait until `path` exists (rank 0 writes it at its start), then read it.
pub fn wait_read(path: &Path, rank: usize, deadline: Instant) -> Result<Vec<u8>> {
    let mut waiting = crate::patience::Waiting::until(deadline);
    loop {
        if let Some(s) = read(path)? {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            return Err(CommError::Timeout(format!(
                "rank {rank}: the job secret {} did not appear (rank 0 writes it when it \
                 starts: is rank 0 running on this host, as this user?)",
                path.display()
            )));
        }
        waiting.tick(|| {
            format!(
                "rank {rank}: still waiting for the job secret {}, which rank 0 writes when \
                 it starts on this host",
                path.display()
            )
        });
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The mark a launcher leaves of a secret it made (`wire::SECRET_MADE`),
/// revealing nothing of it: whether the `PHALANX_SECRET` of a process is
/// that one.
pub fn made_mark(secret_hex: &str) -> String {
    fingerprint(secret_hex.trim().as_bytes())
}

/// What rank 0 publishes in an unauthenticated store so the others know
/// they read its secret and not a stale one; reveals nothing of it.
pub fn fingerprint(secret: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"phalanx secret fingerprint\0");
    h.update(secret);
    wire::to_hex(&h.finalize())[..32].to_string()
}

/// Removes rank 0's secret file when its group is dropped.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
