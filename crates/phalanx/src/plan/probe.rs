//! Quick probes of this machine: matmul throughput (FLOP/s, what the step
//! time and MFU are measured against) and the bandwidth of a local link
//! (a Unix socket pair, what ranks on one host talk over).
//!
//! Both take well under a second. The matmul probe times a few square
//! f32 products through candle (the `gemm` kernels training uses) on the
//! threads this process has, after one warm-up product, and keeps the best.
//!
//! ```
//! let flops = phalanx::plan::probe_matmul_flops();
//! assert!(flops > 1e8, "{flops}");
//! let bw = phalanx::plan::probe_bandwidth(1 << 20);
//! assert!(bw > 1e6, "{bw}");
//! ```

use candle_core::{Device, Tensor};
use std::io::{Read, Write};
use std::time::Instant;

/// Peak matmul FLOP/s of this process (best of a few 512³ products, or
/// 256³ ones when the machine is slow).
pub fn probe_matmul_flops() -> f64 {
    let run = |n: usize, reps: usize| -> Option<f64> {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (n, n), &dev).ok()?;
        let b = Tensor::randn(0f32, 1.0, (n, n), &dev).ok()?;
        a.matmul(&b).ok()?; // warm-up: thread pool, packing buffers
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t0 = Instant::now();
            let c = a.matmul(&b).ok()?;
            let _ = c.dims();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Some(2.0 * (n * n * n) as f64 / best.max(1e-9))
    };
    let small = run(256, 3).unwrap_or(1e9);
    // 512³ takes ~2.7e8 FLOP: ~3 ms at 100 GFLOP/s.
    if small > 5e9 {
        run(512, 5).unwrap_or(small).max(small)
    } else {
        small
    }
}

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
