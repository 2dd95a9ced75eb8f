//! Parameters, and gradients being accumulated, kept resident on the
//! compute device.
//!
//! On a device whose ops are not Phalanx's CPU kernels (CUDA, or the CPU's
//! device-generic path), each block's parameters would otherwise be copied
//! from the flat host buffer into device tensors at every build: once per
//! micro-batch forward, once more per recomputation, once per evaluation.
//! [`Resident`] keeps the device copy (one `Var` per parameter) and hands
//! it out again for as long as the flat buffer it came from is unchanged:
//! a [`FlatBuffer`](super::FlatBuffer) counts every mutable borrow
//! ([`ParamSource::version`]), so the optimizer's step, a ZeRO all-gather
//! or a checkpoint load invalidate the copies and the next build uploads
//! afresh. With gradient accumulation over k micro-batches and full
//! recomputation, that is one upload per parameter per step instead of 2k.
//!
//! A source without a version (ZeRO-3 / FSDP's gathered blocks, whose full
//! parameters must not stay) is never kept. The copies are charged to the
//! ledger as `Working` memory for as long as they are held.
//!
//! [`HeldGrads`] is the gradients' side: while a strategy accumulates
//! micro-batches without reducing them (DDP's `no_sync`, ZeRO-1), each
//! backward adds its gradients into device tensors instead of reading them
//! back to the flat host buffer; the next backward that is not held adds
//! what was held to its own gradient and reads the sum back, once, still
//! block by block (so DDP's bucketed all-reduce overlaps as before). The
//! additions happen in the same order as the host's (((g1 + g2) + g3) +
//! g4, then into a zeroed buffer), so the host buffer receives bitwise the
//! sum it would have added up itself.
//!
//! Both sides also meet the optimizer on the device
//! (`optim::DeviceOptimizer::step_on`): [`Resident::flat`] hands it the
//! kept copies as one tensor, [`Resident::adopt`] keeps its result as the
//! copies of the buffer it has just written; and where nothing reduces the
//! gradients on the host (DDP with one data-parallel rank, or reducing
//! them on the device), [`HeldGrads::take_flat`]
//! hands it every backward's sum without a read back.
//!
//! ```
//! use candle_core::Device;
//! use phalanx::engine::resident::{uploads, Resident};
//! use phalanx::engine::{FlatBuffer, Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2])]]).unwrap();
//! let ledger = Ledger::new();
//! let mut flat = FlatBuffer::from_vec(&layout, &ledger, Mem::Params, vec![1.0, 2.0]);
//! let kept = Resident::new(&ledger);
//! let p = &layout.params()[0];
//! let before = uploads();
//! let a = kept.get(0, p, &flat, &[1.0, 2.0], &Device::Cpu).unwrap().unwrap();
//! let b = kept.get(0, p, &flat, &[1.0, 2.0], &Device::Cpu).unwrap().unwrap();
//! assert_eq!(a.as_tensor().id(), b.as_tensor().id()); // the same device copy
//! flat.as_mut_slice()[0] = 3.0; // a change: the next get uploads again
//! let c = kept.get(0, p, &flat, &[3.0, 2.0], &Device::Cpu).unwrap().unwrap();
//! assert_eq!(c.as_tensor().to_vec1::<f32>().unwrap(), vec![3.0, 2.0]);
//! assert!(uploads() >= before + 2);
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{Device, Result, Tensor, Var};

use super::backend::ParamSource;
use super::layout::ParamInfo;
use crate::ledger::{Charge, Ledger, Mem};

/// Parameter uploads (host buffer to device tensor) by every server in this
/// process, kept or not: what a test counts.
pub fn uploads() -> usize {
    UPLOADS.load(Ordering::Relaxed)
}

static UPLOADS: AtomicUsize = AtomicUsize::new(0);

/// Counts one upload of a parameter to the device.
pub(super) fn uploaded() {
    UPLOADS.fetch_add(1, Ordering::Relaxed);
}

/// Gradients read back from the device into a flat host buffer, off the
/// CPU kernels, in this process: what a test counts.
pub fn downloads() -> usize {
    DOWNLOADS.load(Ordering::Relaxed)
}

static DOWNLOADS: AtomicUsize = AtomicUsize::new(0);

/// Counts one gradient read back from the device.
pub(super) fn downloaded() {
    DOWNLOADS.fetch_add(1, Ordering::Relaxed);
}

/// Device tensors by parameter index, charged to the ledger as `kind` for
/// as long as they are held.
struct Charged<T> {
    map: HashMap<usize, (T, usize)>,
    bytes: usize,
    kind: Mem,
    ledger: Ledger,
    _charge: Option<Charge>,
}

impl<T> Charged<T> {
    fn new(ledger: &Ledger, kind: Mem) -> Self {
        Charged {
            map: HashMap::new(),
            bytes: 0,
            kind,
            ledger: ledger.clone(),
            _charge: None,
        }
    }

