//! CPU plumbing for the fused ops and the engine: borrowing a tensor's f32
//! data, splitting row loops over candle's thread pool, and compiling hot
//! loops for AVX-512 / AVX2 with a run-time check (the binary still runs on
//! machines without them).
//!
//! Mixed precision: the fused ops keep f16 / bf16 tensors in half precision
//! (what autograd stores) but compute in f32. [`cpu_f32`] and
//! [`with_f32_any`] borrow f32 data and widen half data into a temporary;
//! [`storage_in`] and [`tensor_in`] narrow an f32 result to the caller's
//! dtype. The f32 path copies nothing extra.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let t = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
//! let s = phalanx::ops::cpu::with_f32(&t.t().unwrap(), |s| s.to_vec()).unwrap();
//! assert_eq!(s, vec![1., 3., 2., 4.]); // made contiguous first
//! ```

use std::borrow::Cow;
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Call `f` with the tensor's elements as one contiguous f32 slice (row-major).
/// Borrows CPU storage when contiguous; copies otherwise (or off-CPU).
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() != DType::F32 {
        bail!("expected an f32 tensor, got {:?}", t.dtype())
    }
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => Ok(f(cpu_slice(cpu, layout)?)),
        _ => {
            drop(storage);
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(f(&v))
        }
    }
}

/// The f32 elements of a contiguous CPU storage under `layout`.
pub fn cpu_slice<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let s = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((lo, hi)) => Ok(&s[lo..hi]),
        None => bail!("expected a contiguous tensor"),
    }
}

#[inline(always)]
fn bf16_widen_kernel(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

#[inline(always)]
fn bf16_narrow_kernel(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        // Round to nearest, ties to even; NaNs stay (quiet) NaNs.
        let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
        let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
        let h = if nan { (b >> 16) | 0x0040 } else { rounded };
        *d = bf16::from_bits(h as u16);
    }
}

/// bf16 -> f32 (exact), vectorised (AVX-512 / AVX2 at run time). The
/// `half` crate's slice conversions go element by element for bf16; f16
/// uses theirs (F16C instructions).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_to_f32: lengths");
    crate::simd_dispatch!(bf16_widen_kernel(src, dst))
}

/// f32 -> bf16, rounded to nearest even (bit-identical to `bf16::from_f32`),
/// vectorised.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16: lengths");
    crate::simd_dispatch!(bf16_narrow_kernel(src, dst))
}

/// f16 -> f32 (exact), 16 at a time with AVX-512 where the CPU has it
/// (the `half` crate's slice conversion goes 8 at a time through a call
/// each, F16C); the f16 twin of [`bf16_to_f32`].
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F; the lengths are equal.
        return unsafe { f16_widen_avx512(src, dst) };
    }
    src.convert_to_f32_slice(dst)
}

/// f32 -> f16, rounded to nearest even (bit-identical to `f16::from_f32`:
/// the same conversion instruction, 16 at a time with AVX-512); the f16
/// twin of [`f32_to_bf16`].
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F; the lengths are equal.
        return unsafe { f16_narrow_avx512(src, dst) };
    }
    dst.convert_from_f32_slice(src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f16_widen_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: elements i..i + 16 lie in both slices.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    src[n..].convert_to_f32_slice(&mut dst[n..]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f16_narrow_avx512(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::{
        __m256i, _mm256_storeu_si256, _mm512_cvtps_ph, _mm512_loadu_ps, _MM_FROUND_NO_EXC,
        _MM_FROUND_TO_NEAREST_INT,
    };
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: elements i..i + 16 lie in both slices.
        unsafe {
            let h = _mm512_cvtps_ph::<RNE>(_mm512_loadu_ps(src.as_ptr().add(i)));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        }
    }
    dst[n..].convert_from_f32_slice(&src[n..]);
}

/// Whether the fused ops take this dtype on CPU: f32, or f16 / bf16 (widened
/// to f32 inside the kernels).
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Elements `range` of a CPU storage as f32: borrowed for F32, widened into
/// a new buffer for F16 / BF16 (vectorised conversions of the `half` crate).
pub fn storage_f32(storage: &CpuStorage, range: Range<usize>) -> Result<Cow<'_, [f32]>> {
    Ok(match storage {
        CpuStorage::F32(v) => Cow::Borrowed(&v[range]),
        CpuStorage::F16(v) => {
            let src = &v[range];
            let mut out = vec![0f32; src.len()];
            src.convert_to_f32_slice(&mut out);
            Cow::Owned(out)
        }
        CpuStorage::BF16(v) => {
            let src = &v[range];
            let mut out = vec![0f32; src.len()];
            bf16_to_f32(src, &mut out);
            Cow::Owned(out)
        }
        s => bail!("expected an f32, f16 or bf16 tensor, got {:?}", s.dtype()),
    })
}

