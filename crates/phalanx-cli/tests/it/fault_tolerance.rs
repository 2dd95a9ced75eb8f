//! Per-step fault tolerance across replica groups, with groups as processes
//! on one host (`phalanx lighthouse` and `phalanx _ft-worker`, a replica
//! group of one process training a toy model through the lighthouse): a
//! group killed mid-run while the other trains on (the survivor never
//! restarts, commits every step exactly once, and its step count keeps
//! rising); the killed group restarted heals from the survivor and ends
//! with bitwise the same parameters; a group silenced with SIGSTOP is
//! dropped after the heartbeat timeout; below `--min-replicas` a group waits
//! and then fails naming why. `phalanx train` as replica groups is in
//! `ft_train.rs`.

use crate::common;
use common::ft::*;
use common::*;

use std::path::Path;
use std::process::Command;

fn group(d: &Path, name: &str, addr: &str, extra: &[&str]) -> Proc {
    let mut a = vec![
        "_ft-worker",
        "--lighthouse",
        addr,
        "--replica-id",
        name,
        "--heartbeat-timeout",
        "1",
    ];
    a.extend_from_slice(extra);
    Proc::start(d, name, &a)
}

/// (step, groups, digest) of every committed step a group printed.
fn committed(out: &str) -> Vec<(u64, usize, String)> {
    out.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (
                w[1].parse().unwrap(),
                w[4].parse().unwrap(),
                w[9].to_string(),
            )
        })
        .collect()
}

fn final_digest(out: &str) -> String {
    let l = out
        .lines()
        .find(|l| l.starts_with("done: "))
        .unwrap_or_else(|| panic!("not done:\n{out}"));
    l.rsplit(' ').next().unwrap().to_string()
}

