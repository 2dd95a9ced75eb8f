//! Flat f32 buffers (llm.c style): one contiguous `Vec<f32>` for all
//! parameters, one for all gradients, with per-block ranges from the layout.
//!
//! The single buffer is what makes the distributed strategies simple: a DDP
//! bucket is a range of it, a ZeRO shard is a range of it, the optimizer is
//! one fused loop over a range of it. The ledger is charged for the buffer's
//! bytes for as long as it lives.
//!
//! ```
//! use phalanx::engine::{FlatBuffer, GradSink, Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2, 2])]]).unwrap();
//! let ledger = Ledger::new();
//! let mut g = FlatBuffer::zeros(&layout, &ledger, Mem::Grads);
//! g.accumulate(&layout.params()[0], &[1.0; 4]).unwrap();
//! g.accumulate(&layout.params()[0], &[1.0; 4]).unwrap();
//! assert_eq!(g.as_slice(), &[2.0; 4]);
//! assert_eq!(ledger.current(Mem::Grads), 16);
//! ```

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{bail, Result, Tensor};

use super::backend::ParamSource;
use super::layout::{Layout, ParamInfo};
use crate::ledger::{Charge, Ledger, Mem};

/// Where a block's parameter gradients go during backward. The engine's own
/// flat gradient buffer is one; a ZeRO-2/3 strategy can use a per-bucket
/// buffer and reduce-scatter it.
pub trait GradSink {
    /// Add `grad` (flat, `p.numel` values) into the gradient of parameter `p`.
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> Result<()>;

    /// The gradient slots of `ps` (pairwise distinct), in that order, for
    /// a kernel to add into directly (a gemm with accumulate), when this
    /// sink holds them as f32 in one buffer; `None` (the default): use
    /// [`GradSink::accumulate`].
    fn slots(&mut self, ps: &[&ParamInfo]) -> Option<Vec<&mut [f32]>> {
        let _ = ps;
        None
    }
}

/// Where the values live: the heap, or an anonymous mapping whose pages
/// the kernel provides zeroed on first touch (so ranges never touched cost
/// address space, not memory: what a pipeline stage relies on).
enum Storage {
    Heap(Vec<f32>),
    Anon(memmap2::MmapMut),
}

impl Storage {
    fn anon_zeros(n: usize) -> Storage {
        match memmap2::MmapMut::map_anon(n * 4) {
            Ok(m) if n > 0 => Storage::Anon(m),
            _ => Storage::Heap(vec![0.0; n]),
        }
    }

    /// [`Storage::anon_zeros`], with an error instead of an abort where
    /// neither a mapping nor the heap can hold `n` values.
    fn try_anon_zeros(n: usize) -> std::result::Result<Storage, String> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| format!("{n} values do not fit in this machine's address space"))?;
        if n == 0 {
            return Ok(Storage::Heap(Vec::new()));
        }
        if let Ok(m) = memmap2::MmapMut::map_anon(bytes) {
            return Ok(Storage::Anon(m));
        }
        // Zeroed by the allocator (lazily, as `vec![0.0; n]` is), but an
        // error where it has no room rather than an abort.
        let gib = bytes as f64 / (1u64 << 30) as f64;
        let layout = std::alloc::Layout::array::<f32>(n)
            .map_err(|e| format!("cannot lay out {gib:.1} GiB for {n} values: {e}"))?;
        // SAFETY: a non-zero size (n > 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        if ptr.is_null() {
            return Err(format!("cannot allocate {gib:.1} GiB for {n} values"));
        }
        // SAFETY: allocated above by the global allocator with the layout
        // of `n` f32s, all zero (a valid f32), owned by the Vec from here.
        Ok(Storage::Heap(unsafe { Vec::from_raw_parts(ptr, n, n) }))
    }
    fn as_slice(&self) -> &[f32] {
        match self {
            Storage::Heap(v) => v,
            Storage::Anon(m) => bytemuck::cast_slice(&m[..]),
        }
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Storage::Heap(v) => v,
            Storage::Anon(m) => bytemuck::cast_slice_mut(&mut m[..]),
        }
    }
}

