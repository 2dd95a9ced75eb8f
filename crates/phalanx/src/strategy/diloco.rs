//! LocalSGD, DiLoCo and Streaming DiLoCo on the data-parallel axis.
//!
//! Every data-parallel rank is a *group* that trains on its own: its inner
//! step is DDP inside the group (here a group is one rank, so the inner
//! step is local and sends nothing) with the configured optimizer. Every
//! `H = diloco.inner_steps` steps the groups average their pseudo-gradients
//! (the anchor, i.e. the global parameters at the last outer step, minus
//! their own) and take the outer step on the anchor:
//!
//! ```text
//! Δ_g  = anchor - θ_g                     (each group g)
//! Δ    = mean over the groups of Δ_g      (one all-reduce over the groups)
//! b    = Δ on the first outer step, else μ b + Δ
//! anchor -= lr_out (nesterov ? Δ + μ b : b),   θ_g = anchor
//! ```
//!
//! the outer optimizer being PyTorch's SGD (momentum `μ =
//! diloco.outer_momentum`, `lr_out = diloco.outer_lr`, Nesterov by
//! default). LocalSGD is the outer SGD with lr 1 and momentum 0: the anchor
//! becomes the mean of the groups' parameters. With H = 1, that and an SGD
//! inner optimizer is DDP.
//!
//! Streaming DiLoCo (`diloco.fragments = F`): the flat parameter buffer is
//! cut into F contiguous fragments ([`fragments`]); fragment f syncs after
//! `(f + 1) H / F` steps and every H steps after that ([`Schedule`]), so
//! each fragment travels every H steps and the bytes of one outer step are
//! spread over H / F-step intervals. A fragment's all-reduce is started
//! asynchronously (on a process group of its own, so that the step's other
//! collectives do not wait for it) and applied `τ = diloco.overlap_steps`
//! inner steps later (default 1), overlapping them; the fragment's local
//! parameters then become its new anchor (the τ local steps on that
//! fragment are dropped, torchft's `fragment_update_alpha = 0`). With one
//! fragment the outer step is taken in place (τ = 0).
//!
//! `diloco.quantize`: each group's pseudo-gradient travels as int8 with one
//! f32 scale per 256 values, all-gathered; every rank adds the groups'
//! dequantised values in group order, so all get the same average bit for
//! bit. Per rank that sends (groups - 1)(n + 4 ⌈n / 256⌉) bytes for n
//! values, against the f32 ring all-reduce's 2 (groups - 1)/groups · 4n: a
//! quarter at 2 groups, the same at 8.
//!
//! Checkpoints hold, besides what every group shares (the anchor as
//! `param`, the outer momentum as `outer_momentum_buffer`, an averaged
//! pseudo-gradient still to be applied as `outer_pending`), each group's own
//! parameters and inner optimizer state under `group{g}/…` kinds
//! ([`super::state::group_kind`]), so a resumed run on the same layout is
//! exact. A layout with groups the checkpoint does not hold starts those
//! from the anchor; a DDP checkpoint starts every group from its model.
//!
//! The outer step averages over a process group it is given
//! ([`average_pseudo_gradient`]): the data-parallel ranks in a plain job.
//! Under fault tolerance the groups are replica groups and the trainer
//! takes the outer step over each sync's quorum instead
//! ([`Diloco::set_external_outer`]): a group lost during the inner steps
//! drops out of that outer step.

use super::ddp::{check_identical, Ddp, DdpConfig};
use super::reduce::{CommHook, Pending};
use super::state::{fill_params, group_kind, snapshot, StateFill, StateRange};
use super::{dp_mean, BatchFn, MakeOptimizer, Strategy};
use crate::config::TrainConfig;
use crate::engine::{shard_range, Engine};
use crate::error::{Error, Result};
use crate::ledger::{Charge, Mem};
use crate::mesh::DeviceMesh;
use crate::optim::step::StepOutcome;
use crate::optim::{Optimizer, Sgd, SgdConfig};
use crate::precision::LossScaler;
use candle_core::Tensor;
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::Range;

