//! Per-step fault tolerance across replica groups, with groups as processes
//! on one host (`phalanx lighthouse` and `phalanx _ft-worker`, a replica
//! group of one process training a toy model through the lighthouse): a
//! group killed mid-run while the other trains on (the survivor never
//! restarts, commits every step exactly once, and its step count keeps
//! rising); the killed group restarted heals from the survivor and ends
//! with bitwise the same parameters; a group silenced with SIGSTOP is
//! dropped after the heartbeat timeout; below `--min-replicas` a group waits
//! and then fails naming why. And `phalanx train` itself as replica groups
//! (`[fault_tolerance]`): a killed group does not stop the other, and heals
//! from it when started again, ending with byte-identical weights.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(120);
const SECRET: &str = "5a5b5c5d5e5f606162636465666768695a5b5c5d5e5f60616263646566676869";

struct Proc {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Proc {
    fn start(d: &Path, name: &str, args: &[&str]) -> Proc {
        let (out, err) = (d.join(format!("{name}.out")), d.join(format!("{name}.err")));
        let child = Command::new(BIN)
            .args(args)
            .env("PHALANX_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        Proc { child, out, err }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn output(&self) -> String {
        format!(
            "--- stdout\n{}--- stderr\n{}",
            self.stdout(),
            std::fs::read_to_string(&self.err).unwrap_or_default()
        )
    }

    /// Wait until stdout holds `what`.
    fn wait_for(&mut self, what: &str) {
        let t0 = Instant::now();
        while !self.stdout().contains(what) {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "exited before {what:?}:\n{}",
                self.output()
            );
            assert!(t0.elapsed() < DEADLINE, "no {what:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait(&mut self) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().unwrap_or(-1);
            }
            assert!(t0.elapsed() < DEADLINE, "hung:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the test's own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// A lighthouse on a free port (1 s heartbeat timeout); its address.
fn lighthouse(d: &Path, min: &str) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut lh = Proc::start(
        d,
        "lighthouse",
        &[
            "lighthouse",
            "--bind",
            &addr,
            "--min-replicas",
            min,
            "--heartbeat-timeout",
            "1",
            "--join-timeout",
            "0.3",
        ],
    );
    lh.wait_for("phalanx lighthouse at");
    (lh, addr)
}

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
    b.signal(libc::SIGKILL);
    let _ = b.wait();
    // The survivor goes on alone, then the restarted group joins and heals.
    a.wait_for("committed by 1 group(s)");
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

/// `phalanx train` as replica groups of one rank: group 1 is killed
/// mid-run and started again; group 0 never restarts and logs every step
/// once; group 1 heals from group 0 (no checkpoint: checkpoints are off)
/// and both end with byte-identical final weights.
#[test]
fn phalanx_train_groups_survive_a_lost_group_and_heal_it() {
    let d = fresh_dir("phalanx-ft", "train");
    let (_lh, addr) = lighthouse(&d, "1");
    let train = |g: usize, log: &str, out: &str| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--nproc-per-node", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(train_args(&d.join(log), 60));
        for kv in [
            format!("fault_tolerance.lighthouse=\"{addr}\""),
            format!("fault_tolerance.replica_id={g}"),
            "fault_tolerance.replicas=2".into(),
            "fault_tolerance.heartbeat_timeout=1".into(),
            "checkpoint.interval=20".into(),
            format!("checkpoint.dir=\"{}\"", d.join("ckpt").display()),
        ] {
            a.extend(["--set".to_string(), kv]);
        }
        a.extend([
            "--save-final".to_string(),
            d.join(out).display().to_string(),
        ]);
        a
    };
    let strs = |v: &[String]| -> Vec<String> { v.to_vec() };
    let a_args = strs(&train(0, "a.jsonl", "a-final.safetensors"));
    let b_args = strs(&train(1, "b.jsonl", "b-final.safetensors"));
    let slow = |p: &mut Command| {
        p.env("PHALANX_FAULT", "slow:0:60");
    };
    let start = |name: &str, args: &[String]| {
        let (out, err) = (d.join(format!("{name}.out")), d.join(format!("{name}.err")));
        let mut c = Command::new(BIN);
        c.current_dir(repo())
            .args(args)
            .env("PHALANX_SECRET", SECRET)
            .env_remove("RANK")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap());
        slow(&mut c);
        Proc {
            child: c.spawn().unwrap(),
            out,
            err,
        }
    };
    let mut a = start("a", &a_args);
    let mut b = start("b", &b_args);
    b.wait_for(" of 2 group(s) [0, 1]");
    a.wait_for("step    11/60");
    b.signal(libc::SIGKILL);
    let _ = b.wait();
    a.wait_for("of 1 group(s) [0]");
    let mut b2 = start("b2", &b_args);
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(b2.wait(), 0, "{}", b2.output());
    let (oa, ob) = (a.stdout(), b2.stdout());
    // Group 0 trained once, through every step.
    assert_eq!(oa.matches("training ").count(), 1, "{oa}");
    let steps: Vec<u64> = losses(&d.join("a.jsonl")).iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..60).collect::<Vec<_>>(), "{oa}");
    // Every step says how many groups' samples it committed: 2, then 1
    // while group 1 was away, then 2 again.
    let groups: Vec<u64> = std::fs::read_to_string(d.join("a.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["groups_committed"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let mut runs = groups.clone();
    runs.dedup();
    assert!(runs.ends_with(&[2, 1, 2]), "{groups:?}");
    assert!(ob.contains("healed from group 0 at step "), "{ob}");
    let wa = std::fs::read(d.join("a-final.safetensors")).unwrap();
    let wb = std::fs::read(d.join("b-final.safetensors")).unwrap();
    assert!(wa == wb, "the healed group's final weights differ");
    // Each group keeps its own checkpoints under checkpoint.dir.
    for g in 0..2 {
        let dir = d.join(format!("ckpt/replica-{g}/step-00000060"));
        assert!(dir.join("metadata.json").is_file(), "{}", dir.display());
    }
    let _ = std::fs::remove_dir_all(&d);
}
