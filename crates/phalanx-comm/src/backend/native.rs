//! The native backend: Phalanx's own transports (shared memory, Unix
//! sockets, TCP; see `crate::transport`) and the algorithms of
//! `crate::algo`, chosen per call by size and `PHALANX_ALGO`.
//!
//! Every group on one transport shares it: a group's messages travel on
//! channels of its own (`gid * 4 + kind`), so a sub-group's [`Backend::child`]
//! is the same transport again.

use super::{dispatch_collectives, Backend, Call, Collectives};
use crate::algo::{self, even_split, ranges, Ctx};
use crate::config::Algo;
use crate::dtype::{Element, ReduceOp};
use crate::error::{invalid, CommError, Result};
use crate::transport::{Link, Msg, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The native backend of one group (cheap: the transport is shared).
pub struct Native {
    t: Arc<Transport>,
    /// All-reduces done in place in shared memory (the world group's path).
    in_place: AtomicU64,
}

/// A group's channel of a kind: 0 collectives, 1 point-to-point, 2
/// signature checks (PHALANX_DEBUG=detail), 3 the all-gather phase of ring
/// collectives (kept apart so its frames can land in place).
fn chan(c: &Call, kind: u64) -> u64 {
    c.gid.wrapping_mul(4).wrapping_add(kind)
}

impl Native {
    pub fn new(t: Arc<Transport>) -> Native {
        Native {
            t,
            in_place: AtomicU64::new(0),
        }
    }

    /// The algorithms' view of one collective of `elem`-byte elements.
    fn ctx<'a>(&'a self, c: &'a Call, elem: usize) -> Ctx<'a> {
        Ctx {
            t: &self.t,
            members: c.members,
            me: c.me,
            chan: chan(c, 0),
            chan2: chan(c, 3),
            seq: c.seq,
            deadline: c.deadline,
            op: c.op,
            chunk_elems: (c.cfg.chunk_bytes / elem).max(1),
        }
    }
}

impl Collectives for Native {
    fn all_reduce_t<T: Element>(&self, c: &Call, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        if cx.n() == 1 || buf.is_empty() {
            return Ok(());
        }
        let cfg = c.cfg;
        let bytes = std::mem::size_of_val(buf);
        let use_rd = match cfg.algo {
            Algo::RecursiveDoubling => true,
            Algo::Ring => false,
            Algo::Auto => bytes <= cfg.small_message_bytes(cx.n()) || buf.len() < cx.n(),
        };
        // The world group on one host: reduce in place in shared memory.
        let shm = match (&self.t.shm_world, cfg.algo, c.gid) {
            (Some(w), Algo::Auto, 1) if cfg.shm_all_reduce => Some(w),
            _ => None,
        };
        if let Some(w) = shm {
            let what = || format!("{} (collective #{})", cx.op, cx.seq);
            crate::transport::shm_coll::all_reduce(&self.t, w, buf, op, cx.deadline, &what)?;
            self.in_place.fetch_add(1, Ordering::Relaxed);
            // Counted as the ring would move it (2 (n-1)/n of the buffer),
            // as the MPI backend counts its all-reduce: a step's traffic
            // reads the same whichever path carried it.
            self.t.count_sent(2 * bytes * (cx.n() - 1) / cx.n());
        } else if use_rd {
            algo::rd::all_reduce(&cx, buf, op)?;
        } else {
            algo::ring::all_reduce(&cx, buf, op)?;
        }
        if op == ReduceOp::Avg {
            T::div_by(buf, cx.n());
        }
        Ok(())
    }

    fn reduce_scatter_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        let blocks = ranges(counts);
        if cx.n() == 1 {
            output.copy_from_slice(input);
        } else {
            let mut scratch = input.to_vec();
            algo::ring::reduce_scatter(&cx, &mut scratch, &blocks, op)?;
            output.copy_from_slice(&scratch[blocks[cx.me].clone()]);
        }
        if op == ReduceOp::Avg {
            T::div_by(output, cx.n());
        }
        Ok(())
    }

    fn all_gather_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        let blocks = ranges(counts);
        output[blocks[cx.me].clone()].copy_from_slice(input);
        if cx.n() > 1 {
            algo::ring::all_gather(&cx, output, &blocks)?;
        }
        Ok(())
    }

    fn broadcast_t<T: Element>(&self, c: &Call, buf: &mut [T], root: usize) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        if cx.n() == 1 || buf.is_empty() {
            return Ok(());
        }
        if std::mem::size_of_val(buf) <= c.cfg.small_message_bytes(cx.n()) {
            algo::tree::broadcast_tree(&cx, buf, root)
        } else {
            algo::tree::broadcast_chain(&cx, buf, root)
        }
    }

    fn reduce_t<T: Element>(
        &self,
        c: &Call,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        let n = cx.n();
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let mut acc = buf.to_vec();
        if std::mem::size_of_val(buf) <= c.cfg.small_message_bytes(n) {
            algo::tree::reduce_tree(&cx, &mut acc, root, op)?;
        } else {
            // Large: ring reduce-scatter, then every block goes to root.
            let blocks = ranges(&even_split(acc.len(), n));
            algo::ring::reduce_scatter(&cx, &mut acc, &blocks, op)?;
            if cx.me != root {
                cx.send(root, &acc[blocks[cx.me].clone()])?;
            } else {
                for (k, b) in blocks.iter().enumerate().filter(|(k, _)| *k != root) {
                    cx.recv_into(k, &mut acc[b.clone()])?;
                }
            }
        }
        if cx.me == root {
            if op == ReduceOp::Avg {
                T::div_by(&mut acc, n);
            }
            buf.copy_from_slice(&acc);
        }
        Ok(())
    }

    fn all_to_all_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        let cx = self.ctx(c, std::mem::size_of::<T>());
        let (n, me) = (cx.n(), cx.me);
        let offsets = |c: &[usize]| -> Vec<usize> {
            c.iter()
                .scan(0, |a, &x| {
                    let o = *a;
                    *a += x;
                    Some(o)
                })
                .collect()
        };
        let (so, ro) = (offsets(send), offsets(recv));
        output[ro[me]..ro[me] + recv[me]].copy_from_slice(&input[so[me]..so[me] + send[me]]);
        // One message to and from every peer, empty where the count is 0:
        // a header's worth of bytes buys a size check on every pair, so
        // counts that disagree are an error on the receiver (`recv_into`)
        // instead of data dropped in silence, with the unwanted frame left
        // in the inbox for good, or a wait for data that never comes.
        for s in 1..n {
            let to = (me + s) % n;
            cx.send(to, &input[so[to]..so[to] + send[to]])?;
        }
        // Take every peer's message even after a mismatch, so that none is
        // left behind; report the first mismatch.
        let mut mismatch = None;
        for s in 1..n {
            let from = (me + n - s) % n;
            match cx.recv_into(from, &mut output[ro[from]..ro[from] + recv[from]]) {
                Err(e @ CommError::Desync(_)) => {
                    mismatch.get_or_insert(e);
                }
                r => r?,
            }
        }
        mismatch.map_or(Ok(()), Err)
    }
}

