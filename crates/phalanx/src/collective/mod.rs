//! Collectives on candle tensors where they lie: a tensor in host memory
//! through its group's backend, one in CUDA memory through a backend that
//! reduces device memory (NCCL), without a copy through the host. Three
//! collectives, what the strategies need on the device: the all-reduce of
//! held gradients, the all-gather of updated shards, and the
//! reduce-scatter (with the all-reduce and the all-gather, tensor
//! parallelism's exchanges: `tp::comm`).
//!
//! Each runs as a candle in-place op, the one way candle lends its
//! storage mutably: the CPU side reduces the tensor's own elements, the
//! CUDA side hands NCCL their device address, ordered after what candle's
//! stream has queued to write them (an event, not a host wait:
//! [`phalanx_comm::ProcessGroup::all_reduce_device`], `all_gather_device`,
//! `reduce_scatter_device`). [`Started`] starts them without waiting and
//! waits for them one by one. The same code on a
//! storage ([`OnStorage`]) serves custom ops that build a buffer and
//! exchange it (tensor parallelism's).
//! A failure of the group comes back as the group's error (a timeout naming
//! the rank), not as candle's.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_comm::{threads, ReduceOp};
//! let sums = threads::run(2, |pg| {
//!     let t = Tensor::new(&[1.0f32 + pg.rank() as f32, 10.0], &Device::Cpu).unwrap();
//!     assert!(phalanx::collective::reduces_on(&pg, &Device::Cpu));
//!     phalanx::collective::all_reduce_in_place(&pg, &t, ReduceOp::Sum).unwrap();
//!     t.to_vec1::<f32>().unwrap()
//! });
//! assert_eq!(sums, vec![vec![3.0, 20.0]; 2]);
//! ```

use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Device, DeviceLocation, InplaceOp1, Layout, Tensor};
use phalanx_comm::{CommError, DeviceMode, ProcessGroup, ReduceOp};
use std::sync::Mutex;

mod started;
pub use started::Started;

/// Whether `pg` reduces tensors on `dev` where they lie: host memory on
/// every backend, a CUDA device's memory on a backend of that device.
pub fn reduces_on(pg: &ProcessGroup, dev: &Device) -> bool {
    match dev.location() {
        DeviceLocation::Cpu => true,
        DeviceLocation::Cuda { gpu_id } => pg.device_ordinal() == Some(gpu_id),
        _ => false,
    }
}

