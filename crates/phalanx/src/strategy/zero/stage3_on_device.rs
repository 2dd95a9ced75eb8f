//! ZeRO-3 with its parameters and gradients on the device (a GPU, or the
//! CPU's device-generic path): this rank's parameter shard is kept in
//! device memory (uploaded once, then stepped there); before a block runs,
//! its parameters (and those it ties to) are all-gathered in place into a
//! device buffer built from that shard (`collective`: NCCL on device
//! memory, any backend on host memory), served to the block without a
//! host copy ([`crate::engine::ParamSource::block_tensor`]) and let go
//! after it; the backward holds each block's gradients on the device, and
//! as soon as a block is done its gradients are reduce-scattered in place
//! (uneven blocks: the shards cut a block anywhere), leaving this rank its
//! piece, summed over the step's micro-batches. The optimizer steps the
//! shard where it lies and writes the new values to the host shard, so
//! checkpoints and the host path read it as before; evaluation gathers
//! from the device's shards as the forward does.
//!
//! Taken only where every rank takes it (DDP's conditions, and a shard in
//! memory without ZeRO++'s quantised or secondary gathers). Every
//! collective of a pass is started without waiting, in one [`Started`]
//! (under NCCL launched on its own stream, an event after each), and
//! waited for by its own event, no earlier than needed: the gathers of the
//! next `parallel.forward_prefetch` (backward: `backward_prefetch`) blocks
//! are started before a block computes, so they run while it does, and a
//! block's are waited for just before it runs; a block's reduce-scatters
//! are started once its backward is done and waited for after the next
//! block's backward, so they run while it computes.

use super::Zero;
use crate::collective::Started;
use crate::engine::{Engine, ParamSource, Stash};
use crate::error::{Error, Result};
use crate::ledger::{Charge, Mem};
use crate::strategy::ddp::held_or_fail;
use crate::strategy::held::{keep_failure, NoHostGrads};
use crate::strategy::reduce::ReadyCursor;
use candle_core::{DType, Tensor};
use std::collections::{HashMap, VecDeque};

/// The collectives of one ZeRO-3 pass on the device, in the order started.
struct Flight<'a> {
    started: Started<'a>,
    /// What each one not yet waited for is: a gather (`None`: its buffer
    /// is held by its block's [`OnDevice`]) or a unit's reduce-scatter
    /// (unit, counts).
    kinds: VecDeque<Option<(usize, Vec<usize>)>>,
    /// Blocks whose gathers were started ahead, in the order they run:
    /// (block, buffers, how many collectives were started through them).
    ahead: VecDeque<(usize, OnDevice, usize)>,
}

/// Blocks' parameters gathered in device memory, by block: what a block's
/// build is served from, charged as working memory. Dropped after the
/// block, which frees them.
struct OnDevice {
    blocks: HashMap<usize, Tensor>,
    _charge: Charge,
}

impl ParamSource for OnDevice {
    fn block_params(&self, b: usize) -> candle_core::Result<&[f32]> {
        candle_core::bail!(
            "ZeRO-3: block {b}'s parameters were gathered on the device, not the host"
        )
    }

    fn block_tensor(&self, b: usize) -> candle_core::Result<Option<Tensor>> {
        match self.blocks.get(&b) {
            Some(t) => Ok(Some(t.clone())),
            None => candle_core::bail!("ZeRO-3: block {b}'s parameters were not gathered"),
        }
    }
}

impl Zero {
    /// Stage 3's own conditions on top of DDP's: the shard in memory and
    /// not offloaded to the host (`offload_param.device = "cpu"` keeps it
    /// off the device) and plain gathers (no qwZ, no hpZ); hybrid
    /// sharding's replica group must reduce the device's memory too.
    pub(super) fn stage3_may_stay_on_device(&self, engine: &Engine) -> bool {
        self.store.is_resident()
            && !self.cfg.param_offload_host
            && self.secondary.is_none()
            && !self.cfg.quantized_weights
            && self
                .replica_pg
                .as_ref()
                .is_none_or(|rp| crate::collective::reduces_on(rp, engine.device()))
    }

