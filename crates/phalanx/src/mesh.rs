//! The device mesh: named axes over the world (torchtitan's `ParallelDims`
//! and `DeviceMesh`), one process group per axis, made once and reused.
//!
//! Axes, innermost first (Megatron-LM's placement: `tp` on neighbouring
//! ranks, the fastest links, `pp` outermost):
//! - `tp`: the ranks splitting each layer's matrices;
//! - `dp_shard`: the ranks sharding parameters, gradients and optimizer
//!   state (ZeRO / FSDP); `dp_replicate`: the replicas of each shard (HSDP);
//!   together `dp = dp_replicate x dp_shard`, the ranks averaging gradients;
//! - `pp`: the stages of one pipeline.
//!
//! `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`, and
//! `dp_rank = replicate_rank * dp_shard + shard_rank`.
//!
//! An axis that spans the whole world *is* the world group (no sub-group),
//! so its collectives take the world group's paths (on one host, the
//! in-place shared-memory all-reduce). Groups inside an axis (HSDP's shard
//! and replica groups, ZeRO++'s hpZ groups, the pipeline's tie groups) come
//! from [`DeviceMesh::split`] and [`DeviceMesh::subgroup`], each made once
//! and kept.
//!
//! ```
//! use phalanx::mesh::{Axis, Coords, DeviceMesh};
//! let out = phalanx_comm::threads::run(8, |pg| {
//!     let mesh = DeviceMesh::new(&pg, 2, 2, 2).unwrap(); // dp, pp, tp
//!     let g = |a| mesh.group(a).global_ranks().to_vec();
//!     (mesh.coords(), g(Axis::Tp), g(Axis::Dp), g(Axis::Pp))
//! });
//! // Rank 5 = pp 1, dp 0, tp 1.
//! assert_eq!(out[5].0, Coords { dp: 0, pp: 1, tp: 1 });
//! assert_eq!(out[5].1, vec![4, 5]); // its tensor-parallel group
//! assert_eq!(out[5].2, vec![5, 7]); // its data-parallel group
//! assert_eq!(out[5].3, vec![1, 5]); // its pipeline group
//! // A data-parallel axis over the whole world is the world group itself.
//! let world_dp = phalanx_comm::threads::run(2, |pg| {
//!     let mesh = DeviceMesh::new(&pg, 2, 1, 1).unwrap();
//!     mesh.is_world(Axis::Dp)
//! });
//! assert_eq!(world_dp, vec![true, true]);
//! ```

use crate::error::{Error, Result};
use phalanx_comm::ProcessGroup;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A rank's position on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// The sizes of the mesh's axes (torchtitan's `ParallelDims`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub pp: usize,
    pub tp: usize,
}

impl ParallelDims {
    /// The data-parallel degree: `dp_replicate * dp_shard`.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
    pub fn world_size(&self) -> usize {
        self.dp() * self.pp * self.tp
    }
}

/// A named axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Axis {
    /// Data parallel: `dp_replicate x dp_shard`.
    Dp,
    DpShard,
    DpReplicate,
    Pp,
    Tp,
}

/// Sizes of the axes and this rank's group along each.
#[derive(Clone)]
pub struct DeviceMesh {
    pub dp_size: usize,
    pub pp_size: usize,
    pub tp_size: usize,
    dims: ParallelDims,
    coords: Coords,
    world: ProcessGroup,
    dp: ProcessGroup,
    dp_shard: ProcessGroup,
    dp_replicate: ProcessGroup,
    pp: ProcessGroup,
    tp: ProcessGroup,
    /// Groups made inside an axis ([`DeviceMesh::split`],
    /// [`DeviceMesh::subgroup`]), kept by what they were made for.
    made: Arc<Mutex<BTreeMap<Made, Vec<Option<ProcessGroup>>>>>,
}

