//! The batch identity `global = micro x dp x accum`, as DeepSpeed's
//! `train_batch_size = train_micro_batch_size_per_gpu x world x
//! gradient_accumulation_steps`.
//!
//! `train.global_batch_size` (0: unset) may be given with any of the other
//! two, as in DeepSpeed:
//! - with both: `dp_for_world` checks the identity;
//! - with one: the other is derived once dp is known (micro with accum
//!   given, accum with micro given);
//! - alone: accum stays `train.grad_accum_steps` (1 unless given) and micro
//!   is derived (DeepSpeed sets accum to 1 and derives micro).
//!
//! Which one is derived is decided when the config is built, from the keys
//! the file and the overrides set (a private flag, not serialised). The
//! derivation is applied by [`TrainConfig::resolve_batch`]; `build` applies
//! it itself when it runs inside a job (torchrun's, mpirun's or srun's
//! variables set), and the trainer applies it for its mesh's dp size
//! otherwise (library use), so that training always runs the resolved
//! numbers. Validation runs again after each change.
//!
//! ```
//! use phalanx::config::TrainConfig;
//! let set = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
//! let mut c = TrainConfig::build(None, &set(&["train.global_batch_size=16", "train.micro_batch_size=4"])).unwrap();
//! assert_eq!(c.dp_for_world(2).unwrap(), 2);
//! c.resolve_batch(2).unwrap();
//! assert_eq!(c.train.grad_accum_steps, 2);
//! let c = TrainConfig::build(None, &set(&["train.global_batch_size=10", "train.micro_batch_size=4", "train.grad_accum_steps=2"])).unwrap();
//! assert!(c.dp_for_world(2).unwrap_err().to_string().contains("10 != 4 * 2 * 2"));
//! ```

use super::{ConfigError, Result, TrainConfig};

/// Which batch number is derived from `train.global_batch_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Derive {
    #[default]
    Nothing,
    Micro,
    Accum,
}

impl Derive {
    /// From which of the three keys the (file + overrides) table sets.
    pub(crate) fn from_table(t: &toml::Table) -> Derive {
        let train = t.get("train").and_then(|v| v.as_table());
        let has = |k: &str| train.is_some_and(|s| s.contains_key(k));
        let global = train
            .and_then(|s| s.get("global_batch_size"))
            .and_then(|v| v.as_integer())
            .unwrap_or(0);
        match (
            global != 0,
            has("micro_batch_size"),
            has("grad_accum_steps"),
        ) {
            (false, _, _) | (true, true, true) => Derive::Nothing,
            (true, true, false) => Derive::Accum,
            (true, false, _) => Derive::Micro,
        }
    }
}

