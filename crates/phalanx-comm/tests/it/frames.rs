//! Messages longer than the data frame limit travel as several frames, on
//! every path that sends one message per call (the large reduce's blocks
//! to the root, all-to-all, point-to-point, recursive doubling and trees
//! when forced), over every transport.
//!
//! The limit is lowered to `LIMIT` bytes for this whole test binary
//! (every test sets the same value first), so small buffers span many
//! frames; the receiving side refuses any frame over the limit, so a path
//! that still sent one frame would fail its connection.

use phalanx_comm::transport::set_frame_limit_for_test;
use phalanx_comm::{threads, Algo, Config, ProcessGroup, ReduceOp, TransportPref};
use std::time::{Duration, Instant};

const LIMIT: usize = 4096;

const TRANSPORTS: [TransportPref; 3] = [TransportPref::Shm, TransportPref::Uds, TransportPref::Tcp];

/// Run `f` on `world` ranks over each transport with the lowered limit;
/// every rank must succeed.
fn run(world: usize, cfg: Config, f: fn(&ProcessGroup) -> phalanx_comm::Result<()>) {
    set_frame_limit_for_test(LIMIT);
    for transport in TRANSPORTS {
        let cfg = Config {
            transport,
            timeout: Duration::from_secs(30),
            ..cfg.clone()
        };
        let out = threads::run_with(world, cfg, threads::DEADLINE, move |pg| f(&pg));
        for (r, o) in out.into_iter().enumerate() {
            if let Err(e) = o {
                panic!("{transport:?}, world {world}: rank {r}: {e}");
            }
        }
    }
}

/// `n` values of rank `r`, distinct per rank and index, exact in f32.
fn values(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 1000) * 8 + r) as f32).collect()
}

fn sum_over_ranks(world: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0..world).map(|r| values(r, n)[i]).sum())
        .collect()
}

/// 10 000 f32s: 40 000 bytes, ten frames.
const N: usize = 10_000;

#[test]
fn large_reduce_sends_blocks_over_the_limit() {
    for world in [2usize, 3] {
        // Ring reduce-scatter, then each block (over the limit) to the root.
        let cfg = Config {
            rd_max_bytes: 1024,
            ..Config::default()
        };
        run(world, cfg, |pg| {
            let root = pg.size() - 1;
            let mut x = values(pg.rank(), N);
            pg.reduce(&mut x, root, ReduceOp::Sum)?;
            if pg.rank() == root {
                assert_eq!(x, sum_over_ranks(pg.size(), N));
            } else {
                assert_eq!(x, values(pg.rank(), N), "a non-root buffer changed");
            }
            Ok(())
        });
    }
}

#[test]
fn rd_and_trees_forced_over_the_limit() {
    for world in [2usize, 3] {
        // Every size counts as small: recursive doubling and trees.
        let cfg = Config {
            algo: Algo::RecursiveDoubling,
            rd_max_bytes: 1 << 30,
            ..Config::default()
        };
        run(world, cfg, |pg| {
            let n = pg.size();
            let mut x = values(pg.rank(), N);
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            assert_eq!(x, sum_over_ranks(n, N));
            let mut y = values(pg.rank(), N);
            pg.reduce(&mut y, 0, ReduceOp::Sum)?;
            if pg.rank() == 0 {
                assert_eq!(y, sum_over_ranks(n, N));
            }
            let mut b = values(pg.rank(), N);
            pg.broadcast(&mut b, n - 1)?;
            assert_eq!(b, values(n - 1, N));
            Ok(())
        });
    }
}

#[test]
fn ring_all_gather_chunks_over_the_limit() {
    // The default 512 KiB ring chunk is over the limit too: its frames
    // arrive in pieces where a whole chunk was posted for them.
    run(3, Config::default(), |pg| {
        let n = pg.size();
        let mut out = vec![0.0f32; n * N];
        pg.all_gather(&values(pg.rank(), N), &mut out)?;
        for r in 0..n {
            assert_eq!(out[r * N..(r + 1) * N], values(r, N)[..], "block {r}");
        }
        Ok(())
    });
}

#[test]
fn all_to_all_blocks_over_the_limit() {
    for world in [2usize, 3] {
        run(world, Config::default(), |pg| {
            let (n, me) = (pg.size(), pg.rank());
            // Block j of rank r: 3000 values (12 000 bytes) tagged (r, j).
            let k = 3000;
            let input: Vec<f32> = (0..n * k)
                .map(|i| (me * 100_000 + (i / k) * 10_000 + i % k) as f32)
                .collect();
            let mut out = vec![0.0f32; n * k];
            pg.all_to_all(&input, &mut out)?;
            for (i, v) in out.iter().enumerate() {
                let want = ((i / k) * 100_000 + me * 10_000 + i % k) as f32;
                assert_eq!(*v, want, "element {i}");
            }
            // Uneven: rank r sends r*5000 + 1 elements to every rank.
            let send = vec![me * 5000 + 1; n];
            let recv: Vec<usize> = (0..n).map(|r| r * 5000 + 1).collect();
            let input = vec![me as i64; n * (me * 5000 + 1)];
            let out = pg.all_to_all_v_async(input, send, recv.clone()).wait()?;
            let want: Vec<i64> = (0..n)
                .flat_map(|r| std::iter::repeat_n(r as i64, recv[r]))
                .collect();
            assert_eq!(out, want);
            Ok(())
        });
    }
}

#[test]
fn send_recv_and_byte_messages_over_the_limit() {
    run(2, Config::default(), |pg| {
        let peer = 1 - pg.rank();
        let deadline = || Instant::now() + Duration::from_secs(30);
        // Over, exactly at, and a multiple of the limit, and empty.
        let sizes = [N * 4 + 3, LIMIT, 2 * LIMIT, 0, 5];
        if pg.rank() == 0 {
            pg.send(&values(0, N), peer, 1)?;
            for (t, &len) in sizes.iter().enumerate() {
                let msg: Vec<u8> = (0..len).map(|i| (i * 7 + t) as u8).collect();
                pg.send_bytes(peer, 2, &msg, Duration::from_secs(30))?;
            }
            let mut back = vec![0.0f32; N];
            pg.recv(&mut back, peer, 3)?;
            assert_eq!(back, values(1, N));
        } else {
            let mut x = vec![0.0f32; N];
            pg.recv(&mut x, peer, 1)?;
            assert_eq!(x, values(0, N));
            for (t, &len) in sizes.iter().enumerate() {
                let m = pg.recv_bytes(peer, 2, deadline())?;
                let want: Vec<u8> = (0..len).map(|i| (i * 7 + t) as u8).collect();
                assert_eq!(m.bytes(), &want[..], "message {t} of {len} bytes");
            }
            pg.send(&values(1, N), peer, 3)?;
        }
        pg.barrier()
    });
}
