//! The library's error: one enum over the layers it drives, so a trainer can
//! use `?` on tensors, collectives, data and config alike.

use std::fmt;

#[derive(Debug)]
pub enum Error {
    Tensor(candle_core::Error),
    Comm(phalanx_comm::CommError),
    Data(crate::data::DataError),
    Config(crate::config::ConfigError),
    Io(String),
    /// A check that failed (diverged ranks, bad state, ...).
    Check(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Tensor(e) => write!(f, "{e}"),
            Error::Comm(e) => write!(f, "{e}"),
            // "data config: …" says it already.
            Error::Data(e @ crate::data::DataError::Config(_)) => write!(f, "{e}"),
            Error::Data(e) => write!(f, "data: {e}"),
            Error::Config(e) => write!(f, "{e}"),
            Error::Io(e) => write!(f, "{e}"),
            Error::Check(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        // Candle attaches a backtrace when RUST_BACKTRACE is set; a user
        // needs the message, not the frames.
        match e {
            candle_core::Error::WithBacktrace { inner, .. } => Error::Tensor(*inner),
            e => Error::Tensor(e),
        }
    }
}
impl From<phalanx_comm::CommError> for Error {
    fn from(e: phalanx_comm::CommError) -> Self {
        Error::Comm(e)
    }
}
impl From<crate::data::DataError> for Error {
    fn from(e: crate::data::DataError) -> Self {
        Error::Data(e)
    }
}
impl From<crate::config::ConfigError> for Error {
    fn from(e: crate::config::ConfigError) -> Self {
        Error::Config(e)
    }
}
impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, Error>;
