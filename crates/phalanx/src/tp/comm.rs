//! Collectives inside autograd: the communication operators of Megatron-LM
//! tensor and sequence parallelism, as candle custom ops with a backward.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | `copy_to_tp` (Megatron's f) | identity | all-reduce |
//! | `reduce_from_tp` (g) | all-reduce | identity |
//! | `gather_seq` | all-gather along the sequence | reduce-scatter |
//! | `reduce_scatter_seq` | reduce-scatter along the sequence | all-gather |
//! | `split_seq` | keep this rank's sequence chunk | all-gather |
//!
//! Activations are (B, T, C); the sequence ops move the T axis to the front
//! (contiguous per-rank chunks), call the flat collective, and move it back.
//!
//! Each op builds its result's buffer on the tensor's device and runs the
//! collective on it in place (`collective::OnStorage`; the CPU runs the
//! same code): on a GPU under NCCL nothing crosses to the host. Ranks
//! sharing a GPU (the native backend: host memory only) go through a host
//! copy.
//!
//! Mixed precision: f16 / bf16 tensors are communicated in their own dtype
//! (half the bytes of f32); on the host `phalanx_comm` reduces half
//! elements in f32 and rounds once per reduction step, as gloo does, and
//! on a GPU NCCL reduces them in their own dtype. f32 and f64 work too.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let x = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
//!     let y = phalanx::tp::reduce_from_tp(x.as_tensor(), &pg).unwrap(); // sum over ranks
//!     let g = phalanx::tp::copy_to_tp(&y, &pg).unwrap().sum_all().unwrap().backward().unwrap();
//!     (y.to_vec1::<f32>().unwrap(), g.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap())
//! });
//! assert_eq!(out[0].0, vec![2.0, 4.0]);
//! assert_eq!(out[0].1, vec![2.0, 2.0]); // f's backward summed the ranks' gradients
//! ```

use crate::collective::{may_be_in_flight, reduces_on, Coll, OnStorage};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, CustomOp1, DeviceLocation, Layout, Result, Shape, Tensor};
use phalanx_comm::{CommError, ProcessGroup, ReduceOp};
use std::cell::Cell;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Identity forward, all-reduce backward.
    Copy,
    /// All-reduce forward (a sum; a maximum has no backward), identity backward.
    Reduce(ReduceOp),
    /// All-gather dim 0 forward, reduce-scatter backward.
    Gather,
    /// Reduce-scatter dim 0 forward, all-gather backward.
    Scatter,
    /// Local chunk of dim 0 forward, all-gather backward.
    Split,
}

struct TpOp {
    pg: ProcessGroup,
    kind: Kind,
}

pub(super) fn comm_err(e: phalanx_comm::CommError) -> candle_core::Error {
    candle_core::Error::Msg(format!("tensor-parallel collective: {e}"))
}

