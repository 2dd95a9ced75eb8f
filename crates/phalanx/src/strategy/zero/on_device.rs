//! ZeRO with its gradients on the device (a GPU, or the CPU's
//! device-generic path): every micro-batch holds its gradients there, and
//! each bucket (stages 1-2) or block (stage 3) is reduce-scattered where
//! it lies as soon as the backward completes it, leaving each rank its
//! piece (`collective`: NCCL on device memory, any backend on host
//! memory): ZeRO-1 in the last micro-batch's backward, over the step's
//! held sum; ZeRO-2 and ZeRO-3 in every micro-batch's, keeping only the
//! pieces' sums between them. The pieces make this rank's shard, and the
//! optimizer steps it with them, so no gradient is read back to the host.
//! Stages 1-2 step the shard in place in the parameters' kept device
//! copies, which an all-gather in place makes whole again, and the host
//! buffer is deferred to them (as DDP's): a step moves nothing between
//! host and device but the batch and the loss.
//!
//! As DDP's (`strategy::ddp`): taken only where every rank takes it (the
//! optimizer on the device, the plain f32 average, a group that reduces
//! the device's memory, and the trainer's leave). Stage 3's micro-step on
//! the device is `stage3_on_device`'s; its step finishes here too, on
//! the shard kept on the device, and writes the new shard to the host's
//! (a copy down of 1/dp of the model per step, which checkpoints read).

use super::Zero;
use crate::collective::Started;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ledger::Mem;
use crate::optim::step::{agree_and_clip, weighted_sum_squares_on, StepOutcome};
use crate::optim::Grads;
use crate::precision::LossScaler;
use crate::strategy::ddp::{grads_may_stay_on_device, held_or_fail};
use crate::strategy::held::{keep_failure, NoHostGrads};
use crate::strategy::reduce::ReadyCursor;
use candle_core::{DType, Tensor};
use phalanx_comm::ReduceOp;
use std::ops::Range;

impl Zero {
    /// Where DDP's would stay ([`grads_may_stay_on_device`], over the
    /// group the gradients are averaged in), and for stage 3 its own
    /// conditions too.
    pub(super) fn grads_stay_on_device(&mut self, engine: &Engine) -> bool {
        let on_device = self.opt.as_device().is_some();
        (self.cfg.stage <= 2 || self.stage3_may_stay_on_device(engine))
            && grads_may_stay_on_device(
                self.device_grads,
                on_device,
                engine,
                &self.shard_pg,
                &self.reducer,
            )
    }

    /// Stages 1 and 2's reducing micro-step on the device (stage 1's last,
    /// each of stage 2's): forward, then the backward holding its
    /// gradients (with those held before), each bucket's reduce-scatter
    /// started as soon as the backward completes the bucket (under NCCL
    /// on its own stream, overlapping the backward of earlier blocks, as
    /// DeepSpeed's buckets do), all awaited after it, and this rank's piece
    /// of each added to the step's. The shards cut buckets anywhere: the
    /// reduce-scatters are uneven (`collective::reduce_scatter_v_in_place`).
    pub(super) fn scatter_on_device(
        &mut self,
        engine: &mut Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f32,
    ) -> Result<f32> {
        let what = if self.cfg.stage == 1 {
            "ZeRO-1"
        } else {
            "ZeRO-2"
        };
        let engine: &Engine = engine;
        let (stack, src) = (engine.stack(), engine.param_source());
        let (loss, stash) = stack.forward(0..engine.num_blocks(), x, Some(y), src)?;
        let loss = loss.to_scalar::<f32>()?;
        let gy = Tensor::new(scale, engine.device())?;
        let mut cursor = ReadyCursor::default();
        let mut started = Started::new(&self.shard_pg);
        let mut scattered = Vec::new();
        let (mut held_all, mut failed) = (true, None);
        let mut hook = |b: usize, _: &mut NoHostGrads| -> candle_core::Result<()> {
            let ready = cursor.advance(&self.units, b);
            let r = self.start_units(engine, ready, &mut started, &mut scattered);
            keep_failure(r.map(|held| held_all &= held), &mut failed)
        };
        let r = stack.backward(stash, &gy, src, &mut NoHostGrads(what), &mut hook);
        stack.hold_grads(false);
        if let Some(e) = failed {
            return Err(e);
        }
        r?;
        cursor.check_all(&self.units, what)?;
        let done = started.wait()?;
        self.add_pieces(engine, scattered, done)?;
        held_or_fail(loss, held_all, &self.shard_pg, what)
    }

