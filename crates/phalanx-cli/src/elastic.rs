//! torchrun's error file: a worker started by torchrun (torchelastic) gets
//! `TORCHELASTIC_ERROR_FILE`, and torchrun's failure summary reads the root
//! cause from it (without it the summary says `error_file: <N/A>`). A
//! failing command writes its message there in torchelastic's JSON shape:
//!
//! ```json
//! {"message": {"message": "rank 1 (host): phalanx train: ...",
//!              "extraInfo": {"py_callstack": "...", "timestamp": "1764633600"}}}
//! ```
//!
//! written whole (temporary file + rename), so the agent never reads half
//! of it.

use std::fmt::Display;
use std::path::Path;

/// Print `prefix: msg` on stderr and, under torchrun, record it in the
/// error file.
pub fn fail(prefix: &str, msg: impl Display) {
    let text = format!("{prefix}: {msg}");
    crate::launch::say!("{text}");
    let path = std::env::var_os("TORCHELASTIC_ERROR_FILE").filter(|p| !p.is_empty());
    if let Some(path) = path {
        if let Err(e) = record(Path::new(&path), &text) {
            crate::launch::say!(
                "{prefix}: cannot write TORCHELASTIC_ERROR_FILE {}: {e}",
                Path::new(&path).display()
            );
        }
    }
}

/// The JSON torchelastic's error handler writes, for `message`.
pub fn error_json(message: &str, rank: Option<&str>, host: &str, timestamp: u64) -> String {
    let who = match rank {
        Some(r) => format!("rank {r} ({host})"),
        None => host.to_string(),
    };
    serde_json::json!({
        "message": {
            "message": format!("{who}: {message}"),
            "extraInfo": {
                "py_callstack": format!(
                    "{message}\n(phalanx, a Rust program: no Python call stack; {who}, pid {})",
                    std::process::id()
                ),
                "timestamp": timestamp.to_string(),
            }
        }
    })
    .to_string()
}

fn record(path: &Path, message: &str) -> std::io::Result<()> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into());
    let rank = std::env::var("RANK").ok();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let json = error_json(message, rank.as_deref(), &host, now);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, json)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}
