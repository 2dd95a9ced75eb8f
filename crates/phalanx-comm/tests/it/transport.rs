//! The kind of socket between ranks (Unix domain sockets on one host, TCP
//! when forced) and the collectives over each; receives posted ahead
//! (all-gather) when frames arrive early, late or with the wrong size.

use phalanx_comm::{threads, CommError, Config, Link, ProcessGroup, ReduceOp, TransportPref};
use std::time::Duration;

fn cfg(transport: TransportPref) -> Config {
    Config {
        transport,
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

/// Ring all-reduce, uneven all-gather and chain broadcast, checked exactly.
fn check_collectives(pg: &ProcessGroup) {
    let (r, w) = (pg.rank(), pg.size());
    // Large enough for the ring and several pipeline chunks, not divisible by w.
    let n = (3 << 20) + 5;
    let mut x: Vec<f32> = (0..n).map(|i| ((r + i) % 7) as f32).collect();
    pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    for (i, v) in x.iter().enumerate() {
        let want: usize = (0..w).map(|q| (q + i) % 7).sum();
        assert_eq!(*v, want as f32, "all_reduce i={i}");
    }
    let counts: Vec<usize> = (0..w).map(|q| 200_000 + 17 * q).collect();
    let input: Vec<i64> = (0..counts[r]).map(|i| (r * 1_000_000 + i) as i64).collect();
    let mut out = vec![0i64; counts.iter().sum()];
    pg.all_gather_v(&input, &counts, &mut out).unwrap();
    let mut off = 0;
    for (q, &c) in counts.iter().enumerate() {
        for i in 0..c {
            assert_eq!(out[off + i], (q * 1_000_000 + i) as i64, "all_gather");
        }
        off += c;
    }
    let mut b: Vec<f64> = if r == 1 {
        (0..1_500_001).map(|i| i as f64).collect()
    } else {
        vec![0.0; 1_500_001]
    };
    pg.broadcast(&mut b, 1).unwrap();
    assert!(
        b.iter().enumerate().all(|(i, v)| *v == i as f64),
        "broadcast"
    );
}

fn links(pg: &ProcessGroup) -> Vec<Option<Link>> {
    (0..pg.size()).map(|j| pg.link(j)).collect()
}

#[test]
fn ranks_on_one_host_use_shared_memory_by_default() {
    let out = threads::run_with(4, cfg(TransportPref::Auto), threads::DEADLINE, |pg| {
        check_collectives(&pg);
        Ok(links(&pg))
    });
    for (r, l) in out.into_iter().enumerate() {
        let l = l.unwrap();
        for (j, k) in l.iter().enumerate() {
            let want = if j == r { None } else { Some(Link::Shm) };
            assert_eq!(*k, want, "rank {r} -> rank {j}");
        }
    }
}

#[test]
fn unix_sockets_can_be_chosen() {
    let out = threads::run_with(4, cfg(TransportPref::Uds), threads::DEADLINE, |pg| {
        check_collectives(&pg);
        Ok(links(&pg))
    });
    for (r, l) in out.into_iter().enumerate() {
        let l = l.unwrap();
        for (j, k) in l.iter().enumerate() {
            let want = if j == r { None } else { Some(Link::Unix) };
            assert_eq!(*k, want, "rank {r} -> rank {j}");
        }
    }
}

#[test]
fn tcp_can_be_forced() {
    let out = threads::run_with(3, cfg(TransportPref::Tcp), threads::DEADLINE, |pg| {
        check_collectives(&pg);
        Ok(links(&pg))
    });
    for (r, l) in out.into_iter().enumerate() {
        let l = l.unwrap();
        for (j, k) in l.iter().enumerate() {
            let want = if j == r { None } else { Some(Link::Tcp) };
            assert_eq!(*k, want, "rank {r} -> rank {j}");
        }
    }
}

/// Run by `phalanx_transport_env_forces_tcp` in a child process with
/// PHALANX_TRANSPORT=tcp (so no test changes this process's environment).
#[test]
#[ignore]
fn env_child_expects_tcp() {
    assert_eq!(Config::from_env().transport, TransportPref::Tcp);
    let out = threads::run(2, |pg| (links(&pg), pg.rank()));
    for (l, r) in out {
        assert_eq!(l[1 - r], Some(Link::Tcp));
    }
}

#[test]
fn phalanx_transport_env_forces_tcp() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            test_name!("env_child_expects_tcp").as_str(),
            "--ignored",
            "--nocapture",
        ])
        .env("PHALANX_TRANSPORT", "tcp")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

