//! The consuming end of a sharded run: documents in input order become one
//! token stream (the separator, then the document's tokens, for every
//! document), cut into llm.c shards: the first `--val-tokens` tokens are
//! `{prefix}_val_000000.bin`, then every `--shard-size` tokens are
//! `{prefix}_train_{index}.bin` from index 1 (the last one partial), as
//! llm.c's fineweb.py names them. A shard may end inside a document; the
//! next one continues it.
//!
//! Each shard is written whole through a temporary and a rename, then the
//! state records it with the position where the next shard starts, so a
//! killed run leaves only complete shards and a rerun continues exactly
//! there: the first documents and tokens up to that position are skipped,
//! not written again.
//!
//! Test hook: `PHALANX_TOKENIZE_STOP_AFTER_SHARDS=N` makes the process exit
//! abruptly (code 137, as a SIGKILL reads) right after its N-th shard and
//! the state naming it are written, so tests can interrupt a run at a
//! chosen point and check that the rerun resumes to the same bytes.

use super::pipeline::Done;
use super::progress::Progress;
use super::shard::{shard_name, ShardBuf};
use super::state::{Position, ShardRecord, State};
use std::path::{Path, PathBuf};

pub const STOP_HOOK: &str = "PHALANX_TOKENIZE_STOP_AFTER_SHARDS";

pub struct Writer<'a> {
    dir: &'a Path,
    files: &'a [PathBuf],
    pub state: State,
    sep: Vec<u32>,
    cur: ShardBuf,
    /// The index of the shard being filled.
    index: u64,
    /// What a resumed run skips first (see [`Position`]).
    skip_docs: u64,
    skip_tokens: u64,
    skip_bad: bool,
    stop_after: Option<usize>,
    written: usize,
    pub progress: Progress,
}