/// The checkpoint kind of the outer optimizer's momentum.
pub const OUTER_MOMENTUM: &str = "outer_momentum_buffer";
/// The checkpoint kind of averaged pseudo-gradients not yet applied.
pub const OUTER_PENDING: &str = "outer_pending";

/// What a DiLoCo run does (`[diloco]`).
#[derive(Debug, Clone, PartialEq)]
pub struct DilocoConfig {
    /// H: inner steps between a fragment's outer steps.
    pub inner_steps: usize,
    pub outer_lr: f32,
    pub outer_momentum: f32,
    pub nesterov: bool,
    /// F: fragments of the flat parameter buffer (1: DiLoCo).
    pub fragments: usize,
    /// τ: inner steps between a fragment's all-reduce and its outer step.
    pub delay: usize,
    /// int8 pseudo-gradients.
    pub quantize: bool,
    /// With one fragment: check after every outer step that the groups
    /// hold identical parameters (`parallel.check_params_every > 0`).
    pub check: bool,
}

impl DilocoConfig {
    pub fn from_config(cfg: &TrainConfig) -> DilocoConfig {
        let d = &cfg.diloco;
        DilocoConfig {
            inner_steps: d.inner_steps.max(1),
            outer_lr: d.outer_lr as f32,
            outer_momentum: d.outer_momentum as f32,
            nesterov: d.nesterov,
            fragments: d.fragments.max(1),
            delay: d.delay(),
            quantize: d.quantize,
            check: cfg.parallel.check_params_every > 0,
        }
    }

    pub fn schedule(&self) -> Schedule {
        Schedule {
            inner_steps: self.inner_steps,
            fragments: self.fragments,
        }
    }
}

/// When each fragment syncs, in steps done (1 after the first step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub inner_steps: usize,
    pub fragments: usize,
}

impl Schedule {
    /// The step count after which fragment `f` first syncs:
    /// `(f + 1) H / F`, so the last fragment syncs at multiples of H.
    pub fn offset(&self, f: usize) -> usize {
        (f + 1) * self.inner_steps / self.fragments
    }

    /// Per fragment, the inner steps of a run of `steps` after its last
    /// sync: the groups' own, not in the final model (the anchor).
    pub fn left_out(&self, steps: usize) -> Vec<usize> {
        (0..self.fragments)
            .map(|f| {
                let first = self.offset(f);
                if steps < first {
                    steps
                } else {
                    (steps - first) % self.inner_steps
                }
            })
            .collect()
    }

    /// Which sync of fragment `f` happens after `done` steps (0 for the
    /// first), if one does.
    pub fn sync_index(&self, f: usize, done: usize) -> Option<usize> {
        let o = self.offset(f);
        (done >= o && (done - o).is_multiple_of(self.inner_steps))
            .then(|| (done - o) / self.inner_steps)
    }

    /// The fragments that sync after `done` steps.
    pub fn syncing(&self, done: usize) -> Vec<usize> {
        (0..self.fragments)
            .filter(|&f| self.sync_index(f, done).is_some())
            .collect()
    }
}

/// `0..n` cut into `count` contiguous fragments of ⌈n / count⌉ (the last
/// shorter).
pub fn fragments(n: usize, count: usize) -> Vec<Range<usize>> {
    (0..count).map(|f| shard_range(n, f, count)).collect()
}

