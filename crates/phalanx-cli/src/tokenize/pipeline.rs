//! Reading and tokenizing on many threads while handing the results on in
//! input order. One reader thread cuts the inputs into numbered items (a
//! JSONL file into chunks of whole lines of about 2 MiB; any other file, a
//! text or Parquet file, is one item, read whole by
//! `phalanx::data::records::documents`); worker threads parse and tokenize
//! items as they come; the caller's thread receives the results, puts them
//! back in number order and consumes them one by one. The output therefore
//! depends on the inputs only, never on the thread count or on which worker
//! finished first.
//!
//! Memory stays bounded: the reader runs at most `4 x threads + 4` items
//! and about 256 MiB of input ahead of the item being consumed (a [`Gate`]
//! it waits on), so a slow item cannot let the others pile up.

use super::encoder::Encoder;
use super::state::Position;
use phalanx::data::records;
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Condvar, Mutex};

/// A JSONL chunk: this many bytes, then to the end of the line.
const CHUNK: u64 = 2 << 20;
/// Input bytes read ahead of the item being consumed (one item always may).
const BYTES_AHEAD: u64 = 256 << 20;

/// One document's tokens (no separator), or what is wrong with its record.
pub type DocTokens = Result<Vec<u32>, String>;

/// A tokenized item, handed to the consumer in input order.
pub struct Done {
    pub file: usize,
    /// Where the item starts in its file: a line start, and its number.
    pub byte: u64,
    pub line: u64,
    /// The file's last item.
    pub last: bool,
    /// Input bytes it covers.
    pub bytes: u64,
    /// Its documents in order, or an error that stops the run.
    pub docs: Result<Vec<DocTokens>, String>,
}

/// What to read and how.
pub struct Spec<'a> {
    pub files: &'a [PathBuf],
    pub field: &'a str,
    pub threads: usize,
    pub encoder: &'a Encoder,
    /// Read from here on (a resumed run).
    pub start: Position,
}

enum Body {
    Lines(Vec<u8>),
    Whole,
    Failed(String),
}

struct Item {
    seq: u64,
    meta: Done,
    body: Body,
}

/// Run the pipeline, calling `consume` on every item in input order; the
/// first error (from `consume`, or an item's) stops it.
pub fn run(spec: &Spec, mut consume: impl FnMut(Done) -> Result<(), String>) -> Result<(), String> {
    let window = 4 * spec.threads as u64 + 4;
    let gate = Gate::default();
    // The gate keeps at most `window` items in flight, so sends never block.
    let (in_tx, in_rx) = sync_channel::<Item>(window as usize);
    let in_rx = Mutex::new(in_rx);
    let (out_tx, out_rx) = channel::<(u64, Done)>();
    std::thread::scope(|s| {
        let (gate, in_rx) = (&gate, &in_rx);
        s.spawn(move || read_all(spec, gate, window, in_tx));
        for _ in 0..spec.threads {
            let out_tx = out_tx.clone();
            s.spawn(move || work(spec, in_rx, out_tx));
        }
        drop(out_tx);
        let r = deliver(out_rx, gate, &mut consume);
        gate.stop();
        r
    })
}

/// Receive results, restore the order, consume.
fn deliver(
    rx: Receiver<(u64, Done)>,
    gate: &Gate,
    consume: &mut impl FnMut(Done) -> Result<(), String>,
) -> Result<(), String> {
    let mut pending = BTreeMap::new();
    let mut next = 0u64;
    for (seq, done) in rx {
        pending.insert(seq, done);
        while let Some(d) = pending.remove(&next) {
            let bytes = d.bytes;
            consume(d)?;
            next += 1;
            gate.advance(next, bytes);
        }
    }
    if !pending.is_empty() {
        return Err("a tokenizer thread ended without its result".into());
    }
    Ok(())
}

/// How far the reader may run ahead of the consumer.
#[derive(Default)]
struct Gate {
    /// (items consumed, input bytes read but not consumed)
    at: Mutex<(u64, u64)>,
    cv: Condvar,
    stop: AtomicBool,
}

impl Gate {
    /// Wait until item `seq` of `bytes` may be read; false: stop reading.
    fn admit(&self, seq: u64, bytes: u64, window: u64) -> bool {
        let mut at = self.at.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return false;
            }
            let (consumed, ahead) = *at;
            if seq == consumed || (seq < consumed + window && ahead + bytes <= BYTES_AHEAD) {
                at.1 += bytes;
                return true;
            }
            at = self.cv.wait(at).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn advance(&self, consumed: u64, bytes: u64) {
        let mut at = self.at.lock().unwrap_or_else(|e| e.into_inner());
        *at = (consumed, at.1.saturating_sub(bytes));
        self.cv.notify_all();
    }

    fn stop(&self) {
        let _at = self.at.lock().unwrap_or_else(|e| e.into_inner());
        self.stop.store(true, Ordering::Relaxed);
        self.cv.notify_all();
    }
}

