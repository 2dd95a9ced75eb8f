//! Gradients held on the device and reduced where they lie, bucket by
//! bucket as the backward completes them (DDP's device path, as PyTorch's
//! DDP overlaps its buckets): the last micro-batch's backward holds its
//! gradients with the earlier micro-batches' ([`Engine::hold_grads`]),
//! and as soon as a bucket's last block is done its held sum is taken
//! out and its all-reduce started ([`crate::collective::Started`]: under
//! NCCL launched on the communicator's own stream, so it runs while
//! candle's stream computes the earlier blocks' backward; on host memory
//! it runs when waited for). After the backward every one is awaited and the
//! buckets are put together as the step's (n,) gradient tensor.

use super::ddp::held_or_fail;
use super::reduce::{Bucket, ReadyCursor};
use crate::collective::Started;
use crate::engine::{Engine, GradSink, ParamInfo};
use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use phalanx_comm::{ProcessGroup, ReduceOp};

/// The sink of a backward whose gradients are all held on the device: one
/// that reaches the host is a bug, named with the strategy's `what`.
pub(crate) struct NoHostGrads(pub &'static str);

impl GradSink for NoHostGrads {
    fn accumulate(&mut self, p: &ParamInfo, _grad: &[f32]) -> candle_core::Result<()> {
        candle_core::bail!(
            "{} on the device: the gradient of `{}` reached the host",
            self.0,
            p.name
        )
    }
}

/// One micro-batch's forward and backward (the step's last: it holds its
/// gradients with those held before), each bucket's held sum averaged
/// over `pg` as soon as the backward completes the bucket; returns the
/// loss and the step's averaged gradients, (n,) f32 in flat order. Every
/// rank starts the same all-reduces in the same order; one that held
/// nothing for a bucket joins with zeros and fails after the wait, so its
/// peers finish.
pub(crate) fn forward_backward_reducing(
    engine: &Engine,
    x: &Tensor,
    y: &Tensor,
    scale: f32,
    buckets: &[Bucket],
    pg: &ProcessGroup,
    what: &'static str,
) -> Result<(f32, Tensor)> {
    let stack = engine.stack();
    let src = engine.param_source();
    let (loss, stash) = stack.forward(0..engine.num_blocks(), x, Some(y), src)?;
    let loss = loss.to_scalar::<f32>()?;
    let gy = Tensor::new(scale, engine.device())?;
    let mut cursor = ReadyCursor::default();
    let mut started = Started::new(pg);
    // The range of every bucket started, in the order started.
    let mut ranges = Vec::new();
    let mut held_all = true;
    // A failure inside the hook, kept whole (a timeout naming its rank).
    let mut failed: Option<Error> = None;
    let mut hook = |b: usize, _: &mut NoHostGrads| -> candle_core::Result<()> {
        for id in cursor.advance(buckets, b) {
            let r = buckets[id].range.clone();
            let res = (|| -> Result<()> {
                let g = match stack.take_held_grads(r.clone(), 0)? {
                    Some(g) => g,
                    None => {
                        held_all = false;
                        Tensor::zeros(r.len(), DType::F32, engine.device())?
                    }
                };
                started.all_reduce(g, ReduceOp::Avg)?;
                ranges.push(r);
                Ok(())
            })();
            keep_failure(res, &mut failed)?;
        }
        Ok(())
    };
    let r = stack.backward(stash, &gy, src, &mut NoHostGrads(what), &mut hook);
    // The step's last backward: later ones (a new step's) hold only when
    // asked again.
    stack.hold_grads(false);
    if let Some(e) = failed {
        return Err(e);
    }
    r?;
    cursor.check_all(buckets, what)?;
    let reduced = started.wait()?;
    let mut pieces: Vec<(usize, Tensor)> = ranges.iter().map(|r| r.start).zip(reduced).collect();
    // Buckets complete from the top: flat order is the reverse, and sorting
    // says so whatever the plan.
    pieces.sort_unstable_by_key(|(at, _)| *at);
    let n = engine.num_params();
    let covered: usize = pieces.iter().map(|(_, t)| t.elem_count()).sum();
    if covered != n {
        return Err(Error::Check(format!(
            "{what}: the buckets reduced on the device cover {covered} of {n} parameters"
        )));
    }
    let mut pieces: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
    let g = match pieces.len() {
        1 => pieces.remove(0),
        _ => Tensor::cat(&pieces, 0)?,
    };
    held_or_fail((loss, g), held_all, pg, what)
}

/// A backward hook's result as candle's error, the failure itself kept
/// whole in `failed` (a timeout naming its rank) for the caller to return.
pub(crate) fn keep_failure<T>(r: Result<T>, failed: &mut Option<Error>) -> candle_core::Result<T> {
    r.map_err(|e| {
        let msg = e.to_string();
        *failed = Some(e);
        candle_core::Error::Msg(msg)
    })
}