    /// Start the reduce-scatter of each unit in `ready` (their gradients
    /// complete) into `started`, recording (unit, counts) in `scattered`;
    /// whether every one held gradients.
    pub(super) fn start_units(
        &self,
        engine: &Engine,
        ready: Range<usize>,
        started: &mut Started,
        scattered: &mut Vec<(usize, Vec<usize>)>,
    ) -> Result<bool> {
        let mut held_all = true;
        for u in ready {
            let (counts, held) = self.start_unit(engine, self.units[u].range.clone(), started)?;
            held_all &= held;
            scattered.push((u, counts));
        }
        Ok(held_all)
    }

    /// Start the reduce-scatter (average) over the shard group of the
    /// gradients held for `range` (a unit: stage 3's block, stages 1-2's
    /// bucket), in
    /// place in storage of their own; the counts it splits them by, and
    /// whether any were held (zeros stand in where not, so that the rank
    /// still joins).
    fn start_unit(
        &self,
        engine: &Engine,
        range: Range<usize>,
        started: &mut Started,
    ) -> Result<(Vec<usize>, bool)> {
        let len = range.len();
        let counts = self.shards.counts(&range);
        let (g, held) = match engine.stack().take_held_grads(range, 0)? {
            Some(g) => (g, true),
            None => (Tensor::zeros(len, DType::F32, engine.device())?, false),
        };
        started.reduce_scatter_v(g, &counts, ReduceOp::Avg)?;
        Ok((counts, held))
    }

    /// This rank's piece of `g`, a unit's gradients reduce-scattered by
    /// `counts`, in storage of its own (`None` when it owns none of the
    /// unit), averaged over the replicas too under hybrid sharding.
    fn my_piece(&self, g: &Tensor, counts: &[usize]) -> Result<Option<Tensor>> {
        let me = self.shard_pg.rank();
        if counts[me] == 0 {
            return Ok(None);
        }
        let at: usize = counts[..me].iter().sum();
        let piece = g.narrow(0, at, counts[me])?.force_contiguous()?;
        if let Some(rp) = &self.replica_pg {
            crate::collective::all_reduce_in_place(rp, &piece, ReduceOp::Avg)?;
        }
        Ok(Some(piece))
    }

    /// The step's gradient shard on the device, (shard length,): the
    /// pieces of every unit in flat order (the units cover the model, so
    /// their pieces cover the shard).
    pub(super) fn device_grad_shard(&mut self, engine: &Engine) -> Result<Tensor> {
        self.device_pieces_charge = None;
        let mut pieces: Vec<(usize, Tensor)> = std::mem::take(&mut self.device_pieces)
            .into_iter()
            .collect();
        // In flat order (units are numbered in backward order).
        pieces.sort_unstable_by_key(|(u, _)| self.units[*u].range.start);
        let len = self.shards.mine().len();
        let got: usize = pieces.iter().map(|(_, t)| t.elem_count()).sum();
        if got != len {
            return Err(Error::Check(format!(
                "ZeRO-{}: the step's gradient pieces on the device cover {got} of the shard's {len}",
                self.cfg.stage
            )));
        }
        let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
        Ok(match pieces.len() {
            0 => Tensor::zeros(0, DType::F32, engine.device())?,
            1 => pieces.into_iter().next().unwrap(),
            _ => Tensor::cat(&pieces, 0)?,
        })
    }