/// The reader thread: every file from the start position on, as items.
fn read_all(spec: &Spec, gate: &Gate, window: u64, tx: SyncSender<Item>) {
    let mut seq = 0u64;
    let mut send = |meta: Done, body: Body| -> bool {
        let failed = matches!(body, Body::Failed(_));
        if !gate.admit(seq, meta.bytes, window) {
            return false;
        }
        let item = Item { seq, meta, body };
        seq += 1;
        tx.send(item).is_ok() && !failed
    };
    for (file, path) in spec.files.iter().enumerate().skip(spec.start.file) {
        let (byte, line) = if file == spec.start.file {
            (spec.start.byte, spec.start.line)
        } else {
            (0, 1)
        };
        let meta = |byte, line, last, bytes| Done {
            file,
            byte,
            line,
            last,
            bytes,
            docs: Ok(Vec::new()),
        };
        if !records::is_jsonl(path) {
            let (body, size) = match std::fs::metadata(path) {
                Ok(_) if byte != 0 => (Body::Failed(resume_mismatch(path)), 0),
                Ok(m) => (Body::Whole, m.len()),
                Err(e) => (Body::Failed(format!("{}: {e}", path.display())), 0),
            };
            if !send(meta(0, 1, true, size), body) {
                return;
            }
            continue;
        }
        let mut chunks = match Chunks::open(path, byte, line) {
            Ok(c) => c,
            Err(e) => {
                send(meta(byte, line, true, 0), Body::Failed(e));
                return;
            }
        };
        loop {
            let (at, at_line) = (chunks.byte, chunks.line);
            match chunks.next_chunk() {
                Ok((buf, last)) => {
                    if !send(meta(at, at_line, last, buf.len() as u64), Body::Lines(buf)) {
                        return;
                    }
                    if last {
                        break;
                    }
                }
                Err(e) => {
                    send(meta(at, at_line, true, 0), Body::Failed(e));
                    return;
                }
            }
        }
    }
}

fn resume_mismatch(path: &Path) -> String {
    format!(
        "{}: the state file's position does not match this file (--force starts over)",
        path.display()
    )
}

/// A JSONL file read in chunks of whole lines.
struct Chunks {
    r: std::io::BufReader<std::fs::File>,
    path: PathBuf,
    byte: u64,
    line: u64,
}

impl Chunks {
    fn open(path: &Path, byte: u64, line: u64) -> Result<Chunks, String> {
        let named = |e: std::io::Error| format!("{}: {e}", path.display());
        // A FIFO put in place of an input since it was listed would hang.
        phalanx::fsutil::regular_file("input", path)?;
        let mut f = std::fs::File::open(path).map_err(named)?;
        f.seek(std::io::SeekFrom::Start(byte)).map_err(named)?;
        Ok(Chunks {
            r: std::io::BufReader::with_capacity(1 << 20, f),
            path: path.to_path_buf(),
            byte,
            line,
        })
    }

    /// The next chunk, and whether it ends the file.
    fn next_chunk(&mut self) -> Result<(Vec<u8>, bool), String> {
        let named = |e: std::io::Error| format!("{}: {e}", self.path.display());
        let mut buf = Vec::with_capacity(CHUNK as usize + (64 << 10));
        (&mut self.r)
            .take(CHUNK)
            .read_to_end(&mut buf)
            .map_err(named)?;
        if buf.last().is_some_and(|&b| b != b'\n') {
            self.r.read_until(b'\n', &mut buf).map_err(named)?;
        }
        let last = self.r.fill_buf().map_err(named)?.is_empty();
        self.byte += buf.len() as u64;
        self.line += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        Ok((buf, last))
    }
}

/// A worker thread: items in, tokenized items out, until either side closes.
fn work(spec: &Spec, rx: &Mutex<Receiver<Item>>, tx: Sender<(u64, Done)>) {
    loop {
        let item = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
            Ok(item) => item,
            Err(_) => return,
        };
        let (seq, mut done) = (item.seq, item.meta);
        let path = &spec.files[done.file];
        let (line, body) = (done.line, item.body);
        // A panic in a tokenizer becomes this item's error, not a hang.
        done.docs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tokenize(spec, path, line, body)
        }))
        .unwrap_or_else(|_| Err(format!("{}: the tokenizer panicked", path.display())));
        if tx.send((seq, done)).is_err() {
            return;
        }
    }
}

/// An item's documents, parsed and tokenized.
fn tokenize(
    spec: &Spec,
    path: &Path,
    first_line: u64,
    body: Body,
) -> Result<Vec<DocTokens>, String> {
    let docs = match body {
        Body::Failed(e) => return Err(e),
        Body::Lines(buf) => records::documents_of(&buf, true, spec.field, "--field", 1),
        Body::Whole => {
            records::documents(path, spec.field, "--field", 1).map_err(|e| e.to_string())?
        }
    };
    Ok(docs
        .into_iter()
        .map(|d| match d {
            Ok(text) => spec
                .encoder
                .encode(&text)
                .map_err(|e| format!("a document from line {first_line} on: {e}")),
            // Line 0: a record without lines (a Parquet row, named in `msg`).
            Err((0, msg)) => Err(msg),
            Err((n, msg)) => Err(format!("line {}: {msg}", first_line + n as u64 - 1)),
        })
        .collect())
}
