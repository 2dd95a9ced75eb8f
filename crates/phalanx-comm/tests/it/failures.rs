//! Deadlines, dead peers, aborts, desync detection and bad set-up.

use phalanx_comm::{threads, CommError, Config, ReduceOp};
use std::time::Duration;

fn cfg(timeout_s: f64) -> Config {
    Config {
        timeout: Duration::from_secs_f64(timeout_s),
        ..Config::default()
    }
}

#[test]
fn missing_rank_times_out_with_its_name() {
    // (Deadlines of a few seconds: the set-up runs under the same one, and
    // a loaded machine running other tests must not miss it.)
    let out = threads::run_with(2, cfg(2.0), Duration::from_secs(30), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(6));
            return Ok(String::new());
        }
        // A timeout (2 s), not rank 1's exit 6 s later: the deadline held.
        let err = pg.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err();
        Ok(err.to_string())
    });
    let msg = out[0].as_ref().unwrap();
    assert!(msg.contains("timeout") && msg.contains("rank 1"), "{msg}");
}

/// A collective past its deadline tears the transport down: the collectives
/// queued behind it fail at once instead of each waiting out a deadline of
/// its own (8 buckets, 8 timeouts), and a peer that was not the one late
/// hears why at once too.
#[test]
fn a_timeout_fails_what_is_queued_behind_it_at_once() {
    // The ring over the links (the in-place shared-memory all-reduce of
    // the world group fails its transport on any error already).
    let c = Config {
        shm_all_reduce: false,
        ..cfg(2.0)
    };
    let out = threads::run_with(3, c, Duration::from_secs(60), |pg| {
        pg.barrier()?;
        if pg.rank() == 2 {
            // Alive (its heartbeats go on) but stuck outside the job.
            std::thread::sleep(Duration::from_secs(12));
            return Ok(None);
        }
        let t = std::time::Instant::now();
        let works: Vec<_> = (0..8)
            .map(|_| pg.all_reduce_async(vec![1.0f32; 1 << 16], ReduceOp::Sum))
            .collect();
        let errs: Vec<String> = works
            .into_iter()
            .map(|w| w.wait().unwrap_err().to_string())
            .collect();
        let took = t.elapsed();
        let later = pg.barrier().unwrap_err().to_string();
        Ok(Some((errs, took, later)))
    });
    for (r, o) in out.into_iter().enumerate().take(2) {
        let (errs, took, later) = o.unwrap().unwrap();
        // One deadline (2 s) and the teardown, not 8 (16 s).
        assert!(took < Duration::from_secs(8), "rank {r}: {took:?} {errs:?}");
        assert!(errs[0].contains("timeout"), "rank {r}: {}", errs[0]);
        for e in errs.iter().chain([&later]) {
            assert!(e.contains("past the deadline"), "rank {r}: {e}");
        }
    }
}

