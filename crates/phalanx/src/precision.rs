//! Mixed precision: the loss scaler.
//!
//! fp16 has 5 exponent bits: small gradients underflow to zero. As PyTorch's
//! `GradScaler` and DeepSpeed's `DynamicLossScaler`, the loss is multiplied
//! by a scale before backward (so gradients are too), and the optimizer sees
//! them divided by it again. A step whose gradients hold an inf or NaN on
//! any rank is skipped on every rank and the scale is lowered; after
//! `window` clean steps in a row it is raised again.
//!
//! DeepSpeed's semantics, key for key (`fp16.loss_scale` 0 = dynamic,
//! `initial_scale_power`, `loss_scale_window`, `hysteresis`,
//! `min_loss_scale`): with hysteresis h, the scale is only halved on the
//! h-th overflow since the last halving (the first h-1 overflows are
//! tolerated: the step is still skipped); the hysteresis count is restored
//! when the scale is raised.
//!
//! A scale that has fallen to `min_loss_scale` cannot be lowered further:
//! if the gradients still overflow there, every step would be skipped and
//! training would silently stop moving. After [`FLOOR_OVERFLOWS`]
//! overflowing steps in a row at the minimum scale,
//! [`LossScaler::check_floor`] is an error (DeepSpeed raises at its first
//! overflow there once the hysteresis is spent, `raise_error_at_min_scale`).
//!
//! bf16 and fp32 have fp32's exponent range and need no scaling: their
//! scaler is [`LossScaler::none`], a constant 1 that never skips a step
//! (a non-finite gradient there is an error, not an overflow).
//!
//! ```
//! use phalanx::precision::{LossScaler, ScalerConfig};
//! let mut s = LossScaler::dynamic(ScalerConfig { initial_scale_power: 4, window: 2, hysteresis: 1, min_scale: 1.0 });
//! assert_eq!(s.scale(), 16.0);
//! s.update(true);               // overflow: skip, halve
//! assert_eq!(s.scale(), 8.0);
//! s.update(false);
//! s.update(false);              // two clean steps: double
//! assert_eq!(s.scale(), 16.0);
//! ```

/// Overflowing steps in a row at `fp16.min_loss_scale` after which
/// [`LossScaler::check_floor`] fails. Not 1 (DeepSpeed's): one bad batch at
/// a small scale costs a skipped step, not the run; not many either: at the
/// minimum, lowering the scale is no longer there to help, so three steps in
/// a row that overflow even at the smallest scale allowed, with no clean
/// step between, mean the gradients themselves are inf or NaN (diverged
/// training, a bad input) and every later step would be skipped too.
pub const FLOOR_OVERFLOWS: usize = 3;

/// The dynamic scaler's settings (DeepSpeed's `fp16` section).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerConfig {
    pub initial_scale_power: u32,
    /// Clean steps before the scale is doubled.
    pub window: usize,
    /// Overflows tolerated before the scale is halved (1: halve on each).
    pub hysteresis: usize,
    pub min_scale: f64,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        ScalerConfig {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            min_scale: 1.0,
        }
    }
}

/// The loss scale and its history; part of a checkpoint's state.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    scale: f64,
    /// None: a static scale (never changes, overflow still skips).
    dynamic: Option<DynamicState>,
    /// Skipping is what a scaler is for; without one (fp32, bf16) a
    /// non-finite gradient is an error.
    skips: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
struct DynamicState {
    window: usize,
    hysteresis: usize,
    min_scale: f64,
    /// Overflows left before the next halving.
    cur_hysteresis: usize,
    /// Steps seen, and the step of the last overflow (DeepSpeed's counters).
    iter: u64,
    last_overflow: i64,
    /// Overflowing steps in a row taken at `min_scale` (0 after a clean
    /// step). Checkpoints written before it existed read 0.
    #[serde(default)]
    floor_overflows: usize,
}

impl LossScaler {
    /// No scaling (fp32, bf16).
    pub fn none() -> LossScaler {
        LossScaler {
            scale: 1.0,
            dynamic: None,
            skips: false,
        }
    }