/// Start averaging `delta`, this group's pseudo-gradient of one fragment,
/// over `groups` (one rank per group): an f32 all-reduce, or with
/// `quantize` int8 values and one f32 scale per 256 all-gathered and added
/// in group order. `wait` gives the mean, bitwise the same on every rank.
pub fn average_pseudo_gradient(groups: &ProcessGroup, delta: Vec<f32>, quantize: bool) -> Pending {
    if !quantize {
        return Pending::work(groups.all_reduce_async(delta, ReduceOp::Avg));
    }
    let (n, w) = (delta.len(), groups.size());
    let (packed, scales, _) = super::hooks::quantise(&delta);
    let (np, ns) = (packed.len(), scales.len());
    let wq = groups.all_gather_async(packed, vec![np; w]);
    let ws = groups.all_gather_async(scales, vec![ns; w]);
    Pending::new(move || {
        let (q, s) = (wq.wait()?, ws.wait()?);
        let mut sum = vec![0f32; n];
        for r in 0..w {
            super::hooks::add_dequantised(
                &mut sum,
                &q[r * np..(r + 1) * np],
                &s[r * ns..(r + 1) * ns],
            );
        }
        let inv = 1.0 / w as f32;
        sum.iter_mut().for_each(|x| *x *= inv);
        Ok(sum)
    })
}

/// An averaged pseudo-gradient on its way.
enum Average {
    Pending(Pending),
    Ready(Vec<f32>),
}

struct InFlight {
    fragment: usize,
    avg: Average,
}

impl InFlight {
    /// Wait for it (once); it stays here, ready.
    fn settle(&mut self) -> Result<&[f32]> {
        if let Average::Pending(_) = self.avg {
            let Average::Pending(p) = std::mem::replace(&mut self.avg, Average::Ready(Vec::new()))
            else {
                unreachable!()
            };
            self.avg = Average::Ready(p.wait()?);
        }
        match &self.avg {
            Average::Ready(v) => Ok(v),
            Average::Pending(_) => unreachable!(),
        }
    }
}

pub struct Diloco {
    cfg: DilocoConfig,
    sched: Schedule,
    /// DDP inside this rank's group (of one rank here: a local step).
    inner: Ddp,
    /// The data-parallel ranks (the step's loss is their mean).
    dp: ProcessGroup,
    /// One rank per group: what outer steps average over (a group of its
    /// own when all-reduces overlap inner steps).
    outer: ProcessGroup,
    frags: Vec<Range<usize>>,
    /// The global parameters at each fragment's last outer step.
    anchor: Vec<f32>,
    /// The outer SGD of each fragment (its momentum).
    outer_opts: Vec<Sgd>,
    /// All-reduces started and not yet applied, in the order they are due.
    in_flight: RefCell<VecDeque<InFlight>>,
    /// After a resume: the averages that were in flight when the
    /// checkpoint was saved, and how many more steps they may be due.
    restored: Option<Vec<f32>>,
    restored_left: usize,
    /// The outer step is the caller's ([`Diloco::set_external_outer`]).
    external: bool,
    /// This group's own parameters while validation runs on the anchor.
    eval_aside: Option<Vec<f32>>,
    _anchor_charge: Charge,
}

impl Diloco {
    /// Broadcast dp rank 0's parameters (every group starts from them),
    /// build the inner DDP inside this rank's group and the outer state.
    /// Collective over the data-parallel ranks.
    pub fn new(
        engine: &mut Engine,
        mesh: &DeviceMesh,
        cfg: DilocoConfig,
        make_opt: &MakeOptimizer,
        bucket_bytes: usize,
    ) -> Result<Diloco> {
        if mesh.tp_size > 1 || mesh.pp_size > 1 {
            return Err(Error::Check(format!(
                "DiLoCo runs on data parallelism alone in this build (tp {}, pp {})",
                mesh.tp_size, mesh.pp_size
            )));
        }
        let dp = mesh.dp().clone();
        dp.broadcast(engine.params_flat_mut(), 0)?;
        // This rank's group: the ranks sharing its dp coordinate, i.e. its
        // tp (x pp) group, which is the rank itself at tp = pp = 1.
        let group_mesh = DeviceMesh::new(mesh.tp(), 1, 1, 1)?;
        let n = engine.num_params();
        let opt = make_opt(engine, 0..n)?;
        let dcfg = DdpConfig {
            bucket_bytes,
            check_every: 0,
        };
        let inner = Ddp::new(engine, &group_mesh, dcfg, opt, Vec::new())?;
        let outer = if cfg.delay > 0 && dp.size() > 1 {
            let all: Vec<usize> = (0..dp.size()).collect();
            dp.new_group(&all)?
                .ok_or_else(|| Error::Check("DiLoCo: this rank is not in its outer group".into()))?
        } else {
            dp.clone()
        };
        let frags = fragments(n, cfg.fragments);
        let scfg = SgdConfig {
            momentum: cfg.outer_momentum,
            nesterov: cfg.nesterov,
            weight_decay: 0.0,
        };
        let outer_opts = frags
            .iter()
            .map(|r| Sgd::new(scfg, engine.layout(), r.clone(), engine.ledger()))
            .collect();
        Ok(Diloco {
            sched: cfg.schedule(),
            cfg,
            inner,
            dp,
            outer,
            frags,
            anchor: engine.params_flat().to_vec(),
            outer_opts,
            in_flight: RefCell::new(VecDeque::new()),
            restored: None,
            restored_left: 0,
            external: false,
            eval_aside: None,
            _anchor_charge: engine.ledger().charge(Mem::OptState, n * 4),
        })
    }