/// The elements of a contiguous CPU storage under `layout` as f32 (see
/// [`storage_f32`]): the kernel-boundary widening of the half-precision ops.
pub fn cpu_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    match layout.contiguous_offsets() {
        Some((lo, hi)) => storage_f32(storage, lo..hi),
        None => bail!("expected a contiguous tensor"),
    }
}

/// As [`with_f32`] for f32, f16 or bf16 tensors: f32 data is borrowed, half
/// data widened into a temporary f32 buffer.
pub fn with_f32_any<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() == DType::F32 {
        return with_f32(t, f);
    }
    if !is_float(t.dtype()) {
        bail!("expected an f32, f16 or bf16 tensor, got {:?}", t.dtype())
    }
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => Ok(f(&cpu_f32(cpu, layout)?)),
        _ => {
            drop(storage);
            let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(f(&v))
        }
    }
}

/// Narrow an f32 result to `dtype` (f32: moved, no copy; f16 / bf16: rounded
/// to nearest, vectorised).
pub fn storage_in(dtype: DType, v: Vec<f32>) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => {
            let mut out = vec![f16::ZERO; v.len()];
            out.convert_from_f32_slice(&v);
            CpuStorage::F16(out)
        }
        DType::BF16 => {
            let mut out = vec![bf16::ZERO; v.len()];
            f32_to_bf16(&v, &mut out);
            CpuStorage::BF16(out)
        }
        d => bail!("cannot narrow f32 results to {d:?}"),
    })
}

/// A CPU tensor of `dtype` from f32 values (see [`storage_in`]); for the
/// gradients the backward passes return in their forward input's dtype.
pub fn tensor_in(
    v: Vec<f32>,
    dtype: DType,
    shape: impl Into<Shape>,
    dev: &Device,
) -> Result<Tensor> {
    tensor_of(storage_in(dtype, v)?, shape, dev)
}

/// A tensor holding a float CPU storage (f32, f16 or bf16) built by a kernel.
pub fn tensor_of(s: CpuStorage, shape: impl Into<Shape>, dev: &Device) -> Result<Tensor> {
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, dev),
        s => bail!("expected an f32, f16 or bf16 storage, got {:?}", s.dtype()),
    }
}

