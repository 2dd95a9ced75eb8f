//! The shared-memory transport across real processes: a killed and a
//! stopped rank are detected and named; segments have no name on the file
//! system and go with the processes; ranks that disagree on
//! `PHALANX_TRANSPORT` fall back to Unix sockets, or fail clearly under
//! `shm`.
//!
//! Ranks are this test binary run again as children (`child_rank` below,
//! which does nothing unless `PHALANX_SHM_CHILD` is set), around a store
//! served by the parent.

use phalanx_comm::store::{StoreClient, StoreServer};
use phalanx_comm::{CommError, Config, Link, ReduceOp, TransportPref};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A child rank: join, say "ready" with whether its data goes through a
/// memfd mapping, then all-reduce until something fails; report the error
/// and how long after "ready" it came.
#[test]
#[ignore = "one rank's body, started as a process by the tests below"]
fn child_rank() {
    let addr = std::env::var("PHALANX_SHM_CHILD").expect("started by the tests below");
    let rank: usize = std::env::var("CHILD_RANK").unwrap().parse().unwrap();
    let world: usize = std::env::var("CHILD_WORLD").unwrap().parse().unwrap();
    let secret = phalanx_comm::wire::from_hex(SECRET).unwrap();
    let cfg = Config::from_env();
    let store = StoreClient::connect(&addr, &secret, cfg.timeout).unwrap();
    let pg = phalanx_comm::init::from_store(&store, "p", rank, world, &secret, cfg, None).unwrap();
    let links: Vec<_> = (0..world)
        .filter(|&j| j != rank)
        .map(|j| pg.link(j).unwrap().name())
        .collect();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mapped = maps.matches("memfd:phalanx-shm-ring").count();
    pg.barrier().unwrap();
    // Through a file: the test harness may capture a child's stdout.
    let ready = std::env::var("CHILD_READY").unwrap();
    let line = format!("ready links={} mapped={mapped}", links.join(","));
    std::fs::write(format!("{ready}.tmp"), line).unwrap();
    std::fs::rename(format!("{ready}.tmp"), ready).unwrap();
    let t0 = Instant::now();
    let mut x = vec![1.0f32; 1 << 20];
    loop {
        if let Err(e) = pg.all_reduce(&mut x, ReduceOp::Sum) {
            eprintln!("FAILED after {} ms: {e}", t0.elapsed().as_millis());
            std::process::exit(3);
        }
        x.fill(1.0);
    }
}

struct Job {
    _server: StoreServer,
    kids: Vec<Child>,
}