/// Reduce the contiguous tensor `t` across `pg`, in place: every rank's
/// `t` holds the result. `t` is the caller's own (a detached tensor, or a
/// contiguous view of one: its elements only are reduced), and nothing
/// else may read it meanwhile.
pub fn all_reduce_in_place(pg: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<()> {
    run(pg, t, Coll::AllReduce(op))
}

/// All-gather in place: `t` ((sum of `counts`,), contiguous) holds rank
/// k's block of `counts[k]` elements after the blocks before it; each
/// rank's own block is its contribution, and on return every block is its
/// owner's on every rank. Blocks may be uneven (ZeRO's shards of a model
/// the group size does not divide), on CUDA too: no padded copy.
pub fn all_gather_in_place(pg: &ProcessGroup, t: &Tensor, counts: &[usize]) -> Result<()> {
    check_counts("all-gather", pg, t, counts)?;
    run(pg, t, Coll::AllGather(counts))
}

/// Reduce-scatter in place: `t` ((`n` * k,), contiguous, `n` the group
/// size) holds this rank's whole contribution; on return block `rank`
/// (elements `rank * k..(rank + 1) * k`) holds the reduced block, and the
/// other blocks are unspecified.
pub fn reduce_scatter_in_place(pg: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<()> {
    if t.rank() != 1 || !t.elem_count().is_multiple_of(pg.size()) {
        return Err(Error::Check(format!(
            "reduce-scatter in place: a tensor of shape {:?} does not split into {} equal blocks",
            t.shape(),
            pg.size()
        )));
    }
    let counts = vec![t.elem_count() / pg.size(); pg.size()];
    run(pg, t, Coll::ReduceScatter(op, &counts))
}

/// Reduce-scatter in place with uneven blocks: `t` ((sum of `counts`,),
/// contiguous) holds this rank's whole contribution, rank k's block of
/// `counts[k]` elements after the blocks before it; on return this rank's
/// block holds the reduced block (the others are unspecified). ZeRO-3's
/// pieces of a model block, which the shards cut anywhere: on CUDA one
/// reduce of each block to its owner, grouped, with no padded copy.
pub fn reduce_scatter_v_in_place(
    pg: &ProcessGroup,
    t: &Tensor,
    counts: &[usize],
    op: ReduceOp,
) -> Result<()> {
    check_counts("reduce-scatter", pg, t, counts)?;
    run(pg, t, Coll::ReduceScatter(op, counts))
}

fn check_counts(what: &str, pg: &ProcessGroup, t: &Tensor, counts: &[usize]) -> Result<()> {
    let total: usize = counts.iter().sum();
    if counts.len() != pg.size() || t.rank() != 1 || t.elem_count() != total {
        return Err(Error::Check(format!(
            "{what} in place: {} counts summing to {total} for a tensor of shape {:?} \
             (group size {})",
            counts.len(),
            t.shape(),
            pg.size()
        )));
    }
    Ok(())
}

/// Run `coll` on `t` as an in-place op and wait for it, after the
/// collectives started on `pg` and not yet run (host memory: see
/// [`Started`]), as NCCL's stream runs them in the order launched.
fn run(pg: &ProcessGroup, t: &Tensor, coll: Coll) -> Result<()> {
    started::flush(pg, None)?;
    run_op(pg, t, coll, DeviceMode::Wait).map(|_| ())
}

/// Run `coll` on `t` as an in-place op; the group's own error comes back
/// whole. Returns the mark of a collective started on device memory
/// (`DeviceMode::Start`).
fn run_op(pg: &ProcessGroup, t: &Tensor, coll: Coll, mode: DeviceMode) -> Result<Option<u64>> {
    let o = InPlace {
        pg,
        coll,
        mode,
        failure: Mutex::new(None),
        mark: Mutex::new(None),
    };
    match t.inplace_op1(&o) {
        Ok(()) => Ok(o.mark.into_inner().unwrap_or(None)),
        Err(e) => Err(match o.failure.into_inner().unwrap_or(None) {
            Some(c) => {
                if !t.device().is_cpu() && may_be_in_flight(&c) {
                    // An aborted NCCL kernel may still be on its stream,
                    // over this memory: never give it back to candle's
                    // allocator (as the backend leaks its own staging
                    // buffer then). The process is failing anyway.
                    std::mem::forget(t.clone());
                }
                Error::Comm(c)
            }
            None => Error::Tensor(e),
        }),
    }
}

/// Start sending (`send`), or receiving into, the contiguous device tensor
/// `t` to or from rank `peer` of `pg`, without waiting: messages between
/// two ranks match in order, without tags (NCCL's point-to-point; `pg`
/// carries one direction of one pair). Returns the group's mark for it
/// (`ProcessGroup::settle_device_to`, `device_done`); `t` is the caller's
/// until then, and untouched. Device memory only: host memory travels by
/// tagged messages.
pub(crate) fn start_p2p(pg: &ProcessGroup, t: &Tensor, send: bool, peer: usize) -> Result<u64> {
    let coll = match send {
        true => Coll::Send(peer),
        false => Coll::Recv(peer),
    };
    run_op(pg, t, coll, DeviceMode::Start)?.ok_or_else(|| {
        Error::Check(format!(
            "a tagless {} on {:?} through the {} backend (device memory on NCCL only)",
            coll.name(),
            t.device().location(),
            pg.backend_name()
        ))
    })
}

/// What runs on the storage.
/// Whether a collective that failed with `e` may have launched a kernel
/// that is still over its memory: every failure but a refusal before the
/// launch (`Invalid`: a wrong device, dtype or count). NCCL's wait aborts
/// the communicator on a timeout, and on an error NCCL itself reports
/// (`Io`: a peer gone), with its kernel perhaps still queued.
pub(crate) fn may_be_in_flight(e: &CommError) -> bool {
    !matches!(e, CommError::Invalid(_))
}

#[derive(Clone, Copy)]
pub(crate) enum Coll<'a> {
    AllReduce(ReduceOp),
    /// Per-rank counts.
    AllGather(&'a [usize]),
    /// Per-rank counts.
    ReduceScatter(ReduceOp, &'a [usize]),
    /// Point-to-point on device memory only (always started): to, or
    /// from, this group rank ([`start_p2p`]; read on CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Send(usize),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Recv(usize),
}

impl Coll<'_> {
    fn name(&self) -> &'static str {
        match self {
            Coll::AllReduce(_) => "all-reduce",
            Coll::AllGather(_) => "all-gather",
            Coll::ReduceScatter(..) => "reduce-scatter",
            Coll::Send(_) => "send",
            Coll::Recv(_) => "receive",
        }
    }

    /// The collective on host memory `v` (the tensor's range).
    fn host<T: phalanx_comm::Element>(
        &self,
        pg: &ProcessGroup,
        v: &mut [T],
    ) -> phalanx_comm::Result<()> {
        let me = pg.rank();
        match *self {
            Coll::AllReduce(op) => pg.all_reduce(v, op),
            Coll::AllGather(counts) => {
                let at: usize = counts[..me].iter().sum();
                let mine = v[at..at + counts[me]].to_vec();
                pg.all_gather_v(&mine, counts, v)
            }
            Coll::ReduceScatter(op, counts) => {
                let at: usize = counts[..me].iter().sum();
                let mut mine = v[at..at + counts[me]].to_vec();
                pg.reduce_scatter_v(v, counts, &mut mine, op)?;
                v[at..at + counts[me]].copy_from_slice(&mine);
                Ok(())
            }
            // Host memory travels by tagged messages instead
            // (`ProcessGroup::send`): nothing calls this.
            Coll::Send(_) | Coll::Recv(_) => Err(CommError::Invalid(format!(
                "a tagless {} of host memory",
                self.name()
            ))),
        }
    }
}

/// A collective on a storage's contiguous range, where it lies: host
/// memory through the group's backend, CUDA memory through one that
/// reduces it (ordered after what candle's stream has queued). `fail`
/// turns the group's error into candle's (keeping it, for the caller's
/// own error type).
pub(crate) trait OnStorage: BackendStorage {
    /// `mode`: on device memory, return once complete or once launched,
    /// with the group's mark for it (host memory: always complete, no
    /// mark).
    fn collective(
        &mut self,
        l: &Layout,
        pg: &ProcessGroup,
        coll: Coll,
        mode: DeviceMode,
        fail: &dyn Fn(CommError) -> candle_core::Error,
    ) -> candle_core::Result<Option<u64>>;
}

struct InPlace<'a> {
    pg: &'a ProcessGroup,
    coll: Coll<'a>,
    mode: DeviceMode,
    /// The group's own error, kept whole for the caller.
    failure: Mutex<Option<CommError>>,
    /// A started collective's mark.
    mark: Mutex<Option<u64>>,
}

