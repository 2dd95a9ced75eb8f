//! Megatron-LM's asynchronous tensor-parallel all-reduce: a column-parallel
//! linear as one autograd op whose backward overlaps the reduction of the
//! input gradient with the weight gradient.
//!
//! Unfused, a column-parallel linear is `linear(f(x), w, b)`: backward runs
//! both of linear's gemms (dx = dy w, dw = dy^T x) and only then f's
//! all-reduce of dx, which is fully exposed. Here backward computes dx,
//! hands it to the group's communication thread (`all_reduce_async`), runs
//! dw and db while the reduction is in flight, then waits for the reduced
//! dx. Under sequence parallelism forward all-gathers the input's sequence
//! shards and backward reduce-scatters dx the same way, overlapped with dw.
//!
//! Exact: the same gemm calls, f32 widening and narrowing as
//! [`crate::ops::linear`], and the same collective on the same buffer (dx in
//! the input's dtype) as `copy_to_tp` / `gather_seq`, so the results equal
//! the unfused path bit for bit. dx is computed only when the input is
//! tracked, dw only when the weight is (`track_op`, as `ops::linear`).
//!
//! The default for [`super::ColumnParallelLinear`]; `PHALANX_TP_OVERLAP=0`
//! (read once per process) selects the unfused path.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use phalanx::tp::{column_parallel_linear, Tp};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let tp = Tp::new(pg, false);
//!     let x = Var::new(&[[1f32, 2.]], &Device::Cpu).unwrap(); // (1, 2), replicated
//!     let w = Tensor::new(&[[1f32, 1.]], &Device::Cpu).unwrap(); // this rank's (1, 2)
//!     let y = column_parallel_linear(&tp, x.as_tensor(), &w, None).unwrap();
//!     let g = y.sum_all().unwrap().backward().unwrap();
//!     g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap()
//! });
//! assert_eq!(out[0], vec![vec![2., 2.]]); // dx summed over the two ranks
//! ```

use super::comm::{comm_err, gather_seq};
use super::layers::Tp;
use crate::ops::cpu::{cpu_f32, is_float, storage_in, tensor_in, with_f32_any};
use crate::ops::linear::{defer_constant_weights, dims, forward, out_shape};
use crate::ops::{linear_backward_bias, linear_backward_input, linear_backward_weight};

/// dx (rows, k) = dy . w, f32.
fn input_grad(dy: &[f32], w: &[f32], d: (usize, usize, usize)) -> Vec<f32> {
    let mut dx = vec![0f32; d.0 * d.1];
    linear_backward_input(dy, w, d, &mut dx);
    dx
}

/// dw (n, k) = dy^T . x, f32.
fn weight_grad(dy: &[f32], x: &[f32], d: (usize, usize, usize)) -> Vec<f32> {
    let mut dw = vec![0f32; d.2 * d.1];
    linear_backward_weight(x, dy, d, &mut dw);
    dw
}

/// db (n,) = the sum of dy's rows, f32.
fn bias_grad(dy: &[f32], n: usize) -> Vec<f32> {
    let mut db = vec![0f32; n];
    linear_backward_bias(dy, &mut db);
    db
}
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use phalanx_comm::{Element, ProcessGroup, ReduceOp, Work};
use std::sync::OnceLock;

/// Whether column-parallel layers use the overlapped op: true unless the
/// environment sets `PHALANX_TP_OVERLAP=0` (read on first use).
pub fn tp_overlap_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("PHALANX_TP_OVERLAP")
            .map(|v| !matches!(v.trim(), "0" | "false" | "off"))
            .unwrap_or(true)
    })
}

