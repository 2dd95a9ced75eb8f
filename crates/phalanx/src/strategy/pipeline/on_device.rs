//! A pipeline stage with its gradients on the device (a GPU, or the CPU's
//! device-generic path): every micro-batch's backward adds its gradients
//! up there (`Engine::hold_grads`) instead of reading them back, the tied
//! parameters' copies are summed over their stages and the owned ranges
//! averaged over dp where they lie (`collective`: NCCL on device memory,
//! any backend on host memory): all-reduced under plain data parallel
//! (bucket by bucket, each started as soon as its chunk's last backward
//! has run the lowest block reading it, so it runs while the blocks below
//! and the rest of the schedule compute), reduce-scattered under ZeRO-1
//! (`scatter`), each dp rank keeping its piece of each range. The stage's
//! optimizers step on them there, in the ranges' kept device copies
//! (ZeRO-1 then all-gathers the pieces there), and write the new values
//! to the host buffer. Nothing reads a gradient back.
//!
//! Taken where every rank of the stage takes it, as DDP's is (the
//! optimizers on the device, the CPU kernels off, the trainer's leave):
//! one dp rank or the plain f32 average on a group that reduces the
//! device's memory, and tie groups that reduce it too.

use super::scatter::Scatter;
use super::ties::BlockBucket;
use super::trace::EventKind;
use super::{BatchFn, GradsFinal, PipeStrategy, Pipeline};
use crate::collective::{all_gather_in_place, all_reduce_in_place, reduces_on, Started};
use crate::engine::stack::Stack;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::optim::step::{agree_and_clip, weighted_sum_squares_on, StepOutcome};
use crate::optim::Grads;
use crate::precision::LossScaler;
use crate::strategy::ddp::{block_padding, grads_may_stay_on_device, take_held_grads};
use candle_core::{DType, Device, Tensor};
use phalanx_comm::{ProcessGroup, ReduceOp};
use std::collections::BTreeMap;
use std::ops::Range;

impl Pipeline {
    /// Whether this stage's gradients can stay on `engine`'s device
    /// through the step: where DDP's would over dp
    /// ([`grads_may_stay_on_device`]: `allowed` by the trainer, the
    /// optimizers on the device, the CPU kernels off, the dp average
    /// reducing that memory), and the tie groups reducing it too.
    pub fn grads_may_stay_on_device(
        &self,
        allowed: bool,
        opts_on_device: bool,
        engine: &Engine,
    ) -> bool {
        let dev = engine.device();
        grads_may_stay_on_device(
            allowed,
            opts_on_device,
            engine,
            self.mesh.dp(),
            &self.reducer,
        ) && self.ties.groups().all(|(g, _)| reduces_on(g, dev))
    }

    /// One step with the gradients held on the device: the schedule runs
    /// with every backward adding its gradients up there, then each owned
    /// range's sum is taken out (in [`Pipeline::owned_ranges`]' order),
    /// the tied copies summed over their stages and, unless `scatter`
    /// (ZeRO-1: the caller reduce-scatters them), every range averaged
    /// over dp, in place. Under plain data parallelism with `overlap_dp`
    /// (the default) the average is started bucket by bucket as each
    /// chunk's last backward makes them final (blocks put together up to
    /// `bucket_bytes`, as DDP's), during the schedule, and the ranges are
    /// put together from those pieces. With `scatter` each range comes
    /// padded with zeros to whole pieces of ceil(len / dp). Returns the
    /// mean loss (as [`Pipeline::forward_backward`]) and the ranges'
    /// gradients.
    pub fn forward_backward_on_device(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        scatter: bool,
    ) -> Result<(f32, Vec<Tensor>)> {
        let (loss, grads, fault) = self.forward_backward_held(engine, batch, scatter)?;
        match fault {
            Some(e) => Err(e),
            None => Ok((loss, grads)),
        }
    }

