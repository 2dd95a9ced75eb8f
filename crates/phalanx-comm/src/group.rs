//! `ProcessGroup`: rank, size and the collectives over a set of processes.
//!
//! Collectives take slices and run on the calling thread (after any earlier
//! asynchronous operation of the same group has finished, so issue order is
//! execution order). The `*_async` variants take owned buffers, run on the
//! group's communication thread and return a `Work` whose `wait()` gives the
//! buffer back, so computation can overlap communication.
//!
//! ```
//! use phalanx_comm::{threads, ReduceOp};
//! let sums = threads::run(3, |pg| {
//!     let mut x = vec![pg.rank() as f32; 4];
//!     pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
//!     x
//! });
//! assert!(sums.iter().all(|x| x == &vec![3.0; 4]));
//! ```

use crate::backend::{native::Native, Backend, Bytes, BytesMut, Call, DeviceMode};
use crate::config::Config;
use crate::dtype::{Element, ReduceOp};
use crate::error::{invalid, CommError, Result};
use crate::transport::Transport;
use crate::work::Queue;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A group of processes that run collectives together. Cheap to clone.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

mod async_ops;
mod device;
mod msg;
mod p2p;
mod signature;
mod subgroups;

pub(crate) use signature::decode_sig as describe_encoded;
use signature::Signature;
#[cfg(feature = "mpi")]
pub(crate) use signature::{from_words as signature_from_words, to_words as signature_words};

