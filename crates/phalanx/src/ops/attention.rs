//! Causal multi-head self-attention as one op, from the fused qkv projection
//! (llm.c's attention_forward / attention_backward, with gemm per head):
//!
//!   qkv (B, T, 3C) -> q, k, v heads (T, hs) for each (b, h), hs = C / nh
//!   S = q k^T / sqrt(hs);  P = causal_softmax(S);  y_h = P v      -> y (B, T, C)
//! Backward, per (b, h), with P kept from the forward:
//!   dP = dy_h v^T;  dv = P^T dy_h;  dS = P * (dP - rowsum(P * dP)) / sqrt(hs)
//!   dq = dS k;  dk = dS^T q
//!
//! Every product runs by blocks of [`BLOCK`] query rows (or key columns):
//! rows i0..i1 only see keys 0..i1, so the masked triangle beyond each
//! block is never computed (at T = 256 the five products do 5/8 of the
//! full T x T work), as flash attention skips fully masked tiles.
//!
//! Why: the same computation in candle ops is ~15 graph nodes (splits,
//! reshapes, transposes, copies, two batched matmuls, softmax), each of which
//! costs a zero-filled gradient plus an add in candle's backward. Here it is
//! one node; the (b, h) pairs run in parallel on candle's thread pool.
//!
//! f16 / bf16: qkv is widened to f32 at the kernel boundary, scores, softmax
//! and products are f32, y and dqkv are narrowed to qkv's dtype. The saved
//! probabilities P are kept in qkv's dtype too (half the memory of the
//! largest attention activation) and widened one head at a time backward.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! // T = 2, C = 2, one head: the first position only sees itself.
//! let qkv = Tensor::new(&[[[0f32, 0., 0., 0., 1., 2.], [0., 0., 0., 0., 3., 4.]]], &Device::Cpu).unwrap();
//! let y = phalanx::ops::causal_attention(&qkv, 1).unwrap().to_vec3::<f32>().unwrap();
//! assert_eq!(y[0], vec![vec![1., 2.], vec![2., 3.]]);
//! ```

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::cpu::{
    cpu_f32, dot_lanes, is_float, max_lanes, pool_chunked, storage_f32, storage_in, sum_lanes,
    tensor_in, with_f32_any,
};
use super::gelu::exp_approx;
use super::linear::{gemm_block, sgemm_strided, Mat};
use crate::simd_dispatch;

struct Attention {
    n_head: usize,
    /// Softmax probabilities (B, nh, T, T) from the forward, for the
    /// backward; in the input's dtype.
    probs: Mutex<Option<CpuStorage>>,
}

#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
}

/// A pointer shared by the (b, h) tasks; each writes its own elements.
#[derive(Clone, Copy)]
struct Out(*mut f32);
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The element `off` places in.
    /// SAFETY: `off` must lie inside the buffer.
    unsafe fn at(self, off: usize) -> *mut f32 {
        unsafe { self.0.add(off) }
    }
}

/// Row i of the causal softmax of `scale * s` (in place, zeros beyond i).
#[inline(always)]
fn softmax_causal_rows(s: &mut [f32], t: usize, scale: f32) {
    for (i, row) in s.chunks_exact_mut(t).enumerate() {
        let (vis, masked) = row.split_at_mut(i + 1);
        let max = max_lanes(vis) * scale;
        vis.iter_mut()
            .for_each(|v| *v = exp_approx(*v * scale - max));
        let inv = 1.0 / sum_lanes(vis);
        vis.iter_mut().for_each(|v| *v *= inv);
        masked.fill(0.0);
    }
}

/// P for head (b, h) of `qkv`, (T, T).
fn head_probs(qkv: &[f32], d: Dims, b: usize, h: usize) -> Vec<f32> {
    let mut p = vec![0f32; d.t * d.t];
    head_probs_into(qkv, d, b, h, &mut p);
    p
}

/// dS = scale * P * (dP - rowsum(P * dP)) in place of dP, row i over
/// columns 0..=i (zeros beyond, so every element is written).
#[inline(always)]
fn softmax_backward_rows(p: &[f32], ds: &mut [f32], t: usize, scale: f32) {
    for i in 0..t {
        let (pr, dr) = (&p[i * t..i * t + i + 1], &mut ds[i * t..(i + 1) * t]);
        let (vis, masked) = dr.split_at_mut(i + 1);
        let dot = dot_lanes(pr, vis);
        vis.iter_mut()
            .zip(pr)
            .for_each(|(d, &p)| *d = scale * p * (*d - dot));
        masked.fill(0.0);
    }
}

