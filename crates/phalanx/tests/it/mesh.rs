//! The device mesh's named axes (`dp_replicate`, `dp_shard`, `pp`, `tp`):
//! each rank's group along each axis, an axis spanning the world being the
//! world group, and the groups made inside an axis (HSDP's split, the
//! pipeline's tie groups) being the right ranks and made once.

use phalanx::mesh::{Axis, DeviceMesh, ParallelDims};

#[test]
fn named_axes_give_each_rank_its_groups() {
    // 8 ranks: dp_replicate 2 x dp_shard 2 x pp 1 x tp 2.
    let dims = ParallelDims {
        dp_replicate: 2,
        dp_shard: 2,
        pp: 1,
        tp: 2,
    };
    let out = phalanx_comm::threads::run(8, move |pg| {
        let mesh = DeviceMesh::build(&pg, dims).unwrap();
        let g = |a| mesh.group(a).global_ranks().to_vec();
        let all = [
            Axis::Tp,
            Axis::Dp,
            Axis::DpShard,
            Axis::DpReplicate,
            Axis::Pp,
        ];
        let groups: Vec<Vec<usize>> = all.iter().map(|&a| g(a)).collect();
        // The split the config asks for is the mesh's own axes.
        let (s, r) = mesh.split(Axis::Dp, 2).unwrap();
        assert_eq!(s.global_ranks(), g(Axis::DpShard).as_slice());
        assert_eq!(r.global_ranks(), g(Axis::DpReplicate).as_slice());
        // Collectives run on each axis group.
        let mut x = [1i32];
        mesh.group(Axis::DpShard)
            .all_reduce(&mut x, phalanx_comm::ReduceOp::Sum)
            .unwrap();
        assert_eq!(x, [2]);
        groups
    });
    // Rank 5: tp 1, dp 2 (replicate 1, shard 0).
    assert_eq!(out[5][0], vec![4, 5]);
    assert_eq!(out[5][1], vec![1, 3, 5, 7]);
    assert_eq!(out[5][2], vec![5, 7]);
    assert_eq!(out[5][3], vec![1, 5]);
    assert_eq!(out[5][4], vec![5]);
}

#[test]
fn an_axis_over_the_world_is_the_world_group_and_subgroups_are_made_once() {
    let out = phalanx_comm::threads::run(4, |pg| {
        let mesh = DeviceMesh::new(&pg, 1, 4, 1).unwrap();
        assert!(mesh.is_world(Axis::Pp) && !mesh.is_world(Axis::Tp));
        // Tie groups: stages {0, 3} and {1, 2}, asked for twice.
        let ties = |m: &DeviceMesh| {
            [vec![0, 3], vec![1, 2]]
                .iter()
                .map(|s| m.subgroup(Axis::Pp, s).unwrap())
                .collect::<Vec<_>>()
        };
        let first = ties(&mesh);
        let again = ties(&mesh);
        let mine: Vec<Vec<usize>> = first
            .iter()
            .flatten()
            .map(|g| g.global_ranks().to_vec())
            .collect();
        // The kept group still works (a remade one would have another
        // channel and its peers would not answer in time).
        for g in again.iter().flatten() {
            let mut x = [pg.rank() as i64];
            g.all_reduce(&mut x, phalanx_comm::ReduceOp::Sum).unwrap();
            assert_eq!(x[0], g.global_ranks().iter().sum::<usize>() as i64);
        }
        // The whole axis is the axis group itself.
        let whole = mesh.subgroup(Axis::Pp, &[0, 1, 2, 3]).unwrap().unwrap();
        assert_eq!(whole.size(), 4);
        // A split that does not divide the axis is refused.
        let e = mesh.split(Axis::Pp, 3).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("groups of 3"), "{e}");
        mine
    });
    assert_eq!(out[0], vec![vec![0, 3]]);
    assert_eq!(out[1], vec![vec![1, 2]]);
    assert_eq!(out[2], vec![vec![1, 2]]);
    assert_eq!(out[3], vec![vec![0, 3]]);
}
