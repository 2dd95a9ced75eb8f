//! Quick probes of this machine: matmul throughput (FLOP/s, what the step
//! time and MFU are measured against) and the bandwidth of a local link
//! (a Unix socket pair, what ranks on one host talk over).
//!
//! Both take well under a second. The matmul probe times square
//! f32 products through `ops::sgemm` (the `gemm` kernels training uses),
//! one per thread this process has, all at once, after one warm-up round:
//! at least three rounds, up to 24 within a quarter of a second, and keeps
//! the best.
//!
//! ```
//! let flops = phalanx::plan::probe_matmul_flops();
//! assert!(flops > 1e8, "{flops}");
//! let bw = phalanx::plan::probe_bandwidth(1 << 20);
//! assert!(bw > 1e6, "{bw}");
//! ```

use crate::ops::cpu::{par_parts, pool_threads};
use crate::ops::{sgemm, Mat};
use std::io::{Read, Write};
use std::sync::Mutex;
use std::time::Instant;

/// Peak matmul FLOP/s of this process: the best of a few rounds of square
/// products through `ops::sgemm` (the kernels the engine's layers use), one
/// per thread of candle's pool at once, each on its own thread (as the
/// fused layer runs its shares of a batch); 1024³ ones, or 256³ ones when
/// the machine is slow.
pub fn probe_matmul_flops() -> f64 {
    let threads = pool_threads();
    let run = |n: usize, reps: usize| -> f64 {
        // Values do not matter to the time; fixed ones keep the probe cheap.
        let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.25 - 0.75).collect();
        let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        let cs: Vec<Mutex<Vec<f32>>> = (0..threads)
            .map(|_| Mutex::new(vec![0f32; n * n]))
            .collect();
        let mat = |d| Mat {
            data: d,
            rs: n,
            cs: 1,
        };
        let round = || {
            par_parts(threads, |i| {
                let mut c = cs[i].lock().unwrap();
                sgemm(n, n, n, &mut c, false, mat(&a), mat(&b));
            })
        };
        round(); // warm-up: pool, packing
        let mut best = f64::INFINITY;
        // At least `reps` rounds, then more while within the budget: on a
        // shared host a neighbour's burst slows some of them, and a peak read
        // low would show an MFU over 100%.
        let start = Instant::now();
        let mut done = 0;
        while done < reps || (done < 8 * reps && start.elapsed().as_secs_f64() < BUDGET_S) {
            let t0 = Instant::now();
            round();
            best = best.min(t0.elapsed().as_secs_f64());
            done += 1;
        }
        (threads * 2 * n * n * n) as f64 / best.max(1e-9)
    };
    let small = run(256, 3);
    // 1024³ takes ~2.1e9 FLOP: ~10 ms at 200 GFLOP/s.
    if small > 5e9 {
        run(1024, 3).max(small)
    } else {
        small
    }
}

/// Seconds the matmul probe may keep trying for a better figure.
const BUDGET_S: f64 = 0.25;

/// Bytes per second through a local Unix socket pair, moving `bytes`
/// (at least 64 KiB) from one thread to another.
pub fn probe_bandwidth(bytes: usize) -> f64 {
    let bytes = bytes.max(64 << 10);
    let Ok((mut a, mut b)) = std::os::unix::net::UnixStream::pair() else {
        return 1e9;
    };
    let chunk = vec![1u8; 256 << 10];
    let t0 = Instant::now();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        let mut got = 0;
        while got < bytes {
            match b.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        got
    });
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        if a.write_all(&chunk[..n]).is_err() {
            break;
        }
        sent += n;
    }
    let got = reader.join().unwrap_or(0);
    got as f64 / t0.elapsed().as_secs_f64().max(1e-9)
}
