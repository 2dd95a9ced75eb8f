//! The one finish-step path every strategy ends its step with:
//!
//! 1. unscale: gradients hold `loss_scale` times the true gradient (fp16);
//! 2. non-finite check, agreed by every rank of the world: one rank's inf or
//!    NaN skips the step everywhere (fp16) or fails the run (fp32, bf16);
//! 3. the global gradient norm, each parameter counted once: a strategy
//!    gives its local sum of squares already weighted (sharded pieces count
//!    on the rank that holds them, a piece every rank of a replica group
//!    holds counts 1/replicas on each) and one all-reduce over the world
//!    adds them up — the same collective carries the non-finite verdict;
//! 4. clip by that norm; 5. the optimizer steps on each piece this rank
//!    updates, with unscale and clip fused into its gradient factor.
//!
//! ```
//! use phalanx::optim::step::{finish_step, Update};
//! use phalanx::optim::{clip, Sgd, SgdConfig};
//! use phalanx::precision::LossScaler;
//! let layout = phalanx::engine::Layout::new(vec![vec![phalanx::engine::ParamDecl::new("w", &[2])]]).unwrap();
//! let p = phalanx_comm::threads::run(1, move |world| {
//!     let cfg = SgdConfig { momentum: 0.0, nesterov: false, weight_decay: 0.0 };
//!     let mut opt = Sgd::new(cfg, &layout, 0..2, &Default::default());
//!     let (mut p, g) = (vec![1.0f32, 1.0], vec![3.0f32 * 8.0, 4.0 * 8.0]); // scaled by 8
//!     let mut scaler = LossScaler::fixed(8.0);
//!     let u = vec![Update { params: &mut p, grads: &g, opt: &mut opt, on_device: None }];
//!     let out = finish_step(&world, clip::sum_squares(&g), u, &mut scaler, 0.1, 0.0, 0).unwrap();
//!     assert!((out.grad_norm - 5.0).abs() < 1e-4 && !out.skipped);
//!     p
//! });
//! assert!((p[0][0] - 0.7).abs() < 1e-6); // 1 - 0.1 * 3
//! //! ```

use super::clip;
use super::Optimizer;
use crate::error::{Error, Result};
use crate::precision::LossScaler;
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::ops::Range;

/// One piece this rank updates: its parameters, its (scaled, reduced)
/// gradients and the optimizer that owns that range's state.
pub struct Update<'a> {
    pub params: &'a mut [f32],
    pub grads: &'a [f32],
    pub opt: &'a mut (dyn Optimizer + Send),
    /// The parameters on the device, where they are there already ((n,)
    /// f32, the current values of `params`): an optimizer on the device
    /// steps on them in place ([`super::DeviceOptimizer::step_on`]) and
    /// writes the result into `params` too.
    pub on_device: Option<&'a candle_core::Tensor>,
}

/// What the finish path did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The global gradient norm before clipping (unscaled); NaN or inf on a
    /// skipped step.
    pub grad_norm: f32,
    /// The step was skipped (a non-finite gradient on some rank).
    pub skipped: bool,
    /// The loss scale the step's gradients were computed with.
    pub loss_scale: f64,
}

/// Unscale, agree on finiteness, take the global norm, clip and step.
/// `local_ss` is this rank's weighted sum of squares of its *scaled*
/// gradients; `world` must hold every rank of the job (collective there).
pub fn finish_step(
    world: &ProcessGroup,
    local_ss: f64,
    updates: Vec<Update>,
    scaler: &mut LossScaler,
    lr: f32,
    max_norm: f32,
    step: usize,
) -> Result<StepOutcome> {
    // Checked before anything is agreed or stepped: parameters on the
    // device need an optimizer there (the caller keeps its device copy as
    // the new values, which a host step would leave stale).
    let mut updates = updates;
    if updates
        .iter_mut()
        .any(|u| u.on_device.is_some() && u.opt.as_device().is_none())
    {
        return Err(Error::Check(
            "parameters on the device for an optimizer on the host".into(),
        ));
    }
    let (out, factor) = agree_and_clip(world, local_ss, scaler, max_norm, step)?;
    if let Some(factor) = factor {
        for u in updates {
            match (u.on_device, u.opt.as_device()) {
                (Some(dev), Some(opt)) => {
                    let grads = super::Grads::Host(u.grads);
                    opt.step_on(Some(u.params), dev, grads, lr, factor)?;
                }
                _ => u.opt.step(u.params, u.grads, lr, factor),
            }
        }
    }
    Ok(out)
}