#[test]
fn a_killed_group_does_not_stop_the_other_and_heals_when_it_returns() {
    let d = fresh_dir("phalanx-ft", "kill");
    let (_lh, addr) = lighthouse(&d, "1");
    let steps = ["--steps", "160"];
    let mut a = group(&d, "a", &addr, &steps);
    let mut b = group(&d, "b", &addr, &steps);
    b.wait_for("committed by 2 group(s)");
    a.wait_for("step 30 committed");
    // (a may have committed steps alone before b's first quorum: the wait
    // below is for one after the kill.)
    let seen = a.stdout().matches("committed by 1 group(s)").count();
    b.signal(libc::SIGKILL);
    let _ = b.wait();
    // The survivor goes on alone, then the restarted group joins and heals.
    a.wait_for_more("committed by 1 group(s)", seen);
    let lost_at = committed(&a.stdout()).last().unwrap().0;
    let mut b2 = group(&d, "b", &addr, &steps);
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(b2.wait(), 0, "{}", b2.output());
    let (oa, ob) = (a.stdout(), b2.stdout());

    // The survivor never restarted: one process committed every step once,
    // in order: with 2 groups, then 1, then 2 again.
    let ca = committed(&oa);
    let steps_a: Vec<u64> = ca.iter().map(|c| c.0).collect();
    assert_eq!(steps_a, (1..=160).collect::<Vec<_>>(), "{oa}");
    let sizes: Vec<usize> = ca.iter().map(|c| c.1).collect();
    let mut runs = sizes.clone();
    runs.dedup();
    // (a may have trained a few steps alone before b's first quorum)
    assert!(runs.ends_with(&[2, 1, 2]), "{runs:?}\n{oa}");
    assert!(lost_at >= 30);

    // The restarted group healed from the survivor at a step boundary and
    // from then on holds bitwise the same parameters at every step.
    assert!(
        ob.contains("healed at step ") && ob.contains(" from a (was at step 0)"),
        "{ob}"
    );
    let cb = committed(&ob);
    assert!(!cb.is_empty() && cb[0].0 > lost_at, "{ob}");
    for s in &cb {
        let twin = ca.iter().find(|c| c.0 == s.0).unwrap();
        assert_eq!(&s.2, &twin.2, "step {}: digests differ", s.0);
        assert_eq!(s.1, 2);
    }
    assert_eq!(final_digest(&oa), final_digest(&ob));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_silent_group_is_dropped_after_the_heartbeat_timeout() {
    let d = fresh_dir("phalanx-ft", "stop");
    let (_lh, addr) = lighthouse(&d, "1");
    let mut a = group(&d, "a", &addr, &["--steps", "120"]);
    let mut b = group(&d, "b", &addr, &["--steps", "120"]);
    b.wait_for("committed by 2 group(s)");
    a.wait_for("step 20 committed");
    b.signal(libc::SIGSTOP);
    assert_eq!(a.wait(), 0, "{}", a.output());
    b.signal(libc::SIGKILL);
    let oa = a.stdout();
    let ca = committed(&oa);
    assert_eq!(
        ca.iter().map(|c| c.0).collect::<Vec<_>>(),
        (1..=120).collect::<Vec<_>>()
    );
    assert_eq!(ca.last().unwrap().1, 1, "{oa}");
    // The step in flight when b went silent failed and was retried.
    assert!(
        std::fs::read_to_string(&a.err)
            .unwrap()
            .contains("retrying with the next quorum"),
        "{}",
        a.output()
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn below_min_replicas_a_group_waits_then_fails_naming_why() {
    let d = fresh_dir("phalanx-ft", "min");
    let (_lh, addr) = lighthouse(&d, "2");
    let mut a = group(&d, "a", &addr, &["--steps", "5", "--quorum-timeout", "2"]);
    assert_eq!(a.wait(), 1, "{}", a.output());
    let out = a.output();
    assert!(
        out.contains("no quorum within 2s")
            && out.contains("1 replica group(s) alive (a), fewer than --min-replicas 2"),
        "{out}"
    );
    assert!(committed(&out).is_empty());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_lighthouse_needs_the_secret() {
    let (code, _, err) = {
        let o = Command::new(BIN)
            .args(["lighthouse", "--bind", "127.0.0.1:0"])
            .env_remove("PHALANX_SECRET")
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("PHALANX_SECRET"), "{err}");
}

/// A lighthouse stopped and continued (Ctrl-Z and `fg`, a debugger) keeps
/// its connections: its idle reads end in EINTR then, which used to drop
/// every connection, and with it every replica group.
#[test]
fn a_lighthouse_stopped_and_continued_keeps_its_connections() {
    use phalanx_comm::store::StoreClient;
    use std::time::Duration;
    let d = fresh_dir("phalanx-ft", "sigstop");
    let (lh, addr) = lighthouse(&d, "1");
    let secret = phalanx_comm::wire::from_hex(SECRET).unwrap();
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(10)).unwrap();
    c.set("k", b"v").unwrap();
    lh.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(600));
    lh.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(c.get("k").unwrap(), b"v");
    let said = lh.output();
    assert!(!said.contains("dropped connection"), "{said}");
}

/// A lighthouse killed and restarted at its address: the groups go on
/// training meanwhile, join the new one, and end with the same parameters;
/// every step is committed once, in order (a restart used to end every
/// group).
#[test]
fn a_restarted_lighthouse_is_joined_again() {
    let d = fresh_dir("phalanx-ft", "lh-restart");
    let (mut lh, addr) = lighthouse(&d, "1");
    let steps = ["--steps", "160"];
    let mut a = group(&d, "a", &addr, &steps);
    let mut b = group(&d, "b", &addr, &steps);
    b.wait_for("committed by 2 group(s)");
    a.wait_for("step 30 committed");
    lh.signal(libc::SIGKILL);
    let _ = lh.wait();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _lh2 = lighthouse_at(&d, "lighthouse2", &addr, "1", "0.3");
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(b.wait(), 0, "{}", b.output());
    let (oa, ob) = (a.stdout(), b.stdout());
    for o in [&oa, &ob] {
        let steps: Vec<u64> = committed(o).iter().map(|c| c.0).collect();
        assert_eq!(steps, (1..=160).collect::<Vec<_>>(), "{o}");
        assert_eq!(committed(o).last().unwrap().1, 2, "together again: {o}");
    }
    assert!(
        std::fs::read_to_string(&a.err)
            .unwrap()
            .contains("restarted (it knows no groups): joined it again"),
        "{}",
        a.output()
    );
    // Meanwhile it went on with the quorum it had.
    assert!(
        std::fs::read_to_string(&a.err)
            .unwrap()
            .contains("does not answer"),
        "{}",
        a.output()
    );
    assert_eq!(final_digest(&oa), final_digest(&ob));
}

/// A lighthouse stopped for longer than its heartbeat timeout and then
/// continued judges the groups' silence from when it runs again: none is
/// dropped (its clock used to count its own pause against them), and both
/// groups commit every step once, together at the end.
#[test]
fn a_lighthouse_paused_past_its_heartbeat_timeout_drops_no_group() {
    let d = fresh_dir("phalanx-ft", "lh-pause");
    let (lh, addr) = lighthouse(&d, "1");
    let steps = ["--steps", "160"];
    let mut a = group(&d, "a", &addr, &steps);
    let mut b = group(&d, "b", &addr, &steps);
    b.wait_for("committed by 2 group(s)");
    a.wait_for("step 30 committed");
    lh.signal(libc::SIGSTOP);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    lh.signal(libc::SIGCONT);
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(b.wait(), 0, "{}", b.output());
    for p in [&a, &b] {
        let o = p.stdout();
        let steps: Vec<u64> = committed(&o).iter().map(|c| c.0).collect();
        assert_eq!(steps, (1..=160).collect::<Vec<_>>(), "{o}");
        assert!(
            !p.output().contains("dropped from the quorum"),
            "{}",
            p.output()
        );
    }
    assert!(lh.output().contains("was it stopped?"), "{}", lh.output());
}
