//! The compressing hooks on their own, on 2 ranks (threads): with error
//! feedback, what a hook delivers over many steps adds up to the true
//! average gradient (what was left out is sent later); without it, the
//! same part is left out every step and the sum drifts away linearly. A
//! hook rebuilt from its saved state continues bitwise; top-k's DGC
//! warm-up sends a falling fraction, then its promised bytes.

use phalanx::strategy::hooks::{Int8, TopK};
use phalanx::strategy::powersgd::PowerSgd;
use phalanx::strategy::reduce::{BucketParam, Collective, CommHook, GradBucket};

/// Each rank's fixed gradient: a 12 x 10 matrix of rank 3 and a vector.
fn grad(rank: usize) -> Vec<f32> {
    let (n, m) = (12, 10);
    let mut g = vec![0f32; n * m + 6];
    for k in 0..3 {
        for a in 0..n {
            for b in 0..m {
                let u = ((a * (k + 2) + rank) as f32 * 0.7).sin();
                let v = ((b * (k + 3)) as f32 * 0.3 + k as f32).cos();
                g[a * m + b] += u * v / (k + 1) as f32;
            }
        }
    }
    for (i, x) in g[n * m..].iter_mut().enumerate() {
        *x = i as f32 - rank as f32;
    }
    g
}

/// Run `steps` reductions of the fixed gradients through the hook `make`
/// builds; (relative error of the mean delivered gradient, whether both
/// ranks got identical results every step).
fn mean_error(make: fn() -> Box<dyn CommHook>, steps: usize) -> (f64, bool) {
    let out = phalanx_comm::threads::run(2, move |pg| {
        let bucket = GradBucket {
            id: 0,
            params: vec![
                BucketParam {
                    offset: 0,
                    shape: vec![12, 10],
                },
                BucketParam {
                    offset: 120,
                    shape: vec![6],
                },
            ],
        };
        let mut hook = make();
        let g = grad(pg.rank());
        let mut sum = vec![0f64; g.len()];
        let mut each = Vec::new();
        for _ in 0..steps {
            let got = hook
                .reduce(&bucket, g.clone(), &Collective::AllReduce, &pg)
                .wait()
                .unwrap();
            for (s, x) in sum.iter_mut().zip(&got) {
                *s += *x as f64;
            }
            each.push(got);
        }
        (sum, each)
    });
    let truth: Vec<f64> = grad(0)
        .iter()
        .zip(grad(1))
        .map(|(a, b)| (*a as f64 + b as f64) / 2.0)
        .collect();
    let mean: Vec<f64> = out[0].0.iter().map(|s| s / steps as f64).collect();
    let d: f64 = mean.iter().zip(&truth).map(|(a, b)| (a - b).powi(2)).sum();
    let n: f64 = truth.iter().map(|b| b.powi(2)).sum();
    ((d / n).sqrt(), out[0].1 == out[1].1)
}

#[test]
fn powersgd_error_feedback_delivers_the_whole_gradient_over_time() {
    let (ef, same_ef) = mean_error(|| Box::new(PowerSgd::new(1, 0, true)), 40);
    let (no_ef, same) = mean_error(|| Box::new(PowerSgd::new(1, 0, false)), 40);
    eprintln!("PowerSGD rank 1, mean of 40 steps vs the true gradient: {ef:.4} with error feedback, {no_ef:.4} without");
    assert!(same_ef && same, "ranks must get identical gradients");
    assert!(ef < 0.1, "with error feedback the mean converges: {ef}");
    assert!(
        no_ef > 3.0 * ef,
        "without it a part is lost for good: {no_ef} vs {ef}"
    );
}

#[test]
fn top_k_error_feedback_delivers_the_whole_gradient_over_time() {
    let (ef, same_ef) = mean_error(|| Box::new(TopK::new(0.1, true)), 40);
    let (no_ef, same) = mean_error(|| Box::new(TopK::new(0.1, false)), 40);
    eprintln!("top-10%, mean of 40 steps vs the true gradient: {ef:.4} with error feedback, {no_ef:.4} without");
    assert!(same_ef && same, "ranks must get identical gradients");
    assert!(ef < 0.1, "with error feedback the mean converges: {ef}");
    assert!(
        no_ef > 3.0 * ef,
        "without it a part is lost for good: {no_ef} vs {ef}"
    );
}

#[test]
fn powersgd_starts_with_plain_all_reduces() {
    // start_iter = 3: the first three reductions are exact averages.
    let (err, same) = mean_error(|| Box::new(PowerSgd::new(1, 3, true)), 3);
    assert!(same);
    assert!(err < 1e-6, "plain all-reduce: {err}");
}

