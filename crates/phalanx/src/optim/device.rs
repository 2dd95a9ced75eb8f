//! The optimizer's state in device memory and its step run there: AdamW's
//! moments or SGD's momentum as candle tensors on the compute device, the
//! update as a handful of element-wise device ops, a chunk of [`CHUNK`]
//! elements at a time with the state written in place, so that its
//! temporaries stay small whatever the range.
//!
//! Off the CPU kernels (CUDA, or the CPU's device-generic path) this is the
//! optimizer a rank gets, unless `zero_optimization.offload_optimizer.device`
//! says `cpu` (DeepSpeed's optimizer offload: the state in host memory and
//! the host's fused loop, [`super::AdamW`]) or `nvme`. The flat host buffer
//! stays the master copy the strategies reduce, gather and checkpoint: a
//! step uploads the range's reduced gradients, and writes the new
//! parameters back into it. DDP and pipeline stages step on the
//! parameters' device copies ([`DeviceOptimizer::step_on`], through
//! `optim::step::Update::on_device`: kept between builds by `engine::resident`), so
//! the parameters do not go up, and keep the result as the next forward's
//! copies; ZeRO uploads its shard's parameters too
//! ([`Optimizer::step_range`]), except ZeRO-1 with its gradients on the
//! device, which steps its shard in place in the kept copies. The state takes 8
//! bytes per parameter (AdamW; SGD 4, or none without momentum) of device
//! memory, plus 4 for the weight-decay mask where anything decays; the host
//! does no arithmetic.
//!
//! The ops are those of the host loops in the same order, each rounded to
//! f32 once (`x.affine(a, 0)` is `a * x`; no op adds to a product in one
//! kernel, which a compiler might fuse): on the CPU the device path gives
//! the host's results bit for bit (`tests/optim_device.rs`); on a GPU the
//! same is expected of IEEE division and square root, not yet checked on
//! one. On the CPU's generic path it is about ten allocating passes where
//! the host runs one SIMD loop: it is there to be tested, not to be fast.
//!
//! ```
//! use candle_core::Device;
//! use phalanx::engine::{Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! use phalanx::optim::{AdamW, AdamWConfig, DeviceOptimizer, Optimizer};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2, 2]), ParamDecl::new("b", &[2])]]).unwrap();
//! let ledger = Ledger::new();
//! let cfg = AdamWConfig::default();
//! let mut dev = DeviceOptimizer::adamw(cfg, &layout, 0..6, &ledger, &Device::Cpu).unwrap();
//! let mut host = AdamW::new(cfg, &layout, 0..6, &Ledger::new());
//! let (mut p, mut q) = (vec![0.5f32; 6], vec![0.5f32; 6]);
//! let g = [0.1f32, -0.2, 0.3, 0.0, 1.5, -7.0];
//! for _ in 0..3 {
//!     dev.step(&mut p, &g, 1e-2, 0.5);
//!     host.step(&mut q, &g, 1e-2, 0.5);
//! }
//! assert_eq!(p, q); // bit for bit on the CPU
//! // m and v, and the weight-decay mask (w decays, b does not): 12 bytes each.
//! assert_eq!(ledger.current(Mem::OptState), 6 * 12);
//! ```

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor};

use super::adamw::StepConsts;
use super::{check_sub, AdamWConfig, OptimState, Optimizer, SgdConfig};
use crate::engine::Layout;
use crate::ledger::{Charge, Ledger, Mem};

/// Steps begun by device optimizers in this process: what a test counts
/// to tell where the optimizer ran.
pub fn steps() -> usize {
    STEPS.load(Ordering::Relaxed)
}

static STEPS: AtomicUsize = AtomicUsize::new(0);

/// Parameters (elements) device optimizers wrote back into host buffers
/// in this process: what a test counts.
pub fn read_back() -> usize {
    READ_BACK.load(Ordering::Relaxed)
}

static READ_BACK: AtomicUsize = AtomicUsize::new(0);

/// Elements updated per pass: the step's temporaries (about ten of them,
/// f32) are bounded by this, whatever the range (64 MiB each at 2^24), where
/// one pass over a 7B model's range would take ten times its 28 GB.
pub const CHUNK: usize = 1 << 24;

