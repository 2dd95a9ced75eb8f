//! Stage 3's movement of block parameters and gradients: the staging of a
//! block's gradients until its reduce-scatter, and the all-gathers that
//! bring a block's parameters in just before it runs and free them after.
//! Their buffers come from, and go back to, the strategy's [`Pool`], so a
//! steady step takes no fresh pages from the kernel.

use super::offload::ShardStore;
use crate::engine::{Engine, GradSink, ParamInfo, ParamSource};
use crate::error::{Error, Result};
use crate::ledger::{Charge, Mem};
use crate::strategy::pool::Pool;
use crate::strategy::reduce::Bucket;
use crate::strategy::shard::Shards;
use phalanx_comm::ProcessGroup;
use std::collections::{HashMap, VecDeque};

/// Gradient staging for stages 2-3: one buffer per reduction unit, created
/// when the unit's first gradient arrives (a tied weight's unit may open
/// early, from the head) and handed to the reduce-scatter when complete.
/// Buffers come from `pool`, zeroed.
pub(super) struct Staging<'a> {
    pub units: &'a [Bucket],
    pub unit_of_block: &'a [usize],
    pub bufs: HashMap<usize, (Vec<f32>, Option<Charge>)>,
    pub ledger: crate::ledger::Ledger,
    pub pool: &'a Pool,
}

impl Staging<'_> {
    /// Unit `u`'s staging buffer, opened (zeroed, charged) on first use.
    fn unit_buf(&mut self, u: usize) -> &mut Vec<f32> {
        let unit = &self.units[u];
        let (ledger, pool) = (&self.ledger, self.pool);
        let (buf, _) = self.bufs.entry(u).or_insert_with(|| {
            (
                pool.take_zeroed(unit.range.len()),
                Some(ledger.charge(Mem::Grads, unit.range.len() * 4)),
            )
        });
        buf
    }
}

impl GradSink for Staging<'_> {
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> candle_core::Result<()> {
        let u = self.unit_of_block[p.block];
        let lo = p.offset - self.units[u].range.start;
        crate::ops::cpu::add_assign(&mut self.unit_buf(u)[lo..lo + p.numel], grad);
        Ok(())
    }

    /// Slots when every parameter is in one unit (a block's own layer).
    fn slots(&mut self, ps: &[&ParamInfo]) -> Option<Vec<&mut [f32]>> {
        let u = self.unit_of_block[ps.first()?.block];
        if ps.iter().any(|p| self.unit_of_block[p.block] != u) {
            return None;
        }
        let base = self.units[u].range.start;
        crate::engine::flat::split_slots(self.unit_buf(u), base, ps)
    }
}

/// Stage 3: all-gathers of block parameters, issued `ahead` blocks in
/// advance in the order the blocks will run (each block with the blocks it
/// ties to, e.g. GPT-2's head with the embedding). Issuing a gather reads
/// this rank's piece of the block from the shard store (from the file when
/// offloaded, so the read is as far ahead as the gather); that piece is
/// charged as parameters until the gather completes when the store is not
/// resident (a resident store is charged whole already).
pub(super) struct Gatherer<'a> {
    /// The shard gathered from, its geometry and group.
    shard: (&'a dyn ShardStore, &'a Shards, &'a ProcessGroup),
    engine: &'a Engine,
    /// Remaining requests: (block that needs it, block to gather).
    todo: VecDeque<(usize, usize)>,
    pending: VecDeque<Pending>,
    ahead: usize,
    /// ZeRO++ qwZ: gather block-wise int8.
    quantized: bool,
    /// Where pieces, gathered blocks and their staging come from.
    pool: Pool,
}

/// A gather in flight: (block that needs it, block gathered, the gather,
/// the charge for the piece read from an offloaded shard).
type Pending = (
    usize,
    usize,
    crate::strategy::reduce::Pending,
    Option<Charge>,
);

