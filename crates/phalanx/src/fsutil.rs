//! Reading files within bounds ([`read_capped`]: regular files only, at
//! most a cap, so `/dev/zero`, a FIFO or a runaway file is an error naming
//! it, never an endless read or a hang), and writing files whole: a
//! temporary file beside the target (created with
//! the process umask, like every other tool), fsynced, then renamed over
//! the target; on any error the temporary is removed and the target is
//! untouched. On Linux the temporary has no name while it is written
//! (`O_TMPFILE`) and is linked in only for the rename, so a process killed
//! mid-write (Ctrl-C, SIGKILL) leaves nothing behind.
//!
//! ```
//! let d = std::env::temp_dir().join(format!("phalanx-fsutil-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&d).unwrap();
//! phalanx::fsutil::write_atomic(&d.join("a.txt"), b"hello").unwrap();
//! assert_eq!(std::fs::read(d.join("a.txt")).unwrap(), b"hello");
//! assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1); // no temporary left
//! std::fs::remove_dir_all(&d).unwrap();
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};

/// Caps for what Phalanx reads whole: a config (TOML, DeepSpeed JSON or a
/// model's `config.json`), a checkpoint's `latest`.
pub const CONFIG_CAP: u64 = 16 << 20;
/// A checkpoint's `metadata.json` (one entry per tensor region and rank).
pub const METADATA_CAP: u64 = 1 << 30;
/// A JSON log or a trace that `phalanx report` reads.
pub const LOG_CAP: u64 = 4 << 30;

/// `path` (`what` names it in errors: a flag or a key) if it is a regular
/// file, after following symbolic links: a device such as `/dev/zero`
/// would never end, and opening a FIFO waits for a writer.
pub fn regular_file(what: &str, path: &Path) -> Result<std::fs::Metadata, String> {
    let m = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if !m.is_file() {
        let kind = if m.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device, FIFO or socket)"
        };
        return Err(format!("{what} {} is {kind}", path.display()));
    }
    Ok(m)
}

/// The bytes of regular file `path`, at most `cap` of them: larger is an
/// error naming the file and the cap (also when it grows while read).
pub fn read_capped(what: &str, path: &Path, cap: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let m = regular_file(what, path)?;
    let too_big = || {
        format!(
            "{what} {} is larger than {} MiB, more than such a file can be: refusing to read it",
            path.display(),
            cap >> 20
        )
    };
    if m.len() > cap {
        return Err(too_big());
    }
    let f = std::fs::File::open(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let mut out = Vec::with_capacity(m.len() as usize);
    f.take(cap + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if out.len() as u64 > cap {
        return Err(too_big());
    }
    Ok(out)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(what: &str, path: &Path, cap: u64) -> Result<String, String> {
    String::from_utf8(read_capped(what, path, cap)?)
        .map_err(|_| format!("{what} {} is not UTF-8 text", path.display()))
}

/// The temporary `write_atomic` uses for `path`.
fn temp_for(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Write `bytes` to `path` whole (see the module docs). Errors name the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temp_for(path);
    match write_unnamed(path, &tmp, bytes) {
        Ok(true) => return Ok(()),
        Ok(false) => {} // no O_TMPFILE here: a named temporary
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            ));
        }
    }
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(named)
}

/// Write through an unnamed file (`O_TMPFILE`) linked in at the end as
/// `tmp`, then renamed to `path`. `Ok(false)`: the file system has no
/// unnamed files; the caller falls back to a named temporary.
#[cfg(target_os = "linux")]
fn write_unnamed(path: &Path, tmp: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::FromRawFd;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let cdir = CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: plain syscalls on owned C strings; the fd is owned by `f`.
    let fd = unsafe {
        libc::open(
            cdir.as_ptr(),
            libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC,
            0o666,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL) => Ok(false),
            _ => Err(e),
        };
    }
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.write_all(bytes)?;
    f.sync_all()?;
    let proc_path = CString::new(format!("/proc/self/fd/{fd}"))?;
    let ctmp = CString::new(tmp.as_os_str().as_bytes())?;
    let r = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_path.as_ptr(),
            libc::AT_FDCWD,
            ctmp.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if r != 0 {
        // No /proc to link through: the caller writes a named temporary.
        return Ok(false);
    }
    std::fs::rename(tmp, path)?;
    Ok(true)
}

#[cfg(not(target_os = "linux"))]
fn write_unnamed(_: &Path, _: &Path, _: &[u8]) -> std::io::Result<bool> {
    Ok(false)
}

/// A fresh, empty directory under the system's temporary directory
/// (`prefix-name-pid-n`, n counting this process's scratch directories, so
/// tests of different files merged into one binary never share one),
/// removed with everything in it when dropped, also when a test panics.
/// Tests and examples take their scratch space from it;
/// `PHALANX_KEEP_SCRATCH=1` keeps it for a look afterwards.
///
/// ```
/// let d = phalanx::fsutil::ScratchDir::new("phalanx-doc", "scratch");
/// std::fs::write(d.join("a.txt"), b"x").unwrap();
/// let path = d.to_path_buf();
/// drop(d);
/// assert!(!path.exists());
/// ```
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(prefix: &str, name: &str) -> ScratchDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let d = std::env::temp_dir().join(format!("{prefix}-{name}-{pid}-{n}"));
        let _ = std::fs::remove_dir_all(&d);
        if let Err(e) = std::fs::create_dir_all(&d) {
            panic!("creating {}: {e}", d.display());
        }
        ScratchDir(d)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let keep = std::env::var("PHALANX_KEEP_SCRATCH").is_ok_and(|v| !v.is_empty() && v != "0");
        if !keep {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for ScratchDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

/// 32 hex digits from the OS's random source (or, failing that, std's
/// randomly keyed hasher).
pub(crate) fn random_hex() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !ok {
        use std::hash::{BuildHasher, Hasher};
        for (i, c) in b.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_usize(i);
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            c.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}
