//! The one runtime that executes any schedule table for one step.
//!
//! It walks the rank's actions in order. A forward takes its input from the
//! micro-batch (chunk 0), from a local hand-off (the previous chunk ran on
//! this rank) or from a received activation; its output goes to a local
//! hand-off or waits for its `SendAct`. Backwards mirror that with
//! gradients; the last chunk's backward starts from the loss scale `1 / m`,
//! so the accumulated gradient is that of the mean loss over micro-batches.
//! Receives are posted `lookahead` actions ahead of their use (see `p2p`).
//!
//! What a step holds per (micro-batch, chunk) between its passes is the
//! engine's `Stash` (between F and B, or F and I) and `WeightStash` (between
//! I and W); their number is the "in flight" count the timeline records.
//!
//! Driven by `Pipeline::forward_backward`; the doc example there runs it.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use candle_core::{DType, Shape, Tensor};
use phalanx_comm::ProcessGroup;

use super::links::Links;
use super::p2p::{self, Dir, Pending};
use super::schedule::{Action, Schedule};
use super::trace::{Event, EventKind, Timeline};
use crate::engine::stack::{Stack, WeightStash};
use crate::engine::{Engine, Stash};
use crate::error::{Error, Result};
use crate::ledger::Mem;
use crate::strategy::held::{keep_failure, NoHostGrads};

/// A source of micro-batches: `batch(a) = (inputs, targets)` of micro-batch `a`.
pub type BatchFn<'a> = dyn FnMut(usize) -> Result<(Tensor, Tensor)> + 'a;

/// What a step tells its caller as this stage's gradients become final:
/// the place to start a data-parallel reduction (all-reduce, or ZeRO's
/// reduce-scatter) that overlaps the rest of the schedule. A closure
/// `FnMut(chunk, &mut Engine) -> Result<()>` is one that is told chunk by
/// chunk.
pub trait GradsFinal {
    /// Whether to be told block by block as well ([`GradsFinal::block`]):
    /// only where the gradients are held on the device
    /// (`Engine::hold_grads`), since the chunk's last backward then runs
    /// with a sink that refuses any gradient reaching the host.
    fn by_block(&self) -> bool {
        false
    }

    /// After block `block`'s backward within chunk `chunk`'s last backward
    /// of the step (top block first): the held gradients of the parameters
    /// that only this block and those above it in the chunk read are final
    /// (`Stack::take_held_grads`). Returns how many reductions it started
    /// (the timeline records a `DpLaunch` where any did).
    fn block(&mut self, chunk: usize, block: usize, stack: &Stack) -> Result<usize> {
        let _ = (chunk, block, stack);
        Ok(0)
    }

    /// Once chunk `chunk`'s last backward of the step has run: the
    /// gradients of the parameters it owns are final on this stage (tied
    /// ones still lack the other stages' share), in the flat buffer or,
    /// held on the device, in the engine's held gradients.
    fn chunk(&mut self, chunk: usize, engine: &mut Engine) -> Result<()>;
}

impl<F: FnMut(usize, &mut Engine) -> Result<()>> GradsFinal for F {
    fn chunk(&mut self, chunk: usize, engine: &mut Engine) -> Result<()> {
        self(chunk, engine)
    }
}

/// Everything one step needs.
pub(super) struct Step<'a> {
    pub engine: &'a mut Engine,
    pub pg: &'a ProcessGroup,
    pub schedule: &'a Schedule,
    pub rank: usize,
    /// Block range of every chunk (global numbering).
    pub chunks: &'a [Range<usize>],
    pub timeline: &'a mut Timeline,
    pub step: u64,
    pub lookahead: usize,
    /// The fp16 loss scale (1 otherwise): the last chunk's backward starts
    /// from `loss_scale / m`.
    pub loss_scale: f32,
    /// Where the data moves over device links (see `links`) instead of
    /// tagged host messages.
    pub links: Option<&'a mut Links>,
}

/// What a step leaves behind.
pub(super) struct Outcome {
    /// Sum of the micro-batch losses (last stage only; 0 elsewhere).
    pub loss_sum: f64,
    pub peak_in_flight: usize,
    pub peak_activation_bytes: usize,
}