/// Start `world` child ranks with `env`; returns once each said "ready",
/// with their ready lines.
fn start(world: usize, env: &[(&str, &str)]) -> (Job, Vec<String>) {
    let secret = phalanx_comm::wire::from_hex(SECRET).unwrap();
    let server = StoreServer::bind("127.0.0.1:0", secret).unwrap();
    let addr = server.addr().to_string();
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!(
        "phalanx-shm-test-{}-{}",
        std::process::id(),
        phalanx_comm::wire::to_hex(&phalanx_comm::wire::random_bytes(6))
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let ready = |r: usize| dir.join(format!("ready-{r}"));
    let kids: Vec<Child> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "child_rank",
                    "--ignored",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("PHALANX_SHM_CHILD", &addr)
                .env("CHILD_RANK", r.to_string())
                .env("CHILD_WORLD", world.to_string())
                .env("CHILD_READY", ready(r))
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut job = Job {
        _server: server,
        kids,
    };
    let end = Instant::now() + Duration::from_secs(60);
    let mut lines = vec![];
    for r in 0..world {
        loop {
            if let Ok(l) = std::fs::read_to_string(ready(r)) {
                lines.push(l);
                break;
            }
            if let Some(st) = job.kids[r].try_wait().unwrap() {
                let mut err = String::new();
                let _ = job.kids[r]
                    .stderr
                    .as_mut()
                    .unwrap()
                    .read_to_string(&mut err);
                panic!("rank {r} exited ({st}) before it was ready: {err}");
            }
            assert!(Instant::now() < end, "rank {r} not ready within 60 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    (job, lines)
}

/// Wait for every child but `skip` to exit (killing all after `limit`);
/// their exit codes and stderr.
fn finish(job: &mut Job, skip: usize, limit: Duration) -> Vec<(Option<i32>, String)> {
    let end = Instant::now() + limit;
    let mut out = vec![];
    for (r, k) in job.kids.iter_mut().enumerate() {
        if r == skip {
            out.push((None, String::new()));
            continue;
        }
        loop {
            if let Some(st) = k.try_wait().unwrap() {
                let mut err = String::new();
                k.stderr.as_mut().unwrap().read_to_string(&mut err).unwrap();
                out.push((st.code(), err));
                break;
            }
            if Instant::now() >= end {
                out.push((None, "did not exit".into()));
                let _ = k.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    out
}

impl Drop for Job {
    fn drop(&mut self) {
        for k in &mut self.kids {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

fn signal(k: &Child, sig: libc::c_int) {
    // SAFETY: signalling a child process we started and still own.
    assert_eq!(unsafe { libc::kill(k.id() as libc::pid_t, sig) }, 0);
}

fn dev_shm() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn check_ready(lines: &[String], world: usize) {
    for (r, l) in lines.iter().enumerate() {
        let want = vec!["shm"; world - 1].join(",");
        assert!(
            l.starts_with(&format!("ready links={want} ")),
            "rank {r}: {l}"
        );
        // One ring per direction per peer, each mapped once.
        let m: usize = l.rsplit("mapped=").next().unwrap().parse().unwrap();
        assert_eq!(m, 2 * (world - 1), "rank {r}: {l}");
    }
}

/// Every rank but `victim` exited with code 3, naming `victim` as failed.
fn assert_named_as_failed(outs: &[(Option<i32>, String)], victim: usize) {
    for (r, (code, err)) in outs.iter().enumerate() {
        if r == victim {
            continue;
        }
        assert_eq!(*code, Some(3), "rank {r}: {err}");
        // The peer's failure (heartbeats, the closed socket), not the
        // operation's timeout (300 s, past `finish`'s limit): detected.
        assert!(
            err.contains(&format!("rank {victim} (127.0.0.1:")) && err.contains(") failed: "),
            "rank {r}: {err}"
        );
        assert!(!err.contains("timeout:"), "rank {r}: {err}");
    }
}

#[test]
fn killed_rank_on_shm_is_named_as_failed() {
    let before = dev_shm();
    let (mut job, lines) = start(
        3,
        &[
            ("PHALANX_TRANSPORT", "shm"),
            ("PHALANX_HEARTBEAT_TIMEOUT", "2"),
        ],
    );
    check_ready(&lines, 3);
    std::thread::sleep(Duration::from_millis(300));
    signal(&job.kids[1], libc::SIGKILL);
    let outs = finish(&mut job, 1, Duration::from_secs(20));
    assert_named_as_failed(&outs, 1);
    // Nothing was ever named in /dev/shm.
    assert_eq!(dev_shm(), before);
}

#[test]
fn stopped_rank_on_shm_is_named_as_silent() {
    let (mut job, lines) = start(
        3,
        &[
            ("PHALANX_TRANSPORT", "shm"),
            ("PHALANX_HEARTBEAT_TIMEOUT", "1.5"),
        ],
    );
    check_ready(&lines, 3);
    std::thread::sleep(Duration::from_millis(300));
    signal(&job.kids[2], libc::SIGSTOP);
    let outs = finish(&mut job, 2, Duration::from_secs(20));
    // Named by the rank that heard the silence, or passed on by a peer
    // that stopped first.
    assert_named_as_failed(&outs, 2);
    signal(&job.kids[2], libc::SIGKILL);
}

/// Ranks as threads with per-rank transport preferences.
fn mixed(prefs: &[TransportPref]) -> Vec<Result<Vec<Option<Link>>, CommError>> {
    let secret = phalanx_comm::wire::random_bytes(32);
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let addr = server.addr().to_string();
    let world = prefs.len();
    let hs: Vec<_> = prefs
        .iter()
        .enumerate()
        .map(|(rank, &transport)| {
            let (addr, secret) = (addr.clone(), secret.clone());
            std::thread::spawn(move || {
                let cfg = Config {
                    transport,
                    timeout: Duration::from_secs(20),
                    ..Config::default()
                };
                let store = StoreClient::connect(&addr, &secret, cfg.timeout)?;
                let pg =
                    phalanx_comm::init::from_store(&store, "m", rank, world, &secret, cfg, None)?;
                let mut x = vec![rank as f32; 100_000];
                pg.all_reduce(&mut x, ReduceOp::Sum)?;
                let want = (world * (world - 1) / 2) as f32;
                assert!(x.iter().all(|v| *v == want));
                Ok((0..world).map(|j| pg.link(j)).collect())
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_pair_that_disagrees_falls_back_to_unix_sockets() {
    let out = mixed(&[TransportPref::Auto, TransportPref::Uds, TransportPref::Auto]);
    let links: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(links[0], vec![None, Some(Link::Unix), Some(Link::Shm)]);
    assert_eq!(links[1], vec![Some(Link::Unix), None, Some(Link::Unix)]);
    assert_eq!(links[2], vec![Some(Link::Shm), Some(Link::Unix), None]);
}

#[test]
fn forced_shm_with_a_peer_that_declines_is_an_error_naming_it() {
    let out = mixed(&[TransportPref::Shm, TransportPref::Uds]);
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("PHALANX_TRANSPORT=shm") && e.contains("rank 1 (127.0.0.1:"),
        "{e}"
    );
    // The declining rank hears of it instead of waiting out its timeout.
    assert!(out[1].is_err());
}

/// The world's all-reduce in place in shared memory: bitwise the same on
/// every rank, right against a reference over sizes around its chunk
/// (512 KiB) and world sizes 2 to 5; sizes that differ between ranks are an
/// error on every rank, not corruption.
#[test]
fn in_place_all_reduce_is_exact_and_checks_sizes() {
    for world in 2..=5usize {
        let cfg = Config {
            transport: TransportPref::Shm,
            timeout: Duration::from_secs(30),
            ..Config::default()
        };
        let out = phalanx_comm::threads::run_with(world, cfg, Duration::from_secs(120), |pg| {
            let r = pg.rank();
            let mut all = vec![];
            for n in [1usize, 3, 131_071, 131_072, 131_073, 400_009] {
                let mut x: Vec<f32> = (0..n).map(|i| ((i * (r + 3)) as f32).sin() / 7.0).collect();
                pg.all_reduce(&mut x, ReduceOp::Sum)?;
                for i in (0..n).step_by(97).chain([n - 1]) {
                    let want: f32 = (0..pg.size())
                        .map(|q| ((i * (q + 3)) as f32).sin() / 7.0)
                        .sum();
                    assert!(
                        (x[i] - want).abs() < 1e-5,
                        "n={n} i={i}: {} vs {want}",
                        x[i]
                    );
                }
                let mut m: Vec<i64> = (0..n).map(|i| ((i + r * 7) % 11) as i64).collect();
                pg.all_reduce(&mut m, ReduceOp::Max)?;
                for i in (0..n).step_by(89) {
                    let want = (0..pg.size())
                        .map(|q| ((i + q * 7) % 11) as i64)
                        .max()
                        .unwrap();
                    assert_eq!(m[i], want, "max n={n} i={i}");
                }
                all.push(x);
            }
            // Rank 0 believes in 10 elements, the others in 12.
            let mut y = vec![1.0f32; if r == 0 { 10 } else { 12 }];
            let err = pg.all_reduce(&mut y, ReduceOp::Sum).unwrap_err();
            let later = pg.barrier().unwrap_err();
            Ok((all, err, later))
        });
        let (first, _, _) = out[0].as_ref().unwrap();
        for (r, o) in out.iter().enumerate() {
            let (all, err, later) = o.as_ref().unwrap();
            assert!(all == first, "world {world}: rank {r} differs from rank 0");
            assert!(
                matches!(err, CommError::Desync(_)),
                "world {world} rank {r}: {err}"
            );
            // The group is failed: later calls fail at once, with this
            // rank's desync or the one a peer that stopped first passed on.
            assert!(
                later == err || later.to_string().contains("collective desync"),
                "world {world} rank {r}: {later}"
            );
        }
    }
}

/// A rank that leaves cleanly (its goodbye read) while a peer waits for it
/// in the in-place all-reduce's barrier, or writes to its full ring, fails
/// that peer at once naming it: waits on shared memory alone would not
/// notice, and ran to the deadline (60 s here).
#[test]
fn a_rank_that_leaves_cleanly_fails_waits_on_shared_memory_at_once() {
    let cfg = Config {
        transport: TransportPref::Shm,
        timeout: Duration::from_secs(60),
        shm_ring_bytes: 64 << 10,
        ..Config::default()
    };
    // Rank 0 starts once rank 1 has shut down: before that, rank 1's
    // reader may still drain its ring, and the send would fit.
    static LEFT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let out = phalanx_comm::threads::run_with(2, cfg, Duration::from_secs(120), |pg| {
        pg.barrier()?;
        if pg.rank() == 1 {
            pg.shutdown();
            LEFT.store(true, std::sync::atomic::Ordering::SeqCst);
            return Ok(None);
        }
        while !LEFT.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let t = std::time::Instant::now();
        // More than the ring holds, so the send waits for rank 1 to read.
        let big = vec![1.0f32; 1 << 18];
        let sent = pg.send(&big, 1, 5).unwrap_err().to_string();
        let reduced = pg.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err();
        Ok(Some((sent, reduced.to_string(), t.elapsed())))
    });
    let (sent, reduced, took) = out.into_iter().next().unwrap().unwrap().unwrap();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(sent.contains("rank 1 ("), "{sent}");
    assert!(reduced.contains("rank 1 ("), "{reduced}");
}