    fn get(&self, k: usize) -> Option<&T> {
        self.map.get(&k).map(|(t, _)| t)
    }

    /// Hold `t` (`bytes` of device memory) for `k`, in place of what was.
    fn insert(&mut self, k: usize, t: T, bytes: usize) {
        if let Some((_, old)) = self.map.insert(k, (t, bytes)) {
            self.bytes -= old;
        }
        self.bytes += bytes;
        self.recharge();
    }

    fn remove(&mut self, k: usize) -> Option<T> {
        let (t, bytes) = self.map.remove(&k)?;
        self.bytes -= bytes;
        self.recharge();
        Some(t)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.bytes = 0;
        self._charge = None;
    }

    fn recharge(&mut self) {
        self._charge = None; // released before the new charge is taken
        self._charge = (self.bytes > 0).then(|| self.ledger.charge(self.kind, self.bytes));
    }
}

/// The device copies of one stack's parameters, valid for one version of
/// one source.
pub struct Resident {
    inner: Mutex<Kept>,
}

struct Kept {
    /// The source version the copies were taken from.
    version: Option<(u64, u64)>,
    vars: Charged<Var>,
}

impl Resident {
    pub fn new(ledger: &Ledger) -> Self {
        Resident {
            inner: Mutex::new(Kept {
                version: None,
                vars: Charged::new(ledger, Mem::Working),
            }),
        }
    }

    /// The copy of parameter `k` kept for `src`'s current version, if any:
    /// no read of `src`'s values (which may live on the device until read:
    /// `FlatBuffer::defer_to`).
    pub fn kept(&self, k: usize, src: &dyn ParamSource) -> Option<Var> {
        let version = src.version()?;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.version != Some(version) {
            return None;
        }
        inner.vars.get(k).cloned()
    }

    /// The device copy of parameter `k` (`p`, whose values are `data`, read
    /// from `src`), uploaded when `src` changed since it was taken; `None`
    /// when `src` has no version (nothing is kept for it).
    pub fn get(
        &self,
        k: usize,
        p: &ParamInfo,
        src: &dyn ParamSource,
        data: &[f32],
        dev: &Device,
    ) -> Result<Option<Var>> {
        let Some(version) = src.version() else {
            // An untracked source (ZeRO-3's gathered blocks): nothing is
            // kept for it, and copies of an earlier source are let go.
            self.clear();
            return Ok(None);
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Kept {
            version: kept_for,
            vars,
        } = &mut *inner;
        if *kept_for != Some(version) {
            vars.clear();
            *kept_for = Some(version);
        }
        if let Some(v) = vars.get(k) {
            return Ok(Some(v.clone()));
        }
        let v = Var::from_slice(data, p.shape.as_slice(), dev)?;
        uploaded();
        vars.insert(k, v.clone(), p.numel * 4);
        Ok(Some(v))
    }

    /// The copies of `params` (the layout's, covering `range` in flat
    /// order) as one (n,) f32 tensor of fresh storage, when every one of
    /// them is kept for `src`'s current version; else `None`.
    pub fn flat(
        &self,
        src: &dyn ParamSource,
        params: &[ParamInfo],
        range: Range<usize>,
    ) -> Result<Option<Tensor>> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if src.version().is_none() || inner.version != src.version() {
            return Ok(None);
        }
        let mut pieces = Vec::new();
        let mut covered = 0;
        for (k, p) in covering(params, &range) {
            match inner.vars.get(k) {
                Some(v) => pieces.push(v.as_tensor().flatten_all()?),
                None => return Ok(None),
            }
            covered += p.numel;
        }
        if pieces.is_empty() || covered != range.len() {
            return Ok(None);
        }
        // One piece would come back as itself: copy, so that the caller
        // may write it in place. Detached: the pieces are variables, and
        // what is computed from the copy must not keep a graph back to
        // them (step after step, it would keep every step's tensors).
        let flat = if pieces.len() == 1 {
            pieces[0].copy()?
        } else {
            Tensor::cat(&pieces, 0)?
        };
        Ok(Some(flat.detach()))
    }

    /// Device copies (fresh storage) of the pieces of `flat` ((n,) f32, the
    /// values of `range`), one per parameter of `params` inside it, by
    /// layout index: what [`Resident::keep`] takes.
    pub fn copies(
        params: &[ParamInfo],
        range: Range<usize>,
        flat: &Tensor,
    ) -> Result<Vec<(usize, Var)>> {
        let covered: usize = covering(params, &range).map(|(_, p)| p.numel).sum();
        if covered != range.len() || flat.dims() != [range.len()] {
            candle_core::bail!(
                "copying {:?} for the parameters of {range:?}, which cover {covered}",
                flat.dims()
            );
        }
        covering(params, &range)
            .map(|(k, p)| {
                let piece = flat.narrow(0, p.offset - range.start, p.numel)?;
                Ok((k, Var::from_tensor(&piece.reshape(p.shape.as_slice())?)?))
            })
            .collect()
    }

