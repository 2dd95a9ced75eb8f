//! SGD with momentum, PyTorch semantics (dampening 0), one fused loop:
//!
//!   g = grad * grad_scale + wd p              (L2 decay, matrices only)
//!   b = g on the first step, else momentum b + g
//!   p = p - lr (nesterov ? g + momentum b : b)
//!
//! Momentum state covers `range` only (a shard); none is held when
//! `momentum == 0`.
//!
//! ```
//! use phalanx::engine::{Layout, ParamDecl};
//! use phalanx::ledger::Ledger;
//! use phalanx::optim::{Optimizer, Sgd, SgdConfig};
//! let layout = Layout::new(vec![vec![ParamDecl::new("b", &[2])]]).unwrap();
//! let mut opt = Sgd::new(SgdConfig { momentum: 0.9, ..Default::default() }, &layout, 0..2, &Ledger::new());
//! let mut p = vec![1.0f32, 1.0];
//! opt.step(&mut p, &[1.0, 2.0], 0.1, 1.0); // b = g
//! opt.step(&mut p, &[1.0, 2.0], 0.1, 1.0); // b = 0.9 g + g
//! assert!((p[0] - (1.0 - 0.1 - 0.19)).abs() < 1e-6);
//! ```

use std::ops::Range;

use super::{check_sub, segments_in, Optimizer};
use crate::engine::Layout;
use crate::ledger::{Charge, Ledger, Mem};

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SgdConfig {
    pub momentum: f32,
    pub nesterov: bool,
    /// L2 weight decay (added to the gradient), matrices only.
    pub weight_decay: f32,
}

pub struct Sgd {
    cfg: SgdConfig,
    range: Range<usize>,
    segments: Vec<(Range<usize>, bool)>,
    buf: Vec<f32>,
    t: u64,
    _charge: Charge,
}

impl Sgd {
    pub fn new(cfg: SgdConfig, layout: &Layout, range: Range<usize>, ledger: &Ledger) -> Self {
        assert!(
            range.end <= layout.num_params(),
            "range {range:?} beyond the layout"
        );
        let n = if cfg.momentum != 0.0 { range.len() } else { 0 };
        Self {
            cfg,
            segments: layout.decay_segments(range.clone()),
            range,
            buf: vec![0.0; n],
            t: 0,
            _charge: ledger.charge(Mem::OptState, n * 4),
        }
    }

    /// The momentum buffer (empty without momentum).
    pub fn state(&self) -> &[f32] {
        &self.buf
    }
}

impl Optimizer for Sgd {
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
        check_sub("SGD", &self.range, &sub, params.len(), grads.len());
        assert!(self.t > 0, "SGD: step_range before begin_step");
        let SgdConfig {
            momentum,
            nesterov,
            weight_decay,
        } = self.cfg;
        let first = self.t == 1;
        for (seg, decays) in segments_in(&self.segments, &sub) {
            let wd = if decays { weight_decay } else { 0.0 };
            for i in seg {
                let mut g = grads[i] * grad_scale + wd * params[i];
                if momentum != 0.0 {
                    let b = &mut self.buf[sub.start + i];
                    *b = if first { g } else { momentum * *b + g };
                    g = if nesterov { g + momentum * *b } else { *b };
                }
                params[i] -= lr * g;
            }
        }
    }

    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn state_bytes(&self) -> usize {
        self.buf.len() * 4
    }

    fn kind(&self) -> &'static str {
        "sgd"
    }

    fn state(&self) -> std::io::Result<super::OptimState> {
        // Without momentum there is no buffer (and nothing to save).
        let bufs = if self.cfg.momentum != 0.0 {
            vec![("momentum_buffer", self.buf.clone())]
        } else {
            Vec::new()
        };
        Ok((bufs, self.t))
    }

    fn state_names(&self) -> Vec<&'static str> {
        if self.cfg.momentum != 0.0 {
            vec!["momentum_buffer"]
        } else {
            Vec::new()
        }
    }

    fn load_state(&mut self, name: &str, values: &[f32]) -> std::io::Result<()> {
        match name {
            "momentum_buffer" => super::load_into("sgd", name, &mut self.buf, values),
            _ => Err(super::unknown_state("sgd", name)),
        }
    }

    fn set_step_count(&mut self, t: u64) {
        self.t = t;
    }
}