impl DeviceMesh {
    /// A mesh of `dp x pp x tp` over `world` without HSDP (`dp_shard = dp`).
    /// Collective: every rank calls it with the same sizes.
    pub fn new(world: &ProcessGroup, dp: usize, pp: usize, tp: usize) -> Result<DeviceMesh> {
        let dims = ParallelDims {
            dp_replicate: 1,
            dp_shard: dp,
            pp,
            tp,
        };
        DeviceMesh::build(world, dims)
    }

    /// A mesh of the given axes over `world` (collective).
    pub fn build(world: &ProcessGroup, dims: ParallelDims) -> Result<DeviceMesh> {
        let n = world.size();
        let ParallelDims {
            dp_replicate,
            dp_shard,
            pp,
            tp,
        } = dims;
        let dp = dims.dp();
        if dims.world_size() != n || [dp_replicate, dp_shard, pp, tp].contains(&0) {
            return Err(Error::Check(format!(
                "mesh dp {dp} (replicate {dp_replicate} x shard {dp_shard}) x pp {pp} x tp {tp} \
                 does not cover the world of {n} ranks"
            )));
        }
        // rank = (pp * dp_size + dp) * tp_size + tp
        let coords_of = |r: usize| Coords {
            tp: r % tp,
            dp: (r / tp) % dp,
            pp: r / (tp * dp),
        };
        let coords = coords_of(world.rank());
        // The groups along one axis: ranks that agree on the coordinates
        // `key` keeps, in rank order (so in order along the axis).
        let along = |key: &dyn Fn(Coords) -> (usize, usize, usize)| -> Vec<Vec<usize>> {
            let mut groups: BTreeMap<(usize, usize, usize), Vec<usize>> = BTreeMap::new();
            for r in 0..n {
                groups.entry(key(coords_of(r))).or_default().push(r);
            }
            groups.into_values().collect()
        };
        let tp_pg = mine(world, along(&|c| (c.pp, c.dp, 0)))?;
        let dp_pg = mine(world, along(&|c| (c.pp, 0, c.tp)))?;
        let pp_pg = mine(world, along(&|c| (0, c.dp, c.tp)))?;
        // Inside dp: shard groups are consecutive dp ranks, replica groups
        // the same position in every shard group.
        let shard_pg = mine(&dp_pg, consecutive(dp, dp_shard))?;
        let replica_pg = mine(&dp_pg, strided(dp, dp_shard))?;
        Ok(DeviceMesh {
            dp_size: dp,
            pp_size: pp,
            tp_size: tp,
            dims,
            coords,
            world: world.clone(),
            dp: dp_pg,
            dp_shard: shard_pg,
            dp_replicate: replica_pg,
            pp: pp_pg,
            tp: tp_pg,
            made: Default::default(),
        })
    }

    pub fn dims(&self) -> ParallelDims {
        self.dims
    }
    pub fn coords(&self) -> Coords {
        self.coords
    }
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's group along `axis`.
    pub fn group(&self, axis: Axis) -> &ProcessGroup {
        match axis {
            Axis::Dp => &self.dp,
            Axis::DpShard => &self.dp_shard,
            Axis::DpReplicate => &self.dp_replicate,
            Axis::Pp => &self.pp,
            Axis::Tp => &self.tp,
        }
    }

    /// Whether `axis` spans the world (and so is the world group).
    pub fn is_world(&self, axis: Axis) -> bool {
        self.group(axis).size() == self.world.size()
    }

    /// The ranks holding the same model shard (gradients are averaged here).
    pub fn dp(&self) -> &ProcessGroup {
        &self.dp
    }
    /// The stages of one pipeline (point-to-point activations and gradients).
    pub fn pp(&self) -> &ProcessGroup {
        &self.pp
    }
    /// The ranks splitting each layer's matrices.
    pub fn tp(&self) -> &ProcessGroup {
        &self.tp
    }

