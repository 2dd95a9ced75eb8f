//! A corpus: weighted sources of many shards in any supported format.
//!
//! Formats, by file: `*.bin` is a token file (llm.c with its header, else
//! nanoGPT raw uint16; see [`super::source`]), memory-mapped; `*.jsonl` /
//! `*.ndjson` is JSONL (one document per line, its text under `field`);
//! `*.parquet` is Parquet (one document per row, its string column
//! `field`; see [`super::records`]); compressed files
//! (`.gz`, `.zst`, `.xz`, `.bz2`) too; anything else is a plain text file,
//! one document. A source holds token files or text files, not both (they
//! are read differently: random access against a stream).
//!
//! Global index `g` goes to source `s` and its index `k` there by
//! [`super::mix::Mixer`]; the source gives its `k`-th sample
//! ([`super::shards`], [`super::text`]). Everything is a function of the
//! config (and the files), so every rank, layout and resume agrees.

use super::error::{DataError, Result};
use super::mix::Mixer;
use super::paths;
use super::shards::BinSource;
use super::shuffle::mix64;
use super::source::TokenData;
use super::text::{Cursor, TextEncoder, TextSource, TextSpec, TextStats};
use super::{OnBadRecord, Tokenizer};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

/// One source as configured.
#[derive(Clone, Debug)]
pub struct SourceSpec {
    /// Files, directories or globs.
    pub paths: Vec<String>,
    pub weight: f64,
    /// The JSONL key holding a document's text.
    pub field: String,
    /// The config key of this source (`data.path`, `data.sources[1]`) for messages.
    pub key: String,
}

/// What a corpus is built from.
#[derive(Clone)]
pub struct CorpusConfig {
    pub sources: Vec<SourceSpec>,
    /// Validation files (any format); empty: each token shard's tail
    /// `val_fraction` (text sources then have no validation data).
    pub val_paths: Vec<String>,
    pub seq_len: usize,
    pub val_fraction: f64,
    pub shuffle: bool,
    pub seed: u64,
    pub vocab_size: Option<usize>,
    pub on_bad_record: OnBadRecord,
    /// Tokenizer threads per text source (0: up to 4, as the cores allow).
    pub threads: usize,
    /// Tokenized shards queued ahead per text source.
    pub prefetch: usize,
    pub encoder: Arc<dyn TextEncoder>,
}

impl CorpusConfig {
    /// One source of weight 1 from `paths`, with the defaults.
    pub fn new(paths: &[&str], seq_len: usize) -> CorpusConfig {
        CorpusConfig {
            sources: vec![SourceSpec {
                paths: paths.iter().map(|p| p.to_string()).collect(),
                weight: 1.0,
                field: "text".into(),
                key: "data.path".into(),
            }],
            val_paths: Vec::new(),
            seq_len,
            val_fraction: 0.0,
            shuffle: true,
            seed: 0,
            vocab_size: None,
            on_bad_record: OnBadRecord::Error,
            threads: 0,
            prefetch: 2,
            encoder: Arc::new(Tokenizer::Byte),
        }
    }
}

pub(crate) enum Source {
    Bin(BinSource),
    Text(TextSource),
}

/// The training sources, their mixer and the validation parts.
pub struct Corpus {
    pub(crate) sources: Vec<Source>,
    pub(crate) mixer: Mixer,
    /// (data, first token, tokens) of every validation part, in order.
    val: Vec<(Arc<TokenData>, usize, usize)>,
    /// Prefix sums of validation samples over `val`.
    val_prefix: Vec<u64>,
    pub(crate) seq_len: usize,
    pub(crate) vocab: Option<usize>,
    pub(crate) fingerprint: serde_json::Value,
    pub(crate) stats: Arc<TextStats>,
    /// Notes on the files of data directories left out as not data.
    skipped: Vec<String>,
}

#[derive(PartialEq, Clone, Copy)]
enum Kind {
    Bin,
    Text,
}

fn kind_of(p: &std::path::Path, key: &str) -> Result<Kind> {
    paths::refuse_compressed(p, key)?;
    let bin = p.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin"));
    Ok(if bin { Kind::Bin } else { Kind::Text })
}

