//! The progress line on stderr: files done of all, a bar by input bytes,
//! bytes read and MB/s, tokens and tokens/s, shards written. On a terminal
//! it redraws in place at most once a second; into a log, one line every
//! ten seconds. Rates count this process's work only (a resumed run's
//! rate is its own), the totals the whole run's.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Progress {
    t0: Instant,
    shown: Instant,
    tty: bool,
    pub files_total: usize,
    pub files_done: usize,
    pub bytes_total: u64,
    /// Input bytes before where this process started.
    pub bytes_before: u64,
    /// Input bytes this process has read.
    pub bytes: u64,
    /// Tokens written before this process started.
    pub tokens_before: u64,
    /// Tokens this process has put into shards (written or filling).
    pub tokens: u64,
    pub shards: usize,
}

impl Progress {
    pub fn new(files_total: usize, bytes_total: u64) -> Progress {
        let now = Instant::now();
        Progress {
            t0: now,
            shown: now,
            tty: std::io::stderr().is_terminal(),
            files_total,
            files_done: 0,
            bytes_total,
            bytes_before: 0,
            bytes: 0,
            tokens_before: 0,
            tokens: 0,
            shards: 0,
        }
    }

    /// Show the line if it is time.
    pub fn tick(&mut self) {
        let every = Duration::from_secs(if self.tty { 1 } else { 10 });
        if self.shown.elapsed() >= every {
            self.shown = Instant::now();
            self.show(false);
        }
    }

    /// The final line.
    pub fn finish(&mut self) {
        self.show(true);
    }

    fn show(&self, last: bool) {
        let line = self.line();
        let mut err = std::io::stderr().lock();
        let _ = if self.tty {
            write!(err, "\r{line}\x1b[K{}", if last { "\n" } else { "" })
        } else {
            writeln!(err, "tokenize: {line}")
        };
        let _ = err.flush();
    }

    fn line(&self) -> String {
        let secs = self.t0.elapsed().as_secs_f64().max(1e-9);
        let done = self.bytes_before + self.bytes;
        let frac = if self.bytes_total == 0 {
            1.0
        } else {
            (done as f64 / self.bytes_total as f64).min(1.0)
        };
        let filled = (frac * 20.0).round() as usize;
        format!(
            "files {}/{} [{}{}] {:3.0}% | {} read, {:.1} MB/s | {} tokens, {}/s | {} shard{} written",
            self.files_done,
            self.files_total,
            "#".repeat(filled),
            ".".repeat(20 - filled),
            frac * 100.0,
            bytes(done),
            self.bytes as f64 / secs / 1e6,
            count(self.tokens_before + self.tokens),
            count((self.tokens as f64 / secs) as u64),
            self.shards,
            if self.shards == 1 { "" } else { "s" },
        )
    }
}

/// Bytes in decimal units (MB/s is decimal too).
fn bytes(b: u64) -> String {
    match b {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{:.1} kB", b as f64 / 1e3),
        b => format!("{b} B"),
    }
}

/// A count with a K / M / G suffix.
fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}G", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 10_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}