/// A contiguous run of f32, f16 or bf16 elements, read as f32 one range at
/// a time: for kernels that go row by row and should not widen a whole
/// half tensor at once (cross-entropy's (N, V) logits).
#[derive(Clone, Copy)]
pub enum FloatSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> FloatSlice<'a> {
    /// The elements of a contiguous CPU storage under `layout`.
    pub fn new(storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let Some((lo, hi)) = layout.contiguous_offsets() else {
            bail!("expected a contiguous tensor")
        };
        Ok(match storage {
            CpuStorage::F32(v) => Self::F32(&v[lo..hi]),
            CpuStorage::F16(v) => Self::F16(&v[lo..hi]),
            CpuStorage::BF16(v) => Self::BF16(&v[lo..hi]),
            s => bail!("expected an f32, f16 or bf16 tensor, got {:?}", s.dtype()),
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::BF16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `r` as f32: borrowed for f32, otherwise widened into the
    /// front of `buf` (which must hold `r.len()` elements).
    pub fn get<'b>(&'b self, r: Range<usize>, buf: &'b mut [f32]) -> &'b [f32] {
        let out = &mut buf[..r.len()];
        match self {
            Self::F32(v) => return &v[r],
            Self::F16(v) => v[r].convert_to_f32_slice(out),
            Self::BF16(v) => bf16_to_f32(&v[r], out),
        }
        out
    }
}

/// `n_rows` rows of `row_len` computed in f32 by `f(row, out_row)` (which
/// must write the whole row) and stored in `dtype`, in parallel: written in
/// place for f32, through one f32 scratch row per thread chunk for f16 /
/// bf16, so no full-size f32 buffer exists.
pub fn rows_in(
    dtype: DType,
    n_rows: usize,
    row_len: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<CpuStorage> {
    fn half_rows<T: Send + Copy>(
        zero: T,
        narrow: fn(&[f32], &mut [T]),
        n_rows: usize,
        row_len: usize,
        f: &(impl Fn(usize, &mut [f32]) + Sync),
    ) -> Vec<T> {
        let mut out = vec![zero; n_rows * row_len];
        par_rows(&mut out, row_len, |rows, out| {
            let mut row = vec![0f32; row_len];
            for (r, o) in rows.zip(out.chunks_exact_mut(row_len)) {
                f(r, &mut row);
                narrow(&row, o);
            }
        });
        out
    }
    Ok(match dtype {
        DType::F32 => {
            let mut out = vec![0f32; n_rows * row_len];
            par_rows(&mut out, row_len, |rows, out| {
                for (r, o) in rows.zip(out.chunks_exact_mut(row_len)) {
                    f(r, o);
                }
            });
            CpuStorage::F32(out)
        }
        DType::F16 => {
            let narrow = |s: &[f32], d: &mut [f16]| d.convert_from_f32_slice(s);
            CpuStorage::F16(half_rows(f16::ZERO, narrow, n_rows, row_len, &f))
        }
        DType::BF16 => CpuStorage::BF16(half_rows(bf16::ZERO, f32_to_bf16, n_rows, row_len, &f)),
        d => bail!("cannot store f32 rows as {d:?}"),
    })
}

/// The u32 elements of a contiguous CPU storage under `layout`.
pub fn cpu_slice_u32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [u32]> {
    let s = storage.as_slice::<u32>()?;
    match layout.contiguous_offsets() {
        Some((lo, hi)) => Ok(&s[lo..hi]),
        None => bail!("expected a contiguous tensor"),
    }
}

/// Lanes of the partial reductions below: 16 = one AVX-512 register of f32.
/// Float reductions only vectorise when written with independent partial
/// accumulators (the compiler may not reassociate a serial sum).
const LANES: usize = 16;

/// Sum of a slice with 16 partial sums.
#[inline(always)]
pub fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Dot product with 16 partial sums.
#[inline(always)]
pub fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Maximum of a slice (-inf for an empty one) with 16 partial maxima.
#[inline(always)]
pub fn max_lanes(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for i in 0..LANES {
            acc[i] = acc[i].max(c[i]);
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

#[inline(always)]
fn add_kernel(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

/// `a += b`, elementwise, at the CPU's vector width.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "add_assign: lengths differ");
    crate::simd_dispatch!(add_kernel(a, b))
}

/// `out = sum over rows of x` (rows of `out.len()`), at the CPU's vector width.
pub fn sum_rows(x: &[f32], out: &mut [f32]) {
    sum_rows_of_cols(x, out.len(), 0, out)
}

/// `out = sum over rows of x[:, c0..c0 + out.len()]`, x in rows of
/// `row_len`, the rows added in order; at the CPU's vector width.
pub fn sum_rows_of_cols(x: &[f32], row_len: usize, c0: usize, out: &mut [f32]) {
    #[inline(always)]
    fn kernel(x: &[f32], row_len: usize, c0: usize, out: &mut [f32]) {
        out.fill(0.0);
        for r in x.chunks_exact(row_len) {
            add_kernel(out, &r[c0..c0 + out.len()]);
        }
    }
    if out.is_empty() {
        return;
    }
    assert!(
        c0 + out.len() <= row_len,
        "sum_rows_of_cols: columns past the row"
    );
    crate::simd_dispatch!(kernel(x, row_len, c0, out))
}

/// A raw pointer that may cross threads: each thread writes a disjoint range.
struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Below this many elements, threading costs more than it saves.
const PAR_MIN: usize = 1 << 15;

thread_local! {
    /// Set while this thread runs one part of [`par_parts`].
    static IN_PART: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set while this thread's matrix products run in bf16 ([`with_bf16_products`]).
    static BF16_PRODUCTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread's matrix products (`sgemm` and the gemms under
/// it; attention opts out) take bf16 operands on the CPU's bf16 instructions: inside
/// [`with_bf16_products`], and carried into the pool work it starts.
pub fn bf16_products() -> bool {
    BF16_PRODUCTS.with(|b| b.get())
}

/// Runs `f` with this thread's matrix products in bf16 (f32 sums) when
/// `on` and the CPU has AVX512-BF16 ([`super::gemm_bf16::available`]),
/// else in f32: what a bf16 layer's products round their operands to, as
/// `autocast(bfloat16)` does. The pool work `f` starts ([`par_parts`],
/// the kernels' chunks) runs under the same setting.
pub fn with_bf16_products<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let _restore = Bf16Scope::set(on && super::gemm_bf16::available());
    f()
}

/// `f` over chunks of `0..n` on candle's pool, each chunk under the
/// caller's [`bf16_products`] setting (a thread-local the workers would
/// not see otherwise).
fn on_pool(n: usize, f: impl Fn(Range<usize>) + Sync) {
    let bf16 = bf16_products();
    candle_core::utils::barrier_pool().execute_chunked(n, |r| {
        let _scope = Bf16Scope::set(bf16);
        f(r)
    })
}

/// Sets [`BF16_PRODUCTS`] for a scope; restored on drop (unwind too).
struct Bf16Scope(bool);
impl Bf16Scope {
    fn set(on: bool) -> Self {
        Bf16Scope(BF16_PRODUCTS.with(|b| b.replace(on)))
    }
}
impl Drop for Bf16Scope {
    fn drop(&mut self) {
        BF16_PRODUCTS.with(|b| b.set(self.0));
    }
}

/// Threads a kernel may split over: candle's pool workers plus the calling
/// thread (`CANDLE_NUM_THREADS`), or 1 inside a part of [`par_parts`].
pub fn pool_threads() -> usize {
    if IN_PART.with(|p| p.get()) {
        1
    } else {
        candle_core::utils::barrier_pool().n_workers() + 1
    }
}

/// `f` over chunks of `0..n_items` on candle's pool; inline inside a part
/// of [`par_parts`] (that thread is the part's only one).
pub(crate) fn pool_chunked(n_items: usize, f: impl Fn(Range<usize>) + Sync) {
    if IN_PART.with(|p| p.get()) {
        f(0..n_items)
    } else {
        on_pool(n_items, f)
    }
}

/// Runs `f(i)` for each part `i` in `0..parts` in parallel on candle's
/// pool, and every kernel `f` calls serially on the thread running its
/// part: one parallel region for a whole block of work (a fused layer's
/// pass over its share of the batch) instead of one per kernel, so no
/// core idles in the serial passes between kernels and nobody waits at
/// a barrier after each. Use `parts` = [`pool_threads`] for one each; a
/// single part is the whole work, whose kernels split it as usual.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// let sum = AtomicUsize::new(0);
/// phalanx::ops::cpu::par_parts(4, |i| {
///     assert_eq!(phalanx::ops::cpu::pool_threads(), 1); // kernels run serially
///     sum.fetch_add(i, Ordering::Relaxed);
/// });
/// assert_eq!(sum.into_inner(), 6);
/// ```
pub fn par_parts(parts: usize, f: impl Fn(usize) + Sync) {
    let run = |i: usize| {
        let was = IN_PART.with(|p| p.replace(true));
        // Restored on unwind too, so a panicking part leaves no stale flag.
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                IN_PART.with(|p| p.set(self.0));
            }
        }
        let _restore = Restore(was);
        f(i)
    };
    if parts == 1 {
        // The whole work: its kernels may split it themselves.
        f(0);
    } else if parts == 0 || IN_PART.with(|p| p.get()) {
        (0..parts).for_each(run);
    } else {
        on_pool(parts, |r| r.for_each(run));
    }
}

/// Run `f(rows, out_rows)` over `out` split into rows of `row_len`, in
/// parallel on candle's thread pool when the work is large enough.
pub fn par_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [T]) + Sync,
) {
    let n_rows = out.len().checked_div(row_len).unwrap_or(0);
    if out.len() < PAR_MIN || n_rows < 2 {
        f(0..n_rows, out);
        return;
    }
    let ptr = SendPtr(out.as_mut_ptr());
    pool_chunked(n_rows, |rows| {
        let p = ptr;
        // SAFETY: the pool hands out disjoint row ranges within `out`.
        let chunk = unsafe {
            std::slice::from_raw_parts_mut(p.0.add(rows.start * row_len), rows.len() * row_len)
        };
        f(rows, chunk)
    });
}

/// Per-chunk partial sums of a [`par_rows`] pass (a norm's gain and bias
/// gradients), added in row order at the end: float addition is not
/// associative, and adding them as threads finish would make the sum, and
/// the training run, depend on timing. (The chunks are fixed for a given
/// row count and thread count.)
pub struct RowSums(std::sync::Mutex<Vec<(usize, Vec<f32>)>>);

impl Default for RowSums {
    fn default() -> Self {
        Self::new()
    }
}

impl RowSums {
    pub fn new() -> RowSums {
        RowSums(std::sync::Mutex::new(Vec::new()))
    }

    /// The sums of the chunk whose rows start at `start`: the vectors of
    /// [`RowSums::add_into`]'s `outs`, one after the other.
    pub fn push(&self, start: usize, sums: Vec<f32>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, sums));
    }

    /// Add every chunk's sums into `outs`, in row order.
    pub fn add_into(self, outs: &mut [&mut [f32]]) {
        let mut parts = self.0.into_inner().unwrap_or_else(|e| e.into_inner());
        parts.sort_by_key(|p| p.0);
        for (_, v) in &parts {
            let mut at = 0;
            for o in outs.iter_mut() {
                add_assign(o, &v[at..at + o.len()]);
                at += o.len();
            }
        }
    }
}