/// An abort while another thread of the rank is sending to a peer (a
/// bucket's all-reduce) still reaches that peer with its reason: it waits
/// for the send to let go of the socket instead of skipping the peer,
/// which then heard nothing until its heartbeat deadline.
#[test]
fn abort_during_a_send_still_reaches_that_peer() {
    // The emulated link holds a send's socket for its latency (2 s): the
    // abort lands while the send has it.
    let c = Config {
        transport: phalanx_comm::TransportPref::Tcp,
        net_emulate: Some(phalanx_comm::NetEmulate {
            bandwidth_bps: None,
            latency: Duration::from_secs(2),
        }),
        heartbeat_timeout: Duration::from_secs(30),
        ..cfg(60.0)
    };
    let out = threads::run_with(2, c, Duration::from_secs(90), |pg| {
        pg.barrier()?;
        if pg.rank() == 0 {
            let sender = pg.clone();
            let big = std::thread::spawn(move || {
                let _ = sender.send(&[1.0f32; 64], 1, 7);
            });
            std::thread::sleep(Duration::from_millis(300));
            pg.abort("the loss became NaN");
            big.join().unwrap();
            return Ok(None);
        }
        let t = std::time::Instant::now();
        let far = std::time::Instant::now() + Duration::from_secs(60);
        let Err(e) = pg.recv_bytes(0, 8, far) else {
            panic!("a message where none was sent")
        };
        let e = e.to_string();
        Ok(Some((e, t.elapsed())))
    });
    let (e, took) = out.into_iter().nth(1).unwrap().unwrap().unwrap();
    assert!(
        e.contains("rank 0 (") && e.contains("aborted: the loss became NaN"),
        "{e}"
    );
    // Not the heartbeat deadline (30 s).
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn crashed_rank_fails_everyone_fast_naming_it() {
    let out = threads::run_with(4, cfg(60.0), Duration::from_secs(60), |pg| {
        pg.barrier()?;
        if pg.rank() == 2 {
            // Die in the middle of a large all-reduce the others are in.
            std::thread::sleep(Duration::from_millis(200));
            pg.crash_for_test();
            return Ok(None);
        }
        let mut x = vec![1.0f32; 4_000_000];
        let mut res = Ok(());
        for _ in 0..20 {
            res = pg.all_reduce(&mut x, ReduceOp::Sum);
            if res.is_err() {
                break;
            }
        }
        let err = res.unwrap_err();
        // Later calls fail at once too.
        let again = pg.barrier().unwrap_err();
        Ok(Some((err, again)))
    });
    for (r, o) in out.into_iter().enumerate() {
        if r == 2 {
            continue;
        }
        // A dead peer, not the 60 s timeout: the crash was detected.
        let (err, again) = o.unwrap().unwrap();
        // The dead rank and its host are named, whether this rank saw the
        // crash itself or heard of it from a peer that stopped first.
        let m = err.to_string();
        assert!(m.contains("rank 2 (127.0.0.1:"), "rank {r}: {m}");
        assert!(
            matches!(
                err,
                CommError::PeerDead { rank: 2, .. } | CommError::Aborted(_)
            ),
            "rank {r}: {m}"
        );
        assert_eq!(err, again);
    }
}

#[test]
fn abort_reaches_peers_with_its_reason() {
    let out = threads::run_with(3, cfg(60.0), Duration::from_secs(30), |pg| {
        pg.barrier()?;
        if pg.rank() == 0 {
            pg.abort("loss became NaN");
            return Ok(String::new());
        }
        let err = pg.all_reduce(&mut [0i32; 4], ReduceOp::Sum).unwrap_err();
        Ok(err.to_string())
    });
    for o in &out[1..] {
        let m = o.as_ref().unwrap();
        assert!(m.contains("rank 0") && m.contains("loss became NaN"), "{m}");
    }
}

#[test]
fn desync_is_reported_with_each_ranks_call() {
    let c = Config {
        detail: true,
        timeout: Duration::from_secs(10),
        ..Config::default()
    };
    let out = threads::run_with(2, c, Duration::from_secs(30), |pg| {
        pg.barrier()?;
        let mut x = vec![0f32; 16];
        let err = if pg.rank() == 0 {
            pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err()
        } else {
            pg.broadcast(&mut x[..8], 0).unwrap_err()
        };
        Ok(err)
    });
    for o in out {
        let e = o.unwrap();
        let m = e.to_string();
        assert!(matches!(e, CommError::Desync(_)), "{m}");
        assert!(
            m.contains("rank 0 called all_reduce(f32, count=16, op=sum)"),
            "{m}"
        );
        assert!(
            m.contains("rank 1 called broadcast(f32, count=8, root=0)"),
            "{m}"
        );
    }
}

#[test]
fn size_mismatch_without_detail_is_an_error_not_corruption() {
    let out = threads::run_with(2, cfg(3.0), Duration::from_secs(30), |pg| {
        let n = if pg.rank() == 0 { 10 } else { 12 };
        let mut x = vec![1.0f32; n];
        Ok(pg.all_reduce(&mut x, ReduceOp::Sum).is_err())
    });
    assert!(out.into_iter().all(|r| r.unwrap()));
}

#[test]
fn ranks_that_disagree_on_world_size_are_refused() {
    use phalanx_comm::store::{StoreClient, StoreServer};
    let secret = b"s".to_vec();
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let addr = server.addr().to_string();
    let a = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let b = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let t = std::thread::spawn(move || {
        phalanx_comm::init::from_store(&a, "p", 0, 2, b"s", cfg(20.0), None).err()
    });
    let err = phalanx_comm::init::from_store(&b, "p", 1, 3, b"s", cfg(20.0), None)
        .err()
        .unwrap();
    let other = t.join().unwrap().unwrap();
    // Whichever registered second detects it; the other hears of it at once
    // (waiting out its 20 s timeout would have given a timeout error).
    for e in [&err, &other] {
        assert!(e.to_string().contains("disagree on the world size"), "{e}");
    }
}

#[test]
fn a_rank_that_only_accepts_hears_of_a_set_up_error_at_once() {
    // Rank 0 registers first and waits for rank 1 to connect; rank 1 then
    // finds the world sizes differ and never connects. Rank 0 must not wait
    // out its timeout.
    use phalanx_comm::store::{StoreClient, StoreServer};
    let secret = b"s".to_vec();
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let addr = server.addr().to_string();
    let a = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let b = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let t = std::thread::spawn(move || {
        phalanx_comm::init::from_store(&a, "p", 0, 2, b"s", cfg(20.0), None).err()
    });
    std::thread::sleep(Duration::from_millis(300));
    let err = phalanx_comm::init::from_store(&b, "p", 1, 3, b"s", cfg(20.0), None)
        .err()
        .unwrap();
    let other = t.join().unwrap().unwrap();
    // Not a timeout after 20 s: rank 0 heard of the error.
    for e in [&err, &other] {
        assert!(e.to_string().contains("disagree on the world size"), "{e}");
    }
}

/// Counts whose sum wraps around (`usize::MAX + 2 == 1`) must not pass the
/// size check and then slice out of bounds: each uneven collective, sync
/// and async, gives an Invalid error on the rank that passed them, and the
/// group goes on working afterwards (no panic left a lock poisoned).
#[test]
fn counts_that_wrap_are_invalid_and_the_group_goes_on() {
    let out = threads::run_with(2, cfg(30.0), Duration::from_secs(60), |pg| {
        let mut errs = Vec::new();
        if pg.rank() == 1 {
            let wrap = [usize::MAX, 2];
            // Rank 1's part (2) is right and the counts "sum" to the
            // one-element output.
            let mut one = [0.0f32; 1];
            errs.push(pg.all_gather_v(&[1.0f32; 2], &wrap, &mut one));
            errs.push(pg.reduce_scatter_v(&[1.0f32; 1], &wrap, &mut [0.0; 2], ReduceOp::Sum));
            errs.push(pg.all_to_all_v(&[1.0f32; 1], &wrap, &mut one, &[usize::MAX, 2]));
            errs.push(
                pg.all_gather_async(vec![1.0f32; 2], wrap.to_vec())
                    .wait()
                    .map(|_| ()),
            );
            errs.push(
                pg.all_to_all_v_async(vec![1.0f32; 1], wrap.to_vec(), wrap.to_vec())
                    .wait()
                    .map(|_| ()),
            );
        }
        let errs: Vec<CommError> = errs.into_iter().map(|r| r.unwrap_err()).collect();
        // Both ranks: the next collectives still run.
        let mut x = [pg.rank() as i32 + 1; 3];
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        let mut g = [0i64; 4];
        pg.all_gather_v(&[pg.rank() as i64; 2], &[2, 2], &mut g)?;
        Ok((errs, x, g))
    });
    for (r, o) in out.into_iter().enumerate() {
        let (errs, x, g) = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(x, [3; 3], "rank {r}");
        assert_eq!(g, [0, 0, 1, 1], "rank {r}");
        for e in errs {
            assert!(matches!(e, CommError::Invalid(_)), "rank {r}: {e}");
        }
    }
}

/// Under PHALANX_DEBUG=detail a rank that never calls is found in the
/// signature phase (named as never having called, not as a plain
/// timeout). That must tear the transport down as a timeout does: the
/// collectives queued behind fail at once as aborted instead of each
/// waiting out a deadline of its own and reporting the same thing.
#[test]
fn a_rank_that_never_calls_under_detail_fails_what_is_queued_at_once() {
    let c = Config {
        detail: true,
        shm_all_reduce: false,
        ..cfg(2.0)
    };
    // Rank 1 stays alive (its heartbeats go on) without calling, until
    // rank 0 has its errors.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let done_tx = std::sync::Mutex::new(done_tx);
    let done_rx = std::sync::Mutex::new(done_rx);
    let out = threads::run_with(2, c, Duration::from_secs(60), move |pg| {
        pg.barrier()?;
        if pg.rank() == 1 {
            let _ = done_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
            return Ok(Vec::new());
        }
        let works: Vec<_> = (0..4)
            .map(|_| pg.all_reduce_async(vec![1.0f32; 64], ReduceOp::Sum))
            .collect();
        let errs: Vec<CommError> = works.into_iter().map(|w| w.wait().unwrap_err()).collect();
        let _ = done_tx.lock().unwrap().send(());
        Ok(errs)
    });
    let errs = out.into_iter().next().unwrap().unwrap();
    let first = errs[0].to_string();
    assert!(matches!(errs[0], CommError::Desync(_)), "{first}");
    assert!(
        first.contains("rank 1 never called collective #1"),
        "{first}"
    );
    for e in &errs[1..] {
        // Refused by the torn-down transport, naming the first failure,
        // not a signature phase of its own.
        assert!(matches!(e, CommError::Aborted(_)), "{e}");
        assert!(e.to_string().contains("never called collective #1"), "{e}");
    }
}

/// The counts of one all-to-all-v where rank 0 sends 5 elements to rank 1,
/// which expects none from it (everything else agrees).
fn mismatched_all_to_all(pg: &phalanx_comm::ProcessGroup) -> phalanx_comm::Result<()> {
    let (send, recv) = if pg.rank() == 0 {
        ([1, 5], [1, 2])
    } else {
        ([2, 1], [0, 1])
    };
    let input = vec![pg.rank() as f32; send.iter().sum()];
    let mut out = vec![0f32; recv.iter().sum()];
    pg.all_to_all_v(&input, &send, &mut out, &recv)
}

/// Without detail, the rank that expected nothing from rank 0 but was sent
/// 5 elements says so (the data used to be dropped in silence, the frame
/// left in its inbox for good); the group goes on working.
#[test]
fn all_to_all_v_counts_that_disagree_are_an_error_without_detail() {
    let out = threads::run_with(2, cfg(10.0), Duration::from_secs(60), |pg| {
        let r = mismatched_all_to_all(&pg);
        let mut x = [1.0f32; 4];
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok((r, x[0]))
    });
    let o: Vec<_> = out.into_iter().map(|o| o.unwrap()).collect();
    assert!(o[0].0.is_ok(), "{:?}", o[0].0);
    let e = o[1].0.as_ref().unwrap_err();
    assert!(matches!(e, CommError::Desync(_)), "{e}");
    assert!(
        e.to_string().contains("rank 0 sent 20 bytes where 0"),
        "{e}"
    );
    assert!(o.iter().all(|x| x.1 == 2.0));
}

/// Under detail, every rank fails before any data moves, naming the pair
/// and both counts.
#[test]
fn all_to_all_v_counts_that_disagree_are_a_desync_under_detail() {
    let c = Config {
        detail: true,
        ..cfg(10.0)
    };
    let out = threads::run_with(2, c, Duration::from_secs(60), |pg| {
        Ok(mismatched_all_to_all(&pg).unwrap_err())
    });
    for o in out {
        let e = o.unwrap();
        let m = e.to_string();
        assert!(matches!(e, CommError::Desync(_)), "{m}");
        assert!(
            m.contains("rank 0 sends 5 elements to rank 1, which expects 0 from it"),
            "{m}"
        );
    }
}

/// Under detail, ranks that ask `new_group` for different members fail on
/// every rank, naming each rank's call, instead of forming groups that
/// disagree on who is in them.
#[test]
fn new_group_with_different_members_is_a_desync_under_detail() {
    let c = Config {
        detail: true,
        ..cfg(10.0)
    };
    let out = threads::run_with(3, c, Duration::from_secs(60), |pg| {
        let ranks: &[usize] = if pg.rank() == 1 { &[1, 2] } else { &[0, 1] };
        Ok(pg.new_group(ranks).map(|g| g.is_some()))
    });
    for o in out {
        let e = o.unwrap().unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, CommError::Desync(_)), "{m}");
        assert!(
            m.contains("rank 1 called new_group(i64, count=2, digest="),
            "{m}"
        );
    }
}

