//! The NCCL backend (`--features nccl`, `PHALANX_BACKEND=nccl`): a
//! `ProcessGroup` whose collectives run on NVIDIA's NCCL, one CUDA device
//! per rank.
//!
//! **Status: built and unit-tested on CPU machines; not yet run on GPU
//! hardware.** `scripts/gpu_check.sh` is the check to run where a GPU is.
//!
//! - Nothing of CUDA is needed to build: `cudarc` (driver API and NCCL
//!   types) loads `libcuda` at run time, and NCCL is loaded here by name
//!   (`libnccl.so.2`, then `libnccl.so`; see [`probe`]). On a machine
//!   without a driver, device or libnccl, `init_process_group` fails at
//!   once naming what is missing.
//! - Device: `LOCAL_RANK` modulo the number of devices (its primary
//!   context, so CUDA code of the same process shares it).
//! - The world communicator's unique id travels through the job's store
//!   ([`id`]); sub-groups are `ncclCommSplit`s of their parent.
//! - The trait's buffers are on the host: each collective is staged to the
//!   device, run on the communicator's stream, waited for under the call's
//!   deadline (`PHALANX_TIMEOUT`; then `ncclCommAbort` and an error naming
//!   the operation, group and rank) and copied back ([`backend`]).
//!   `all_reduce_device`, `all_gather_device` and `reduce_scatter_device`
//!   take the caller's device memory instead, in place, nothing staged,
//!   ordered after the caller's stream by an event; started without
//!   waiting, each gets an event and a mark to wait for it alone
//!   ([`marks`]).
//! - Point-to-point messages and `PHALANX_DEBUG=detail` signature checks go
//!   over the native mesh, which the world group connects as well. The
//!   mesh also carries the job's failures (a peer's ABORT, crash or
//!   silence): every NCCL wait asks it, so a rank that fails ends its
//!   peers' collectives at once with its reason, where NCCL alone would
//!   wait for it until the deadline.
//!
//! Not yet built (issue 30): device buffers for the collectives other than
//! the all-reduce, the all-gather and the reduce-scatter.

mod backend;
mod comm;
mod cuda;
pub mod id;
pub mod layout;
pub mod marks;
pub mod probe;
pub mod progress;

pub use backend::Nccl;

use crate::backend::native::Native;
use crate::backend::Backend;
use crate::config::Config;
use crate::error::Result;
use crate::store::StoreClient;
use crate::transport::connect_mesh;
use std::sync::Arc;
use std::time::Instant;

/// The world group's carrier: the native mesh, then the NCCL communicator
/// on device `local_rank % devices`, its id shared through `store`.
pub(crate) fn world(
    store: &StoreClient,
    prefix: &str,
    rank: usize,
    world: usize,
    local_rank: usize,
    secret: &[u8],
    cfg: &Config,
) -> Result<Arc<dyn Backend>> {
    let (devices, api) = probe::require()?;
    let deadline = Instant::now() + cfg.timeout;
    let t = connect_mesh(store, prefix, rank, world, secret, cfg)?;
    let dev = Arc::new(cuda::Device::open(local_rank % devices)?);
    let uid = id::share(store, &id::key(prefix, 1), rank, deadline, || {
        comm::Comm::unique_id(api)
    })?;
    let native: Arc<dyn Backend> = Arc::new(Native::new(t));
    // A peer that aborts or dies is seen on the mesh: every NCCL wait of
    // this job (creation, splits, collectives) ends with it at once.
    let mesh = native.clone();
    let peers: comm::Peers = Arc::new(move || mesh.failure());
    let comm = comm::Comm::init(api, dev, uid, rank, world, deadline, peers)?;
    Ok(Arc::new(Nccl { comm, native }))
}
