//! Which flat ranges a pipeline rank owns, and the reduction of parameters
//! read on several stages.
//!
//! The layout adds a tied parameter's gradient from every block that reads
//! it into one slot (the owner block's). Inside one process that slot ends
//! up with the full gradient; split over stages, each reader stage holds only
//! its blocks' share. So for every set of stages reading the same parameters
//! (GPT-2: `wte` on the first and last stage) there is one sub-group of the
//! pipeline group, and after the schedule those gradients are summed over
//! it. Every reader then applies the same optimizer update to the same
//! values, and the copies stay equal without ever sending parameters.

use std::collections::BTreeMap;
use std::ops::Range;

use phalanx_comm::{ProcessGroup, ReduceOp};

use super::schedule::Schedule;
use crate::engine::Layout;
use crate::error::Result;
use crate::mesh::{Axis, DeviceMesh};

/// One set of stages sharing parameters, as seen by one of them.
struct TieGroup {
    group: ProcessGroup,
    ranges: Vec<Range<usize>>,
}

pub(super) struct Ties {
    /// Ranges of every parameter this stage reads (merged).
    pub owned: Vec<Range<usize>>,
    /// Ranges of the parameters whose lowest reader stage is this one.
    pub primary: Vec<Range<usize>>,
    groups: Vec<TieGroup>,
}

/// Sort and merge adjacent ranges.
fn merge(mut rs: Vec<Range<usize>>) -> Vec<Range<usize>> {
    rs.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in rs.into_iter().filter(|r| !r.is_empty()) {
        match out.last_mut() {
            Some(l) if l.end >= r.start => l.end = l.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl Ties {
    /// `chunks`: block range of every chunk, chunk `c` on stage `c % p`.
    /// Collective over the mesh's `pp` axis (every stage asks for the same
    /// sub-groups, in the same order).
    pub fn new(
        layout: &Layout,
        chunks: &[Range<usize>],
        p: usize,
        stage: usize,
        mesh: &DeviceMesh,
    ) -> Result<Ties> {
        // readers[k]: the stages whose blocks read parameter k.
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); layout.params().len()];
        for (c, blocks) in chunks.iter().enumerate() {
            for b in blocks.clone() {
                for k in layout.block_param_indices(b) {
                    if !readers[k].contains(&(c % p)) {
                        readers[k].push(c % p);
                    }
                }
            }
        }
        let mut owned = Vec::new();
        let mut primary = Vec::new();
        let mut shared: BTreeMap<Vec<usize>, Vec<Range<usize>>> = BTreeMap::new();
        for (k, rs) in readers.iter_mut().enumerate() {
            rs.sort_unstable();
            let range = layout.params()[k].range();
            if rs.contains(&stage) {
                owned.push(range.clone());
            }
            if rs.first() == Some(&stage) {
                primary.push(range.clone());
            }
            if rs.len() > 1 {
                shared.entry(rs.clone()).or_default().push(range);
            }
        }
        let mut groups = Vec::new();
        for (stages, ranges) in shared {
            if let Some(group) = mesh.subgroup(Axis::Pp, &stages)? {
                groups.push(TieGroup {
                    group,
                    ranges: merge(ranges),
                });
            }
        }
        Ok(Ties {
            owned: merge(owned),
            primary: merge(primary),
            groups,
        })
    }

    /// Each group of stages that read the same parameters, and the flat
    /// ranges of those (in the same order on every member).
    pub fn groups(&self) -> impl Iterator<Item = (&ProcessGroup, &[Range<usize>])> {
        self.groups.iter().map(|g| (&g.group, g.ranges.as_slice()))
    }

    /// Sum the shared gradients over each group of stages sharing them.
    pub fn reduce(&self, grads: &mut [f32]) -> Result<()> {
        for g in &self.groups {
            let mut buf: Vec<f32> = Vec::new();
            for r in &g.ranges {
                buf.extend_from_slice(&grads[r.clone()]);
            }
            g.group.all_reduce(&mut buf, ReduceOp::Sum)?;
            let mut at = 0;
            for r in &g.ranges {
                grads[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
                at += r.len();
            }
        }
        Ok(())
    }
}

/// For every parameter this stage reads: the local chunk reading it whose
/// last backward of the step comes last in the table (its gradient is
/// final there); `None` for the others.
fn final_chunks(
    layout: &Layout,
    chunks: &[Range<usize>],
    schedule: &Schedule,
    stage: usize,
) -> Vec<Option<usize>> {
    let p = schedule.p;
    let mut finish: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, a) in schedule.ranks[stage].iter().enumerate() {
        if a.is_last_backward() {
            finish.insert(a.chunk(), i);
        }
    }
    let mut last: Vec<Option<usize>> = vec![None; layout.params().len()];
    for (c, blocks) in chunks.iter().enumerate().filter(|(c, _)| c % p == stage) {
        for b in blocks.clone() {
            for k in layout.block_param_indices(b) {
                if last[k].is_none_or(|l| finish[&l] < finish[&c]) {
                    last[k] = Some(c);
                }
            }
        }
    }
    last
}

/// The flat ranges whose gradients are final on this stage once a chunk's
/// last backward of the step has run, by chunk: every parameter this stage
/// reads goes with the local chunk reading it that finishes last in the
/// table. A data-parallel reduction can start there, while later chunks
/// still compute. (Summing tied parts over stages afterwards is fine: both
/// reductions are linear.)
pub(super) fn dp_buckets(
    layout: &Layout,
    chunks: &[Range<usize>],
    schedule: &Schedule,
    stage: usize,
) -> BTreeMap<usize, Vec<Range<usize>>> {
    let last = final_chunks(layout, chunks, schedule, stage);
    let mut out: BTreeMap<usize, Vec<Range<usize>>> = BTreeMap::new();
    for (k, c) in last.iter().enumerate() {
        if let Some(c) = c {
            out.entry(*c).or_default().push(layout.params()[k].range());
        }
    }
    out.into_iter().map(|(c, rs)| (c, merge(rs))).collect()
}

/// Part of a chunk's [`dp_buckets`] whose gradients are final as soon as
/// block `ready_at`'s backward has run within the chunk's last backward.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlockBucket {
    pub ready_at: usize,
    pub ranges: Vec<Range<usize>>,
}

