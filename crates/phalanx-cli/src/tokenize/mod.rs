//! `phalanx tokenize`: text into llm.c token files, in two forms.
//!
//! - Sharded (`--output-dir DIR`, every positional an input): files,
//!   directories and globs of text, JSONL and Parquet, tokenized on every core into
//!   llm.c shards of `--shard-size` tokens plus a validation shard, with a
//!   progress line, resumable after a kill ([`shards`], the book's
//!   "Preparing data" in `docs/training.md`).
//! - Single file (`INPUT OUTPUT`): one UTF-8 text file encoded whole into
//!   one `.bin` ([`single`]), the form that came first.
//!
//! The tokenizer is a Hugging Face `tokenizer.json` (`--tokenizer`) or a
//! built-in one (`--encoding gpt2 | byte`), so the shards suit models of
//! any vocabulary: the loader reads llm.c files whatever `data.tokenizer`
//! says.

mod encoder;
mod pipeline;
mod progress;
mod shard;
mod shards;
mod single;
mod state;
mod writer;

use clap::{ArgGroup, Args};
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("vocabulary").required(true).args(["tokenizer", "encoding"])))]
pub struct TokenizeOpts {
    /// A Hugging Face `tokenizer.json`, or a model directory holding one.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// A built-in tokenizer: gpt2 (tiktoken's r50k_base, offline) or byte.
    #[arg(long)]
    pub encoding: Option<String>,
    /// With --output-dir: input files, directories and globs (a text file
    /// is one document, JSONL one per line, Parquet one per row). Without:
    /// INPUT OUTPUT, one text file into one llm.c file.
    #[arg(required = true, value_name = "INPUT")]
    pub paths: Vec<String>,
    /// Write llm.c shards and a resumable state (tokenize.json) here.
    #[arg(long, value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
    /// Shard file names: PREFIX_val_000000.bin, PREFIX_train_000001.bin, ...
    /// [default: data]
    #[arg(long)]
    pub prefix: Option<String>,
    /// Tokens per training shard (K, M, G suffixes: powers of 1000), at
    /// most 4294967295. [default: 100M, as llm.c]
    #[arg(long, value_parser = shard::parse_count, value_name = "TOKENS")]
    pub shard_size: Option<u64>,
    /// The first TOKENS of the stream go to the validation shard. [default:
    /// 0, none: the trainer holds out data.val_fraction of each shard]
    #[arg(long, value_parser = shard::parse_count, value_name = "TOKENS")]
    pub val_tokens: Option<u64>,
    /// The JSONL key holding a document's text. [default: text]
    #[arg(long)]
    pub field: Option<String>,
    /// A bad record (bad JSON, missing field, not UTF-8): error stops naming
    /// the file and line, skip counts it. [default: error]
    #[arg(long, value_parser = ["error", "skip"])]
    pub on_bad_record: Option<String>,
    /// Tokenizer threads (the output does not depend on it). [default: the
    /// available cores]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub threads: Option<u32>,
    /// The single-file form: start with this token. Sharded: put it before
    /// every document instead of the tokenizer's end-of-text token.
    #[arg(long)]
    pub bos: Option<String>,
    /// Single file: replace OUTPUT. Sharded: start over, deleting this
    /// run's shards in DIR.
    #[arg(long)]
    pub force: bool,
}

pub fn main(o: &TokenizeOpts) -> i32 {
    match run(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx tokenize: {e}");
            1
        }
    }
}

fn run(o: &TokenizeOpts) -> Result<(), String> {
    if let Some(dir) = &o.output_dir {
        return shards::run(o, dir);
    }
    let sharded_only = [
        (o.prefix.is_some(), "--prefix"),
        (o.shard_size.is_some(), "--shard-size"),
        (o.val_tokens.is_some(), "--val-tokens"),
        (o.field.is_some(), "--field"),
        (o.on_bad_record.is_some(), "--on-bad-record"),
        (o.threads.is_some(), "--threads"),
    ];
    if let Some((_, flag)) = sharded_only.iter().find(|(given, _)| *given) {
        return Err(format!(
            "{flag} is for sharded output: give --output-dir DIR"
        ));
    }
    match o.paths.as_slice() {
        [input, output] => single::run(o, Path::new(input), Path::new(output)),
        _ => Err(format!(
            "{} paths given without --output-dir: give --output-dir DIR to write llm.c shards \
             from many inputs (without it the form is INPUT OUTPUT: one text file into one .bin)",
            o.paths.len()
        )),
    }
}
