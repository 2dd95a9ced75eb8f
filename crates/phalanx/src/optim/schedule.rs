//! Learning-rate schedules: constant, or linear warmup then cosine decay to
//! `min_lr` (llm.c / nanoGPT).
//!
//! Warmup: `lr(s) = max_lr * (s + 1) / warmup` for `s < warmup` (never 0 on
//! the first step). Then `ratio = (s - warmup) / (decay_steps - warmup)`,
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
}

impl LrSchedule {
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
                if step >= decay_steps || decay_steps <= warmup {
                    return min_lr;
                }
                let ratio = (step - warmup) as f64 / (decay_steps - warmup) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                (min_lr as f64 + coeff * (max_lr - min_lr) as f64) as f32
            }
        }
    }
}
