//! The device mesh: named axes `dp`, `pp`, `tp` over the world, and one
//! process group per axis slice, so strategies compose (torchtitan's
//! DeviceMesh).
//!
//! Rank layout, as Megatron-LM places it: `tp` innermost (neighbouring
//! ranks, the fastest links), then `dp`, then `pp` outermost:
//!
//! `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`
//!
//! ```
//! let out = phalanx_comm::threads::run(8, |pg| {
//!     let mesh = phalanx::mesh::DeviceMesh::new(&pg, 2, 2, 2).unwrap(); // dp, pp, tp
//!     (mesh.coords(), mesh.tp().global_ranks().to_vec(), mesh.dp().global_ranks().to_vec(), mesh.pp().global_ranks().to_vec())
//! });
//! // Rank 5 = pp 1, dp 0, tp 1.
//! assert_eq!(out[5].0, phalanx::mesh::Coords { dp: 0, pp: 1, tp: 1 });
//! assert_eq!(out[5].1, vec![4, 5]); // its tensor-parallel group
//! assert_eq!(out[5].2, vec![5, 7]); // its data-parallel group
//! assert_eq!(out[5].3, vec![1, 5]); // its pipeline group
//! ```

use crate::error::{Error, Result};
use phalanx_comm::ProcessGroup;

/// A rank's position on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// Sizes of the axes and this rank's groups along each.
#[derive(Clone)]
pub struct DeviceMesh {
    pub dp_size: usize,
    pub pp_size: usize,
    pub tp_size: usize,
    coords: Coords,
    world: ProcessGroup,
    dp: ProcessGroup,
    pp: ProcessGroup,
    tp: ProcessGroup,
}

impl DeviceMesh {
    /// Build the mesh over `world` (collective: every rank calls it with the
    /// same sizes). `dp * pp * tp` must equal the world size.
    pub fn new(world: &ProcessGroup, dp: usize, pp: usize, tp: usize) -> Result<DeviceMesh> {
        let n = world.size();
        if dp * pp * tp != n || dp == 0 || pp == 0 || tp == 0 {
            return Err(Error::Check(format!(
                "mesh dp {dp} x pp {pp} x tp {tp} does not cover the world of {n} ranks"
            )));
        }
        // rank = (pp * dp_size + dp) * tp_size + tp
        let coords_of = |r: usize| Coords {
            tp: r % tp,
            dp: (r / tp) % dp,
            pp: r / (tp * dp),
        };
        let coords = coords_of(world.rank());
        // Every rank creates every group, in the same order (new_group is
        // collective in that sense), and keeps the ones it belongs to.
        let mine = |groups: Vec<Vec<usize>>| -> Result<ProcessGroup> {
            let mut own = None;
            for g in groups {
                if let Some(pg) = world.new_group(&g)? {
                    own = Some(pg);
                }
            }
            Ok(own.expect("every rank is on every axis"))
        };
        // The groups along one axis: ranks that agree on the other two
        // coordinates, in rank order (so in order along the axis).
        let along = |axis: fn(Coords) -> Coords| -> Vec<Vec<usize>> {
            let mut groups: std::collections::BTreeMap<(usize, usize, usize), Vec<usize>> =
                Default::default();
            for r in 0..n {
                let k = axis(coords_of(r));
                groups.entry((k.pp, k.dp, k.tp)).or_default().push(r);
            }
            groups.into_values().collect()
        };
        let tp_groups = along(|c| Coords { tp: 0, ..c });
        let dp_groups = along(|c| Coords { dp: 0, ..c });
        let pp_groups = along(|c| Coords { pp: 0, ..c });
        let tp_pg = mine(tp_groups)?;
        let dp_pg = mine(dp_groups)?;
        let pp_pg = mine(pp_groups)?;
        Ok(DeviceMesh {
            dp_size: dp,
            pp_size: pp,
            tp_size: tp,
            coords,
            world: world.clone(),
            dp: dp_pg,
            pp: pp_pg,
            tp: tp_pg,
        })
    }

    pub fn coords(&self) -> Coords {
        self.coords
    }
    pub fn world(&self) -> &ProcessGroup {
        &self.world
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
}
