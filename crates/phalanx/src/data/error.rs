//! Errors of the data module.
//!
//! Every message names the sizes involved, so that a wrong config can be fixed
//! from the message alone.
//!
//! ```
//! use phalanx::data::DataError;
//! let e = DataError::Config("global batch 6 does not divide by dp 4".into());
//! assert!(e.to_string().contains("global batch 6"));
//! ```

use std::fmt;
use std::path::PathBuf;

/// What can go wrong while loading, tokenizing or batching data.
#[derive(Debug)]
pub enum DataError {
    /// Reading or memory-mapping a file failed.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file's content does not match its format (bad header, odd length, ...).
    Format { path: PathBuf, msg: String },
    /// A tokenizer name other than "byte" or "gpt2", or a tokenizer that failed to load.
    Tokenizer(String),
    /// A token id that the model's vocabulary does not hold.
    Vocab {
        token: u32,
        position: usize,
        vocab_size: usize,
    },
    /// Too few tokens or samples for what was asked.
    TooSmall(String),
    /// An inconsistent batch or split setting.
    Config(String),
    /// Building a tensor failed.
    Tensor(candle_core::Error),
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            DataError::Format { path, msg } => write!(f, "{}: {msg}", path.display()),
            DataError::Tokenizer(msg) => write!(f, "tokenizer: {msg}"),
            DataError::Vocab {
                token,
                position,
                vocab_size,
            } => write!(
                f,
                "token id {token} at position {position} is out of range for the model's \
                 vocab_size {vocab_size} (was the data tokenized with another tokenizer?)"
            ),
            DataError::TooSmall(msg) => write!(f, "not enough data: {msg}"),
            DataError::Config(msg) => write!(f, "data config: {msg}"),
            DataError::Tensor(e) => write!(f, "building a batch tensor: {e}"),
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DataError::Io { source, .. } => Some(source),
            DataError::Tensor(e) => Some(e),
            _ => None,
        }
    }
}

impl From<candle_core::Error> for DataError {
    fn from(e: candle_core::Error) -> Self {
        DataError::Tensor(e)
    }
}

/// Shorthand used across the data module.
pub type Result<T> = std::result::Result<T, DataError>;
