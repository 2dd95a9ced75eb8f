//! Reusable buffers for the large vectors that ZeRO-2/3 move every step.
//!
//! Stage 3 passes every block's parameters and gradients through fresh
//! vectors each step: the piece read from the shard, its half-precision
//! copy, the gathered block and its widened copy, the gradient staging
//! buffer and its reduce-scatter output. They are megabytes each, so glibc
//! serves them with `mmap` and unmaps them on free (or trims them off the
//! heap), and every step took fresh zeroed pages from the kernel. Measured
//! with `/usr/bin/time -v` on `phalanx train --nproc-per-node 2` (gpt-10m,
//! micro-batch 2, `zero_optimization.stage=3`), as (faults(15 steps) -
//! faults(5 steps)) / 10 / 2 ranks: 24,500-26,500 minor faults per rank per
//! step before this pool (DDP: about 0); with it, between -260 and +280,
//! i.e. 0 within the run-to-run noise. In-process
//! (`crates/phalanx-models/tests/zero3_faults.rs`, 2 layers of 384): 3,200
//! to 10,100 per rank per step with every buffer fresh, 34 to 119 pooled.
//! The cost: idle buffers stay resident. Over that run, peak RSS per rank
//! moved from 316-324 to 312-330 MiB; after the first step (the pool
//! filling during it) from 252-276 to 301-316 MiB.
//!
//! Buffers are keyed by element type and length, and handed back
//! explicitly ([`Pool::put`]), from any thread (the communication thread
//! returns a collective's input as soon as it is sent). The pool never
//! keeps more idle buffers of a key than were ever in use at once, so it
//! holds at most one step's working set, however long training runs. Idle
//! buffers stay resident, so the pool charges them to the ledger as
//! [`Mem::Working`]; a buffer in use is charged by its user, as before.
//!
//! ```
//! use phalanx::ledger::{Ledger, Mem};
//! use phalanx::strategy::pool::Pool;
//! let ledger = Ledger::new();
//! let pool = Pool::new(&ledger);
//! let a: Vec<f32> = pool.take_zeroed(1000);
//! let at = a.as_ptr();
//! pool.put(a);
//! assert_eq!(ledger.current(Mem::Working), 4000);
//! let b: Vec<f32> = pool.take(1000);
//! assert_eq!(b.as_ptr(), at); // the same memory, not a fresh allocation
//! assert_eq!(ledger.current(Mem::Working), 0);
//! ```

use crate::ledger::{Charge, Ledger, Mem};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The buffers of one (element type, length).
#[derive(Default)]
struct Shelf {
    /// Idle buffers, each a boxed `Vec<T>`.
    idle: Vec<Box<dyn Any + Send>>,
    /// Taken and not yet returned.
    in_use: usize,
    /// Most ever in use at once: the most idle buffers kept.
    peak: usize,
}

struct Inner {
    shelves: HashMap<(TypeId, usize), Shelf>,
    /// The idle buffers' bytes, charged as `Working`.
    idle: Charge,
}

/// A pool of `Vec<T>` buffers (T: f32, bf16, f16, i32, ...), shared by
/// cloning.
#[derive(Clone)]
pub struct Pool(Arc<Mutex<Inner>>);