fn missing(what: &str, a: &Action) -> Error {
    Error::Check(format!("pipeline runtime: no {what} for {a:?}"))
}

/// Run this rank's table once.
pub(super) fn run(mut s: Step, batch: &mut BatchFn, done: &mut dyn GradsFinal) -> Result<Outcome> {
    let sched = s.schedule;
    let (p, m, rank) = (sched.p, sched.m, s.rank);
    let last = sched.num_chunks() - 1;
    let owner = |c: usize| c % p;
    let dev = s.engine.device().clone();
    let split = sched.kind.split_backward();
    let actions = &sched.ranks[rank];
    // Receives posted ahead (tagged host messages); links post their own,
    // in their senders' order.
    let recvs: Vec<Action> = actions
        .iter()
        .filter(|a| matches!(a, Action::RecvAct { .. } | Action::RecvGrad { .. }))
        .filter(|_| s.links.is_none())
        .copied()
        .collect();
    if let Some(l) = s.links.as_deref_mut() {
        l.begin_step()?;
    }
    let scale = Tensor::new(s.loss_scale / m as f32, &dev)?;

    let mut data: HashMap<usize, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
    let mut inputs: HashMap<(usize, usize), Tensor> = HashMap::new();
    let mut grads_in: HashMap<(usize, usize), Tensor> = HashMap::new();
    // Outputs waiting for their send: activations by producing chunk,
    // input gradients by the chunk whose input they are.
    let mut act_out: HashMap<(usize, usize), Tensor> = HashMap::new();
    let mut grad_out: HashMap<(usize, usize), Tensor> = HashMap::new();
    let (holds_first, holds_last) = (owner(0) == rank, owner(last) == rank);
    let mut out_meta: HashMap<(usize, usize), (Shape, DType)> = HashMap::new();
    let mut stashes: HashMap<(usize, usize), Stash> = HashMap::new();
    let mut wstashes: HashMap<(usize, usize), WeightStash> = HashMap::new();
    let mut posted: VecDeque<(Action, Pending)> = VecDeque::new();
    let (mut next_post, mut consumed) = (0usize, 0usize);
    let (mut in_flight, mut peak, mut peak_bytes) = (0usize, 0usize, 0usize);
    let mut loss_sum = 0f64;
    let mut hook = |_: usize, _: &mut [f32]| Ok(());
    // Final backwards still to run, per chunk of this rank.
    let mut left: HashMap<usize, usize> = HashMap::new();
    for a in actions.iter().filter(|a| a.is_last_backward()) {
        *left.entry(a.chunk()).or_default() += 1;
    }

    for a in actions {
        if let Some(l) = s.links.as_deref_mut() {
            let meta = |mb: usize, c: usize| out_meta.get(&(mb, c)).cloned();
            l.post_ahead(s.pg, s.step, &dev, &meta, s.lookahead.max(1))?;
        }
        // Post receives ahead, in consumption order; a gradient's receive
        // waits until the forward that fixes its shape has run.
        while next_post < recvs.len() && next_post < consumed + s.lookahead.max(1) {
            let r = recvs[next_post];
            let (mb, c) = (r.mb(), r.chunk());
            let pend = match r {
                Action::RecvAct { .. } => p2p::post_act(
                    s.pg,
                    owner(c - 1),
                    p2p::tag(s.step, Dir::ActHeader, mb, c),
                    p2p::tag(s.step, Dir::Act, mb, c),
                ),
                _ => match out_meta.get(&(mb, c)) {
                    Some((shape, dt)) => p2p::post_known(
                        s.pg,
                        owner(c + 1),
                        p2p::tag(s.step, Dir::Grad, mb, c),
                        shape,
                        *dt,
                    )?,
                    None => break,
                },
            };
            posted.push_back((r, pend));
            next_post += 1;
        }
        let (mb, c) = (a.mb(), a.chunk());
        let lc = c / p;
        let t0 = s.timeline.now_us();
        // The chunk's last backward of the step, told block by block.
        let by_block = a.is_last_backward() && left.get(&c) == Some(&1) && done.by_block();
        let kind = match *a {
            Action::Forward { .. } => {
                if (c == 0 || c == last) && !data.contains_key(&mb) {
                    // Only the first and last stages need the micro-batch.
                    let (x, y) = batch(mb)?;
                    data.insert(mb, (holds_first.then_some(x), holds_last.then_some(y)));
                }
                let x = if c == 0 {
                    let d = data.get_mut(&mb).and_then(|d| d.0.take());
                    d.ok_or_else(|| missing("micro-batch inputs", a))?
                } else {
                    inputs.remove(&(mb, c)).ok_or_else(|| missing("input", a))?
                };
                let tg = if c == last {
                    let d = data.get_mut(&mb).and_then(|d| d.1.take());
                    Some(d.ok_or_else(|| missing("targets", a))?)
                } else {
                    None
                };
                let range = s.chunks[c].clone();
                let (y, stash) = if split {
                    s.engine.forward_range_frozen(range, &x, tg.as_ref())?
                } else {
                    s.engine.forward_range(range, &x, tg.as_ref())?
                };
                if c == last {
                    loss_sum += y.to_scalar::<f32>()? as f64;
                } else {
                    out_meta.insert((mb, c), (y.shape().clone(), y.dtype()));
                    if owner(c + 1) == rank {
                        inputs.insert((mb, c + 1), y);
                    } else {
                        act_out.insert((mb, c), y);
                    }
                }
                if data
                    .get(&mb)
                    .is_some_and(|d| d.0.is_none() && d.1.is_none())
                {
                    data.remove(&mb);
                }
                stashes.insert((mb, c), stash);
                in_flight += 1;
                peak = peak.max(in_flight);
                EventKind::Forward
            }
            Action::Backward { .. } | Action::BackwardInput { .. } => {
                let gy = if c == last {
                    scale.clone()
                } else {
                    grads_in
                        .remove(&(mb, c))
                        .ok_or_else(|| missing("gradient", a))?
                };
                let stash = stashes
                    .remove(&(mb, c))
                    .ok_or_else(|| missing("stash", a))?;
                let full = matches!(a, Action::Backward { .. });
                let dx = if full && by_block {
                    in_flight -= 1;
                    let pass = LastPass::Full(stash, gy);
                    by_blocks(&mut s, done, pass, (mb, c, lc))?
                } else if full {
                    in_flight -= 1;
                    s.engine.backward_range(stash, &gy, &mut hook)?
                } else {
                    let (dx, w) = s.engine.backward_input_range(stash, &gy)?;
                    wstashes.insert((mb, c), w);
                    dx
                };
                if c > 0 {
                    let dx = dx.ok_or_else(|| missing("input gradient", a))?;
                    if owner(c - 1) == rank {
                        grads_in.insert((mb, c - 1), dx);
                    } else {
                        grad_out.insert((mb, c), dx);
                    }
                }
                if full {
                    EventKind::Backward
                } else {
                    EventKind::BackwardInput
                }
            }
            Action::BackwardWeight { .. } => {
                let w = wstashes
                    .remove(&(mb, c))
                    .ok_or_else(|| missing("W stash", a))?;
                if by_block {
                    by_blocks(&mut s, done, LastPass::Weight(w), (mb, c, lc))?;
                } else {
                    s.engine.backward_weight_range(w, &mut hook)?;
                }
                in_flight -= 1;
                EventKind::BackwardWeight
            }
            Action::SendAct { .. } | Action::SendGrad { .. } => {
                if matches!(a, Action::SendAct { .. }) {
                    let t = act_out
                        .remove(&(mb, c))
                        .ok_or_else(|| missing("output", a))?;
                    let th = p2p::tag(s.step, Dir::ActHeader, mb, c + 1);
                    let td = p2p::tag(s.step, Dir::Act, mb, c + 1);
                    match s.links.as_deref_mut() {
                        Some(l) => l.send(s.pg, &t, owner(c + 1), Some(th))?,
                        None => p2p::send_tensor(s.pg, &t, owner(c + 1), td, Some(th))?,
                    }
                    EventKind::SendAct
                } else {
                    let t = grad_out
                        .remove(&(mb, c))
                        .ok_or_else(|| missing("output", a))?;
                    let td = p2p::tag(s.step, Dir::Grad, mb, c - 1);
                    match s.links.as_deref_mut() {
                        Some(l) => l.send(s.pg, &t, owner(c - 1), None)?,
                        None => p2p::send_tensor(s.pg, &t, owner(c - 1), td, None)?,
                    }
                    EventKind::SendGrad
                }
            }
            Action::RecvAct { .. } | Action::RecvGrad { .. } => {
                let t = match s.links.as_deref_mut() {
                    Some(l) => {
                        let (from, key) = match a {
                            Action::RecvAct { .. } => (owner(c - 1), (Dir::Act, mb, c)),
                            _ => (owner(c + 1), (Dir::Grad, mb, c)),
                        };
                        let meta = |mb: usize, c: usize| out_meta.get(&(mb, c)).cloned();
                        l.recv(s.pg, from, key, s.step, &dev, &meta)?
                    }
                    None => {
                        let (r, pend) = posted
                            .pop_front()
                            .ok_or_else(|| missing("posted receive", a))?;
                        if r != *a {
                            return Err(Error::Check(format!(
                                "pipeline runtime: receive {a:?} out of order (posted {r:?})"
                            )));
                        }
                        pend.wait(s.pg, &dev)?
                    }
                };
                consumed += 1;
                if matches!(a, Action::RecvAct { .. }) {
                    inputs.insert((mb, c), t);
                    EventKind::WaitAct
                } else {
                    grads_in.insert((mb, c), t);
                    EventKind::WaitGrad
                }
            }
        };
        let t1 = s.timeline.now_us();
        s.timeline.record(Event {
            kind,
            step: s.step,
            mb,
            chunk: lc,
            start_us: t0,
            dur_us: t1 - t0,
        });
        peak_bytes = peak_bytes.max(s.engine.ledger().current(Mem::Activations));
        if a.is_last_backward() {
            let n = left.get_mut(&c).ok_or_else(|| missing("chunk count", a))?;
            *n -= 1;
            if *n == 0 {
                done.chunk(c, s.engine)?;
            }
        }
    }
    if let Some(l) = s.links.as_deref_mut() {
        l.end_step()?;
    }
    let unsent = act_out.len() + grad_out.len();
    if !stashes.is_empty() || !wstashes.is_empty() || unsent > 0 || !posted.is_empty() {
        return Err(Error::Check(format!(
            "pipeline runtime: rank {rank} ended the step with {} stashes, {} weight stashes, \
             {} unsent and {} unreceived tensors",
            stashes.len(),
            wstashes.len(),
            unsent,
            posted.len()
        )));
    }
    Ok(Outcome {
        loss_sum,
        peak_in_flight: peak,
        peak_activation_bytes: peak_bytes,
    })
}

