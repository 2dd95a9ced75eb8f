//! Learning-rate schedules: constant; linear warmup then cosine decay to
//! `min_lr` (llm.c / nanoGPT); and DeepSpeed's WarmupLR (`warmup_constant`)
//! and WarmupDecayLR (`warmup_linear`). [`LrSchedule::from_config`] picks one
//! from `optim.schedule`.
//!
//! Cosine: warmup `lr(s) = max_lr * (s + 1) / warmup` for `s < warmup` (never
//! 0 on the first step). Then `ratio = (s - warmup) / (decay_steps - warmup)`,
//! `lr = min_lr + 0.5 (1 + cos(pi ratio)) (max_lr - min_lr)`; `min_lr` after
//! `decay_steps`.
//!
//! ```
//! use phalanx::optim::LrSchedule;
//! let s = LrSchedule::WarmupCosine { max_lr: 1.0, min_lr: 0.1, warmup: 10, decay_steps: 110 };
//! assert_eq!(s.lr(0), 0.1);
//! assert_eq!(s.lr(10), 1.0);
//! assert!((s.lr(60) - 0.55).abs() < 1e-6);
//! assert_eq!(s.lr(500), 0.1);
//! ```
//!
//! DeepSpeed's schedules, as functions of `s`, Phalanx's step (0-based; the
//! engine of DeepSpeed sets step `k`'s lr from `last_batch_iteration = k -
//! 1`, one step behind, and holds it on a skipped fp16 step: see
//! docs/training.md): `lr = warmup_min_lr + (max_lr - warmup_min_lr) *
//! gamma(s)`, where during warmup `gamma = s / warmup` ("linear") or
//! `ln(s + 1) / ln(warmup)` ("log", DeepSpeed's default; warmup counted as at
//! least 2), and after it `gamma = 1` (WarmupLR) or, for WarmupDecayLR,
//! `max(0, (decay_steps - s) / max(1, decay_steps - warmup))`, decaying to
//! `min_lr` (DeepSpeed decays to warmup_min_lr; the DeepSpeed translation
//! sets `min_lr` to it).
//!
//! ```
//! use phalanx::optim::schedule::{LrSchedule, WarmupType};
//! let w = LrSchedule::WarmupConstant { warmup_min_lr: 0.0, max_lr: 1.0, warmup: 10, warmup_type: WarmupType::Linear };
//! assert_eq!((w.lr(0), w.lr(5), w.lr(10), w.lr(1000)), (0.0, 0.5, 1.0, 1.0));
//! let log = LrSchedule::WarmupConstant { warmup_min_lr: 0.0, max_lr: 1.0, warmup: 10, warmup_type: WarmupType::Log };
//! assert!((log.lr(4) - (5f32.ln() / 10f32.ln())).abs() < 1e-6); // 0.69897
//! let d = LrSchedule::WarmupLinear {
//!     warmup_min_lr: 0.0, max_lr: 1.0, min_lr: 0.0, warmup: 10,
//!     warmup_type: WarmupType::Linear, decay_steps: 110,
//! };
//! assert_eq!((d.lr(5), d.lr(10), d.lr(60), d.lr(110), d.lr(200)), (0.5, 1.0, 0.5, 0.0, 0.0));
//! ```

use crate::config::{LrScheduleKind, OptimConfig};

pub use crate::config::WarmupType;

