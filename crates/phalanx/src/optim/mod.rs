//! Optimizers over flat f32 buffers, each one fused loop, able to update any
//! `[lo, hi)` range of the flat buffer (a ZeRO-1/2 shard) with state for that
//! range only; learning-rate schedules; global-norm gradient clipping whose
//! sum of squares can be reduced across shards before the scale is taken.
//!
//! ```
//! use phalanx::engine::{Layout, ParamDecl};
//! use phalanx::ledger::Ledger;
//! use phalanx::optim::{clip, AdamW, AdamWConfig, LrSchedule, Optimizer};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2, 2]), ParamDecl::new("b", &[2])]]).unwrap();
//! let (mut params, mut grads) = (vec![1.0f32; 6], vec![3.0f32; 6]);
//! let mut opt = AdamW::new(AdamWConfig::default(), &layout, 0..6, &Ledger::new());
//! let sched = LrSchedule::Constant { lr: 1e-2 };
//! // The norm of a shard is all-reduced first in ZeRO; here there is one shard.
//! let (norm, scale) = clip::clip_scale(clip::sum_squares(&grads), 1.0);
//! assert!((norm - 6f32.sqrt() * 3.0).abs() < 1e-5);
//! opt.step(&mut params, &grads, sched.lr(0), scale);
//! assert!(params.iter().all(|&p| p < 1.0));
//! ```

pub mod adamw;
pub mod clip;
pub mod device;
pub mod offload;
pub mod schedule;
pub mod sgd;
pub mod step;

use std::ops::Range;

pub use adamw::{AdamW, AdamWConfig};
pub use device::{DeviceOptimizer, Grads};
pub use offload::{from_config, from_config_on, DiskAdamW};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

/// An optimizer's state buffers by name and its step count.
pub type OptimState = (Vec<(&'static str, Vec<f32>)>, u64);

/// An optimizer owning the state of `range()` of the flat parameter buffer.
pub trait Optimizer {
    /// Update `params` from `grads`, both exactly `range()` of the flat
    /// buffers. Gradients are multiplied by `grad_scale` first (the clipping
    /// factor, fused into the same loop; 1.0 for none). By default one
    /// [`Optimizer::begin_step`] and one [`Optimizer::step_range`] over all
    /// of it (optimizers that cannot step in pieces implement this instead).
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, grad_scale: f32) {
        let range = self.range();
        check_lens("optimizer", &range, params.len(), grads.len());
        self.begin_step();
        self.step_range(0..range.len(), params, grads, lr, grad_scale);
    }

    /// The range of the flat buffer this optimizer updates.
    fn range(&self) -> Range<usize>;

    /// Bytes of optimizer state held.
    fn state_bytes(&self) -> usize;

    /// The optimizer's name in checkpoints (`adamw`, `sgd`).
    fn kind(&self) -> &'static str;

    /// Its state for a checkpoint: each buffer by name (PyTorch's names:
    /// `exp_avg`, `exp_avg_sq`, `momentum_buffer`), `range().len()` values
    /// each, and the number of steps taken.
    fn state(&self) -> std::io::Result<OptimState>;

    /// The names of [`Optimizer::state`]'s buffers, without copying them
    /// (a resume asks for each by name: an offloaded or device state is
    /// not read whole for that).
    fn state_names(&self) -> Vec<&'static str>;

    /// Restore a buffer [`Optimizer::state`] named (`values` is
    /// `range().len()` long), and the step count.
    fn load_state(&mut self, name: &str, values: &[f32]) -> std::io::Result<()>;
    fn set_step_count(&mut self, t: u64);

    /// From step `after + 1` on, keep the second moment as it stands after
    /// step `after` and take each gradient as the momentum itself (1-bit
    /// Adam's frozen variance, which a compressing hook that carries the
    /// momentum needs: see `strategy::topk`). Only AdamW has it.
    fn freeze_variance_after(&mut self, after: u64) -> std::result::Result<(), String> {
        let _ = after;
        Err(format!(
            "{} has no second moment to freeze (only adamw does)",
            self.kind()
        ))
    }

    /// The optimizer with its state on the device, which can also step on
    /// parameters already there ([`DeviceOptimizer::step_on`]); `None`
    /// for the host's.
    fn as_device(&mut self) -> Option<&mut DeviceOptimizer> {
        None
    }

    /// Whether [`Optimizer::begin_step`] / [`Optimizer::step_range`] work.
    fn steps_in_ranges(&self) -> bool {
        false
    }

    /// Start a step applied in pieces by [`Optimizer::step_range`] (a
    /// parameter shard streamed from disk): the step count advances here,
    /// once. Panics for optimizers that cannot step in pieces.
    fn begin_step(&mut self) {
        panic!("this optimizer cannot step in pieces (begin_step)");
    }

    /// Apply the step begun by [`Optimizer::begin_step`] to `sub`, a range
    /// relative to `range()` (`params` and `grads` are exactly `sub`). The
    /// pieces of one step, together covering `range()` once, give the same
    /// result, bit for bit, as one [`Optimizer::step`].
    fn step_range(
        &mut self,
        sub: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
    ) {
        let _ = (sub, params, grads, lr, grad_scale);
        panic!("this optimizer cannot step in pieces (step_range)");
    }
}

/// Panic unless `sub` lies in `range` and the slices are `sub`'s length.
fn check_sub(name: &str, range: &Range<usize>, sub: &Range<usize>, params: usize, grads: usize) {
    assert!(
        sub.start <= sub.end && sub.end <= range.len() && params == sub.len() && grads == sub.len(),
        "{name}: piece {sub:?} of range {range:?} needs {} params and grads inside it, got {params} and {grads}",
        sub.len()
    );
}

/// The parts of run-length `segments` (relative to an optimizer's range)
/// inside `sub`, relative to `sub.start`.
fn segments_in<'a>(
    segments: &'a [(Range<usize>, bool)],
    sub: &Range<usize>,
) -> impl Iterator<Item = (Range<usize>, bool)> + 'a {
    let sub = sub.clone();
    segments.iter().filter_map(move |(r, d)| {
        let lo = r.start.max(sub.start);
        let hi = r.end.min(sub.end);
        (lo < hi).then(|| (lo - sub.start..hi - sub.start, *d))
    })
}