/// Every file `paths` name; a directory's files that are not data beside
/// its data files (see [`paths::expand_noting`]) go to `skipped` as a note.
/// `val_given`: whether `data.val_path` is set (a tokenize output's
/// validation shard left out of training is then no news).
fn expand_all(
    paths: &[String],
    key: &str,
    val_given: bool,
    skipped: &mut Vec<String>,
) -> Result<Vec<PathBuf>> {
    if paths.is_empty() {
        return Err(DataError::Config(format!("{key}: no path given")));
    }
    let mut files = Vec::new();
    for p in paths {
        let (mut found, left, tokenized) = paths::expand_noting_run(p, key)?;
        if !left.is_empty() {
            skipped.push(paths::skipped_note(key, p, &left));
        }
        // A directory `phalanx tokenize` wrote holds its held-out split
        // beside the training shards: validation takes that one only, and
        // training the others (else the validation loss would be measured
        // on data trained on).
        if let Some(run) = tokenized {
            let validation = key == "data.val_path";
            let (val, train): (Vec<PathBuf>, Vec<PathBuf>) =
                found.into_iter().partition(|f| run.is_val_shard(f));
            if validation {
                if val.is_empty() {
                    return Err(DataError::Config(format!(
                        "{key} = {p:?}: the `phalanx tokenize` output there has no validation \
                         shard ({}_val_000000.bin; was it run with --val-tokens 0?)",
                        run.prefix
                    )));
                }
                found = val;
            } else {
                if !val.is_empty() && !train.is_empty() && !val_given {
                    skipped.push(format!(
                        "{key} {p:?}: its validation shard {} (phalanx tokenize's held-out \
                         split) is not trained on; evaluate on it with data.val_path = {p:?}",
                        val[0].display()
                    ));
                }
                found = if train.is_empty() { val } else { train };
            }
        }
        files.extend(found);
    }
    // Several patterns may name one file, spelled alike or not (`shards/`
    // and `/abs/shards/*.bin`, `./x.bin` and `x.bin`, a link, hard or
    // symbolic): once is
    // enough, as first named (sorted order within each pattern, patterns
    // in the order given).
    let mut seen = std::collections::HashSet::new();
    files.retain(|f| seen.insert(file_id(f)));
    Ok(files)
}

/// Text files from this size on are said at the start: each is one shard,
/// tokenized whole in memory.
const BIG_TEXT: u64 = 1 << 30;

/// The note for a text source whose largest file is [`BIG_TEXT`] or more:
/// its bytes, documents and tokens are held at once on every rank (a few
/// times its size, `data.prefetch` shards ahead), where `phalanx tokenize`
/// would stream it once into mapped shards.
fn big_text_note(key: &str, files: &[PathBuf]) -> Option<String> {
    let (size, f) = files
        .iter()
        .filter_map(|f| Some((std::fs::metadata(f).ok()?.len(), f)))
        .max_by_key(|(s, _)| *s)?;
    (size >= BIG_TEXT).then(|| {
        format!(
            "{key}: {} is {:.1} GiB of text, tokenized whole in memory on every rank (a \
             few times its size; each text file is one shard): `phalanx tokenize` it into \
             .bin shards once, which are memory-mapped",
            f.display(),
            size as f64 / (1u64 << 30) as f64
        )
    })
}

/// A validation file (or part) too short for one sample of `seq_len`:
/// almost surely a mistake.
fn val_too_short(name: &str, n: usize, seq_len: usize) -> DataError {
    DataError::TooSmall(format!(
        "the validation file {name} has {n} tokens, fewer than seq_len + 1 = {} (data.val_path)",
        seq_len + 1
    ))
}

/// A file in the fingerprint: its name (not its path: a resume from another
/// directory, or with an absolute path, reads the same files) and size.
fn file_print(f: &std::path::Path) -> serde_json::Value {
    let name = f
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    json!([name, std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)])
}

/// Which file `f` is, whatever the name: its device and inode (a hard
/// link, a symbolic one, `..` or another spelling is the same file), else
/// its path with links and `..` resolved (as given when that fails).
#[derive(PartialEq, Eq, Hash)]
enum FileId {
    Inode(u64, u64),
    Path(std::path::PathBuf),
}

fn file_id(f: &std::path::Path) -> FileId {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(f) {
        Ok(m) => FileId::Inode(m.dev(), m.ino()),
        Err(_) => FileId::Path(std::fs::canonicalize(f).unwrap_or_else(|_| f.to_path_buf())),
    }
}

impl Corpus {
    /// What the run should know about the data before it trains (files of
    /// a data directory that are not data, tokens token sources leave out).
    pub fn notes(&self) -> Vec<String> {
        let unused = self.sources.iter().filter_map(|s| match s {
            Source::Bin(b) => b.unused_note(),
            Source::Text(_) => None,
        });
        self.skipped.iter().cloned().chain(unused).collect()
    }