/// Run `f(range, out_chunk)` over an elementwise output in parallel chunks.
pub fn par_elems(out: &mut [f32], f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync) {
    const CHUNK: usize = 1 << 12;
    let n = out.len();
    if n < PAR_MIN {
        f(0..n, out);
        return;
    }
    let n_chunks = n.div_ceil(CHUNK);
    let ptr = SendPtr(out.as_mut_ptr());
    pool_chunked(n_chunks, |chunks| {
        let p = ptr;
        let lo = chunks.start * CHUNK;
        let hi = (chunks.end * CHUNK).min(n);
        // SAFETY: disjoint element ranges within `out`.
        let chunk = unsafe { std::slice::from_raw_parts_mut(p.0.add(lo), hi - lo) };
        f(lo..hi, chunk)
    });
}

/// `out[r] = f(r)` for `r in 0..n_rows`, in parallel when `n_rows * row_work`
/// (elements touched) is large enough.
pub fn par_map_rows(n_rows: usize, row_work: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; n_rows];
    if n_rows * row_work < PAR_MIN || n_rows < 2 {
        out.iter_mut().enumerate().for_each(|(r, o)| *o = f(r));
        return out;
    }
    let ptr = SendPtr(out.as_mut_ptr());
    pool_chunked(n_rows, |rows| {
        let p = ptr;
        for r in rows {
            // SAFETY: each row index is handed out once.
            unsafe { *p.0.add(r) = f(r) };
        }
    });
    out
}