/// A flat f32 buffer laid out by a [`Layout`], charged to a [`Ledger`].
/// Offsets are global (the same on every rank); a buffer may hold only some
/// ranges ([`FlatBuffer::hold_only`]), the rest reading as zeros and costing
/// no memory.
pub struct FlatBuffer {
    /// Written through `&self` only by `sync` (see the `Sync` impl).
    data: UnsafeCell<Storage>,
    len: usize,
    /// Values that live on the device until the host reads them
    /// ([`FlatBuffer::defer_to`]): pieces by offset, covering the buffer;
    /// `has_pending` says so without the lock.
    pending: Mutex<Vec<(usize, Tensor)>>,
    has_pending: AtomicBool,
    blocks: Vec<Range<usize>>,
    /// The ranges held (sorted, disjoint); `None`: all of it.
    held: Option<Vec<Range<usize>>>,
    ledger: Ledger,
    kind: Mem,
    _charge: Charge,
    /// This buffer (unique in the process) and how many times it was
    /// borrowed mutably: [`ParamSource::version`].
    id: u64,
    generation: u64,
}

// SAFETY: the storage is written through `&self` only in `sync`, under the
// `pending` lock and only while `has_pending` is set. `has_pending` is set
// only by `defer_to`, through `&mut self`, so when it is set no borrow of
// the values exists; every borrow handed out through `&self` (`as_slice`)
// is taken after `sync` has run and cleared it (the write happens-before
// the Release store that clears it, which the borrower's Acquire load
// sees), and a reader that finds it set waits on the lock. So the write
// never overlaps a borrow, and otherwise the storage is only read.
unsafe impl Sync for FlatBuffer {}

/// Device-to-host reads of deferred values ([`FlatBuffer::defer_to`]) in
/// this process: what a test counts.
pub fn deferred_reads() -> usize {
    DEFERRED_READS.load(Ordering::Relaxed)
}

static DEFERRED_READS: AtomicUsize = AtomicUsize::new(0);