    pub fn open(cfg: &CorpusConfig) -> Result<Corpus> {
        if cfg.sources.is_empty() {
            return Err(DataError::Config("no data sources".into()));
        }
        let threads = match cfg.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            n => n,
        };
        let stats = Arc::new(TextStats::default());
        let mut sources = Vec::new();
        let mut prints = Vec::new();
        let mut skipped = Vec::new();
        // Every training file, to keep the validation files apart from
        // them, and for the content digest.
        let mut trained = std::collections::HashMap::new();
        let mut all_files = Vec::new();
        // Validation text files are read with the first text source's field.
        let mut text_field: Option<(String, String)> = None;
        for (i, spec) in cfg.sources.iter().enumerate() {
            let files = expand_all(
                &spec.paths,
                &spec.key,
                !cfg.val_paths.is_empty(),
                &mut skipped,
            )?;
            for f in &files {
                trained.insert(file_id(f), spec.key.clone());
            }
            all_files.extend(files.iter().cloned());
            let mut kinds = Vec::new();
            for f in &files {
                kinds.push(kind_of(f, &spec.key)?);
            }
            if let Some(j) = kinds.iter().position(|k| *k != kinds[0]) {
                return Err(DataError::Config(format!(
                    "{}: {} is a token file and {} a text file; a source holds one or the other \
                     (make two sources)",
                    spec.key,
                    files[if kinds[0] == Kind::Bin { 0 } else { j }].display(),
                    files[if kinds[0] == Kind::Bin { j } else { 0 }].display()
                )));
            }
            if kinds[0] == Kind::Text {
                if let Some(n) = big_text_note(&spec.key, &files) {
                    skipped.push(n);
                }
            }
            let seed = mix64(cfg.seed.wrapping_add(mix64(i as u64 + 1)));
            let print: Vec<serde_json::Value> = files.iter().map(|f| file_print(f)).collect();
            let source = if kinds[0] == Kind::Bin {
                let mut shards = Vec::new();
                for f in &files {
                    let d = TokenData::open(f, Tokenizer::Byte)?;
                    if d.is_empty() {
                        return Err(DataError::Format {
                            path: f.clone(),
                            msg: format!("the token file is empty ({})", spec.key),
                        });
                    }
                    shards.push(d);
                }
                let name = format!("{} ({} shards)", spec.key, files.len());
                prints.push(json!({"weight": spec.weight, "files": print}));
                Source::Bin(BinSource::new(
                    shards,
                    cfg.seq_len,
                    if cfg.val_paths.is_empty() {
                        cfg.val_fraction
                    } else {
                        0.0
                    },
                    cfg.shuffle,
                    seed,
                    &name,
                )?)
            } else {
                prints.push(json!({"weight": spec.weight, "field": spec.field, "files": print}));
                let field_key = if spec.key == "data.path" {
                    "data.field".to_string()
                } else {
                    format!("{}.field", spec.key)
                };
                text_field.get_or_insert_with(|| (spec.field.clone(), field_key.clone()));
                Source::Text(TextSource::new(
                    TextSpec {
                        files,
                        field: spec.field.clone(),
                        field_key,
                        on_bad: cfg.on_bad_record,
                        encoder: cfg.encoder.clone(),
                        shuffle: cfg.shuffle,
                        seed,
                        threads,
                        prefetch: cfg.prefetch,
                    },
                    cfg.seq_len,
                    stats.clone(),
                )?)
            };
            sources.push(source);
        }
        let weights: Vec<f64> = cfg.sources.iter().map(|s| s.weight).collect();
        let mixer = Mixer::new(&weights, cfg.seed)?;
        let mut val = Vec::new();
        let mut val_print = Vec::new();
        let mut text_val = Vec::new();
        if cfg.val_paths.is_empty() {
            for s in &sources {
                if let Source::Bin(b) = s {
                    val.extend(b.val_parts());
                }
            }
        } else {
            for f in expand_all(&cfg.val_paths, "data.val_path", true, &mut skipped)? {
                if let Some(key) = trained.get(&file_id(&f)) {
                    // A validation loss measured on training data looks
                    // better than it is (a `data_*.bin` glob also matches
                    // `phalanx tokenize`'s `data_val_*.bin`).
                    return Err(DataError::Config(format!(
                        "data.val_path: {} is also training data ({key}); validation must be \
                 held out: narrow {key}'s pattern",
                        f.display()
                    )));
                }
                val_print.push(file_print(&f));
                let d = if kind_of(&f, "data.val_path")? == Kind::Bin {
                    TokenData::open(&f, Tokenizer::Byte)?
                } else {
                    text_val.push(f.clone());
                    let (field, key) = text_field.clone().unwrap_or_else(|| {
                        (cfg.sources[0].field.clone(), "data.field".to_string())
                    });
                    TokenData::from_tokens(val_text(&f, cfg, (&field, &key))?)
                };
                if d.is_empty() {
                    return Err(DataError::Format {
                        path: f.clone(),
                        msg: "the validation file holds no tokens (data.val_path)".into(),
                    });
                }
                if d.len() < cfg.seq_len + 1 {
                    // (A text file's tokens carry no path: named here.)
                    return Err(val_too_short(
                        &f.display().to_string(),
                        d.len(),
                        cfg.seq_len,
                    ));
                }
                let n = d.len();
                val.push((Arc::new(d), 0, n));
            }
        }
        let t = cfg.seq_len;
        // (Shard tails too short for a sample are trained on instead: see
        // `BinSource::new`.)
        if let Some((d, _, n)) = val.iter().find(|(_, _, n)| *n > 0 && *n < t + 1) {
            // A validation file too short for one sample is almost surely
            // a mistake.
            let name = d
                .path()
                .map_or("(a shard's tail)".into(), |p| p.display().to_string());
            return Err(val_too_short(&name, *n, t));
        }
        let has_bin = sources.iter().any(|s| matches!(s, Source::Bin(_)));
        if cfg.val_paths.is_empty() && cfg.val_fraction > 0.0 && has_bin && val.is_empty() {
            // Validation asked for and none at all: say so rather than
            // train without it.
            return Err(DataError::TooSmall(format!(
                "no token shard is long enough to hold out a validation tail of \
                 seq_len + 1 = {} tokens at data.val_fraction = {}; raise data.val_fraction, \
                 give data.val_path, or set data.val_fraction = 0",
                t + 1,
                cfg.val_fraction
            )));
        }
        let mut val_prefix = vec![0u64];
        for (_, _, n) in &val {
            let last = *val_prefix.last().expect("non-empty");
            val_prefix.push(last + (n.saturating_sub(1) / t) as u64);
        }
        let mut fingerprint = json!({
            "seq_len": cfg.seq_len,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
            "val_fraction": cfg.val_fraction,
            "tokenizer": cfg.encoder.name(),
            "on_bad_record": format!("{:?}", cfg.on_bad_record).to_lowercase(),
            "sources": prints,
            "val_path": val_print,
            // Regenerated data keeps its names and sizes (see `digest`).
            "content": super::digest::of_files(&all_files)
                .map_err(|e| DataError::Config(format!("reading the training data: {e}")))?,
        });
        // Token files are read as ids whatever data.tokenizer says: it
        // decides no sample then (a resume naming the model's tokenizer
        // over a run that left the default is the same data).
        let text = sources.iter().any(|s| matches!(s, Source::Text(_))) || !text_val.is_empty();
        // `.json` files were read as plain text before they were JSON
        // Lines: recorded, so that such a checkpoint is not resumed over a
        // stream of other tokens with the same files (see `resume`).
        let json = |f: &PathBuf| {
            f.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        };
        if text {
            fingerprint["json_lines"] = json!(all_files.iter().any(json));
            // The same tokenizer.json path with other contents encodes
            // other tokens.
            if let Some(c) = cfg.encoder.content() {
                fingerprint["tokenizer_content"] = json!(c);
            }
        }
        // A tokenizer whose ids the model cannot hold fails here, not at
        // the first batch that meets a high id.
        if let (true, Some(v)) = (text, cfg.vocab_size) {
            super::text::check_fits(&*cfg.encoder, v)?;
        }
        if !text {
            if let Some(o) = fingerprint.as_object_mut() {
                o.remove("tokenizer");
            }
        }
        Ok(Corpus {
            sources,
            mixer,
            val,
            val_prefix,
            seq_len: t,
            vocab: cfg.vocab_size,
            fingerprint,
            stats,
            skipped,
        })
    }

    /// The mixer placing global indices in sources.
    pub fn mixer(&self) -> &Mixer {
        &self.mixer
    }

    /// Training samples per epoch of the token sources; `None` when a text
    /// source makes it unknown before reading it all.
    pub fn train_samples(&self) -> Option<u64> {
        let mut n = 0;
        for s in &self.sources {
            match s {
                Source::Bin(b) => n += b.samples(),
                Source::Text(_) => return None,
            }
        }
        Some(n)
    }

    /// Whether a source is text, tokenized as it streams (its tokens are
    /// not counted ahead).
    pub fn has_text(&self) -> bool {
        self.sources.iter().any(|s| matches!(s, Source::Text(_)))
    }

    pub fn train_tokens(&self) -> usize {
        self.sources
            .iter()
            .map(|s| match s {
                Source::Bin(b) => b.train_tokens(),
                Source::Text(_) => 0,
            })
            .sum()
    }

    pub fn val_tokens(&self) -> usize {
        self.val.iter().map(|v| v.2).sum()
    }

    pub fn val_samples(&self) -> u64 {
        *self.val_prefix.last().expect("non-empty")
    }

    /// Appends global index `g`'s sample.
    pub fn push_sample(&self, g: u64, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) -> Result<()> {
        let (s, k) = self.mixer.locate(g);
        match &self.sources[s] {
            Source::Bin(b) => b.push_sample(k, self.vocab, inputs, targets),
            Source::Text(t) => {
                let from = inputs.len();
                t.push_sample(k, inputs, targets)?;
                if let Some(v) = self.vocab {
                    if let Some(bad) = inputs[from..]
                        .iter()
                        .chain(targets.last())
                        .find(|&&x| x as usize >= v)
                    {
                        let files = t.files();
                        let more = match files.len() {
                            1 => String::new(),
                            n => format!(" (one of {n} files)"),
                        };
                        return Err(DataError::Tokenizer(format!(
                            "token id {bad} from the text of {}{more} is out of range for the \
                             model's vocab_size {v}",
                            files[0].display()
                        )));
                    }
                }
                Ok(())
            }
        }
    }

    /// Appends validation sample `i`.
    pub fn push_val(&self, i: u64, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) -> Result<()> {
        let part = self.val_prefix.partition_point(|&p| p <= i) - 1;
        let (d, first, _) = &self.val[part];
        let at = first + (i - self.val_prefix[part]) as usize * self.seq_len;
        let t = self.seq_len;
        d.check_unchanged()?;
        let from = inputs.len();
        d.copy_range(at, at + t, inputs);
        d.copy_range(at + 1, at + t + 1, targets);
        if let Some(v) = self.vocab {
            super::shards::check_tokens(&inputs[from..], targets.last(), v, d, at)?;
        }
        Ok(())
    }

    /// Every text source's cursor at global position `g` (`None` for token sources).
    pub fn cursors_at(&self, g: u64) -> Result<Vec<Option<Cursor>>> {
        let counts = self.mixer.consumed(g);
        self.sources
            .iter()
            .zip(counts)
            .map(|(s, k)| match s {
                Source::Bin(_) => Ok(None),
                Source::Text(t) => t.cursor_of(k).map(Some),
            })
            .collect()
    }

    pub fn add_cursors(&self, cursors: &[Option<Cursor>]) -> Result<()> {
        for (s, c) in self.sources.iter().zip(cursors) {
            if let (Source::Text(t), Some(c)) = (s, c) {
                t.add_cursor(*c)?;
            }
        }
        Ok(())
    }
}