    /// The fragments of the flat parameter buffer, in order.
    pub fn fragment_ranges(&self) -> &[Range<usize>] {
        &self.frags
    }

    /// The global parameters as of each fragment's last outer step.
    pub fn anchor(&self) -> &[f32] {
        &self.anchor
    }

    /// The group outer steps average over.
    pub fn outer_group(&self) -> &ProcessGroup {
        &self.outer
    }

    /// Leave the outer step to the caller: a fault-tolerant trainer, whose
    /// groups are replica groups that average over each outer step's
    /// quorum ([`Diloco::pseudo_gradient`], then [`Diloco::apply_outer`]).
    /// One fragment, taken in place.
    pub fn set_external_outer(&mut self) -> Result<()> {
        if self.cfg.fragments != 1 || self.cfg.quantize {
            return Err(Error::Check(
                "DiLoCo's outer step over a quorum is taken whole and in f32 (diloco.fragments = 1, \
                 diloco.quantize = false)"
                    .into(),
            ));
        }
        self.external = true;
        Ok(())
    }

    /// H: the inner steps between outer steps.
    pub fn inner_steps(&self) -> usize {
        self.cfg.inner_steps
    }

    /// This group's pseudo-gradient: the anchor minus its parameters.
    pub fn pseudo_gradient(&self, engine: &Engine) -> Vec<f32> {
        self.anchor
            .iter()
            .zip(engine.params_flat())
            .map(|(a, p)| a - p)
            .collect()
    }

    /// The outer step after `done` steps with the groups' mean
    /// pseudo-gradient `avg` (a multiple of H; as [`Strategy::finish_step`]
    /// takes it in a plain job).
    pub fn apply_outer(&mut self, engine: &mut Engine, done: usize, avg: &[f32]) -> Result<()> {
        let k = self.sched.sync_index(0, done).ok_or_else(|| {
            Error::Check(format!(
                "DiLoCo: no outer step is due after step {done} (diloco.inner_steps = {})",
                self.cfg.inner_steps
            ))
        })?;
        self.apply(engine, 0, k, avg)
    }

    /// Outer step `index` of fragment `f` with the groups' mean
    /// pseudo-gradient `avg`: the anchor moves, and this group's
    /// parameters of the fragment become it.
    /// A non-finite mean (a group whose parameters overflowed, an int8
    /// block holding NaN) is refused before it reaches the anchor: every
    /// group holds the same mean, so every group stops here together.
    fn apply(&mut self, engine: &mut Engine, f: usize, index: usize, avg: &[f32]) -> Result<()> {
        if let Some(i) = avg.iter().position(|x| !x.is_finite()) {
            return Err(Error::Check(format!(
                "DiLoCo: outer step {index} of fragment {f}: the groups' mean pseudo-gradient is not \
                 finite ({} at element {i}); a group's parameters overflowed or turned NaN (lower \
                 optim.lr or diloco.outer_lr, or resume from an earlier checkpoint)",
                avg[i]
            )));
        }
        let r = self.frags[f].clone();
        let opt = &mut self.outer_opts[f];
        // The step count says whether this is the first step (momentum = Δ).
        opt.set_step_count(index as u64);
        opt.step(&mut self.anchor[r.clone()], avg, self.cfg.outer_lr, 1.0);
        engine.params_flat_mut()[r.clone()].copy_from_slice(&self.anchor[r]);
        Ok(())
    }

