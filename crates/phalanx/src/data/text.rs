//! Text shards (JSONL, plain text) streamed: read and tokenized ahead by a
//! background thread into a bounded queue, so a large corpus starts
//! training at once and memory stays bounded by a few shards.
//!
//! The order is a pure function of the seed and the position, without an
//! index built in advance: the source is one endless token stream, epoch
//! after epoch. Epoch `e` visits the shards in the order
//! `perm(shards, seed_s, e)`; a shard's documents (JSONL lines with the
//! `field` key; a plain text file is one document) are tokenized and
//! placed in the order `perm(docs, seed_s ^ mix(shard), e)` (file order
//! without `data.shuffle`), each followed by the separator (the
//! tokenizer's end-of-text token; a newline for the byte tokenizer, which
//! has none). Sample `k` is `stream[kT .. kT + T + 1]`. Random access to a
//! text stream needs every shard before it tokenized, so each rank reads
//! the stream in order and keeps a window of recent shards; a position
//! outside the window restarts the reader at the nearest known shard start
//! (a cursor: epoch, slot, stream offset). A checkpoint stores the cursor
//! of the shard holding its position, so a resume tokenizes from there,
//! not from the start. Shards are tokenized with `threads` threads; the
//! result does not depend on how many.

use super::error::{DataError, Result};
use super::shuffle::{mix64, permutation};
use super::tokenizer::Tokenizer;
use super::OnBadRecord;
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

/// Turns text into token ids (the built-in tokenizers implement it; a
/// Hugging Face `tokenizer.json` does in `phalanx-models`).
pub trait TextEncoder: Send + Sync {
    /// The text's token ids; an error (what the tokenizer said) makes the
    /// document a bad record (`data.on_bad_record`), never an empty one.
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String>;
    /// Tokens put after every document.
    fn separator(&self) -> Vec<u32>;
    /// Its name, part of the data fingerprint a resume checks.
    fn name(&self) -> String;
    /// A digest of what defines it where that can change under the same
    /// name (a `tokenizer.json`'s bytes), part of the fingerprint too
    /// (`tokenizer_content`); `None` for the built-in tokenizers.
    fn content(&self) -> Option<String> {
        None
    }
    /// The ids it gives are below this, where every model must hold them
    /// all (checked before training); `None`: the text decides (bytes:
    /// ASCII text fits a vocabulary of 128).
    fn vocab_size(&self) -> Option<usize> {
        None
    }
}

impl TextEncoder for Tokenizer {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        Ok(Tokenizer::encode(self, text))
    }
    fn separator(&self) -> Vec<u32> {
        match self.eot_token() {
            Some(t) => vec![t],
            None => vec![u32::from(b'\n')],
        }
    }
    fn name(&self) -> String {
        Tokenizer::name(self).to_string()
    }
    fn vocab_size(&self) -> Option<usize> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Gpt2 => Some(Tokenizer::vocab_size(self)),
        }
    }
}

/// An error where `encoder` gives ids a model of `vocab` cannot hold (see
/// [`TextEncoder::vocab_size`]): before training, not at the first batch
/// that meets a high id.
pub fn check_fits(encoder: &dyn TextEncoder, vocab: usize) -> Result<()> {
    match encoder.vocab_size() {
        Some(n) => vocab_fits(&encoder.name(), n, vocab).map_err(DataError::Config),
        None => Ok(()),
    }
}

/// The refusal of tokenizer `name`, of `n` ids, for a model of `vocab`
/// (also for a `tokenizer.json`, read in `phalanx-models`).
pub fn vocab_fits(name: &str, n: usize, vocab: usize) -> std::result::Result<(), String> {
    if n > vocab {
        return Err(format!(
            "data.tokenizer {name} has a vocabulary of {n} tokens, more than model.vocab_size = \
             {vocab}; set model.vocab_size to at least {n}"
        ));
    }
    Ok(())
}

/// Counters the JSON log reports (shared by every text source of a loader).
#[derive(Debug, Default)]
pub struct TextStats {
    pub tokens: AtomicU64,
    pub bytes: AtomicU64,
    /// Nanoseconds spent reading and tokenizing.
    pub busy_ns: AtomicU64,
    /// Shards tokenized and waiting in the queues.
    pub queued: AtomicI64,
    /// Records skipped under `data.on_bad_record = "skip"`, each once (a
    /// shard is tokenized again every epoch, ahead, and after a restart).
    pub skipped: AtomicU64,
    /// The files whose skipped records are counted.
    counted: Mutex<std::collections::HashSet<PathBuf>>,
}