/// A validation text file, tokenized whole (validation sets are small).
/// A validation text file's tokens, its records read with `field` (the
/// first text source's, named by `field_key` in errors).
fn val_text(
    f: &std::path::Path,
    cfg: &CorpusConfig,
    (field, field_key): (&str, &str),
) -> Result<Vec<u32>> {
    let src = TextSource::new(
        TextSpec {
            files: vec![f.to_path_buf()],
            field: field.to_string(),
            field_key: field_key.to_string(),
            on_bad: cfg.on_bad_record,
            encoder: cfg.encoder.clone(),
            shuffle: false,
            seed: 0,
            threads: 1,
            prefetch: 1,
        },
        1,
        Arc::new(TextStats::default()),
    )?;
    src.whole_shard()
}

#[cfg(test)]
mod tests {
    /// A text file of a GiB or more is said (a sparse file: nothing read).
    #[test]
    fn a_big_text_file_is_said_naming_tokenize() {
        let d = std::env::temp_dir().join(format!("phalanx-big-text-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let small = d.join("small.txt");
        let big = d.join("big.jsonl");
        std::fs::write(&small, "hello").unwrap();
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(super::BIG_TEXT - 1).unwrap();
        let files = vec![small.clone(), big.clone()];
        assert_eq!(super::big_text_note("data.path", &files), None);
        f.set_len(3 * super::BIG_TEXT / 2).unwrap();
        let n = super::big_text_note("data.path", &files).unwrap();
        assert!(
            n.starts_with(&format!("data.path: {} is 1.5 GiB of text", big.display()))
                && n.contains("`phalanx tokenize` it"),
            "{n}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
