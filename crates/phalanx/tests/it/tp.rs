//! The overlapped column-parallel linear (`tp::column_parallel_linear`)
//! against the unfused path (`ops::linear(copy_to_tp(x))`, or
//! `gather_seq(x)` under sequence parallelism): forward and every gradient,
//! on odd shapes (in 7, out 10 over 2 ranks, 5 rows), ranks as threads.
//!
//! Why exact: both paths make the same gemm calls on the same f32 data, and
//! the same collective on the same dx buffer (in x's dtype), so f32 must
//! agree bit for bit; bf16 is held to bf16 tolerance (it agrees bit for bit
//! as well in practice).

use candle_core::{DType, Result, Tensor, Var};
use phalanx::ops;
use phalanx::tp::{column_parallel_linear, copy_to_tp, gather_seq, ColumnParallelLinear, Tp};

use crate::common;
use common::{flat, randn};

const IN: usize = 7;
const OUT: usize = 10;

/// What one rank sees of a run: y, and the gradients of x, w, b (f32).
#[derive(Debug, PartialEq)]
struct Run {
    y: Vec<f32>,
    dx: Option<Vec<f32>>,
    dw: Option<Vec<f32>>,
    db: Option<Vec<f32>>,
}

/// One rank's column-parallel linear on its shard of a (10, 7) weight:
/// fused or unfused, with or without bias, and with x and/or w tracked.
fn one(
    tp: &Tp,
    fused: bool,
    dtype: DType,
    x_shape: &[usize],
    bias: bool,
    (track_x, track_w): (bool, bool),
) -> Result<Run> {
    let r = tp.rank();
    let o = OUT / tp.size();
    // x is the same on every rank (replicated), or this rank's sequence shard.
    let x_seed = if tp.sequence_parallel {
        100 + r as u64
    } else {
        1
    };
    let x = randn(x_shape, x_seed).to_dtype(dtype)?;
    let w = randn(&[OUT, IN], 2).narrow(0, r * o, o)?.to_dtype(dtype)?;
    let b = randn(&[OUT], 3).narrow(0, r * o, o)?.to_dtype(dtype)?;
    let (xv, wv, bv) = (
        Var::from_tensor(&x)?,
        Var::from_tensor(&w)?,
        Var::from_tensor(&b)?,
    );
    let x = if track_x { xv.as_tensor().clone() } else { x };
    let w = if track_w { wv.as_tensor().clone() } else { w };
    let b = bias.then(|| bv.as_tensor().clone());
    let y = if fused {
        column_parallel_linear(tp, &x, &w, b.as_ref())?
    } else {
        let h = match tp.sequence_parallel {
            true => gather_seq(&x, &tp.pg)?,
            false => copy_to_tp(&x, &tp.pg)?,
        };
        ops::linear(&h, &w, b.as_ref())?
    };
    // A loss with a different upstream gradient on each rank and element.
    let dy = randn(y.dims(), 7 + r as u64);
    let g = y.to_dtype(DType::F32)?.mul(&dy)?.sum_all()?.backward()?;
    let get = |v: &Var| g.get(v.as_tensor()).map(flat);
    Ok(Run {
        y: flat(&y),
        dx: get(&xv),
        dw: get(&wv),
        db: bias.then(|| get(&bv)).flatten(),
    })
}

/// Both paths on 2 ranks; returns (fused, unfused) per rank.
fn both(
    sp: bool,
    dtype: DType,
    x_shape: &'static [usize],
    bias: bool,
    track: (bool, bool),
) -> Vec<(Run, Run)> {
    phalanx_comm::threads::run(2, move |pg| {
        let tp = Tp::new(pg, sp);
        let f = one(&tp, true, dtype, x_shape, bias, track).unwrap();
        let u = one(&tp, false, dtype, x_shape, bias, track).unwrap();
        (f, u)
    })
}