/// Panic with a clear message when a step is given the wrong slices: this is
/// a caller bug, not a run-time condition.
fn check_lens(name: &str, range: &Range<usize>, params: usize, grads: usize) {
    assert!(
        params == range.len() && grads == range.len(),
        "{name}: range {range:?} needs {} params and grads, got {params} and {grads}",
        range.len()
    );
}

/// The error for a state buffer an optimizer does not have.
fn unknown_state(kind: &str, name: &str) -> std::io::Error {
    std::io::Error::other(format!("{kind} has no state buffer {name:?}"))
}

/// Copy `values` into `dst`, checking the length.
fn load_into(kind: &str, name: &str, dst: &mut [f32], values: &[f32]) -> std::io::Result<()> {
    if dst.len() != values.len() {
        return Err(std::io::Error::other(format!(
            "{kind} state {name:?}: {} values for a range of {}",
            values.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(values);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Layout, ParamDecl};
    use crate::ledger::Ledger;

    /// `state_names` names what `state` holds, for every optimizer.
    #[test]
    fn state_names_are_the_state_buffers() {
        let layout = Layout::new(vec![vec![ParamDecl::new("w", &[8, 4])]]).unwrap();
        let ledger = Ledger::new();
        let dir = std::env::temp_dir().join(format!("phalanx-names-{}", std::process::id()));
        let sgd = |momentum| SgdConfig {
            momentum,
            nesterov: false,
            weight_decay: 0.0,
        };
        let opts: Vec<Box<dyn Optimizer>> = vec![
            Box::new(AdamW::new(AdamWConfig::default(), &layout, 0..32, &ledger)),
            Box::new(Sgd::new(sgd(0.9), &layout, 0..32, &ledger)),
            Box::new(Sgd::new(sgd(0.0), &layout, 0..32, &ledger)),
            Box::new(
                DiskAdamW::new(
                    AdamWConfig::default(),
                    &layout,
                    0..32,
                    &ledger,
                    &dir,
                    "r0",
                    8,
                )
                .unwrap(),
            ),
        ];
        for o in &opts {
            let (bufs, _) = o.state().unwrap();
            let names: Vec<_> = bufs.iter().map(|(n, _)| *n).collect();
            assert_eq!(o.state_names(), names, "{}", o.kind());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
