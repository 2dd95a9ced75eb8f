//! `rpc_sync` round trip: worker0 calls `echo` on worker1 with a payload of
//! 8 B, 64 KB and 4 MB (a `Blob<u8>`, there and back), as
//! `bench/peers/torch_rpc.py` does with torch.distributed.rpc. Prints one
//! JSON line per size: mean round trip, calls/s and MB/s (payload bytes /
//! round trip).
//!
//! ```sh
//! cargo run --release -p phalanx --example rpc_bench
//! ```
//! Started by hand it launches its two ranks (`PHALANX_TRANSPORT` picks the
//! transport as for any job: shared memory by default on one host).

use phalanx_rpc::rpc::{self, launch, Blob, Options, Registry};
use std::time::{Duration, Instant};

const SIZES: [(usize, usize); 3] = [(8, 5000), (64 << 10, 2000), (4 << 20, 200)];

fn main() {
    launch::check_args(
        "usage: rpc_bench (no options; PHALANX_TRANSPORT picks the transport)",
        &[],
        &[],
    );
    let Some((rank, world)) = launch::rank_of_job() else {
        let code = launch::spawn_ranks(2, Duration::from_secs(10));
        std::process::exit(code.unwrap_or(2));
    };
    let mut reg = Registry::new();
    reg.register("echo", |_c, x: Blob<u8>| x);
    let name = format!("worker{rank}");
    let rpc = rpc::init_rpc_with(&name, rank, world, reg, Options::default()).expect("init_rpc");
    if rank == 0 {
        let transport = std::env::var("PHALANX_TRANSPORT").unwrap_or_else(|_| "auto".into());
        for (size, iters) in SIZES {
            let x = Blob::from(vec![1u8; size]);
            for _ in 0..(iters / 10).max(10) {
                let _: Blob<u8> = rpc.rpc_sync("worker1", "echo", &x).expect("echo");
            }
            let t0 = Instant::now();
            let mut n = 0;
            for _ in 0..iters {
                let y: Blob<u8> = rpc.rpc_sync("worker1", "echo", &x).expect("echo");
                n = y.len();
            }
            let dt = t0.elapsed().as_secs_f64() / iters as f64;
            assert_eq!(n, size);
            println!(
                "{{\"peer\": \"phalanx_rpc::rpc\", \"transport\": \"{transport}\", \"bytes\": {size}, \
                 \"iters\": {iters}, \"rtt_us\": {:.1}, \"calls_per_s\": {:.0}, \"mb_per_s\": {:.1}}}",
                dt * 1e6,
                1.0 / dt,
                size as f64 / dt / 1e6
            );
        }
    }
    rpc.shutdown().expect("shutdown");
}