impl<'a> Gatherer<'a> {
    pub(super) fn over(
        shard: (&'a dyn ShardStore, &'a Shards, &'a ProcessGroup),
        engine: &'a Engine,
        ahead: usize,
        order: Vec<usize>,
        pool: Pool,
    ) -> Self {
        let layout = engine.layout();
        let mut todo = VecDeque::new();
        for b in order {
            todo.push_back((b, b));
            for o in tied_owners(layout, b) {
                todo.push_back((b, o));
            }
        }
        Gatherer {
            shard,
            engine,
            todo,
            pending: VecDeque::new(),
            ahead,
            quantized: false,
            pool,
        }
    }

    /// Gather int8 blocks and scales instead of values (ZeRO++ qwZ).
    pub(super) fn quantized(mut self, on: bool) -> Self {
        self.quantized = on;
        self
    }

    fn issue(&mut self) -> Result<()> {
        let (b, owner) = self.todo.pop_front().unwrap();
        let r = self.engine.layout().block(owner).range.clone();
        let (store, shards, pg) = self.shard;
        let local = shards.local(&r);
        let charge = (!store.is_resident())
            .then(|| self.engine.ledger().charge(Mem::Params, local.len() * 4));
        // Overwritten whole by the read.
        let mut piece = self.pool.take(local.len());
        store
            .read(local, &mut piece)
            .map_err(|e| Error::Io(e.to_string()))?;
        let counts = shards.counts(&r);
        let pool = &self.pool;
        let w = if self.quantized {
            gather_quantized(pg, piece, counts, pool)
        } else {
            gather_in(pg, piece, counts, self.engine.stack().compute_dtype(), pool)
        };
        self.pending.push_back((b, owner, w, charge));
        Ok(())
    }

    /// The parameters block `b` needs, gathered (blocks after it keep
    /// gathering in the background).
    pub(super) fn take(&mut self, b: usize) -> Result<Gathered> {
        let blocks_ahead = |p: &VecDeque<Pending>| {
            let mut seen: Vec<usize> = p.iter().map(|x| x.0).collect();
            seen.dedup();
            seen.len()
        };
        while !self.todo.is_empty()
            && (self.todo.front().unwrap().0 == b || blocks_ahead(&self.pending) <= self.ahead)
        {
            self.issue()?;
        }
        let mut out = Gathered {
            blocks: HashMap::new(),
            _charge: Vec::new(),
            pool: self.pool.clone(),
        };
        while self.pending.front().is_some_and(|p| p.0 == b) {
            let (_, owner, w, _piece) = self.pending.pop_front().unwrap();
            let v = w.wait()?;
            out._charge
                .push(self.engine.ledger().charge(Mem::Working, v.len() * 4));
            out.blocks.insert(owner, v);
        }
        Ok(out)
    }
}

/// The other blocks whose parameters block `b` reads (its ties: GPT-2's
/// head reads the embedding's), each once, in block order.
pub(super) fn tied_owners(layout: &crate::engine::Layout, b: usize) -> Vec<usize> {
    // `tied` lists parameter indices.
    let mut owners: Vec<usize> = layout
        .block(b)
        .tied
        .iter()
        .map(|&k| layout.params()[k].block)
        .filter(|&o| o != b)
        .collect();
    owners.sort_unstable();
    owners.dedup();
    owners
}

/// Gathered block parameters, returned to the pool when dropped.
pub(super) struct Gathered {
    pub blocks: HashMap<usize, Vec<f32>>,
    _charge: Vec<Charge>,
    pool: Pool,
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // Released before the pool charges them as idle: never both.
        self._charge.clear();
        for (_, v) in self.blocks.drain() {
            self.pool.put(v);
        }
    }
}

impl ParamSource for Gathered {
    fn block_params(&self, b: usize) -> candle_core::Result<&[f32]> {
        match self.blocks.get(&b) {
            Some(v) => Ok(v),
            None => candle_core::bail!("ZeRO-3: block {b}'s parameters were not gathered"),
        }
    }
}