    /// This rank's parameter shard on the device, uploaded from the host
    /// shard the first time (and after a checkpoint load let it go).
    fn device_store(&mut self, engine: &Engine) -> Result<Tensor> {
        if let Some((t, _)) = &self.device_store {
            return Ok(t.clone());
        }
        let host = self
            .store
            .resident()
            .ok_or_else(|| Error::Check("ZeRO-3 on the device needs a shard in memory".into()))?;
        let t = Tensor::from_slice(host, host.len(), engine.device())?;
        // The device's copy, beside the host shard (charged as parameters).
        let charge = engine.ledger().charge(Mem::Working, host.len() * 4);
        self.device_store = Some((t.clone(), charge));
        Ok(t)
    }

    /// Block `b`'s parameters, and those of the blocks it ties to, each
    /// gathered in place into a device buffer holding this rank's piece.
    fn gather_on_device(&self, engine: &Engine, shard: &Tensor, b: usize) -> Result<OnDevice> {
        let mut started = Started::new(&self.shard_pg);
        let g = self.start_gather(engine, shard, b, &mut started)?;
        started.wait()?;
        Ok(g)
    }

    /// [`Zero::gather_on_device`]'s buffers, their gathers started in
    /// `started`: the parameters are there once it is waited for.
    fn start_gather(
        &self,
        engine: &Engine,
        shard: &Tensor,
        b: usize,
        started: &mut Started,
    ) -> Result<OnDevice> {
        let layout = engine.layout();
        let mut owners = super::gather::tied_owners(layout, b);
        owners.push(b);
        owners.sort_unstable();
        let me = self.shard_pg.rank();
        let mut blocks = HashMap::new();
        for o in owners {
            let r = layout.block(o).range.clone();
            if r.is_empty() {
                // Nothing to serve (a block whose parameters are all
                // another's, e.g. a tied head).
                continue;
            }
            let counts = self.shards.counts(&r);
            let local = self.shards.local(&r);
            let at: usize = counts[..me].iter().sum();
            // This rank's piece in place; the gather writes the others'.
            let buf = Tensor::zeros(r.len(), DType::F32, engine.device())?;
            if !local.is_empty() {
                // `local` counts from the shard's start.
                buf.slice_set(&shard.narrow(0, local.start, local.len())?, 0, at)?;
            }
            started.all_gather(buf.clone(), &counts)?;
            blocks.insert(o, buf);
        }
        let bytes = blocks.values().map(|t| t.elem_count() * 4).sum();
        Ok(OnDevice {
            blocks,
            _charge: engine.ledger().charge(Mem::Working, bytes),
        })
    }