impl Pool {
    /// An empty pool whose idle buffers are charged to `ledger`.
    pub fn new(ledger: &Ledger) -> Pool {
        Pool(Arc::new(Mutex::new(Inner {
            shelves: HashMap::new(),
            idle: ledger.charge(Mem::Working, 0),
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere leaves the shelves consistent: keep going.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An idle buffer of `len` elements, counted as in use; `None` when
    /// there is none (the caller allocates, still counted).
    fn reuse<T: bytemuck::Pod + Send>(&self, len: usize) -> Option<Vec<T>> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let shelf = inner.shelves.entry((TypeId::of::<T>(), len)).or_default();
        shelf.in_use += 1;
        shelf.peak = shelf.peak.max(shelf.in_use);
        let v = *shelf
            .idle
            .pop()?
            .downcast::<Vec<T>>()
            .expect("keyed by type");
        let bytes = inner.idle.bytes() - v.capacity() * size_of::<T>();
        inner.idle.resize(bytes);
        Some(v)
    }

    /// A buffer of `len` elements whose values are unspecified (an earlier
    /// user's, or zero when fresh): for outputs that are overwritten whole.
    pub fn take<T: bytemuck::Pod + Send>(&self, len: usize) -> Vec<T> {
        if len == 0 {
            return Vec::new();
        }
        match self.reuse(len) {
            Some(mut v) => {
                v.resize(len, T::zeroed());
                v
            }
            None => vec![T::zeroed(); len],
        }
    }

    /// A buffer of `len` zeros (a reused one is cleared; a fresh one comes
    /// zeroed from the allocator).
    pub fn take_zeroed<T: bytemuck::Pod + Send>(&self, len: usize) -> Vec<T> {
        if len == 0 {
            return Vec::new();
        }
        match self.reuse(len) {
            Some(mut v) => {
                v.clear();
                v.resize(len, T::zeroed());
                v
            }
            None => vec![T::zeroed(); len],
        }
    }

    /// Return a buffer (from [`Pool::take`], any thread). It is kept while
    /// fewer idle buffers of its length are kept than were ever in use at
    /// once, and freed otherwise.
    pub fn put<T: bytemuck::Pod + Send>(&self, v: Vec<T>) {
        let n = v.capacity();
        if n == 0 {
            return;
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        let shelf = inner.shelves.entry((TypeId::of::<T>(), n)).or_default();
        shelf.in_use = shelf.in_use.saturating_sub(1);
        if shelf.idle.len() < shelf.peak {
            shelf.idle.push(Box::new(v));
            let bytes = inner.idle.bytes() + n * size_of::<T>();
            inner.idle.resize(bytes);
        } else {
            // Free outside the lock (unmapping takes a while).
            drop(guard);
            drop(v);
        }
    }

    /// A buffer of `len` elements taken from the pool will not come back
    /// (handed to code that does not return buffers).
    pub fn forget<T: bytemuck::Pod + Send>(&self, len: usize) {
        let mut inner = self.lock();
        if let Some(shelf) = inner.shelves.get_mut(&(TypeId::of::<T>(), len)) {
            shelf.in_use = shelf.in_use.saturating_sub(1);
        }
    }

    /// Bytes held idle.
    pub fn idle_bytes(&self) -> usize {
        self.lock().idle.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_at_most_what_was_in_use_at_once() {
        let ledger = Ledger::new();
        let pool = Pool::new(&ledger);
        // Two in use at once, then three returned (one from elsewhere).
        let a: Vec<f32> = pool.take(10);
        let b: Vec<f32> = pool.take(10);
        pool.put(a);
        pool.put(b);
        pool.put(vec![0f32; 10]);
        assert_eq!(pool.idle_bytes(), 80);
        assert_eq!(ledger.current(Mem::Working), 80);
        // Keyed by type and length: half-precision buffers of 10 are others.
        let h: Vec<half::bf16> = pool.take(10);
        assert_eq!(pool.idle_bytes(), 80);
        pool.put(h);
        assert_eq!(pool.idle_bytes(), 100);
        // A zeroed take clears a reused buffer.
        let mut c: Vec<f32> = pool.take(10);
        c.fill(7.0);
        pool.put(c);
        assert_eq!(pool.take_zeroed::<f32>(10), vec![0.0; 10]);
        drop(pool);
        assert_eq!(ledger.current(Mem::Working), 0);
    }

    #[test]
    fn returns_from_other_threads() {
        let pool = Pool::new(&Ledger::new());
        let v: Vec<f32> = pool.take(4);
        let p = pool.clone();
        std::thread::spawn(move || p.put(v)).join().unwrap();
        assert_eq!(pool.idle_bytes(), 16);
    }
}