    /// The mean pseudo-gradient of fragment `f` due now: the next one in
    /// flight, or (after a resume) one that was in flight at the save.
    fn take_due(&mut self, f: usize, done: usize) -> Result<Vec<f32>> {
        let q = self.in_flight.get_mut();
        if q.front().is_some_and(|x| x.fragment == f) {
            let mut x = q.pop_front().expect("a front");
            return Ok(x.settle()?.to_vec());
        }
        match &self.restored {
            Some(v) => Ok(v[self.frags[f].clone()].to_vec()),
            None => Err(Error::Check(format!(
                "DiLoCo: fragment {f}'s outer step is due after step {done} but its all-reduce was never \
                 started (a checkpoint saved with other diloco settings?)"
            ))),
        }
    }

    /// The outer part of a step, after `done` steps: apply the fragments
    /// due, start the fragments that sync now.
    fn outer_steps(&mut self, engine: &mut Engine, done: usize) -> Result<()> {
        let tau = self.cfg.delay;
        if tau > 0 && done > tau {
            for f in self.sched.syncing(done - tau) {
                let avg = self.take_due(f, done)?;
                let k = self.sched.sync_index(f, done - tau).expect("syncing");
                self.apply(engine, f, k, &avg)?;
            }
        }
        if self.restored.is_some() {
            self.restored_left = self.restored_left.saturating_sub(1);
            if self.restored_left == 0 {
                self.restored = None;
            }
        }
        let now = self.sched.syncing(done);
        for &f in &now {
            let r = self.frags[f].clone();
            let delta: Vec<f32> = self.anchor[r.clone()]
                .iter()
                .zip(&engine.params_flat()[r])
                .map(|(a, p)| a - p)
                .collect();
            let avg = average_pseudo_gradient(&self.outer, delta, self.cfg.quantize);
            if tau == 0 {
                let avg = avg.wait()?;
                let k = self.sched.sync_index(f, done).expect("syncing");
                self.apply(engine, f, k, &avg)?;
            } else {
                self.in_flight.get_mut().push_back(InFlight {
                    fragment: f,
                    avg: Average::Pending(avg),
                });
            }
        }
        if self.cfg.check && tau == 0 && !now.is_empty() && self.cfg.fragments == 1 {
            check_identical(&self.outer, engine.params_flat(), done)?;
        }
        Ok(())
    }
}

impl Strategy for Diloco {
    fn name(&self) -> String {
        let c = &self.cfg;
        let groups = self.outer.size();
        let outer = if c.outer_lr == 1.0 && c.outer_momentum == 0.0 {
            "outer SGD lr 1 (LocalSGD)".to_string()
        } else {
            format!(
                "outer SGD lr {} momentum {}{}",
                c.outer_lr,
                c.outer_momentum,
                if c.nesterov && c.outer_momentum > 0.0 {
                    " Nesterov"
                } else {
                    ""
                }
            )
        };
        let int8 = if c.quantize { ", int8" } else { "" };
        if self.external {
            return format!(
                "DiLoCo (H = {}, {outer}) over each outer step's quorum of replica groups",
                c.inner_steps
            );
        }
        if c.fragments > 1 {
            format!(
                "Streaming DiLoCo (H = {}, {} fragments, τ = {}, {outer}{int8}) over {groups} groups",
                c.inner_steps, c.fragments, c.delay
            )
        } else {
            format!(
                "DiLoCo (H = {}, {outer}{int8}) over {groups} groups",
                c.inner_steps
            )
        }
    }