    /// Stage 3's micro-step on the device: each block's forward on its
    /// gathered parameters, then the backward block by block from the top,
    /// gathering again where the forward's were let go, each block's
    /// gradients reduce-scattered as soon as it is done and this rank's
    /// piece added to the step's.
    ///
    /// Every collective of the pass is started in one [`Started`] and
    /// waited for no earlier than needed: a block's gathers just before
    /// it computes (`forward_prefetch` / `backward_prefetch` blocks' gathers
    /// are started ahead, so they run while earlier blocks compute), and a
    /// block's reduce-scatters after the next block's backward (so they
    /// run while it computes; at most two blocks' held gradients are in
    /// flight).
    pub(super) fn gathered_on_device(
        &mut self,
        engine: &mut Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f32,
    ) -> Result<f32> {
        let shard = self.device_store(engine)?;
        let engine: &Engine = engine;
        let nb = engine.num_blocks();
        let pg = self.shard_pg.clone();
        let mut flight = Flight {
            started: Started::new(&pg),
            kinds: VecDeque::new(),
            ahead: VecDeque::new(),
        };
        let mut stashes: Vec<Stash> = Vec::with_capacity(nb);
        let mut kept: HashMap<usize, OnDevice> = HashMap::new();
        let mut h = x.clone();
        // The next block whose gathers are not started yet.
        let mut next = 0;
        for b in 0..nb {
            let src = self.take_gathered(engine, &shard, &mut flight, b)?;
            next = next.max(b + 1);
            while next < nb && next - b <= self.cfg.forward_prefetch {
                self.gather_ahead(engine, &shard, &mut flight, next)?;
                next += 1;
            }
            let targets = (b + 1 == nb).then_some(y);
            let (out, stash) = engine.stack().forward(b..b + 1, &h, targets, &src)?;
            h = out;
            stashes.push(stash);
            if b >= self.first_kept {
                kept.insert(b, src);
            }
        }
        // Nothing gathered ahead outlives the forward (the last block's
        // prefetch stops at the last block).
        self.retire(engine, &mut flight, usize::MAX)?;
        flight.ahead.clear();
        let loss = h.to_scalar::<f32>()?;
        let mut gy = Tensor::new(scale, engine.device())?;
        let mut cursor = ReadyCursor::default();
        // A failure inside the backward's hook, kept whole (a timeout
        // naming its rank) rather than as candle's message.
        let mut failed: Option<Error> = None;
        // Whether every unit held gradients: a rank that held none for a
        // unit joins its reduce-scatter with zeros and every later
        // collective, and fails once the backward is done, so its peers
        // finish theirs rather than wait.
        let mut held_all = true;
        // The collectives started through the previous block's
        // reduce-scatters: waited for after this block's backward.
        let mut previous = 0;
        // The next block below whose gathers are not started (blocks are
        // counted from 1 here: 0 means none left).
        let mut below = nb;
        for b in (0..nb).rev() {
            let src = match kept.remove(&b) {
                Some(src) => src,
                None => self.take_gathered(engine, &shard, &mut flight, b)?,
            };
            below = below.min(b);
            // The blocks below gathered while this one's backward computes.
            while below > 0 && b - (below - 1) <= self.cfg.backward_prefetch {
                let k = below - 1;
                if !kept.contains_key(&k) {
                    self.gather_ahead(engine, &shard, &mut flight, k)?;
                }
                below -= 1;
            }
            let stash = stashes.pop().expect("one stash per block");
            // The units reduce-scattered, in the order started.
            let mut scattered: Vec<(usize, Vec<usize>)> = Vec::new();
            let started = &mut flight.started;
            let mut hook = |b: usize, _: &mut NoHostGrads| -> candle_core::Result<()> {
                let ready = cursor.advance(&self.units, b);
                let r = self.start_units(engine, ready, started, &mut scattered);
                keep_failure(r.map(|held| held_all &= held), &mut failed)
            };
            let r =
                engine
                    .stack()
                    .backward(stash, &gy, &src, &mut NoHostGrads("ZeRO-3"), &mut hook);
            let dx = match (r, failed.take()) {
                (_, Some(e)) => return Err(e),
                (r, None) => r?,
            };
            drop(src);
            flight.kinds.extend(scattered.into_iter().map(Some));
            // The block above's reduce-scatters ran while this one computed.
            self.retire(engine, &mut flight, previous)?;
            previous = flight.started.len();
            if let Some(dx) = dx {
                gy = dx;
            }
        }
        self.retire(engine, &mut flight, usize::MAX)?;
        cursor.check_all(&self.units, "ZeRO-3")?;
        held_or_fail(loss, held_all, &self.shard_pg, "ZeRO-3")
    }