/// Query rows per block of the causal products. Smaller blocks skip more
/// of the masked triangle but make smaller, less efficient gemms.
pub const BLOCK: usize = 64;

/// The (start, end) of each block of [`BLOCK`] rows of 0..t.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |i0| (i0, (i0 + BLOCK).min(t)))
}

/// Rows r.. and columns r.. of a (T, T) matrix in `x`, transposed.
fn below_diag_t(x: &[f32], t: usize, r: usize) -> Mat<'_> {
    Mat {
        data: &x[r * t + r..],
        rs: 1,
        cs: t,
    }
}

/// P for head (b, h) into `p` (T, T), every element written.
fn head_probs_into(qkv: &[f32], d: Dims, b: usize, h: usize, p: &mut [f32]) {
    let (t, c3) = (d.t, 3 * d.c);
    let base = b * t * c3 + h * d.hs;
    let kt = Mat {
        data: &qkv[base + d.c..],
        rs: 1,
        cs: c3,
    };
    // S[i0..i1, 0..i1] = q[i0..i1] k[0..i1]^T; the rest of those rows is
    // masked, and the softmax writes its zeros.
    for (i0, i1) in blocks(t) {
        let q = Mat {
            data: &qkv[base + i0 * c3..],
            rs: c3,
            cs: 1,
        };
        sgemm_strided(i1 - i0, i1, d.hs, &mut p[i0 * t..], t, false, q, kt, false);
    }
    simd_dispatch!(softmax_causal_rows(p, t, 1.0 / (d.hs as f32).sqrt()));
}