/// Each chunk's [`dp_buckets`] cut by when its last backward makes them
/// final (the device path's buckets, as DDP's): a parameter is final once
/// the lowest block of that chunk reading it has run its backward (the
/// backward runs top block first). Blocks are put together, top first,
/// until a bucket holds at least `cap` bytes (the lowest bucket may hold
/// less). Per chunk, in the order they become ready.
pub(super) fn dp_block_buckets(
    layout: &Layout,
    chunks: &[Range<usize>],
    schedule: &Schedule,
    stage: usize,
    cap: usize,
) -> BTreeMap<usize, Vec<BlockBucket>> {
    let last = final_chunks(layout, chunks, schedule, stage);
    // Per (chunk, block): the ranges final once the block has run.
    let mut ready: BTreeMap<(usize, usize), Vec<Range<usize>>> = BTreeMap::new();
    for (k, c) in last.iter().enumerate() {
        let Some(c) = *c else { continue };
        let lowest = chunks[c]
            .clone()
            .find(|&b| layout.block_param_indices(b).any(|j| j == k));
        if let Some(b) = lowest {
            ready
                .entry((c, b))
                .or_default()
                .push(layout.params()[k].range());
        }
    }
    let mut out: BTreeMap<usize, Vec<BlockBucket>> = BTreeMap::new();
    // A bucket is closed with its ranges merged (one reduction each).
    let close = |out: &mut BTreeMap<usize, Vec<BlockBucket>>, c: usize, mut bk: BlockBucket| {
        bk.ranges = merge(bk.ranges);
        out.entry(c).or_default().push(bk);
    };
    let mut cur: Option<(usize, BlockBucket)> = None;
    for ((c, b), rs) in ready.into_iter().rev() {
        if let Some((cc, bk)) = cur.take() {
            match cc == c {
                true => cur = Some((cc, bk)),
                false => close(&mut out, cc, bk),
            }
        }
        let (_, bk) = cur.get_or_insert((
            c,
            BlockBucket {
                ready_at: b,
                ranges: vec![],
            },
        ));
        bk.ready_at = b;
        bk.ranges.extend(rs);
        let bytes: usize = bk.ranges.iter().map(|r| r.len() * 4).sum();
        if bytes >= cap.max(1) {
            let (cc, bk) = cur.take().expect("just set");
            close(&mut out, cc, bk);
        }
    }
    if let Some((cc, bk)) = cur {
        close(&mut out, cc, bk);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ParamDecl;
    use crate::strategy::pipeline::ScheduleKind;

    /// GPT-2's shape: the embedding in block 0, read again by the head.
    fn layout() -> Layout {
        let d = |n: &str, k: usize| ParamDecl::new(n, &[k]);
        Layout::new(vec![
            vec![d("wte", 8), d("wpe", 4)],
            vec![d("h0.a", 6), d("h0.b", 2)],
            vec![d("h1.a", 6), d("h1.b", 2)],
            vec![d("h2.a", 6), d("h2.b", 2)],
            vec![d("lnf", 2), d("wte", 8)],
        ])
        .unwrap()
    }

    #[test]
    fn block_buckets_cut_each_chunks_ranges_by_when_they_are_final() {
        let l = layout();
        let chunks = vec![0..2, 2..3, 3..4, 4..5];
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved { v: 2 }] {
            let chunks: Vec<Range<usize>> = match kind {
                ScheduleKind::OneFOneB => vec![0..3, 3..5],
                _ => chunks.clone(),
            };
            let s = Schedule::new(kind, 2, 3).unwrap();
            for stage in 0..2 {
                let whole = dp_buckets(&l, &chunks, &s, stage);
                for cap in [0, 40, 1 << 20] {
                    let cut = dp_block_buckets(&l, &chunks, &s, stage, cap);
                    assert_eq!(
                        cut.keys().collect::<Vec<_>>(),
                        whole.keys().collect::<Vec<_>>()
                    );
                    for (c, bs) in &cut {
                        // Each bucket's ranges merged (one reduction
                        // per run of parameters); together they are the
                        // chunk's ranges, ...
                        for b in bs {
                            assert_eq!(b.ranges, merge(b.ranges.clone()), "{kind:?} {bs:?}");
                        }
                        let all = merge(bs.iter().flat_map(|b| b.ranges.clone()).collect());
                        assert_eq!(
                            &all, &whole[c],
                            "{kind:?} stage {stage} chunk {c} cap {cap}"
                        );
                        // ... ready from the top block down, inside the chunk.
                        for w in bs.windows(2) {
                            assert!(w[0].ready_at > w[1].ready_at, "{bs:?}");
                        }
                        assert!(bs.iter().all(|b| chunks[*c].contains(&b.ready_at)));
                        if cap == 1 << 20 {
                            assert_eq!(bs.len(), 1, "one bucket under a large cap: {bs:?}");
                        }
                    }
                }
            }
        }
        // 1F1B, stage 0 (blocks 0..3), every block its own bucket: h1 first,
        // then h0, then the embedding (wpe, and wte: read by block 0 only
        // on this stage).
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 3).unwrap();
        let cut = dp_block_buckets(&l, &[0..3, 3..5], &s, 0, 0);
        // The bucket of `names`, final once block `at` has run.
        let bucket = |at: usize, names: &[&str]| BlockBucket {
            ready_at: at,
            ranges: merge(names.iter().map(|n| l.find(n).unwrap().range()).collect()),
        };
        let want = vec![
            bucket(2, &["h1.a", "h1.b"]),
            bucket(1, &["h0.a", "h0.b"]),
            bucket(0, &["wte", "wpe"]),
        ];
        assert_eq!(cut[&0], want);
        // Stage 1 (blocks 3..5): the tied wte is final with lnf, after
        // block 4 (the head, its only reader there).
        let cut = dp_block_buckets(&l, &[0..3, 3..5], &s, 1, 0);
        let want = vec![bucket(4, &["lnf", "wte"]), bucket(3, &["h2.a", "h2.b"])];
        assert_eq!(cut[&1], want);
    }
}
