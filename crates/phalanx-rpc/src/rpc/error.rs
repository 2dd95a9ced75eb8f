//! What an RPC can fail with. Every variant names the worker involved, so
//! that one worker's log says where to look next.

use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub enum RpcError {
    /// The callee's function returned an error or panicked: its message.
    Remote {
        worker: String,
        func: String,
        message: String,
    },
    /// No function of that name is registered on the callee.
    UnknownFunction { worker: String, func: String },
    /// The caller's argument or result type is not the registered one.
    TypeMismatch {
        worker: String,
        func: String,
        detail: String,
    },
    /// No answer within the call's timeout.
    Timeout {
        worker: String,
        func: String,
        after: Duration,
    },
    /// The worker died, or left, before answering.
    WorkerDead { worker: String, reason: String },
    /// No worker has that name (or rank).
    UnknownWorker(String),
    /// Arguments or results that could not be (de)serialised.
    Codec(String),
    /// Bad arguments from this worker's own caller (names, ranks, sizes).
    Invalid(String),
    /// This agent was shut down.
    Shutdown(String),
    /// The transport under the agent failed.
    Comm(phalanx_comm::CommError),
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RpcError::Remote {
                worker,
                func,
                message,
            } => write!(f, "rpc {func} on {worker} failed: {message}"),
            RpcError::UnknownFunction { worker, func } => {
                write!(
                    f,
                    "rpc {func}: no function of that name is registered on {worker}"
                )
            }
            RpcError::TypeMismatch {
                worker,
                func,
                detail,
            } => write!(f, "rpc {func} on {worker}: type mismatch: {detail}"),
            RpcError::Timeout {
                worker,
                func,
                after,
            } => write!(
                f,
                "rpc {func} on {worker}: no answer within {:.3} s",
                after.as_secs_f64()
            ),
            RpcError::WorkerDead { worker, reason } => {
                write!(f, "rpc worker {worker} is gone: {reason}")
            }
            RpcError::UnknownWorker(w) => write!(f, "rpc: no worker named {w}"),
            RpcError::Codec(m) => write!(f, "rpc: serialisation: {m}"),
            RpcError::Invalid(m) => write!(f, "rpc: invalid argument: {m}"),
            RpcError::Shutdown(m) => write!(f, "rpc: shut down: {m}"),
            RpcError::Comm(e) => write!(f, "rpc: {e}"),
        }
    }
}

impl std::error::Error for RpcError {}

impl From<phalanx_comm::CommError> for RpcError {
    fn from(e: phalanx_comm::CommError) -> Self {
        RpcError::Comm(e)
    }
}

pub type RpcResult<T> = std::result::Result<T, RpcError>;
