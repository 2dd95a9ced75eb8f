//! `VarBuilder` backends: how a block's candle code meets the flat buffers.
//!
//! - [`Recorder`] answers every `vb.get*` with zeros and writes down the
//!   request (name, shape, init hint, and the placement
//!   [`crate::placement::declare`] gave): the engine builds its layout from it.
//!   [`declarations`] records a block with a recorder that allocates
//!   nothing (a model too large to hold can be declared).
//! - [`Server`] answers from a [`ParamSource`]: it copies the parameter out of
//!   the flat buffer into a fresh candle tensor, a `Var` when gradients are
//!   wanted, and remembers the `Var` so the engine can read its gradient.
//!   A name asked twice returns the same tensor (like candle-nn's `VarMap`).
//!   A source that holds a block's parameters on the device already
//!   ([`ParamSource::block_tensor`]: ZeRO-3's device gathers) is served
//!   from there: views, or a device copy per variable.
//!
//! The copy is deliberate: candle cannot alias memory it does not own, and
//! viewing parameters as `narrow`s of one big tensor makes every backward pay
//! a full-size zero-padded gradient per parameter. A copy per block forward is
//! O(params), negligible next to the O(params x tokens) matmuls. Off the CPU
//! kernels (CUDA), where it is a host-to-device copy, the server takes the
//! stack's kept device copies instead ([`super::resident`]).
//!
//! ```
//! use phalanx::engine::backend::Recorder;
//! use candle_core::{DType, Device};
//! let rec = Recorder::new();
//! let vb = candle_nn::VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
//! let _l = candle_nn::linear(3, 2, vb.pp("fc")).unwrap();
//! let names: Vec<String> = rec.take().into_iter().map(|d| d.name).collect();
//! assert_eq!(names, vec!["fc.weight", "fc.bias"]);
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Device, Result, Shape, Tensor, TensorId, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use super::block::Block;
use super::layout::{Layout, ParamDecl};
use super::resident::Resident;

/// Where a block's parameters come from: the engine's flat buffer, or (for
/// ZeRO-3 / FSDP) a buffer gathered from shards just before the forward.
pub trait ParamSource: Sync {
    /// The parameters owned by block `b`, flat, in layout order
    /// (`layout.block(b).range.len()` elements).
    fn block_params(&self, b: usize) -> Result<&[f32]>;

    /// Which values these are: (the source, how many times it has been
    /// changed), or `None` when that is not tracked. Device copies of the
    /// parameters ([`super::resident::Resident`]) are kept only for a
    /// source with a version, and only while it stays the same.
    fn version(&self) -> Option<(u64, u64)> {
        None
    }

    /// Block `b`'s parameters as one (n,) f32 tensor on the compute
    /// device, when this source holds them there (ZeRO-3's blocks gathered
    /// in device memory); `None`, the default: read them with
    /// [`ParamSource::block_params`]. A server then serves each parameter
    /// from that tensor, without a host copy.
    fn block_tensor(&self, b: usize) -> Result<Option<Tensor>> {
        let _ = b;
        Ok(None)
    }
}

/// Records parameter requests; serves zeros.
#[derive(Clone, Default)]
pub struct Recorder {
    decls: Arc<Mutex<Vec<ParamDecl>>>,
    /// Serve one zero broadcast to the asked shape (no storage of its size).
    shapes_only: bool,
}

impl Recorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A recorder that serves each request as one zero broadcast to the
    /// asked shape: nothing of the parameter's size is allocated, so a
    /// block of a model too large to hold can be declared (a block that
    /// computes with its parameters while it is built gets the zeros, as
    /// from [`Recorder::new`]).
    pub fn shapes_only() -> Self {
        Recorder {
            shapes_only: true,
            ..Self::default()
        }
    }

    /// The requests so far, in request order.
    pub fn take(&self) -> Vec<ParamDecl> {
        std::mem::take(&mut *self.decls.lock().unwrap())
    }
}

