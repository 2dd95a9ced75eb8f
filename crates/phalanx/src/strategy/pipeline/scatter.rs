//! ZeRO-1 on a pipeline stage with its gradients on the device: each dp
//! rank keeps its piece of every owned range (`shard_range`'s cut of the
//! range over dp), reduce-scattered where the gradients lie.
//!
//! With `overlap_dp` (the default) the reduce-scatters start bucket by
//! bucket inside each chunk's last backward, as the all-reduces of plain
//! data parallelism do (`on_device`'s `Flight`): a bucket's ranges meet
//! the dp ranks' pieces anywhere, so each is reduce-scattered by the
//! lengths it shares with them (`collective::reduce_scatter_v`; uneven on
//! NCCL: one grouped `ncclReduce` per rank). Tied parameters are the
//! exception: their stages cut them differently (each by its own owned
//! range), so they are summed over their stages first, after the
//! schedule, and reduce-scattered then. This rank's parts are put
//! together as its piece of each range.

use std::ops::Range;

use candle_core::Tensor;
use phalanx_comm::ReduceOp;

use super::on_device::Flight;
use super::trace::EventKind;
use super::{BatchFn, Pipeline};
use crate::collective::{all_reduce_in_place, reduce_scatter_in_place, reduce_scatter_v_in_place};
use crate::engine::{shard_range, Engine};
use crate::error::{Error, Result};
use crate::strategy::ddp::take_held_grads;

/// ZeRO-1's cut of a stage's owned ranges over `n` dp ranks, and the tied
/// ranges, left whole until their sums.
#[derive(Debug, Clone)]
pub(super) struct Scatter {
    owned: Vec<Range<usize>>,
    tied: Vec<Range<usize>>,
    rank: usize,
    n: usize,
}

impl Scatter {
    pub fn new(
        owned: Vec<Range<usize>>,
        tied: Vec<Range<usize>>,
        rank: usize,
        n: usize,
    ) -> Scatter {
        Scatter {
            owned,
            tied,
            rank,
            n,
        }
    }

    /// Dp rank `k`'s piece of owned range `o` (global).
    fn piece(&self, o: &Range<usize>, k: usize) -> Range<usize> {
        let s = shard_range(o.len(), k, self.n);
        o.start + s.start..o.start + s.end
    }

    /// How much of `r` (inside one owned range) each dp rank's piece holds.
    pub fn counts(&self, r: &Range<usize>) -> Result<Vec<usize>> {
        let o = self
            .owned
            .iter()
            .find(|o| o.start <= r.start && r.end <= o.end)
            .ok_or_else(|| Error::Check(format!("pipeline: {r:?} lies in no owned range")))?;
        Ok((0..self.n)
            .map(|k| {
                let p = self.piece(o, k);
                p.end.min(r.end).saturating_sub(p.start.max(r.start))
            })
            .collect())
    }

    /// `r` less the tied ranges, in order.
    pub fn untied(&self, r: &Range<usize>) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut at = r.start;
        for t in &self.tied {
            if t.end <= at || t.start >= r.end {
                continue;
            }
            if t.start > at {
                out.push(at..t.start);
            }
            at = at.max(t.end);
        }
        if at < r.end {
            out.push(at..r.end);
        }
        out
    }

    /// This rank's part of `g`, the gradients of `r` reduce-scattered by
    /// `counts`: (its global start, the part); `None` where it holds none.
    fn mine(
        &self,
        r: &Range<usize>,
        counts: &[usize],
        g: &Tensor,
    ) -> Result<Option<(usize, Tensor)>> {
        let len = counts[self.rank];
        if len == 0 {
            return Ok(None);
        }
        let off: usize = counts[..self.rank].iter().sum();
        Ok(Some((r.start + off, g.narrow(0, off, len)?)))
    }

    /// This rank's piece of every owned range put together from `parts`
    /// ((global start, values) of each); `None` where a piece is empty. An
    /// error names a piece the parts do not cover exactly.
    fn assemble(&self, mut parts: Vec<(usize, Tensor)>) -> Result<Vec<Option<Tensor>>> {
        parts.sort_unstable_by_key(|(at, _)| *at);
        let mut out = Vec::with_capacity(self.owned.len());
        for o in &self.owned {
            let p = self.piece(o, self.rank);
            let mine: Vec<&(usize, Tensor)> =
                parts.iter().filter(|(at, _)| p.contains(at)).collect();
            let mut at = p.start;
            for (s, t) in &mine {
                if *s != at {
                    return Err(Error::Check(format!(
                        "pipeline: ZeRO-1's parts of {p:?} leave a gap at {at} (next at {s})"
                    )));
                }
                at += t.elem_count();
            }
            if at != p.end {
                return Err(Error::Check(format!(
                    "pipeline: ZeRO-1's parts of {p:?} end at {at}"
                )));
            }
            let ts: Vec<Tensor> = mine.into_iter().map(|(_, t)| t.clone()).collect();
            out.push(match ts.len() {
                0 => None,
                1 => Some(ts[0].force_contiguous()?),
                _ => Some(Tensor::cat(&ts, 0)?),
            });
        }
        Ok(out)
    }
}