/// The bucket of [`grad`]: a 12 x 10 matrix and a vector of 6.
fn bucket() -> GradBucket {
    GradBucket {
        id: 3,
        params: vec![
            BucketParam {
                offset: 0,
                shape: vec![12, 10],
            },
            BucketParam {
                offset: 120,
                shape: vec![6],
            },
        ],
    }
}

/// A gradient that changes from step to step.
fn grad_at(rank: usize, step: usize) -> Vec<f32> {
    grad(rank)
        .iter()
        .enumerate()
        .map(|(i, x)| x * (1.0 + 0.3 * ((i + 7 * step) as f32).sin()))
        .collect()
}

/// Builds a fresh hook.
type MakeHook = fn() -> Box<dyn CommHook>;

/// `steps` reductions through one hook, or through a first hook for
/// `split` steps and a fresh one that loads its state for the rest: every
/// rank's results.
fn continued(make: MakeHook, steps: usize, split: Option<usize>) -> Vec<Vec<Vec<f32>>> {
    phalanx_comm::threads::run(2, move |pg| {
        let mut hook = make();
        let mut out = Vec::new();
        for t in 0..steps {
            if Some(t) == split {
                let state = hook.state();
                hook = make();
                hook.load_state(&state).unwrap();
            }
            let g = grad_at(pg.rank(), t);
            out.push(
                hook.reduce(&bucket(), g, &Collective::AllReduce, &pg)
                    .wait()
                    .unwrap(),
            );
        }
        out
    })
}

#[test]
fn a_hook_reloaded_from_its_state_continues_bitwise() {
    let hooks: [(&str, MakeHook); 5] = [
        ("int8", || Box::new(Int8::new(true))),
        ("top-k with DGC", || Box::new(TopK::dgc(0.05, true, 4, 0.9))),
        ("top-k for Adam", || {
            Box::new(TopK::adam(0.05, true, 2, 0.9))
        }),
        ("PowerSGD", || Box::new(PowerSgd::new(2, 2, true))),
        ("PowerSGD before its start", || {
            Box::new(PowerSgd::new(1, 5, true))
        }),
    ];
    for (what, make) in hooks {
        let whole = continued(make, 8, None);
        let split = continued(make, 8, Some(3));
        assert!(whole == split, "{what}: the reloaded hook differs");
        // A fresh hook without the state is another run.
        let fresh = phalanx_comm::threads::run(2, move |pg| {
            let mut hook = make();
            (3..8)
                .map(|t| {
                    hook.reduce(
                        &bucket(),
                        grad_at(pg.rank(), t),
                        &Collective::AllReduce,
                        &pg,
                    )
                    .wait()
                    .unwrap()
                })
                .collect::<Vec<_>>()
        });
        assert!(
            whole[0][3..] != fresh[0][..],
            "{what}: the state should matter"
        );
    }
}

#[test]
fn top_k_warm_up_sends_a_falling_fraction_then_its_promised_bytes() {
    // 126 values at 5% after the warm-up: k = 7, 2 x 7 x 4 = 56 bytes per
    // rank (each rank sends its own pairs to the other). The warm-up of 4
    // reductions sends 25% twice (k = 32), then 6.25% twice (k = 8).
    let sent = phalanx_comm::threads::run(2, move |pg| {
        let mut hook = TopK::dgc(0.05, true, 4, 0.0);
        (0..7)
            .map(|t| {
                let b0 = pg.bytes_sent();
                hook.reduce(
                    &bucket(),
                    grad_at(pg.rank(), t),
                    &Collective::AllReduce,
                    &pg,
                )
                .wait()
                .unwrap();
                pg.bytes_sent() - b0
            })
            .collect::<Vec<u64>>()
    });
    let want: Vec<u64> = [32u64, 32, 8, 8, 7, 7, 7].iter().map(|k| 8 * k).collect();
    for (r, s) in sent.iter().enumerate() {
        assert_eq!(*s, want, "rank {r}");
    }
}

