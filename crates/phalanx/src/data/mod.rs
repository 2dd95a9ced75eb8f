//! Training data: tokenizers, token files and a layout-independent batch order.
//!
//! - [`tokenizer`]: `byte` (vocab 256) and `gpt2` (tiktoken r50k_base, offline).
//! - [`source`]: text files, nanoGPT and llm.c `.bin` files (memory-mapped).
//! - [`loader`]: train/validation split and the batch order, identical for
//!   every data-parallel size and accumulation setting at the same global batch.
//! - [`shuffle`]: the seeded permutation (splitmix64 + Fisher-Yates).
//! - [`corpus`]: many shards and sources (files, globs, directories, lists;
//!   token `.bin`, JSONL, text) mixed by weight ([`mix`]), token shards
//!   mapped ([`shards`]), text streamed and tokenized ahead ([`text`]),
//!   a text file's documents ([`records`]).
//!
//! The repository ships a corpus in `data/corpus.txt` (see `data/README.md`).
//!
//! ```
//! use phalanx::data::{DataLoader, LoaderConfig, TokenData, Tokenizer};
//! let tok = Tokenizer::from_name("byte").unwrap();
//! let text = "the quick brown fox jumps over the lazy dog. ".repeat(10);
//! let cfg = LoaderConfig { seq_len: 8, vocab_size: Some(256), ..Default::default() };
//! let loader = DataLoader::new(TokenData::from_tokens(tok.encode(&text)), cfg).unwrap();
//! // Rank 0 of 2, first of 2 micro-steps, 3 samples each: a global batch of 12.
//! let batch = loader.micro_batch(0, 0, 2, 0, 3, 2).unwrap();
//! assert_eq!(batch.inputs.len(), 3 * 8);
//! ```

pub mod corpus;
pub mod digest;
pub mod error;
pub mod loader;
pub mod mix;
pub mod paths;
pub mod records;
pub mod resume;
pub mod shards;
pub mod shuffle;
pub mod source;
pub mod text;
pub mod tokenizer;

pub use corpus::{Corpus, CorpusConfig, SourceSpec};
pub use text::{TextEncoder, TextStats};

/// What a record that cannot be read (a JSONL line that is not JSON, a
/// missing field, text that is not UTF-8) does: stop the run naming the
/// file and line, or be skipped and counted (`data_skipped` in the JSON log).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadRecord {
    #[default]
    Error,
    Skip,
}

/// What a resume does when the data differs from the checkpoint's (files,
/// content, order settings): stop naming the difference, or `warn` and go
/// on at the checkpoint's sample position in the data as it is now (after
/// a bad record was fixed, a file renamed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnMismatch {
    #[default]
    Error,
    Warn,
}

pub use error::DataError;
pub use loader::{micro_batch_size, Batch, DataLoader, LoaderConfig};
pub use resume::{DataState, LoaderStats};
pub use source::{Format, TokenData};
pub use tokenizer::Tokenizer;
