//! Token streams from files: text, nanoGPT `.bin` and llm.c `.bin`.
//!
//! Formats, detected from the file itself:
//! - llm.c (`*.bin` starting with a 256 x int32 little-endian header):
//!   `header[0]` magic, `header[1]` version, `header[2]` token count, then the
//!   tokens. Magic 20240520 / version 1 holds uint16 tokens (GPT-2); magic
//!   20240801 / version 7 holds uint32 tokens (Llama 3), as llm.c's
//!   `dev/data/data_common.py` writes them.
//! - nanoGPT (any other `*.bin`): raw little-endian uint16 tokens, no header.
//! - anything else: UTF-8 text (or any bytes for the byte tokenizer),
//!   tokenized in memory.
//!
//! Binary files are memory-mapped and read in place, so a large file costs no
//! memory beyond the pages that batches touch. The file is closed once
//! mapped (a corpus of thousands of shards would otherwise hold a
//! descriptor each and meet the open-files limit); whether it changed is
//! then checked by its path (see [`TokenData::check_unchanged`]).
//!
//! ```
//! use phalanx::data::{TokenData, Tokenizer};
//! let dir = std::env::temp_dir().join(format!("phalanx-doc-source-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("tiny.bin");
//! std::fs::write(&path, [1u8, 0, 2, 0, 3, 0]).unwrap(); // nanoGPT: u16 LE
//! let data = TokenData::open(&path, Tokenizer::Byte).unwrap();
//! assert_eq!((data.len(), data.get(2)), (3, 3));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

use super::error::{DataError, Result};
use super::tokenizer::Tokenizer;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

/// llm.c's header: 256 int32 values.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;
/// llm.c magic for GPT-2 token files (version 1, uint16 tokens).
pub const LLMC_MAGIC_GPT2: u32 = 20240520;
/// llm.c magic for Llama 3 token files (version 7, uint32 tokens).
pub const LLMC_MAGIC_LLAMA3: u32 = 20240801;

/// Where the tokens came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A text file, tokenized when opened.
    Text,
    /// nanoGPT's raw uint16 `.bin`.
    NanoGpt,
    /// llm.c `.bin` with uint16 tokens (magic 20240520, version 1).
    LlmcU16,
    /// llm.c `.bin` with uint32 tokens (magic 20240801, version 7).
    LlmcU32,
    /// Tokens given in memory.
    Memory,
}

enum Storage {
    Owned(Vec<u32>),
    /// Tokens of `width` bytes, little-endian, starting at byte `offset`.
    Mapped {
        map: Mmap,
        offset: usize,
        width: usize,
        /// The file as mapped: a file truncated under the map would kill
        /// the process with SIGBUS on the next read.
        opened: Stamp,
    },
}

/// What identifies a mapped file without holding it open: device, inode
/// and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    bytes: u64,
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            bytes: m.len(),
        }
    }
}

/// A stream of tokens, owned or memory-mapped.
pub struct TokenData {
    storage: Storage,
    len: usize,
    format: Format,
    path: Option<PathBuf>,
    /// The digest of the tokenizer that encoded a text file held in
    /// memory (see [`TokenData::encoded_from`]).
    tokenizer: Option<String>,
}

impl std::fmt::Debug for TokenData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenData")
            .field("len", &self.len)
            .field("format", &self.format)
            .field("path", &self.path)
            .finish()
    }
}

