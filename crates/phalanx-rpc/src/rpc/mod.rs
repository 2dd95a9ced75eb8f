//! Remote procedure calls between workers, for what collectives do not
//! fit: parameter servers, reinforcement-learning actors and learners,
//! anything asynchronous (PyTorch's `torch.distributed.rpc`).
//!
//! Workers start from the same rendezvous as a process group and have
//! names. Functions are registered by name, before the agent starts, with
//! typed arguments and results (serde); a caller using other types than
//! the registered ones gets `RpcError::TypeMismatch`, an unknown name
//! `RpcError::UnknownFunction`, and a function's `Err` (or panic) comes
//! back as `RpcError::Remote` with the callee's message: the callee never
//! crashes. Calls run on a bounded pool of threads on the callee.
//!
//! - `rpc_sync` / `rpc_async` (an `RpcFuture`: `wait()`, `.await`, or
//!   `wait_any` over several);
//! - `remote` runs a function on another worker and leaves the result
//!   there, returning an `RRef` (`to_here`, methods run on the owner,
//!   owner-side reference counting);
//! - every call has a timeout; a dead worker fails the calls pending on it
//!   at once, naming it; `shutdown` waits for every worker's outstanding
//!   calls before it closes;
//! - `Blob` carries tensors beside the message without copies.
//!
//! ```
//! use phalanx_rpc::rpc::{Registry, Rpc, Options, RpcError};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let mut reg = Registry::new();
//!     reg.register("add", |_ctx, (a, b): (i64, i64)| a + b);
//!     reg.register("counter", |_ctx, start: u64| std::sync::Mutex::new(start));
//!     reg.register_method("bump", |_ctx, c: &std::sync::Mutex<u64>, by: u64| {
//!         let mut c = c.lock().unwrap();
//!         *c += by;
//!         Ok(*c)
//!     });
//!     let name = format!("worker{}", pg.rank());
//!     let rpc = Rpc::start(&pg, &name, reg, Options::default()).unwrap();
//!     let mut got = 0;
//!     if pg.rank() == 0 {
//!         got = rpc.rpc_sync::<_, i64>("worker1", "add", &(2i64, 3i64)).unwrap();
//!         let fut = rpc.rpc_async::<_, i64>("worker1", "add", &(1i64, 1i64));
//!         assert_eq!(fut.wait().unwrap(), 2);
//!         // A value left on worker1, and a method run there.
//!         let c = rpc.remote::<_, std::sync::Mutex<u64>>("worker1", "counter", &10u64).unwrap();
//!         assert_eq!(c.rpc_sync::<_, u64>("bump", &5u64).unwrap(), 15);
//!         // Wrong types are the caller's error, not a crash over there.
//!         let e = rpc.rpc_sync::<_, i64>("worker1", "add", &(1.0f32,)).unwrap_err();
//!         assert!(matches!(e, RpcError::TypeMismatch { .. }));
//!     }
//!     rpc.shutdown().unwrap();
//!     got
//! });
//! assert_eq!(out[0], 5);
//! ```

mod agent;
mod codec;
mod error;
mod future;
pub mod launch;
mod loops;
mod registry;
mod rref;

pub use agent::Options;
pub use codec::{Blob, RRefId};
pub use error::{RpcError, RpcResult};
pub use future::{wait_any, RpcFuture};
pub use registry::{Ctx, Registry};
pub use rref::RRef;

use agent::Agent;
use codec::{encode, RRefId as Id, Target};
use phalanx_comm::ProcessGroup;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::any::type_name;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A worker's RPC agent. Cheap to clone.
#[derive(Clone)]
pub struct Rpc {
    a: Arc<Agent>,
}

/// A worker, by name or by rank.
pub trait ToWorker {
    fn rank_in(&self, rpc: &Rpc) -> RpcResult<usize>;
}