/// Where [`DeviceOptimizer::step_on`] finds the gradients: the flat host
/// buffer (reduced there), or a (n,) f32 tensor on the device (nothing to
/// reduce: they never left it).
#[derive(Clone, Copy)]
pub enum Grads<'a> {
    Host(&'a [f32]),
    Device(&'a Tensor),
}

/// The sum of squares of `t` (f32, any shape, on any device), in f64 as
/// the host's [`super::clip::sum_squares`], a chunk at a time (one f64
/// chunk's temporary); one read back of the per-chunk sums.
pub fn sum_squares(t: &Tensor) -> candle_core::Result<f64> {
    Ok(read_sums(&[square_sums(t)?])?[0])
}

/// The per-chunk sums of squares of `t` as 0-d f64 tensors on its device,
/// not read yet ([`read_sums`] reads many groups at once).
pub fn square_sums(t: &Tensor) -> candle_core::Result<Vec<Tensor>> {
    let flat = t.flatten_all()?;
    chunks(flat.elem_count(), CHUNK)
        .map(|c| {
            let x = flat.narrow(0, c.start, c.len())?;
            x.to_dtype(candle_core::DType::F64)?.sqr()?.sum_all()
        })
        .collect()
}

/// Each group's total, read back from the device in one copy.
pub fn read_sums(groups: &[Vec<Tensor>]) -> candle_core::Result<Vec<f64>> {
    let all: Vec<Tensor> = groups.iter().flatten().cloned().collect();
    let values = if all.is_empty() {
        Vec::new()
    } else {
        Tensor::stack(&all, 0)?.to_vec1::<f64>()?
    };
    let mut at = 0;
    Ok(groups
        .iter()
        .map(|g| {
            let total = values[at..at + g.len()].iter().sum();
            at += g.len();
            total
        })
        .collect())
}

/// `0..n` in consecutive pieces of `chunk` elements (the last shorter).
fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (0..n)
        .step_by(chunk)
        .map(move |lo| lo..lo.saturating_add(chunk).min(n))
}

/// `t`'s values (one chunk of new parameters) into `dst`, counted.
fn write_back(dst: &mut [f32], t: &Tensor) -> candle_core::Result<()> {
    dst.copy_from_slice(&t.to_vec1::<f32>()?);
    READ_BACK.fetch_add(dst.len(), Ordering::Relaxed);
    Ok(())
}

/// Which update rule, with its settings.
#[derive(Debug, Clone, Copy)]
enum Rule {
    AdamW(AdamWConfig),
    Sgd(SgdConfig),
}

/// An optimizer whose state lives on `device` (see the module docs).
pub struct DeviceOptimizer {
    rule: Rule,
    range: Range<usize>,
    device: Device,
    /// (n,) 1.0 where weight decay applies (matrices), else 0.0; none
    /// when nothing in the range decays (or the decay is 0).
    mask: Option<Tensor>,
    /// AdamW: `exp_avg`, `exp_avg_sq`; SGD: `momentum_buffer` (none
    /// without momentum). Each (n,) f32 on `device`.
    bufs: Vec<(&'static str, Tensor)>,
    t: u64,
    /// AdamW: steps after which v is frozen (0: never).
    freeze_after: u64,
    /// Elements per pass ([`CHUNK`]).
    chunk: usize,
    _charge: Charge,
}

impl DeviceOptimizer {
    /// AdamW with its moments for `range` on `device`.
    pub fn adamw(
        cfg: AdamWConfig,
        layout: &Layout,
        range: Range<usize>,
        ledger: &Ledger,
        device: &Device,
    ) -> candle_core::Result<Self> {
        Self::new(
            Rule::AdamW(cfg),
            &["exp_avg", "exp_avg_sq"],
            layout,
            range,
            ledger,
            device,
        )
    }

    /// SGD with its momentum buffer (if any) for `range` on `device`.
    pub fn sgd(
        cfg: SgdConfig,
        layout: &Layout,
        range: Range<usize>,
        ledger: &Ledger,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let names: &[&'static str] = if cfg.momentum != 0.0 {
            &["momentum_buffer"]
        } else {
            &[]
        };
        Self::new(Rule::Sgd(cfg), names, layout, range, ledger, device)
    }

