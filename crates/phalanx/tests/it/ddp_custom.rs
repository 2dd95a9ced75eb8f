//! DDP on a user's own candle model (the `ddp_custom_model` example): two
//! ranks reproduce one rank; and the parameter check names a diverged rank.

use crate::example;

/// Losses within 1e-5 relative, parameters within 1e-5 (norm-relative).
fn assert_close(a: &(Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>)) {
    for (k, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        assert!(((x - y) / y).abs() < 1e-5, "step {k}: loss {x} vs {y}");
    }
    let d: f64 =
        a.1.iter()
            .zip(&b.1)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum();
    let n: f64 = b.1.iter().map(|y| (*y as f64).powi(2)).sum();
    assert!((d / n).sqrt() < 1e-5, "params differ: {:e}", (d / n).sqrt());
}

#[test]
fn custom_model_ddp_equals_one_rank_at_the_same_global_batch() {
    // Global batch 16: 1 rank x 16, 2 ranks x 8, 2 ranks x 4 x accum 2.
    let one = phalanx_comm::threads::run(1, |pg| {
        example::train_rank(pg, &example::config(5, 16, 1), true).unwrap()
    });
    let two = phalanx_comm::threads::run(2, |pg| {
        example::train_rank(pg, &example::config(5, 8, 1), true).unwrap()
    });
    let acc = phalanx_comm::threads::run(2, |pg| {
        example::train_rank(pg, &example::config(5, 4, 2), true).unwrap()
    });
    assert!(
        one[0].0[4] < one[0].0[0],
        "the model should learn: {:?}",
        one[0].0
    );
    for r in two.iter().chain(&acc) {
        assert_close(r, &one[0]);
    }
}

#[test]
fn diverged_parameters_are_reported_with_the_rank() {
    let out = phalanx_comm::threads::run(3, |pg| {
        let mut p = vec![1.0f32; 100];
        if pg.rank() == 2 {
            p[17] = 1.0 + f32::EPSILON;
        }
        phalanx::strategy::ddp::check_identical(&pg, &p, 40).map_err(|e| e.to_string())
    });
    for o in out {
        let m = o.unwrap_err();
        assert!(m.contains("step 40") && m.contains("rank(s) [2]"), "{m}");
    }
}

#[test]
fn ddp_over_the_whole_world_reduces_gradients_in_place_in_shared_memory() {
    // dp spans the world, so the mesh's dp group is the world group and the
    // gradient all-reduces take its in-place shared-memory path (no
    // messages). On a sub-group they would not: the count would stay 0.
    let steps = 5;
    let out = phalanx_comm::threads::run(2, move |pg| {
        let mut t = example::trainer(pg, &example::config(steps, 8, 1)).unwrap();
        let dp = t.mesh().dp().clone();
        assert!(t.mesh().is_world(phalanx::mesh::Axis::Dp));
        let before = dp.in_place_all_reduces();
        t.run(&Default::default()).unwrap();
        dp.in_place_all_reduces() - before
    });
    for n in out {
        assert!(
            n >= steps as u64,
            "{n} in-place all-reduces over {steps} steps"
        );
    }
}
