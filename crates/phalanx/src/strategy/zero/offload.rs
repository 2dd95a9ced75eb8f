//! Where a ZeRO-3 rank keeps its parameter shard (DeepSpeed ZeRO-Infinity's
//! `offload_param`): in memory ([`InMemory`]) or in a file ([`OnDisk`],
//! `offload_param.device = "nvme"`).
//!
//! Stage 3 touches the shard in two ways only: a block's piece is read when
//! its all-gather is issued, and the optimizer step rewrites the shard. So
//! the store is read and written by ranges, and a file works as well as a
//! vector: with [`OnDisk`] the memory held for parameters is the pieces in
//! flight plus one chunk of the streamed update, never the whole shard.
//!
//! `offload_param.device = "cpu"` keeps the shard in memory ([`InMemory`]):
//! on CPU training the parameters already live in host memory, so there is
//! nothing to move (a GPU build would pin them in host memory there).
//!
//! ```
//! use phalanx::strategy::zero::offload::{OnDisk, ShardStore};
//! let dir = std::env::temp_dir().join(format!("phalanx-doc-shard-{}", std::process::id()));
//! let mut s = OnDisk::create(&dir, "r0", &[1.0, 2.0, 3.0, 4.0]).unwrap();
//! s.write(1..3, &[20.0, 30.0]).unwrap();
//! let mut out = [0f32; 3];
//! s.read(1..4, &mut out).unwrap();
//! assert_eq!(out, [20.0, 30.0, 4.0]);
//! // The file is unlinked as soon as it is open: nothing is left behind,
//! // however the process ends.
//! assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
//! drop(s);
//! std::fs::remove_dir(&dir).unwrap();
//! ```

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A rank's flat parameter shard, read and written by ranges (relative to
/// the start of the shard).
pub trait ShardStore: Send + Sync {
    /// Elements in the shard.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy `range` of the shard into `out` (`range.len()` elements).
    fn read(&self, range: Range<usize>, out: &mut [f32]) -> io::Result<()>;

    /// Overwrite `range` of the shard with `data`.
    fn write(&mut self, range: Range<usize>, data: &[f32]) -> io::Result<()>;

    /// The whole shard, when it is held in memory; `None` for a store that
    /// streams.
    fn resident(&self) -> Option<&[f32]>;

    /// As [`ShardStore::resident`], to update in place.
    fn resident_mut(&mut self) -> Option<&mut [f32]>;

    /// Whether the whole shard is held in memory (and charged as such).
    fn is_resident(&self) -> bool {
        self.resident().is_some()
    }
}

/// The shard in a vector (`offload_param.device` = `none` or `cpu`).
pub struct InMemory(pub Vec<f32>);

fn check(range: &Range<usize>, len: usize, n: usize) -> io::Result<()> {
    if range.start > range.end || range.end > len || range.len() != n {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("range {range:?} of a {len}-element shard with a buffer of {n}"),
        ));
    }
    Ok(())
}

impl ShardStore for InMemory {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> io::Result<()> {
        check(&range, self.0.len(), out.len())?;
        out.copy_from_slice(&self.0[range]);
        Ok(())
    }

    fn write(&mut self, range: Range<usize>, data: &[f32]) -> io::Result<()> {
        check(&range, self.0.len(), data.len())?;
        self.0[range].copy_from_slice(data);
        Ok(())
    }

    fn resident(&self) -> Option<&[f32]> {
        Some(&self.0)
    }

    fn resident_mut(&mut self) -> Option<&mut [f32]> {
        Some(&mut self.0)
    }
}

/// The shard in a file under the offload directory, accessed with
/// positioned reads and writes (`pread`/`pwrite`): no memory map, whose
/// pages would stay resident until the kernel evicts them.
///
/// The file's name holds the tag (the rank), the process id and 128 random
/// bits, and it is created exclusively (never an existing file or link), so
/// jobs sharing a directory cannot collide or be made to write elsewhere.
/// It is unlinked right after it is opened: the open handle keeps the data,
/// and the space is freed when the store is dropped or the process ends in
/// any way (error, panic, signal) — no file is ever left behind.
pub struct OnDisk {
    file: File,
    len: usize,
    path: PathBuf,
}

impl OnDisk {
    /// A new file under `dir` (created if missing) holding `init`.
    /// Errors name the path that could not be created or written.
    pub fn create(dir: &Path, tag: &str, init: &[f32]) -> io::Result<OnDisk> {
        let named = |what: &str, p: &Path, e: io::Error| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot {what} {} for ZeRO-3 parameter offload: {e}",
                    p.display()
                ),
            )
        };
        std::fs::create_dir_all(dir).map_err(|e| named("create the directory", dir, e))?;
        let path = dir.join(format!(
            "phalanx-params-{tag}-{}-{}.bin",
            std::process::id(),
            crate::fsutil::random_hex()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| named("create", &path, e))?;
        // From here on the open handle is the only reference to the data.
        std::fs::remove_file(&path).map_err(|e| named("unlink", &path, e))?;
        let mut s = OnDisk {
            file,
            len: init.len(),
            path,
        };
        s.file
            .set_len(init.len() as u64 * 4)
            .map_err(|e| named("size", &s.path, e))?;
        for lo in (0..init.len()).step_by(CHUNK) {
            let hi = (lo + CHUNK).min(init.len());
            s.write(lo..hi, &init[lo..hi])?;
        }
        Ok(s)
    }

    /// Where the file was created (it is unlinked already).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Elements per chunk of the streamed optimizer update (4 MiB of f32).
pub const CHUNK: usize = 1 << 20;

impl ShardStore for OnDisk {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> io::Result<()> {
        check(&range, self.len, out.len())?;
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(out), range.start as u64 * 4)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "reading offloaded parameters from {}: {e}",
                        self.path.display()
                    ),
                )
            })
    }

    fn write(&mut self, range: Range<usize>, data: &[f32]) -> io::Result<()> {
        check(&range, self.len, data.len())?;
        self.file
            .write_all_at(bytemuck::cast_slice(data), range.start as u64 * 4)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "writing offloaded parameters to {}: {e}",
                        self.path.display()
                    ),
                )
            })
    }

    fn resident(&self) -> Option<&[f32]> {
        None
    }

    fn resident_mut(&mut self) -> Option<&mut [f32]> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_disk_reads_back_what_was_written_and_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("phalanx-shard-test-{}", std::process::id()));
        let init: Vec<f32> = (0..(CHUNK + 7)).map(|i| i as f32).collect();
        let mut s = OnDisk::create(&dir, "t", &init).unwrap();
        assert_eq!(s.len(), init.len());
        let mut out = vec![0f32; 10];
        s.read(CHUNK - 3..CHUNK + 7, &mut out).unwrap();
        assert_eq!(out, init[CHUNK - 3..].to_vec());
        s.write(0..2, &[-1.0, -2.0]).unwrap();
        s.read(0..3, &mut out[..3]).unwrap();
        assert_eq!(&out[..3], &[-1.0, -2.0, 2.0]);
        assert!(s.read(0..3, &mut out[..2]).is_err());
        assert!(s.read(init.len()..init.len() + 1, &mut out[..1]).is_err());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        drop(s);
        let _ = std::fs::remove_dir(&dir);
    }

    #[test]
    fn an_unusable_directory_is_named() {
        let f = std::env::temp_dir().join(format!("phalanx-shard-file-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let dir = f.join("sub");
        let e = OnDisk::create(&dir, "t", &[1.0]).err().unwrap().to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
        std::fs::remove_file(&f).unwrap();
    }
}