    fn new(
        rule: Rule,
        names: &[&'static str],
        layout: &Layout,
        range: Range<usize>,
        ledger: &Ledger,
        device: &Device,
    ) -> candle_core::Result<Self> {
        assert!(
            range.end <= layout.num_params(),
            "range {range:?} beyond the layout"
        );
        let n = range.len();
        let decay = match rule {
            Rule::AdamW(c) => c.weight_decay,
            Rule::Sgd(c) => c.weight_decay,
        };
        let segments = layout.decay_segments(range.clone());
        let mask = if decay != 0.0 && segments.iter().any(|(_, d)| *d) {
            let mut mask = vec![0f32; n];
            for (seg, _) in segments.into_iter().filter(|(_, d)| *d) {
                mask[seg].fill(1.0);
            }
            Some(Tensor::from_vec(mask, n, device)?)
        } else {
            None
        };
        let bufs = names
            .iter()
            .map(|&name| Ok((name, Tensor::zeros(n, candle_core::DType::F32, device)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // The state, and the mask beside it (device memory all the same).
        let bytes = n * 4 * (bufs.len() + mask.is_some() as usize);
        Ok(DeviceOptimizer {
            rule,
            _charge: ledger.charge(Mem::OptState, bytes),
            range,
            device: device.clone(),
            mask,
            bufs,
            t: 0,
            freeze_after: 0,
            chunk: CHUNK,
        })
    }

    /// The device the state lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Elements updated per pass (default [`CHUNK`]): a smaller chunk
    /// for tests that cross chunk boundaries.
    pub fn with_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    /// One whole step (it begins the step itself) with the parameters
    /// already on the device: `dev` ((n,) f32, contiguous, the current
    /// values of this optimizer's whole range) is updated in place, so the
    /// caller may keep it as the parameters' device copy; `params`, when
    /// given, receives the same new values (when not, the caller defers
    /// the host's copy to `dev`: `FlatBuffer::defer_to`). Only the
    /// gradients go up, unless they are on the device too.
    pub fn step_on(
        &mut self,
        mut params: Option<&mut [f32]>,
        dev: &Tensor,
        grads: Grads,
        lr: f32,
        grad_scale: f32,
    ) -> candle_core::Result<()> {
        let n = self.range.len();
        let glen = match grads {
            Grads::Host(g) => g.len(),
            Grads::Device(g) => g.elem_count(),
        };
        let plen = params.as_ref().map_or(n, |p| p.len());
        if plen != n || glen != n {
            candle_core::bail!(
                "{}: range {:?} needs {n} parameters and gradients, got {plen} and {glen} \
                 (the device gradients must be ({n},))",
                self.kind(),
                self.range,
            );
        }
        let mut checks = vec![("parameters", dev)];
        if let Grads::Device(g) = grads {
            checks.push(("gradients", g));
        }
        for (what, t) in checks {
            if t.dims() != [n] || !t.is_contiguous() || t.dtype() != candle_core::DType::F32 {
                candle_core::bail!(
                    "{}: the device {what} are {:?} {:?}, not ({n},) contiguous f32",
                    self.kind(),
                    t.dims(),
                    t.dtype()
                );
            }
        }
        self.begin_step();
        for c in chunks(n, self.chunk) {
            let g = match grads {
                Grads::Host(g) => Tensor::from_slice(&g[c.clone()], c.len(), &self.device)?,
                Grads::Device(g) => g.narrow(0, c.start, c.len())?,
            };
            let p = dev.narrow(0, c.start, c.len())?;
            let p = self.step_chunk(c.clone(), p, &g, lr, grad_scale)?;
            dev.slice_set(&p, 0, c.start)?;
            if let Some(params) = params.as_deref_mut() {
                write_back(&mut params[c], &p)?;
            }
        }
        Ok(())
    }

    /// One piece `sub` of the step begun by `begin_step`, a chunk at a
    /// time: upload, update the state in place, write the parameters back.
    fn update(
        &mut self,
        sub: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
    ) -> candle_core::Result<()> {
        for c in chunks(sub.len(), self.chunk) {
            let at = sub.start + c.start..sub.start + c.end;
            let (p, g) = (&mut params[c.clone()], &grads[c]);
            let dev = &self.device;
            let (pt, gt) = (
                Tensor::from_slice(p, p.len(), dev)?,
                Tensor::from_slice(g, g.len(), dev)?,
            );
            let new = self.step_chunk(at, pt, &gt, lr, grad_scale)?;
            write_back(p, &new)?;
        }
        Ok(())
    }

    /// The update of elements `at` (relative to the range) from `p` and
    /// `g` ((n,) each, on the device): the state updated in place, the new
    /// parameters returned (fresh storage).
    fn step_chunk(
        &mut self,
        at: Range<usize>,
        p: Tensor,
        g: &Tensor,
        lr: f32,
        grad_scale: f32,
    ) -> candle_core::Result<Tensor> {
        let n = at.len();
        let mask = match &self.mask {
            Some(m) => Some(m.narrow(0, at.start, n)?),
            None => None,
        };
        let mut state: Vec<Tensor> = self
            .bufs
            .iter()
            .map(|(_, b)| b.narrow(0, at.start, n))
            .collect::<candle_core::Result<_>>()?;
        // The frozen variance is left alone: still the view of its buffer.
        let mut untouched = None;
        let p = match self.rule {
            Rule::AdamW(c) => {
                let (k, frozen) =
                    StepConsts::of_step(&c, self.t, self.freeze_after, lr, grad_scale);
                untouched = frozen.then_some(1);
                adamw(
                    k,
                    frozen,
                    lr * c.weight_decay,
                    mask.as_ref(),
                    p,
                    g,
                    &mut state,
                )?
            }
            Rule::Sgd(c) => sgd(
                &c,
                self.t == 1,
                lr,
                grad_scale,
                mask.as_ref(),
                p,
                g,
                &mut state,
            )?,
        };
        let whole = n == self.range.len();
        for (i, ((_, buf), new)) in self.bufs.iter_mut().zip(state).enumerate() {
            if whole {
                // Detached: no graph from one step's state to the next.
                *buf = new.detach();
            } else if untouched != Some(i) {
                buf.slice_set(&new.contiguous()?, 0, at.start)?;
            }
        }
        p.contiguous()
    }
}

/// AdamW over (n,) tensors, the host loop's ops in its order:
/// g = grad * scale; m = b1 m + (1 - b1) g; v = b2 v + ((1 - b2) g) g;
/// p = p decay - (step_size m) / (sqrt(v) inv_bc2_sqrt + eps).
/// Frozen: m = ((1 - b1) grad) scale, v kept. `lr_wd` is lr x weight
/// decay, applied where `mask` is 1 (no mask: nowhere).
fn adamw(
    k: StepConsts,
    frozen: bool,
    lr_wd: f32,
    mask: Option<&Tensor>,
    p: Tensor,
    grad: &Tensor,
    state: &mut [Tensor],
) -> candle_core::Result<Tensor> {
    let f = |x: f32| x as f64;
    let (m, v) = (&state[0], &state[1]);
    let (m, v) = if frozen {
        let m = grad.affine(f(1.0 - k.b1), 0.0)?.affine(f(k.scale), 0.0)?;
        (m, v.clone())
    } else {
        let g = grad.affine(f(k.scale), 0.0)?;
        let m = (m.affine(f(k.b1), 0.0)? + g.affine(f(1.0 - k.b1), 0.0)?)?;
        let v = (v.affine(f(k.b2), 0.0)? + (g.affine(f(1.0 - k.b2), 0.0)? * &g)?)?;
        (m, v)
    };
    // Two passes, not affine(inv, eps): a compiler that fuses x * a + b
    // into one rounding (nvcc does) would round differently from the host.
    let denom = v
        .sqrt()?
        .affine(f(k.inv_bc2_sqrt), 0.0)?
        .affine(1.0, f(k.eps))?;
    let step = (m.affine(f(k.step_size), 0.0)? / denom)?;
    let p = match mask {
        Some(mask) if lr_wd != 0.0 => {
            // 1 - lr wd where the mask is 1, exactly 1.0 where it is 0.
            let decay = mask.affine(-f(lr_wd), 1.0)?;
            (p * decay)?
        }
        _ => p,
    };
    state[0] = m;
    state[1] = v;
    p - step
}

/// SGD over (n,) tensors, the host loop's ops in its order:
/// g = grad * scale + wd p (where the mask is 1); b = g on the first step,
/// else momentum b + g; p = p - lr (nesterov ? g + momentum b : b).
#[allow(clippy::too_many_arguments)]
fn sgd(
    c: &SgdConfig,
    first: bool,
    lr: f32,
    grad_scale: f32,
    mask: Option<&Tensor>,
    p: Tensor,
    grad: &Tensor,
    state: &mut [Tensor],
) -> candle_core::Result<Tensor> {
    let f = |x: f32| x as f64;
    let mut g = grad.affine(f(grad_scale), 0.0)?;
    if let Some(mask) = mask {
        g = (g + (mask.affine(f(c.weight_decay), 0.0)? * &p)?)?;
    }
    if c.momentum != 0.0 {
        let b = if first {
            g.clone()
        } else {
            (state[0].affine(f(c.momentum), 0.0)? + &g)?
        };
        g = if c.nesterov {
            (g + b.affine(f(c.momentum), 0.0)?)?
        } else {
            b.clone()
        };
        state[0] = b;
    }
    p - g.affine(f(lr), 0.0)?
}

impl Optimizer for DeviceOptimizer {
    fn steps_in_ranges(&self) -> bool {
        true
    }

    fn begin_step(&mut self) {
        STEPS.fetch_add(1, Ordering::Relaxed);
        self.t += 1;
    }

    fn step_range(
        &mut self,
        sub: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
    ) {
        check_sub(self.kind(), &self.range, &sub, params.len(), grads.len());
        assert!(self.t > 0, "{}: step_range before begin_step", self.kind());
        // The trait's step cannot fail (the host loops cannot); a device
        // that fails here (out of memory, a lost GPU) ends the rank with
        // what it said, as the disk optimizer's I/O errors do.
        if let Err(e) = self.update(sub, params, grads, lr, grad_scale) {
            panic!(
                "the optimizer's step on {:?} failed: {e}",
                self.device.location()
            );
        }
    }

    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn state_bytes(&self) -> usize {
        self.bufs.len() * self.range.len() * 4
    }

    fn kind(&self) -> &'static str {
        match self.rule {
            Rule::AdamW(_) => "adamw",
            Rule::Sgd(_) => "sgd",
        }
    }

    fn state(&self) -> std::io::Result<OptimState> {
        let bufs = self
            .bufs
            .iter()
            .map(|(name, b)| Ok((*name, b.to_vec1::<f32>().map_err(std::io::Error::other)?)))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok((bufs, self.t))
    }

    fn state_names(&self) -> Vec<&'static str> {
        self.bufs.iter().map(|(name, _)| *name).collect()
    }

    fn load_state(&mut self, name: &str, values: &[f32]) -> std::io::Result<()> {
        let kind = self.kind();
        let n = self.range.len();
        let Some((_, buf)) = self.bufs.iter_mut().find(|(b, _)| *b == name) else {
            return Err(super::unknown_state(kind, name));
        };
        if values.len() != n {
            return Err(std::io::Error::other(format!(
                "{kind} state {name:?}: {} values for a range of {n}",
                values.len()
            )));
        }
        *buf = Tensor::from_slice(values, n, &self.device).map_err(std::io::Error::other)?;
        Ok(())
    }

    fn set_step_count(&mut self, t: u64) {
        self.t = t;
    }

    fn as_device(&mut self) -> Option<&mut DeviceOptimizer> {
        Some(self)
    }

    fn freeze_variance_after(&mut self, after: u64) -> std::result::Result<(), String> {
        match self.rule {
            Rule::AdamW(_) => {
                self.freeze_after = after;
                Ok(())
            }
            Rule::Sgd(_) => Err("sgd has no second moment to freeze (only adamw does)".into()),
        }
    }
}
