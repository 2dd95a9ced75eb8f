//! The collective suite shared by every backend: each check takes one
//! rank's `ProcessGroup` and asserts against a sequential reference. The
//! native transports run it with ranks as threads (`collectives.rs`), the
//! MPI backend under `mpirun` (`mpi.rs`).

#![allow(dead_code)]

use phalanx_comm::{bf16, f16, Element, ProcessGroup, ReduceOp};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// Small integers: sums stay exact in every dtype, so the reference can be
/// compared exactly for full-precision types.
fn value(rank: usize, i: usize, salt: usize) -> i64 {
    ((rank * 31 + i * 7 + salt * 3) % 13) as i64 - 6
}

fn input<T: Element>(rank: usize, n: usize, salt: usize) -> Vec<T> {
    (0..n).map(|i| T::from_i64(value(rank, i, salt))).collect()
}

/// The reference reduction of element i over `world` ranks, in f64.
fn reference(world: usize, i: usize, salt: usize, op: ReduceOp, integer: bool) -> f64 {
    let vals: Vec<f64> = (0..world).map(|r| value(r, i, salt) as f64).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg if integer => ((vals.iter().sum::<f64>() as i64) / world as i64) as f64,
        ReduceOp::Avg => vals.iter().sum::<f64>() / world as f64,
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
    }
}

fn close<T: Element>(got: T, want: f64, ctx: &str) {
    let g = got.to_f64();
    let tol = match T::DTYPE {
        phalanx_comm::DType::F16 | phalanx_comm::DType::BF16 => 1e-2 * want.abs().max(1.0),
        _ => 1e-6 * want.abs().max(1.0),
    };
    assert!((g - want).abs() <= tol, "{ctx}: got {g}, want {want}");
}

fn check_all_ops<T: Element>(pg: &ProcessGroup, n: usize, salt: usize) {
    let (r, w) = (pg.rank(), pg.size());
    let integer = matches!(
        T::DTYPE,
        phalanx_comm::DType::I32 | phalanx_comm::DType::I64
    );
    let name = T::DTYPE.name();
    for op in OPS {
        // all_reduce
        let mut x = input::<T>(r, n, salt);
        pg.all_reduce(&mut x, op).unwrap();
        for (i, v) in x.iter().enumerate() {
            close(
                *v,
                reference(w, i, salt, op, integer),
                &format!("all_reduce {name} {op:?} n={n} w={w} i={i}"),
            );
        }
        // reduce_scatter_v with uneven blocks
        let counts = phalanx_comm::algo::even_split(n, w);
        let x = input::<T>(r, n, salt);
        let mut out = vec![T::zeroed(); counts[r]];
        pg.reduce_scatter_v(&x, &counts, &mut out, op).unwrap();
        let off: usize = counts[..r].iter().sum();
        for (k, v) in out.iter().enumerate() {
            close(
                *v,
                reference(w, off + k, salt, op, integer),
                &format!("reduce_scatter {name} {op:?} n={n}"),
            );
        }
        // reduce to the last rank
        let root = w - 1;
        let mut x = input::<T>(r, n, salt);
        let before = x.clone();
        pg.reduce(&mut x, root, op).unwrap();
        if r == root {
            for (i, v) in x.iter().enumerate() {
                close(
                    *v,
                    reference(w, i, salt, op, integer),
                    &format!("reduce {name} {op:?} n={n}"),
                );
            }
        } else {
            assert_eq!(x, before, "reduce must leave non-root buffers alone");
        }
    }
    // all_gather_v: rank k contributes k+n%3 elements.
    let counts: Vec<usize> = (0..w).map(|k| (k + n) % 3 + n / 2).collect();
    let mine = input::<T>(r, counts[r], salt);
    let mut out = vec![T::zeroed(); counts.iter().sum()];
    pg.all_gather_v(&mine, &counts, &mut out).unwrap();
    let mut off = 0;
    for (k, &c) in counts.iter().enumerate() {
        assert_eq!(
            &out[off..off + c],
            &input::<T>(k, c, salt)[..],
            "all_gather {name} from rank {k}"
        );
        off += c;
    }
    // broadcast from every root
    for root in 0..w {
        let mut x = if r == root {
            input::<T>(root, n, salt)
        } else {
            vec![T::zeroed(); n]
        };
        pg.broadcast(&mut x, root).unwrap();
        assert_eq!(
            x,
            input::<T>(root, n, salt),
            "broadcast {name} root {root} n={n}"
        );
    }
    // all_to_all: block j of rank i is value(i, j*k + t)
    let k = n;
    let x = input::<T>(r, w * k, salt);
    let mut out = vec![T::zeroed(); w * k];
    pg.all_to_all(&x, &mut out).unwrap();
    for i in 0..w {
        assert_eq!(
            &out[i * k..(i + 1) * k],
            &input::<T>(i, w * k, salt)[r * k..(r + 1) * k],
            "all_to_all {name}"
        );
    }
}