impl ToWorker for usize {
    fn rank_in(&self, rpc: &Rpc) -> RpcResult<usize> {
        (*self < rpc.world())
            .then_some(*self)
            .ok_or_else(|| RpcError::UnknownWorker(format!("rank {self}")))
    }
}

impl ToWorker for &str {
    fn rank_in(&self, rpc: &Rpc) -> RpcResult<usize> {
        rpc.worker_rank(self)
    }
}

impl ToWorker for &String {
    fn rank_in(&self, rpc: &Rpc) -> RpcResult<usize> {
        rpc.worker_rank(self)
    }
}

impl ToWorker for String {
    fn rank_in(&self, rpc: &Rpc) -> RpcResult<usize> {
        rpc.worker_rank(self)
    }
}

/// Start this process's agent as worker `name`, rank `rank` of `world`,
/// from the launcher's rendezvous (`MASTER_ADDR`, `MASTER_PORT`,
/// `PHALANX_SECRET`: see `phalanx_comm::init`). Every worker calls it.
pub fn init_rpc(name: &str, rank: usize, world: usize, reg: Registry) -> RpcResult<Rpc> {
    init_rpc_with(name, rank, world, reg, Options::default())
}

pub fn init_rpc_with(
    name: &str,
    rank: usize,
    world: usize,
    reg: Registry,
    opts: Options,
) -> RpcResult<Rpc> {
    let mut env = phalanx_comm::DistEnv::from_env()?;
    if env.source != "single" && (env.rank, env.world_size) != (rank, world) {
        return Err(RpcError::Invalid(format!(
            "init_rpc({name:?}, rank {rank}, world {world}), but {} started this process as rank {} of {}",
            env.source, env.rank, env.world_size
        )));
    }
    if env.source == "single" && (rank, world) != (0, 1) {
        // Read again as the rank it is, so that what depends on the job's
        // size is decided for this one (a job that may span hosts needs
        // PHALANX_SECRET, said here, not after the store's wait).
        let n = |v: usize| Some(v.to_string());
        // (Read as torchrun's variables: the messages name init_rpc.)
        let me = format!("init_rpc(rank {rank}, world {world}) without a launcher");
        env = phalanx_comm::DistEnv::from_vars(|k| match k {
            "RANK" | "LOCAL_RANK" => n(rank),
            "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => n(world),
            _ => std::env::var(k).ok(),
        })
        .map_err(|e| match e {
            phalanx_comm::CommError::Invalid(m) => {
                phalanx_comm::CommError::Invalid(m.replacen("torchrun", &me, 1))
            }
            e => e,
        })?;
        env.source = "init_rpc";
    }
    let pg = phalanx_comm::init::init_with(&env, phalanx_comm::Config::from_env())?;
    Rpc::start(&pg, name, reg, opts)
}

impl Rpc {
    /// Start an agent over an existing process group (every rank calls
    /// it). The agent makes its own sub-group, so its traffic never meets
    /// the group's own; `shutdown` closes the transport under both.
    pub fn start(pg: &ProcessGroup, name: &str, reg: Registry, opts: Options) -> RpcResult<Rpc> {
        Ok(Rpc {
            a: Agent::start(pg, name, reg, opts)?,
        })
    }

    pub(crate) fn from_agent(a: Arc<Agent>) -> Rpc {
        Rpc { a }
    }

    pub(crate) fn weak(&self) -> Weak<Agent> {
        Arc::downgrade(&self.a)
    }

