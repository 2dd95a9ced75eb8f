//! A pipeline stage with its gradients on the device (a GPU, or the CPU's
//! device-generic path): every micro-batch's backward adds its gradients
//! up there (`Engine::hold_grads`) instead of reading them back, the tied
//! parameters' copies are summed over their stages and the owned ranges
//! averaged over dp where they lie (`collective`: NCCL on device memory,
//! any backend on host memory), and the stage's optimizers step on them
//! there (`PipeStrategy`'s finish). Nothing reads a gradient back.
//!
//! Taken where every rank of the stage takes it, as DDP's is (the
//! optimizers on the device, the CPU kernels off, the trainer's leave):
//! plain data parallel over dp (no ZeRO-1 pieces), with one dp rank or
//! the plain f32 average on a group that reduces the device's memory, and
//! tie groups that reduce it too.

use super::trace::EventKind;
use super::{BatchFn, Pipeline};
use crate::collective::{all_reduce_in_place, reduces_on};
use crate::engine::Engine;
use crate::error::{Error, Result};
use candle_core::Tensor;
use phalanx_comm::ReduceOp;
use std::ops::Range;

impl Pipeline {
    /// Whether this stage's gradients can stay on `engine`'s device
    /// through the step (the caller checks the optimizers and the
    /// trainer's leave): the CPU kernels off, and every reduction they
    /// need (ties over pp, the average over dp) reducing that memory.
    pub fn grads_may_stay_on_device(&self, engine: &Engine) -> bool {
        let dev = engine.device();
        let dp = self.mesh.dp();
        !crate::ops::host_kernels(dev)
            && (dp.size() == 1 || (self.reducer.plain_average() && reduces_on(dp, dev)))
            && self.ties.groups().all(|(g, _)| reduces_on(g, dev))
    }

    /// One step with the gradients held on the device: the schedule runs
    /// with every backward adding its gradients up there, then each owned
    /// range's sum is taken out (in [`Pipeline::owned_ranges`]' order),
    /// the tied copies summed over their stages and every range averaged
    /// over dp, in place. Returns the mean loss (as
    /// [`Pipeline::forward_backward`]) and the ranges' gradients.
    pub fn forward_backward_on_device(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
    ) -> Result<(f32, Vec<Tensor>)> {
        engine.zero_grad();
        engine.hold_grads(true);
        let loss = self.run_schedule(engine, batch);
        engine.hold_grads(false);
        let loss = loss?;
        let mut grads = Vec::with_capacity(self.ties.owned.len());
        let mut missing = None;
        for r in &self.ties.owned {
            grads.push(match engine.take_device_grads(r.clone(), 0)? {
                Some(g) => g,
                None => {
                    // Zeros stand in, so that this rank still joins the
                    // reductions below; it fails after them.
                    missing.get_or_insert(r.clone());
                    Tensor::zeros(r.len(), candle_core::DType::F32, engine.device())?
                }
            });
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
        let dp = self.mesh.dp().clone();
        if dp.size() > 1 {
            let t0 = self.timeline.now_us();
            for g in &grads {
                all_reduce_in_place(&dp, g, ReduceOp::Avg)?;
            }
            self.event(EventKind::DpReduce, t0);
        }
        if let Some(r) = missing {
            return Err(Error::Check(format!(
                "pipeline: stage {} held no gradients on the device for {r:?} after backward",
                self.stage
            )));
        }
        Ok((self.dp_mean(loss)?, grads))
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