impl TokenData {
    /// Tokens held in memory.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        TokenData {
            len: tokens.len(),
            storage: Storage::Owned(tokens),
            format: Format::Memory,
            path: None,
            tokenizer: None,
        }
    }

    /// Tokens encoded from the text file `path` by a tokenizer whose
    /// digest is `tokenizer` (see `TextEncoder::content`): the resume
    /// fingerprint then names the file, its content and the tokenizer, as
    /// for a file this crate opens itself.
    pub fn encoded_from(tokens: Vec<u32>, path: &Path, tokenizer: Option<String>) -> Self {
        TokenData {
            path: Some(path.to_path_buf()),
            format: Format::Text,
            tokenizer,
            ..TokenData::from_tokens(tokens)
        }
    }

    /// The digest of the tokenizer that encoded these tokens, where given.
    pub fn tokenizer_content(&self) -> Option<&str> {
        self.tokenizer.as_deref()
    }

    /// Opens a file, detecting its format (see the module docs). The
    /// tokenizer is used only for text files.
    pub fn open(path: impl AsRef<Path>, tokenizer: Tokenizer) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            return Err(format_err(
                path,
                "is a directory, not a token or text file".into(),
            ));
        }
        // A device (/dev/zero) would be read without end, a FIFO would hang.
        if path.exists() {
            crate::fsutil::regular_file("data file", path).map_err(|e| format_err(path, e))?;
        }
        let is_bin = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        if is_bin {
            open_bin(path)
        } else {
            super::paths::refuse_compressed(path, "data.path")?;
            open_text(path, tokenizer)
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The file the tokens came from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// An error naming the file if a memory-mapped file changed since it
    /// was opened: truncated (reading it would end the process with
    /// SIGBUS), replaced or removed. The map holds no descriptor, so the
    /// file is looked up by its path: another file there now means the
    /// mapped one can no longer be checked, and the data is no longer what
    /// a resume would read. (A changed modification time alone is not an
    /// error: scratch file systems' purge policies `touch` files.)
    pub fn check_unchanged(&self) -> Result<()> {
        let Storage::Mapped { opened, .. } = &self.storage else {
            return Ok(());
        };
        let path = self.path.as_deref().unwrap_or(Path::new("?"));
        let now = match std::fs::metadata(path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => {
                return Err(format_err(
                    path,
                    format!("the file can no longer be read during training ({e}); {UNCHANGED}"),
                ))
            }
        };
        let (was, is) = (opened.bytes, now.bytes);
        let what = if (now.dev, now.ino) != (opened.dev, opened.ino) {
            "the file was replaced during training (another file is at its path now)".to_string()
        } else if is < was {
            format!("the file was truncated during training ({was} bytes when opened, {is} now)")
        } else {
            return Ok(());
        };
        Err(format_err(path, format!("{what}; {UNCHANGED}")))
    }

    /// Token `i`. Panics if `i >= len()`, like slice indexing.
    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len, "token index {i} out of range {}", self.len);
        match &self.storage {
            Storage::Owned(v) => v[i],
            Storage::Mapped {
                map, offset, width, ..
            } => read_le(&map[offset + i * width..], *width),
        }
    }

    /// Appends tokens `start..end` to `out`.
    pub fn copy_range(&self, start: usize, end: usize, out: &mut Vec<u32>) {
        assert!(
            start <= end && end <= self.len,
            "range {start}..{end} out of 0..{}",
            self.len
        );
        match &self.storage {
            Storage::Owned(v) => out.extend_from_slice(&v[start..end]),
            Storage::Mapped {
                map, offset, width, ..
            } => {
                let bytes = &map[offset + start * width..offset + end * width];
                out.extend(bytes.chunks_exact(*width).map(|b| read_le(b, *width)));
            }
        }
    }

    /// All tokens as one slice, without a copy, where the storage allows it
    /// (in memory, or uint32 llm.c files on little-endian hosts).
    pub fn as_u32_slice(&self) -> Option<&[u32]> {
        match &self.storage {
            Storage::Owned(v) => Some(v),
            Storage::Mapped {
                map,
                offset,
                width: 4,
                ..
            } if cfg!(target_endian = "little") => {
                bytemuck::try_cast_slice(&map[*offset..offset + self.len * 4]).ok()
            }
            Storage::Mapped { .. } => None,
        }
    }

    /// Fails on the first token id `>= vocab_size`. Reads the whole stream
    /// once (sequentially, so a mapped file streams through the page cache).
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        const BLOCK: usize = 1 << 16;
        let mut buf = Vec::with_capacity(BLOCK);
        for start in (0..self.len).step_by(BLOCK) {
            buf.clear();
            self.copy_range(start, (start + BLOCK).min(self.len), &mut buf);
            if let Some(k) = buf.iter().position(|&t| t as usize >= vocab_size) {
                let e = DataError::Vocab {
                    token: buf[k],
                    position: start + k,
                    vocab_size,
                };
                // Name the file where there is one (a training file and a
                // validation file are both checked).
                return Err(match &self.path {
                    Some(p) => DataError::Format {
                        path: p.clone(),
                        msg: e.to_string(),
                    },
                    None => e,
                });
            }
        }
        Ok(())
    }
}

fn read_le(b: &[u8], width: usize) -> u32 {
    if width == 2 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    } else {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a changed token file's error ends with.
const UNCHANGED: &str = "token files must not change while they are read";

fn format_err(path: &Path, msg: String) -> DataError {
    DataError::Format {
        path: path.to_path_buf(),
        msg,
    }
}

fn open_text(path: &Path, tokenizer: Tokenizer) -> Result<TokenData> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let mut d = TokenData::from_text(bytes, tokenizer, path)?;
    d.path = Some(path.to_path_buf());
    Ok(d)
}