    /// [`Pipeline::forward_backward_on_device`], a fault found on this
    /// rank (no gradients held, chunks that fell short) returned beside
    /// the result rather than as the error, once this rank has joined
    /// every collective its peers join here (the loss's mean too), so
    /// that a caller with collectives still to run (ZeRO-1's
    /// reduce-scatter) joins those before failing.
    pub(super) fn forward_backward_held(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
        scatter: bool,
    ) -> Result<(f32, Vec<Tensor>, Option<Error>)> {
        let dp = self.mesh.dp().clone();
        // As DDP's device path: each bucket of a chunk's ranges averaged
        // over dp as soon as the chunk's last backward has run its lowest
        // block, while the blocks below and the rest of the schedule go on
        // (`Started`: under NCCL on its own stream; the last stages, done
        // first, reduce while the first ones finish).
        let overlap = !scatter && dp.size() > 1 && self.cfg.overlap_dp;
        engine.zero_grad();
        engine.hold_grads(true);
        let mut flight = Flight::new(self.dp_block_buckets.clone(), &dp, None, engine.device());
        // A fault found after the schedule, reported after the reductions.
        let mut uncovered: Option<String> = None;
        let loss = match overlap {
            true => self.run_schedule_with(engine, batch, &mut flight),
            false => self.run_schedule(engine, batch),
        };
        engine.hold_grads(false);
        let loss = loss?;
        let mut grads = Vec::with_capacity(self.ties.owned.len());
        let Flight {
            started,
            pieces,
            mut missing,
            ..
        } = flight;
        let pieces: Vec<Range<usize>> = pieces.into_iter().map(|(r, _)| r).collect();
        if overlap {
            let t0 = self.timeline.now_us();
            let reduced = started.wait()?;
            self.event(EventKind::DpReduce, t0);
            let mut parts: Vec<(Range<usize>, Tensor)> = pieces.into_iter().zip(reduced).collect();
            parts.sort_unstable_by_key(|(r, _)| r.start);
            for o in &self.ties.owned {
                let mine: Vec<Tensor> = parts
                    .iter()
                    .filter(|(r, _)| o.start <= r.start && r.end <= o.end)
                    .map(|(_, t)| t.clone())
                    .collect();
                let got: usize = mine.iter().map(|t| t.elem_count()).sum();
                // Zeros stand in where the pieces fall short, so that this
                // rank still joins the tied sums below; it fails after.
                if got != o.len() {
                    uncovered.get_or_insert(format!(
                        "pipeline: stage {}'s chunks reduced {got} of the {} gradients of {o:?}",
                        self.stage,
                        o.len()
                    ));
                    grads.push(Tensor::zeros(o.len(), DType::F32, engine.device())?);
                    continue;
                }
                grads.push(match mine.len() {
                    1 => mine.into_iter().next().expect("one"),
                    _ => Tensor::cat(&mine, 0)?,
                });
            }
            // A gradient held after its chunk's reduction started would be
            // lost: no backward may add to a chunk's parameters after the
            // chunk's last backward.
            let late = engine.stack().held_grads_count();
            if late > 0 {
                uncovered.get_or_insert(format!(
                    "pipeline: stage {} held {late} parameters' gradients after their chunks' \
                     reductions had started",
                    self.stage
                ));
                engine.stack().drop_held_grads();
            }
        } else {
            drop(started);
            for r in &self.ties.owned {
                let pad = match scatter {
                    true => block_padding(r.len(), dp.size()),
                    false => 0,
                };
                // Zeros stand in where none are held, so that this rank
                // still joins the reductions below (not ZeRO-1's
                // reduce-scatter, in the finish); it fails after them.
                let (g, held) = take_held_grads(engine, r.clone(), pad)?;
                if !held {
                    missing.get_or_insert(r.clone());
                }
                grads.push(g);
            }
        }
        let t0 = self.timeline.now_us();
        // One all-reduce per tied range, in place in its view (the host
        // path packs a group's ranges into one buffer): every member of a
        // group takes this path or none does, since everything the choice
        // reads is the same on every rank.
        for (group, ranges) in self.ties.groups() {
            for r in ranges {
                all_reduce_in_place(group, &view(&self.ties.owned, &grads, r)?, ReduceOp::Sum)?;
            }
        }
        self.event(EventKind::TieReduce, t0);
        if dp.size() > 1 && !scatter && !overlap {
            let t0 = self.timeline.now_us();
            for g in &grads {
                all_reduce_in_place(&dp, g, ReduceOp::Avg)?;
            }
            self.event(EventKind::DpReduce, t0);
        }
        let mean = self.dp_mean(loss)?;
        let fault = match (missing, uncovered) {
            (Some(r), _) => Some(Error::Check(format!(
                "pipeline: stage {} held no gradients on the device for {r:?} after backward",
                self.stage
            ))),
            (None, e) => e.map(Error::Check),
        };
        Ok((mean, grads, fault))
    }
}

