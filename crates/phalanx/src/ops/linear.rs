//! `y = x @ w^T + b` as one op (llm.c's matmul_forward / matmul_backward),
//! calling the `gemm` crate directly:
//!
//!   forward:  y (N, out) = b + x (N, in) . w^T          N = all leading dims of x
//!   backward: dx = dy . w;   dw = dy^T . x;   db = sum_rows(dy)
//!
//! Why: candle records a linear layer as reshape, transpose, matmul,
//! broadcast-add and reshape; its backward then allocates a zeroed gradient
//! and adds into it for each of those nodes (five full-size passes or more).
//! One node here: three gemms backward, nothing else.
//!
//! f16 / bf16: x, w and b are widened to f32 at the kernel boundary (the
//! widened weight costs O(out * in), small next to the O(N * out * in)
//! product), the gemm accumulates in f32, and y is narrowed to x's dtype;
//! dx, dw and db come back in the dtypes of x, w and b. f32 copies nothing.
//! Where both operands of a product are bf16 and the CPU has AVX512-BF16,
//! the product runs on its bf16 instructions (`gemm_bf16`: the same exact
//! products, f32 sums, about 1.7-2x the f32 gemm's speed).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let x = Tensor::new(&[[[1f32, 2.]]], &dev).unwrap();            // (1, 1, 2)
//! let w = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &dev).unwrap(); // (3, 2)
//! let b = Tensor::new(&[0f32, 10., 100.], &dev).unwrap();
//! let y = phalanx::ops::linear(&x, &w, Some(&b)).unwrap();
//! assert_eq!(y.to_vec3::<f32>().unwrap(), vec![vec![vec![1., 12., 103.]]]);
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::cpu::{
    cpu_f32, is_float, pool_chunked, pool_threads, storage_in, tensor_in, with_bf16_products,
    with_f32_any,
};
use super::tape;

/// Row-major (rs = row stride, cs = column stride) view of a matrix in a slice.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// Asserts that every view holds its (m, n, k) span, and does what a
/// product with nothing to sum does (k = 0 zeroes dst unless
/// accumulating); returns whether a product remains to compute.
#[allow(clippy::too_many_arguments)]
pub(super) fn checked(
    what: &str,
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
) -> bool {
    assert!(dst.len() >= span(m, n, dst_rs, 1), "{what}: dst too small");
    assert!(
        a.data.len() >= span(m, k, a.rs, a.cs),
        "{what}: lhs too small"
    );
    assert!(
        b.data.len() >= span(k, n, b.rs, b.cs),
        "{what}: rhs too small"
    );
    if k == 0 && !accumulate && m > 0 && n > 0 {
        dst.chunks_mut(dst_rs)
            .take(m)
            .for_each(|r| r[..n].fill(0.0));
    }
    m > 0 && n > 0 && k > 0
}

fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `dst (m, n) = [dst +] a (m, k) . b (k, n)`, dst row-major contiguous.
pub fn sgemm(m: usize, n: usize, k: usize, dst: &mut [f32], accumulate: bool, a: Mat, b: Mat) {
    sgemm_strided(m, n, k, dst, n, accumulate, a, b, true)
}

/// As [`sgemm`] with a destination row stride `dst_rs` (columns contiguous),
/// and a choice of threading (`par`: use candle's thread count when big).
/// Bounds are checked here, so the unsafe gemm call only sees valid memory.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
    par: bool,
) {
    if !checked("sgemm", (m, n, k), dst, dst_rs, accumulate, a, b) {
        return;
    }
    // The pool's workers plus the calling thread (CANDLE_NUM_THREADS).
    let threads = pool_threads();
    // Small products are not worth waking the pool for.
    if !par || threads < 2 || m < 2 * 16 || m * n * k < 1 << 18 {
        gemm_block(m, n, k, dst.as_mut_ptr(), dst_rs, accumulate, a, b);
        return;
    }
    // Split the output rows over candle's barrier pool rather than gemm's
    // rayon pool: one pool means no two sets of workers spinning for the
    // same cores (which made 2 threads slower than 1 on a 2-core machine).
    let chunk = m.div_ceil(threads * 2).next_multiple_of(16);
    let n_chunks = m.div_ceil(chunk);
    let dst_ptr = DstPtr(dst.as_mut_ptr());
    pool_chunked(n_chunks, |chunks| {
        let p = dst_ptr;
        for ci in chunks {
            let (r0, r1) = (ci * chunk, ((ci + 1) * chunk).min(m));
            let a_rows = Mat {
                data: &a.data[r0 * a.rs..],
                ..a
            };
            // SAFETY: rows r0..r1 of dst belong to this chunk only, and lie
            // inside dst (its span was asserted above).
            gemm_block(
                r1 - r0,
                n,
                k,
                unsafe { p.0.add(r0 * dst_rs) },
                dst_rs,
                accumulate,
                a_rows,
                b,
            );
        }
    });
}