/// `linear(f(x), w, b)` of a column-parallel layer (`f` = [`Tp::enter`]:
/// all-reduce of dx backward, or all-gather / reduce-scatter over the
/// sequence) as one op whose backward overlaps the collective on dx with
/// dw and db. x (.., in) replicated, or (B, T/tp, in) under sequence
/// parallelism; w (out/tp, in); b (out/tp,). Off CPU, for other dtypes or a
/// group of one it is the unfused `ops::linear(tp.enter(x), w, b)`.
pub fn column_parallel_linear(
    tp: &Tp,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Tensor> {
    let float = is_float(x.dtype()) && is_float(w.dtype()) && b.is_none_or(|b| is_float(b.dtype()));
    if tp.size() == 1 || !crate::ops::host_kernels(x.device()) || !float {
        return crate::ops::linear(&tp.enter(x)?, w, b);
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    // The layer's full input: x itself, or the gathered sequence (computed
    // here outside autograd; backward reduce-scatters into x's shard).
    let full = if tp.sequence_parallel {
        gather_seq(&x.detach(), &tp.pg)?
    } else {
        x.clone()
    };
    let op = ColumnOverlap {
        pg: tp.pg.clone(),
        seq: tp.sequence_parallel,
        full,
    };
    match b {
        Some(b) => {
            if b.dims() != [w.dim(0)?] {
                bail!("linear: bias {:?} for weight {:?}", b.shape(), w.shape())
            }
            x.apply_op3(&w, &b.contiguous()?, op)
        }
        None => x.apply_op2(&w, op),
    }
}

struct ColumnOverlap {
    pg: ProcessGroup,
    /// Sequence parallel: `full` is x gathered over the sequence (dim 1).
    seq: bool,
    /// The input the gemms see (contiguous): x, or its gathered sequence.
    full: Tensor,
}

/// A collective on dx in flight, in dx's dtype.
enum Pending {
    F32(Work<Vec<f32>>),
    F16(Work<Vec<f16>>),
    BF16(Work<Vec<bf16>>),
}

/// Dims 0 and 1 of a row-major (d0, d1, rest..) buffer swapped, as
/// `transpose(0, 1).contiguous()` (how the sequence ops put T first).
fn swap01<T: Copy>(v: &[T], d0: usize, d1: usize) -> Vec<T> {
    let rest = v.len().checked_div(d0 * d1).unwrap_or(0);
    let mut out = Vec::with_capacity(v.len());
    for j in 0..d1 {
        for i in 0..d0 {
            let at = (i * d1 + j) * rest;
            out.extend_from_slice(&v[at..at + rest]);
        }
    }
    out
}

impl ColumnOverlap {
    fn fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let w = cpu_f32(s2, l2)?;
        let b = bias.map(|(s, l)| cpu_f32(s, l)).transpose()?;
        let y_of = |x: &[f32], lx: &Layout| -> Result<(Vec<f32>, Shape)> {
            let d = dims(lx, l2)?;
            Ok((forward(x, &w, b.as_deref(), d), out_shape(lx, d.2)))
        };
        let (y, shape) = if self.seq {
            let lx = self.full.layout().clone();
            with_f32_any(&self.full, |x| y_of(x, &lx))??
        } else {
            y_of(&cpu_f32(s1, l1)?, l1)?
        };
        Ok((storage_in(s1.dtype(), y)?, shape))
    }

    /// Start the collective on dx (f32, the full input's shape): narrowed to
    /// the input's dtype, then all-reduced, or (T first) reduce-scattered.
    fn launch(&self, dx: Vec<f32>, dtype: DType) -> Result<Pending> {
        Ok(match storage_in(dtype, dx)? {
            CpuStorage::F32(v) => Pending::F32(self.start(v)?),
            CpuStorage::F16(v) => Pending::F16(self.start(v)?),
            CpuStorage::BF16(v) => Pending::BF16(self.start(v)?),
            s => bail!("tensor-parallel overlap: unsupported dtype {:?}", s.dtype()),
        })
    }

    fn start<T: Element + Copy>(&self, v: Vec<T>) -> Result<Work<Vec<T>>> {
        if !self.seq {
            return Ok(self.pg.all_reduce_async(v, ReduceOp::Sum));
        }
        let (d, n) = (self.full.dims(), self.pg.size());
        if d.len() < 2 || !d[1].is_multiple_of(n) {
            bail!("sequence length of {d:?} is not divisible by the tensor-parallel size {n}")
        }
        let v = swap01(&v, d[0], d[1]);
        let counts = vec![v.len() / n; n];
        Ok(self.pg.reduce_scatter_async(v, counts, ReduceOp::Sum))
    }

    /// Wait for the collective; dx in x's (local) shape.
    fn finish(&self, p: Pending, x: &Tensor) -> Result<Tensor> {
        fn done<T: Element + Copy + candle_core::WithDType>(
            me: &ColumnOverlap,
            w: Work<Vec<T>>,
            x: &Tensor,
        ) -> Result<Tensor> {
            let v = w.wait().map_err(comm_err)?;
            let v = match me.seq {
                // (T/tp, B, rest) back to (B, T/tp, rest).
                true => swap01(&v, x.dim(1)?, x.dim(0)?),
                false => v,
            };
            Tensor::from_vec(v, x.shape(), x.device())
        }
        match p {
            Pending::F32(w) => done(self, w, x),
            Pending::F16(w) => done(self, w, x),
            Pending::BF16(w) => done(self, w, x),
        }
    }

    /// dx first, its collective launched; dw and db while it runs; then the
    /// reduced dx.
    fn bwd3(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        b: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (need_dx, need_dw) = (x.track_op(), w.track_op());
        let bias = b.filter(|b| b.track_op()).map(|b| b.dtype());
        let full = &self.full;
        // The zero-bubble input pass: constant weights' gradients to the tape.
        defer_constant_weights(full, w, b, dy);
        let (k, n) = (w.dim(1)?, w.dim(0)?);
        let d = (full.elem_count() / k, k, n);
        let dev = x.device();
        let (pending, dw, db) = with_f32_any(dy, |dy| -> Result<_> {
            let pending = match need_dx {
                true => {
                    let dx = with_f32_any(w, |w| input_grad(dy, w, d))?;
                    Some(self.launch(dx, full.dtype())?)
                }
                false => None,
            };
            // In flight: the weight pass (errors wait for nothing; the
            // collective completes on the communication thread anyway).
            let dw = match need_dw {
                true => Some(with_f32_any(full, |x| weight_grad(dy, x, d))?),
                false => None,
            };
            let db = bias.map(|_| bias_grad(dy, n));
            Ok((pending, dw, db))
        })??;
        let dx = pending.map(|p| self.finish(p, x)).transpose()?;
        Ok((
            dx,
            dw.map(|dw| tensor_in(dw, w.dtype(), w.shape(), dev))
                .transpose()?,
            db.zip(bias)
                .map(|(db, dt)| tensor_in(db, dt, n, dev))
                .transpose()?,
        ))
    }
}

impl CustomOp3 for ColumnOverlap {
    fn name(&self) -> &'static str {
        "tp-column-linear-overlap"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        self.fwd(s1, l1, s2, l2, Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.bwd3(x, w, dy, Some(b))
    }
}

impl CustomOp2 for ColumnOverlap {
    fn name(&self) -> &'static str {
        "tp-column-linear-overlap-nobias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        self.fwd(s1, l1, s2, l2, None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.bwd3(x, w, dy, None)?;
        Ok((dx, dw))
    }
}
