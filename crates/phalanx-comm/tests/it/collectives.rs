//! Every collective against a sequential reference, for world sizes 1 to 5,
//! every dtype and reduce op, and element counts 0, 1, 7 and 2M+1, on every
//! transport (shared memory, Unix sockets, TCP).

#[path = "../suite/mod.rs"]
mod suite;

use phalanx_comm::{threads, Algo, Config, Link, ProcessGroup, ReduceOp, TransportPref};

/// Each transport with the link it must give between two ranks of one host.
const TRANSPORTS: [(TransportPref, Link); 3] = [
    (TransportPref::Shm, Link::Shm),
    (TransportPref::Uds, Link::Unix),
    (TransportPref::Tcp, Link::Tcp),
];

/// `threads::run` once per transport; checks that the ranks really talk
/// over it.
fn run_all<R: Send + 'static>(
    world: usize,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + Clone + 'static,
) {
    for (transport, link) in TRANSPORTS {
        let cfg = Config {
            transport,
            ..Config::from_env()
        };
        let f = f.clone();
        let out = threads::run_with(world, cfg, threads::DEADLINE, move |pg| {
            for j in (0..pg.size()).filter(|&j| j != pg.rank()) {
                assert_eq!(pg.link(j), Some(link), "{transport:?}: link to rank {j}");
            }
            Ok(f(pg))
        });
        for (r, o) in out.into_iter().enumerate() {
            if let Err(e) = o {
                panic!("{transport:?}: rank {r}: {e}");
            }
        }
    }
}

#[test]
fn small_counts_every_dtype_and_op_world_1_to_5() {
    for world in 1..=5 {
        run_all(world, |pg| {
            suite::small_counts(&pg);
        });
    }
}

#[test]
fn large_counts_ring_and_chain() {
    let n = 2_000_001;
    for world in [2usize, 3, 5] {
        run_all(world, move |pg| {
            suite::large_counts(&pg, n);
        });
    }
}