impl WarmupType {
    /// The warmup fraction at step `s < warmup`; `plus_one` is the cosine
    /// schedule's linear warmup, `(s + 1) / warmup`.
    fn gamma(self, s: usize, warmup: usize, plus_one: bool) -> f64 {
        match self {
            WarmupType::Linear if plus_one => (s + 1) as f64 / warmup as f64,
            WarmupType::Linear => s as f64 / warmup as f64,
            WarmupType::Log => ((s + 1) as f64).ln() / (warmup.max(2) as f64).ln(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    Constant {
        lr: f32,
    },
    WarmupCosine {
        max_lr: f32,
        min_lr: f32,
        warmup: usize,
        /// Step at which the decay reaches `min_lr` (the total, warmup included).
        decay_steps: usize,
    },
    /// `WarmupCosine` whose warmup starts at `warmup_min_lr` (linear:
    /// `warmup_min_lr + (max_lr - warmup_min_lr) (s + 1) / warmup`) or is
    /// logarithmic; with 0 and linear it is `WarmupCosine`.
    WarmupCosineFrom {
        warmup_min_lr: f32,
        max_lr: f32,
        min_lr: f32,
        warmup: usize,
        warmup_type: WarmupType,
        decay_steps: usize,
    },
    /// DeepSpeed's WarmupLR: warmup, then `max_lr`.
    WarmupConstant {
        warmup_min_lr: f32,
        max_lr: f32,
        warmup: usize,
        warmup_type: WarmupType,
    },
    /// DeepSpeed's WarmupDecayLR: warmup, then linear decay to `min_lr` at
    /// `decay_steps`.
    WarmupLinear {
        warmup_min_lr: f32,
        max_lr: f32,
        min_lr: f32,
        warmup: usize,
        warmup_type: WarmupType,
        decay_steps: usize,
    },
}

fn lerp(a: f32, b: f32, t: f64) -> f32 {
    (a as f64 + (b as f64 - a as f64) * t) as f32
}

fn cosine(max_lr: f32, min_lr: f32, step: usize, warmup: usize, decay_steps: usize) -> f32 {
    if step >= decay_steps || decay_steps <= warmup {
        return min_lr;
    }
    let ratio = (step - warmup) as f64 / (decay_steps - warmup) as f64;
    let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
    (min_lr as f64 + coeff * (max_lr - min_lr) as f64) as f32
}

impl LrSchedule {
    /// The schedule `optim.schedule` names, for a run of `total_steps`:
    /// - `constant`: `optim.lr`;
    /// - `cosine`: warmup over `optim.warmup_steps` (from `optim.warmup_min_lr`,
    ///   `optim.warmup_type`), cosine to `optim.min_lr` at `optim.decay_steps`
    ///   (0: `total_steps`), never before `warmup + 1`;
    /// - `warmup_constant`: DeepSpeed's WarmupLR from `optim.warmup_min_lr` to `optim.lr`;
    /// - `warmup_linear`: DeepSpeed's WarmupDecayLR, to `optim.min_lr` at
    ///   `optim.decay_steps` (0: `total_steps`).
    ///
    /// ```
    /// use phalanx::config::TrainConfig;
    /// use phalanx::optim::LrSchedule;
    /// let c = TrainConfig::build(None, &["optim.schedule=warmup_linear".into(), "optim.lr=1.0".into(),
    ///     "optim.min_lr=0.0".into(), "optim.warmup_steps=10".into(), "optim.decay_steps=110".into()]).unwrap();
    /// let s = LrSchedule::from_config(&c.optim, c.train.steps);
    /// assert_eq!((s.lr(0), s.lr(10), s.lr(60)), (0.0, 1.0, 0.5));
    /// ```
    pub fn from_config(o: &OptimConfig, total_steps: usize) -> LrSchedule {
        let (min_lr, max_lr, start) = (o.min_lr as f32, o.lr as f32, o.warmup_min_lr as f32);
        let warmup = o.warmup_steps;
        let warmup_type = o.warmup_type;
        let decay = if o.decay_steps == 0 {
            total_steps
        } else {
            o.decay_steps
        };
        match o.schedule {
            LrScheduleKind::Constant => LrSchedule::Constant { lr: max_lr },
            LrScheduleKind::WarmupConstant => LrSchedule::WarmupConstant {
                warmup_min_lr: start,
                max_lr,
                warmup,
                warmup_type,
            },
            LrScheduleKind::WarmupLinear => LrSchedule::WarmupLinear {
                warmup_min_lr: start,
                max_lr,
                min_lr,
                warmup,
                warmup_type,
                decay_steps: decay,
            },
            LrScheduleKind::Cosine if start == 0.0 && warmup_type == WarmupType::Linear => {
                LrSchedule::WarmupCosine {
                    max_lr,
                    min_lr,
                    warmup,
                    decay_steps: decay.max(warmup + 1),
                }
            }
            LrScheduleKind::Cosine => LrSchedule::WarmupCosineFrom {
                warmup_min_lr: start,
                max_lr,
                min_lr,
                warmup,
                warmup_type,
                decay_steps: decay.max(warmup + 1),
            },
        }
    }

    /// The learning rate of step `step` (0-based).
    pub fn lr(&self, step: usize) -> f32 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                max_lr,
                min_lr,
                warmup,
                decay_steps,
            } => {
                if step < warmup {
                    return max_lr * (step + 1) as f32 / warmup as f32;
                }
                cosine(max_lr, min_lr, step, warmup, decay_steps)
            }
            LrSchedule::WarmupCosineFrom {
                warmup_min_lr,
                max_lr,
                min_lr,
                warmup,
                warmup_type,
                decay_steps,
            } => {
                if step < warmup {
                    return lerp(warmup_min_lr, max_lr, warmup_type.gamma(step, warmup, true));
                }
                cosine(max_lr, min_lr, step, warmup, decay_steps)
            }
            LrSchedule::WarmupConstant {
                warmup_min_lr,
                max_lr,
                warmup,
                warmup_type,
            } => {
                if step < warmup {
                    return lerp(
                        warmup_min_lr,
                        max_lr,
                        warmup_type.gamma(step, warmup, false),
                    );
                }
                max_lr
            }
            LrSchedule::WarmupLinear {
                warmup_min_lr,
                max_lr,
                min_lr,
                warmup,
                warmup_type,
                decay_steps,
            } => {
                if step < warmup {
                    return lerp(
                        warmup_min_lr,
                        max_lr,
                        warmup_type.gamma(step, warmup, false),
                    );
                }
                let left = decay_steps.saturating_sub(step) as f64;
                let span = (decay_steps.saturating_sub(warmup) as f64).max(1.0);
                lerp(min_lr, max_lr, (left / span).max(0.0))
            }
        }
    }
}
