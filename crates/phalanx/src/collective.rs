//! Collectives on candle tensors where they lie: a tensor in host memory
//! through its group's backend, one in CUDA memory through a backend that
//! reduces device memory (NCCL), without a copy through the host. Two
//! collectives, what the data-parallel strategies need on the device: the
//! all-reduce of held gradients, and the all-gather of updated shards.
//!
//! Each runs as a candle in-place op, the one way candle lends its
//! storage mutably: the CPU side reduces the tensor's own elements, the
//! CUDA side hands NCCL their device address after candle's stream has
//! finished writing them ([`phalanx_comm::ProcessGroup::all_reduce_device`],
//! `all_gather_device`).
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
use phalanx_comm::{CommError, ProcessGroup, ReduceOp};
use std::sync::Mutex;

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
/// `t` holds the result. `t` must own its storage (nothing else may read
/// it meanwhile: a detached tensor of this caller's, not a view).
pub fn all_reduce_in_place(pg: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<()> {
    run(pg, t, Coll::AllReduce(op))
}

/// All-gather in place: `t` ((sum of `counts`,), contiguous) holds rank
/// k's block of `counts[k]` elements after the blocks before it; each
/// rank's own block is its contribution, and on return every block is its
/// owner's on every rank. Blocks may be uneven (ZeRO's shards of a model
/// the group size does not divide), on CUDA too: no padded copy.
pub fn all_gather_in_place(pg: &ProcessGroup, t: &Tensor, counts: &[usize]) -> Result<()> {
    check_counts(pg, t, counts)?;
    run(pg, t, Coll::AllGather(counts))
}

fn check_counts(pg: &ProcessGroup, t: &Tensor, counts: &[usize]) -> Result<()> {
    let total: usize = counts.iter().sum();
    if counts.len() != pg.size() || t.rank() != 1 || t.elem_count() != total {
        return Err(Error::Check(format!(
            "all-gather in place: {} counts summing to {total} for a tensor of shape {:?} \
             (group size {})",
            counts.len(),
            t.shape(),
            pg.size()
        )));
    }
    Ok(())
}

/// Run `coll` on `t` as an in-place op; the group's own error comes back
/// whole.
fn run(pg: &ProcessGroup, t: &Tensor, coll: Coll) -> Result<()> {
    let o = InPlace {
        pg,
        coll,
        failure: Mutex::new(None),
    };
    match t.inplace_op1(&o) {
        Ok(()) => Ok(()),
        Err(e) => Err(match o.failure.into_inner().unwrap_or(None) {
            Some(c) => {
                if !t.device().is_cpu()
                    && matches!(c, CommError::Timeout(_) | CommError::Aborted(_))
                {
                    // The aborted NCCL kernel may still be on its stream,
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

#[derive(Clone, Copy)]
enum Coll<'a> {
    AllReduce(ReduceOp),
    /// Per-rank counts.
    AllGather(&'a [usize]),
}

struct InPlace<'a> {
    pg: &'a ProcessGroup,
    coll: Coll<'a>,
    /// The group's own error, kept whole for the caller.
    failure: Mutex<Option<CommError>>,
}

impl InPlace<'_> {
    fn fail(&self, e: CommError) -> candle_core::Error {
        let msg = e.to_string();
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        candle_core::Error::Msg(msg)
    }

    /// The collective on host memory `v` (the tensor's range).
    fn host<T: phalanx_comm::Element>(&self, v: &mut [T]) -> phalanx_comm::Result<()> {
        match self.coll {
            Coll::AllReduce(op) => self.pg.all_reduce(v, op),
            Coll::AllGather(counts) => {
                let me = self.pg.rank();
                let at: usize = counts[..me].iter().sum();
                let mine = v[at..at + counts[me]].to_vec();
                self.pg.all_gather_v(&mine, counts, v)
            }
        }
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
        match self.coll {
            Coll::AllReduce(_) => "all-reduce",
            Coll::AllGather(_) => "all-gather",
        }
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = span(l)?;
        let r = match s {
            CpuStorage::F32(v) => self.host(&mut v[a..b]),
            CpuStorage::F64(v) => self.host(&mut v[a..b]),
            CpuStorage::BF16(v) => self.host(&mut v[a..b]),
            CpuStorage::F16(v) => self.host(&mut v[a..b]),
            CpuStorage::I64(v) => self.host(&mut v[a..b]),
            _ => candle_core::bail!("{} of a {:?} tensor", self.name(), s.dtype()),
        };
        r.map_err(|e| self.fail(e))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        use candle_core::backend::BackendDevice;
        use candle_core::cuda::cudarc::driver::DevicePtrMut;
        use candle_core::DType as C;
        use phalanx_comm::{DType as D, DeviceBuf};
        let (a, b) = span(l)?;
        let dev = s.device.clone();
        let DeviceLocation::Cuda { gpu_id } = dev.location() else {
            candle_core::bail!("{}: CUDA storage off a CUDA device", self.name());
        };
        let stream = dev.cuda_stream();
        let (ptr, dtype) = match s.dtype() {
            C::F32 => (
                s.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream).0,
                D::F32,
            ),
            C::BF16 => (
                s.as_cuda_slice_mut::<half::bf16>()?
                    .device_ptr_mut(&stream)
                    .0,
                D::BF16,
            ),
            C::F16 => (
                s.as_cuda_slice_mut::<half::f16>()?
                    .device_ptr_mut(&stream)
                    .0,
                D::F16,
            ),
            d => candle_core::bail!("{} of a {d:?} tensor on CUDA", self.name()),
        };
        // NCCL runs on its own stream: what candle's stream wrote (the
        // backward that made these gradients, the step that made these
        // shards) must be complete first, and NCCL's wait returns only once
        // the collective is (so candle's later kernels read the result).
        stream.synchronize().map_err(candle_core::Error::wrap)?;
        // A group of one on a host backend (one GPU without NCCL) has
        // nothing to exchange and no way to: the tensor is the result.
        if self.pg.size() == 1 && self.pg.device_ordinal() != Some(gpu_id) {
            return Ok(());
        }
        let buf = DeviceBuf {
            ptr: ptr + (a * dtype.size()) as u64,
            count: b - a,
            dtype,
            ordinal: gpu_id,
        };
        // SAFETY: `buf` is this tensor's contiguous range on device
        // `gpu_id`, candle's writes to it are complete (synchronised above),
        // and candle lends it mutably (an in-place op) until we return.
        let r = match self.coll {
            Coll::AllReduce(op) => unsafe { self.pg.all_reduce_device(buf, op) },
            Coll::AllGather(counts) => unsafe { self.pg.all_gather_device(buf, counts) },
        };
        r.map_err(|e| self.fail(e))
    }
}