/// Top-k for Adam (1-bit Adam's scheme): the warm-up reductions are exact
/// averages (dense all-reduces); after it, the promised 2 x k x 4 bytes,
/// delivering what a reference in f64 computes: per rank, the velocity
/// u = b1 u + g from the end of the warm-up, accumulated with error
/// feedback, its top-k sent and cleared with its velocity (DGC's masking),
/// the ranks' pairs averaged.
#[test]
fn top_k_for_adam_warms_up_dense_then_carries_the_momentum() {
    let (steps, warm, k, n) = (40, 3, 7, 126);
    let out = phalanx_comm::threads::run(2, move |pg| {
        let mut hook = TopK::adam(0.05, true, warm, 0.9);
        (0..steps)
            .map(|t| {
                let b0 = pg.bytes_sent();
                let got = hook
                    .reduce(
                        &bucket(),
                        grad_at(pg.rank(), t),
                        &Collective::AllReduce,
                        &pg,
                    )
                    .wait()
                    .unwrap();
                (got, pg.bytes_sent() - b0)
            })
            .collect::<Vec<_>>()
    });
    // The reference.
    let mut u = vec![vec![0f64; n]; 2];
    let mut v = vec![vec![0f64; n]; 2];
    for t in 0..steps {
        let mut want = vec![0f64; n];
        for r in 0..2 {
            let g = grad_at(r, t);
            if t < warm {
                g.iter()
                    .zip(want.iter_mut())
                    .for_each(|(x, w)| *w += *x as f64 / 2.0);
                continue;
            }
            for i in 0..n {
                u[r][i] = 0.9 * u[r][i] + g[i] as f64;
                v[r][i] += u[r][i];
            }
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| v[r][b].abs().total_cmp(&v[r][a].abs()).then(a.cmp(&b)));
            for &i in &order[..k] {
                want[i] += v[r][i] / 2.0;
                (u[r][i], v[r][i]) = (0.0, 0.0);
            }
        }
        for (rank, o) in out.iter().enumerate() {
            let (got, bytes) = &o[t];
            if t >= warm {
                assert_eq!(*bytes, 8 * k as u64, "step {t}: the promised bytes");
            }
            for (i, (x, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*x as f64 - w).abs() < 1e-4 * (1.0 + w.abs()),
                    "rank {rank}, step {t}, entry {i}: {x} vs {w}"
                );
            }
        }
    }
}

/// The int8 hook's reduction of a bucket that holds a NaN on rank 0 (the
/// rest finite), then the step's finiteness verdict under `scaler`: the
/// reduced gradients are not finite on either rank, so fp16 skips the step
/// and fp32 (`train.on_nonfinite = "stop"`) fails it.
fn int8_with_a_nan(
    coll: Collective,
    scaler: phalanx::precision::LossScaler,
) -> Vec<(bool, phalanx::Result<bool>)> {
    phalanx_comm::threads::run(2, move |pg| {
        let mut g: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin()).collect();
        if pg.rank() == 0 {
            g[1] = f32::NAN;
        }
        let mut hook = Int8::new(true);
        let bucket = GradBucket {
            id: 0,
            params: Vec::new(),
        };
        let got = hook.reduce(&bucket, g, &coll, &pg).wait().unwrap();
        let finite = got.iter().all(|x| x.is_finite());
        let ss = phalanx::optim::clip::sum_squares(&got);
        let mut scaler = scaler;
        let verdict = phalanx::optim::step::agree_and_clip(&pg, ss, &mut scaler, 0.0, 5)
            .map(|(out, _)| out.skipped);
        (finite, verdict)
    })
}

#[test]
fn int8_carries_a_nan_to_the_non_finite_check() {
    use phalanx::precision::{LossScaler, ScalerConfig};
    let colls = [
        Collective::AllReduce,
        // ZeRO++ qgZ: rank 0 holds the NaN in rank 0's piece.
        Collective::ReduceScatter {
            counts: vec![150, 150],
        },
    ];
    for coll in colls {
        let fp16 = LossScaler::dynamic(ScalerConfig::default());
        for (r, (finite, verdict)) in int8_with_a_nan(coll.clone(), fp16).into_iter().enumerate() {
            assert!(
                !finite || matches!(coll, Collective::ReduceScatter { .. }) && r == 1,
                "{coll:?}: rank {r}'s reduced gradients hide the NaN"
            );
            assert!(verdict.unwrap(), "{coll:?}: fp16 skips the step (rank {r})");
        }
        for (r, (_, verdict)) in int8_with_a_nan(coll.clone(), LossScaler::none())
            .into_iter()
            .enumerate()
        {
            let e = verdict.expect_err("fp32 stops on the NaN").to_string();
            assert!(e.contains("inf or NaN"), "{coll:?} rank {r}: {e}");
        }
    }
}