/// Compile `$body` (a call to an `#[inline(always)]` kernel) three times,
/// for AVX-512, AVX2+FMA and the baseline, and pick at run time.
#[macro_export]
#[doc(hidden)]
macro_rules! simd_dispatch {
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
            unsafe fn v4<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn v3<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // The closure must be inlined into v4 / v3 to be compiled with
            // their features: left to itself LLVM keeps a large one (a
            // whole row kernel) as a function of its own, at the baseline
            // (SSE2) width.
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
            {
                unsafe {
                    v4(
                        #[inline(always)]
                        || $body,
                    )
                }
            } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            {
                unsafe {
                    v3(
                        #[inline(always)]
                        || $body,
                    )
                }
            } else {
                $body
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $body
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::RowSums;

    #[test]
    fn row_sums_add_in_row_order_whatever_order_the_chunks_came() {
        // Values whose sum depends on the order of addition in f32.
        let chunk = |s: usize| vec![[1e8f32, 1.0, -1e8, 3.0][s % 4], 0.5 * s as f32];
        let sum = |order: &[usize]| {
            let sums = RowSums::new();
            for &s in order {
                sums.push(s, chunk(s));
            }
            let (mut a, mut b) = (vec![0f32; 1], vec![0f32; 1]);
            sums.add_into(&mut [&mut a, &mut b]);
            (a[0].to_bits(), b[0].to_bits())
        };
        let want = sum(&[0, 1, 2, 3]);
        assert_eq!(sum(&[3, 1, 0, 2]), want);
        assert_eq!(sum(&[2, 3, 1, 0]), want);
        // The order matters in f32 (else the test shows nothing).
        let direct = [1e8f32, 3.0, -1e8, 1.0].iter().fold(0f32, |a, v| a + v);
        assert_ne!(direct.to_bits(), want.0);
    }
}