    fn forward_backward(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        accum: usize,
        loss_scale: f32,
    ) -> Result<f32> {
        // The group's own step (no reduction across groups); the loss is
        // the mean over the groups, for the log.
        let loss = self
            .inner
            .forward_backward(engine, batch, accum, loss_scale)?;
        dp_mean(&self.dp, loss as f64)
    }

    fn finish_step(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        // The inner step: finiteness, norm and clipping are the group's.
        let out = self.inner.finish_step(engine, scaler, lr, max_norm, step)?;
        if !self.external {
            self.outer_steps(engine, step + 1)?;
        }
        Ok(out)
    }

    fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        Ok(engine.eval_loss(x, y)?)
    }

    /// Validation measures the global model (the anchor), as the DiLoCo
    /// papers report it, not the mean of the groups' drifted copies: the
    /// group's own parameters are put aside until [`after_eval`].
    ///
    /// [`after_eval`]: Strategy::after_eval
    fn prepare_eval(&mut self, engine: &mut Engine) -> Result<()> {
        // Set aside once: a second call before `after_eval` must not take
        // the anchor for the group's parameters.
        if self.eval_aside.is_none() {
            let local = engine.params_flat().to_vec();
            engine.params_flat_mut().copy_from_slice(&self.anchor);
            self.eval_aside = Some(local);
        }
        Ok(())
    }

    fn after_eval(&mut self, engine: &mut Engine) -> Result<()> {
        if let Some(local) = self.eval_aside.take() {
            engine.params_flat_mut().copy_from_slice(&local);
        }
        Ok(())
    }

    /// Streaming DiLoCo's all-reduces still in flight at the end (due τ
    /// steps after their sync, past the last step) are applied now: every
    /// group started them, and the final model holds their outer steps.
    fn finish_run(&mut self, engine: &mut Engine, done: usize) -> Result<()> {
        let tau = self.cfg.delay;
        while let Some(mut x) = self.in_flight.get_mut().pop_front() {
            let f = x.fragment;
            // Its sync: the latest of the last τ steps that synced it.
            let synced = (done.saturating_sub(tau) + 1..=done)
                .rev()
                .find(|&s| self.sched.sync_index(f, s).is_some());
            let Some(s) = synced else {
                continue;
            };
            let k = self.sched.sync_index(f, s).expect("synced");
            let avg = x.settle()?.to_vec();
            self.apply(engine, f, k, &avg)?;
        }
        Ok(())
    }

    /// The global model: the anchor, the parameters every group agreed on
    /// at its last outer step (per fragment under Streaming DiLoCo). The
    /// same on every rank; the inner steps since the last outer step (a
    /// run of `train.steps` not a multiple of `diloco.inner_steps`, a
    /// fragment's all-reduce still in flight) are the groups' own and are
    /// not in it.
    fn full_params(&self, _engine: &Engine) -> Result<Vec<f32>> {
        Ok(self.anchor.clone())
    }

    fn optimizers(&self) -> Vec<&(dyn Optimizer + Send)> {
        let mut v = self.inner.optimizers();
        v.extend(self.outer_opts.iter().map(|o| o as &(dyn Optimizer + Send)));
        v
    }

    fn save_state(&self, engine: &Engine) -> Result<Vec<StateRange>> {
        let n = engine.num_params();
        let (g, groups) = (self.outer.rank(), self.outer.size());
        // This group's own parameters and inner optimizer state.
        let opt = self.inner.optimizers()[0];
        let mut own = snapshot(opt, engine.params_flat())?;
        own.group = Some(g);
        // What the groups share, each writing 1/groups of it.
        let mine = shard_range(n, g, groups);
        let mut optim = Vec::new();
        if self.cfg.outer_momentum != 0.0 {
            let m: Vec<f32> = self
                .outer_opts
                .iter()
                .flat_map(|o| o.state().iter().copied())
                .collect();
            optim.push((OUTER_MOMENTUM, m[mine.clone()].to_vec()));
        }
        let mut q = self.in_flight.borrow_mut();
        if !q.is_empty() || self.restored.is_some() {
            let mut pending = self.restored.clone().unwrap_or_else(|| vec![0.0; n]);
            for x in q.iter_mut() {
                let r = self.frags[x.fragment].clone();
                pending[r].copy_from_slice(x.settle()?);
            }
            optim.push((OUTER_PENDING, pending[mine.clone()].to_vec()));
        }
        let shared = StateRange {
            range: mine.clone(),
            params: self.anchor[mine].to_vec(),
            optim,
            optim_kind: own.optim_kind,
            optim_step: own.optim_step,
            group: None,
        };
        Ok(vec![own, shared])
    }

    fn load_state(
        &mut self,
        engine: &mut Engine,
        fill: &mut StateFill,
        optim_step: u64,
    ) -> Result<()> {
        let n = engine.num_params();
        let g = self.outer.rank();
        self.anchor = fill_params(fill, 0..n)?;
        if self.cfg.outer_momentum != 0.0 {
            for (f, r) in self.frags.iter().enumerate() {
                if let Some(v) = fill(r.clone(), OUTER_MOMENTUM)? {
                    self.outer_opts[f]
                        .load_state("momentum_buffer", &v)
                        .map_err(|e| Error::Io(format!("outer optimizer state: {e}")))?;
                }
            }
        }
        self.in_flight.get_mut().clear();
        self.restored = fill(0..n, OUTER_PENDING)?;
        self.restored_left = self.cfg.delay;
        // The group's own state, else what every group shares (the
        // anchor; a DDP checkpoint's model and optimizer).
        let mut own = |r: Range<usize>, kind: &str| -> Result<Option<Vec<f32>>> {
            match fill(r.clone(), &group_kind(g, kind))? {
                Some(v) => Ok(Some(v)),
                None => fill(r, kind),
            }
        };
        self.inner.load_state(engine, &mut own, optim_step)
    }

    fn set_comm_hook(&mut self, make: &dyn Fn() -> Box<dyn CommHook>) {
        self.inner.set_comm_hook(make);
    }

    fn set_hook_rollback(&mut self, on: bool) {
        self.inner.set_hook_rollback(on);
    }

    fn diloco_mut(&mut self) -> Option<&mut Diloco> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fragment_syncs_every_h_steps_at_staggered_offsets() {
        let s = Schedule {
            inner_steps: 20,
            fragments: 4,
        };
        for f in 0..4 {
            let at: Vec<usize> = (1..=100).filter(|&d| s.syncing(d).contains(&f)).collect();
            let o = 5 * (f + 1);
            assert_eq!(at, vec![o, o + 20, o + 40, o + 60, o + 80], "fragment {f}");
        }
        // One fragment at a time, one every H / F steps.
        for d in 1..=100 {
            assert_eq!(s.syncing(d).len(), usize::from(d % 5 == 0), "step {d}");
        }
        let one = Schedule {
            inner_steps: 3,
            fragments: 1,
        };
        let at: Vec<usize> = (1..=9).filter(|&d| !one.syncing(d).is_empty()).collect();
        assert_eq!(at, vec![3, 6, 9]);
        assert_eq!(one.sync_index(0, 9), Some(2));
        // What each fragment's last sync leaves out: one fragment, none at
        // a multiple of H; staggered fragments, all but one some.
        assert_eq!(one.left_out(9), [0]);
        assert_eq!(one.left_out(10), [1]);
        assert_eq!(one.left_out(2), [2]);
        assert_eq!(s.left_out(25), [0, 15, 10, 5]);
        assert_eq!(s.left_out(20), [15, 10, 5, 0]);
        for (steps, lost) in [(25, s.left_out(25)), (47, s.left_out(47))] {
            for (f, n) in lost.iter().enumerate() {
                let last = (1..=steps).rev().find(|&d| s.syncing(d).contains(&f));
                assert_eq!(*n, steps - last.unwrap_or(0), "fragment {f} of {steps}");
            }
        }
    }

    #[test]
    fn fragments_tile_the_buffer() {
        let f = fragments(10, 3);
        assert_eq!(f, vec![0..4, 4..8, 8..10]);
    }
}