impl InPlace<'_> {
    /// The collective on storage `s`, its mark kept.
    fn on<S: OnStorage>(&self, s: &mut S, l: &Layout) -> candle_core::Result<()> {
        let m = s.collective(l, self.pg, self.coll, self.mode, &|e| self.fail(e))?;
        *self.mark.lock().unwrap_or_else(|p| p.into_inner()) = m;
        Ok(())
    }

    fn fail(&self, e: CommError) -> candle_core::Error {
        let msg = e.to_string();
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        candle_core::Error::Msg(msg)
    }
}

/// The contiguous element range of `l`.
fn span(l: &Layout) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("a collective in place on a non-contiguous tensor".into())
    })
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        self.coll.name()
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        self.on(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        self.on(s, l)
    }
}

impl OnStorage for CpuStorage {
    fn collective(
        &mut self,
        l: &Layout,
        pg: &ProcessGroup,
        coll: Coll,
        _mode: DeviceMode,
        fail: &dyn Fn(CommError) -> candle_core::Error,
    ) -> candle_core::Result<Option<u64>> {
        let (a, b) = span(l)?;
        let r = match self {
            CpuStorage::F32(v) => coll.host(pg, &mut v[a..b]),
            CpuStorage::F64(v) => coll.host(pg, &mut v[a..b]),
            CpuStorage::BF16(v) => coll.host(pg, &mut v[a..b]),
            CpuStorage::F16(v) => coll.host(pg, &mut v[a..b]),
            CpuStorage::I64(v) => coll.host(pg, &mut v[a..b]),
            s => candle_core::bail!("{} of a {:?} tensor", coll.name(), s.dtype()),
        };
        r.map(|_| None).map_err(fail)
    }
}

