//! A sampled digest of data files, part of the resume fingerprint.
//!
//! Names and sizes alone do not tell regenerated data apart: every full
//! shard `phalanx tokenize` (or llm.c) writes has the same size, and a
//! re-run on other text keeps the names. Hashing whole files would read the
//! corpus at every start, so each file contributes its size and three
//! 4 KiB windows (its start, middle and end): 12 KiB read per file, 120 MB
//! for 10,000 shards. An edit that keeps the size and misses all three
//! windows still passes; any regeneration from other text does not.
//!
//! ```
//! # let d = phalanx::fsutil::ScratchDir::new("phalanx", "digest-doc");
//! let (a, b) = (d.join("a.bin"), d.join("b.bin"));
//! std::fs::write(&a, vec![1u8; 100_000]).unwrap();
//! std::fs::write(&b, vec![1u8; 100_000]).unwrap();
//! let same = phalanx::data::digest::of_files(&[a.clone()]).unwrap();
//! assert_eq!(same, phalanx::data::digest::of_files(&[b.clone()]).unwrap());
//! let mut v = vec![1u8; 100_000];
//! v[99_999] = 2; // the same size, the last byte changed
//! std::fs::write(&b, v).unwrap();
//! assert_ne!(same, phalanx::data::digest::of_files(&[b]).unwrap());
//! ```

use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const WINDOW: u64 = 4096;

/// The digest of a small file read whole (a `tokenizer.json`, where one
/// changed id anywhere is another tokenizer), as 32 hex digits.
pub fn of_whole_file(f: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(f)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", f.display())))?;
    Ok(Sha256::digest(&bytes)[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The digest of `files` in order, as 32 hex digits.
pub fn of_files(files: &[PathBuf]) -> std::io::Result<String> {
    let mut h = Sha256::new();
    for f in files {
        sample(f, &mut h)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", f.display())))?;
    }
    Ok(h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn sample(f: &Path, h: &mut Sha256) -> std::io::Result<()> {
    // Never a FIFO (the open would wait for a writer) or a device.
    crate::fsutil::regular_file("data file", f).map_err(std::io::Error::other)?;
    let mut file = std::fs::File::open(f)?;
    let len = file.metadata()?.len();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; WINDOW as usize];
    for at in [
        0,
        len.saturating_sub(WINDOW) / 2,
        len.saturating_sub(WINDOW),
    ] {
        let n = WINDOW.min(len - at.min(len)) as usize;
        file.seek(SeekFrom::Start(at))?;
        file.read_exact(&mut buf[..n])?;
        h.update(&buf[..n]);
    }
    Ok(())
}