/// What a text source reads (see the module docs).
pub struct TextSpec {
    pub files: Vec<PathBuf>,
    pub field: String,
    /// The key `field` came from, for messages.
    pub field_key: String,
    pub on_bad: OnBadRecord,
    pub encoder: Arc<dyn TextEncoder>,
    pub shuffle: bool,
    pub seed: u64,
    pub threads: usize,
    /// Tokenized shards queued ahead of the reader.
    pub prefetch: usize,
}

pub use super::records::is_jsonl;
use super::records::record_text;

/// A shard start in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub slot: u64,
    /// The stream offset (tokens) of that shard's first token.
    pub offset: u64,
}

struct Chunk {
    at: Cursor,
    tokens: Arc<Vec<u32>>,
}

struct Stream {
    rx: Receiver<Result<Chunk>>,
    chunks: VecDeque<Chunk>,
    /// Where the next chunk from `rx` starts.
    next: u64,
}

impl Stream {
    fn start(&self) -> u64 {
        self.chunks.front().map_or(self.next, |c| c.at.offset)
    }
}

struct State {
    stream: Option<Stream>,
    /// Every shard start seen (and the resume cursor), by offset.
    cursors: BTreeMap<u64, Cursor>,
    error: Option<String>,
}

/// A streamed text source.
pub struct TextSource {
    spec: Arc<TextSpec>,
    stats: Arc<TextStats>,
    state: Mutex<State>,
    seq_len: usize,
}

/// Tokens kept behind the reader for ranks that lag (tokens, 16 MiB).
const RETAIN: usize = 1 << 22;

impl TextSource {
    /// Checks every file up front (exists, not empty, a JSONL file's first
    /// record parses and holds the field) so that most mistakes stop the
    /// run before it starts, naming the file and line.
    pub fn new(spec: TextSpec, seq_len: usize, stats: Arc<TextStats>) -> Result<TextSource> {
        for f in &spec.files {
            check_first_record(f, &spec)?;
        }
        let mut cursors = BTreeMap::new();
        cursors.insert(
            0,
            Cursor {
                epoch: 0,
                slot: 0,
                offset: 0,
            },
        );
        Ok(TextSource {
            spec: Arc::new(spec),
            stats,
            state: Mutex::new(State {
                stream: None,
                cursors,
                error: None,
            }),
            seq_len,
        })
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.spec.files
    }

    /// The first shard's tokens, read at once (a validation file).
    pub fn whole_shard(&self) -> Result<Vec<u32>> {
        shard_tokens(&self.spec, &self.stats, 0, 0)
    }

    /// Appends sample `k`'s inputs and targets.
    pub fn push_sample(&self, k: u64, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) -> Result<()> {
        let t = self.seq_len;
        let mut buf = Vec::with_capacity(t + 1);
        self.read(k * t as u64, t + 1, &mut buf)?;
        inputs.extend_from_slice(&buf[..t]);
        targets.extend_from_slice(&buf[1..]);
        Ok(())
    }

    /// The cursor of the shard holding sample `k`'s first token.
    pub fn cursor_of(&self, k: u64) -> Result<Cursor> {
        let at = k * self.seq_len as u64;
        self.read(at, 1, &mut Vec::new())?;
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (_, c) = st
            .cursors
            .range(..=at)
            .next_back()
            .expect("offset 0 is always known");
        Ok(*c)
    }

