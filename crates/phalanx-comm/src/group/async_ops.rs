//! The asynchronous variants of the collectives: each runs on the group's
//! communication thread (point-to-point receives on their own thread) and
//! returns a `Work`, in issue order with the synchronous calls.

use super::ProcessGroup;
use crate::dtype::{Element, ReduceOp};
use crate::error::{invalid, Result};
use crate::work::Work;

/// The length of an all-gather's output, the counts checked first (this
/// rank's part is `part`): a count that no input holds, or counts that
/// overflow, are refused before anything is allocated.
fn gathered(g: &ProcessGroup, counts: &[usize], part: usize) -> Result<usize> {
    let total = super::total_of(counts)
        .ok_or_else(|| invalid!("all_gather: counts {counts:?} sum to more than usize::MAX"))?;
    g.check_counts("all_gather", counts, total, part)?;
    Ok(total)
}

/// `n` zeroed elements, or an error where that much memory cannot be had
/// (counts given for peers that no peer would send), not an abort. Past
/// 1 GiB the allocation is tried first; the buffer itself comes zeroed from
/// the allocator (`vec!`: no pass writing zeros over it).
fn zeroed<T: Element>(n: usize) -> Result<Vec<T>> {
    let bytes = n
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| invalid!("an output of {n} elements does not fit in memory"))?;
    if bytes > 1 << 30 {
        let mut probe: Vec<u8> = Vec::new();
        probe
            .try_reserve_exact(bytes)
            .map_err(|e| invalid!("cannot allocate an output of {n} elements: {e}"))?;
    }
    Ok(vec![T::zeroed(); n])
}

/// `out` resized to `n` elements (kept as it is at that length already).
fn resize<T: Element>(out: &mut Vec<T>, n: usize) -> Result<()> {
    if out.len() != n {
        out.try_reserve_exact(n.saturating_sub(out.len()))
            .map_err(|e| invalid!("cannot allocate an output of {n} elements: {e}"))?;
        out.resize(n, T::zeroed());
    }
    Ok(())
}

impl ProcessGroup {
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("all_reduce_async", self.inner.cfg.timeout, move || {
                g.all_reduce_now(&mut buf, op).map(|_| buf)
            })
    }

    pub fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("reduce_scatter_async", self.inner.cfg.timeout, move || {
                let n = counts.get(g.rank()).copied().unwrap_or(0);
                // Checked before the output is made: a count no input holds
                // would allocate first.
                g.check_counts("reduce_scatter", &counts, input.len(), n)?;
                let mut out = zeroed(n)?;
                g.reduce_scatter_now(&input, &counts, &mut out, op)
                    .map(|_| out)
            })
    }

    pub fn all_gather_async<T: Element>(&self, input: Vec<T>, counts: Vec<usize>) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("all_gather_async", self.inner.cfg.timeout, move || {
                let mut out = zeroed(gathered(&g, &counts, input.len())?)?;
                g.all_gather_now(&input, &counts, &mut out).map(|_| out)
            })
    }

    /// [`ProcessGroup::reduce_scatter_async`] into `out`, a buffer the
    /// caller supplies (its values are overwritten; it is resized only when
    /// its length is not this rank's count), so that a caller that reuses
    /// its buffers allocates nothing per call. `release` gets `input` back
    /// on the communication thread as soon as the collective is done with
    /// it (also when it failed), before `wait` returns: a caller that waits
    /// late need not hold every input meanwhile. It runs ahead of the
    /// group's next queued operation, so it should be quick (e.g. return
    /// the buffer to a pool).
    pub fn reduce_scatter_into_async<T: Element>(
        &self,
        input: Vec<T>,
        counts: Vec<usize>,
        op: ReduceOp,
        mut out: Vec<T>,
        release: impl FnOnce(Vec<T>) + Send + 'static,
    ) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner.queue.submit(
            "reduce_scatter_into_async",
            self.inner.cfg.timeout,
            move || {
                let n = counts.get(g.rank()).copied().unwrap_or(0);
                if let Err(e) = g
                    .check_counts("reduce_scatter", &counts, input.len(), n)
                    .and_then(|_| resize(&mut out, n))
                {
                    release(input);
                    return Err(e);
                }
                let r = g.reduce_scatter_now(&input, &counts, &mut out, op);
                release(input);
                r.map(|_| out)
            },
        )
    }

    /// [`ProcessGroup::all_gather_async`] into `out`, a buffer the caller
    /// supplies (resized only when its length is not the total), handing
    /// `input` to `release` as soon as the gather is done with it: as
    /// [`ProcessGroup::reduce_scatter_into_async`].
    pub fn all_gather_into_async<T: Element>(
        &self,
        input: Vec<T>,
        counts: Vec<usize>,
        mut out: Vec<T>,
        release: impl FnOnce(Vec<T>) + Send + 'static,
    ) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("all_gather_into_async", self.inner.cfg.timeout, move || {
                if let Err(e) = gathered(&g, &counts, input.len()).and_then(|n| resize(&mut out, n))
                {
                    release(input);
                    return Err(e);
                }
                let r = g.all_gather_now(&input, &counts, &mut out);
                release(input);
                r.map(|_| out)
            })
    }

    /// [`ProcessGroup::all_to_all_v`] on the communication thread.
    pub fn all_to_all_v_async<T: Element>(
        &self,
        input: Vec<T>,
        send: Vec<usize>,
        recv: Vec<usize>,
    ) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("all_to_all_v_async", self.inner.cfg.timeout, move || {
                let total = super::total_of(&recv).ok_or_else(|| {
                    invalid!("all_to_all: receive counts {recv:?} sum to more than usize::MAX")
                })?;
                let mut out = zeroed(total)?;
                let n = g.size();
                g.all_to_all_v_now(&input, &send, &mut out, &recv, n)
                    .map(|_| out)
            })
    }

    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .queue
            .submit("broadcast_async", self.inner.cfg.timeout, move || {
                g.broadcast_now(&mut buf, root).map(|_| buf)
            })
    }

    /// Receive on the group's point-to-point thread; sends never wait behind
    /// it, so a pipeline can post receives early without deadlocking. The
    /// receives posted this way run one after the other in issue order (as
    /// on an NCCL stream, unlike gloo's `irecv`s, which complete
    /// independently): a later one completes only after every earlier one,
    /// so post them in the order their messages are needed. A synchronous
    /// [`ProcessGroup::recv`] of the same source and tag waits for them.
    pub fn recv_async<T: Element>(&self, mut buf: Vec<T>, src: usize, tag: u64) -> Work<Vec<T>> {
        let g = self.clone();
        if let Err(e) = self.check_peer(src) {
            return self
                .inner
                .p2p_queue
                .submit("recv_async", self.inner.cfg.timeout, move || Err(e));
        }
        self.inner.posted.add(src, tag);
        self.inner
            .p2p_queue
            .submit("recv_async", self.inner.cfg.timeout, move || {
                // Done also if the receive panics.
                let _done = g.inner.posted.finish_on_drop(src, tag);
                g.recv_now(&mut buf, src, tag).map(|_| buf)
            })
    }

    /// Wait for every asynchronous operation issued so far.
    pub fn synchronize(&self) {
        self.inner.queue.drain();
        self.inner.p2p_queue.drain();
    }
}
