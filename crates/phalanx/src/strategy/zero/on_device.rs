//! ZeRO-1 and ZeRO-2 with their gradients on the device (a GPU, or the
//! CPU's device-generic path): every micro-batch holds its gradients
//! there, and a reduce-scatter averages them where they lie, leaving each
//! rank its shard (`collective`: NCCL on device memory, any backend on
//! host memory): ZeRO-1 once, the step's sum after the last backward;
//! ZeRO-2 after every micro-batch's backward, keeping only the shard's
//! sum between them. The optimizer steps the shard with those gradients,
//! so no gradient is read back to the host. The shard is stepped in place in the
//! parameters' kept device copies, which an all-gather in place makes
//! whole again, and the host buffer is deferred to them (as DDP's): a
//! step moves nothing between host and device but the batch and the loss.
//!
//! As DDP's (`strategy::ddp`): taken only where every rank takes it (the
//! optimizer on the device, the plain f32 average, a group that reduces
//! the device's memory, and the trainer's leave). Stage 3's micro-step on
//! the device is `stage3_on_device`'s; its step finishes here too, on
//! the shard kept on the device, and writes the new shard to the host's
//! (a copy down of 1/dp of the model per step, which checkpoints and
//! evaluation read).

use super::Zero;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::optim::step::{agree_and_clip, weighted_sum_squares_on, StepOutcome};
use crate::optim::Grads;
use crate::precision::LossScaler;
use crate::strategy::ddp::{
    block_padding, grads_may_stay_on_device, held_or_fail, take_held_grads,
};
use candle_core::Tensor;
use phalanx_comm::ReduceOp;

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

    /// Stage 2's micro-step on the device: forward and backward holding
    /// the gradients, then their reduce-scatter, this rank's shard added
    /// to the step's, so that between micro-batches only the shard's sum
    /// is held (DeepSpeed's stage 2 reduces every micro-batch too; the
    /// buckets of its backward are not overlapped here, and while a
    /// micro-batch's are put together into one flat tensor they are there
    /// twice).
    pub(super) fn scatter_on_device(
        &mut self,
        engine: &mut Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f32,
    ) -> Result<f32> {
        let loss = engine.forward_backward(x, y, scale)?;
        let gs = self.reduce_scatter_held(engine)?;
        self.device_shard = Some(match self.device_shard.take() {
            Some(sum) => (sum + gs)?,
            None => gs,
        });
        Ok(loss)
    }

    /// This rank's shard of the held gradients averaged over the group,
    /// in storage of its own: one reduce-scatter in place (DeepSpeed's
    /// stage 1 reduces each gradient to its owner too), half an
    /// all-reduce's traffic. The shards are blocks of ceil(n / size) (the
    /// last ones short or empty), so the flat sum is padded with zeros to
    /// `size` whole blocks where the size does not divide it.
    fn reduce_scatter_held(&self, engine: &mut Engine) -> Result<Tensor> {
        let (n, size) = (engine.num_params(), self.shard_pg.size());
        // The padding comes in the held gradients' own allocation.
        let (g, held) = take_held_grads(engine, 0..n, block_padding(n, size))?;
        crate::collective::reduce_scatter_in_place(&self.shard_pg, &g, ReduceOp::Avg)?;
        let mine = self.shards.mine();
        // The shard in storage of its own (`copy` would clone the whole
        // storage under the view); the rest is let go before the
        // parameters' flat copy is made.
        let gs = g.narrow(0, mine.start, mine.len())?.force_contiguous()?;
        let what = format!("ZeRO-{}", self.cfg.stage);
        held_or_fail(gs, held, &self.shard_pg, &what)
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
        // Stage 1 reduces the step's held sum now; stage 2 has reduced
        // every micro-batch's already.
        let gs = match stage {
            1 => self.reduce_scatter_held(engine)?,
            3 => self.device_grad_shard(engine)?,
            _ => self.device_shard.take().ok_or_else(|| {
                Error::Check(format!(
                    "ZeRO-{stage}: the step ended with no gradient shard on the device"
                ))
            })?,
        };
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