fn dims_of(l: &Layout, nh: usize) -> Result<Dims> {
    let (b, t, c3) = match *l.dims() {
        [b, t, c3] => (b, t, c3),
        _ => bail!(
            "causal_attention: qkv must be (B, T, 3C), got {:?}",
            l.dims()
        ),
    };
    if nh == 0 || c3 % (3 * nh) != 0 {
        bail!(
            "causal_attention: 3C = {c3} is not divisible by 3 * n_head = {}",
            3 * nh
        )
    }
    let c = c3 / 3;
    Ok(Dims {
        b,
        t,
        c,
        nh,
        hs: c / nh,
    })
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "phalanx-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let qkv = cpu_f32(s, l)?;
        let d = dims_of(l, self.n_head)?;
        let mut y = vec![0f32; d.b * d.t * d.c];
        let mut probs = vec![0f32; d.b * d.nh * d.t * d.t];
        forward_into(&qkv, d, &mut y, &mut probs);
        *self.probs.lock().unwrap() = Some(storage_in(s.dtype(), probs)?);
        Ok((storage_in(s.dtype(), y)?, Shape::from((d.b, d.t, d.c))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let saved = self.probs.lock().unwrap().take();
        let dqkv = with_f32_any(arg, |qkv| {
            with_f32_any(grad, |dy| {
                let d = dims_of(arg.layout(), self.n_head)?;
                backward(qkv, dy, saved.as_ref(), d)
            })
        })???;
        Ok(Some(tensor_in(
            dqkv,
            arg.dtype(),
            arg.shape(),
            arg.device(),
        )?))
    }
}

/// y (B, T, C) and P (B, nh, T, T) from qkv; both fully written.
fn forward_into(qkv: &[f32], d: Dims, y: &mut [f32], probs: &mut [f32]) {
    let (t, c) = (d.t, d.c);
    let (yp, pp) = (Out(y.as_mut_ptr()), Out(probs.as_mut_ptr()));
    assert!(y.len() >= d.b * t * c && probs.len() >= d.b * d.nh * t * t);
    pool_chunked(d.b * d.nh, |tasks| {
        for task in tasks {
            let (b, h) = (task / d.nh, task % d.nh);
            // SAFETY: task (b, h) alone owns probs[b, h], a contiguous (T, T)
            // block inside `probs` (asserted above).
            let p = unsafe { std::slice::from_raw_parts_mut(pp.at(task * t * t), t * t) };
            head_probs_into(qkv, d, b, h, p);
            let v = Mat {
                data: &qkv[b * t * 3 * c + 2 * c + h * d.hs..],
                rs: 3 * c,
                cs: 1,
            };
            // y[b, i0..i1, h*hs..(h+1)*hs] = P[i0..i1, 0..i1] v[0..i1],
            // written in place (row stride C).
            for (i0, i1) in blocks(t) {
                let p = Mat {
                    data: &p[i0 * t..],
                    rs: t,
                    cs: 1,
                };
                // SAFETY: task (b, h) alone writes these elements, and the
                // span (i1 - i0 - 1) C + hs from b T C + i0 C + h hs lies
                // inside `y` (asserted).
                gemm_block(
                    i1 - i0,
                    d.hs,
                    i1,
                    unsafe { yp.at((b * t + i0) * c + h * d.hs) },
                    c,
                    false,
                    p,
                    v,
                );
            }
        }
    });
}

/// The probabilities a backward uses.
enum Probs<'a> {
    /// Kept by the op, in qkv's dtype.
    Stored(&'a CpuStorage),
    /// Kept by a fused block, f32.
    F32(&'a [f32]),
    /// Not kept: recomputed per head.
    Recompute,
}

fn dims_checked(b: usize, t: usize, c: usize, nh: usize) -> Dims {
    assert!(
        nh > 0 && c.is_multiple_of(nh),
        "attention: C = {c}, n_head = {nh}"
    );
    Dims {
        b,
        t,
        c,
        nh,
        hs: c / nh,
    }
}

/// Causal attention over slices, for fused blocks: qkv (B, T, 3C) ->
/// y (B, T, C) and the probabilities (B, nh, T, T) its backward needs.
/// Every element of `y` and `probs` is written.
pub fn attention_forward(
    qkv: &[f32],
    (b, t, c, nh): (usize, usize, usize, usize),
    y: &mut [f32],
    probs: &mut [f32],
) {
    let d = dims_checked(b, t, c, nh);
    assert!(qkv.len() == b * t * 3 * c && y.len() == b * t * c && probs.len() == b * nh * t * t);
    // Attention's products stay f32 in a bf16 layer: they are a few percent
    // of its products, and rounding the probabilities costs the most.
    super::cpu::with_bf16_products(false, || forward_into(qkv, d, y, probs))
}

/// The backward of [`attention_forward`]: dqkv (B, T, 3C), every element
/// written, from dy (B, T, C) and the kept probabilities.
pub fn attention_backward(
    qkv: &[f32],
    dy: &[f32],
    probs: &[f32],
    (b, t, c, nh): (usize, usize, usize, usize),
    dqkv: &mut [f32],
) {
    let d = dims_checked(b, t, c, nh);
    assert!(dy.len() == b * t * c && probs.len() == b * nh * t * t && dqkv.len() == qkv.len());
    super::cpu::with_bf16_products(false, || backward_into(qkv, dy, Probs::F32(probs), d, dqkv))
}

fn backward(qkv: &[f32], dy: &[f32], saved: Option<&CpuStorage>, d: Dims) -> Result<Vec<f32>> {
    if let Some(s) = saved {
        // The dtype is checked here so the tasks below cannot fail.
        storage_f32(s, 0..0)?;
    }
    let mut dqkv = vec![0f32; qkv.len()];
    let probs = saved.map_or(Probs::Recompute, Probs::Stored);
    backward_into(qkv, dy, probs, d, &mut dqkv);
    Ok(dqkv)
}

/// dqkv from dy; every element of `dqkv` is written.
fn backward_into(qkv: &[f32], dy: &[f32], saved: Probs, d: Dims, dqkv: &mut [f32]) {
    let (t, c, hs) = (d.t, d.c, d.hs);
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    assert!(dqkv.len() >= qkv.len() && qkv.len() >= d.b * t * c3);
    let out = Out(dqkv.as_mut_ptr());
    pool_chunked(d.b * d.nh, |tasks| {
        for task in tasks {
            let (b, h) = (task / d.nh, task % d.nh);
            let head = task * t * t..(task + 1) * t * t;
            let p: std::borrow::Cow<[f32]> = match &saved {
                // Borrowed for f32, one head widened for f16 / bf16.
                Probs::Stored(s) => storage_f32(s, head).expect("dtype checked before the tasks"),
                Probs::F32(p) => p[head].into(),
                Probs::Recompute => head_probs(qkv, d, b, h).into(),
            };
            let p = &p[..];
            let base = b * t * c3 + h * hs;
            // Rows r.. of q, k (T, hs) and dy_h; columns r.. of v^T.
            let q = |r: usize| Mat {
                data: &qkv[base + r * c3..],
                rs: c3,
                cs: 1,
            };
            let k = |r: usize| Mat {
                data: &qkv[base + c + r * c3..],
                rs: c3,
                cs: 1,
            };
            let vt = Mat {
                data: &qkv[base + 2 * c..],
                rs: 1,
                cs: c3,
            };
            let dyh = |r: usize| Mat {
                data: &dy[(b * t + r) * c + h * hs..],
                rs: c,
                cs: 1,
            };
            // dP[i0..i1, 0..i1] = dy_h[i0..i1] v[0..i1]^T, then dS in place
            // (zeros beyond the diagonal, so every element is written).
            let mut ds = vec![0f32; t * t];
            for (i0, i1) in blocks(t) {
                sgemm_strided(
                    i1 - i0,
                    i1,
                    hs,
                    &mut ds[i0 * t..],
                    t,
                    false,
                    dyh(i0),
                    vt,
                    false,
                );
            }
            simd_dispatch!(softmax_backward_rows(p, &mut ds, t, scale));
            // By blocks of rows r0..r1 of dv, dq and dk (T, hs), each written
            // in place into its columns of dqkv (row stride 3C):
            //   dv[r0..r1] = P[r0..T, r0..r1]^T dy_h[r0..T]   (P[i, j] = 0, j > i)
            //   dq[r0..r1] = dS[r0..r1, 0..r1] k[0..r1]
            //   dk[r0..r1] = dS[r0..T, r0..r1]^T q[r0..T]
            // SAFETY: task (b, h) alone writes columns h*hs.. of q, k and v
            // in row block b; each span lies inside dqkv (asserted above).
            let mm = |off: usize, m: usize, kk: usize, a: Mat, b: Mat| {
                gemm_block(m, hs, kk, unsafe { out.at(off) }, c3, false, a, b)
            };
            for (r0, r1) in blocks(t) {
                let (m, below) = (r1 - r0, t - r0);
                mm(
                    base + 2 * c + r0 * c3,
                    m,
                    below,
                    below_diag_t(p, t, r0),
                    dyh(r0),
                );
                let ds_rows = Mat {
                    data: &ds[r0 * t..],
                    rs: t,
                    cs: 1,
                };
                mm(base + r0 * c3, m, r1, ds_rows, k(0));
                mm(
                    base + c + r0 * c3,
                    m,
                    below,
                    below_diag_t(&ds, t, r0),
                    q(r0),
                );
            }
        }
    });
}

/// Causal self-attention of `qkv` (B, T, 3C) = [q | k | v] with `n_head`
/// heads; returns (B, T, C), heads concatenated, in qkv's dtype. f32, f16
/// or bf16 on CPU.
pub fn causal_attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    if !is_float(qkv.dtype()) {
        bail!(
            "causal_attention: f32, f16 or bf16 only (got {:?})",
            qkv.dtype()
        )
    }
    if !super::host_kernels(qkv.device()) {
        return composed(qkv, n_head);
    }
    qkv.contiguous()?.apply_op1(Attention {
        n_head,
        probs: Mutex::new(None),
    })
}

/// The same attention from candle's ops (the device-generic path: what a
/// CUDA device runs): per head `softmax(q k^T / sqrt(d) + mask) v`, the
/// softmax in f32, the products in qkv's dtype.
fn composed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    let Dims { b, t, c, hs: d, .. } = dims_of(qkv.layout(), n_head)?;
    // (B, T, C) -> (B, H, T, d)
    let heads = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, n_head, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
    // fp16 scores can pass 65504 (inf, and NaN beside the mask): they are
    // taken in f32, as the CPU kernel takes them.
    let (q, k) = match qkv.dtype() {
        DType::F16 => (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?),
        _ => (q, k),
    };
    let s = q.matmul(&k.t()?.contiguous()?)?; // (B, H, T, T)
    let p = super::softmax::composed_causal(&s, 1.0 / (d as f32).sqrt())?;
    // (B, H, T, d) -> (B, T, C)
    p.to_dtype(v.dtype())?
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((b, t, c))
}