/// The dp averages of one step's chunks in flight: each bucket's held
/// gradients taken out and its all-reduce (ZeRO-1: reduce-scatter) started
/// as soon as the chunk's last backward has made them final (`Started`:
/// under NCCL on the communicator's stream while candle's computes the
/// blocks below).
pub(super) struct Flight<'a> {
    /// Per chunk, in the order they become final.
    buckets: BTreeMap<usize, Vec<BlockBucket>>,
    /// Per chunk, the buckets started so far.
    next: BTreeMap<usize, usize>,
    /// ZeRO-1's cut of the ranges; `None`: all-reduced.
    scatter: Option<Scatter>,
    pub started: Started<'a>,
    /// The ranges started, in order, with their reduce-scatters' counts
    /// (empty for an all-reduce).
    pub pieces: Vec<(Range<usize>, Vec<usize>)>,
    /// The first range held nowhere: zeros stand in, so that this rank
    /// still joins; it fails after.
    pub missing: Option<Range<usize>>,
    dev: Device,
}

impl<'a> Flight<'a> {
    pub fn new(
        buckets: BTreeMap<usize, Vec<BlockBucket>>,
        dp: &'a ProcessGroup,
        scatter: Option<Scatter>,
        dev: &Device,
    ) -> Self {
        Flight {
            buckets,
            next: BTreeMap::new(),
            scatter,
            started: Started::new(dp),
            pieces: Vec::new(),
            missing: None,
            dev: dev.clone(),
        }
    }

    /// Start chunk `c`'s buckets that are final once block `b` has run
    /// (every one left with `None`: the chunk is done); how many
    /// reductions that started.
    fn start(&mut self, c: usize, b: Option<usize>, stack: &Stack) -> Result<usize> {
        let Some(bs) = self.buckets.get(&c) else {
            return Ok(0);
        };
        let next = self.next.entry(c).or_default();
        let lo = self.pieces.len();
        while *next < bs.len() && b.is_none_or(|b| bs[*next].ready_at >= b) {
            for r in &bs[*next].ranges {
                // ZeRO-1 leaves the tied parts for after their sums.
                let parts = match &self.scatter {
                    Some(sc) => sc.untied(r),
                    None => vec![r.clone()],
                };
                for r in parts {
                    let g = match stack.take_held_grads(r.clone(), 0)? {
                        Some(g) => g,
                        None => {
                            self.missing.get_or_insert(r.clone());
                            Tensor::zeros(r.len(), DType::F32, &self.dev)?
                        }
                    };
                    let counts = match &self.scatter {
                        Some(sc) => {
                            let counts = sc.counts(&r)?;
                            self.started.reduce_scatter_v(g, &counts, ReduceOp::Avg)?;
                            counts
                        }
                        None => {
                            self.started.all_reduce(g, ReduceOp::Avg)?;
                            Vec::new()
                        }
                    };
                    self.pieces.push((r, counts));
                }
            }
            *next += 1;
        }
        Ok(self.pieces.len() - lo)
    }
}

impl GradsFinal for Flight<'_> {
    fn by_block(&self) -> bool {
        true
    }

    fn block(&mut self, chunk: usize, block: usize, stack: &Stack) -> Result<usize> {
        self.start(chunk, Some(block), stack)
    }

    /// Whatever the blocks left (none, as each block's backward reports).
    fn chunk(&mut self, chunk: usize, engine: &mut Engine) -> Result<()> {
        self.start(chunk, None, engine.stack())?;
        Ok(())
    }
}

/// The part `r` of the owned ranges' gradients `grads` (`owned[i]`'s in
/// `grads[i]`): a view of the one range that contains it.
pub(crate) fn view(owned: &[Range<usize>], grads: &[Tensor], r: &Range<usize>) -> Result<Tensor> {
    let i = owned
        .iter()
        .position(|o| o.start <= r.start && r.end <= o.end)
        .ok_or_else(|| Error::Check(format!("pipeline: {r:?} lies in no owned range")))?;
    Ok(grads[i].narrow(0, r.start - owned[i].start, r.len())?)
}