impl SimpleBackend for Recorder {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.decls.lock().unwrap().push(ParamDecl {
            name: name.to_string(),
            shape: s.dims().to_vec(),
            init: h,
            placement: crate::placement::take_pending(),
        });
        if self.shapes_only {
            return Tensor::zeros((), dtype, dev)?.broadcast_as(s);
        }
        Tensor::zeros(s, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        bail!(
            "parameter `{name}`: blocks must give shapes (vb.get), get_unchecked is not supported"
        )
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// What `block` declares: its parameter requests (name, this rank's shape,
/// init hint, placement) in request order, recorded with
/// [`Recorder::shapes_only`], so nothing of the parameters' size is
/// allocated (the planner's model families declare their blocks so).
///
/// ```
/// use phalanx::engine::backend::declarations;
/// use phalanx::engine::FnBlock;
/// let big = FnBlock::new(|vb: candle_nn::VarBuilder| candle_nn::linear(50_000, 50_000, vb.pp("fc")));
/// let d = declarations(&big).unwrap(); // 2.5e9 parameters, none allocated
/// assert_eq!((d[0].name.as_str(), d[0].shape.as_slice()), ("fc.weight", &[50_000, 50_000][..]));
/// ```
pub fn declarations(block: &dyn Block) -> Result<Vec<ParamDecl>> {
    let rec = Recorder::shapes_only();
    let vb = VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
    block.build(vb)?;
    Ok(rec.take())
}

/// What a [`Server`] handed out: the tensors, and the `Var`s to read grads from.
#[derive(Default)]
pub struct Served {
    cache: HashMap<usize, Tensor>,
    /// (parameter index, variable), in request order.
    pub vars: Vec<(usize, Var)>,
    /// Every tensor handed out (dtype casts included), by id: what a
    /// deferred weight gradient (`ops::tape`) names its parameter by.
    pub ids: HashMap<TensorId, usize>,
    /// Bytes materialised (for the ledger's `Working` count).
    pub bytes: usize,
}

/// Serves parameters from a [`ParamSource`].
pub struct Server<'a> {
    layout: &'a Layout,
    src: &'a dyn ParamSource,
    /// The blocks whose parameters may be asked for; `None` = any (whole model).
    block: Option<usize>,
    grad: bool,
    device: Device,
    served: Arc<Mutex<Served>>,
    /// Device copies kept between builds, when the stack keeps them.
    resident: Option<&'a Resident>,
}

impl<'a> Server<'a> {
    /// A server for block `block` (or the whole model with `None`); `grad`
    /// makes the tensors `Var`s. Read the result from the returned handle
    /// after building.
    pub fn new(
        layout: &'a Layout,
        src: &'a dyn ParamSource,
        block: Option<usize>,
        grad: bool,
        device: &Device,
    ) -> (Self, Arc<Mutex<Served>>) {
        let served = Arc::new(Mutex::new(Served::default()));
        let server = Self {
            layout,
            src,
            block,
            grad,
            device: device.clone(),
            served: served.clone(),
            resident: None,
        };
        (server, served)
    }

    /// Serve from (and keep in) `resident`'s device copies while the
    /// source is unchanged.
    pub fn keeping(mut self, resident: Option<&'a Resident>) -> Self {
        self.resident = resident;
        self
    }

