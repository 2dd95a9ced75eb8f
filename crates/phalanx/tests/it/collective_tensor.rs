//! `collective`: all-reduce, all-gather and reduce-scatter of candle
//! tensors where they lie, the path DDP's and ZeRO's device-held
//! gradients and shards take (host memory here; NCCL's device memory on a GPU, which
//! `scripts/gpu_check.sh` runs).

use candle_core::{DType, Device, Tensor};
use phalanx::collective::{
    all_gather_in_place, all_reduce_in_place, reduce_scatter_in_place, reduce_scatter_v_in_place,
    reduces_on, Started,
};
use phalanx_comm::{threads, ReduceOp};

/// A (3, 2) view of a (2, 3) matrix: no contiguous range.
fn transposed() -> Tensor {
    Tensor::zeros((2, 3), DType::F32, &Device::Cpu)
        .unwrap()
        .t()
        .unwrap()
}

#[test]
fn reduces_the_tensors_own_range_in_every_float_dtype() {
    let out = threads::run(3, |pg| {
        let r = pg.rank() as f32;
        let mut got = Vec::new();
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            // (8,), of which the view (2..5) is reduced: its elements only.
            let whole = Tensor::arange(0f32, 8.0, &Device::Cpu)
                .unwrap()
                .affine(1.0, r as f64)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let view = whole.narrow(0, 2, 3).unwrap();
            all_reduce_in_place(&pg, &view, ReduceOp::Sum).unwrap();
            let all = whole
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            got.push((dt, all));
        }
        let avg = Tensor::new(&[1.0f32 + r, 4.0 * r], &Device::Cpu).unwrap();
        all_reduce_in_place(&pg, &avg, ReduceOp::Avg).unwrap();
        (got, avg.to_vec1::<f32>().unwrap(), r)
    });
    for (got, avg, r) in out {
        for (dt, all) in got {
            // Ranks add 0, 1, 2 to arange(8): the view sums to 3x + 3.
            let want: Vec<f32> = (0..8)
                .map(|i| {
                    let x = i as f32;
                    if (2..5).contains(&i) {
                        3.0 * x + 3.0
                    } else {
                        x + r
                    }
                })
                .collect();
            assert_eq!(all, want, "{dt:?} on rank {r}");
        }
        assert_eq!(avg, [2.0, 4.0], "rank {r}");
    }
}

