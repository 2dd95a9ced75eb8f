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
    let p = schedule.p;
    let mut finish: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, a) in schedule.ranks[stage].iter().enumerate() {
        if a.is_last_backward() {
            finish.insert(a.chunk(), i);
        }
    }
    // For each parameter: the local chunk reading it that finishes last.
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
    let mut out: BTreeMap<usize, Vec<Range<usize>>> = BTreeMap::new();
    for (k, c) in last.iter().enumerate() {
        if let Some(c) = c {
            out.entry(*c).or_default().push(layout.params()[k].range());
        }
    }
    out.into_iter().map(|(c, rs)| (c, merge(rs))).collect()
}
