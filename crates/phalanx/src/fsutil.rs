//! Writing files whole: a temporary file beside the target (created with
//! the process umask, like every other tool), fsynced, then renamed over
//! the target; on any error the temporary is removed and the target is
//! untouched.
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
