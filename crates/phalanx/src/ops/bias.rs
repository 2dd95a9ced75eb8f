//! `x + b` where `b`'s shape is the trailing dims of `x` (a bias (C,) on
//! (B, T, C), a position table (T, C) on (B, T, C)).
//!
//!   y = x + b (broadcast over the leading dims);  dx = dy;  db = sum_rows(dy)
//!
//! Why our own: candle's `broadcast_add` backward sums over the broadcast
//! dims with a generic strided reduction, which profiled at ~16% of a small
//! GPT-2 step; here db is one contiguous pass.
//!
//! f16 / bf16: computed in f32 at the kernel boundary; y and dx in x's
//! dtype, db (summed in f32) in b's dtype.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
//! let b = Tensor::new(&[10f32, 20.], &Device::Cpu).unwrap();
//! let y = phalanx::ops::add_bias(&x, &b).unwrap().to_vec2::<f32>().unwrap();
//! assert_eq!(y, vec![vec![11., 22.], vec![13., 24.]]);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::cpu::{cpu_f32, is_float, par_rows, storage_in, tensor_in, with_f32_any};
use super::tape;

struct AddBias;

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "phalanx-add-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let (x, b) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?);
        let n = b.len();
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, n, |rows, y| {
            for (r, y) in rows.zip(y.chunks_exact_mut(n)) {
                let x = &x[r * n..(r + 1) * n];
                for i in 0..n {
                    y[i] = x[i] + b[i];
                }
            }
        });
        Ok((storage_in(s1.dtype(), y)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !b.track_op() {
            // A constant bias: its gradient goes to a recording tape (the
            // zero-bubble input pass), or nowhere.
            tape::defer(Box::new(BiasGrads {
                b: b.clone(),
                dy: grad.clone(),
            }));
            return Ok((Some(grad.clone()), None));
        }
        Ok((Some(grad.clone()), Some(bias_grad(b, grad)?)))
    }
}

/// db = dy summed over its leading dims, in b's dtype.
fn bias_grad(b: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let n = b.elem_count();
    let db = with_f32_any(dy, |g| {
        let mut db = vec![0f32; n];
        for row in g.chunks_exact(n) {
            for (d, &v) in db.iter_mut().zip(row) {
                *d += v;
            }
        }
        db
    })?;
    tensor_in(db, b.dtype(), b.shape(), b.device())
}

/// A bias gradient postponed to the zero-bubble W pass.
struct BiasGrads {
    b: Tensor,
    dy: Tensor,
}

impl tape::DeferredGrad for BiasGrads {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        Ok(vec![(self.b.clone(), bias_grad(&self.b, &self.dy)?)])
    }

    fn kept(&self) -> Vec<&Tensor> {
        vec![&self.dy]
    }
}

/// `x + b`, `b` shaped like the trailing dims of `x`.
pub fn add_bias(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (xd, bd) = (x.dims(), b.dims());
    if bd.len() > xd.len() || xd[xd.len() - bd.len()..] != *bd {
        bail!(
            "add_bias: {:?} is not the trailing shape of {:?}",
            b.shape(),
            x.shape()
        )
    }
    if !is_float(x.dtype()) || !is_float(b.dtype()) || !super::host_kernels(x.device()) {
        return x.broadcast_add(b);
    }
    x.contiguous()?.apply_op2(&b.contiguous()?, AddBias)
}
