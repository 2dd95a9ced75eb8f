//! What the families' direct layers share (an explicit forward and
//! backward over reused buffers, run by the engine outside candle's graph:
//! GPT-2's `gpt2::fused`, Llama's `llama::direct`):
//!
//! - [`enabled`] / [`set_fused_layer`]: the switch, `PHALANX_FUSED_LAYER=0`
//!   turning every direct layer off (the composed layers then run);
//! - [`batch_parts`] and [`run_parts`]: one share of the batch per pool
//!   thread, each running a whole pass serially (one parallel region per
//!   pass instead of one per kernel);
//! - [`split_parts`] / [`split_parts_mut`] / [`pieces`]: a set of
//!   row-major buffers (or one, of any element type) cut into those shares;
//! - [`with_f32_params`], [`Wide`], [`convert`]: the parameters (or any
//!   half tensor) as f32 slices, widened in parallel into pooled buffers;
//! - [`bf16_weights`]: whether the layer's products run in bf16;
//! - [`weight_grads`] / [`weight_grads_into`]: a layer's weight pass
//!   (every dW and db) in one parallel region, returned or added into
//!   the flat gradient buffer.
//!
//! ```
//! use phalanx_models::common::direct::split_parts;
//! let (a, b) = ([1f32, 2., 3., 4.], [5f32, 6.]);
//! let parts = split_parts([&a[..], &b[..]], 2);
//! assert_eq!(parts[1], [&[3f32, 4.][..], &[6f32][..]]);
//! ```

use std::sync::Mutex;

use candle_core::{bail, Result, Storage, Tensor};
use phalanx::ops::buffers::{self, Buf};
use phalanx::ops::cpu;

thread_local! {
    static OVERRIDE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether direct layers are on: this thread's [`set_fused_layer`], else
/// `PHALANX_FUSED_LAYER` (default on).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    OVERRIDE.with(|o| o.get()).unwrap_or_else(|| {
        *ON.get_or_init(|| std::env::var("PHALANX_FUSED_LAYER").map_or(true, |v| v != "0"))
    })
}

/// Turns the direct layers on or off for layers built on this thread
/// (`None`: back to `PHALANX_FUSED_LAYER`); for comparisons and tests.
pub fn set_fused_layer(on: Option<bool>) {
    OVERRIDE.with(|o| o.set(on));
}

/// How many parts to split a batch of `b` over: one per pool thread when
/// they divide it evenly (each then runs the whole layer on its share of
/// the batch), else 1 (the kernels then split their own work).
pub fn batch_parts(b: usize) -> usize {
    let threads = cpu::pool_threads();
    if threads > 1 && b.is_multiple_of(threads) {
        threads
    } else {
        1
    }
}

/// Each buffer of `bufs` cut into `parts` equal pieces, gathered per part.
pub fn split_parts<const K: usize>(bufs: [&[f32]; K], parts: usize) -> Vec<[&[f32]; K]> {
    let mut its = bufs.map(|v| v.chunks(v.len().div_ceil(parts).max(1)));
    (0..parts)
        .map(|_| std::array::from_fn(|k| its[k].next().unwrap_or(&[])))
        .collect()
}

/// `v` cut into `parts` equal pieces (the last shorter when `parts` does
/// not divide it; empty ones for an empty `v`).
pub fn pieces<T>(v: &mut [T], parts: usize) -> Vec<&mut [T]> {
    let len = v.len().div_ceil(parts).max(1);
    let mut out: Vec<&mut [T]> = v.chunks_mut(len).collect();
    out.resize_with(parts, Default::default);
    out
}

/// [`split_parts`] for buffers a pass writes.
pub fn split_parts_mut<const K: usize>(
    bufs: [&mut [f32]; K],
    parts: usize,
) -> Vec<[&mut [f32]; K]> {
    let mut its = bufs.map(|v| pieces(v, parts).into_iter());
    (0..parts)
        .map(|_| std::array::from_fn(|k| its[k].next().unwrap_or_default()))
        .collect()
}