    /// A constant scale (`fp16.loss_scale` > 0); overflowing steps are
    /// still skipped.
    pub fn fixed(scale: f64) -> LossScaler {
        LossScaler {
            scale,
            dynamic: None,
            skips: true,
        }
    }

    pub fn dynamic(c: ScalerConfig) -> LossScaler {
        LossScaler {
            scale: 2f64.powi(c.initial_scale_power as i32),
            dynamic: Some(DynamicState {
                window: c.window.max(1),
                hysteresis: c.hysteresis.max(1),
                min_scale: c.min_scale,
                cur_hysteresis: c.hysteresis.max(1),
                iter: 0,
                last_overflow: -1,
                floor_overflows: 0,
            }),
            skips: true,
        }
    }

    /// This run's scaler (`self`, from the config) resuming `saved`, a
    /// checkpoint's: a dynamic scale keeps its value and its history (the
    /// scale, the steps seen, the last overflow, the overflows left before
    /// the next halving), while what the config says (dynamic or static,
    /// the window, the hysteresis, the floor, and `train.on_nonfinite`'s
    /// skip or stop) is this run's. The result, and whether the checkpoint
    /// said otherwise (for a note).
    pub fn resumed(&self, saved: &LossScaler) -> (LossScaler, bool) {
        let kept = match (&self.dynamic, &saved.dynamic) {
            (Some(c), Some(s)) => LossScaler {
                scale: saved.scale.max(c.min_scale),
                dynamic: Some(DynamicState {
                    cur_hysteresis: s.cur_hysteresis.min(c.hysteresis),
                    iter: s.iter,
                    last_overflow: s.last_overflow,
                    floor_overflows: s.floor_overflows,
                    ..*c
                }),
                skips: self.skips,
            },
            _ => *self,
        };
        let differs = self.skips != saved.skips
            || match (&self.dynamic, &saved.dynamic) {
                (Some(c), Some(s)) => {
                    (c.window, c.hysteresis, c.min_scale) != (s.window, s.hysteresis, s.min_scale)
                }
                (None, None) => self.scale != saved.scale,
                _ => true,
            };
        (kept, differs)
    }

