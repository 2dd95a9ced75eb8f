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

use crate::algo::{self, even_split, ranges, Ctx};
use crate::config::{Algo, Config};
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

/// What a group's operations run on.
enum Net {
    /// Phalanx's own transport: shared memory, Unix sockets, TCP.
    Native(Arc<Transport>),
    /// The system MPI library (`--features mpi`, `PHALANX_BACKEND=mpi`).
    #[cfg(feature = "mpi")]
    Mpi(crate::mpi::Comm),
}

/// Return `$e` from the enclosing function when the group runs on MPI,
/// with the MPI communicator bound to `$m`.
macro_rules! on_mpi {
    ($self:ident, $m:ident => $e:expr) => {
        #[cfg(feature = "mpi")]
        if let Net::Mpi($m) = &$self.inner.net {
            return $e;
        }
    };
}

// After `on_mpi!`, which they use.
mod async_ops;
mod msg;
mod signature;
mod subgroups;

use signature::Signature;

struct Inner {
    net: Net,
    members: Vec<usize>,
    me: usize,
    gid: u64,
    seq: AtomicU64,
    children: AtomicU64,
    exec: Mutex<()>,
    queue: Queue,
    p2p_queue: Queue,
    cfg: Config,
    /// Keeps a store server alive for as long as the group (rank 0 under mpirun).
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
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
        ProcessGroup::make(Net::Native(t), members, me, 1, cfg, keep)
    }

    /// The world group of an MPI job (`PHALANX_BACKEND=mpi`).
    #[cfg(feature = "mpi")]
    pub(crate) fn from_mpi(comm: crate::mpi::Comm, cfg: Config) -> ProcessGroup {
        let members = comm.members().to_vec();
        let me = comm.rank();
        ProcessGroup::make(Net::Mpi(comm), members, me, 1, cfg, None)
    }

    /// The native transport. Every operation of an MPI group returns
    /// through `on_mpi!` before it gets here.
    fn t(&self) -> &Arc<Transport> {
        match &self.inner.net {
            Net::Native(t) => t,
            #[cfg(feature = "mpi")]
            Net::Mpi(_) => unreachable!("an MPI group reached the native transport"),
        }
    }

    fn make(
        net: Net,
        members: Vec<usize>,
        me: usize,
        gid: u64,
        cfg: Config,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> ProcessGroup {
        let name = format!("phalanx-comm-{gid:x}");
        ProcessGroup {
            inner: Arc::new(Inner {
                net,
                members,
                me,
                gid,
                seq: AtomicU64::new(0),
                children: AtomicU64::new(0),
                exec: Mutex::new(()),
                queue: Queue::new(name.clone()),
                p2p_queue: Queue::new(name + "-p2p"),
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
    /// Payload bytes this process has sent to peers so far, over every
    /// group sharing this group's transport (to measure a step's traffic).
    pub fn bytes_sent(&self) -> u64 {
        on_mpi!(self, m => m.bytes_sent());
        self.t().bytes_sent()
    }

    /// The kind of socket between this process and group rank `rank`:
    /// `Link::Unix` for a peer on this host, `Link::Tcp` for one elsewhere
    /// or under `PHALANX_TRANSPORT=tcp`; `None` for this process itself.
    pub fn link(&self, rank: usize) -> Option<crate::transport::Link> {
        let g = *self.inner.members.get(rank)?;
        on_mpi!(self, _m => (g != self.global_rank()).then_some(crate::transport::Link::Mpi));
        self.t().link(g)
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// This group's channel of a kind: 0 collectives, 1 point-to-point,
    /// 2 signature checks (PHALANX_DEBUG=detail), 3 the all-gather phase of
    /// ring collectives (kept apart so its frames can land in place).
    fn chan(&self, kind: u64) -> u64 {
        self.inner.gid.wrapping_mul(4).wrapping_add(kind)
    }

    /// Run one collective: take the next sequence number, optionally check
    /// that every rank called the same thing, then run `f`.
    fn collective<R>(&self, sig: Signature, f: impl FnOnce(&Ctx) -> Result<R>) -> Result<R> {
        let _blocked = crate::work::BlockedTimer::start();
        let inner = &*self.inner;
        let t = self.t();
        if let Some(e) = t.failure() {
            return Err(e);
        }
        let _g = inner.exec.lock().unwrap();
        let seq = inner.seq.fetch_add(1, Ordering::SeqCst);
        let elem = sig.dtype.size();
        let ctx = Ctx {
            t,
            members: &inner.members,
            me: inner.me,
            chan: self.chan(0),
            chan2: self.chan(3),
            seq,
            deadline: Instant::now() + inner.cfg.timeout,
            op: sig.op,
            chunk_elems: (inner.cfg.chunk_bytes / elem).max(1),
        };
        if inner.cfg.detail && ctx.n() > 1 {
            self.check_signatures(&ctx, &sig)?;
        }
        f(&ctx)
    }

    /// Run an MPI operation in issue order, as `collective` runs native ones.
    #[cfg(feature = "mpi")]
    fn serial<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let _blocked = crate::work::BlockedTimer::start();
        let _g = self.inner.exec.lock().unwrap();
        self.inner.seq.fetch_add(1, Ordering::SeqCst);
        f()
    }

    fn sig<T: Element>(&self, op: &'static str, count: usize) -> Signature {
        Signature {
            op,
            dtype: T::DTYPE,
            count: count as u64,
            reduce: None,
            root: None,
            layout: 0,
        }
    }

    /// The per-rank `counts` of an uneven collective must cover the `full`
    /// buffer (one count per rank) and this rank's count its `part`.
    fn check_counts(&self, op: &str, counts: &[usize], full: usize, part: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let total: usize = counts.iter().sum();
        if counts.len() != n || total != full || counts[r] != part {
            return Err(invalid!(
                "{op}: {} counts summing to {total} for a full buffer of {full} and this rank's part of {part} \
                 (group size {n}, rank {r})",
                counts.len()
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
        on_mpi!(self, m => self.serial(|| m.all_reduce(buf, op)));
        let sig = Signature {
            reduce: Some(op),
            ..self.sig::<T>("all_reduce", buf.len())
        };
        let cfg = &self.inner.cfg;
        self.collective(sig, |c| {
            if c.n() == 1 || buf.is_empty() {
                return Ok(());
            }
            let bytes = std::mem::size_of_val(buf);
            let use_rd = match cfg.algo {
                Algo::RecursiveDoubling => true,
                Algo::Ring => false,
                Algo::Auto => bytes <= cfg.small_message_bytes(c.n()) || buf.len() < c.n(),
            };
            // The world group on one host: reduce in place in shared memory.
            let shm = match (&c.t.shm_world, cfg.algo, self.inner.gid) {
                (Some(w), Algo::Auto, 1) if cfg.shm_all_reduce => Some(w),
                _ => None,
            };
            if let Some(w) = shm {
                let what = || format!("{} (collective #{})", c.op, c.seq);
                crate::transport::shm_coll::all_reduce(c.t, w, buf, op, c.deadline, &what)?;
            } else if use_rd {
                algo::rd::all_reduce(c, buf, op)?;
            } else {
                algo::ring::all_reduce(c, buf, op)?;
            }
            if op == ReduceOp::Avg {
                T::div_by(buf, c.n());
            }
            Ok(())
        })
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
        on_mpi!(self, m => self.serial(|| m.reduce_scatter_v(input, counts, output, op)));
        let sig = Signature {
            reduce: Some(op),
            layout: digest(counts),
            ..self.sig::<T>("reduce_scatter", input.len())
        };
        self.collective(sig, |c| {
            let blocks = ranges(counts);
            if c.n() == 1 {
                output.copy_from_slice(input);
            } else {
                let mut scratch = input.to_vec();
                algo::ring::reduce_scatter(c, &mut scratch, &blocks, op)?;
                output.copy_from_slice(&scratch[blocks[c.me].clone()]);
            }
            if op == ReduceOp::Avg {
                T::div_by(output, c.n());
            }
            Ok(())
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
        on_mpi!(self, m => self.serial(|| m.all_gather_v(input, counts, output)));
        let sig = Signature {
            layout: digest(counts),
            ..self.sig::<T>("all_gather", output.len())
        };
        self.collective(sig, |c| {
            let blocks = ranges(counts);
            output[blocks[c.me].clone()].copy_from_slice(input);
            if c.n() > 1 {
                algo::ring::all_gather(c, output, &blocks)?;
            }
            Ok(())
        })
    }

    /// Copy `buf` of rank `root` to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.inner.queue.drain();
        self.broadcast_now(buf, root)
    }

    fn broadcast_now<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        on_mpi!(self, m => self.serial(|| m.broadcast(buf, root)));
        let sig = Signature {
            root: Some(root as u64),
            ..self.sig::<T>("broadcast", buf.len())
        };
        let cfg = &self.inner.cfg;
        self.collective(sig, |c| {
            if c.n() == 1 || buf.is_empty() {
                return Ok(());
            }
            if std::mem::size_of_val(buf) <= cfg.small_message_bytes(c.n()) {
                algo::tree::broadcast_tree(c, buf, root)
            } else {
                algo::tree::broadcast_chain(c, buf, root)
            }
        })
    }

    /// Reduce `buf` across the group into rank `root`'s `buf`; other ranks'
    /// buffers are left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.inner.queue.drain();
        self.check_root(root)?;
        on_mpi!(self, m => self.serial(|| m.reduce(buf, root, op)));
        let sig = Signature {
            reduce: Some(op),
            root: Some(root as u64),
            ..self.sig::<T>("reduce", buf.len())
        };
        let cfg = &self.inner.cfg;
        self.collective(sig, |c| {
            let n = c.n();
            if n == 1 || buf.is_empty() {
                return Ok(());
            }
            let mut acc = buf.to_vec();
            if std::mem::size_of_val(buf) <= cfg.small_message_bytes(n) {
                algo::tree::reduce_tree(c, &mut acc, root, op)?;
            } else {
                // Large: ring reduce-scatter, then every block goes to root.
                let blocks = ranges(&even_split(acc.len(), n));
                algo::ring::reduce_scatter(c, &mut acc, &blocks, op)?;
                if c.me != root {
                    c.send(root, &acc[blocks[c.me].clone()])?;
                } else {
                    for (k, b) in blocks.iter().enumerate().filter(|(k, _)| *k != root) {
                        c.recv_into(k, &mut acc[b.clone()])?;
                    }
                }
            }
            if c.me == root {
                if op == ReduceOp::Avg {
                    T::div_by(&mut acc, n);
                }
                buf.copy_from_slice(&acc);
            }
            Ok(())
        })
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
        if send.len() != n
            || recv.len() != n
            || send.iter().sum::<usize>() != input.len()
            || recv.iter().sum::<usize>() != output.len()
            || send[me] != recv[me]
        {
            return Err(invalid!(
                "all_to_all_v: {} send and {} receive counts for {n} ranks, summing to {} and {} \
                 for buffers of {} and {} (and this rank's own count must match)",
                send.len(),
                recv.len(),
                send.iter().sum::<usize>(),
                recv.iter().sum::<usize>(),
                input.len(),
                output.len()
            ));
        }
        let offsets = |c: &[usize]| -> Vec<usize> {
            c.iter()
                .scan(0, |a, &x| {
                    let o = *a;
                    *a += x;
                    Some(o)
                })
                .collect()
        };
        on_mpi!(self, m => self.serial(|| m.all_to_all_v(input, send, output, recv)));
        let (so, ro) = (offsets(send), offsets(recv));
        // Ranks of a v-collective send different amounts: its signature
        // (`sig_count`) is the group size, and each receive checks its size.
        self.collective(self.sig::<T>("all_to_all", sig_count), |c| {
            output[ro[me]..ro[me] + recv[me]].copy_from_slice(&input[so[me]..so[me] + send[me]]);
            for s in 1..n {
                let to = (me + s) % n;
                if send[to] > 0 {
                    c.send(to, &input[so[to]..so[to] + send[to]])?;
                }
            }
            for s in 1..n {
                let from = (me + n - s) % n;
                if recv[from] > 0 {
                    c.recv_into(from, &mut output[ro[from]..ro[from] + recv[from]])?;
                }
            }
            Ok(())
        })
    }

    /// Return once every rank of the group has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        let mut x = [1i32];
        self.all_reduce(&mut x, ReduceOp::Sum)
    }

    // ---- point to point ------------------------------------------------

    /// Send `buf` to group rank `dst` under `tag`; returns once the data is
    /// handed to the transport (the receiver buffers it).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u64) -> Result<()> {
        self.check_peer(dst)?;
        on_mpi!(self, m => m.send(buf, dst, tag));
        let deadline = Instant::now() + self.inner.cfg.timeout;
        self.t().send(
            self.inner.members[dst],
            self.chan(1),
            tag,
            bytemuck::cast_slice(buf),
            deadline,
        )
    }

    /// Receive exactly `buf.len()` elements from group rank `src` under `tag`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.check_peer(src)?;
        on_mpi!(self, m => m.recv(buf, src, tag));
        let deadline = Instant::now() + self.inner.cfg.timeout;
        let what = || format!("recv(tag={tag})");
        let m = self
            .t()
            .recv(self.inner.members[src], self.chan(1), tag, deadline, &what)?;
        if m.len != std::mem::size_of_val(buf) {
            return Err(invalid!(
                "recv from rank {src} tag {tag}: expected {} bytes, got {}",
                std::mem::size_of_val(buf),
                m.len
            ));
        }
        buf.copy_from_slice(m.as_slice());
        self.t().recycle(m);
        Ok(())
    }

    fn check_peer(&self, p: usize) -> Result<()> {
        if p >= self.size() || p == self.rank() {
            return Err(invalid!(
                "peer {p} is not another rank of this group (size {})",
                self.size()
            ));
        }
        Ok(())
    }

    /// Leave the job cleanly (`destroy_process_group`): peers see a goodbye,
    /// not a crash. Every group sharing the transport stops working.
    pub fn shutdown(&self) {
        self.synchronize();
        on_mpi!(self, m => m.shutdown());
        self.t().close();
    }

    /// Tear down the transport under this group (and every group sharing
    /// it): pending and later calls here and on peers fail with `reason`.
    pub fn abort(&self, reason: &str) {
        #[cfg(feature = "mpi")]
        if let Net::Mpi(m) = &self.inner.net {
            m.abort(reason)
        }
        self.t().abort(reason);
    }

    #[doc(hidden)]
    pub fn crash_for_test(&self) {
        #[cfg(feature = "mpi")]
        if let Net::Mpi(_) = &self.inner.net {
            std::process::abort()
        }
        self.t().crash_for_test();
    }

    /// The failure that broke this group, if any.
    pub fn failure(&self) -> Option<CommError> {
        on_mpi!(self, _m => None);
        self.t().failure()
    }
}