#[derive(Clone, Copy)]
struct DstPtr(*mut f32);
unsafe impl Send for DstPtr {}
unsafe impl Sync for DstPtr {}

/// One single-threaded gemm call; `dst` must be valid for the (m, n, dst_rs) span.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_block(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
) {
    assert!(a.data.len() >= span(m, k, a.rs, a.cs) && b.data.len() >= span(k, n, b.rs, b.cs));
    if super::cpu::bf16_products() {
        // SAFETY: the callers guarantee dst is valid for the (m, n, dst_rs) span.
        let d = unsafe { std::slice::from_raw_parts_mut(dst, span(m, n, dst_rs, 1)) };
        return super::gemm_bf16::gemm(m, n, k, d, dst_rs, accumulate, a, b);
    }
    // SAFETY: lhs/rhs spans checked here, dst by the callers.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Whether a product's two operands are both bf16 values: its products
/// then run on the CPU's bf16 instructions where it has them (exact
/// products, f32 sums; only the order of the sums changes).
fn both_bf16(a: candle_core::DType, b: candle_core::DType) -> bool {
    a == candle_core::DType::BF16 && b == candle_core::DType::BF16
}

/// (rows, in, out) of a linear on x with weight w (out, in).
pub(crate) fn dims(x: &Layout, w: &Layout) -> Result<(usize, usize, usize)> {
    let (wd, xd) = (w.dims(), x.dims());
    if wd.len() != 2 || xd.is_empty() || xd[xd.len() - 1] != wd[1] {
        bail!(
            "linear: x {:?} and weight {:?} (out, in) do not match",
            xd,
            wd
        )
    }
    Ok((x.shape().elem_count() / wd[1], wd[1], wd[0]))
}

pub(crate) fn out_shape(x: &Layout, out: usize) -> Shape {
    let mut d = x.dims().to_vec();
    let last = d.len() - 1;
    d[last] = out;
    Shape::from(d)
}

pub(crate) fn forward(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    (rows, k, n): (usize, usize, usize),
) -> Vec<f32> {
    let mut y = vec![0f32; rows * n];
    linear_forward(x, w, b, (rows, k, n), &mut y);
    y
}

/// `y (rows, n) = x (rows, k) . w^T + b` over slices, w (n, k): every
/// element of `y` is written (no need to zero it).
pub fn linear_forward(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    (rows, k, n): (usize, usize, usize),
    y: &mut [f32],
) {
    assert!(y.len() == rows * n && b.is_none_or(|b| b.len() == n));
    if let Some(b) = b {
        y.chunks_exact_mut(n).for_each(|r| r.copy_from_slice(b));
    }
    // w^T (in, out) as a strided view of w (out, in).
    let a = Mat {
        data: x,
        rs: k,
        cs: 1,
    };
    let wt = Mat {
        data: w,
        rs: 1,
        cs: k,
    };
    sgemm(rows, n, k, y, b.is_some(), a, wt);
}

/// Gradients of a linear: dx = dy w, dw = dy^T x, db = sum(dy). Each is
/// computed only where its input takes part in autograd (`track_op`): the
/// zero-bubble schedule's input pass (B) holds the weights constant and its
/// weight pass (W) needs no input gradient. While a [`tape`] records (B), the
/// constant weight's gradient is deferred to it instead of dropped.
fn backward(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let b_tracked = b.filter(|b| b.track_op());
    defer_constant_weights(x, w, b, dy);
    Ok((
        x.track_op().then(|| input_grad(x, w, dy)).transpose()?,
        w.track_op().then(|| weight_grad(x, w, dy)).transpose()?,
        b_tracked.map(|b| bias_grad(b, dy)).transpose()?,
    ))
}

/// While a tape records (the zero-bubble input pass), hands it the weight
/// and bias gradients of a linear on `x` whose weight or bias is a constant.
pub(crate) fn defer_constant_weights(x: &Tensor, w: &Tensor, b: Option<&Tensor>, dy: &Tensor) {
    if !tape::active() {
        return;
    }
    let defer_w = !w.track_op();
    let defer_b = b.filter(|b| !b.track_op());
    if defer_w || defer_b.is_some() {
        tape::defer(Box::new(LinearGrads {
            x: x.clone(),
            w: defer_w.then(|| w.clone()),
            b: defer_b.cloned(),
            dy: dy.clone(),
        }));
    }
}

/// dx (rows, in) = dy (rows, out) . w (out, in), in x's dtype.
fn input_grad(x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (k, n) = (w.dim(1)?, w.dim(0)?);
    let rows = x.elem_count() / k;
    let bf16 = both_bf16(w.dtype(), dy.dtype());
    let dx = with_f32_any(w, |w| {
        with_f32_any(dy, |dy| {
            let mut dx = vec![0f32; rows * k];
            with_bf16_products(bf16, || linear_backward_input(dy, w, (rows, k, n), &mut dx));
            dx
        })
    })??;
    tensor_in(dx, x.dtype(), x.shape(), x.device())
}

/// dw (out, in) = dy^T (out, rows) . x (rows, in), in w's dtype.
fn weight_grad(x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (k, n) = (w.dim(1)?, w.dim(0)?);
    let rows = x.elem_count() / k;
    let bf16 = both_bf16(x.dtype(), dy.dtype());
    let dw = with_f32_any(x, |x| {
        with_f32_any(dy, |dy| {
            let mut dw = vec![0f32; n * k];
            with_bf16_products(bf16, || {
                linear_backward_weight(x, dy, (rows, k, n), &mut dw)
            });
            dw
        })
    })??;
    tensor_in(dw, w.dtype(), w.shape(), w.device())
}

/// db (out,) = the sum of dy's rows, in b's dtype.
fn bias_grad(b: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let n = b.elem_count();
    let db = with_f32_any(dy, |dy| {
        let mut db = vec![0f32; n];
        linear_backward_bias(dy, &mut db);
        db
    })?;
    tensor_in(db, b.dtype(), n, b.device())
}

/// Over slices, for fused blocks: dx (rows, k) = dy (rows, n) . w (n, k);
/// every element of `dx` is written.
pub fn linear_backward_input(
    dy: &[f32],
    w: &[f32],
    (rows, k, n): (usize, usize, usize),
    dx: &mut [f32],
) {
    backward_input_into(dy, w, (rows, k, n), dx, false)
}

/// [`linear_backward_input`] added into `dx` (`dx += dy w`): the input
/// gradient of a tensor that feeds several linears.
pub fn linear_backward_input_acc(
    dy: &[f32],
    w: &[f32],
    (rows, k, n): (usize, usize, usize),
    dx: &mut [f32],
) {
    backward_input_into(dy, w, (rows, k, n), dx, true)
}

fn backward_input_into(
    dy: &[f32],
    w: &[f32],
    (rows, k, n): (usize, usize, usize),
    dx: &mut [f32],
    accumulate: bool,
) {
    assert_eq!(dx.len(), rows * k);
    let g = Mat {
        data: dy,
        rs: n,
        cs: 1,
    };
    let w = Mat {
        data: w,
        rs: k,
        cs: 1,
    };
    sgemm(rows, k, n, dx, accumulate, g, w);
}

/// Over slices: dw (n, k) = dy^T (n, rows) . x (rows, k); every element
/// of `dw` is written.
pub fn linear_backward_weight(
    x: &[f32],
    dy: &[f32],
    (rows, k, n): (usize, usize, usize),
    dw: &mut [f32],
) {
    assert_eq!(dw.len(), n * k);
    weight_rows_into(x, dy, (rows, k, n), 0, dw, false)
}

/// Output rows `o0..o0 + dw.len() / k` of [`linear_backward_weight`]'s dw
/// added into `dw` (`dw += dy^T x` over those rows), each element summed
/// over all `rows` exactly as there (a thread's share of the product's
/// output rows): a weight gradient written straight into the flat gradient
/// buffer, with no temporary to zero and add.
pub fn linear_backward_weight_rows_acc(
    x: &[f32],
    dy: &[f32],
    dims: (usize, usize, usize),
    o0: usize,
    dw: &mut [f32],
) {
    weight_rows_into(x, dy, dims, o0, dw, true)
}

/// Output rows `o0..` of dw = dy^T x into `dw`: overwritten, or added to
/// with `accumulate`.
fn weight_rows_into(
    x: &[f32],
    dy: &[f32],
    (rows, k, n): (usize, usize, usize),
    o0: usize,
    dw: &mut [f32],
    accumulate: bool,
) {
    assert!(dw.len().is_multiple_of(k) && o0 + dw.len() / k <= n);
    let gt = Mat {
        data: &dy[o0..],
        rs: 1,
        cs: n,
    };
    let x = Mat {
        data: x,
        rs: k,
        cs: 1,
    };
    sgemm(dw.len() / k, k, rows, dw, accumulate, gt, x);
}

/// Over slices: db (n,) = the sum of the rows of dy (rows, n); `db` is
/// overwritten.
pub fn linear_backward_bias(dy: &[f32], db: &mut [f32]) {
    super::cpu::sum_rows(dy, db)
}

/// Columns `o0..o0 + db.len()` of [`linear_backward_bias`]'s db, of dy
/// (rows, n), summed as there; `db` is overwritten.
pub fn linear_backward_bias_cols(dy: &[f32], n: usize, o0: usize, db: &mut [f32]) {
    super::cpu::sum_rows_of_cols(dy, n, o0, db)
}

/// A linear's weight (and bias) gradient, postponed to the W pass.
struct LinearGrads {
    x: Tensor,
    w: Option<Tensor>,
    b: Option<Tensor>,
    dy: Tensor,
}

impl tape::DeferredGrad for LinearGrads {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(2);
        if let Some(w) = &self.w {
            out.push((w.clone(), weight_grad(&self.x, w, &self.dy)?));
        }
        if let Some(b) = &self.b {
            out.push((b.clone(), bias_grad(b, &self.dy)?));
        }
        Ok(out)
    }

    fn kept(&self) -> Vec<&Tensor> {
        vec![&self.x, &self.dy]
    }
}