/// A new contiguous storage of `shape` on `s`'s device, holding the
/// elements `l` selects from `s`.
fn copied<S>(s: &S, l: &Layout, shape: &Shape) -> Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: every element is written by the copy below before it is read.
    let mut out = unsafe { s.device().alloc_uninit(shape, s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok(out)
}

impl TpOp {
    /// The exchange on storage `s` (layout `l`, contiguous, dim 0 the
    /// sequence axis for the sequence ops), on `s`'s device: the result's
    /// buffer is built there and the collective runs on it in place
    /// ([`OnStorage`]: host memory through the backend, CUDA memory
    /// through NCCL), so nothing crosses to the host. The CPU runs this
    /// very code.
    fn exchange<S>(&self, s: &S, l: &Layout) -> Result<(S, Shape)>
    where
        S: OnStorage,
        S::Device: BackendDevice<Storage = S>,
    {
        if !l.is_contiguous() {
            bail!("tensor-parallel collective: expected a contiguous tensor")
        }
        let (n, r) = (self.pg.size(), self.pg.rank());
        let shape = l.shape().clone();
        let mut part = shape.dims().to_vec();
        let mut whole = part.clone();
        if matches!(self.kind, Kind::Scatter | Kind::Split) {
            if !part[0].is_multiple_of(n) {
                bail!(
                    "sequence length {} is not divisible by the tensor-parallel size {n}",
                    part[0]
                );
            }
            part[0] /= n;
        }
        whole[0] *= n;
        let (part, whole) = (Shape::from(part), Shape::from(whole));
        let out = match self.kind {
            Kind::Copy => (copied(s, l, &shape)?, shape),
            Kind::Reduce(op) => {
                let out = copied(s, l, &shape)?;
                (self.run(out, &shape, Coll::AllReduce(op))?, shape)
            }
            Kind::Gather => {
                // This rank's block in place; the gather fills the others.
                // SAFETY: every block is written (this one by the copy, the
                // others by the gather) before the result is read.
                let mut out = unsafe { s.device().alloc_uninit(&whole, s.dtype())? };
                s.copy_strided_src(&mut out, r * shape.elem_count(), l)?;
                let counts = vec![shape.elem_count(); n];
                (self.run(out, &whole, Coll::AllGather(&counts))?, whole)
            }
            Kind::Scatter => {
                let full = copied(s, l, &shape)?;
                let k = part.elem_count();
                let counts = vec![k; n];
                let full = self.run(full, &shape, Coll::ReduceScatter(ReduceOp::Sum, &counts))?;
                let mine = Layout::contiguous_with_offset(&part, r * k);
                (copied(&full, &mine, &part)?, part)
            }
            Kind::Split => {
                let rows = part.dims()[0];
                (copied(s, &l.narrow(0, r * rows, rows)?, &part)?, part)
            }
        };
        Ok(out)
    }

    /// The collective in place on `out` (contiguous, `shape`). After a
    /// failure that may have launched (anything but a refusal) off the
    /// host `out` is never freed: an aborted NCCL kernel may still be over
    /// it, and the process is failing anyway.
    fn run<S: OnStorage>(&self, mut out: S, shape: &Shape, coll: Coll) -> Result<S> {
        let aborted = Cell::new(false);
        let fail = |e: CommError| {
            aborted.set(may_be_in_flight(&e));
            comm_err(e)
        };
        let wait = phalanx_comm::DeviceMode::Wait;
        match out.collective(&Layout::contiguous(shape), &self.pg, coll, wait, &fail) {
            Ok(_) => Ok(out),
            Err(e) => {
                if aborted.get() && !matches!(out.device().location(), DeviceLocation::Cpu) {
                    std::mem::forget(out);
                }
                Err(e)
            }
        }
    }
}

impl CustomOp1 for TpOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "tp-copy",
            Kind::Reduce(_) => "tp-reduce",
            Kind::Gather => "tp-gather-seq",
            Kind::Scatter => "tp-reduce-scatter-seq",
            Kind::Split => "tp-split-seq",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.exchange(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.exchange(s, l)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let back = match self.kind {
            Kind::Copy => Kind::Reduce(ReduceOp::Sum),
            Kind::Reduce(ReduceOp::Sum) => Kind::Copy,
            Kind::Reduce(op) => bail!("tensor-parallel collective: no backward for {op:?}"),
            Kind::Gather => Kind::Scatter,
            Kind::Scatter | Kind::Split => Kind::Gather,
        };
        // The gradient is communicated in its own dtype (the forward input's).
        Ok(Some(exchange(g, &self.pg, back, false)?))
    }
}

fn apply(x: &Tensor, pg: &ProcessGroup, kind: Kind) -> Result<Tensor> {
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    exchange(x, pg, kind, true)
}

/// `kind` on `x` where it lies when the group reduces that memory (host
/// memory; a GPU's under NCCL), else through a host copy (ranks sharing a
/// GPU: the native backend). `track`: as an op of autograd's.
fn exchange(x: &Tensor, pg: &ProcessGroup, kind: Kind, track: bool) -> Result<Tensor> {
    let op = TpOp {
        pg: pg.clone(),
        kind,
    };
    let go = |h: &Tensor| {
        let h = h.contiguous()?;
        if track {
            h.apply_op1(op)
        } else {
            h.apply_op1_no_bwd(&op)
        }
    };
    if reduces_on(pg, x.device()) {
        go(x)
    } else {
        crate::ops::on_host(x, go)
    }
}

/// Along the sequence axis (dim 1 of (B, T, C)): move it to the front, apply, move back.
fn along_seq(x: &Tensor, pg: &ProcessGroup, kind: Kind) -> Result<Tensor> {
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    let y = apply(&x.transpose(0, 1)?.contiguous()?, pg, kind)?;
    y.transpose(0, 1)?.contiguous()
}

/// Megatron's f: identity forward, all-reduce of the gradient backward
/// (before a column-parallel layer whose input is replicated).
pub fn copy_to_tp(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    apply(x, pg, Kind::Copy)
}

/// Megatron's g: all-reduce forward (after a row-parallel layer's partial
/// sums), identity backward.
pub fn reduce_from_tp(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    apply(x, pg, Kind::Reduce(ReduceOp::Sum))
}

/// The element-wise maximum over the group, outside autograd (a value
/// only: the vocabulary-parallel loss's row maxima).
pub(crate) fn max_over_tp(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    if pg.size() == 1 {
        return Ok(x.detach());
    }
    exchange(&x.detach(), pg, Kind::Reduce(ReduceOp::Max), false)
}

/// Sequence parallel: (B, T/tp, C) -> (B, T, C); backward reduce-scatters.
pub fn gather_seq(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    along_seq(x, pg, Kind::Gather)
}

/// Sequence parallel: partial (B, T, C) -> summed (B, T/tp, C); backward all-gathers.
pub fn reduce_scatter_seq(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    along_seq(x, pg, Kind::Scatter)
}

/// Sequence parallel: replicated (B, T, C) -> this rank's (B, T/tp, C); backward all-gathers.
pub fn split_seq(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    along_seq(x, pg, Kind::Split)
}