/// Steps 1-4 of the finish path, without the update: agree on finiteness
/// over `world`, take the global norm and the clip factor, and update the
/// loss scaler. Returns the outcome and, unless the step is skipped, the
/// factor to multiply the scaled gradients by (unscale and clip fused) —
/// for callers that update in pieces, e.g. a parameter shard streamed from
/// disk chunk by chunk with [`crate::optim::Optimizer::step_range`].
pub fn agree_and_clip(
    world: &ProcessGroup,
    local_ss: f64,
    scaler: &mut LossScaler,
    max_norm: f32,
    step: usize,
) -> Result<(StepOutcome, Option<f32>)> {
    let mut ss = [if local_ss.is_finite() {
        local_ss
    } else {
        f64::INFINITY
    }];
    world.all_reduce(&mut ss, ReduceOp::Sum)?;
    let loss_scale = scaler.scale();
    if !ss[0].is_finite() {
        if !scaler.skips_on_overflow() {
            // Every rank is here (the verdict is agreed): name the ranks
            // whose gradients hold them (after any data-parallel reduction,
            // which spreads one rank's inf to its replicas).
            let mine = [local_ss.is_finite() as i32];
            let mut all = vec![0i32; world.size()];
            world.all_gather(&mine, &mut all)?;
            let bad: Vec<usize> = (0..all.len()).filter(|&r| all[r] == 0).collect();
            return Err(Error::Check(format!(
                "the gradients hold inf or NaN at step {step} on rank(s) {bad:?}; {} \
                 (or set train.on_nonfinite = \"skip\" to skip such steps)",
                diverged_hint(max_norm)
            )));
        }
        // (A dynamic fp16 scale stuck at its minimum is an error once the
        // step is logged: `LossScaler::check_floor`, by the trainer.)
        scaler.update(true);
        let out = StepOutcome {
            grad_norm: f32::INFINITY,
            skipped: true,
            loss_scale,
        };
        return Ok((out, None));
    }
    let inv = 1.0 / loss_scale;
    let (norm, clip_factor) = clip::clip_scale(ss[0] * inv * inv, max_norm);
    let clip_factor = if max_norm > 0.0 { clip_factor } else { 1.0 };
    let factor = (clip_factor as f64 * inv) as f32;
    scaler.update(false);
    let out = StepOutcome {
        grad_norm: norm,
        skipped: false,
        loss_scale,
    };
    Ok((out, Some(factor)))
}

/// Sum of squares of `g` (flat positions `offset..`), each element weighted
/// by `weight`, and elements inside `replicated` by `weight / tp`: every
/// tensor-parallel rank holds those whole, so summed over tp they count once.
pub fn weighted_sum_squares(
    g: &[f32],
    offset: usize,
    weight: f64,
    replicated: &[Range<usize>],
    tp: usize,
) -> f64 {
    let mut ss = clip::sum_squares(g);
    if tp > 1 {
        for r in replicated {
            let lo = r.start.max(offset);
            let hi = r.end.min(offset + g.len());
            if lo < hi {
                ss -= (1.0 - 1.0 / tp as f64) * clip::sum_squares(&g[lo - offset..hi - offset]);
            }
        }
    }
    ss * weight
}

/// [`weighted_sum_squares`] of gradients on the device: `g` is the (n,)
/// f32 tensor of flat positions `offset..`.
pub fn weighted_sum_squares_on(
    g: &candle_core::Tensor,
    offset: usize,
    weight: f64,
    replicated: &[Range<usize>],
    tp: usize,
) -> candle_core::Result<f64> {
    use super::device::{read_sums, square_sums};
    let n = g.elem_count();
    // The whole and every replicated part, read back in one copy.
    let mut groups = vec![square_sums(g)?];
    if tp > 1 {
        for r in replicated {
            let lo = r.start.max(offset);
            let hi = r.end.min(offset + n);
            if lo < hi {
                groups.push(square_sums(&g.narrow(0, lo - offset, hi - lo)?)?);
            }
        }
    }
    let sums = read_sums(&groups)?;
    let mut ss = sums[0];
    for part in &sums[1..] {
        ss -= (1.0 - 1.0 / tp as f64) * part;
    }
    Ok(ss * weight)
}

/// What to try when training diverges, given the clipping in force.
pub fn diverged_hint(max_norm: f32) -> String {
    if max_norm > 0.0 {
        format!("lower optim.lr (gradients are already clipped to norm {max_norm})")
    } else {
        "lower optim.lr or enable optim.grad_clip".into()
    }
}