impl<'a> Writer<'a> {
    /// Continue `state` (fresh or resumed) in `dir`.
    pub fn new(
        dir: &'a Path,
        files: &'a [PathBuf],
        state: State,
        sep: Vec<u32>,
        progress: Progress,
    ) -> Writer<'a> {
        let s = &state.settings;
        let first = if s.val_tokens > 0 { 0 } else { 1 };
        let index = state.shards.last().map_or(first, |r| r.index + 1);
        let target = if index == 0 {
            s.val_tokens
        } else {
            s.shard_size
        };
        Writer {
            dir,
            files,
            cur: ShardBuf::new(s.uint32, target),
            index,
            skip_docs: state.next.skip_docs,
            skip_tokens: state.next.skip_tokens,
            skip_bad: s.on_bad_record == "skip",
            sep,
            stop_after: std::env::var(STOP_HOOK).ok().and_then(|v| v.parse().ok()),
            written: 0,
            progress,
            state,
        }
    }

    fn target(&self) -> u64 {
        let s = &self.state.settings;
        if self.index == 0 {
            s.val_tokens
        } else {
            s.shard_size
        }
    }

    /// Append one item's documents to the stream.
    pub fn consume(&mut self, d: Done) -> Result<(), String> {
        let path = &self.files[d.file];
        let docs = d.docs?;
        let n_docs = docs.len();
        for (k, doc) in docs.into_iter().enumerate() {
            if self.skip_docs > 0 {
                self.skip_docs -= 1;
                continue;
            }
            let tokens = match doc {
                Ok(t) => t,
                // The document a shard ended inside cannot have become bad.
                Err(_) if self.skip_tokens > 0 => return Err(mismatch(path)),
                Err(_) if self.skip_bad => {
                    self.state.skipped += 1;
                    continue;
                }
                Err(msg) => {
                    return Err(format!(
                        "{}: {msg} (--on-bad-record skip skips such records)",
                        path.display()
                    ))
                }
            };
            let from = std::mem::take(&mut self.skip_tokens);
            let total = (self.sep.len() + tokens.len()) as u64;
            if from > total {
                return Err(mismatch(path));
            }
            if from == 0 {
                self.state.documents += 1;
            }
            let mut at = from;
            while at < total {
                let n = (self.target() - self.cur.len()).min(total - at);
                self.push(&tokens, at, n, path)?;
                at += n;
                if self.cur.len() == self.target() {
                    let next = if at < total {
                        Position {
                            file: d.file,
                            byte: d.byte,
                            line: d.line,
                            skip_docs: k as u64,
                            skip_tokens: at,
                        }
                    } else if k + 1 == n_docs && d.last {
                        Position::start_of(d.file + 1)
                    } else {
                        Position {
                            file: d.file,
                            byte: d.byte,
                            line: d.line,
                            skip_docs: k as u64 + 1,
                            skip_tokens: 0,
                        }
                    };
                    self.flush(next)?;
                }
            }
        }
        if d.last && (self.skip_docs > 0 || self.skip_tokens > 0) {
            return Err(mismatch(path));
        }
        let p = &mut self.progress;
        p.bytes += d.bytes;
        p.files_done += usize::from(d.last);
        p.tick();
        Ok(())
    }

    /// Tokens `at .. at + n` of the stream `separator ++ tokens`.
    fn push(&mut self, tokens: &[u32], at: u64, n: u64, path: &Path) -> Result<(), String> {
        let (at, end, s) = (at as usize, (at + n) as usize, self.sep.len());
        let r = self
            .cur
            .extend(&self.sep[at.min(s)..end.min(s)])
            .and_then(|()| self.cur.extend(&tokens[at.max(s) - s..end.max(s) - s]));
        self.progress.tokens += n;
        r.map_err(|id| {
            format!(
                "{}: token id {id} does not fit uint16 (the tokenizer gave an id past its \
                 vocabulary size)",
                path.display()
            )
        })
    }

    /// Write the shard being filled and record it, with `next`.
    fn flush(&mut self, next: Position) -> Result<(), String> {
        let name = shard_name(&self.state.settings.prefix, self.index);
        self.index += 1;
        let fresh = ShardBuf::new(self.state.settings.uint32, self.target());
        let buf = std::mem::replace(&mut self.cur, fresh);
        let tokens = buf.len();
        phalanx::fsutil::write_atomic(&self.dir.join(&name), &buf.finish())
            .map_err(|e| e.to_string())?;
        self.state.shards.push(ShardRecord {
            name,
            index: self.index - 1,
            tokens,
        });
        self.state.next = next;
        self.state.save(self.dir)?;
        self.progress.shards += 1;
        self.written += 1;
        if self.stop_after == Some(self.written) {
            eprintln!(
                "{STOP_HOOK}: stopping after {} shard(s) (test hook), exit code 137",
                self.written
            );
            std::process::exit(137);
        }
        Ok(())
    }

    /// Write the last, partial shard and mark the run complete.
    pub fn finish(mut self) -> Result<State, String> {
        let val = self.state.settings.val_tokens;
        if !self.cur.is_empty() {
            if self.index == 0 {
                return Err(format!(
                    "the inputs hold only {} tokens, not more than --val-tokens {val}: no \
                     training shard would be written",
                    self.cur.len()
                ));
            }
            self.flush(Position::start_of(self.files.len()))?;
        }
        if !self.state.shards.iter().any(|s| s.index > 0) {
            return Err(if self.state.tokens() == 0 {
                format!(
                    "the inputs hold no documents ({} bad records skipped)",
                    self.state.skipped
                )
            } else {
                format!("the inputs hold exactly --val-tokens {val} tokens: no training shard")
            });
        }
        self.state.complete = true;
        self.state.save(self.dir)?;
        self.progress.finish();
        Ok(self.state)
    }
}

fn mismatch(path: &Path) -> String {
    format!(
        "{}: the state file's position does not match this file's documents (--force starts \
         over)",
        path.display()
    )
}
