//! One error type for the whole communication layer.
//!
//! Every error says what failed and, where a peer is to blame, which rank and
//! host, so that a user reading one rank's log knows where to look next.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum CommError {
    /// A blocking call ran past its deadline.
    Timeout(String),
    /// A peer disconnected, crashed or stopped sending heartbeats.
    PeerDead {
        rank: usize,
        host: String,
        reason: String,
    },
    /// This group was torn down by `abort()` (here or on a peer).
    Aborted(String),
    /// Ranks called different collectives (PHALANX_DEBUG=detail).
    Desync(String),
    /// Authentication with the job secret failed.
    Auth(String),
    /// A malformed or oversized frame.
    Protocol(String),
    /// Bad arguments from the caller (sizes, ranks, roots...).
    Invalid(String),
    /// Anything the operating system reported.
    Io(String),
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommError::Timeout(m) => write!(f, "timeout: {m}"),
            CommError::PeerDead { rank, host, reason } => {
                write!(f, "rank {rank} ({host}) failed: {reason}")
            }
            CommError::Aborted(m) => write!(f, "process group aborted: {m}"),
            CommError::Desync(m) => write!(f, "collective desync: {m}"),
            CommError::Auth(m) => write!(f, "authentication failed: {m}"),
            CommError::Protocol(m) => write!(f, "protocol error: {m}"),
            CommError::Invalid(m) => write!(f, "invalid argument: {m}"),
            CommError::Io(m) => write!(f, "I/O error: {m}"),
        }
    }
}

impl std::error::Error for CommError {}

impl From<std::io::Error> for CommError {
    fn from(e: std::io::Error) -> Self {
        CommError::Io(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, CommError>;

/// Shorthand for an `Invalid` error from a format string.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::CommError::Invalid(format!($($arg)*)) };
}
pub(crate) use invalid;
