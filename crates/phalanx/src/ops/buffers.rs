//! Reused f32 buffers for fused blocks' activations (llm.c keeps one
//! activation buffer for the whole run; here each thread keeps the buffers
//! its blocks freed, by length, and hands them out again next step). A
//! steady training step then takes no fresh pages from the kernel for them:
//! no page faults, no zero-fill.
//!
//! A taken buffer holds stale values: the kernels that fill it must write
//! every element.
//!
//! ```
//! let a = phalanx::ops::buffers::take(1000);
//! let p = a.as_ptr();
//! drop(a);                                            // back to this thread's pool
//! assert_eq!(phalanx::ops::buffers::take(1000).as_ptr(), p); // and out again
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Free buffers kept per thread, in bytes, beyond which freed ones go back
/// to the allocator (a bound on what a pool can hold on to).
const KEEP_BYTES: usize = 4 << 30;

#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
    /// Buffers `take` had to allocate rather than reuse.
    fresh: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// How many buffers [`take`] has had to allocate (not reuse) on this
/// thread: flat across steady training steps.
pub fn fresh_allocations() -> usize {
    POOL.with(|p| p.borrow().fresh)
}

/// A buffer of `len` f32s that returns to its dropping thread's pool.
#[derive(Default)]
pub struct Buf(Vec<f32>);

/// A buffer of `len` f32s: a freed one of the same length if this thread
/// has one (stale contents), else a fresh zeroed one.
pub fn take(len: usize) -> Buf {
    let reused = POOL.with(|p| {
        let mut p = p.borrow_mut();
        let v = p.free.get_mut(&len).and_then(|l| l.pop());
        match v {
            Some(_) => p.bytes -= len * 4,
            None => p.fresh += 1,
        }
        v
    });
    Buf(reused.unwrap_or_else(|| vec![0f32; len]))
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let len = v.len();
        if len == 0 {
            return;
        }
        // `try_with`: a thread being torn down frees normally.
        let _ = POOL.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.bytes + len * 4 <= KEEP_BYTES {
                p.bytes += len * 4;
                p.free.entry(len).or_default().push(v);
            }
        });
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

/// A pooled buffer of `len` 16-bit floats (`half::f16` or `half::bf16`):
/// an f32 [`Buf`] of half the length from the same pool underneath, so
/// activations kept in half precision take half the bytes and, in steady
/// steps, no fresh pages either. Stale contents, as [`take`]'s.
pub struct HalfBuf<T> {
    buf: Buf,
    len: usize,
    _t: PhantomData<T>,
}

/// A buffer of `len` f16 or bf16 values (see [`HalfBuf`]).
///
/// ```
/// let mut h = phalanx::ops::buffers::take_half::<half::bf16>(5);
/// h.fill(half::bf16::ONE);
/// assert_eq!(h.len(), 5);
/// assert_eq!(h.bytes(), 12); // three f32s underneath
/// ```
pub fn take_half<T: bytemuck::Pod>(len: usize) -> HalfBuf<T> {
    assert_eq!(
        std::mem::size_of::<T>(),
        2,
        "take_half: 16-bit elements only"
    );
    HalfBuf {
        buf: take(len.div_ceil(2)),
        len,
        _t: PhantomData,
    }
}

impl<T> HalfBuf<T> {
    /// The bytes it holds (the pooled f32 buffer's).
    pub fn bytes(&self) -> usize {
        4 * self.buf.len()
    }
}

impl<T: bytemuck::Pod> Deref for HalfBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.buf[..])[..self.len]
    }
}

impl<T: bytemuck::Pod> DerefMut for HalfBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.buf[..])[..self.len]
    }
}