#[test]
fn all_gather_is_correct_when_chunks_arrive_before_they_are_posted() {
    // Tiny chunks, and ranks that start late: the left neighbour's first
    // chunks wait in the inbox before this rank posts its receives, the
    // later ones land in place.
    let c = Config {
        chunk_bytes: 256,
        ..cfg(TransportPref::Auto)
    };
    let out = threads::run_with(3, c, threads::DEADLINE, |pg| {
        let r = pg.rank();
        for round in 0..6u64 {
            if (round as usize) % 3 == r {
                std::thread::sleep(Duration::from_millis(50));
            }
            let n = 10_007;
            let input: Vec<i64> = (0..n)
                .map(|i| ((r as u64) << 40 | round << 32 | i) as i64)
                .collect();
            let mut out = vec![0i64; 3 * n as usize];
            pg.all_gather(&input, &mut out)?;
            for q in 0..3u64 {
                for i in 0..n {
                    let got = out[(q * n + i) as usize];
                    assert_eq!(got as u64, q << 40 | round << 32 | i, "round {round}");
                }
            }
        }
        Ok(())
    });
    assert!(out.into_iter().all(|r| r.is_ok()));
}

#[test]
fn all_gather_with_mismatched_sizes_is_an_error_not_corruption() {
    let c = Config {
        timeout: Duration::from_secs(3),
        ..cfg(TransportPref::Auto)
    };
    let out = threads::run_with(3, c, Duration::from_secs(60), |pg| {
        // Rank 1 believes rank 0 contributes 5 elements more than it does.
        let mut counts = vec![1000usize, 1000, 1000];
        if pg.rank() == 1 {
            counts[0] = 1005;
        }
        let input = vec![pg.rank() as f32; counts[pg.rank()]];
        let mut out = vec![0f32; counts.iter().sum()];
        Ok(pg.all_gather_v(&input, &counts, &mut out).err())
    });
    let errs: Vec<Option<CommError>> = out.into_iter().map(|r| r.unwrap()).collect();
    let e = errs[1].as_ref().expect("rank 1 must fail");
    assert!(
        matches!(e, CommError::Desync(_) | CommError::Timeout(_)),
        "{e}"
    );
}

#[test]
fn a_crashed_rank_is_named_over_every_transport() {
    for pref in [TransportPref::Auto, TransportPref::Uds, TransportPref::Tcp] {
        // Heartbeats too rare to matter here: only the closed connection
        // can reveal the crash; missing it would end the all-reduce with a
        // timeout after 60 s (the harness waits 180 s for that).
        let c = Config {
            heartbeat_timeout: Duration::from_secs(600),
            ..cfg(pref)
        };
        let out = threads::run_with(3, c, Duration::from_secs(180), |pg| {
            pg.barrier()?;
            if pg.rank() == 1 {
                // Die while the others are in a large all-reduce (both phases).
                std::thread::sleep(Duration::from_millis(100));
                pg.crash_for_test();
                return Ok(None);
            }
            let mut x = vec![1.0f32; 3_000_000];
            let mut res = Ok(());
            for _ in 0..50 {
                res = pg.all_reduce(&mut x, ReduceOp::Sum);
                if res.is_err() {
                    break;
                }
            }
            Ok(Some(res.unwrap_err()))
        });
        for (r, o) in out.into_iter().enumerate() {
            if r == 1 {
                continue;
            }
            let err = o.unwrap().unwrap();
            let m = err.to_string();
            // A dead peer (seen here, or heard of from the other survivor),
            // not a timeout: the crash was detected.
            assert!(
                matches!(
                    err,
                    CommError::PeerDead { rank: 1, .. } | CommError::Aborted(_)
                ),
                "{pref:?} rank {r}: {m}"
            );
            assert!(m.contains("rank 1 (127.0.0.1:"), "{pref:?} rank {r}: {m}");
        }
    }
}