#[cfg(feature = "cuda")]
impl OnStorage for candle_core::CudaStorage {
    fn collective(
        &mut self,
        l: &Layout,
        pg: &ProcessGroup,
        coll: Coll,
        mode: DeviceMode,
        fail: &dyn Fn(CommError) -> candle_core::Error,
    ) -> candle_core::Result<Option<u64>> {
        use candle_core::backend::BackendDevice;
        use candle_core::cuda::cudarc::driver::DevicePtrMut;
        use candle_core::DType as C;
        use phalanx_comm::{DType as D, DeviceBuf};
        let (a, b) = span(l)?;
        let dev = self.device.clone();
        let DeviceLocation::Cuda { gpu_id } = dev.location() else {
            candle_core::bail!("{}: CUDA storage off a CUDA device", coll.name());
        };
        let stream = dev.cuda_stream();
        let (ptr, dtype) = match self.dtype() {
            C::F32 => (
                self.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream).0,
                D::F32,
            ),
            C::BF16 => (
                self.as_cuda_slice_mut::<half::bf16>()?
                    .device_ptr_mut(&stream)
                    .0,
                D::BF16,
            ),
            C::F16 => (
                self.as_cuda_slice_mut::<half::f16>()?
                    .device_ptr_mut(&stream)
                    .0,
                D::F16,
            ),
            C::F64 => (
                self.as_cuda_slice_mut::<f64>()?.device_ptr_mut(&stream).0,
                D::F64,
            ),
            d => candle_core::bail!("{} of a {d:?} tensor on CUDA", coll.name()),
        };
        // A group of one on a host backend (one GPU without NCCL) has
        // nothing to exchange and no way to: the tensor is the result.
        if pg.size() == 1 && pg.device_ordinal() != Some(gpu_id) {
            return Ok(None);
        }
        // NCCL runs on its own stream, after what candle's stream has
        // queued so far (the backward that made these gradients, the step
        // that made these shards, the op that built this buffer): an event
        // recorded there and waited for on NCCL's, so the host does not
        // wait for candle's kernels. NCCL's wait returns only once the
        // collective is complete (so candle's later kernels read the
        // result); a started one's result is read only after the group
        // has settled its mark ([`Started`]).
        let buf = DeviceBuf {
            ptr: ptr + (a * dtype.size()) as u64,
            count: b - a,
            dtype,
            ordinal: gpu_id,
            after: Some(stream.cu_stream() as usize as u64),
        };
        // SAFETY: `buf` is this storage's contiguous range on device
        // `gpu_id`, candle's writes to it are queued on `buf.after` (the
        // collective is ordered after them), and the caller lends it
        // mutably until we return. A started one is held by the caller
        // until the group settles its mark ([`Started`]).
        let r = match (coll, mode) {
            (Coll::AllReduce(op), DeviceMode::Wait) => {
                unsafe { pg.all_reduce_device(buf, op) }.map(|_| None)
            }
            (Coll::AllReduce(op), DeviceMode::Start) => {
                unsafe { pg.all_reduce_device_start(buf, op) }.map(Some)
            }
            (Coll::AllGather(counts), DeviceMode::Wait) => {
                unsafe { pg.all_gather_device(buf, counts) }.map(|_| None)
            }
            (Coll::AllGather(counts), DeviceMode::Start) => {
                unsafe { pg.all_gather_device_start(buf, counts) }.map(Some)
            }
            (Coll::ReduceScatter(op, counts), DeviceMode::Wait) => {
                unsafe { pg.reduce_scatter_device(buf, counts, op) }.map(|_| None)
            }
            (Coll::ReduceScatter(op, counts), DeviceMode::Start) => {
                unsafe { pg.reduce_scatter_device_start(buf, counts, op) }.map(Some)
            }
            (Coll::Send(dst), _) => unsafe { pg.send_device_start(buf, dst) }.map(Some),
            (Coll::Recv(src), _) => unsafe { pg.recv_device_start(buf, src) }.map(Some),
        };
        r.map_err(fail)
    }
}