/// All-gather `piece` as block-wise int8 (ZeRO++ qwZ): each rank's piece
/// is quantised on its own (256 values and one f32 scale per block), and
/// every rank, the owner included, uses what the gathered bytes decode to,
/// so all ranks compute with identical parameters.
fn gather_quantized(
    pg: &ProcessGroup,
    piece: Vec<f32>,
    counts: Vec<usize>,
    pool: &Pool,
) -> crate::strategy::reduce::Pending {
    use crate::strategy::hooks::{add_dequantised, quantise, INT8_BLOCK};
    let (packed, scales, _) = quantise(&piece);
    pool.put(piece);
    let qc: Vec<usize> = counts.iter().map(|c| c.div_ceil(4)).collect();
    let sc: Vec<usize> = counts.iter().map(|c| c.div_ceil(INT8_BLOCK)).collect();
    // `quantise` allocates its outputs: they are not the pool's.
    let q_out = pool.take::<i32>(qc.iter().sum());
    let wq = pg.all_gather_into_async(packed, qc.clone(), q_out, drop);
    let s_out = pool.take::<f32>(sc.iter().sum());
    let ws = pg.all_gather_into_async(scales, sc.clone(), s_out, drop);
    let pool = pool.clone();
    crate::strategy::reduce::Pending::new(move || {
        let (q, s) = (wq.wait()?, ws.wait()?);
        // Dequantised values are added in: it starts at zero.
        let mut out = pool.take_zeroed::<f32>(counts.iter().sum());
        let (mut o, mut qo, mut so) = (0, 0, 0);
        for r in 0..counts.len() {
            add_dequantised(
                &mut out[o..o + counts[r]],
                &q[qo..qo + qc[r]],
                &s[so..so + sc[r]],
            );
            (o, qo, so) = (o + counts[r], qo + qc[r], so + sc[r]);
        }
        pool.put(q);
        pool.put(s);
        Ok(out)
    })
}

/// All-gather `piece` in the compute dtype (mixed precision halves the
/// bytes): a block casts its parameters to that dtype anyway, and rounding
/// to it is idempotent, so the block sees exactly what a full-precision
/// gather would have given it. Every buffer comes from `pool` and is
/// overwritten whole; the inputs go back as soon as they are sent.
fn gather_in(
    pg: &ProcessGroup,
    piece: Vec<f32>,
    counts: Vec<usize>,
    dtype: candle_core::DType,
    pool: &Pool,
) -> crate::strategy::reduce::Pending {
    use crate::strategy::reduce::Pending as P;
    use candle_core::DType;
    use half::slice::HalfFloatSliceExt;
    let total = counts.iter().sum();
    let p = pool.clone();
    let pool = pool.clone();
    match dtype {
        DType::BF16 => {
            let mut h = pool.take::<half::bf16>(piece.len());
            crate::ops::cpu::f32_to_bf16(&piece, &mut h);
            pool.put(piece);
            let w = pg.all_gather_into_async(h, counts, pool.take(total), move |h| p.put(h));
            P::new(move || {
                let h = w.wait()?;
                let mut out = pool.take::<f32>(h.len());
                crate::ops::cpu::bf16_to_f32(&h, &mut out);
                pool.put(h);
                Ok(out)
            })
        }
        DType::F16 => {
            let mut h = pool.take::<half::f16>(piece.len());
            h.convert_from_f32_slice(&piece);
            pool.put(piece);
            let w = pg.all_gather_into_async(h, counts, pool.take(total), move |h| p.put(h));
            P::new(move || {
                let h = w.wait()?;
                let mut out = pool.take::<f32>(h.len());
                h.convert_to_f32_slice(&mut out);
                pool.put(h);
                Ok(out)
            })
        }
        _ => P::work(pg.all_gather_into_async(piece, counts, pool.take(total), move |v| p.put(v))),
    }
}
