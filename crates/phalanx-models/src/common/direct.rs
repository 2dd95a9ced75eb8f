//! What the families' direct layers share (an explicit forward and
//! backward over reused buffers, run by the engine outside candle's graph:
//! GPT-2's `gpt2::fused`, Llama's `llama::direct`):
//!
//! - [`enabled`] / [`set_fused_layer`]: the switch, `PHALANX_FUSED_LAYER=0`
//!   turning every direct layer off (the composed layers then run);
//! - [`batch_parts`] and [`run_parts`]: one share of the batch per pool
//!   thread, each running a whole pass serially (one parallel region per
//!   pass instead of one per kernel);
//! - [`split_parts`] / [`split_parts_mut`]: a set of row-major buffers cut
//!   into those shares;
//! - [`with_f32_params`]: the parameters as f32 slices;
//! - [`bf16_weights`]: whether the layer's products run in bf16.
//!
//! ```
//! use phalanx_models::common::direct::split_parts;
//! let (a, b) = ([1f32, 2., 3., 4.], [5f32, 6.]);
//! let parts = split_parts([&a[..], &b[..]], 2);
//! assert_eq!(parts[1], [&[3f32, 4.][..], &[6f32][..]]);
//! ```

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, Result, Storage, Tensor};
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

/// [`split_parts`] for buffers a pass writes.
pub fn split_parts_mut<const K: usize>(
    bufs: [&mut [f32]; K],
    parts: usize,
) -> Vec<[&mut [f32]; K]> {
    let mut its = bufs.map(|v| {
        let len = v.len().div_ceil(parts).max(1);
        v.chunks_mut(len)
    });
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

/// Runs `f` on the parameters as f32 slices: contiguous CPU tensors, f32
/// borrowed, f16 / bf16 widened (the kernel boundary of a half-precision
/// layer); `what` names the layer in the error.
pub fn with_f32_params<R>(p: &[Tensor], what: &str, f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
    let held: Vec<_> = p.iter().map(|t| t.storage_and_layout()).collect();
    let mut wide = Vec::with_capacity(held.len());
    for (st, l) in &held {
        match &**st {
            Storage::Cpu(s) if cpu::is_float(s.dtype()) && l.is_contiguous() => {
                wide.push(cpu::cpu_f32(s, l)?)
            }
            _ => bail!("{what}: parameters must be contiguous f32, f16 or bf16 on CPU"),
        }
    }
    let s: Vec<&[f32]> = wide.iter().map(|w| &w[..]).collect();
    Ok(f(&s))
}