impl Backend for Native {
    fn name(&self) -> &'static str {
        "native"
    }

    dispatch_collectives!();

    /// On the signature channel: a rank that never calls is named as such
    /// (not as a plain timeout).
    fn exchange_signatures(&self, c: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let ch = chan(c, 2);
        for j in (0..c.n()).filter(|&j| j != c.me) {
            self.t.send(c.members[j], ch, c.seq, mine, c.deadline)?;
        }
        let mut all = Vec::with_capacity(c.n());
        for j in 0..c.n() {
            if j == c.me {
                all.push(mine.to_vec());
                continue;
            }
            let what = || {
                format!(
                    "{} #{} (waiting for rank {} to join)",
                    c.op, c.seq, c.members[j]
                )
            };
            let m = self
                .t
                .recv(c.members[j], ch, c.seq, c.deadline, &what)
                .map_err(|e| match e {
                    CommError::Timeout(_) => CommError::Desync(format!(
                        "rank {} never called collective #{} ({} on this rank {})",
                        c.members[j],
                        c.seq,
                        crate::group::describe_encoded(mine),
                        c.members[c.me]
                    )),
                    e => e,
                })?;
            all.push(m.bytes().to_vec());
            self.t.recycle(m);
        }
        Ok(all)
    }

    fn send(&self, c: &Call, dst: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.t
            .send(c.members[dst], chan(c, 1), tag, data, c.deadline)
    }

    fn recv_into(&self, c: &Call, src: usize, tag: u64, buf: &mut [u8]) -> Result<()> {
        let m = self.recv_message(c, src, tag)?;
        if m.len != buf.len() {
            return Err(invalid!(
                "recv from rank {src} tag {tag}: expected {} bytes, got {}",
                buf.len(),
                m.len
            ));
        }
        buf.copy_from_slice(m.bytes());
        self.t.recycle(m);
        Ok(())
    }

    fn recv_message(&self, c: &Call, src: usize, tag: u64) -> Result<Msg> {
        let what = || format!("{}(tag={tag})", c.op);
        self.t
            .recv(c.members[src], chan(c, 1), tag, c.deadline, &what)
    }

    fn child(
        &self,
        _c: &Call,
        color: Option<u32>,
        _key: i64,
        _want: usize,
    ) -> Result<Option<Arc<dyn Backend>>> {
        Ok(color.map(|_| Arc::new(Native::new(self.t.clone())) as Arc<dyn Backend>))
    }

    fn bytes_sent(&self) -> u64 {
        self.t.bytes_sent()
    }

    fn in_place_all_reduces(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    fn link(&self, _me: usize, global: usize) -> Option<Link> {
        self.t.link(global)
    }

    fn failure(&self) -> Option<CommError> {
        self.t.failure()
    }

    fn shutdown(&self) {
        self.t.close();
    }

    fn closed(&self) -> Option<CommError> {
        self.t.closed_here()
    }

    fn abort(&self, reason: &str) {
        self.t.abort(reason);
    }

    fn crash_for_test(&self) {
        self.t.crash_for_test();
    }
}
