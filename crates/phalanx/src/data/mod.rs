//! Training data: tokenizers, token files and a layout-independent batch order.
//!
//! - [`tokenizer`]: `byte` (vocab 256) and `gpt2` (tiktoken r50k_base, offline).
//! - [`source`]: text files, nanoGPT and llm.c `.bin` files (memory-mapped).
//! - [`loader`]: train/validation split and the batch order, identical for
//!   every data-parallel size and accumulation setting at the same global batch.
//! - [`shuffle`]: the seeded permutation (splitmix64 + Fisher-Yates).
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

pub mod error;
pub mod loader;
pub mod shuffle;
pub mod source;
pub mod tokenizer;

pub use error::DataError;
pub use loader::{micro_batch_size, Batch, DataLoader, LoaderConfig};
pub use source::{Format, TokenData};
pub use tokenizer::Tokenizer;