impl TrainConfig {
    /// `(micro_batch_size, grad_accum_steps)` for `dp` data-parallel ranks,
    /// derived from `train.global_batch_size` where the config left one to
    /// derive, with DeepSpeed's identity check.
    pub fn batch_for_dp(&self, dp: usize) -> Result<(usize, usize)> {
        let t = &self.train;
        let (g, m, a) = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps);
        if g == 0 {
            return Ok((m, a));
        }
        let dp = dp.max(1);
        let uneven = |what: &str, by: usize| {
            Err(ConfigError(format!(
                "train.global_batch_size (train_batch_size) {g} is not divisible by {what} = {by}, \
                 so {} cannot be derived",
                if what.starts_with("micro") {
                    "train.grad_accum_steps (gradient_accumulation_steps)"
                } else {
                    "train.micro_batch_size (train_micro_batch_size_per_gpu)"
                }
            )))
        };
        match self.derive {
            Derive::Nothing => {
                if m * dp * a != g {
                    return Err(ConfigError(format!(
                        "check batch related parameters: train_batch_size (train.global_batch_size) is not equal to \
                         micro_batch_per_gpu (train.micro_batch_size) * gradient_acc_step (train.grad_accum_steps) \
                         * data-parallel size: {g} != {m} * {a} * {dp}"
                    )));
                }
                Ok((m, a))
            }
            Derive::Micro => {
                if !g.is_multiple_of(dp * a) {
                    return uneven("grad_accum_steps x dp", dp * a);
                }
                Ok((g / (dp * a), a))
            }
            Derive::Accum => {
                if !g.is_multiple_of(m * dp) {
                    return uneven("micro_batch_size x dp", m * dp);
                }
                Ok((m, g / (m * dp)))
            }
        }
    }

    /// True while a batch number is still to be derived (see
    /// [`resolve_batch`](TrainConfig::resolve_batch)).
    pub fn batch_to_derive(&self) -> bool {
        self.derive != Derive::Nothing
    }

    /// Set the derived batch number for `dp` ranks (see [`batch_for_dp`]).
    ///
    /// [`batch_for_dp`]: TrainConfig::batch_for_dp
    pub fn resolve_batch(&mut self, dp: usize) -> Result<()> {
        let (m, a) = self.batch_for_dp(dp)?;
        self.train.micro_batch_size = m;
        self.train.grad_accum_steps = a;
        self.derive = Derive::Nothing;
        // Checks that read the accumulation (compression under ZeRO-2/3)
        // see the derived number too.
        self.validate()
    }

    /// Keep `global` samples per step on `dp` data-parallel ranks (an
    /// elastic job re-formed with another world size resumes a checkpoint
    /// of that global batch): the micro-batch stays and the accumulation
    /// changes where that divides, else the smallest accumulation whose
    /// micro-batch is no larger. Returns what changed, for the log (None:
    /// nothing to change).
    pub fn keep_global_batch(&mut self, global: usize, dp: usize) -> Result<Option<String>> {
        let (m, a) = (self.train.micro_batch_size, self.train.grad_accum_steps);
        let dp = dp.max(1);
        if m * a * dp == global {
            return Ok(None);
        }
        if !global.is_multiple_of(dp) {
            return Err(ConfigError(format!(
                "cannot keep the global batch of {global} samples on {dp} data-parallel ranks: \
                 it does not divide by {dp}"
            )));
        }
        let (m2, a2) = if global.is_multiple_of(m * dp) {
            (m, global / (m * dp))
        } else {
            // The smallest accumulation that divides a rank's share with a
            // micro-batch no larger than m: the least divisor of the share
            // from ceil(share / m) up (the share itself always is one).
            // Divisors come in pairs around the square root, so this looks
            // at sqrt(share) numbers, not share many (a checkpoint may say
            // 10^12).
            let per = global / dp;
            let lo = per.div_ceil(m.max(1));
            let mut best = per;
            let mut i = 1usize;
            while i <= per / i {
                if per.is_multiple_of(i) {
                    for d in [i, per / i] {
                        if d >= lo && d < best {
                            best = d;
                        }
                    }
                }
                i += 1;
            }
            (per / best, best)
        };
        self.train.micro_batch_size = m2;
        self.train.grad_accum_steps = a2;
        if self.train.global_batch_size != 0 {
            self.train.global_batch_size = global;
        }
        self.derive = Derive::Nothing;
        self.validate()?;
        Ok(Some(format!(
            "keeping the global batch of {global} on dp {dp}: micro-batch {m2} x grad_accum {a2} \
             (the config gives {m} x {a} x dp {dp} = {})",
            m * a * dp
        )))
    }

    /// Inside a job (torchrun's, mpirun's or srun's variables set), resolve
    /// the batch for its dp size.
    pub(crate) fn resolve_batch_from_env(&mut self) -> Result<()> {
        if self.derive == Derive::Nothing {
            return Ok(());
        }
        let job = phalanx_comm::JobSizes::from_env().map_err(|e| ConfigError(e.to_string()))?;
        if job.in_job() {
            let dp = self.dp_for_world(job.world_size)?;
            self.resolve_batch(dp)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(micro: usize, accum: usize) -> TrainConfig {
        TrainConfig::build(
            None,
            &[
                format!("train.micro_batch_size={micro}"),
                format!("train.grad_accum_steps={accum}"),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_global_batch_is_kept_by_the_smallest_accumulation_that_fits() {
        // 12 on dp 2 with micro-batch 4: 6 per rank, 3 x 2.
        let mut c = cfg(4, 1);
        assert!(c.keep_global_batch(12, 2).unwrap().is_some());
        assert_eq!((c.train.micro_batch_size, c.train.grad_accum_steps), (3, 2));
        // The micro-batch stays where it divides.
        let mut c = cfg(4, 1);
        c.keep_global_batch(24, 2).unwrap();
        assert_eq!((c.train.micro_batch_size, c.train.grad_accum_steps), (4, 3));
        // A prime share of about 10^12 per rank (a checkpoint's claim):
        // micro-batch 1, found by looking up to its square root, not 10^12.
        let p = 999_999_999_989usize;
        let mut c = cfg(4, 1);
        c.keep_global_batch(2 * p, 2).unwrap();
        assert_eq!((c.train.micro_batch_size, c.train.grad_accum_steps), (1, p));
        // Not divisible by dp: refused at once, in one readable sentence.
        let e = cfg(4, 1).keep_global_batch((1 << 40) - 1, 2).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("does not divide by 2") && !e.contains("  "),
            "{e}"
        );
    }
}