/// The asynchronous variants check the counts before they allocate the
/// output: a count no input holds is an invalid argument, not an abort of
/// the process for lack of memory.
#[test]
fn async_counts_are_checked_before_the_output_is_allocated() {
    let out = threads::run_with(1, cfg(10.0), Duration::from_secs(60), |pg| {
        let huge = vec![1usize << 45];
        let errs = vec![
            pg.all_gather_async(vec![1.0f32; 4], huge.clone())
                .wait()
                .map(|_| ()),
            pg.all_gather_into_async(vec![1.0f32; 4], huge.clone(), Vec::new(), drop)
                .wait()
                .map(|_| ()),
            pg.reduce_scatter_async(vec![1.0f32; 4], huge.clone(), ReduceOp::Sum)
                .wait()
                .map(|_| ()),
            pg.reduce_scatter_into_async(vec![1.0f32; 4], huge, ReduceOp::Sum, Vec::new(), drop)
                .wait()
                .map(|_| ()),
            pg.all_to_all_v_async(vec![1.0f32; 1], vec![1], vec![usize::MAX / 2])
                .wait()
                .map(|_| ()),
        ];
        Ok(errs)
    });
    for e in out.into_iter().next().unwrap().unwrap() {
        let e = e.unwrap_err();
        assert!(matches!(e, CommError::Invalid(_)), "{e}");
    }
}