struct LinearBias;
struct LinearNoBias;

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "phalanx-linear"
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
        let d = dims(l1, l2)?;
        let (x, w, b) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?, cpu_f32(s3, l3)?);
        let y = with_bf16_products(both_bf16(s1.dtype(), s2.dtype()), || {
            forward(&x, &w, Some(&b), d)
        });
        Ok((storage_in(s1.dtype(), y)?, out_shape(l1, d.2)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        backward(x, w, Some(b), dy)
    }
}

impl CustomOp2 for LinearNoBias {
    fn name(&self) -> &'static str {
        "phalanx-linear-nobias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::ops::kernel_ran();
        let d = dims(l1, l2)?;
        let (x, w) = (cpu_f32(s1, l1)?, cpu_f32(s2, l2)?);
        let y = with_bf16_products(both_bf16(s1.dtype(), s2.dtype()), || {
            forward(&x, &w, None, d)
        });
        Ok((storage_in(s1.dtype(), y)?, out_shape(l1, d.2)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = backward(x, w, None, dy)?;
        Ok((dx, dw))
    }
}

/// `x @ w^T + b` for x (.., in), w (out, in), b (out,): a candle-nn `Linear`
/// as one op. f32, f16 or bf16 on CPU (any mix; y in x's dtype); elsewhere
/// candle's matmul.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let float = is_float(x.dtype()) && is_float(w.dtype()) && b.is_none_or(|b| is_float(b.dtype()));
    if !super::host_kernels(x.device()) || !float {
        let lin = candle_nn::Linear::new(w.clone(), b.cloned());
        return candle_core::Module::forward(&lin, x);
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => {
            if b.dims() != [w.dim(0)?] {
                bail!("linear: bias {:?} for weight {:?}", b.shape(), w.shape())
            }
            x.apply_op3(&w, &b.contiguous()?, LinearBias)
        }
        None => x.apply_op2(&w, LinearNoBias),
    }
}