    /// `axis` cut into groups of `inner` consecutive ranks: this rank's
    /// group of them and, across them, its group of ranks at the same
    /// position (HSDP's shard and replica groups inside dp; ZeRO++'s hpZ
    /// groups inside a shard group). Made once per (axis, inner); every
    /// rank of the axis calls it in the same order.
    pub fn split(&self, axis: Axis, inner: usize) -> Result<(ProcessGroup, ProcessGroup)> {
        let parent = self.group(axis);
        let n = parent.size();
        if inner == 0 || !n.is_multiple_of(inner) {
            return Err(Error::Check(format!(
                "the {axis:?} axis of {n} ranks does not split into groups of {inner}"
            )));
        }
        if axis == Axis::Dp && inner == self.dims.dp_shard {
            return Ok((self.dp_shard.clone(), self.dp_replicate.clone()));
        }
        let made = self.made(Made::Split(axis, inner), || {
            Ok(vec![
                Some(mine(parent, consecutive(n, inner))?),
                Some(mine(parent, strided(n, inner))?),
            ])
        })?;
        let mut both = made.into_iter().flatten();
        let inner_pg = both.next().expect("a split keeps its inner group");
        Ok((
            inner_pg,
            both.next().expect("a split keeps its outer group"),
        ))
    }

    /// The group of `ranks` (ranks along `axis`) if this rank is one of
    /// them (the pipeline's tie groups: the stages reading one tied weight).
    /// Made once per member list; every rank of the axis calls it for every
    /// list, in the same order.
    pub fn subgroup(&self, axis: Axis, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let parent = self.group(axis);
        let mut rs = ranks.to_vec();
        rs.sort_unstable();
        let whole = rs.len() == parent.size() && rs.iter().enumerate().all(|(i, &r)| i == r);
        let made = self.made(Made::Sub(axis, rs.clone()), || {
            Ok(vec![if whole {
                Some(parent.clone())
            } else {
                parent.new_group(&rs)?
            }])
        })?;
        Ok(made.into_iter().next().flatten())
    }

    /// The groups made for `key`, made by `make` the first time.
    fn made(
        &self,
        key: Made,
        make: impl FnOnce() -> Result<Vec<Option<ProcessGroup>>>,
    ) -> Result<Vec<Option<ProcessGroup>>> {
        // Held across `make`: two threads sharing this mesh must not both
        // miss and both make the groups (their ranks would fall out of step).
        let mut made = self.made.lock().unwrap();
        if let Some(g) = made.get(&key) {
            return Ok(g.clone());
        }
        let g = make()?;
        made.insert(key, g.clone());
        Ok(g)
    }
}

/// What a group inside an axis was made for (the key it is kept under).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Made {
    /// [`DeviceMesh::split`] of an axis into groups of this many ranks.
    Split(Axis, usize),
    /// [`DeviceMesh::subgroup`] of these ranks of an axis.
    Sub(Axis, Vec<usize>),
}

/// This rank's group of a partition of `parent` into `groups`. Every rank
/// creates every group in the same order (`new_group` is collective in
/// that sense) and keeps its own; a group of all of `parent` is `parent`.
fn mine(parent: &ProcessGroup, groups: Vec<Vec<usize>>) -> Result<ProcessGroup> {
    if groups.len() == 1 {
        return Ok(parent.clone());
    }
    let mut own = None;
    for g in groups {
        if let Some(pg) = parent.new_group(&g)? {
            own = Some(pg);
        }
    }
    Ok(own.expect("every rank is on every axis"))
}

/// `0..n` cut into blocks of `inner` consecutive ranks.
fn consecutive(n: usize, inner: usize) -> Vec<Vec<usize>> {
    (0..n / inner)
        .map(|k| (k * inner..(k + 1) * inner).collect())
        .collect()
}

/// `0..n` in groups of the ranks at the same position of each block of
/// `inner` (the complement of [`consecutive`]).
fn strided(n: usize, inner: usize) -> Vec<Vec<usize>> {
    (0..inner)
        .map(|j| (0..n / inner).map(|k| k * inner + j).collect())
        .collect()
}