/// After `shutdown`, a call on this rank fails at once saying so: a send
/// is not written into a ring nobody reads, and a wait does not run out
/// its deadline blaming a healthy peer.
#[test]
fn calls_after_shutdown_fail_at_once_saying_so() {
    for transport in [
        phalanx_comm::TransportPref::Shm,
        phalanx_comm::TransportPref::Tcp,
    ] {
        let c = Config {
            transport,
            ..cfg(20.0)
        };
        let out = threads::run_with(2, c, Duration::from_secs(60), |pg| {
            pg.barrier()?;
            if pg.rank() == 1 {
                // Rank 1 stays alive until rank 0 is done.
                std::thread::sleep(Duration::from_secs(2));
                return Ok(vec![]);
            }
            // A receive waiting on another thread when the group shuts
            // down ends then too (not at its deadline, blaming rank 1).
            let other = pg.clone();
            let waiting = std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                let r = other.recv(&mut [0.0f32; 4], 1, 77);
                (r, t0.elapsed())
            });
            std::thread::sleep(Duration::from_millis(300));
            pg.shutdown();
            let t0 = std::time::Instant::now();
            let mut x = [1.0f32; 4];
            let mut errs = vec![
                pg.send(&x, 1, 5),
                pg.recv(&mut x, 1, 5),
                pg.all_reduce(&mut x, ReduceOp::Sum),
                pg.new_group(&[0, 1]).map(|_| ()),
            ];
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            let (r, waited) = waiting.join().unwrap();
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            errs.push(r);
            Ok(errs)
        });
        let errs = out.into_iter().next().unwrap().unwrap();
        assert_eq!(errs.len(), 5);
        for e in errs {
            let m = e.unwrap_err().to_string();
            assert!(m.contains("shut down on this rank"), "{transport:?}: {m}");
        }
    }
}