#[test]
fn int8_without_error_feedback_drops_a_checkpoint_s_residuals() {
    let out = phalanx_comm::threads::run(2, |pg| {
        let bucket = bucket();
        // A run with error feedback leaves residuals...
        let mut with = Int8::new(true);
        with.reduce(&bucket, grad_at(pg.rank(), 0), &Collective::AllReduce, &pg)
            .wait()
            .unwrap();
        let state = with.state();
        assert!(
            state.iter().any(|(_, v)| v.iter().any(|&x| x != 0.0)),
            "the saved residuals are not all zero"
        );
        // ... resumed with parallel.error_feedback = false: zero gradients
        // reduce to zeros, every step.
        let mut without = Int8::new(false);
        without.load_state(&state).unwrap();
        let n = grad_at(0, 0).len();
        let mut got = Vec::new();
        for _ in 0..2 {
            got.push(
                without
                    .reduce(&bucket, vec![0.0; n], &Collective::AllReduce, &pg)
                    .wait()
                    .unwrap(),
            );
        }
        (got, without.state())
    });
    for (r, (got, state)) in out.into_iter().enumerate() {
        for (k, g) in got.iter().enumerate() {
            assert!(
                g.iter().all(|&x| x == 0.0),
                "rank {r}, reduction {k}: {g:?}"
            );
        }
        assert!(state.is_empty(), "rank {r} keeps no residual: {state:?}");
    }
}

/// Every value of a hook's state, by name.
type HookState = Vec<(String, Vec<f32>)>;

/// Reductions of steps `steps` through a [`Reducer`] holding the hook
/// `make` builds; at `bad` rank 1's gradient holds an inf and the step is
/// skipped ([`Reducer::settle`] told so). Each rank's results of the
/// applied steps and its hook state at the end.
fn with_a_skipped_step(
    make: MakeHook,
    steps: Vec<usize>,
    bad: Option<usize>,
) -> Vec<(Vec<Vec<f32>>, HookState)> {
    use phalanx::strategy::reduce::Reducer;
    phalanx_comm::threads::run(2, move |pg| {
        let mut red = Reducer::new(pg.clone(), make());
        red.describe(vec![bucket()]);
        let mut out = Vec::new();
        for &t in &steps {
            let mut g = grad_at(pg.rank(), t);
            let skip = Some(t) == bad;
            if skip && pg.rank() == 1 {
                g[5] = f32::INFINITY;
            }
            red.launch(3, g, &Collective::AllReduce);
            let (_, got) = red.wait_all().unwrap().remove(0);
            red.settle(!skip).unwrap();
            if !skip {
                out.push(got);
            }
        }
        (out, red.hook_state())
    })
}

#[test]
fn a_skipped_step_leaves_the_hook_state_as_it_was() {
    let hooks: [(&str, MakeHook); 5] = [
        ("int8", || Box::new(Int8::new(true))),
        ("top-k", || Box::new(TopK::new(0.05, true))),
        ("top-k with DGC", || Box::new(TopK::dgc(0.05, true, 4, 0.9))),
        ("top-k for Adam", || {
            Box::new(TopK::adam(0.05, true, 2, 0.9))
        }),
        ("PowerSGD", || Box::new(PowerSgd::new(2, 1, true))),
    ];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, make) in hooks {
        let hit = with_a_skipped_step(make, (0..8).collect(), Some(3));
        let reference = with_a_skipped_step(make, (0..8).filter(|&t| t != 3).collect(), None);
        for (r, ((out, state), (ref_out, ref_state))) in hit.iter().zip(&reference).enumerate() {
            assert_eq!(out.len(), 7);
            for (k, (a, b)) in out.iter().zip(ref_out).enumerate() {
                assert!(
                    a.iter().all(|x| x.is_finite()),
                    "{name}: rank {r}'s reduction {k} after the skipped step is not finite"
                );
                assert_eq!(bits(a), bits(b), "{name}: rank {r}, reduction {k}");
            }
            assert_eq!(state.len(), ref_state.len(), "{name}: rank {r}'s state");
            for ((n, v), (rn, rv)) in state.iter().zip(ref_state) {
                assert_eq!(n, rn);
                assert!(v.iter().all(|x| x.is_finite()), "{name}: {n} is not finite");
                assert_eq!(bits(v), bits(rv), "{name}: rank {r}'s {n}");
            }
        }
    }
}

#[test]
fn powersgd_starts_q_over_after_an_inf() {
    let out = phalanx_comm::threads::run(2, |pg| {
        let mut h = PowerSgd::new(2, 0, true);
        let mut g = grad_at(pg.rank(), 0);
        if pg.rank() == 1 {
            g[5] = f32::INFINITY;
        }
        let got = h
            .reduce(&bucket(), g, &Collective::AllReduce, &pg)
            .wait()
            .unwrap();
        let qs: HookState = h
            .state()
            .into_iter()
            .filter(|(n, _)| n.contains("/q"))
            .collect();
        (got.iter().any(|x| !x.is_finite()), qs)
    });
    for (r, (non_finite, qs)) in out.into_iter().enumerate() {
        assert!(non_finite, "rank {r}: the inf reaches the reduced gradient");
        assert!(!qs.is_empty());
        for (n, q) in qs {
            assert!(q.iter().all(|x| x.is_finite()), "rank {r}: {n} = {q:?}");
        }
    }
}