    /// Check a scaler read from a checkpoint: a finite positive scale, and
    /// counters that `update` can step without dividing by zero or
    /// overflowing. The error names the field (`scale`, `dynamic.window`…).
    pub fn check(&self) -> Result<(), String> {
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(format!("scale {} is not a positive number", self.scale));
        }
        let Some(d) = &self.dynamic else {
            return Ok(());
        };
        const MAX: u64 = 1 << 40;
        let bad = if d.window == 0 || d.window as u64 > MAX {
            Some("window")
        } else if d.hysteresis == 0 || d.hysteresis as u64 > MAX {
            Some("hysteresis")
        } else if d.cur_hysteresis == 0 || d.cur_hysteresis > d.hysteresis {
            Some("cur_hysteresis")
        } else if !(d.min_scale.is_finite() && d.min_scale > 0.0) {
            Some("min_scale")
        } else if d.iter > MAX {
            Some("iter")
        } else if d.last_overflow < -1 || d.last_overflow > d.iter as i64 {
            Some("last_overflow")
        } else {
            None
        };
        match bad {
            Some(f) => Err(format!("dynamic.{f} is out of range: {d:?}")),
            None => Ok(()),
        }
    }

    /// The factor the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether an overflow skips the step (fp16) or is an error (fp32, bf16).
    pub fn skips_on_overflow(&self) -> bool {
        self.skips
    }

    /// After a step: `overflow` says whether any rank saw a non-finite
    /// gradient (the step was skipped).
    pub fn update(&mut self, overflow: bool) {
        let scale = &mut self.scale;
        let Some(d) = &mut self.dynamic else {
            return;
        };
        if overflow && *scale <= d.min_scale {
            d.floor_overflows += 1;
        } else if !overflow {
            d.floor_overflows = 0;
        }
        if overflow {
            if d.hysteresis == 1 || d.cur_hysteresis == 1 {
                *scale = (*scale / 2.0).max(d.min_scale);
            } else {
                d.cur_hysteresis -= 1;
            }
            d.last_overflow = d.iter as i64;
        } else if (d.iter as i64 - d.last_overflow).rem_euclid(d.window as i64) == 0 {
            d.cur_hysteresis = d.hysteresis;
            *scale *= 2.0;
        }
        d.iter += 1;
    }

    /// After an overflow that did not lower the scale, what kept it: a
    /// static scale, the minimum, or the hysteresis (as the config names
    /// them).
    pub fn kept_by(&self) -> &'static str {
        match &self.dynamic {
            None => "a static fp16.loss_scale",
            Some(d) if self.scale <= d.min_scale => "at fp16.min_loss_scale",
            Some(_) => "fp16.hysteresis",
        }
    }

    /// After [`LossScaler::update`]: an error once [`FLOOR_OVERFLOWS`]
    /// steps in a row have overflowed at the minimum scale
    /// (`fp16.min_loss_scale`), where lowering the scale no longer helps
    /// and every step would be skipped, silently, from then on. Static
    /// scales and bf16 / fp32 never fail here.
    /// (A message, not [`crate::error::Error`]: this module sits below
    /// the error layer. The trainer calls it after each step is logged, so
    /// the log holds the step that ended the run.)
    pub fn check_floor(&self) -> Result<(), String> {
        match &self.dynamic {
            Some(d) if d.floor_overflows >= FLOOR_OVERFLOWS => Err(format!(
                "fp16: the gradients keep overflowing at the minimum loss scale {} \
                     (fp16.min_loss_scale): {} steps in a row were skipped at it, and the scale \
                     cannot go lower, so every later step would be skipped too. The gradients are \
                     inf or NaN whatever the scale (diverged training: lower optim.lr or enable \
                     optim.grad_clip; or a bad batch), or the floor is too high: lower \
                     fp16.min_loss_scale (and fp16.initial_scale_power, the scale it starts at), \
                     or train in bf16",
                d.min_scale, d.floor_overflows
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_keeps_the_scale_and_takes_the_settings_of_this_run() {
        let c = |window| ScalerConfig {
            initial_scale_power: 10,
            window,
            hysteresis: 2,
            min_scale: 1.0,
        };
        let mut saved = LossScaler::dynamic(c(1000));
        saved.update(true);
        saved.update(true); // 512, hysteresis spent
        let (s, differs) = LossScaler::dynamic(c(1000)).resumed(&saved);
        assert_eq!(
            (s, differs),
            (saved, false),
            "same settings: the saved state whole"
        );
        let (mut s, differs) = LossScaler::dynamic(c(2)).resumed(&saved);
        assert!(differs);
        assert_eq!(s.scale(), 512.0, "the scale carries over");
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 1024.0, "the new window (2) applies");
        // fp32 stopped on a NaN, resumed with train.on_nonfinite = skip.
        let (s, differs) = LossScaler::fixed(1.0).resumed(&LossScaler::none());
        assert!(differs && s.skips_on_overflow());
        let (s, _) = LossScaler::none().resumed(&LossScaler::fixed(1.0));
        assert!(!s.skips_on_overflow());
    }

    #[test]
    fn hysteresis_delays_the_halving() {
        let c = ScalerConfig {
            initial_scale_power: 10,
            window: 1000,
            hysteresis: 2,
            min_scale: 1.0,
        };
        let mut s = LossScaler::dynamic(c);
        s.update(true);
        assert_eq!(s.scale(), 1024.0, "first overflow tolerated");
        s.update(true);
        assert_eq!(s.scale(), 512.0, "second halves");
        s.update(true);
        assert_eq!(s.scale(), 256.0, "hysteresis stays spent until a raise");
    }

    #[test]
    fn window_counts_from_the_last_overflow_and_min_holds() {
        let c = ScalerConfig {
            initial_scale_power: 1,
            window: 3,
            hysteresis: 1,
            min_scale: 1.0,
        };
        let mut s = LossScaler::dynamic(c);
        s.update(true); // iter 0 overflows: 2 -> 1
        s.update(true); // min holds
        assert_eq!(s.scale(), 1.0);
        s.update(false); // iter 2: 1 since overflow
        s.update(false); // iter 3: 2
        assert_eq!(s.scale(), 1.0);
        s.update(false); // iter 4: 3 since overflow -> double
        assert_eq!(s.scale(), 2.0);
    }

    #[test]
    fn overflows_that_go_on_at_the_minimum_scale_are_an_error() {
        let c = ScalerConfig {
            initial_scale_power: 2,
            window: 1000,
            hysteresis: 2,
            min_scale: 1.0,
        };
        let mut s = LossScaler::dynamic(c);
        // 4 -> (hysteresis) 4 -> 2 -> 1: none of these ran at the floor.
        for _ in 0..3 {
            s.update(true);
            assert!(s.check_floor().is_ok());
        }
        assert_eq!(s.scale(), 1.0);
        // Overflows at the floor, broken by a clean step: tolerated.
        for _ in 0..FLOOR_OVERFLOWS - 1 {
            s.update(true);
        }
        s.update(false);
        assert!(
            s.check_floor().is_ok(),
            "a clean step starts the count over"
        );
        for k in 1..=FLOOR_OVERFLOWS {
            s.update(true);
            assert_eq!(s.scale(), 1.0);
            assert_eq!(
                s.check_floor().is_err(),
                k == FLOOR_OVERFLOWS,
                "overflow {k} at the floor"
            );
        }
        let e = s.check_floor().unwrap_err().to_string();
        for key in [
            "fp16.min_loss_scale",
            "fp16.initial_scale_power",
            "overflowing",
        ] {
            assert!(e.contains(key), "{e}");
        }
        // It stays an error while the overflows go on (the run stops at
        // the first), and a clean step clears it.
        s.update(true);
        assert!(s.check_floor().is_err());
        s.update(false);
        assert!(s.check_floor().is_ok());
        // What a resume carries on counting.
        let mut s2 = LossScaler::dynamic(c);
        for _ in 0..3 + FLOOR_OVERFLOWS - 1 {
            s2.update(true);
        }
        let (mut r, _) = LossScaler::dynamic(c).resumed(&s2);
        assert!(r.check_floor().is_ok());
        r.update(true);
        assert!(r.check_floor().is_err(), "the count carries over a resume");
        // A static scale and no scaling never fail here.
        let (mut f, mut n) = (LossScaler::fixed(1.0), LossScaler::none());
        for _ in 0..10 {
            f.update(true);
            n.update(true);
        }
        assert!(f.check_floor().is_ok() && n.check_floor().is_ok());
    }

    #[test]
    fn what_keeps_the_scale_is_named() {
        assert_eq!(
            LossScaler::fixed(1024.0).kept_by(),
            "a static fp16.loss_scale"
        );
        let mut s = LossScaler::dynamic(ScalerConfig {
            initial_scale_power: 2,
            hysteresis: 2,
            min_scale: 2.0,
            ..ScalerConfig::default()
        });
        s.update(true); // held by the hysteresis
        assert_eq!((s.scale(), s.kept_by()), (4.0, "fp16.hysteresis"));
        s.update(true); // lowered to the minimum
        s.update(true);
        assert_eq!((s.scale(), s.kept_by()), (2.0, "at fp16.min_loss_scale"));
    }

    #[test]
    fn none_and_fixed() {
        let mut n = LossScaler::none();
        n.update(true);
        assert_eq!(n.scale(), 1.0);
        assert!(!n.skips_on_overflow());
        let mut f = LossScaler::fixed(128.0);
        f.update(true);
        assert_eq!(f.scale(), 128.0);
        assert!(f.skips_on_overflow());
    }
}
