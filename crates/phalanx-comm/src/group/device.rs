//! Collectives on CUDA device memory (NCCL): in place, waited for or
//! started with a mark to settle by, and the point-to-point sends and
//! receives of a pipeline's links. Backends without device memory refuse
//! them naming themselves.

use super::*;

impl ProcessGroup {
    /// The CUDA device whose memory this group's backend reduces where it
    /// lies ([`ProcessGroup::all_reduce_device`]); `None`: host memory only.
    pub fn device_ordinal(&self) -> Option<usize> {
        self.inner.backend.device_ordinal()
    }

    /// Reduce `buf`, in CUDA device memory, in place across the group; every
    /// rank gets the result. Backends without device memory
    /// ([`ProcessGroup::device_ordinal`] is `None`) refuse, as does one on
    /// another device than `buf.ordinal`.
    ///
    /// # Safety
    /// `buf.ptr` must address `buf.count` elements of `buf.dtype` on that
    /// device, in a context of the process's primary one (candle's and the
    /// CUDA runtime's), with every earlier write to them complete or
    /// queued on `buf.after` (a live stream of that context), and nothing
    /// else may touch them until this returns.
    pub unsafe fn all_reduce_device(
        &self,
        buf: crate::backend::DeviceBuf,
        op: ReduceOp,
    ) -> Result<()> {
        self.all_reduce_device_in(buf, op, DeviceMode::Wait)
            .map(|_| ())
    }

