//! The sharded form, `phalanx tokenize (--tokenizer T | --encoding E)
//! --output-dir DIR INPUT...`: checks everything that can be checked
//! before reading (options, inputs, the directory and its state), then runs
//! the reading and tokenizing [`pipeline`](super::pipeline) into the shard
//! [`Writer`](super::writer::Writer).

use super::encoder::Encoder;
use super::pipeline::{self, Spec};
use super::progress::Progress;
use super::shard::MAX_SHARD_TOKENS;
use super::state::{self, InputFile, Position, Settings, Start, State, STATE_FILE};
use super::writer::Writer;
use super::TokenizeOpts;
use std::path::{Path, PathBuf};

pub fn run(o: &TokenizeOpts, dir: &Path) -> Result<(), String> {
    let shard_size = o.shard_size.unwrap_or(100_000_000);
    let val_tokens = o.val_tokens.unwrap_or(0);
    check_count("--shard-size", shard_size, 1)?;
    check_count("--val-tokens", val_tokens, 0)?;
    let prefix = o.prefix.clone().unwrap_or_else(|| "data".into());
    check_prefix(&prefix)?;
    let mut enc = Encoder::open(o.tokenizer.as_deref(), o.encoding.as_deref())?;
    enc.choose_separator(o.bos.as_deref())?;
    let files = expand_inputs(&o.paths)?;
    check_outputs(dir, &o.paths, &files)?;
    let settings = Settings {
        inputs: files
            .iter()
            .map(|f| InputFile::stat(f))
            .collect::<Result<_, _>>()?,
        tokenizer: enc.identity()?,
        separator: enc.separator().to_vec(),
        uint32: enc.wide(),
        field: o.field.clone().unwrap_or_else(|| "text".into()),
        on_bad_record: o.on_bad_record.clone().unwrap_or_else(|| "error".into()),
        shard_size,
        val_tokens,
        prefix,
    };
    let state = match state::open_dir(dir, &settings, o.force)? {
        Start::Fresh => State::new(settings),
        Start::Complete(s) => {
            println!(
                "{} is complete: {} shards, {} tokens; nothing to do (--force starts over)",
                dir.display(),
                s.shards.len(),
                s.tokens()
            );
            return Ok(());
        }
        Start::Resume(s) => {
            println!(
                "resuming {}: {} shards ({} tokens) already written, continuing at {}",
                dir.display(),
                s.shards.len(),
                s.tokens(),
                where_(&files, &s.next)
            );
            s
        }
    };
    // Written before any shard: the directory is this run's from now on.
    state.save(dir)?;
    let threads = o.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    let sizes: Vec<u64> = state.settings.inputs.iter().map(|i| i.size).collect();
    let mut progress = Progress::new(files.len(), sizes.iter().sum());
    progress.files_done = state.next.file;
    progress.bytes_before = sizes[..state.next.file.min(sizes.len())]
        .iter()
        .sum::<u64>()
        + state.next.byte;
    progress.tokens_before = state.tokens();
    progress.shards = state.shards.len();
    let spec = Spec {
        files: &files,
        field: &state.settings.field.clone(),
        threads,
        encoder: &enc,
        start: state.next,
    };
    let mut w = Writer::new(dir, &files, state, enc.separator().to_vec(), progress);
    pipeline::run(&spec, |d| w.consume(d))?;
    let s = w.finish()?;
    let val: u64 = s
        .shards
        .iter()
        .filter(|r| r.index == 0)
        .map(|r| r.tokens)
        .sum();
    println!(
        "wrote {} shards to {}: {val} validation and {} training tokens, {} bits per token, \
         {} documents from {} files; {} (vocabulary {}), {} before every document",
        s.shards.len(),
        dir.display(),
        s.tokens() - val,
        if s.settings.uint32 { 32 } else { 16 },
        s.documents,
        files.len(),
        enc.name(),
        enc.vocab(),
        enc.separator_name()
    );
    if s.skipped > 0 {
        println!("skipped {} bad records (--on-bad-record skip)", s.skipped);
    }
    Ok(())
}

fn check_count(flag: &str, n: u64, min: u64) -> Result<(), String> {
    if n < min {
        return Err(format!("{flag} {n}: a shard holds at least {min} token"));
    }
    if n > MAX_SHARD_TOKENS {
        return Err(format!(
            "{flag} {n}: more than {MAX_SHARD_TOKENS} tokens, what the 32-bit count of an llm.c \
             header can hold"
        ));
    }
    Ok(())
}

/// A prefix is a plain file name start: no directories, no hidden files.
fn check_prefix(p: &str) -> Result<(), String> {
    let ok = !p.is_empty()
        && !p.starts_with('.')
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--prefix {p:?}: use letters, digits, '-', '_' and '.' (not first)"
        ))
    }
}

/// Every input file, patterns in the order given, each pattern's files
/// sorted; a file named twice is read once.
fn expand_inputs(patterns: &[String]) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for p in patterns {
        let (found, left) =
            phalanx::data::paths::expand_text_noting(p, "input").map_err(|e| match e {
                phalanx::data::DataError::Config(m) => m,
                other => other.to_string(),
            })?;
        files.extend(found);
        if !left.is_empty() {
            eprintln!(
                "note: {}",
                phalanx::data::paths::skipped_note("input", p, &left)
            );
        }
    }
    let mut seen = std::collections::HashSet::new();
    files.retain(|f| seen.insert(crate::outputs::resolve(f)));
    for f in &files {
        phalanx::data::paths::refuse_compressed(f, "input").map_err(|e| e.to_string())?;
    }
    Ok(files)
}

/// DIR must not hold an input, nor lie inside an input directory (its
/// shards would become inputs of the next run).
fn check_outputs(dir: &Path, patterns: &[String], files: &[PathBuf]) -> Result<(), String> {
    let d = crate::outputs::resolve(dir);
    if let Some(f) = files
        .iter()
        .find(|f| crate::outputs::resolve(f).starts_with(&d))
    {
        return Err(format!(
            "input {} is inside --output-dir {}: refusing to write shards beside an input",
            f.display(),
            dir.display()
        ));
    }
    let mut io = crate::outputs::Io::new();
    for p in patterns.iter().map(Path::new).filter(|p| p.is_dir()) {
        io.input("input directory", p);
    }
    for f in files {
        io.input("input", f);
    }
    io.output("--output-dir", &dir.join(STATE_FILE)).check()
}

/// A position in words: the file and line the next shard starts at.
fn where_(files: &[PathBuf], p: &Position) -> String {
    let Some(f) = files.get(p.file) else {
        return "the end of the inputs".into();
    };
    // A chunk (JSONL) or a whole file (text, Parquet) starts at `line`;
    // the documents and tokens of it already written are passed over.
    let mut at = match phalanx::data::records::is_jsonl(f) {
        true => format!("{} line {}", f.display(), p.line),
        false => f.display().to_string(),
    };
    if p.skip_docs > 0 || p.skip_tokens > 0 {
        at += &format!(
            " ({} document(s) and {} token(s) from there already written)",
            p.skip_docs, p.skip_tokens
        );
    }
    at
}