/// Every op, dtype and reduce op at counts 0, 1, 7 and 40.
pub fn small_counts(pg: &ProcessGroup) {
    for (salt, n) in [0usize, 1, 7, 40].into_iter().enumerate() {
        check_all_ops::<f32>(pg, n, salt);
        check_all_ops::<f64>(pg, n, salt);
        check_all_ops::<f16>(pg, n, salt);
        check_all_ops::<bf16>(pg, n, salt);
        check_all_ops::<i32>(pg, n, salt);
        check_all_ops::<i64>(pg, n, salt);
    }
    pg.barrier().unwrap();
}

/// 2M+1 elements on the large-message paths of every collective.
pub fn large_counts(pg: &ProcessGroup, n: usize) {
    let (r, w) = (pg.rank(), pg.size());
    let mut x = input::<f32>(r, n, 1);
    pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    for i in (0..n).step_by(997).chain([n - 1]) {
        close(
            x[i],
            reference(w, i, 1, ReduceOp::Sum, false),
            "large all_reduce",
        );
    }
    let counts = phalanx_comm::algo::even_split(n, w);
    let x = input::<f32>(r, n, 2);
    let mut out = vec![0f32; counts[r]];
    pg.reduce_scatter_v(&x, &counts, &mut out, ReduceOp::Max)
        .unwrap();
    let off: usize = counts[..r].iter().sum();
    for k in (0..out.len()).step_by(101) {
        close(
            out[k],
            reference(w, off + k, 2, ReduceOp::Max, false),
            "large reduce_scatter",
        );
    }
    let mut full = vec![0f32; n];
    pg.all_gather_v(&out, &counts, &mut full).unwrap();
    for i in (0..n).step_by(499) {
        close(
            full[i],
            reference(w, i, 2, ReduceOp::Max, false),
            "large all_gather",
        );
    }
    let mut b = if r == 1 {
        input::<f32>(1, n, 3)
    } else {
        vec![0f32; n]
    };
    pg.broadcast(&mut b, 1).unwrap();
    assert_eq!(b, input::<f32>(1, n, 3));
    let mut x = input::<i64>(r, n, 4);
    pg.reduce(&mut x, 0, ReduceOp::Sum).unwrap();
    if r == 0 {
        for i in (0..n).step_by(333) {
            assert_eq!(x[i] as f64, reference(w, i, 4, ReduceOp::Sum, true));
        }
    }
}

