//! Data parallel (DDP): every rank holds the whole model, computes gradients
//! on its slice of the batch, and the gradients are averaged across ranks.
//!
//! As PyTorch's DDP:
//! - gradients travel in buckets (default 25 MB), filled in backward order;
//!   a bucket's async all-reduce starts as soon as the last block in it has
//!   finished its backward, so it overlaps the backward of earlier blocks;
//! - no communication on the non-final micro-steps of gradient accumulation
//!   (`no_sync`): gradients accumulate locally and are reduced once;
//! - initial parameters are broadcast from rank 0;
//! - optionally, every K steps, a check that all ranks hold identical
//!   parameters, with an error naming the diverged rank.
//!
//! Buckets are contiguous ranges of the flat gradient buffer covering whole
//! blocks: blocks are laid out in order, so blocks `lo..=hi` are one range.
//!
//! ```
//! use phalanx::strategy::ddp::plan_buckets;
//! // Three blocks of 10, 20 and 30 floats; buckets of at most 100 bytes.
//! let ranges = vec![0..10, 10..30, 30..60];
//! let b = plan_buckets(&ranges, 100);
//! // Backward order: block 2 alone (120 B), then blocks 0-1 together (40 +
//! // 80 B): a bucket closes once it reaches the cap.
//! assert_eq!(b.iter().map(|b| b.range.clone()).collect::<Vec<_>>(), vec![30..60, 0..30]);
//! assert_eq!(b.iter().map(|b| b.ready_at).collect::<Vec<_>>(), vec![2, 0]);
//! ```

use crate::engine::Engine;
use crate::error::{Error, Result};
use phalanx_comm::{ProcessGroup, ReduceOp, Work};
use std::ops::Range;

#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Bucket capacity in bytes (PyTorch's bucket_cap_mb * 2^20).
    pub bucket_bytes: usize,
    /// Check parameter equality across ranks every K steps (0: never).
    pub check_every: usize,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_bytes: 25 << 20,
            check_every: 0,
        }
    }
}

/// A bucket: a contiguous range of the flat gradient buffer, ready when
/// block `ready_at` (its lowest block) has run its backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub range: Range<usize>,
    pub ready_at: usize,
}

/// Group blocks, last to first, into buckets of at least `cap` bytes (the
/// last bucket may be smaller). Empty blocks join their neighbours.
pub fn plan_buckets(block_ranges: &[Range<usize>], cap: usize) -> Vec<Bucket> {
    let mut out = Vec::new();
    let mut cur: Option<Bucket> = None;
    for (b, r) in block_ranges.iter().enumerate().rev() {
        let bucket = cur.get_or_insert(Bucket {
            range: r.clone(),
            ready_at: b,
        });
        bucket.range.start = r.start;
        bucket.ready_at = b;
        if bucket.range.len() * 4 >= cap {
            out.push(cur.take().unwrap());
        }
    }
    if let Some(b) = cur {
        if !b.range.is_empty() || out.is_empty() {
            out.push(b);
        }
    }
    out
}

pub struct Ddp {
    pg: ProcessGroup,
    cfg: DdpConfig,
    buckets: Vec<Bucket>,
}

impl Ddp {
    /// Plan the buckets for `engine` and broadcast rank 0's parameters.
    pub fn new(engine: &mut Engine, pg: ProcessGroup, cfg: DdpConfig) -> Result<Ddp> {
        let ranges: Vec<Range<usize>> = engine
            .layout()
            .blocks()
            .iter()
            .map(|b| b.range.clone())
            .collect();
        let buckets = plan_buckets(&ranges, cfg.bucket_bytes.max(4));
        pg.broadcast(engine.params_flat_mut(), 0)?;
        Ok(Ddp { pg, cfg, buckets })
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Forward and backward of one micro-batch. With `sync` (the last
    /// micro-step), each bucket's all-reduce (average) is launched as soon as
    /// it is ready and all are awaited before returning; otherwise gradients
    /// only accumulate locally.
    pub fn forward_backward(
        &self,
        engine: &mut Engine,
        inputs: &candle_core::Tensor,
        targets: &candle_core::Tensor,
        loss_scale: f32,
        sync: bool,
    ) -> Result<f32> {
        if !sync || self.pg.size() == 1 {
            return Ok(engine.forward_backward(inputs, targets, loss_scale)?);
        }
        let mut inflight: Vec<(Range<usize>, Work<Vec<f32>>)> =
            Vec::with_capacity(self.buckets.len());
        let mut next = 0;
        let buckets = &self.buckets;
        let pg = &self.pg;
        let loss = engine.forward_backward_with(inputs, targets, loss_scale, &mut |b, grads| {
            // Hooks run for blocks last to first, so every bucket whose lowest
            // block is >= b is complete: launch those not yet launched.
            while next < buckets.len() && buckets[next].ready_at >= b {
                let r = buckets[next].range.clone();
                inflight.push((
                    r.clone(),
                    pg.all_reduce_async(grads[r].to_vec(), ReduceOp::Avg),
                ));
                next += 1;
            }
            Ok(())
        })?;
        let grads = engine.grads_flat_mut();
        for (r, w) in inflight {
            let g = w.wait()?;
            grads[r].copy_from_slice(&g);
        }
        if next != buckets.len() {
            return Err(Error::Check(format!(
                "DDP: only {next} of {} buckets were reduced",
                buckets.len()
            )));
        }
        Ok(loss)
    }

    /// Every `check_every` steps: verify that all ranks hold bitwise
    /// identical parameters; the error names the ranks that diverged.
    pub fn maybe_check(&self, engine: &Engine, step: usize) -> Result<()> {
        if self.cfg.check_every == 0 || !step.is_multiple_of(self.cfg.check_every) {
            return Ok(());
        }
        check_identical(&self.pg, engine.params_flat(), step)
    }
}

/// A 64-bit digest of the bits of `xs` (FNV-1a over the words).
pub fn digest(xs: &[f32]) -> i64 {
    xs.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3)
    }) as i64
}

/// All-gather a digest of `params` and compare with rank 0's.
pub fn check_identical(pg: &ProcessGroup, params: &[f32], step: usize) -> Result<()> {
    let mut all = vec![0i64; pg.size()];
    pg.all_gather(&[digest(params)], &mut all)?;
    let diverged: Vec<usize> = (0..pg.size()).filter(|&r| all[r] != all[0]).collect();
    if diverged.is_empty() {
        Ok(())
    } else {
        Err(Error::Check(format!(
            "parameters diverged at step {step}: rank(s) {diverged:?} differ from rank 0 \
             (global ranks {:?})",
            diverged
                .iter()
                .map(|&r| pg.global_ranks()[r])
                .collect::<Vec<_>>()
        )))
    }
}
