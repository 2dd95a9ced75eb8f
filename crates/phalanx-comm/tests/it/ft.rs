//! The lighthouse and its replica groups (`phalanx_comm::ft`), groups as
//! threads of one process: a group that heartbeats but never comes to a
//! quorum (hung) is dropped and told so, instead of the others
//! reconnecting to it forever; two groups with one replica id are named; a
//! lighthouse with a shorter heartbeat timeout than its groups' keeps them;
//! a join slot its group never wrote does not block later joins; a group
//! whose first heal failed still takes the healer's state next time; a
//! group that stops leaves at once.

use phalanx_comm::ft::{Lighthouse, LighthouseOpts, Manager, ManagerOpts};
use phalanx_comm::store::StoreClient;
use std::sync::mpsc;
use std::time::Duration;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

fn lighthouse(heartbeat: f64) -> Lighthouse {
    Lighthouse::start(
        "127.0.0.1:0",
        SECRET.to_vec(),
        LighthouseOpts {
            min_replicas: 1,
            join_timeout: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_secs_f64(heartbeat),
        },
    )
    .unwrap()
}

fn opts(heartbeat: f64) -> ManagerOpts {
    ManagerOpts {
        quorum_timeout: Duration::from_secs(30),
        heartbeat_timeout: Duration::from_secs_f64(heartbeat),
        sync_timeout: Some(Duration::from_secs(1)),
        ..ManagerOpts::default()
    }
}

/// Wait for a quorum of `n` groups.
fn quorum_of(m: &mut Manager, n: usize) {
    loop {
        let q = m.quorum(0).unwrap();
        if q.size == n {
            return;
        }
        m.wait_change().unwrap();
    }
}

#[test]
fn a_hung_group_is_dropped_and_told_so() {
    let lh = lighthouse(1.0);
    let addr = lh.addr().to_string();
    let (wake_tx, wake_rx) = mpsc::channel::<()>();
    let hung = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut m = Manager::connect(&addr, SECRET, "c", opts(1.0)).unwrap();
            quorum_of(&mut m, 3);
            let mut g = vec![1.0f32];
            assert!(m.all_reduce(&mut g).unwrap());
            // Hung: the heartbeats go on, the group never comes back to
            // a quorum until woken.
            wake_rx.recv().unwrap();
            m.quorum(1).unwrap_err().to_string()
        })
    };
    let healthy: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|id| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut m = Manager::connect(&addr, SECRET, id, opts(1.0)).unwrap();
                quorum_of(&mut m, 3);
                let mut g = vec![1.0f32];
                assert!(m.all_reduce(&mut g).unwrap());
                // Step 1 without c: retried with each new quorum until c
                // is dropped and the two of them commit it.
                let mut tries = 0;
                loop {
                    tries += 1;
                    assert!(tries < 20, "{id}: step 1 never committed");
                    let q = m.quorum(1).unwrap();
                    let mut g = vec![if id == "a" { 1.0f32 } else { 3.0 }];
                    if m.all_reduce(&mut g).unwrap() {
                        return (q.size, g[0]);
                    }
                }
            })
        })
        .collect();
    for h in healthy {
        assert_eq!(h.join().unwrap(), (2, 2.0));
    }
    wake_tx.send(()).unwrap();
    let err = hung.join().unwrap();
    assert!(
        err.contains("replica group c: dropped from the quorum"),
        "{err}"
    );
}

#[test]
fn a_second_group_with_the_same_replica_id_is_named() {
    let lh = lighthouse(5.0);
    let addr = lh.addr().to_string();
    let mut first = Manager::connect(&addr, SECRET, "a", opts(5.0)).unwrap();
    quorum_of(&mut first, 1);
    let mut second = Manager::connect(&addr, SECRET, "a", opts(5.0)).unwrap();
    quorum_of(&mut second, 1);
    let err = first.quorum(1).unwrap_err().to_string();
    assert!(
        err.contains("joined again as incarnation 1") && err.contains("replica_id"),
        "{err}"
    );
}

#[test]
fn groups_beat_within_the_lighthouses_shorter_timeout() {
    // Groups set for 10 s would beat every 2 s; the lighthouse drops a
    // group silent for 1 s.
    let lh = lighthouse(1.0);
    let addr = lh.addr().to_string();
    let t: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|id| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut m = Manager::connect(&addr, SECRET, id, opts(10.0)).unwrap();
                quorum_of(&mut m, 2);
                std::thread::sleep(Duration::from_millis(2500));
                let q = m.quorum(1).unwrap();
                (q.size, q.changed)
            })
        })
        .collect();
    for h in t {
        assert_eq!(h.join().unwrap(), (2, false));
    }
}

#[test]
fn a_join_its_group_never_wrote_does_not_block_later_joins() {
    let lh = lighthouse(0.5);
    let addr = lh.addr().to_string();
    // A joiner that stopped between counting its join and writing it.
    let raw = StoreClient::connect(&addr, SECRET, Duration::from_secs(10)).unwrap();
    raw.add("ft/joins", 1).unwrap();
    let mut m = Manager::connect(&addr, SECRET, "a", opts(0.5)).unwrap();
    let q = m.quorum(0).unwrap();
    assert_eq!((q.size, q.members), (1, vec!["a".to_string()]));
    // The skipped slot written late (and heartbeating): that group joins
    // after all, as incarnation 0.
    raw.set("ft/join/0", b"z").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        raw.add("ft/hb/z", 1).unwrap();
        let e = raw.try_get("ft/epoch").unwrap().unwrap_or_default();
        let e = String::from_utf8_lossy(&e).into_owned();
        let members = raw
            .try_get(&format!("ft/members/{e}"))
            .unwrap()
            .unwrap_or_default();
        if String::from_utf8_lossy(&members).contains("z@0") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "z never joined");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(m);
}