impl Pipeline {
    /// ZeRO-1's step with the gradients on the device: the schedule, the
    /// tied gradients summed over their stages, and every owned range
    /// reduce-scattered (averaged) over dp (bucket by bucket inside the
    /// chunks' last backwards with `overlap_dp`; see the module docs).
    /// Returns the mean loss and, per owned range, this dp rank's piece of
    /// its gradients (`None` where the piece is empty: CUDA refuses an
    /// allocation of 0 bytes).
    pub fn forward_backward_scattered(
        &mut self,
        engine: &mut Engine,
        batch: &mut BatchFn,
    ) -> Result<(f32, Vec<Option<Tensor>>)> {
        let dp = self.mesh.dp().clone();
        if dp.size() == 1 || !self.cfg.overlap_dp {
            // Everything after the schedule: whole ranges, padded to whole
            // pieces of ceil(len / dp) for the even reduce-scatter.
            // A fault of this rank's reported after the reduce-scatters,
            // which its dp peers join.
            let (loss, grads, fault) = self.forward_backward_held(engine, batch, true)?;
            let t0 = self.timeline.now_us();
            let mut mine = Vec::with_capacity(grads.len());
            // Each range's whole gradients let go once its piece is out.
            for (g, o) in grads.into_iter().zip(&self.ties.owned) {
                reduce_scatter_in_place(&dp, &g, ReduceOp::Avg)?;
                let s = shard_range(o.len(), dp.rank(), dp.size());
                mine.push(match s.is_empty() {
                    true => None,
                    false => Some(g.narrow(0, s.start, s.len())?.force_contiguous()?),
                });
            }
            self.event(EventKind::DpReduce, t0);
            return match fault {
                Some(e) => Err(e),
                None => Ok((loss, mine)),
            };
        }
        let tied: Vec<Range<usize>> = {
            let mut t: Vec<Range<usize>> =
                self.ties.groups().flat_map(|(_, rs)| rs.to_vec()).collect();
            t.sort_unstable_by_key(|r| r.start);
            t
        };
        let sc = Scatter::new(self.ties.owned.clone(), tied, dp.rank(), dp.size());
        engine.zero_grad();
        engine.hold_grads(true);
        let buckets = self.dp_block_buckets.clone();
        let mut flight = Flight::new(buckets, &dp, Some(sc.clone()), engine.device());
        let loss = self.run_schedule_with(engine, batch, &mut flight);
        engine.hold_grads(false);
        let loss = loss?;
        let Flight {
            started,
            pieces,
            mut missing,
            ..
        } = flight;
        let t0 = self.timeline.now_us();
        let reduced = started.wait()?;
        self.event(EventKind::DpReduce, t0);
        let mut parts = Vec::new();
        for ((r, counts), g) in pieces.iter().zip(&reduced) {
            parts.extend(sc.mine(r, counts, g)?);
        }
        // The tied parameters: summed over their stages, then cut.
        let t0 = self.timeline.now_us();
        let mut tied = Vec::new();
        for (group, ranges) in self.ties.groups() {
            for r in ranges {
                // Zeros stand in where none are held, so that this rank
                // still joins; it fails after.
                let (g, held) = take_held_grads(engine, r.clone(), 0)?;
                if !held {
                    missing.get_or_insert(r.clone());
                }
                all_reduce_in_place(group, &g, ReduceOp::Sum)?;
                tied.push((r.clone(), g));
            }
        }
        self.event(EventKind::TieReduce, t0);
        let t0 = self.timeline.now_us();
        for (r, g) in &tied {
            let counts = sc.counts(r)?;
            reduce_scatter_v_in_place(&dp, g, &counts, ReduceOp::Avg)?;
            parts.extend(sc.mine(r, &counts, g)?);
        }
        self.event(EventKind::DpReduce, t0);
        // The loss's mean joined before any fault of this rank's returns.
        let mean = self.dp_mean(loss)?;
        // A gradient held after its bucket started would be lost.
        let late = engine.stack().held_grads_count();
        if late > 0 {
            engine.stack().drop_held_grads();
            return Err(Error::Check(format!(
                "pipeline: stage {} held {late} parameters' gradients after their chunks' \
                 reductions had started",
                self.stage
            )));
        }
        if let Some(r) = missing {
            return Err(Error::Check(format!(
                "pipeline: stage {} held no gradients on the device for {r:?} after backward",
                self.stage
            )));
        }
        Ok((mean, sc.assemble(parts)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn counts_cut_a_range_by_the_pieces_and_untied_skips_the_tied() {
        // Owned 10..20 over 3 ranks: pieces 10..14, 14..18, 18..20.
        let tied: Vec<Range<usize>> = std::iter::once(12..15).collect();
        let sc = Scatter::new(vec![0..5, 10..20], tied, 1, 3);
        assert_eq!(sc.counts(&(10..20)).unwrap(), vec![4, 4, 2]);
        assert_eq!(sc.counts(&(13..19)).unwrap(), vec![1, 4, 1]);
        assert_eq!(sc.counts(&(0..5)).unwrap(), vec![2, 2, 1]);
        assert!(sc.counts(&(4..11)).is_err());
        assert_eq!(sc.untied(&(10..20)), vec![10..12, 15..20]);
        assert_eq!(sc.untied(&(12..15)), Vec::<Range<usize>>::new());
        assert_eq!(sc.untied(&(0..5)), vec![0..5]);
        // Rank 1's parts of 13..19 and 10..13 (reduced in place: its part
        // sits after rank 0's).
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let a = sc
            .mine(&(13..19), &[1, 4, 1], &t(&[0., 1., 2., 3., 4., 5.]))
            .unwrap();
        let (at, part) = a.unwrap();
        assert_eq!(
            (at, part.to_vec1::<f32>().unwrap()),
            (14, vec![1., 2., 3., 4.])
        );
        let b = sc
            .mine(&(10..13), &sc.counts(&(10..13)).unwrap(), &t(&[7., 8., 9.]))
            .unwrap();
        assert!(b.is_none(), "rank 1 holds none of 10..13");
        let c = sc
            .mine(&(0..5), &[2, 2, 1], &t(&[0., 1., 2., 3., 4.]))
            .unwrap()
            .unwrap();
        let got = sc.assemble(vec![(at, part), c]).unwrap();
        assert_eq!(
            got[0].as_ref().unwrap().to_vec1::<f32>().unwrap(),
            vec![2., 3.]
        );
        assert_eq!(
            got[1].as_ref().unwrap().to_vec1::<f32>().unwrap(),
            vec![1., 2., 3., 4.]
        );
        // A part missing is a gap.
        let c = sc
            .mine(&(0..5), &[2, 2, 1], &t(&[0., 1., 2., 3., 4.]))
            .unwrap()
            .unwrap();
        assert!(sc.assemble(vec![c]).is_err());
    }
}
