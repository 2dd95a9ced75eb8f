//! ZeRO-2/3's micro-step: backward into per-unit staging buffers, each
//! unit reduce-scattered into this rank's gradient shard as soon as its
//! last block is done. Stage 3 also gathers each block's parameters before
//! its forward and again before its backward (`Gatherer`, with prefetch),
//! keeping the last blocks' gathers under `stage3_max_reuse_distance` and
//! gathering from the secondary partition under hpZ.

use super::gather::{Gathered, Gatherer, Staging};
use super::offload::ShardStore;
use super::Zero;
use crate::engine::{Engine, Stash};
use crate::error::Result;
use crate::strategy::reduce::{Collective, ReadyCursor};
use candle_core::Tensor;
use phalanx_comm::ReduceOp;
use std::collections::HashMap;

impl Zero {
    /// Stages 2 and 3: gradients go to per-unit staging buffers and each
    /// unit is reduce-scattered into the shard as soon as it is complete.
    pub(super) fn backward_sharded(
        &mut self,
        engine: &mut Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f32,
        gather: bool,
    ) -> Result<f32> {
        let nb = engine.num_blocks();
        let gy = Tensor::new(scale, engine.device())?;
        let mut sink = Staging {
            units: &self.units,
            unit_of_block: &self.unit_of_block,
            bufs: HashMap::new(),
            ledger: engine.ledger().clone(),
            pool: &self.pool,
        };
        let (units, shards, pool) = (&self.units, &self.shards, &self.pool);
        let reducer = &mut self.reducer;
        let mut cursor = ReadyCursor::default();
        let mut hook = |b: usize, s: &mut Staging| -> candle_core::Result<()> {
            for u in cursor.advance(units, b) {
                let (buf, _charge) = s
                    .bufs
                    .remove(&u)
                    .unwrap_or_else(|| (pool.take_zeroed(units[u].range.len()), None));
                let counts = shards.counts(&units[u].range);
                reducer.launch(u, buf, &Collective::ReduceScatter { counts });
            }
            Ok(())
        };
        let loss = if !gather {
            let (loss, stash) = engine
                .stack()
                .forward(0..nb, x, Some(y), engine.param_source())?;
            engine
                .stack()
                .backward(stash, &gy, engine.param_source(), &mut sink, &mut hook)?;
            loss.to_scalar::<f32>()?
        } else {
            let src = (&*self.store, &self.shards, &self.shard_pg);
            let qw = self.cfg.quantized_weights;
            let ahead = self.cfg.forward_prefetch;
            let mut g =
                Gatherer::over(src, engine, ahead, (0..nb).collect(), pool.clone()).quantized(qw);
            let mut stashes: Vec<Stash> = Vec::with_capacity(nb);
            let mut h = x.clone();
            // Blocks used again in the backward within max_reuse_distance
            // parameters keep what the forward gathered: a suffix of blocks.
            let first_kept = self.first_kept;
            let mut kept: HashMap<usize, Gathered> = HashMap::new();
            for b in 0..nb {
                let src = g.take(b)?;
                if let Some(s) = &mut self.secondary {
                    s.keep(engine, &src);
                }
                let targets = (b + 1 == nb).then_some(y);
                let (out, stash) = engine.stack().forward(b..b + 1, &h, targets, &src)?;
                h = out;
                stashes.push(stash);
                if b >= first_kept {
                    kept.insert(b, src);
                }
            }
            let loss = h.to_scalar::<f32>()?;
            // hpZ: gather from the secondary partition, inside the group
            // (exact: it holds what the forward gathered).
            let (src, qw) = match &self.secondary {
                Some(s) => ((&s.store as &dyn ShardStore, &s.shards, &s.pg), false),
                None => (src, qw),
            };
            let mut g = Gatherer::over(
                src,
                engine,
                self.cfg.backward_prefetch,
                (0..nb).rev().filter(|b| !kept.contains_key(b)).collect(),
                pool.clone(),
            )
            .quantized(qw);
            let mut gy = gy;
            for b in (0..nb).rev() {
                let src = match kept.remove(&b) {
                    Some(src) => src,
                    None => g.take(b)?,
                };
                let stash = stashes.pop().unwrap();
                if let Some(dx) = engine
                    .stack()
                    .backward(stash, &gy, &src, &mut sink, &mut hook)?
                {
                    gy = dx;
                }
            }
            loss
        };
        cursor.check_all(&self.units, "ZeRO")?;
        for (u, mut piece) in self.reducer.wait_all()? {
            if let Some(rp) = &self.replica_pg {
                rp.all_reduce(&mut piece, ReduceOp::Avg)?;
            }
            let local = self.shards.local(&self.units[u].range);
            for (d, s) in self.grad_shard[local].iter_mut().zip(&piece) {
                *d += s;
            }
            self.pool.put(piece);
        }
        Ok(loss)
    }
}
