//! Ranks as threads: a whole process group inside one process, for tests
//! and examples. Each thread gets its own transport over real sockets (Unix
//! domain sockets, or loopback TCP under `PHALANX_TRANSPORT=tcp` /
//! `Config::transport`), so the code under test is exactly what runs across
//! processes.
//!
//! ```
//! let ranks = phalanx_comm::threads::run(4, |pg| pg.rank());
//! assert_eq!(ranks, vec![0, 1, 2, 3]);
//! ```

use crate::config::Config;
use crate::error::Result;
use crate::group::ProcessGroup;
use crate::store::{StoreClient, StoreServer};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// How long `run` waits for all ranks before failing the caller.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// Start `world` ranks as threads, run `f` on each, return the results in
/// rank order. Panics (fails the test) if a rank panics or the group does not
/// finish within `DEADLINE`, instead of hanging.
pub fn run<R: Send + 'static>(
    world: usize,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_with(world, Config::from_env(), DEADLINE, move |pg| Ok(f(pg)))
        .into_iter()
        .map(|r| r.expect("rank failed"))
        .collect()
}

/// Like `run`, with an explicit configuration and deadline, and with each
/// rank's `Result` (including group set-up errors) returned to the caller.
pub fn run_with<R: Send + 'static>(
    world: usize,
    cfg: Config,
    deadline: Duration,
    f: impl Fn(ProcessGroup) -> Result<R> + Send + Sync + 'static,
) -> Vec<Result<R>> {
    let secret = crate::wire::random_bytes(32);
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).expect("bind store");
    let addr = server.addr().to_string();
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let (f, tx, secret, addr, cfg) = (
            f.clone(),
            tx.clone(),
            secret.clone(),
            addr.clone(),
            cfg.clone(),
        );
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let store = StoreClient::connect(&addr, &secret, cfg.timeout)?;
                    let pg = crate::init::from_store(
                        &store, "threads", rank, world, &secret, cfg, None,
                    )?;
                    f(pg)
                }));
                let _ = tx.send((rank, res));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let mut out: Vec<Option<Result<R>>> = (0..world).map(|_| None).collect();
    let end = std::time::Instant::now() + deadline;
    for _ in 0..world {
        let left = end.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} panicked: {msg}");
            }
            Err(_) => {
                let missing: Vec<usize> = (0..world).filter(|r| out[*r].is_none()).collect();
                panic!("ranks {missing:?} did not finish within {deadline:?}");
            }
        }
    }
    drop(server);
    out.into_iter().map(|r| r.unwrap()).collect()
}