#[test]
fn refuses_what_it_cannot_reduce_and_keeps_the_groups_error() {
    let out = threads::run(2, |pg| {
        assert!(reduces_on(&pg, &Device::Cpu));
        // A transposed matrix has no contiguous range: refused before any
        // message (so both ranks stay in step).
        let strided = all_reduce_in_place(&pg, &transposed(), ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let ints = Tensor::zeros(4, DType::U8, &Device::Cpu).unwrap();
        let u8s = all_reduce_in_place(&pg, &ints, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        // A torn-down group fails with its own error, not candle's.
        if pg.rank() == 1 {
            pg.abort("rank 1 stopped on purpose");
        }
        let t = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let e = all_reduce_in_place(&pg, &t, ReduceOp::Sum).unwrap_err();
        (strided, u8s, e)
    });
    for (strided, u8s, e) in out {
        assert!(strided.contains("non-contiguous"), "{strided}");
        assert!(u8s.contains("U8"), "{u8s}");
        assert!(matches!(e, phalanx::error::Error::Comm(_)), "{e:?}");
    }
}

#[test]
fn gathers_every_ranks_block_in_place_even_and_uneven() {
    // Uneven blocks (one empty), as ZeRO's shards of a model that the
    // group size does not divide; and even ones.
    let out = threads::run(3, |pg| {
        let me = pg.rank();
        let mut got = Vec::new();
        for counts in [vec![2usize, 0, 3], vec![2, 2, 2]] {
            for dt in [DType::F32, DType::BF16] {
                let n: usize = counts.iter().sum();
                let at: usize = counts[..me].iter().sum();
                // Everyone's block garbage (-1) but this rank's own.
                let mut v = vec![-1.0f32; n];
                for (i, x) in v[at..at + counts[me]].iter_mut().enumerate() {
                    *x = (10 * me + i) as f32;
                }
                let t = Tensor::from_vec(v, n, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap();
                all_gather_in_place(&pg, &t, &counts).unwrap();
                let all = t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                got.push((counts.clone(), dt, all));
            }
        }
        // Counts that do not cover the tensor are refused before any message.
        let t = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let e = all_gather_in_place(&pg, &t, &[1, 1, 1])
            .unwrap_err()
            .to_string();
        (got, e)
    });
    for (got, e) in out {
        for (counts, dt, all) in got {
            let want: Vec<f32> = counts
                .iter()
                .enumerate()
                .flat_map(|(k, &c)| (0..c).map(move |i| (10 * k + i) as f32))
                .collect();
            assert_eq!(all, want, "{counts:?} {dt:?}");
        }
        assert!(e.contains("3 counts summing to 3"), "{e}");
    }
}

#[test]
fn a_group_of_one_leaves_the_tensor_as_it_is_and_refuses_as_larger_ones() {
    let out = threads::run(1, |pg| {
        let t = Tensor::new(&[1.5f32, -2.0, 3.0], &Device::Cpu).unwrap();
        all_reduce_in_place(&pg, &t, ReduceOp::Avg).unwrap();
        all_gather_in_place(&pg, &t, &[3]).unwrap();
        let counts = all_gather_in_place(&pg, &t, &[2]).unwrap_err().to_string();
        let strided = all_reduce_in_place(&pg, &transposed(), ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        (t.to_vec1::<f32>().unwrap(), counts, strided)
    });
    let (t, counts, strided) = &out[0];
    assert_eq!(t, &[1.5, -2.0, 3.0]);
    assert!(counts.contains("1 counts summing to 2"), "{counts}");
    assert!(strided.contains("non-contiguous"), "{strided}");
}

#[test]
fn reduce_scatters_into_this_ranks_block_of_the_tensors_own_range() {
    let out = threads::run(3, |pg| {
        let r = pg.rank();
        let mut got = Vec::new();
        for dt in [DType::F32, DType::BF16, DType::F64] {
            // (10,), of which the view (1..7) is 3 blocks of 2.
            let whole = Tensor::arange(0f32, 10.0, &Device::Cpu)
                .unwrap()
                .affine(1.0, r as f64)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let view = whole.narrow(0, 1, 6).unwrap();
            reduce_scatter_in_place(&pg, &view, ReduceOp::Sum).unwrap();
            let all = whole
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            got.push((dt, all));
        }
        let avg = Tensor::new(
            &[1.0f32 + r as f32, 2.0, 3.0, 4.0, 5.0, 6.0 * r as f32],
            &Device::Cpu,
        )
        .unwrap();
        reduce_scatter_in_place(&pg, &avg, ReduceOp::Avg).unwrap();
        let avg = avg.narrow(0, 2 * r, 2).unwrap().to_vec1::<f32>().unwrap();
        // 7 elements do not split into 3 blocks; a matrix is no flat
        // buffer: both refused before any message.
        let seven = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
        let uneven = reduce_scatter_in_place(&pg, &seven, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let matrix = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let matrix = reduce_scatter_in_place(&pg, &matrix, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        (r, got, avg, uneven, matrix)
    });
    let avg_want = [[2.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]];
    for (r, got, avg, uneven, matrix) in out {
        for (dt, all) in got {
            // This rank's block of the view, elements 1 + 2r and 2 + 2r,
            // is the sum 3x + 3; the rest of the tensor outside the view
            // is untouched.
            for (i, v) in all.iter().enumerate() {
                let x = i as f32;
                if i == 0 || i >= 7 {
                    assert_eq!(*v, x + r as f32, "{dt:?} rank {r} element {i}");
                } else if (i - 1) / 2 == r {
                    assert_eq!(*v, 3.0 * x + 3.0, "{dt:?} rank {r} element {i}");
                }
            }
        }
        assert_eq!(avg, avg_want[r], "rank {r}");
        assert!(
            uneven.contains("does not split into 3 equal blocks"),
            "{uneven}"
        );
        assert!(matrix.contains("[3, 2]"), "{matrix}");
    }
}

#[test]
fn reduce_scatters_uneven_blocks_in_place() {
    // ZeRO-3's pieces of a model block: the shards cut it anywhere, so a
    // rank's block may be short or empty.
    let counts = [3usize, 0, 2];
    let out = threads::run(3, move |pg| {
        let r = pg.rank();
        // (5,) values 10 * rank + i.
        let t = Tensor::arange(0f32, 5.0, &Device::Cpu)
            .unwrap()
            .affine(1.0, 10.0 * r as f64)
            .unwrap();
        reduce_scatter_v_in_place(&pg, &t, &counts, ReduceOp::Sum).unwrap();
        let at: usize = counts[..r].iter().sum();
        let mine = t
            .narrow(0, at, counts[r])
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // Counts that do not cover the tensor: refused before any message.
        let short = reduce_scatter_v_in_place(&pg, &t, &[1, 1, 1], ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        (r, mine, short)
    });
    for (r, mine, short) in out {
        // Element i summed over the 3 ranks: 3i + 30.
        let at: usize = counts[..r].iter().sum();
        let want: Vec<f32> = (at..at + counts[r])
            .map(|i| 3.0 * i as f32 + 30.0)
            .collect();
        assert_eq!(mine, want, "rank {r}");
        assert!(
            short.contains("reduce-scatter in place: 3 counts summing to 3"),
            "{short}"
        );
    }
}

#[test]
fn started_collectives_run_in_order_when_waited_for_as_on_a_stream() {
    // On host memory a started collective runs when it is waited for, or
    // when a later collective on its group runs: NCCL's stream order. So a
    // tensor read before its wait is still this rank's own (as a GPU's
    // would be, unfinished), and code that reads early is caught on the CPU.
    let out = threads::run(2, |pg| {
        let r = pg.rank() as f32;
        let t = |x: f32| Tensor::new(&[x + r], &Device::Cpu).unwrap();
        let v = |t: &Tensor| t.to_vec1::<f32>().unwrap()[0];
        let mut started = Started::new(&pg);
        let (a, b, c) = (t(1.0), t(10.0), t(100.0));
        started.all_reduce(a.clone(), ReduceOp::Sum).unwrap();
        started.all_reduce(b.clone(), ReduceOp::Sum).unwrap();
        started.all_reduce(c.clone(), ReduceOp::Sum).unwrap();
        assert_eq!(started.len(), 3);
        let early = (v(&a), v(&b), v(&c));
        // The first alone: the later ones are still this rank's.
        let first = started.wait_first(1).unwrap();
        assert_eq!(first.len(), 1);
        let after_first = (v(&a), v(&b), v(&c));
        // A blocking collective on the group runs what was started before
        // it, in order, first.
        let d = t(1000.0);
        all_reduce_in_place(&pg, &d, ReduceOp::Sum).unwrap();
        let after_blocking = (v(&b), v(&c), v(&d));
        // What is left comes back without running anything twice.
        let rest = started.wait().unwrap();
        assert_eq!(rest.len(), 2);
        // A started one dropped without a wait is never run.
        let mut dropped = Started::new(&pg);
        let e = t(5.0);
        dropped.all_reduce(e.clone(), ReduceOp::Sum).unwrap();
        drop(dropped);
        all_reduce_in_place(&pg, &t(0.0), ReduceOp::Sum).unwrap();
        (early, after_first, after_blocking, v(&b), v(&e))
    });
    for (rank, (early, after_first, after_blocking, b, e)) in out.into_iter().enumerate() {
        let r = rank as f32;
        assert_eq!(early, (1.0 + r, 10.0 + r, 100.0 + r), "rank {rank}");
        assert_eq!(after_first, (3.0, 10.0 + r, 100.0 + r), "rank {rank}");
        assert_eq!(after_blocking, (21.0, 201.0, 2001.0), "rank {rank}");
        assert_eq!(b, 21.0, "rank {rank}: reduced once");
        assert_eq!(e, 5.0 + r, "rank {rank}: the dropped one ran");
    }
}