    /// Parameter `k` as a tensor on `dev`, and whether it is a fresh copy
    /// (not one kept in `resident`).
    fn materialise(&self, k: usize, dev: &Device) -> Result<(Tensor, bool)> {
        // A kept copy first, without reading the source's values.
        if let Some(v) = self.resident.and_then(|kept| kept.kept(k, self.src)) {
            return Ok(self.serve_kept(k, v));
        }
        let p = &self.layout.params()[k];
        let owner = self.layout.block(p.block);
        if let Some(t) = self.src.block_tensor(p.block)? {
            return self.serve_from_device(k, &t, owner.range.start);
        }
        let flat = self.src.block_params(p.block)?;
        if flat.len() != owner.range.len() {
            bail!(
                "parameter source gave {} values for block {}, layout says {}",
                flat.len(),
                p.block,
                owner.range.len()
            );
        }
        let lo = p.offset - owner.range.start;
        let data = &flat[lo..lo + p.numel];
        if let Some(kept) = self.resident {
            if let Some(v) = kept.get(k, p, self.src, data, dev)? {
                return Ok(self.serve_kept(k, v));
            }
        }
        super::resident::uploaded();
        if self.grad {
            let v = Var::from_slice(data, p.shape.as_slice(), dev)?;
            let t = v.as_tensor().clone();
            self.served.lock().unwrap().vars.push((k, v));
            Ok((t, true))
        } else {
            Ok((Tensor::from_slice(data, p.shape.as_slice(), dev)?, true))
        }
    }
}

impl Server<'_> {
    /// Parameter `k` out of `t`, its block's parameters on the device
    /// (flat from `start`, the block's first offset): a variable of its
    /// own when gradients are wanted (candle's gradient is per variable),
    /// else a view.
    fn serve_from_device(&self, k: usize, t: &Tensor, start: usize) -> Result<(Tensor, bool)> {
        let p = &self.layout.params()[k];
        let owner = self.layout.block(p.block).range.len();
        if t.dims() != [owner] || t.dtype() != DType::F32 {
            bail!(
                "parameter source gave a {:?} {:?} tensor for block {}, layout says ({owner},) f32",
                t.dims(),
                t.dtype(),
                p.block
            )
        }
        if !t.device().same_device(&self.device) {
            bail!(
                "parameter source gave block {}'s parameters on {:?}, the engine runs on {:?}",
                p.block,
                t.device(),
                self.device
            )
        }
        let piece = t
            .narrow(0, p.offset - start, p.numel)?
            .reshape(p.shape.as_slice())?;
        if !self.grad {
            return Ok((piece.detach(), false));
        }
        let v = Var::from_tensor(&piece)?;
        let out = v.as_tensor().clone();
        self.served.lock().unwrap().vars.push((k, v));
        Ok((out, true))
    }

    /// A kept copy: a variable when gradients are wanted, else a constant
    /// view of the same storage.
    fn serve_kept(&self, k: usize, v: Var) -> (Tensor, bool) {
        let t = v.as_tensor().clone();
        if !self.grad {
            return (t.detach(), false);
        }
        self.served.lock().unwrap().vars.push((k, v));
        (t, false)
    }
}

impl SimpleBackend for Server<'_> {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let Some(k) = self.layout.index_of(name) else {
            bail!("parameter `{name}` was not declared when the model was built")
        };
        if let Some(b) = self.block {
            if !self.layout.block_param_indices(b).any(|i| i == k) {
                bail!(
                    "block {b} asks for parameter `{name}` which it did not ask for at build time"
                )
            }
        }
        let p = &self.layout.params()[k];
        if s.dims() != p.shape.as_slice() {
            bail!(
                "parameter `{name}`: asked with shape {:?}, the layout has {:?}",
                s.dims(),
                p.shape
            )
        }
        if !dev.same_device(&self.device) {
            bail!(
                "parameter `{name}`: asked on {dev:?}, the engine runs on {:?}",
                self.device
            )
        }
        let cached = self.served.lock().unwrap().cache.get(&k).cloned();
        let t = match cached {
            Some(t) => t,
            None => {
                let (t, fresh) = self.materialise(k, dev)?;
                let mut served = self.served.lock().unwrap();
                if fresh {
                    served.bytes += p.numel * 4;
                }
                served.cache.insert(k, t.clone());
                t
            }
        };
        // Master weights are f32; a block asking for another dtype gets a cast
        // (autograd flows through it back to the f32 variable).
        let t = if dtype == DType::F32 {
            t
        } else {
            t.to_dtype(dtype)?
        };
        self.served.lock().unwrap().ids.insert(t.id(), k);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        bail!(
            "parameter `{name}`: blocks must give shapes (vb.get), get_unchecked is not supported"
        )
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.layout.index_of(name).is_some()
    }
}
