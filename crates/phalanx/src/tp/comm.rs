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
//! Mixed precision: f16 / bf16 tensors are communicated in their own dtype
//! (half the bytes of f32); `phalanx_comm` reduces half elements in f32 and
//! rounds once per reduction step, as gloo does. f32 and f64 work too.
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

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use phalanx_comm::{Element, ProcessGroup, ReduceOp};

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Identity forward, all-reduce backward.
    Copy,
    /// All-reduce forward, identity backward.
    Reduce,
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

impl TpOp {
    /// The flat operation on `x` with leading dimension `rows` (after the
    /// sequence axis was moved to the front).
    fn run<T: Element + Default>(
        &self,
        kind: Kind,
        x: &[T],
        shape: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>)> {
        let n = self.pg.size();
        let r = self.pg.rank();
        let mut out_shape = shape.to_vec();
        let v = match kind {
            Kind::Copy => x.to_vec(),
            Kind::Reduce => {
                let mut v = x.to_vec();
                self.pg
                    .all_reduce(&mut v, ReduceOp::Sum)
                    .map_err(comm_err)?;
                v
            }
            Kind::Gather => {
                out_shape[0] *= n;
                let mut v = vec![T::default(); x.len() * n];
                self.pg.all_gather(x, &mut v).map_err(comm_err)?;
                v
            }
            Kind::Scatter | Kind::Split => {
                if !shape[0].is_multiple_of(n) {
                    candle_core::bail!(
                        "sequence length {} is not divisible by the tensor-parallel size {n}",
                        shape[0]
                    );
                }
                out_shape[0] /= n;
                let k = x.len() / n;
                if kind == Kind::Split {
                    x[r * k..(r + 1) * k].to_vec()
                } else {
                    let mut v = vec![T::default(); k];
                    self.pg
                        .reduce_scatter(x, &mut v, ReduceOp::Sum)
                        .map_err(comm_err)?;
                    v
                }
            }
        };
        Ok((v, out_shape))
    }
}

impl CustomOp1 for TpOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "tp-copy",
            Kind::Reduce => "tp-reduce",
            Kind::Gather => "tp-gather-seq",
            Kind::Scatter => "tp-reduce-scatter-seq",
            Kind::Split => "tp-split-seq",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((lo, hi)) = l.contiguous_offsets() else {
            bail!("tensor-parallel collective: expected a contiguous tensor")
        };
        let dims = l.dims();
        let (storage, shape) = match s {
            CpuStorage::F32(x) => {
                let (v, sh) = self.run(self.kind, &x[lo..hi], dims)?;
                (CpuStorage::F32(v), sh)
            }
            CpuStorage::F16(x) => {
                let (v, sh) = self.run(self.kind, &x[lo..hi], dims)?;
                (CpuStorage::F16(v), sh)
            }
            CpuStorage::BF16(x) => {
                let (v, sh) = self.run(self.kind, &x[lo..hi], dims)?;
                (CpuStorage::BF16(v), sh)
            }
            CpuStorage::F64(x) => {
                let (v, sh) = self.run(self.kind, &x[lo..hi], dims)?;
                (CpuStorage::F64(v), sh)
            }
            other => bail!(
                "tensor-parallel collective: unsupported dtype {:?}",
                other.dtype()
            ),
        };
        Ok((storage, Shape::from(shape)))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let back = match self.kind {
            Kind::Copy => Kind::Reduce,
            Kind::Reduce => Kind::Copy,
            Kind::Gather => Kind::Scatter,
            Kind::Scatter | Kind::Split => Kind::Gather,
        };
        let g = g.contiguous()?;
        let flat = g.flatten_all()?;
        let dev = g.device();
        // The gradient is communicated in its own dtype (the forward input's).
        let t = match g.dtype() {
            DType::F32 => {
                let (v, sh) = self.run(back, &flat.to_vec1::<f32>()?, g.dims())?;
                Tensor::from_vec(v, sh, dev)?
            }
            DType::F16 => {
                let (v, sh) = self.run(back, &flat.to_vec1::<f16>()?, g.dims())?;
                Tensor::from_vec(v, sh, dev)?
            }
            DType::BF16 => {
                let (v, sh) = self.run(back, &flat.to_vec1::<bf16>()?, g.dims())?;
                Tensor::from_vec(v, sh, dev)?
            }
            DType::F64 => {
                let (v, sh) = self.run(back, &flat.to_vec1::<f64>()?, g.dims())?;
                Tensor::from_vec(v, sh, dev)?
            }
            d => bail!("tensor-parallel collective: unsupported dtype {d:?}"),
        };
        Ok(Some(t))
    }
}

fn apply(x: &Tensor, pg: &ProcessGroup, kind: Kind) -> Result<Tensor> {
    if pg.size() == 1 {
        return Ok(x.clone());
    }
    let op = TpOp {
        pg: pg.clone(),
        kind,
    };
    crate::ops::on_host(x, |h| h.contiguous()?.apply_op1(op))
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
    apply(x, pg, Kind::Reduce)
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