/// `f(i, work[i])` for every part, in parallel on the pool
/// (`cpu::par_parts`: the kernels inside run serially); the results in
/// part order.
pub fn run_parts<T: Send, R: Send>(work: Vec<T>, f: impl Fn(usize, T) -> R + Sync) -> Vec<R> {
    let parts = work.len();
    let slots: Vec<Mutex<(Option<T>, Option<R>)>> = work
        .into_iter()
        .map(|w| Mutex::new((Some(w), None)))
        .collect();
    cpu::par_parts(parts, |i| {
        let w = slots[i]
            .lock()
            .unwrap()
            .0
            .take()
            .expect("each part runs once");
        let r = f(i, w);
        slots[i].lock().unwrap().1 = Some(r);
    });
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap().1.expect("every part ran"))
        .collect()
}

/// Whether a layer with these parameters takes its matrix products in
/// bf16 (`ops::cpu::with_bf16_products`): when its weights are bf16, as
/// `autocast(bfloat16)` multiplies bf16 operands. On a CPU without
/// AVX512-BF16 the products stay f32.
pub fn bf16_weights(p: &[Tensor]) -> bool {
    p.first()
        .is_some_and(|t| t.dtype() == candle_core::DType::BF16)
}

/// f32 data: borrowed (f32), or widened into this thread's pooled buffer
/// (half).
pub enum Wide<'a> {
    Borrowed(&'a [f32]),
    Pooled(Buf),
}

impl std::ops::Deref for Wide<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Wide::Borrowed(s) => s,
            Wide::Pooled(b) => b,
        }
    }
}

/// Elements per conversion task of [`convert`].
const CHUNK: usize = 1 << 14;

/// `f(src, dst)` over `dst` in chunks, in parallel on candle's pool.
pub fn convert<S: Sync, D: Send>(src: &[S], dst: &mut [D], f: fn(&[S], &mut [D])) {
    assert_eq!(src.len(), dst.len());
    let full = dst.len() / CHUNK * CHUNK;
    let (head, tail) = dst.split_at_mut(full);
    cpu::par_rows(head, CHUNK, |rows, out| {
        f(&src[rows.start * CHUNK..rows.end * CHUNK], out)
    });
    f(&src[full..], tail);
}

/// Runs `f` on the tensors (the parameters, a gradient) as f32 slices:
/// contiguous CPU tensors, f32 borrowed, f16 / bf16 widened into this
/// thread's pooled buffers (the kernel boundary of a half-precision layer:
/// no fresh pages per call); `what` names the layer in the error.
pub fn with_f32_params<R>(p: &[Tensor], what: &str, f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
    use candle_core::CpuStorage as C;
    let held: Vec<_> = p.iter().map(|t| t.storage_and_layout()).collect();
    let mut wide = Vec::with_capacity(held.len());
    for (st, l) in &held {
        let (Storage::Cpu(s), Some((lo, hi))) = (&**st, l.contiguous_offsets()) else {
            bail!("{what}: tensors must be contiguous f32, f16 or bf16 on CPU")
        };
        wide.push(match s {
            C::F32(v) => Wide::Borrowed(&v[lo..hi]),
            C::BF16(v) => {
                let mut b = buffers::take(hi - lo);
                convert(&v[lo..hi], &mut b, cpu::bf16_to_f32);
                Wide::Pooled(b)
            }
            C::F16(v) => {
                let mut b = buffers::take(hi - lo);
                convert(&v[lo..hi], &mut b, cpu::f16_to_f32);
                Wide::Pooled(b)
            }
            _ => bail!("{what}: tensors must be contiguous f32, f16 or bf16 on CPU"),
        });
    }
    let s: Vec<&[f32]> = wide.iter().map(|w| &w[..]).collect();
    Ok(f(&s))
}

/// One linear of a layer's weight pass: dW (out, inp) = d^T x over the
/// batch's rows, x (rows, inp) its input and d (rows, out) its output
/// gradient; db (out,) = the sum of d's rows when `bias`.
pub struct WeightGrad<'a> {
    pub x: &'a [f32],
    pub d: &'a [f32],
    pub out: usize,
    pub inp: usize,
    pub bias: bool,
}