    /// Continue from a saved cursor: positions at or after it are read
    /// from its shard on, without tokenizing the shards before it.
    pub fn add_cursor(&self, c: Cursor) -> Result<()> {
        if c.slot >= self.spec.files.len() as u64 {
            return Err(DataError::Config(format!(
                "the checkpoint's data cursor names shard slot {} of {} files",
                c.slot,
                self.spec.files.len()
            )));
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.cursors.insert(c.offset, c);
        st.stream = None;
        Ok(())
    }

    fn read(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = &st.error {
            return Err(DataError::Config(e.clone()));
        }
        let end = start + len as u64;
        if st.stream.as_ref().is_none_or(|s| s.start() > start) {
            let (_, c) = st.cursors.range(..=start).next_back().expect("offset 0");
            let c = *c;
            st.stream = Some(self.spawn(c));
        }
        loop {
            let s = st.stream.as_mut().expect("just set");
            if s.next >= end {
                break;
            }
            let chunk = match s.rx.recv() {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    st.error = Some(e.to_string());
                    st.stream = None;
                    return Err(e);
                }
                Err(_) => {
                    st.stream = None;
                    return Err(DataError::Config(
                        "the text loader thread ended unexpectedly".into(),
                    ));
                }
            };
            self.stats.queued.fetch_sub(1, Relaxed);
            s.next = chunk.at.offset + chunk.tokens.len() as u64;
            let at = chunk.at;
            s.chunks.push_back(chunk);
            // Drop shards wholly before this read, keeping RETAIN tokens
            // behind it for ranks that share this loader and lag.
            let mut kept: usize = s.chunks.iter().map(|c| c.tokens.len()).sum();
            while s.chunks.len() > 1 {
                let f = &s.chunks[0];
                let f_end = f.at.offset + f.tokens.len() as u64;
                if f_end > start || kept - f.tokens.len() < RETAIN {
                    break;
                }
                kept -= f.tokens.len();
                s.chunks.pop_front();
            }
            st.cursors.insert(at.offset, at);
        }
        let s = st.stream.as_ref().expect("set");
        let mut pos = start;
        for c in &s.chunks {
            let c_end = c.at.offset + c.tokens.len() as u64;
            if c_end <= pos || pos >= end {
                continue;
            }
            let a = (pos - c.at.offset) as usize;
            let b = (end.min(c_end) - c.at.offset) as usize;
            out.extend_from_slice(&c.tokens[a..b]);
            pos = end.min(c_end);
        }
        debug_assert_eq!(pos, end);
        Ok(())
    }

    fn spawn(&self, from: Cursor) -> Stream {
        let (tx, rx) = sync_channel(self.spec.prefetch.max(1));
        let (spec, stats) = (self.spec.clone(), self.stats.clone());
        std::thread::Builder::new()
            .name("phalanx-text-loader".into())
            .spawn(move || produce(&spec, &stats, from, tx))
            .expect("spawn the text loader thread");
        Stream {
            rx,
            chunks: VecDeque::new(),
            next: from.offset,
        }
    }
}

