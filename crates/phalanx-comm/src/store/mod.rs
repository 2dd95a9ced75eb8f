//! The rendezvous store: a small TCP key-value store, like PyTorch's TCPStore.
//!
//! The launcher (or rank 0 under mpirun/srun) serves it; every rank connects
//! as a client to publish its address and find its peers. Every connection
//! first proves it holds the job secret (see `wire::handshake`), frames are
//! size-limited, and a bad client is dropped without disturbing the others.
//!
//! ```
//! use phalanx_comm::store::{StoreServer, StoreClient};
//! use std::time::Duration;
//! let secret = b"job-secret".to_vec();
//! let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
//! let c = StoreClient::connect(&server.addr().to_string(), &secret, Duration::from_secs(5)).unwrap();
//! c.set("k", b"v").unwrap();
//! assert_eq!(c.get("k").unwrap(), b"v".to_vec());
//! assert_eq!(c.add("n", 2).unwrap(), 2);
//! ```

mod client;
mod server;
mod torch;

pub use client::StoreClient;
pub use server::{StoreLimits, StoreServer};

/// Frames larger than this are refused before any memory is allocated.
pub const MAX_FRAME: usize = 16 << 20;

// Request opcodes.
pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_WAIT: u8 = 3;
pub(crate) const OP_ADD: u8 = 4;
pub(crate) const OP_CAS: u8 = 5;
pub(crate) const OP_DELETE: u8 = 6;
pub(crate) const OP_NUM_KEYS: u8 = 7;

// Reply status bytes.
pub(crate) const R_OK: u8 = 0;
pub(crate) const R_NOT_FOUND: u8 = 1;
pub(crate) const R_TIMEOUT: u8 = 2;
pub(crate) const R_ERROR: u8 = 3;
