//! Outputs never cost a run: every output path of `phalanx train` is
//! checked before any rank starts — it can be written (its directory exists
//! or can be made and takes a file), it is not a directory, it is not an
//! input (the data file, the `--init-from` model), and no two outputs are
//! the same file.

use std::path::{Path, PathBuf};

/// The absolute form of `p`, resolving what exists of it.
fn resolve(p: &Path) -> PathBuf {
    if let Ok(c) = p.canonicalize() {
        return c;
    }
    match (p.parent(), p.file_name()) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            dir.canonicalize()
                .map(|d| d.join(name))
                .unwrap_or_else(|_| p.to_path_buf())
        }
        _ => p.to_path_buf(),
    }
}

/// Check `outputs` (what, path) against each other and `inputs`.
pub fn check(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<(), String> {
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for (what, p) in outputs {
        if p.is_dir() {
            return Err(format!("{what} {} is a directory, not a file", p.display()));
        }
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("{what} {}: cannot create its directory: {e}", p.display()))?;
        let probe = dir.join(format!(".phalanx-probe-{}", std::process::id()));
        std::fs::write(&probe, b"")
            .map_err(|e| format!("{what} {}: its directory is not writable: {e}", p.display()))?;
        let _ = std::fs::remove_file(&probe);
        let r = resolve(p);
        for (iwhat, ip) in inputs {
            if resolve(ip) == r {
                return Err(format!(
                    "{what} {} is the {iwhat}: refusing to overwrite an input",
                    p.display()
                ));
            }
        }
        if let Some((other, _)) = seen.iter().find(|(_, q)| *q == r) {
            return Err(format!(
                "{what} and {other} are the same file {}",
                p.display()
            ));
        }
        seen.push((what, r));
    }
    Ok(())
}
