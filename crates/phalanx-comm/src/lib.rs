//! phalanx-comm: process groups, collectives, transports and the rendezvous
//! store of Phalanx. It knows nothing of tensors: collectives move slices of
//! `f32`, `f64`, `f16`, `bf16`, `i32` and `i64`.
//!
//! Layers, bottom up:
//! - `wire`: frames and the secret handshake;
//! - `store`: the rendezvous key-value store (TCPStore);
//! - `transport`: the mesh between ranks (Unix sockets on one host, TCP
//!   across hosts), failure detection;
//! - `algo`: ring, recursive doubling and tree algorithms;
//! - `backend`: the `Backend` trait a group's operations run on (`native`:
//!   the transports and algorithms above; `mpi`);
//! - `group`: `ProcessGroup`, its collectives, async `Work`, sub-groups;
//! - `init`: start from torchrun / mpirun / srun variables;
//! - `mpi` (feature `mpi`): the same `ProcessGroup` on the system MPI library;
//! - `nccl` (feature `nccl`): collectives on NVIDIA's NCCL, one CUDA device
//!   per rank (built without CUDA; not yet run on GPU hardware);
//! - `ft`: replica groups, the lighthouse and per-step quorums (fault tolerance);
//! - `threads`: ranks as threads, for tests.
//!
//! ```
//! use phalanx_comm::{threads, ReduceOp};
//! let out = threads::run(2, |pg| {
//!     let mut g = vec![1.0f32, 2.0];
//!     pg.all_reduce(&mut g, ReduceOp::Avg).unwrap();
//!     g
//! });
//! assert_eq!(out[1], vec![1.0, 2.0]);
//! ```

pub mod algo;
pub mod backend;
pub mod child;
pub mod config;
pub mod dtype;
pub mod error;
pub mod ft;
pub mod group;
pub mod init;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod patience;
mod ratelog;
pub mod secret_file;
pub mod store;
pub mod threads;
pub mod transport;
pub mod wire;
pub mod work;

pub use backend::{Backend, DeviceBuf, DeviceMode};
pub use config::{Algo, Config, NetEmulate, TransportPref};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use group::ProcessGroup;
pub use half::{bf16, f16};
pub use init::{init_process_group, BackendKind, DistEnv, JobSizes};
pub use transport::Link;
pub use work::{blocked_seconds, Work};
