//! What makes a sharded run resumable: `DIR/tokenize.json`, written
//! atomically when the run starts and after every shard. It records what
//! decides the bytes of the shards (the input files with their sizes and
//! modification times, the tokenizer, the options), the shards written, and
//! where the next shard starts in the inputs ([`Position`]). A rerun of the
//! same command continues from there; other inputs or options are refused
//! naming what differs (`--force` starts over). The thread count is not
//! recorded: the output does not depend on it.
//!
//! The directory must hold nothing but this run's files (the state, its
//! shards and the temporaries of atomic writes): tokenize deletes only
//! files it owns, so a directory with anything else is refused.

use super::shard::{file_len, is_shard_name};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const STATE_FILE: &str = "tokenize.json";
const FORMAT: &str = "phalanx-tokenize-1";

/// One input file as the run saw it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct InputFile {
    /// Resolved (absolute, links followed), so the same command from
    /// another directory is the same run.
    pub path: String,
    pub size: u64,
    pub mtime_ns: u64,
}

impl InputFile {
    pub fn stat(p: &Path) -> Result<InputFile, String> {
        let m = phalanx::fsutil::regular_file("input", p)?;
        let mtime_ns = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        Ok(InputFile {
            path: crate::outputs::resolve(p).display().to_string(),
            size: m.len(),
            mtime_ns,
        })
    }
}

/// Everything that decides the shards' bytes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Settings {
    pub inputs: Vec<InputFile>,
    pub tokenizer: serde_json::Value,
    pub separator: Vec<u32>,
    pub uint32: bool,
    pub field: String,
    pub on_bad_record: String,
    pub shard_size: u64,
    pub val_tokens: u64,
    pub prefix: String,
}

/// Where the next shard starts: `skip_docs` documents into input `file`
/// counted from byte `byte` (a line start; `line` is its number), then
/// `skip_tokens` tokens into that document's stream (separator included).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub file: usize,
    pub byte: u64,
    pub line: u64,
    pub skip_docs: u64,
    pub skip_tokens: u64,
}

impl Position {
    pub fn start_of(file: usize) -> Position {
        Position {
            file,
            byte: 0,
            line: 1,
            skip_docs: 0,
            skip_tokens: 0,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ShardRecord {
    pub name: String,
    pub index: u64,
    pub tokens: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct State {
    pub format: String,
    pub settings: Settings,
    pub shards: Vec<ShardRecord>,
    pub next: Position,
    /// Documents written and bad records skipped before `next`.
    pub documents: u64,
    pub skipped: u64,
    pub complete: bool,
}

impl State {
    pub fn new(settings: Settings) -> State {
        State {
            format: FORMAT.into(),
            settings,
            shards: Vec::new(),
            next: Position::start_of(0),
            documents: 0,
            skipped: 0,
            complete: false,
        }
    }

    pub fn tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.tokens).sum()
    }

    pub fn save(&self, dir: &Path) -> Result<(), String> {
        let mut text = serde_json::to_string_pretty(self).expect("plain data");
        text.push('\n');
        phalanx::fsutil::write_atomic(&dir.join(STATE_FILE), text.as_bytes())
            .map_err(|e| e.to_string())
    }
}

/// How a run starts in its directory.
pub enum Start {
    Fresh,
    Resume(State),
    Complete(State),
}

/// Prepare `dir` for a run of `new` (see the module docs).
pub fn open_dir(dir: &Path, new: &Settings, force: bool) -> Result<Start, String> {
    if !dir.exists() {
        crate::outputs::create_own_dir("--output-dir", &dir.join(STATE_FILE))?;
        return Ok(Start::Fresh);
    }
    if !dir.is_dir() {
        return Err(format!("--output-dir {} is not a directory", dir.display()));
    }
    let old = load(dir)?;
    let prefix = old.as_ref().map(|s| s.settings.prefix.as_str());
    let names = entries(dir)?;
    let foreign: Vec<&String> = names.iter().filter(|n| !is_ours(n, prefix)).collect();
    if !foreign.is_empty() {
        let shown: Vec<&str> = foreign.iter().take(3).map(|s| s.as_str()).collect();
        return Err(format!(
            "--output-dir {} holds {} entr{} this command did not write ({}{}): give a new or \
             empty directory (tokenize deletes only its own files)",
            dir.display(),
            foreign.len(),
            if foreign.len() == 1 { "y" } else { "ies" },
            shown.join(", "),
            if foreign.len() > 3 { ", ..." } else { "" }
        ));
    }
    let Some(old) = old else {
        remove(dir, names.iter().filter(|n| is_temp(n, None)))?;
        return Ok(Start::Fresh);
    };
    // A run that wrote no shard (stopped by bad input, say) has nothing
    // to keep: other options start over without `--force`.
    if force || (old.shards.is_empty() && !old.complete) {
        remove(dir, names.iter())?;
        return Ok(Start::Fresh);
    }
    let diff = differences(&old.settings, new);
    if !diff.is_empty() {
        return Err(format!(
            "--output-dir {} holds a tokenize run with other settings ({}): rerun with the \
             same inputs and options to continue it, or --force to start over",
            dir.display(),
            diff.join("; ")
        ));
    }
    for s in &old.shards {
        let p = dir.join(&s.name);
        let want = file_len(s.tokens, new.uint32);
        if std::fs::metadata(&p).map(|m| m.len()).ok() != Some(want) {
            return Err(format!(
                "{}: {STATE_FILE} records it with {} tokens ({want} bytes), but it is missing \
                 or another size: --force starts over",
                p.display(),
                s.tokens
            ));
        }
    }
    // A shard renamed into place before the state recorded it, and
    // temporaries of a killed write: the rerun writes them again.
    let stale = names
        .iter()
        .filter(|n| *n != STATE_FILE && !old.shards.iter().any(|s| &s.name == *n));
    remove(dir, stale)?;
    Ok(if old.complete {
        Start::Complete(old)
    } else {
        Start::Resume(old)
    })
}

fn load(dir: &Path) -> Result<Option<State>, String> {
    let p = dir.join(STATE_FILE);
    if !p.exists() {
        return Ok(None);
    }
    let text = phalanx::fsutil::read_text_capped("state file", &p, phalanx::fsutil::CONFIG_CAP)?;
    let s: State = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: not the state of a phalanx tokenize run ({e}); remove it or give another \
             --output-dir",
            p.display()
        )
    })?;
    if s.format != FORMAT {
        return Err(format!(
            "{}: state format {:?}, this build reads {FORMAT:?}",
            p.display(),
            s.format
        ));
    }
    Ok(Some(s))
}