/// Under detail, a barrier on one rank and a one-word all-reduce on the
/// other are told apart.
#[test]
fn a_barrier_against_an_all_reduce_is_a_desync_under_detail() {
    let c = Config {
        detail: true,
        timeout: Duration::from_secs(10),
        ..Config::default()
    };
    let out = threads::run_with(2, c, Duration::from_secs(30), |pg| {
        Ok(if pg.rank() == 0 {
            pg.barrier()
        } else {
            pg.all_reduce(&mut [1i32], ReduceOp::Sum)
        })
    });
    for o in out {
        let e = o.unwrap().unwrap_err();
        assert!(matches!(e, CommError::Desync(_)), "{e}");
        assert!(e.to_string().contains("rank 0 called barrier"), "{e}");
    }
}

/// A blocking `recv` takes its message after the `recv_async`s of the same
/// source and tag posted before it: messages are taken in issue order.
#[test]
fn a_recv_after_a_recv_async_of_the_same_tag_gets_the_later_message() {
    let out = threads::run_with(2, cfg(20.0), Duration::from_secs(120), |pg| {
        let mut got = Vec::new();
        for round in 0..30u64 {
            if pg.rank() == 1 {
                pg.send(&[1i32], 0, round)?;
                pg.send(&[2i32], 0, round)?;
            } else {
                let w = pg.recv_async(vec![0i32; 1], 1, round);
                let mut b = [0i32];
                pg.recv(&mut b, 1, round)?;
                got.push((w.wait()?[0], b[0]));
            }
        }
        Ok(got)
    });
    for (a, b) in out.into_iter().next().unwrap().unwrap() {
        assert_eq!((a, b), (1, 2));
    }
}