impl PipeStrategy {
    /// The step from the gradients taken on the device (`grads`, one per
    /// optimizer range: each owned range's as
    /// [`Pipeline::forward_backward_on_device`] leaves them, or under
    /// ZeRO-1 this dp rank's piece of each as
    /// [`Pipeline::forward_backward_scattered`] does, `None` where empty):
    /// the norm summed there over the primary ranges;
    /// each optimizer stepping on its range (or piece) in the ranges' kept
    /// device copies (uploaded where there are none), ZeRO-1's pieces then
    /// all-gathered there; the new values written to the host buffer and
    /// the copies kept for the next forward.
    pub(super) fn finish_on_device(
        &mut self,
        engine: &mut Engine,
        grads: Vec<Option<Tensor>>,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<StepOutcome> {
        let dp = self.mesh.dp().clone();
        let owned = self.pipe.owned_ranges().to_vec();
        // The optimizers' ranges: the owned ones, or (ZeRO-1) this dp
        // rank's piece of each, in the same order.
        let ranges: Vec<Range<usize>> = self.opts.iter().map(|(r, _)| r.clone()).collect();
        let fits = ranges.len() == owned.len()
            && ranges
                .iter()
                .zip(&owned)
                .all(|(r, o)| o.start <= r.start && r.end <= o.end);
        if !fits {
            return Err(Error::Check(format!(
                "pipeline: optimizer ranges {ranges:?} do not follow the owned ranges {owned:?}"
            )));
        }
        // Every rank's share of the norm counts once: the averaged ranges
        // are on every dp rank (1/dp each), a piece on its owner only.
        // (`None`: an empty piece, which needs no storage: CUDA refuses
        // an allocation of 0 bytes.)
        let w = match &self.zero1 {
            None => 1.0 / dp.size() as f64,
            Some(_) => 1.0,
        };
        if grads.len() != ranges.len() {
            return Err(Error::Check(format!(
                "pipeline: {} gradients for {} optimizer ranges",
                grads.len(),
                ranges.len()
            )));
        }
        let (tp, rep) = (self.mesh.tp_size, &self.tp_replicated);
        let mut ss = 0.0;
        for (g, r) in grads.iter().zip(&ranges) {
            let Some(g) = g else { continue };
            for p in self.pipe.primary_ranges() {
                let (lo, hi) = (p.start.max(r.start), p.end.min(r.end));
                if lo < hi {
                    let part = g.narrow(0, lo - r.start, hi - lo)?;
                    ss += weighted_sum_squares_on(&part, lo, w, rep, tp)?;
                }
            }
        }
        let (out, factor) = agree_and_clip(self.mesh.world(), ss, scaler, max_norm, step)?;
        let Some(factor) = factor else {
            // Skipped: the parameters, here and on the device, are unchanged.
            return Ok(out);
        };
        // Every range's kept copies first: the one mutable borrow of the
        // flat buffer below makes them all stale, and each is kept again
        // after it (as `finish` does).
        let mut kept = Vec::with_capacity(owned.len());
        for o in &owned {
            kept.push(engine.device_params(o.clone())?);
        }
        let dev = engine.device().clone();
        let p = engine.params_flat_mut();
        let mut full = Vec::with_capacity(owned.len());
        for (i, (r, opt)) in self.opts.iter_mut().enumerate() {
            let (o, g) = (&owned[i], &grads[i]);
            let all = match kept[i].take() {
                Some(k) => k,
                None => Tensor::from_slice(&p[o.clone()], o.len(), &dev)?,
            };
            let Some(opt) = opt.as_device() else {
                return Err(Error::Check(format!(
                    "pipeline: the gradients of {r:?} stayed on the device but its optimizer is not there"
                )));
            };
            if let Some(g) = g {
                let mine = all.narrow(0, r.start - o.start, r.len())?;
                // Under ZeRO-1 the host buffer takes the whole gathered
                // range below, this piece with it.
                let host = match self.zero1 {
                    None => Some(&mut p[r.clone()]),
                    Some(_) => None,
                };
                opt.step_on(host, &mine, Grads::Device(g), lr, factor)?;
            }
            if let Some(pieces) = &self.zero1 {
                // The others' pieces, into the kept copies and the host buffer.
                all_gather_in_place(&dp, &all, &pieces[i].1)?;
                p[o.clone()].copy_from_slice(&all.to_vec1::<f32>()?);
            }
            full.push(all);
        }
        // Stepped: the new values, here and in the host buffer.
        for (o, all) in owned.iter().zip(&full) {
            engine.keep_device_params(o.clone(), all)?;
        }
        Ok(out)
    }
}
