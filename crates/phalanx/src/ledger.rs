//! Memory ledger: the bytes one rank holds, by kind, current and peak.
//!
//! Every long-lived buffer of the engine (flat parameters, flat gradients,
//! optimizer state) and every saved activation takes a [`Charge`] from the
//! rank's [`Ledger`]; the charge is returned when the buffer is dropped. Tests
//! and the memory estimator compare these numbers with theory, e.g. fp32 AdamW
//! holds 4 (param) + 4 (grad) + 8 (m, v) = 16 bytes per parameter.
//!
//! A ledger is per rank, not global: ranks run as threads in one process in
//! tests, so each engine gets its own (cheap to clone, shared inside).
//!
//! ```
//! use phalanx::ledger::{Ledger, Mem};
//! let ledger = Ledger::new();
//! {
//!     let _c = ledger.charge(Mem::Params, 400);
//!     assert_eq!(ledger.current(Mem::Params), 400);
//! }
//! assert_eq!(ledger.current(Mem::Params), 0);
//! assert_eq!(ledger.peak(Mem::Params), 400);
//! ```

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The number of elements of a tensor of `shape`, or `None` when the
/// product overflows (shapes read from a file or a config may claim any
/// size; every caller bounds the result its own way).
///
/// ```
/// assert_eq!(phalanx::ledger::checked_numel(&[3, 4]), Some(12));
/// assert_eq!(phalanx::ledger::checked_numel(&[]), Some(1));
/// assert_eq!(phalanx::ledger::checked_numel(&[1 << 40, 1 << 40]), None);
/// ```
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// What a charged allocation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// Master parameters (the flat parameter buffer or this rank's shard of it).
    Params,
    /// Gradients (the flat gradient buffer or this rank's shard of it).
    Grads,
    /// Optimizer state (AdamW m and v, SGD momentum).
    OptState,
    /// Activations saved between forward and backward.
    Activations,
    /// Transient working copies of one block's parameters, materialised as
    /// candle tensors for its forward/backward (the "unsharded unit" of FSDP).
    Working,
}

const KINDS: [Mem; 5] = [
    Mem::Params,
    Mem::Grads,
    Mem::OptState,
    Mem::Activations,
    Mem::Working,
];

impl Mem {
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Default)]
struct Inner {
    current: [AtomicUsize; 5],
    peak: [AtomicUsize; 5],
    total_peak: AtomicUsize,
}

/// Per-rank byte counters. Cloning shares the counters.
#[derive(Clone, Default)]
pub struct Ledger {
    inner: Arc<Inner>,
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record `bytes` of kind `kind`; they are released when the charge drops.
    pub fn charge(&self, kind: Mem, bytes: usize) -> Charge {
        self.add(kind, bytes);
        Charge {
            ledger: self.clone(),
            kind,
            bytes,
        }
    }

    fn add(&self, kind: Mem, bytes: usize) {
        let i = kind.index();
        let now = self.inner.current[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.inner.peak[i].fetch_max(now, Ordering::Relaxed);
        let total = self.total();
        self.inner.total_peak.fetch_max(total, Ordering::Relaxed);
    }

    fn sub(&self, kind: Mem, bytes: usize) {
        self.inner.current[kind.index()].fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Bytes of `kind` held now.
    pub fn current(&self, kind: Mem) -> usize {
        self.inner.current[kind.index()].load(Ordering::Relaxed)
    }

    /// Most bytes of `kind` held at any time.
    pub fn peak(&self, kind: Mem) -> usize {
        self.inner.peak[kind.index()].load(Ordering::Relaxed)
    }

    /// All bytes held now.
    pub fn total(&self) -> usize {
        KINDS.iter().map(|&k| self.current(k)).sum()
    }

    /// Most bytes held at any time, all kinds together.
    pub fn total_peak(&self) -> usize {
        self.inner.total_peak.load(Ordering::Relaxed)
    }

    /// Parameters + gradients + optimizer state held now ("model states" in
    /// the ZeRO paper): 16 bytes/param for fp32 AdamW without sharding.
    pub fn model_state_bytes(&self) -> usize {
        self.current(Mem::Params) + self.current(Mem::Grads) + self.current(Mem::OptState)
    }

    /// Forget the peaks (e.g. after warm-up), keeping current values.
    pub fn reset_peaks(&self) {
        for k in KINDS {
            let i = k.index();
            let cur = self.inner.current[i].load(Ordering::Relaxed);
            self.inner.peak[i].store(cur, Ordering::Relaxed);
        }
        self.inner.total_peak.store(self.total(), Ordering::Relaxed);
    }
}

impl fmt::Display for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        for k in KINDS {
            writeln!(
                f,
                "{:<12} {:>10.2} MiB (peak {:>10.2} MiB)",
                format!("{k:?}"),
                mib(self.current(k)),
                mib(self.peak(k))
            )?;
        }
        write!(
            f,
            "{:<12} {:>10.2} MiB (peak {:>10.2} MiB)",
            "total",
            mib(self.total()),
            mib(self.total_peak())
        )
    }
}

/// An outstanding allocation; releases its bytes from the ledger on drop.
pub struct Charge {
    ledger: Ledger,
    kind: Mem,
    bytes: usize,
}

impl Charge {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn kind(&self) -> Mem {
        self.kind
    }

    /// Change the charged size (e.g. a buffer that grew or shrank).
    pub fn resize(&mut self, bytes: usize) {
        if bytes > self.bytes {
            self.ledger.add(self.kind, bytes - self.bytes);
        } else {
            self.ledger.sub(self.kind, self.bytes - bytes);
        }
        self.bytes = bytes;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.ledger.sub(self.kind, self.bytes);
    }
}

impl fmt::Debug for Charge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Charge({:?}, {} bytes)", self.kind, self.bytes)
    }
}