struct Inner {
    /// What carries this group's operations (see `crate::backend`).
    backend: Arc<dyn Backend>,
    members: Vec<usize>,
    me: usize,
    gid: u64,
    seq: AtomicU64,
    children: AtomicU64,
    exec: Mutex<()>,
    queue: Queue,
    p2p_queue: Queue,
    /// Receives posted with `recv_async` and not yet done, per (source,
    /// tag): a synchronous `recv` of the same source and tag waits for
    /// them, so that messages are taken in issue order.
    posted: p2p::Posted,
    cfg: Config,
    /// Keeps a store server alive for as long as the group (rank 0 under mpirun).
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// The sum of per-rank `counts`, or `None` where it does not fit in a
/// `usize`: a plain sum would wrap in release builds (`[usize::MAX, 2]`
/// "sums" to 1), pass the size checks and then slice out of bounds.
pub(crate) fn total_of(counts: &[usize]) -> Option<usize> {
    counts.iter().try_fold(0usize, |a, &c| a.checked_add(c))
}

fn describe_total(total: Option<usize>) -> String {
    total.map_or_else(|| "more than usize::MAX".into(), |t| t.to_string())
}

impl Inner {
    /// Take the group's turn to run an operation. The lock guards no data,
    /// only the order of operations, so one that panicked (and poisoned
    /// it) leaves nothing inconsistent behind: later calls go on rather
    /// than every one panicking in turn.
    fn lock_exec(&self) -> std::sync::MutexGuard<'_, ()> {
        self.exec.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn digest(xs: &[usize]) -> u64 {
    // FNV-1a: a stable hash, the same in every process.
    xs.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

impl ProcessGroup {
    pub(crate) fn from_transport(
        t: Arc<Transport>,
        cfg: Config,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> ProcessGroup {
        let members: Vec<usize> = (0..t.world()).collect();
        let me = t.rank();
        ProcessGroup::make(Arc::new(Native::new(t)), members, me, 1, cfg, keep)
    }

    /// The world group of an MPI job (`PHALANX_BACKEND=mpi`).
    #[cfg(feature = "mpi")]
    pub(crate) fn from_mpi(comm: crate::mpi::Comm, cfg: Config) -> ProcessGroup {
        let members = comm.members().to_vec();
        let me = comm.rank();
        ProcessGroup::make(Arc::new(comm), members, me, 1, cfg, None)
    }

    /// The world group on another backend (NCCL), rank `me` of `world`.
    #[cfg(feature = "nccl")]
    pub(crate) fn from_backend(
        backend: Arc<dyn Backend>,
        world: usize,
        me: usize,
        cfg: Config,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> ProcessGroup {
        ProcessGroup::make(backend, (0..world).collect(), me, 1, cfg, keep)
    }

    /// Rank `rank` of a group of `size` that has no peers: it says where
    /// the rank stands ([`Self::rank`], [`Self::size`]) and every operation
    /// fails, naming it. For code that only lays things out for a rank (a
    /// tensor-parallel block declaring its parameters) without starting the
    /// other ranks. Panics when `rank` is not below `size` (a caller's bug,
    /// as an index out of range).
    ///
    /// ```
    /// use phalanx_comm::{ProcessGroup, ReduceOp};
    /// let pg = ProcessGroup::detached(1, 4);
    /// assert_eq!((pg.rank(), pg.size(), pg.backend_name()), (1, 4, "detached"));
    /// let e = pg.all_reduce(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
    /// assert!(e.to_string().contains("detached"), "{e}");
    /// ```
    pub fn detached(rank: usize, size: usize) -> ProcessGroup {
        assert!(rank < size, "rank {rank} is not in a group of size {size}");
        let backend = Arc::new(crate::backend::detached::Detached);
        ProcessGroup::make(
            backend,
            (0..size).collect(),
            rank,
            1,
            Config::default(),
            None,
        )
    }

    fn make(
        backend: Arc<dyn Backend>,
        members: Vec<usize>,
        me: usize,
        gid: u64,
        cfg: Config,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> ProcessGroup {
        let name = format!("phalanx-comm-{gid:x}");
        ProcessGroup {
            inner: Arc::new(Inner {
                backend,
                members,
                me,
                gid,
                seq: AtomicU64::new(0),
                children: AtomicU64::new(0),
                exec: Mutex::new(()),
                queue: Queue::new(name.clone()),
                p2p_queue: Queue::new(name + "-p2p"),
                posted: p2p::Posted::default(),
                cfg,
                _keep: keep,
            }),
        }
    }

    /// This process's rank within the group.
    pub fn rank(&self) -> usize {
        self.inner.me
    }
    /// Number of processes in the group.
    pub fn size(&self) -> usize {
        self.inner.members.len()
    }
    /// Global (world) rank of each group rank.
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.members
    }
    /// This process's global rank.
    pub fn global_rank(&self) -> usize {
        self.inner.members[self.inner.me]
    }
    /// The backend that carries this group: `native`, `mpi` or `nccl`.
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }
    /// Payload bytes this process has sent to peers so far, over every
    /// group sharing this group's transport (to measure a step's traffic).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.backend.bytes_sent()
    }

    /// All-reduces of this group done in place in shared memory (the world
    /// group on one host), for checks that the fast path serves a caller.
    pub fn in_place_all_reduces(&self) -> u64 {
        self.inner.backend.in_place_all_reduces()
    }

    /// The kind of link between this process and group rank `rank`:
    /// `Link::Unix` for a peer on this host, `Link::Tcp` for one elsewhere
    /// or under `PHALANX_TRANSPORT=tcp`; `None` for this process itself.
    pub fn link(&self, rank: usize) -> Option<crate::transport::Link> {
        let g = *self.inner.members.get(rank)?;
        self.inner.backend.link(self.global_rank(), g)
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// An operation's view of this group for its backend.
    fn call(&self, op: &'static str, seq: u64) -> Call<'_> {
        let inner = &*self.inner;
        Call {
            members: &inner.members,
            me: inner.me,
            gid: inner.gid,
            seq,
            deadline: Instant::now() + inner.cfg.timeout,
            op,
            cfg: &inner.cfg,
        }
    }

    /// Run one collective: take the next sequence number, optionally check
    /// that every rank called the same thing, then run `f` on the backend.
    fn collective<R>(
        &self,
        sig: Signature,
        f: impl FnOnce(&dyn Backend, &Call) -> Result<R>,
    ) -> Result<R> {
        let _blocked = crate::work::BlockedTimer::start();
        let inner = &*self.inner;
        if let Some(e) = self.broken() {
            return Err(e);
        }
        let _g = inner.lock_exec();
        let seq = inner.seq.fetch_add(1, Ordering::SeqCst);
        let c = self.call(sig.op, seq);
        if inner.cfg.detail && c.n() > 1 {
            self.down_on_timeout(self.check_signatures(&c, &sig))?;
        }
        self.down_on_timeout(f(&*inner.backend, &c))
    }

    /// `r`, once the group's transport is torn down if `r` is a timeout.
    /// Past an operation's deadline the ranks no longer agree on where they
    /// are: a later collective could take this one's frames, and each one
    /// queued behind it would wait out a deadline of its own (k buckets, k
    /// timeouts). So the peers are told why, as NCCL's watchdog does: they
    /// fail at once, and so does every later call here.
    fn down_on_timeout<R>(&self, r: Result<R>) -> Result<R> {
        if let Err(e @ CommError::Timeout(_)) = &r {
            self.fail_peers(&e.to_string());
        }
        r
    }

    fn sig<T: Element>(&self, op: &'static str, count: usize) -> Signature {
        Signature {
            op,
            dtype: T::DTYPE,
            count: count as u64,
            reduce: None,
            root: None,
            layout: 0,
            pairs: None,
        }
    }

    /// The per-rank `counts` of an uneven collective must cover the `full`
    /// buffer (one count per rank) and this rank's count its `part`.
    fn check_counts(&self, op: &str, counts: &[usize], full: usize, part: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let total = total_of(counts);
        if counts.len() != n || total != Some(full) || counts[r] != part {
            return Err(invalid!(
                "{op}: {} counts summing to {} for a full buffer of {full} and this rank's part of {part} \
                 (group size {n}, rank {r})",
                counts.len(),
                describe_total(total)
            ));
        }
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(invalid!(
                "root {root} is out of range for a group of size {}",
                self.size()
            ));
        }
        Ok(())
    }

    // ---- synchronous collectives -------------------------------------

    /// Reduce `buf` across the group in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.inner.queue.drain();
        self.all_reduce_now(buf, op)
    }

    fn all_reduce_now<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let sig = Signature {
            reduce: Some(op),
            ..self.sig::<T>("all_reduce", buf.len())
        };
        self.collective(sig, |b, c| b.all_reduce(c, BytesMut::of(buf), op))
    }

    /// Reduce `input` (size * output.len() elements) across the group and
    /// leave block `rank` of the result in `output`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = vec![output.len(); self.size()];
        self.reduce_scatter_v(input, &counts, output, op)
    }

