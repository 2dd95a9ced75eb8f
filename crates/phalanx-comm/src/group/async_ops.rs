//! The asynchronous variants of the collectives: each runs on the group's
//! communication thread (point-to-point receives on their own thread) and
//! returns a `Work`, in issue order with the synchronous calls.

use super::ProcessGroup;
use crate::dtype::{Element, ReduceOp};
use crate::work::Work;

impl ProcessGroup {
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
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
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            let mut out = vec![T::zeroed(); counts.get(g.rank()).copied().unwrap_or(0)];
            g.reduce_scatter_now(&input, &counts, &mut out, op)
                .map(|_| out)
        })
    }

    pub fn all_gather_async<T: Element>(&self, input: Vec<T>, counts: Vec<usize>) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            // Counts that overflow are refused by the check, on no buffer.
            let mut out = vec![T::zeroed(); super::total_of(&counts).unwrap_or(0)];
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
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            let n = counts.get(g.rank()).copied().unwrap_or(0);
            if out.len() != n {
                out.resize(n, T::zeroed());
            }
            let r = g.reduce_scatter_now(&input, &counts, &mut out, op);
            release(input);
            r.map(|_| out)
        })
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
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            let n = super::total_of(&counts).unwrap_or(0);
            if out.len() != n {
                out.resize(n, T::zeroed());
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
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            let mut out = vec![T::zeroed(); super::total_of(&recv).unwrap_or(0)];
            let n = g.size();
            g.all_to_all_v_now(&input, &send, &mut out, &recv, n)
                .map(|_| out)
        })
    }

    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner.queue.submit(self.inner.cfg.timeout, move || {
            g.broadcast_now(&mut buf, root).map(|_| buf)
        })
    }

    /// Receive on the group's point-to-point thread; sends never wait behind
    /// it, so a pipeline can post receives early without deadlocking.
    pub fn recv_async<T: Element>(&self, mut buf: Vec<T>, src: usize, tag: u64) -> Work<Vec<T>> {
        let g = self.clone();
        self.inner
            .p2p_queue
            .submit(self.inner.cfg.timeout, move || {
                g.recv(&mut buf, src, tag).map(|_| buf)
            })
    }

    /// Wait for every asynchronous operation issued so far.
    pub fn synchronize(&self) {
        self.inner.queue.drain();
        self.inner.p2p_queue.drain();
    }
}