    /// Add this rank's piece of each unit in `scattered` (reduce-scattered,
    /// `done` in the same order) to the step's.
    pub(super) fn add_pieces(
        &mut self,
        engine: &Engine,
        scattered: Vec<(usize, Vec<usize>)>,
        done: Vec<Tensor>,
    ) -> Result<()> {
        if done.len() != scattered.len() {
            return Err(Error::Check(format!(
                "ZeRO-{}: {} collectives came back for {} reduce-scatters",
                self.cfg.stage,
                done.len(),
                scattered.len()
            )));
        }
        if done.is_empty() {
            return Ok(());
        }
        for ((u, counts), g) in scattered.into_iter().zip(&done) {
            if let Some(piece) = self.my_piece(g, &counts)? {
                let sum = match self.device_pieces.remove(&u) {
                    Some(s) => (s + piece)?,
                    None => piece,
                };
                self.device_pieces.insert(u, sum);
            }
        }
        let bytes = self
            .device_pieces
            .values()
            .map(|t| t.elem_count() * 4)
            .sum();
        self.device_pieces_charge = None; // released before the new charge
        self.device_pieces_charge = Some(engine.ledger().charge(Mem::Grads, bytes));
        Ok(())
    }

    /// The step from the held gradients: averaged over the group on the
    /// device, the norm summed there over this rank's shard, the shard
    /// stepped in the kept copies and gathered there (`gathered`: nothing
    /// left for the host's all-gather), or, without kept copies, written
    /// back to the host buffer. Stage 3's shard: its pieces of the step's
    /// reduce-scatters, stepping the shard kept on the device.
    pub(super) fn finish_on_device(
        &mut self,
        engine: &mut Engine,
        scaler: &mut LossScaler,
        lr: f32,
        max_norm: f32,
        step: usize,
    ) -> Result<(StepOutcome, bool)> {
        let n = engine.num_params();
        let stage = self.cfg.stage;
        // Every stage reduce-scattered its units' held gradients in the
        // backward; their pieces make this rank's shard.
        let gs = self.device_grad_shard(engine)?;
        let mine = self.shards.mine();
        // Hybrid sharding's replicas of a shard count 1/replicas each.
        let w = 1.0 / self.replica_pg.as_ref().map_or(1, |r| r.size()) as f64;
        let ss =
            weighted_sum_squares_on(&gs, mine.start, w, &self.tp_replicated, self.mesh.tp_size)?;
        let world = self.mesh.world().clone();
        let (out, factor) = agree_and_clip(&world, ss, scaler, max_norm, step)?;
        let Some(factor) = factor else {
            // Skipped: the parameters, here and there, are unchanged.
            return Ok((out, true));
        };
        if stage == 3 {
            self.step_device_store(&gs, lr, factor)?;
            return Ok((out, true));
        }
        let Some(opt) = self.opt.as_device() else {
            // `grads_stay_on_device` asked for it: a bug, not an input.
            return Err(Error::Check(format!(
                "ZeRO-{stage}: the gradients stayed on the device but the optimizer is not there"
            )));
        };
        // The forward kept every parameter's copy (the same on every rank:
        // the same model, the same forward).
        if let Some(all) = engine.device_params(0..n)? {
            opt.step_on(
                None,
                &all.narrow(0, mine.start, mine.len())?,
                Grads::Device(&gs),
                lr,
                factor,
            )?;
            let counts = self.shards.counts(&(0..n));
            crate::collective::all_gather_in_place(&self.shard_pg, &all, &counts)?;
            engine.defer_params(&all)?;
            return Ok((out, true));
        }
        let p = &mut engine.params_flat_mut()[mine.clone()];
        // A shard cuts parameters: its values go up as they are.
        let dev = Tensor::from_slice(p, p.len(), gs.device())?;
        opt.step_on(Some(p), &dev, Grads::Device(&gs), lr, factor)?;
        Ok((out, false))
    }
}