    /// This worker's name.
    pub fn name(&self) -> &str {
        self.a.name_of(self.a.rank)
    }
    pub fn rank(&self) -> usize {
        self.a.rank
    }
    pub fn world(&self) -> usize {
        self.a.names.len()
    }
    /// Every worker's name, by rank.
    pub fn workers(&self) -> &[String] {
        &self.a.names
    }
    pub fn worker_name(&self, rank: usize) -> &str {
        self.a.name_of(rank)
    }
    pub fn worker_rank(&self, name: &str) -> RpcResult<usize> {
        self.a
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| RpcError::UnknownWorker(name.to_string()))
    }
    /// The default timeout of this worker's calls (`Options::timeout`; as
    /// `torch.distributed.rpc.get_rpc_timeout`).
    pub fn timeout(&self) -> Duration {
        self.a.opts.timeout
    }
    /// The process group under the agent (its own sub-group).
    pub fn group(&self) -> &ProcessGroup {
        &self.a.pg
    }

    /// Call `func` on `to` with `args`; wait for its result.
    pub fn rpc_sync<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> RpcResult<R> {
        self.rpc_async(to, func, args).wait()
    }

    pub fn rpc_sync_timeout<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Duration,
    ) -> RpcResult<R> {
        self.rpc_async_timeout(to, func, args, timeout).wait()
    }

    /// Start a call of `func` on `to`; the future gives its result.
    pub fn rpc_async<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> RpcFuture<R> {
        self.rpc_async_timeout(to, func, args, self.a.opts.timeout)
    }

    pub fn rpc_async_timeout<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Duration,
    ) -> RpcFuture<R> {
        let (at, rt) = (type_name::<A>(), type_name::<R>());
        let (to, enc) = match to.rank_in(self) {
            Ok(r) => (r, encode(args)),
            Err(e) => (self.a.rank, Err(e)),
        };
        let (timeout, enc) = match agent::checked_timeout(timeout) {
            Ok(t) => (t, enc),
            Err(e) => (Duration::from_secs(1), Err(e)),
        };
        let slot = self
            .a
            .start_call(to, func, at, rt, Target::Func, enc, timeout);
        RpcFuture::new(slot, self.weak(), to, func, timeout)
    }

    /// Run `func` on `to` and keep its result there; the `RRef` refers to
    /// it. Returns at once: `to_here` and methods wait for the value, and
    /// report an error of `func`.
    pub fn remote<A: Serialize, T: 'static>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> RpcResult<RRef<T>> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let to = to.rank_in(self)?;
        let id = Id {
            creator: self.a.rank as u32,
            seq: SEQ.fetch_add(1, Ordering::Relaxed),
        };
        let (at, rt) = (type_name::<A>(), type_name::<T>());
        let t = self.a.opts.timeout;
        let slot = self
            .a
            .start_call(to, func, at, rt, Target::Remote(id), encode(args), t);
        // A call that could not even be sent is reported now (the value
        // will never exist); the function's own outcome comes with the value.
        let fut = RpcFuture::<()>::new(slot, self.weak(), to, func, t);
        // Made first: the owner counted this reference when the call
        // arrived, and a reference dropped on an error below gives the
        // count back (the owner frees its entry).
        let r = RRef::new(to, id, self.weak());
        if fut.is_ready() {
            if let Err(
                e @ (RpcError::WorkerDead { .. }
                | RpcError::UnknownFunction { .. }
                | RpcError::TypeMismatch { .. }
                | RpcError::Shutdown(_)
                | RpcError::Comm(_)
                | RpcError::Codec(_)),
            ) = fut.wait()
            {
                drop(r);
                return Err(e);
            }
        }
        Ok(r)
    }

    /// Values this worker owns for `RRef`s (for tests and monitoring).
    pub fn owned_values(&self) -> usize {
        self.a.owned.len()
    }

    /// Graceful shutdown: wait for this worker's outstanding calls, then
    /// for every worker to reach `shutdown` (serving calls meanwhile),
    /// then stop the agent and close the transport. Every worker calls it.
    pub fn shutdown(&self) -> RpcResult<()> {
        let deadline = Instant::now() + self.a.opts.timeout;
        while !self.a.pending.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let res = self.a.pg.barrier();
        self.a.stop();
        self.a.join_pool();
        self.a.pg.shutdown();
        res.map_err(|e| self.a.comm_error(self.a.rank, e))
    }
}