/// Every (dW, db) of `lins` over `rows` batch rows (db empty without a
/// bias), in one parallel region: [`weight_grads_into`] on zeroed buffers.
pub fn weight_grads(rows: usize, lins: &[WeightGrad]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut grads: Vec<(Vec<f32>, Vec<f32>)> = lins
        .iter()
        .map(|l| {
            (
                vec![0f32; l.out * l.inp],
                vec![0f32; if l.bias { l.out } else { 0 }],
            )
        })
        .collect();
    let dst = grads.iter_mut().map(|(w, b)| (&mut w[..], &mut b[..]));
    weight_grads_into(rows, lins, dst.collect());
    grads
}

/// Adds every (dW, db) of `lins` over `rows` batch rows into `dst` (one
/// (dW, db) slot pair per linear, db empty without a bias: a flat gradient
/// buffer's ranges, or zeroed buffers), in one parallel region: each pool
/// thread computes its share of every product's output rows over all batch
/// rows, so each element's sum is the unsplit one and the result does not
/// depend on the thread count.
pub fn weight_grads_into(rows: usize, lins: &[WeightGrad], dst: Vec<(&mut [f32], &mut [f32])>) {
    assert_eq!(
        dst.len(),
        lins.len(),
        "weight_grads_into: one slot pair per linear"
    );
    let least = lins.iter().map(|l| l.out).min().unwrap_or(1);
    let parts = cpu::pool_threads().min(least).max(1);
    // Part p's rows out * p / parts .. out * (p + 1) / parts of each product.
    let mut shares: Vec<Vec<(&mut [f32], &mut [f32])>> = (0..parts).map(|_| Vec::new()).collect();
    for ((mut dw, mut db), l) in dst.into_iter().zip(lins) {
        let nb = if l.bias { l.out } else { 0 };
        assert!(
            dw.len() == l.out * l.inp && db.len() == nb,
            "weight_grads_into: slots of {} and {} values for a ({}, {}) linear",
            dw.len(),
            db.len(),
            l.out,
            l.inp
        );
        for (p, share) in shares.iter_mut().enumerate() {
            let r = l.out * (p + 1) / parts - l.out * p / parts;
            let (w0, w1) = std::mem::take(&mut dw).split_at_mut(r * l.inp);
            let (b0, b1) = std::mem::take(&mut db).split_at_mut(if l.bias { r } else { 0 });
            share.push((w0, b0));
            (dw, db) = (w1, b1);
        }
    }
    run_parts(shares, |p, share| {
        for (l, (dw, db)) in lins.iter().zip(share) {
            let o0 = l.out * p / parts;
            phalanx::ops::linear_backward_weight_rows_acc(l.x, l.d, (rows, l.inp, l.out), o0, dw);
            if l.bias {
                // The bias's sum on its own, then added: as a bias
                // gradient handed to the sink is.
                let mut sum = vec![0f32; db.len()];
                phalanx::ops::linear_backward_bias_cols(l.d, l.out, o0, &mut sum);
                cpu::add_assign(db, &sum);
            }
        }
    });
}

/// The gradient slots a direct layer's `accumulate_into` was given (in its
/// `order`: parameter indices), by parameter index, with each `ready`
/// gradient (a norm's, computed with dx) already added into its slot; `what`
/// names the layer in the error.
pub fn slots_by_param<'a>(
    params: usize,
    order: &[usize],
    slots: Vec<&'a mut [f32]>,
    ready: &[(usize, Vec<f32>)],
    what: &str,
) -> Result<Vec<Option<&'a mut [f32]>>> {
    if slots.len() != order.len() {
        bail!(
            "{what}: {} gradient slots for {} parameters",
            slots.len(),
            order.len()
        )
    }
    let mut by_param: Vec<Option<&mut [f32]>> = (0..params).map(|_| None).collect();
    for (&i, s) in order.iter().zip(slots) {
        by_param[i] = Some(s);
    }
    for (i, g) in ready {
        match by_param.get_mut(*i).and_then(|s| s.as_deref_mut()) {
            Some(s) if s.len() == g.len() => cpu::add_assign(s, g),
            _ => bail!(
                "{what}: no gradient slot of {} values for parameter {i}",
                g.len()
            ),
        }
    }
    Ok(by_param)
}