fn close(what: &str, a: &[f32], b: &[f32], rel: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = rel * x.abs().max(y.abs()).max(1.0);
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

fn check_close(runs: &[(Run, Run)], rel: f32) {
    for (r, (f, u)) in runs.iter().enumerate() {
        close(&format!("rank {r} y"), &f.y, &u.y, rel);
        for (name, a, b) in [
            ("dx", &f.dx, &u.dx),
            ("dw", &f.dw, &u.dw),
            ("db", &f.db, &u.db),
        ] {
            assert_eq!(a.is_some(), b.is_some(), "rank {r} {name}: present");
            if let (Some(a), Some(b)) = (a, b) {
                close(&format!("rank {r} {name}"), a, b, rel);
            }
        }
    }
}

#[test]
fn overlap_equals_unfused_f32() {
    for x_shape in [&[5, IN][..], &[1, 5, IN]] {
        for bias in [true, false] {
            let runs = both(false, DType::F32, x_shape, bias, (true, true));
            for (r, (f, u)) in runs.iter().enumerate() {
                assert_eq!(f, u, "rank {r}, x {x_shape:?}, bias {bias}");
                assert!(f.dx.is_some() && f.dw.is_some() && f.db.is_some() == bias);
            }
        }
    }
}

#[test]
fn overlap_equals_unfused_bf16() {
    let runs = both(false, DType::BF16, &[1, 5, IN], true, (true, true));
    check_close(&runs, 1e-2);
}

#[test]
fn overlap_equals_unfused_sequence_parallel() {
    // x (B 5, T/tp 2, in 7) per rank: rows 5 * 4 after the gather.
    let runs = both(true, DType::F32, &[5, 2, IN], true, (true, true));
    for (r, (f, u)) in runs.iter().enumerate() {
        assert_eq!(f, u, "rank {r}");
        assert_eq!(f.y.len(), 5 * 4 * OUT / 2);
        assert_eq!(f.dx.as_ref().unwrap().len(), 5 * 2 * IN);
    }
    check_close(
        &both(true, DType::BF16, &[5, 2, IN], false, (true, true)),
        1e-2,
    );
}

#[test]
fn only_tracked_gradients_are_computed() {
    // Weights held constant (the zero-bubble input pass): dx only, still
    // reduced; input held constant (the weight pass): dw and db, no collective.
    for sp in [false, true] {
        let shape: &'static [usize] = if sp { &[5, 2, IN] } else { &[1, 5, IN] };
        for track in [(true, false), (false, true)] {
            let runs = both(sp, DType::F32, shape, true, track);
            for (f, u) in &runs {
                assert_eq!(f, u, "sp {sp}, track {track:?}");
                assert_eq!(f.dx.is_some(), track.0);
                assert_eq!(f.dw.is_some(), track.1);
            }
        }
    }
}

#[test]
fn overlap_reduces_the_input_gradient_like_one_rank() {
    // dx summed over the two shards = the gradient of the unsharded linear.
    let runs = both(false, DType::F32, &[5, IN], true, (true, true));
    let x = Var::from_tensor(&randn(&[5, IN], 1)).unwrap();
    let y = ops::linear(
        x.as_tensor(),
        &randn(&[OUT, IN], 2),
        Some(&randn(&[OUT], 3)),
    )
    .unwrap();
    // Upstream gradient: each rank's columns of the full output.
    let dy = Tensor::cat(&[randn(&[5, OUT / 2], 7), randn(&[5, OUT / 2], 8)], 1).unwrap();
    let g = y.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
    let want = flat(g.get(x.as_tensor()).unwrap());
    for (f, _) in &runs {
        close("dx", f.dx.as_ref().unwrap(), &want, 1e-5);
    }
}

#[test]
fn column_parallel_linear_layer_matches_the_unfused_ops() {
    // The layer (overlapped unless PHALANX_TP_OVERLAP=0) against the unfused ops.
    let out = phalanx_comm::threads::run(2, |pg| {
        let tp = Tp::new(pg, false);
        let r = tp.rank();
        let w = Var::from_tensor(&randn(&[OUT, IN], 2).narrow(0, r * 5, 5).unwrap()).unwrap();
        let b = Var::from_tensor(&randn(&[OUT], 3).narrow(0, r * 5, 5).unwrap()).unwrap();
        let layer = ColumnParallelLinear::from_parts(
            &tp,
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
        );
        let x = Var::from_tensor(&randn(&[1, 5, IN], 1)).unwrap();
        let y = layer.forward(x.as_tensor()).unwrap();
        let dx = flat(
            y.sum_all()
                .unwrap()
                .backward()
                .unwrap()
                .get(x.as_tensor())
                .unwrap(),
        );
        let u = ops::linear(
            &copy_to_tp(x.as_tensor(), &tp.pg).unwrap(),
            w.as_tensor(),
            Some(b.as_tensor()),
        )
        .unwrap();
        let du = flat(
            u.sum_all()
                .unwrap()
                .backward()
                .unwrap()
                .get(x.as_tensor())
                .unwrap(),
        );
        (flat(&y) == flat(&u), dx == du)
    });
    assert!(out.iter().all(|&(y, dx)| y && dx), "{out:?}");
}

#[test]
fn a_failed_collective_is_an_error_not_a_hang() {
    let out = phalanx_comm::threads::run(2, |pg| {
        let tp = Tp::new(pg.clone(), false);
        let x = Var::from_tensor(&randn(&[5, IN], 1)).unwrap();
        let w = Var::from_tensor(&randn(&[5, IN], 2)).unwrap();
        let y = column_parallel_linear(&tp, x.as_tensor(), w.as_tensor(), None).unwrap();
        pg.abort("test: the group is gone");
        match y.sum_all().unwrap().backward() {
            Ok(_) => "no error".to_string(),
            Err(e) => e.to_string(),
        }
    });
    for e in &out {
        assert!(e.contains("tensor-parallel collective"), "{e}");
    }
}