    /// Reduce-scatter with uneven blocks: block k has `counts[k]` elements.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.inner.queue.drain();
        self.reduce_scatter_now(input, counts, output, op)
    }

    fn reduce_scatter_now<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_counts("reduce_scatter", counts, input.len(), output.len())?;
        let sig = Signature {
            reduce: Some(op),
            layout: digest(counts),
            ..self.sig::<T>("reduce_scatter", input.len())
        };
        self.collective(sig, |b, c| {
            b.reduce_scatter_v(c, Bytes::of(input), counts, BytesMut::of(output), op)
        })
    }

    /// Gather every rank's `input` (all the same length) into `output`,
    /// ordered by rank.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = vec![input.len(); self.size()];
        self.all_gather_v(input, &counts, output)
    }

    /// All-gather with uneven sizes: rank k contributes `counts[k]` elements.
    pub fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        self.inner.queue.drain();
        self.all_gather_now(input, counts, output)
    }

    fn all_gather_now<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        self.check_counts("all_gather", counts, output.len(), input.len())?;
        let sig = Signature {
            layout: digest(counts),
            ..self.sig::<T>("all_gather", output.len())
        };
        self.collective(sig, |b, c| {
            b.all_gather_v(c, Bytes::of(input), counts, BytesMut::of(output))
        })
    }

    /// Copy `buf` of rank `root` to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.inner.queue.drain();
        self.broadcast_now(buf, root)
    }

    fn broadcast_now<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        let sig = Signature {
            root: Some(root as u64),
            ..self.sig::<T>("broadcast", buf.len())
        };
        self.collective(sig, |b, c| b.broadcast(c, BytesMut::of(buf), root))
    }

    /// Reduce `buf` across the group into rank `root`'s `buf`; other ranks'
    /// buffers are left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.inner.queue.drain();
        self.check_root(root)?;
        let sig = Signature {
            reduce: Some(op),
            root: Some(root as u64),
            ..self.sig::<T>("reduce", buf.len())
        };
        self.collective(sig, |b, c| b.reduce(c, BytesMut::of(buf), root, op))
    }

    /// Block j of `input` goes to rank j; block i of `output` comes from
    /// rank i. Both hold size * k elements.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.inner.queue.drain();
        self.all_to_all_now(input, output)
    }

    fn all_to_all_now<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = self.size();
        if input.len() != output.len() || !input.len().is_multiple_of(n) {
            return Err(invalid!(
                "all_to_all: input ({}) and output ({}) must be equal and divisible by the group size {n}",
                input.len(),
                output.len()
            ));
        }
        let k = vec![input.len() / n; n];
        self.all_to_all_v_now(input, &k, output, &k, input.len())
    }

    /// All-to-all with sizes per rank: `input` holds `send[j]` elements for
    /// rank j, in rank order; `output` receives `recv[i]` from rank i.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        self.inner.queue.drain();
        self.all_to_all_v_now(input, send, output, recv, self.size())
    }

    fn all_to_all_v_now<T: Element>(
        &self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
        sig_count: usize,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank();
        let (sent, received) = (total_of(send), total_of(recv));
        if send.len() != n
            || recv.len() != n
            || sent != Some(input.len())
            || received != Some(output.len())
            || send[me] != recv[me]
        {
            return Err(invalid!(
                "all_to_all_v: {} send and {} receive counts for {n} ranks, summing to {} and {} \
                 for buffers of {} and {} (and this rank's own count must match; rank {me})",
                send.len(),
                recv.len(),
                describe_total(sent),
                describe_total(received),
                input.len(),
                output.len()
            ));
        }
        // Ranks of a v-collective send different amounts: its signature
        // (`sig_count`) is the group size, and each receive checks its size.
        // Under detail it also carries both count vectors, so that every
        // rank checks that what each rank sends each other rank is what
        // that one expects (`check_signatures`).
        let pairs = self.inner.cfg.detail.then(|| {
            let words = |c: &[usize]| c.iter().map(|&x| x as u64).collect();
            (words(send), words(recv))
        });
        let sig = Signature {
            pairs,
            ..self.sig::<T>("all_to_all", sig_count)
        };
        self.collective(sig, |b, c| {
            b.all_to_all_v(c, Bytes::of(input), send, BytesMut::of(output), recv)
        })
    }

    /// Return once every rank of the group has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.inner.queue.drain();
        // An all-reduce of one word, under its own name: PHALANX_DEBUG=detail
        // tells a barrier on one rank from an all_reduce on another.
        let mut x = [1i32];
        let sig = Signature {
            reduce: Some(ReduceOp::Sum),
            ..self.sig::<i32>("barrier", 1)
        };
        self.collective(sig, |b, c| {
            b.all_reduce(c, BytesMut::of(&mut x[..]), ReduceOp::Sum)
        })
    }

    /// Leave the job cleanly (`destroy_process_group`): peers see a goodbye,
    /// not a crash. Every group sharing the transport stops working.
    pub fn shutdown(&self) {
        self.synchronize();
        self.inner.backend.shutdown();
    }

    /// Tear down the transport under this group (and every group sharing
    /// it): pending and later calls here and on peers fail with `reason`.
    /// Under MPI this ends the whole job at once (`MPI_Abort`).
    pub fn abort(&self, reason: &str) {
        self.inner.backend.abort(reason);
    }

    /// Tell the peers this rank has failed, with `reason`, where that
    /// leaves this process running: [`ProcessGroup::abort`] on the native
    /// and NCCL backends (peers fail at once with `rank N (host) aborted:
    /// reason`), even where this rank has recorded a failure already (an
    /// NCCL timeout, a torn socket: its peers have not heard of it; an
    /// abort again only closes what is left); nothing under MPI, whose
    /// abort would end the job before the caller sees its error (the
    /// rank's exit with that error ends an mpirun job).
    pub fn fail_peers(&self, reason: &str) {
        let b = &self.inner.backend;
        if !b.abort_ends_job() {
            b.abort(reason);
        }
    }

    #[doc(hidden)]
    pub fn crash_for_test(&self) {
        self.inner.backend.crash_for_test();
    }

    /// The failure that broke this group, if any.
    pub fn failure(&self) -> Option<CommError> {
        self.inner.backend.failure()
    }

    /// An error once this rank shut the group down cleanly (messages: a
    /// failure of the group is theirs to report, after what arrived).
    fn check_open(&self) -> Result<()> {
        match self.inner.backend.closed() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Why a call cannot run: the group's failure, or its clean shutdown on
    /// this rank.
    fn broken(&self) -> Option<CommError> {
        let b = &self.inner.backend;
        b.failure().or_else(|| b.closed())
    }

    /// Whether `other` is this group (a clone of it), not another with the
    /// same members.
    pub fn same_group(&self, other: &ProcessGroup) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside one operation (here the backend call itself) poisons
    /// the group's turn lock; the next operation must still run.
    #[test]
    fn a_panic_inside_a_collective_leaves_the_group_usable() {
        let out = crate::threads::run(1, |pg| {
            let sig = pg.sig::<f32>("all_reduce", 1);
            let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = pg.collective(sig, |_, _| -> Result<()> { panic!("in the backend") });
            }));
            assert!(hit.is_err(), "the panic was not raised");
            assert!(pg.inner.exec.is_poisoned());
            let mut x = [2.0f32];
            pg.all_reduce(&mut x, ReduceOp::Sum).map(|_| x[0])
        });
        assert_eq!(out[0], Ok(2.0));
    }
}