#[test]
fn a_group_whose_first_heal_failed_is_still_first() {
    let lh = lighthouse(0.5);
    let addr = lh.addr().to_string();
    let (gone_tx, gone_rx) = mpsc::channel::<()>();
    let a = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut m = Manager::connect(&addr, SECRET, "a", opts(0.5)).unwrap();
            quorum_of(&mut m, 2);
            // Lost before the heal.
            m.abort("test: lost before the heal");
            drop(m);
            gone_tx.send(()).unwrap();
        })
    };
    let mut b = Manager::connect(&addr, SECRET, "b", opts(0.5)).unwrap();
    quorum_of(&mut b, 2);
    gone_rx.recv().unwrap();
    a.join().unwrap();
    let mut state = vec![1.0f32; 4];
    assert!(!b.heal(&mut state).unwrap(), "a member was lost");
    // The next quorum (without a): b never completed a heal.
    let q = loop {
        let q = b.quorum(0).unwrap();
        if q.size == 1 {
            break q;
        }
        b.wait_change().unwrap();
    };
    assert!(q.first, "{q:?}");
    // Once a heal completed, the next change is not first.
    b.mark_healed();
    let mut c = Manager::connect(&addr, SECRET, "c", opts(0.5)).unwrap();
    let t = std::thread::spawn(move || {
        quorum_of(&mut c, 2);
        c
    });
    let q = loop {
        let q = b.quorum(0).unwrap();
        if q.size == 2 {
            break q;
        }
        b.wait_change().unwrap();
    };
    assert!(q.changed && !q.first, "{q:?}");
    drop(t.join().unwrap());
}

/// A quorum timeout no longer than the lighthouse's heartbeat timeout
/// plus its join timeout is refused at connect, naming both: after a
/// group's loss the survivors would give up before the next quorum.
#[test]
fn a_quorum_timeout_within_the_lighthouses_timeouts_is_refused() {
    let lh = lighthouse(2.0);
    let addr = lh.addr().to_string();
    let o = ManagerOpts {
        quorum_timeout: Duration::from_secs(2),
        ..opts(2.0)
    };
    let e = Manager::connect(&addr, SECRET, "a", o)
        .err()
        .expect("refused");
    let e = e.to_string();
    assert!(
        e.contains("quorum_timeout = 2s is not above the lighthouse's heartbeat timeout (2s)")
            && e.contains("join timeout (200ms)"),
        "{e}"
    );
    // Above both: accepted.
    let o = ManagerOpts {
        quorum_timeout: Duration::from_secs(3),
        ..opts(2.0)
    };
    assert!(Manager::connect(&addr, SECRET, "a", o).is_ok());
}

/// A group busy for long between quorums (DiLoCo's inner steps) whose
/// steps go on is not dropped when a newcomer finds it absent: the
/// newcomer waits, and the two meet at the busy group's next quorum. (It
/// used to be dropped as hung after two absent epochs, and the group
/// holding the trained state was stopped.)
#[test]
fn a_busy_group_whose_steps_go_on_is_not_dropped_as_hung() {
    let lh = lighthouse(0.5);
    let addr = lh.addr().to_string();
    let fast = |hb: f64| ManagerOpts {
        sync_timeout: Some(Duration::from_millis(300)),
        ..opts(hb)
    };
    let mut a = Manager::connect(&addr, SECRET, "a", fast(0.5)).unwrap();
    quorum_of(&mut a, 1);
    let b = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut m = Manager::connect(&addr, SECRET, "b", fast(0.5)).unwrap();
            let q = m.quorum(0).unwrap();
            let mut g = vec![3.0f32];
            assert!(m.all_reduce(&mut g).unwrap());
            (q.size, g[0])
        })
    };
    // Inner steps, well past two absent epochs (each 0.3 s of waiting plus
    // the 0.5 s heartbeat timeout before the next).
    for step in 0..80u64 {
        a.note_progress(step);
        std::thread::sleep(Duration::from_millis(50));
    }
    let q = a.quorum(80).expect("not dropped");
    assert_eq!(q.size, 2);
    let mut g = vec![1.0f32];
    assert!(a.all_reduce(&mut g).unwrap());
    assert_eq!(g[0], 2.0);
    assert_eq!(b.join().unwrap(), (2, 2.0));
}

/// A group that stops (its manager dropped: its run finished or failed)
/// tells the lighthouse, which drops it at once: the other's next quorum
/// is of one, long before the lighthouse's heartbeat timeout (300 s, past
/// this test's hang guard) would have dropped it.
#[test]
fn a_group_that_stops_leaves_at_once() {
    let lh = lighthouse(300.0);
    let addr = lh.addr().to_string();
    let long = || ManagerOpts {
        quorum_timeout: Duration::from_secs(400),
        ..opts(300.0)
    };
    let (met_tx, met_rx) = mpsc::channel::<()>();
    let b = {
        let (addr, opts) = (addr.clone(), long());
        std::thread::spawn(move || {
            let mut m = Manager::connect(&addr, SECRET, "b", opts).unwrap();
            quorum_of(&mut m, 2);
            // Stops once a has its quorum of two as well.
            met_rx.recv().unwrap();
        })
    };
    let mut a = Manager::connect(&addr, SECRET, "a", long()).unwrap();
    quorum_of(&mut a, 2);
    met_tx.send(()).unwrap();
    b.join().unwrap();
    let raw = StoreClient::connect(&addr, SECRET, Duration::from_secs(10)).unwrap();
    assert!(
        raw.try_get("ft/left/b").unwrap().is_some(),
        "b did not say it left"
    );
    let t0 = std::time::Instant::now();
    quorum_of(&mut a, 1);
    assert!(t0.elapsed() < Duration::from_secs(120), "hang guard");
}
