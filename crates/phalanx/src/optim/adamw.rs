//! AdamW (decoupled weight decay, Loshchilov & Hutter), PyTorch semantics,
//! one fused loop over a range of the flat buffers:
//!
//!   g = grad * grad_scale
//!   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//!   p = p (1 - lr wd)                         (matrices only, as nanoGPT)
//!   p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//!
//! With the variance frozen after step F ([`Optimizer::freeze_variance_after`],
//! 1-bit Adam's scheme; Tang et al., 2021), a later step takes what it is
//! handed as the momentum in sum form (a compressing hook's velocity
//! u = b1 u + g) and keeps v as step F left it:
//!
//!   m = (1 - b1) g;  p = p - lr m / (sqrt(v / (1 - b2^F)) + eps)
//!
//! The update is then linear in what is handed over, so what an
//! error-feedback hook holds back and delivers later moves the parameters
//! as far as it would have at once (a plain Adam would shrink such delayed
//! spikes by its own normalisation).
//!
//! The state (m, v) covers `range` only, so a ZeRO-1 rank builds it with its
//! shard `[lo, hi)`; the weight-decay mask comes from the layout (elements of
//! parameters with ndim >= 2), run-length encoded.
//!
//! ```
//! use phalanx::engine::{Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! use phalanx::optim::{AdamW, AdamWConfig, Optimizer};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[4, 4])]]).unwrap();
//! let ledger = Ledger::new();
//! let opt = AdamW::new(AdamWConfig::default(), &layout, 0..16, &ledger);
//! assert_eq!(ledger.current(Mem::OptState), 16 * 8);
//! assert_eq!(opt.state_bytes(), 128);
//! ```

use std::ops::Range;

use super::{check_sub, segments_in, Optimizer};
use crate::engine::Layout;
use crate::ledger::{Charge, Ledger, Mem};
use crate::simd_dispatch;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay, applied to matrices (ndim >= 2) only.
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

pub struct AdamW {
    cfg: AdamWConfig,
    range: Range<usize>,
    /// Weight-decay segments, relative to `range.start`.
    segments: Vec<(Range<usize>, bool)>,
    m: Vec<f32>,
    v: Vec<f32>,
    t: u64,
    /// Steps after which v is frozen (0: never).
    freeze_after: u64,
    _charge: Charge,
}

/// Constants of one step, shared by every element (and by the device's
/// AdamW, `super::device`, so that both compute the same numbers).
#[derive(Clone, Copy)]
pub(super) struct StepConsts {
    pub b1: f32,
    pub b2: f32,
    pub eps: f32,
    pub scale: f32,
    /// lr / (1 - b1^t)
    pub step_size: f32,
    /// 1 / sqrt(1 - b2^t)
    pub inv_bc2_sqrt: f32,
    /// 1 - lr wd (1.0 where no decay)
    pub decay: f32,
}

impl StepConsts {
    /// The constants of step `t` (decay 1.0: the caller sets it where a
    /// segment decays), and whether the variance is frozen at this step
    /// (`freeze_after` > 0 and passed).
    pub fn of_step(
        c: &AdamWConfig,
        t: u64,
        freeze_after: u64,
        lr: f32,
        grad_scale: f32,
    ) -> (StepConsts, bool) {
        let frozen = freeze_after > 0 && t > freeze_after;
        // Frozen: v's bias correction stays that of the freeze, and the
        // momentum handed over is complete (no correction).
        let bc1 = if frozen {
            1.0
        } else {
            1.0 - (c.beta1 as f64).powi(t.min(i32::MAX as u64) as i32)
        };
        let t2 = if frozen { freeze_after } else { t };
        let bc2 = 1.0 - (c.beta2 as f64).powi(t2.min(i32::MAX as u64) as i32);
        let k = StepConsts {
            b1: c.beta1,
            b2: c.beta2,
            eps: c.eps,
            scale: grad_scale,
            step_size: (lr as f64 / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            decay: 1.0,
        };
        (k, frozen)
    }
}

/// After the freeze: `g` is the momentum in sum form; v stays.
#[inline(always)]
fn frozen_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: StepConsts) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m = (1.0 - k.b1) * g * k.scale;
        let denom = v.sqrt() * k.inv_bc2_sqrt + k.eps;
        *p = *p * k.decay - k.step_size * *m / denom;
    }
}

#[inline(always)]
fn adamw_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: StepConsts) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g * k.scale;
        *m = k.b1 * *m + (1.0 - k.b1) * g;
        *v = k.b2 * *v + (1.0 - k.b2) * g * g;
        let denom = v.sqrt() * k.inv_bc2_sqrt + k.eps;
        *p = *p * k.decay - k.step_size * *m / denom;
    }
}

impl AdamW {
    /// State for `range` of the flat buffer described by `layout`.
    pub fn new(cfg: AdamWConfig, layout: &Layout, range: Range<usize>, ledger: &Ledger) -> Self {
        assert!(
            range.end <= layout.num_params(),
            "range {range:?} beyond the layout"
        );
        let n = range.len();
        Self {
            cfg,
            segments: layout.decay_segments(range.clone()),
            range,
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
            freeze_after: 0,
            _charge: ledger.charge(Mem::OptState, n * 8),
        }
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Steps taken so far (the t of the bias correction).
    pub fn step_count(&self) -> u64 {
        self.t
    }

    /// First and second moments, for checkpoints.
    pub fn state(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Restore moments and step count (from a checkpoint).
    pub fn set_state(&mut self, m: &[f32], v: &[f32], t: u64) {
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
        self.t = t;
    }
}

impl Optimizer for AdamW {
    fn steps_in_ranges(&self) -> bool {
        true
    }

    fn begin_step(&mut self) {
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
        check_sub("AdamW", &self.range, &sub, params.len(), grads.len());
        assert!(self.t > 0, "AdamW: step_range before begin_step");
        let c = &self.cfg;
        let (base, frozen) = StepConsts::of_step(c, self.t, self.freeze_after, lr, grad_scale);
        for (seg, decays) in segments_in(&self.segments, &sub) {
            let k = StepConsts {
                decay: if decays {
                    1.0 - lr * c.weight_decay
                } else {
                    1.0
                },
                ..base
            };
            let r = seg.clone();
            let s = sub.start + r.start..sub.start + r.end;
            let (p, g) = (&mut params[r.clone()], &grads[r]);
            let (m, v) = (&mut self.m[s.clone()], &mut self.v[s]);
            if frozen {
                simd_dispatch!(frozen_kernel(p, g, m, v, k));
            } else {
                simd_dispatch!(adamw_kernel(p, g, m, v, k));
            }
        }
    }

    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn state_bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * 4
    }

    fn kind(&self) -> &'static str {
        "adamw"
    }

    fn state(&self) -> std::io::Result<super::OptimState> {
        Ok((
            vec![("exp_avg", self.m.clone()), ("exp_avg_sq", self.v.clone())],
            self.t,
        ))
    }

    fn state_names(&self) -> Vec<&'static str> {
        vec!["exp_avg", "exp_avg_sq"]
    }

    fn load_state(&mut self, name: &str, values: &[f32]) -> std::io::Result<()> {
        match name {
            "exp_avg" => super::load_into("adamw", name, &mut self.m, values),
            "exp_avg_sq" => super::load_into("adamw", name, &mut self.v, values),
            _ => Err(super::unknown_state("adamw", name)),
        }
    }

    fn set_step_count(&mut self, t: u64) {
        self.t = t;
    }

    fn freeze_variance_after(&mut self, after: u64) -> std::result::Result<(), String> {
        self.freeze_after = after;
        Ok(())
    }
}