/// A chunk's last backward pass: a whole one (its stash and upstream
/// gradient), or zero-bubble's W.
enum LastPass {
    Full(Stash, Tensor),
    Weight(WeightStash),
}

/// Run a chunk's last backward with its gradients held on the device,
/// telling `done` after each block (`GradsFinal::block`); a gradient that
/// reaches the host fails it. The timeline records a `DpLaunch` (no
/// duration) where a block started reductions. `at` is (micro-batch,
/// chunk, the rank's local chunk). Returns the input gradient (a whole
/// pass).
fn by_blocks(
    s: &mut Step,
    done: &mut dyn GradsFinal,
    pass: LastPass,
    at: (usize, usize, usize),
) -> Result<Option<Tensor>> {
    let (mb, c, lc) = at;
    let (stack, src) = (s.engine.stack(), s.engine.param_source());
    let (timeline, step) = (&mut *s.timeline, s.step);
    let mut failed = None;
    let mut h = |b: usize, _: &mut NoHostGrads| -> candle_core::Result<()> {
        let t = timeline.now_us();
        let n = keep_failure(done.block(c, b, stack), &mut failed)?;
        if n > 0 {
            timeline.record(Event {
                kind: EventKind::DpLaunch,
                step,
                mb,
                chunk: lc,
                start_us: t,
                dur_us: 0.0,
            });
        }
        Ok(())
    };
    let mut sink = NoHostGrads("pipeline");
    let r = match pass {
        LastPass::Full(stash, gy) => stack.backward(stash, &gy, src, &mut sink, &mut h),
        LastPass::Weight(w) => stack
            .backward_weight(w, src, &mut sink, &mut h)
            .map(|_| None),
    };
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(r?)
}