/// A fresh buffer id.
fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl FlatBuffer {
    /// A zeroed buffer for all of `layout`'s parameters.
    pub fn zeros(layout: &Layout, ledger: &Ledger, kind: Mem) -> Self {
        let n = layout.num_params();
        Self::with_storage(layout, ledger, kind, Storage::anon_zeros(n))
    }

    /// [`FlatBuffer::zeros`], or an error naming the size where the
    /// machine cannot hold it (a model configured far too large), instead
    /// of the allocator's abort.
    pub fn try_zeros(
        layout: &Layout,
        ledger: &Ledger,
        kind: Mem,
    ) -> std::result::Result<Self, String> {
        let n = layout.num_params();
        let data = Storage::try_anon_zeros(n)
            .map_err(|e| format!("the model's {kind:?} ({n} parameters): {e}"))?;
        Ok(Self::with_storage(layout, ledger, kind, data))
    }

    fn with_storage(layout: &Layout, ledger: &Ledger, kind: Mem, data: Storage) -> Self {
        let n = layout.num_params();
        Self {
            data: UnsafeCell::new(data),
            len: n,
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            blocks: layout.blocks().iter().map(|b| b.range.clone()).collect(),
            held: None,
            ledger: ledger.clone(),
            kind,
            _charge: ledger.charge(kind, n * 4),
            id: next_id(),
            generation: 0,
        }
    }

    /// A buffer holding `data` for all of `layout`'s parameters.
    pub fn from_vec(layout: &Layout, ledger: &Ledger, kind: Mem, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), layout.num_params(), "flat buffer size");
        let n = data.len();
        Self {
            data: UnsafeCell::new(Storage::Heap(data)),
            len: n,
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            blocks: layout.blocks().iter().map(|b| b.range.clone()).collect(),
            held: None,
            ledger: ledger.clone(),
            kind,
            _charge: ledger.charge(kind, n * 4),
            id: next_id(),
            generation: 0,
        }
    }

    /// An empty stand-in for a buffer a sharding strategy released.
    pub fn released(ledger: &Ledger, kind: Mem) -> Self {
        Self {
            data: UnsafeCell::new(Storage::Heap(Vec::new())),
            len: 0,
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            blocks: Vec::new(),
            held: None,
            ledger: ledger.clone(),
            kind,
            _charge: ledger.charge(kind, 0),
            id: next_id(),
            generation: 0,
        }
    }

    /// Keep only `keep` (ranges of the flat buffer): the values there stay,
    /// the memory of everything else is given back (it reads as zeros), and
    /// the ledger counts the held bytes only. For a pipeline stage, which
    /// holds its own blocks (and the tied parameters it reads).
    pub fn hold_only(&mut self, keep: &[Range<usize>]) {
        let mut keep: Vec<Range<usize>> = keep.iter().filter(|r| !r.is_empty()).cloned().collect();
        keep.sort_by_key(|r| r.start);
        let n = self.len();
        // A fresh mapping with the held values copied in: nothing outside
        // them is ever touched, on any storage the buffer had before.
        let mut data = Storage::anon_zeros(n);
        {
            let (src, dst) = (self.as_slice(), data.as_mut_slice());
            for r in &keep {
                dst[r.clone()].copy_from_slice(&src[r.clone()]);
            }
        }
        *self.data.get_mut() = data;
        self.generation += 1;
        let bytes = keep.iter().map(|r| r.len() * 4).sum();
        self._charge = self.ledger.charge(self.kind, bytes);
        self.held = Some(keep);
    }

    /// The ranges held, `None` when all of it is.
    pub fn held(&self) -> Option<&[Range<usize>]> {
        self.held.as_deref()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values (read back from the device first, when deferred there).
    pub fn as_slice(&self) -> &[f32] {
        self.sync();
        // SAFETY: after `sync` no write happens until the next `&mut self`
        // (see the `Sync` impl).
        unsafe { (*self.data.get()).as_slice() }
    }

    /// Every change to the values goes through here (or `hold_only`), and
    /// each borrow counts as one ([`ParamSource::version`]).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.sync();
        self.generation += 1;
        self.data.get_mut().as_mut_slice()
    }

    /// From now on the values are the device tensors `pieces` hold (each
    /// f32, any shape, placed at its offset; together covering the buffer
    /// in order), until the host reads them: the first read copies them
    /// back, once. What an optimizer that updated them on the device leaves
    /// behind when nothing on the host needs them every step
    /// (`optim::DeviceOptimizer`); the pieces may be the very copies the
    /// forward is served (`engine::resident`), so nothing is held twice.
    /// Counts as a change. A later change to a piece's values before that
    /// read is what the read sees; a buffer holding only some ranges
    /// cannot.
    pub fn defer_to(&mut self, pieces: Vec<(usize, Tensor)>) -> Result<()> {
        let mut at = 0;
        for (offset, t) in &pieces {
            if *offset != at || t.dtype() != candle_core::DType::F32 {
                bail!(
                    "deferring a flat buffer: a {:?} piece at {offset}, where {at} comes next",
                    t.dtype()
                );
            }
            at += t.elem_count();
        }
        if self.held.is_some() || at != self.len {
            bail!(
                "deferring a flat buffer of {} (held {:?}) to pieces covering {at}",
                self.len,
                self.held
            );
        }
        self.generation += 1;
        if !pieces.is_empty() {
            *self.pending.get_mut().unwrap_or_else(|e| e.into_inner()) = pieces;
            self.has_pending.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Whether the values are on the device, not yet read back.
    pub fn is_deferred(&self) -> bool {
        self.has_pending.load(Ordering::Acquire)
    }

    /// Read deferred values back into the storage (once).
    fn sync(&self) {
        if !self.has_pending.load(Ordering::Acquire) {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.is_empty() {
            return; // another reader did it while this one waited
        }
        // One read back for all the pieces (they cover the buffer in
        // order). Reads cannot fail in their signature; a device that fails
        // here (a lost GPU) ends the rank with what it said, and the pieces
        // stay pending, so no later read sees stale values.
        let v = pending
            .iter()
            .map(|(_, t)| t.flatten_all())
            .collect::<Result<Vec<_>>>()
            .and_then(|flat| Tensor::cat(&flat, 0))
            .and_then(|t| t.to_vec1::<f32>())
            .unwrap_or_else(|e| panic!("reading the parameters back from the device: {e}"));
        // SAFETY: `has_pending` is still set and we hold the lock: no
        // borrow of the values exists (see the `Sync` impl).
        unsafe { (*self.data.get()).as_mut_slice().copy_from_slice(&v) };
        pending.clear();
        DEFERRED_READS.fetch_add(1, Ordering::Relaxed);
        self.has_pending.store(false, Ordering::Release);
    }

    /// Block `b`'s part of the buffer.
    pub fn block(&self, b: usize) -> &[f32] {
        &self.as_slice()[self.blocks[b].clone()]
    }

    pub fn block_mut(&mut self, b: usize) -> &mut [f32] {
        let r = self.blocks[b].clone();
        &mut self.as_mut_slice()[r]
    }

    /// Set every held value to `v`.
    pub fn fill(&mut self, v: f32) {
        match self.held.take() {
            None => self.as_mut_slice().fill(v),
            Some(keep) => {
                for r in &keep {
                    self.as_mut_slice()[r.clone()].fill(v);
                }
                self.held = Some(keep);
            }
        }
    }
}

impl ParamSource for FlatBuffer {
    fn block_params(&self, b: usize) -> Result<&[f32]> {
        match self.blocks.get(b) {
            Some(r) => Ok(&self.as_slice()[r.clone()]),
            None => bail!("no block {b} (model has {})", self.blocks.len()),
        }
    }

    fn version(&self) -> Option<(u64, u64)> {
        Some((self.id, self.generation))
    }
}

impl GradSink for FlatBuffer {
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> Result<()> {
        if grad.len() != p.numel {
            bail!(
                "gradient of `{}` has {} values, expected {}",
                p.name,
                grad.len(),
                p.numel
            )
        }
        // At the CPU's vector width: every weight gradient of a step passes here.
        crate::ops::cpu::add_assign(&mut self.as_mut_slice()[p.range()], grad);
        Ok(())
    }

    fn slots(&mut self, ps: &[&ParamInfo]) -> Option<Vec<&mut [f32]>> {
        split_slots(self.as_mut_slice(), 0, ps)
    }
}

/// The ranges of `ps` (pairwise disjoint) cut out of `buf`, which holds
/// the flat range starting at `base`, in the order of `ps`: what
/// [`GradSink::slots`] hands out. `None` when two overlap (a repeated
/// parameter) or one lies outside `buf`.
pub fn split_slots<'a>(
    buf: &'a mut [f32],
    base: usize,
    ps: &[&ParamInfo],
) -> Option<Vec<&'a mut [f32]>> {
    // Cut at the ranges in offset order, then hand them back in the order
    // asked.
    let mut order: Vec<usize> = (0..ps.len()).collect();
    order.sort_by_key(|&i| ps[i].offset);
    let mut out: Vec<Option<&mut [f32]>> = ps.iter().map(|_| None).collect();
    let (mut rest, mut base) = (buf, base);
    for i in order {
        let r = ps[i].range();
        if r.start < base || r.end - base > rest.len() {
            return None;
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - base);
        let (slot, tail) = tail.split_at_mut(r.len());
        (out[i], rest, base) = (Some(slot), tail, r.end);
    }
    out.into_iter().collect()
}