    unsafe fn all_reduce_device_in(
        &self,
        buf: crate::backend::DeviceBuf,
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<u64> {
        self.inner.queue.drain();
        let sig = device_sig("all_reduce_dev", &buf, Some(op), 0);
        self.collective(sig, |b, c| {
            b.all_reduce_device(c, buf, op, mode)?;
            Ok(b.device_mark())
        })
    }

    /// Start [`ProcessGroup::all_reduce_device`] and return without
    /// waiting where the backend can (NCCL launches it on its own stream).
    /// Returns its mark: [`ProcessGroup::settle_device_to`] with it waits
    /// for this one (and every one started before it), and
    /// [`ProcessGroup::settle_device`] for every one started. Ranks see
    /// the same sequence of collectives as with the blocking call.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device`], and nothing may touch
    /// (or free) the memory until a settle has returned.
    pub unsafe fn all_reduce_device_start(
        &self,
        buf: crate::backend::DeviceBuf,
        op: ReduceOp,
    ) -> Result<u64> {
        self.all_reduce_device_in(buf, op, DeviceMode::Start)
    }

    /// [`ProcessGroup::all_gather_device`], started as
    /// [`ProcessGroup::all_reduce_device_start`] is.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device_start`].
    pub unsafe fn all_gather_device_start(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
    ) -> Result<u64> {
        self.all_gather_device_in(buf, counts, DeviceMode::Start)
    }

    /// [`ProcessGroup::reduce_scatter_device`], started as
    /// [`ProcessGroup::all_reduce_device_start`] is.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device_start`].
    pub unsafe fn reduce_scatter_device_start(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<u64> {
        self.reduce_scatter_device_in(buf, counts, op, DeviceMode::Start)
    }

    /// Wait, until the deadline, for every device collective started on
    /// this group (`*_device_start`). Not a
    /// collective: nothing is exchanged.
    pub fn settle_device(&self) -> Result<()> {
        self.settle_device_in(None)
    }

    /// Wait, until the deadline, for the device collective started on this
    /// group whose mark (what its `*_device_start` returned) is `mark`, and
    /// for every one started before it; later ones may still run (on NCCL
    /// one event per started collective, waited for alone). Not a
    /// collective.
    pub fn settle_device_to(&self, mark: u64) -> Result<()> {
        self.settle_device_in(Some(mark))
    }

    /// Whether the device operation started on this group with `mark` is
    /// complete, without waiting (an error where the backend reports one).
    pub fn device_done(&self, mark: u64) -> Result<bool> {
        let inner = &*self.inner;
        let _g = inner.exec.lock().unwrap_or_else(|p| p.into_inner());
        let c = self.call("device_done", inner.seq.load(Ordering::SeqCst));
        self.down_on_timeout(inner.backend.device_done(&c, mark))
    }

    /// Send `buf`, in CUDA device memory, to rank `dst` of this group,
    /// started without waiting; returns its mark
    /// ([`ProcessGroup::settle_device_to`], [`ProcessGroup::device_done`]).
    /// No tags: messages between two ranks match in the order sent and
    /// received (NCCL's `ncclSend`/`ncclRecv`), so a group should carry one
    /// direction of one pair. Refused as
    /// [`ProcessGroup::all_reduce_device`] is.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device_start`].
    pub unsafe fn send_device_start(
        &self,
        buf: crate::backend::DeviceBuf,
        dst: usize,
    ) -> Result<u64> {
        self.p2p_device("send_device", dst, |b, c| b.send_device(c, buf, dst))
    }

    /// Receive the next message from rank `src` of this group into `buf`,
    /// in CUDA device memory, started without waiting, as
    /// [`ProcessGroup::send_device_start`].
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device_start`].
    pub unsafe fn recv_device_start(
        &self,
        buf: crate::backend::DeviceBuf,
        src: usize,
    ) -> Result<u64> {
        self.p2p_device("recv_device", src, |b, c| b.recv_device(c, buf, src))
    }

    fn p2p_device(
        &self,
        op: &'static str,
        peer: usize,
        f: impl FnOnce(&dyn Backend, &Call) -> Result<()>,
    ) -> Result<u64> {
        if peer >= self.size() || peer == self.rank() {
            return Err(invalid!(
                "{op}: peer {peer} of a group of {} (this rank is {})",
                self.size(),
                self.rank()
            ));
        }
        let inner = &*self.inner;
        if let Some(e) = self.broken() {
            return Err(e);
        }
        let _g = inner.exec.lock().unwrap();
        let c = self.call(op, inner.seq.load(Ordering::SeqCst));
        self.down_on_timeout(f(&*inner.backend, &c))?;
        Ok(inner.backend.device_mark())
    }

    fn settle_device_in(&self, mark: Option<u64>) -> Result<()> {
        let _blocked = crate::work::BlockedTimer::start();
        let inner = &*self.inner;
        // Even after a failure: the backend aborts what is in flight. A
        // lock poisoned by a panic elsewhere still settles (this may run
        // while unwinding).
        let _g = inner.exec.lock().unwrap_or_else(|p| p.into_inner());
        let c = self.call("settle_device", inner.seq.load(Ordering::SeqCst));
        let r = self.down_on_timeout(inner.backend.settle_device(&c, mark));
        match inner.backend.failure() {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// All-gather in place in CUDA device memory: `buf` holds rank k's
    /// block of `counts[k]` elements after the blocks before it; each
    /// rank's own block is what it contributes, and every block is its
    /// owner's on return. Refused as [`ProcessGroup::all_reduce_device`] is.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device`].
    pub unsafe fn all_gather_device(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
    ) -> Result<()> {
        self.all_gather_device_in(buf, counts, DeviceMode::Wait)
            .map(|_| ())
    }

    unsafe fn all_gather_device_in(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
        mode: DeviceMode,
    ) -> Result<u64> {
        self.inner.queue.drain();
        self.check_device_counts("all_gather_device", &buf, counts)?;
        let sig = device_sig("all_gather_dev", &buf, None, digest(counts));
        self.collective(sig, |b, c| {
            b.all_gather_device(c, buf, counts, mode)?;
            Ok(b.device_mark())
        })
    }

    /// Reduce-scatter in place in CUDA device memory: `buf` holds this
    /// rank's whole contribution, rank k's block of `counts[k]` elements
    /// after the blocks before it (uneven blocks: ZeRO-3's pieces of a
    /// block); on return block `rank` holds the reduced block (the others
    /// are unspecified). Refused as [`ProcessGroup::all_reduce_device`] is.
    ///
    /// # Safety
    /// As for [`ProcessGroup::all_reduce_device`].
    pub unsafe fn reduce_scatter_device(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_device_in(buf, counts, op, DeviceMode::Wait)
            .map(|_| ())
    }

    unsafe fn reduce_scatter_device_in(
        &self,
        buf: crate::backend::DeviceBuf,
        counts: &[usize],
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<u64> {
        self.inner.queue.drain();
        self.check_device_counts("reduce_scatter_device", &buf, counts)?;
        let sig = device_sig("reduce_scatter_dev", &buf, Some(op), digest(counts));
        self.collective(sig, |b, c| {
            b.reduce_scatter_device(c, buf, counts, op, mode)?;
            Ok(b.device_mark())
        })
    }

    /// One count per rank, summing to the buffer's elements.
    fn check_device_counts(
        &self,
        what: &str,
        buf: &crate::backend::DeviceBuf,
        counts: &[usize],
    ) -> Result<()> {
        let total = super::total_of(counts);
        if counts.len() != self.size() || total != Some(buf.count) {
            return Err(invalid!(
                "{what}: {} counts summing to {} for a buffer of {} elements (group size {})",
                counts.len(),
                super::describe_total(total),
                buf.count,
                self.size()
            ));
        }
        Ok(())
    }
}

/// The signature of a collective on device memory, named apart from its
/// host form (`op`): under PHALANX_DEBUG=detail a rank on the other path
/// is a mismatch.
fn device_sig(
    op: &'static str,
    buf: &crate::backend::DeviceBuf,
    reduce: Option<ReduceOp>,
    layout: u64,
) -> Signature {
    Signature {
        op,
        dtype: buf.dtype,
        count: buf.count as u64,
        reduce,
        root: None,
        layout,
        pairs: None,
    }
}