/// Tags received in the opposite order to their sends, a wrong-size receive,
/// async collectives in issue order (3 ranks).
pub fn send_recv_tags_and_async(pg: &ProcessGroup) {
    let r = pg.rank();
    let next = (r + 1) % 3;
    let prev = (r + 2) % 3;
    // Two tags sent in the opposite order to the receives.
    pg.send(&[r as i32; 5], next, 7).unwrap();
    pg.send(&[10 + r as i32; 3], next, 9).unwrap();
    let mut a = [0i32; 3];
    pg.recv(&mut a, prev, 9).unwrap();
    let mut b = [0i32; 5];
    pg.recv(&mut b, prev, 7).unwrap();
    assert_eq!(a, [10 + prev as i32; 3]);
    assert_eq!(b, [prev as i32; 5]);
    // A wrong-size receive is an error, not corruption.
    pg.send(&[1.0f32; 4], next, 11).unwrap();
    let mut wrong = [0f32; 3];
    assert!(pg.recv(&mut wrong, prev, 11).is_err());

    // Async collectives of different sizes: if order differed between
    // ranks, sizes would mismatch and fail.
    let works: Vec<_> = (1..=8)
        .map(|k| pg.all_reduce_async(vec![(r + k) as f64; k * 1000], ReduceOp::Sum))
        .collect();
    let recv = pg.recv_async(vec![0u8 as i64; 2], prev, 99);
    pg.send(&[r as i64, 42], next, 99).unwrap();
    // A synchronous call issued after them runs after them.
    let mut s = [1i32];
    pg.all_reduce(&mut s, ReduceOp::Sum).unwrap();
    assert_eq!(s, [3]);
    for (i, w) in works.into_iter().enumerate() {
        let k = i + 1;
        let v = w.wait().unwrap();
        assert_eq!(v.len(), k * 1000);
        assert!(v.iter().all(|&x| x == (3 * k + 3) as f64));
    }
    assert_eq!(recv.wait().unwrap(), vec![prev as i64, 42]);
    let g = pg
        .all_gather_async(vec![r as i32], vec![1, 1, 1])
        .wait()
        .unwrap();
    assert_eq!(g, vec![0, 1, 2]);
    let rs = pg
        .reduce_scatter_async(vec![1.0f32; 5], vec![2, 2, 1], ReduceOp::Sum)
        .wait()
        .unwrap();
    assert_eq!(rs, vec![3.0; if r == 2 { 1 } else { 2 }]);
    // The `_into` variants fill the caller's buffer (resized when its
    // length is not the result's) and give the input back early.
    let (tx, rx) = std::sync::mpsc::channel();
    let t = tx.clone();
    let out = vec![-1i32; 6];
    let g = pg
        .all_gather_into_async(vec![r as i32; 2], vec![2, 2, 2], out, move |v| {
            t.send(v.len()).unwrap()
        })
        .wait()
        .unwrap();
    assert_eq!(g, vec![0, 0, 1, 1, 2, 2]);
    let out = Vec::with_capacity(2);
    let rs = pg
        .reduce_scatter_into_async(
            vec![1.0f32; 5],
            vec![2, 2, 1],
            ReduceOp::Sum,
            out,
            move |v| tx.send(v.len()).unwrap(),
        )
        .wait()
        .unwrap();
    assert_eq!(rs, vec![3.0; if r == 2 { 1 } else { 2 }]);
    assert_eq!(rx.iter().collect::<Vec<_>>(), vec![2, 5]);
    let b = pg.broadcast_async(vec![r as i32; 4], 2).wait().unwrap();
    assert_eq!(b, vec![2; 4]);
}

/// `new_group` and `split` (4 ranks); sub-group work on another thread
/// while the parent reduces.
pub fn subgroups(pg: &ProcessGroup) {
    let r = pg.rank();
    let pair = pg.new_group(if r < 2 { &[0, 1] } else { &[2, 3] }).unwrap();
    // Both pairs are created on every rank, in the same order.
    let other = pg.new_group(if r < 2 { &[2, 3] } else { &[0, 1] }).unwrap();
    assert!(other.is_none());
    let pair = pair.unwrap();
    assert_eq!(pair.size(), 2);
    let odd_even = pg.split((r % 2) as i64, -(r as i64)).unwrap().unwrap();
    // Ordered by key: descending rank.
    assert_eq!(
        odd_even.global_ranks(),
        if r.is_multiple_of(2) {
            &[2, 0]
        } else {
            &[3, 1]
        }
    );

    // Sub-group work on another thread while the parent reduces here.
    let p2 = pair.clone();
    let h = std::thread::spawn(move || {
        let mut total = 0.0;
        for i in 0..50 {
            let mut x = vec![(r + i) as f32; 1000];
            p2.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            total += x[0];
        }
        total
    });
    for i in 0..50 {
        let mut y = vec![i as f64; 300];
        pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        assert_eq!(y[0], 4.0 * i as f64);
        let mut z = [r as i64];
        odd_even.all_reduce(&mut z, ReduceOp::Sum).unwrap();
        assert_eq!(z[0], if r.is_multiple_of(2) { 2 } else { 4 });
    }
    let total = h.join().unwrap();
    let base = if r < 2 { 1.0 } else { 5.0 };
    let want: f32 = (0..50).map(|i| base + 2.0 * i as f32).sum();
    assert_eq!(total, want);
}