impl TokenData {
    /// Tokenize text held in memory (`name` is for messages; the built-in
    /// corpus is one).
    pub fn from_text(bytes: Vec<u8>, tokenizer: Tokenizer, name: &Path) -> Result<TokenData> {
        let tokens: Vec<u32> = match tokenizer {
            // Any bytes are valid input for the byte tokenizer.
            Tokenizer::Byte => bytes.into_iter().map(u32::from).collect(),
            _ => {
                let text = String::from_utf8(bytes).map_err(|e| {
                    let at = e.utf8_error().valid_up_to();
                    format_err(name, format!("text is not valid UTF-8 at byte {at}"))
                })?;
                tokenizer.encode(&text)
            }
        };
        Ok(TokenData {
            len: tokens.len(),
            storage: Storage::Owned(tokens),
            format: Format::Text,
            path: None,
            tokenizer: None,
        })
    }
}

fn open_bin(path: &Path) -> Result<TokenData> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let meta = file.metadata().map_err(io_err(path))?;
    let size = meta.len() as usize;
    if size == 0 {
        // Mapping an empty file fails on some systems; it simply has no tokens.
        return Ok(TokenData {
            storage: Storage::Owned(Vec::new()),
            len: 0,
            format: Format::NanoGpt,
            path: Some(path.to_path_buf()),
            tokenizer: None,
        });
    }
    // SAFETY: the map is read-only; as with any mmap, the file must not be
    // truncated while training runs (token files are written once, then read).
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    // The map keeps the pages; the descriptor is not needed (see the
    // module docs).
    drop(file);
    let (format, offset, width, len) = detect_bin(path, &map)?;
    Ok(TokenData {
        storage: Storage::Mapped {
            map,
            offset,
            width,
            opened: Stamp::of(&meta),
        },
        len,
        format,
        path: Some(path.to_path_buf()),
        tokenizer: None,
    })
}

/// Returns (format, byte offset of the first token, token width, token count).
fn detect_bin(path: &Path, bytes: &[u8]) -> Result<(Format, usize, usize, usize)> {
    let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    let magic = if bytes.len() >= 4 { word(0) } else { 0 };
    if matches!(magic, LLMC_MAGIC_GPT2 | LLMC_MAGIC_LLAMA3) && bytes.len() < LLMC_HEADER_BYTES {
        // A cut llm.c file, not raw tokens (its magic would be read as
        // two tokens beyond GPT-2's vocabulary, then the header as data).
        return Err(format_err(
            path,
            format!(
                "starts with llm.c magic {magic} but has {} bytes, fewer than the \
                 {LLMC_HEADER_BYTES}-byte llm.c header: the file is truncated",
                bytes.len()
            ),
        ));
    }
    let (format, version, width) = match magic {
        LLMC_MAGIC_GPT2 => (Format::LlmcU16, 1, 2),
        LLMC_MAGIC_LLAMA3 => (Format::LlmcU32, 7, 4),
        _ => {
            // Megatron-LM's indexed datasets are `name.bin` + `name.idx`,
            // with int32 tokens for large vocabularies: read as uint16 they
            // would be garbage that still passes the vocabulary check.
            if path.with_extension("idx").is_file() {
                return Err(format_err(
                    path,
                    format!(
                        "no llm.c header, and {} lies beside it: a Megatron-LM indexed dataset, \
                         which Phalanx does not read; tokenize the text with `phalanx tokenize`",
                        path.with_extension("idx").display()
                    ),
                ));
            }
            if !bytes.len().is_multiple_of(2) {
                return Err(format_err(
                    path,
                    format!(
                        "{} bytes is not a whole number of uint16 tokens (nanoGPT format); \
                         an llm.c file would start with magic {LLMC_MAGIC_GPT2}",
                        bytes.len()
                    ),
                ));
            }
            return Ok((Format::NanoGpt, 0, 2, bytes.len() / 2));
        }
    };
    // A file that starts with llm.c's magic is llm.c's: report a bad header
    // rather than silently reading it as raw tokens.
    if word(1) != version {
        return Err(format_err(
            path,
            format!(
                "llm.c magic {magic} expects version {version}, found {}",
                word(1)
            ),
        ));
    }
    let count = word(2) as usize;
    let expected = LLMC_HEADER_BYTES + count * width;
    if bytes.len() != expected {
        return Err(format_err(
            path,
            format!(
                "llm.c header says {count} tokens of {width} bytes ({expected} bytes with the \
                 header), but the file has {} bytes",
                bytes.len()
            ),
        ));
    }
    Ok((format, LLMC_HEADER_BYTES, width, count))
}