    /// Keep `vars` (by layout index; from [`Resident::copies`]) as the
    /// device copies for `src`'s current version, in place of whatever was
    /// kept for them: the next build uploads nothing for them.
    pub fn keep(&self, src: &dyn ParamSource, params: &[ParamInfo], vars: &[(usize, Var)]) {
        let Some(version) = src.version() else {
            self.clear();
            return;
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.version != Some(version) {
            inner.vars.clear();
            inner.version = Some(version);
        }
        for (k, v) in vars {
            inner.vars.insert(*k, v.clone(), params[*k].numel * 4);
        }
    }

    /// Keep the pieces of `flat` ((n,) f32, the values of `range` just
    /// written to `src`) as the device copies of `params` for `src`'s
    /// current version: [`Resident::copies`], then [`Resident::keep`].
    pub fn adopt(
        &self,
        src: &dyn ParamSource,
        params: &[ParamInfo],
        range: Range<usize>,
        flat: &Tensor,
    ) -> Result<()> {
        // The copies being replaced go first, so that old and new are not
        // on the device together.
        self.forget(src, params, &range);
        let vars = Self::copies(params, range, flat)?;
        self.keep(src, params, &vars);
        Ok(())
    }

    /// Let go of the copies of `params` inside `range` (all of them, when
    /// they were kept for another version of `src`).
    fn forget(&self, src: &dyn ParamSource, params: &[ParamInfo], range: &Range<usize>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.version != src.version() {
            inner.vars.clear();
            inner.version = None;
            return;
        }
        for (k, _) in covering(params, range) {
            inner.vars.remove(k);
        }
    }

    /// Let go of every copy (the memory goes back to the device).
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.vars.clear();
        inner.version = None;
    }
}

/// The parameters (by layout index) that lie inside `range`; `range` must
/// start and end on parameter boundaries with nothing between them
/// missing, which a caller's range over whole blocks does.
fn covering<'a>(
    params: &'a [ParamInfo],
    range: &Range<usize>,
) -> impl Iterator<Item = (usize, &'a ParamInfo)> {
    let range = range.clone();
    params
        .iter()
        .enumerate()
        .filter(move |(_, p)| range.start <= p.offset && p.offset + p.numel <= range.end)
}

/// Gradients added up on the device across held backwards
/// ([`crate::engine::Engine::hold_grads`]).
pub struct HeldGrads {
    on: AtomicBool,
    inner: Mutex<Charged<Tensor>>,
}

impl HeldGrads {
    pub fn new(ledger: &Ledger) -> Self {
        HeldGrads {
            on: AtomicBool::new(false),
            inner: Mutex::new(Charged::new(ledger, Mem::Grads)),
        }
    }

    /// Whether backwards now hold their gradients.
    pub fn holding(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn set_holding(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Add `g`, parameter `k`'s gradient of one backward, to what is held.
    pub fn add(&self, k: usize, g: &Tensor) -> Result<()> {
        // Detached: a gradient computed from a product may still refer to
        // the micro-batch's activations, which holding it must not keep.
        let g = g.detach();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let sum = match inner.get(k) {
            Some(h) => (h + &g)?,
            None => g.clone(),
        };
        inner.insert(k, sum, g.elem_count() * 4);
        Ok(())
    }

    /// What is held for parameter `k`, taken out.
    pub fn take(&self, k: usize) -> Option<Tensor> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(k)
    }

    /// Everything held for the parameters of `range` (the layout's
    /// `params`, whole ones), taken out as one (n + `pad`,) f32 tensor in
    /// flat order, zeros where a parameter has nothing held and `pad`
    /// zeros last (put together in the one allocation); `None` when
    /// nothing at all is held for them.
    pub fn take_flat(
        &self,
        params: &[ParamInfo],
        range: Range<usize>,
        dev: &Device,
        pad: usize,
    ) -> Result<Option<Tensor>> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut pieces = Vec::new();
        let (mut covered, mut any) = (0, false);
        for (k, p) in covering(params, &range) {
            let piece = match inner.remove(k) {
                Some(g) => {
                    any = true;
                    g.to_dtype(candle_core::DType::F32)?.flatten_all()?
                }
                None => Tensor::zeros(p.numel, candle_core::DType::F32, dev)?,
            };
            pieces.push(piece);
            covered += p.numel;
        }
        if covered != range.len() {
            candle_core::bail!("the parameters of {range:?} cover {covered} of it");
        }
        if !any {
            return Ok(None);
        }
        if pad > 0 {
            pieces.push(Tensor::zeros(pad, candle_core::DType::F32, dev)?);
        }
        let flat = if pieces.len() == 1 {
            pieces.remove(0).contiguous()?
        } else {
            Tensor::cat(&pieces, 0)?
        };
        Ok(Some(flat.detach()))
    }

    /// How many parameters' gradients are held.
    pub fn count(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .len()
    }

    /// Stop holding and let go of everything held (a new step's
    /// `zero_grad`).
    pub fn clear(&self) {
        self.set_holding(false);
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}