    /// Block `b`'s gathered parameters, waited for: started ahead (the
    /// front of `flight.ahead`), or gathered now.
    fn take_gathered(
        &mut self,
        engine: &Engine,
        shard: &Tensor,
        flight: &mut Flight,
        b: usize,
    ) -> Result<OnDevice> {
        if flight.ahead.front().is_some_and(|(k, ..)| *k == b) {
            let (_, src, through) = flight.ahead.pop_front().expect("a front");
            self.retire(engine, flight, through)?;
            return Ok(src);
        }
        let src = self.gather_ahead_into(engine, shard, flight, b)?;
        self.retire(engine, flight, flight.started.len())?;
        Ok(src)
    }

    /// Start block `b`'s gathers, queued in `flight.ahead` for
    /// [`Zero::take_gathered`].
    fn gather_ahead(
        &self,
        engine: &Engine,
        shard: &Tensor,
        flight: &mut Flight,
        b: usize,
    ) -> Result<()> {
        let src = self.gather_ahead_into(engine, shard, flight, b)?;
        let through = flight.started.len();
        flight.ahead.push_back((b, src, through));
        Ok(())
    }

    /// Start block `b`'s gathers in `flight` (their buffers held by the
    /// result, not by `flight.kinds`).
    fn gather_ahead_into(
        &self,
        engine: &Engine,
        shard: &Tensor,
        flight: &mut Flight,
        b: usize,
    ) -> Result<OnDevice> {
        let before = flight.started.len();
        let src = self.start_gather(engine, shard, b, &mut flight.started)?;
        let n = flight.started.len() - before;
        flight.kinds.extend(std::iter::repeat_n(None, n));
        Ok(src)
    }

    /// Wait for the first `n` collectives of `flight` (all: `usize::MAX`),
    /// adding this rank's pieces of the reduce-scatters among them to the
    /// step's.
    fn retire(&mut self, engine: &Engine, flight: &mut Flight, n: usize) -> Result<()> {
        let n = n.min(flight.started.len());
        let done = flight.started.wait_first(n)?;
        let mut scattered = Vec::new();
        let mut grads = Vec::new();
        for (kind, t) in flight.kinds.drain(..done.len()).zip(done) {
            if let Some(unit) = kind {
                scattered.push(unit);
                grads.push(t);
            }
        }
        self.add_pieces(engine, scattered, grads)
    }

    /// Validation loss without autograd, block by block on parameters
    /// gathered from the shard kept on the device; `None` when there is no
    /// such shard (no step took the device path yet, or a checkpoint load
    /// let it go; the same on every rank), for the host's gathers.
    pub(super) fn eval_on_device(
        &self,
        engine: &Engine,
        x: &Tensor,
        y: &Tensor,
    ) -> Result<Option<f32>> {
        let Some((shard, _)) = &self.device_store else {
            return Ok(None);
        };
        let nb = engine.num_blocks();
        let mut h = x.clone();
        for b in 0..nb {
            let src = self.gather_on_device(engine, shard, b)?;
            let targets = (b + 1 == nb).then_some(y);
            h = engine.stack().forward_eval(b..b + 1, &h, targets, &src)?;
        }
        Ok(Some(h.to_scalar::<f32>()?))
    }

    /// Step the device shard with `gs` in place, writing the new values to
    /// the host shard too.
    pub(super) fn step_device_store(&mut self, gs: &Tensor, lr: f32, factor: f32) -> Result<()> {
        let dev = self
            .device_store
            .as_ref()
            .map(|(t, _)| t.clone())
            .ok_or_else(|| {
                Error::Check("ZeRO-3: the step ended with no parameter shard on the device".into())
            })?;
        let host = self
            .store
            .resident_mut()
            .ok_or_else(|| Error::Check("ZeRO-3 on the device needs a shard in memory".into()))?;
        let opt = self.opt.as_device().ok_or_else(|| {
            Error::Check(
                "ZeRO-3: the gradients stayed on the device but the optimizer is not there".into(),
            )
        })?;
        opt.step_on(
            Some(host),
            &dev,
            crate::optim::Grads::Device(gs),
            lr,
            factor,
        )?;
        Ok(())
    }
}