/// The reader thread: shard after shard, epoch after epoch, until the
/// receiver is dropped or a record fails.
fn produce(spec: &TextSpec, stats: &TextStats, from: Cursor, tx: SyncSender<Result<Chunk>>) {
    let n = spec.files.len() as u64;
    let (mut epoch, mut slot, mut offset) = (from.epoch, from.slot, from.offset);
    let mut whole_epoch = slot == 0;
    loop {
        let order = if spec.shuffle {
            permutation(n, spec.seed, epoch)
        } else {
            (0..n).collect()
        };
        let mut epoch_tokens = 0u64;
        while slot < n {
            let shard = order[slot as usize] as usize;
            let t0 = std::time::Instant::now();
            let r = shard_tokens(spec, stats, shard, epoch);
            stats
                .busy_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            let tokens = match r {
                Ok(t) => t,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let len = tokens.len() as u64;
            stats.tokens.fetch_add(len, Relaxed);
            stats.queued.fetch_add(1, Relaxed);
            let at = Cursor {
                epoch,
                slot,
                offset,
            };
            let chunk = Chunk {
                at,
                tokens: Arc::new(tokens),
            };
            if tx.send(Ok(chunk)).is_err() {
                stats.queued.fetch_sub(1, Relaxed);
                return;
            }
            offset += len;
            epoch_tokens += len;
            slot += 1;
        }
        if whole_epoch && epoch_tokens == 0 {
            let names: Vec<_> = spec.files.iter().map(|f| f.display().to_string()).collect();
            let _ = tx.send(Err(DataError::TooSmall(format!(
                "the text source {names:?} gave no tokens in a whole epoch (every record skipped?)"
            ))));
            return;
        }
        epoch += 1;
        slot = 0;
        whole_epoch = true;
    }
}

/// A bad record: (1-based line, what is wrong).
type Bad = (usize, String);

fn bad_err(path: &Path, (line, msg): Bad) -> DataError {
    DataError::Format {
        path: path.to_path_buf(),
        // (Line 0: the message says where, as a Parquet row.)
        msg: if line == 0 {
            msg
        } else {
            format!("line {line}: {msg}")
        },
    }
}

/// Shard `shard`'s tokens for `epoch`: documents in (shuffled) order, each
/// followed by the separator.
fn shard_tokens(spec: &TextSpec, stats: &TextStats, shard: usize, epoch: u64) -> Result<Vec<u32>> {
    let path = &spec.files[shard];
    let threads = spec.threads.max(1);
    let texts = if super::records::is_parquet(path) {
        let n = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        stats.bytes.fetch_add(n, Relaxed);
        super::records::documents(path, &spec.field, &spec.field_key, threads)?
    } else {
        super::paths::check_regular(path)?;
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        stats.bytes.fetch_add(bytes.len() as u64, Relaxed);
        super::records::documents_of(
            &bytes,
            is_jsonl(path),
            &spec.field,
            &spec.field_key,
            threads,
        )
    };
    // Encode on `threads` threads, in order.
    let at: Vec<usize> = (0..texts.len()).collect();
    let docs: Vec<std::result::Result<Vec<u32>, Bad>> =
        super::records::par_map(&at, threads, |&i| {
            let t = texts[i].as_ref().map_err(Clone::clone)?;
            spec.encoder.encode(t).map_err(|e| {
                // (Line 0: the message says which record.)
                let n = t.chars().count();
                (
                    0,
                    format!(
                        "record {} ({n} characters) could not be tokenized: {e}",
                        i + 1
                    ),
                )
            })
        });
    let mut good = Vec::with_capacity(docs.len());
    let mut skipped = 0;
    for d in docs {
        match d {
            Ok(t) => good.push(t),
            Err(bad) => match spec.on_bad {
                OnBadRecord::Error => return Err(bad_err(path, bad)),
                OnBadRecord::Skip => skipped += 1,
            },
        }
    }
    let mut counted = stats.counted.lock().unwrap_or_else(|e| e.into_inner());
    if skipped > 0 && counted.insert(path.clone()) {
        stats.skipped.fetch_add(skipped, Relaxed);
    }
    drop(counted);
    let order: Vec<u64> = if spec.shuffle {
        permutation(
            good.len() as u64,
            spec.seed ^ mix64(shard as u64 + 1),
            epoch,
        )
    } else {
        (0..good.len() as u64).collect()
    };
    let sep = spec.encoder.separator();
    let total: usize = good.iter().map(|d| d.len() + sep.len()).sum();
    let mut out = Vec::with_capacity(total);
    for i in order {
        out.extend_from_slice(&good[i as usize]);
        out.extend_from_slice(&sep);
    }
    Ok(out)
}

/// The checks made before training: the file reads, is not empty, and a
/// JSONL file's first record is good (with `skip`, only that it reads).
fn check_first_record(path: &Path, spec: &TextSpec) -> Result<()> {
    use std::io::BufRead;
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    super::paths::check_regular(path)?;
    let f = std::fs::File::open(path).map_err(io)?;
    if f.metadata().map_err(io)?.len() == 0 {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            msg: "the file is empty".into(),
        });
    }
    if super::records::is_parquet(path) {
        // The column is there, a string, and there are rows.
        return super::records::check_parquet(path, &spec.field, &spec.field_key);
    }
    if !is_jsonl(path) || spec.on_bad == OnBadRecord::Skip {
        return Ok(());
    }
    let mut r = std::io::BufReader::new(f);
    let mut line = Vec::new();
    let mut n = 0;
    loop {
        line.clear();
        if r.read_until(b'\n', &mut line).map_err(io)? == 0 {
            return Err(DataError::Format {
                path: path.to_path_buf(),
                msg: "no records (only blank lines)".into(),
            });
        }
        n += 1;
        let l = line.strip_suffix(b"\n").unwrap_or(&line);
        let l = l.strip_suffix(b"\r").unwrap_or(l);
        if l.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        return record_text(l, &spec.field, &spec.field_key)
            .map(|_| ())
            .map_err(|m| bad_err(path, (n, m)));
    }
}