fn entries(dir: &Path) -> Result<Vec<String>, String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut v: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// The state, a shard of `prefix`, or a temporary of either.
fn is_ours(name: &str, prefix: Option<&str>) -> bool {
    name == STATE_FILE || prefix.is_some_and(|p| is_shard_name(p, name)) || is_temp(name, prefix)
}

/// A temporary of `write_atomic` (`.NAME.tmp-PID`) for one of our files,
/// or the writability probe of the output checks.
fn is_temp(name: &str, prefix: Option<&str>) -> bool {
    if name.strip_prefix(".phalanx-probe-").is_some_and(all_digits) {
        return true;
    }
    let Some((inner, pid)) = name.strip_prefix('.').and_then(|n| n.rsplit_once(".tmp-")) else {
        return false;
    };
    all_digits(pid) && (inner == STATE_FILE || prefix.is_some_and(|p| is_shard_name(p, inner)))
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn remove<'a>(dir: &Path, names: impl Iterator<Item = &'a String>) -> Result<(), String> {
    for n in names {
        let p: PathBuf = dir.join(n);
        std::fs::remove_file(&p).map_err(|e| format!("{}: cannot remove it: {e}", p.display()))?;
    }
    Ok(())
}

/// What differs between the recorded settings and this command's, in words.
fn differences(old: &Settings, new: &Settings) -> Vec<String> {
    let mut d = Vec::new();
    let mut cmp = |what: &str, a: String, b: String| {
        if a != b {
            d.push(format!("{what}: {a} there, {b} now"));
        }
    };
    cmp(
        "--shard-size",
        old.shard_size.to_string(),
        new.shard_size.to_string(),
    );
    cmp(
        "--val-tokens",
        old.val_tokens.to_string(),
        new.val_tokens.to_string(),
    );
    cmp("--prefix", old.prefix.clone(), new.prefix.clone());
    cmp("--field", old.field.clone(), new.field.clone());
    cmp(
        "--on-bad-record",
        old.on_bad_record.clone(),
        new.on_bad_record.clone(),
    );
    cmp(
        "the tokenizer",
        old.tokenizer.to_string(),
        new.tokenizer.to_string(),
    );
    cmp(
        "the separator",
        format!("{:?}", old.separator),
        format!("{:?}", new.separator),
    );
    if old.inputs != new.inputs {
        d.push(input_difference(&old.inputs, &new.inputs));
    }
    d
}

fn input_difference(old: &[InputFile], new: &[InputFile]) -> String {
    for (i, (a, b)) in old.iter().zip(new).enumerate() {
        if a.path != b.path {
            return format!("input {}: {} there, {} now", i + 1, a.path, b.path);
        }
        if a.size != b.size {
            return format!(
                "input {} changed size: {} bytes there, {} now",
                a.path, a.size, b.size
            );
        }
        if a.mtime_ns != b.mtime_ns {
            return format!("input {} was modified since", a.path);
        }
    }
    match old.len().cmp(&new.len()) {
        std::cmp::Ordering::Less => format!(
            "{} input files there, {} now ({} is new)",
            old.len(),
            new.len(),
            new[old.len()].path
        ),
        _ => format!(
            "{} input files there, {} now ({} is gone)",
            old.len(),
            new.len(),
            old[new.len()].path
        ),
    }
}