#[test]
fn forced_algorithms_agree_bitwise_across_ranks() {
    for (algo, world, (transport, _)) in [Algo::Ring, Algo::RecursiveDoubling]
        .into_iter()
        .flat_map(|a| [3usize, 4].map(|w| (a, w)))
        .flat_map(|(a, w)| TRANSPORTS.map(|t| (a, w, t)))
    {
        {
            let cfg = Config {
                algo,
                chunk_bytes: 4096,
                transport,
                ..Config::default()
            };
            let out = threads::run_with(world, cfg, threads::DEADLINE, |pg| {
                // Irrational-ish values: rounding differs with reduction order.
                let mut x: Vec<f32> = (0..10_007)
                    .map(|i| ((i * (pg.rank() + 3)) as f32).sin() / 7.0)
                    .collect();
                pg.all_reduce(&mut x, ReduceOp::Sum)?;
                Ok(x)
            });
            let first = out[0].as_ref().unwrap();
            for o in &out {
                assert_eq!(
                    o.as_ref().unwrap(),
                    first,
                    "{algo:?} world {world}: ranks disagree"
                );
            }
            let want: Vec<f32> = (0..10_007)
                .map(|i| (0..world).map(|r| ((i * (r + 3)) as f32).sin() / 7.0).sum())
                .collect();
            for (g, w) in first.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{algo:?}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn send_recv_tags_and_async_order() {
    run_all(3, |pg| {
        suite::send_recv_tags_and_async(&pg);
    });
}

#[test]
fn subgroups_run_concurrently_with_parent() {
    run_all(4, |pg| {
        suite::subgroups(&pg);
    });
}

#[test]
fn host_backends_refuse_device_memory_naming_themselves() {
    // Only NCCL reduces CUDA memory where it lies; a host backend says so
    // (on every rank, before touching the address) instead of reading it.
    let out = threads::run(2, |pg| {
        let buf = phalanx_comm::DeviceBuf {
            ptr: 0x1000,
            count: 4,
            dtype: phalanx_comm::DType::F32,
            ordinal: 0,
            after: None,
        };
        // SAFETY: a host backend refuses without dereferencing `ptr`.
        let e = unsafe { pg.all_reduce_device(buf, ReduceOp::Sum) }.unwrap_err();
        let g = unsafe { pg.all_gather_device(buf, &[1, 3]) }
            .unwrap_err()
            .to_string();
        assert!(
            g.contains("native backend gathers into host memory only"),
            "{g}"
        );
        // Started or whole, the same refusal; nothing is left to settle.
        let started = unsafe { pg.all_reduce_device_start(buf, ReduceOp::Sum) }
            .unwrap_err()
            .to_string();
        assert!(
            started.contains("native backend reduces host memory only"),
            "{started}"
        );
        pg.settle_device().unwrap();
        let rs = unsafe { pg.reduce_scatter_device(buf, &[2, 2], ReduceOp::Sum) }
            .unwrap_err()
            .to_string();
        assert!(
            rs.contains("native backend reduces host memory only"),
            "{rs}"
        );
        // Counts that do not cover the 4 elements, for the reduce-scatter.
        let uneven = unsafe { pg.reduce_scatter_device(buf, &[1, 2], ReduceOp::Sum) }
            .unwrap_err()
            .to_string();
        assert!(
            uneven.contains("2 counts summing to 3 for a buffer of 4"),
            "{uneven}"
        );
        // Counts that do not cover the 4 elements.
        let odd = unsafe { pg.all_gather_device(buf, &[1, 1]) }
            .unwrap_err()
            .to_string();
        assert!(
            odd.contains("2 counts summing to 2 for a buffer of 4"),
            "{odd}"
        );
        // The group goes on working after the refusal.
        let mut x = [1.0f32; 2];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        (pg.device_ordinal(), e.to_string(), x)
    });
    for (ordinal, e, x) in out {
        assert_eq!(ordinal, None);
        assert!(e.contains("native backend reduces host memory only"), "{e}");
        assert!(e.contains("PHALANX_BACKEND=nccl"), "{e}");
        assert_eq!(x, [2.0; 2]);
    }
}

/// Every path an all-reduce can be forced onto (recursive doubling, the
/// ring, the in-place shared-memory one), with 2 and 3 ranks.
fn forced_paths() -> Vec<(&'static str, Config)> {
    let base = Config {
        transport: TransportPref::Uds,
        ..Config::default()
    };
    vec![
        (
            "rd",
            Config {
                algo: Algo::RecursiveDoubling,
                ..base.clone()
            },
        ),
        (
            "ring",
            Config {
                algo: Algo::Ring,
                ..base.clone()
            },
        ),
        (
            "shm in place",
            Config {
                transport: TransportPref::Shm,
                ..base
            },
        ),
    ]
}

/// `op` over `vals[rank]` (one element per rank, as f64 bits), in `T`,
/// on every forced path: each rank's result bits.
fn bits_after<T: phalanx_comm::Element>(
    world: usize,
    cfg: Config,
    op: ReduceOp,
    vals: fn(usize) -> T,
    bits: fn(T) -> u64,
) -> Vec<u64> {
    threads::run_with(world, cfg, threads::DEADLINE, move |pg| {
        // A few copies so the ring has a block per rank.
        let mut x = vec![vals(pg.rank()); 8];
        pg.all_reduce(&mut x, op)?;
        let b: Vec<u64> = x.iter().map(|v| bits(*v)).collect();
        assert!(b.iter().all(|v| *v == b[0]), "elements differ: {b:x?}");
        Ok(b[0])
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn max_and_min_with_nan_or_signed_zero_agree_bitwise_on_every_path() {
    use phalanx_comm::{bf16, f16};
    for world in [2usize, 3] {
        for (path, cfg) in forced_paths() {
            for op in [ReduceOp::Max, ReduceOp::Min] {
                let ctx = format!("{path}, world {world}, {op:?}");
                // NaN on rank 0, 1.0 elsewhere: NaN on every rank.
                let f = bits_after(
                    world,
                    cfg.clone(),
                    op,
                    |r| if r == 0 { f32::NAN } else { 1.0 },
                    |v| v.to_bits() as u64,
                );
                assert!(f.iter().all(|b| *b == f[0]), "f32 {ctx}: {f:x?}");
                assert!(f32::from_bits(f[0] as u32).is_nan(), "f32 {ctx}: {f:x?}");
                let d = bits_after(
                    world,
                    cfg.clone(),
                    op,
                    |r| if r == 0 { f64::NAN } else { 1.0 },
                    f64::to_bits,
                );
                assert!(d.iter().all(|b| *b == d[0]), "f64 {ctx}: {d:x?}");
                assert!(f64::from_bits(d[0]).is_nan(), "f64 {ctx}: {d:x?}");
                let h = bits_after(
                    world,
                    cfg.clone(),
                    op,
                    |r| if r == 0 { f16::NAN } else { f16::ONE },
                    |v| v.to_bits() as u64,
                );
                assert!(h.iter().all(|b| *b == h[0]), "f16 {ctx}: {h:x?}");
                assert!(f16::from_bits(h[0] as u16).is_nan(), "f16 {ctx}: {h:x?}");
                let b = bits_after(
                    world,
                    cfg.clone(),
                    op,
                    |r| if r == 0 { bf16::NAN } else { bf16::ONE },
                    |v| v.to_bits() as u64,
                );
                assert!(b.iter().all(|x| *x == b[0]), "bf16 {ctx}: {b:x?}");
                assert!(bf16::from_bits(b[0] as u16).is_nan(), "bf16 {ctx}: {b:x?}");
                // -0 on rank 0, +0 elsewhere: max +0 and min -0 everywhere.
                let z = bits_after(
                    world,
                    cfg.clone(),
                    op,
                    |r| if r == 0 { -0.0f32 } else { 0.0 },
                    |v| v.to_bits() as u64,
                );
                let want = match op {
                    ReduceOp::Max => 0.0f32,
                    _ => -0.0,
                };
                assert!(
                    z.iter().all(|b| *b == want.to_bits() as u64),
                    "signed zero {ctx}: {z:x?}"
                );
            }
        }
    }
}
