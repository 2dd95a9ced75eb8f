//! Elastic membership (`phalanx train --nnodes MIN:MAX`), on one host with
//! processes as nodes: a node killed (or stopped: silent) mid-run leaves the other to re-form
//! and finish alone with the losses of a 1-node run resumed from the same
//! checkpoint (global batch kept, accumulation adjusted); a node that joins
//! a running 1:3 job is admitted at a re-formation (the running round
//! stops at a step boundary, with a checkpoint of it); below MIN the
//! rendezvous fails within its timeout saying why; worker failures count
//! against `--max-restarts` and membership changes do not; losing the node
//! that serves the rendezvous store fails the others fast, saying so.

use crate::common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(240);
const SECRET: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// One node: a `phalanx train` agent with its output in files.
struct Node {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Node {
    fn start(d: &Path, name: &str, args: &[String], env: &[(&str, &str)]) -> Node {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).arg("train").args(args);
        Node::spawn(d, name, c, env)
    }

    /// `c` as a node: the job secret, no inherited launcher state, its
    /// output to `d/name.{out,err}`.
    fn spawn(d: &Path, name: &str, mut c: Command, env: &[(&str, &str)]) -> Node {
        let (out, err) = (d.join(format!("{name}.out")), d.join(format!("{name}.err")));
        c.env_remove("RANK")
            .env_remove("PHALANX_FAULT")
            .env_remove("PHALANX_RESTART_COUNT")
            .env_remove("TORCHELASTIC_RESTART_COUNT")
            .env("PHALANX_SECRET", SECRET)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap());
        Node {
            child: c.spawn().unwrap(),
            out,
            err,
        }
    }

    fn output(&self) -> String {
        format!(
            "--- stdout\n{}--- stderr\n{}",
            std::fs::read_to_string(&self.out).unwrap_or_default(),
            std::fs::read_to_string(&self.err).unwrap_or_default()
        )
    }

    /// Wait until the node's stdout holds `what`.
    fn wait_for(&mut self, what: &str) {
        let t0 = Instant::now();
        while !std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .contains(what)
        {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "exited before printing {what:?}:\n{}",
                self.output()
            );
            assert!(t0.elapsed() < DEADLINE, "no {what:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait for the exit (killing the node past the deadline): its code.
    fn wait(&mut self) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().unwrap_or(-1);
            }
            if t0.elapsed() > DEADLINE {
                let _ = self.child.kill();
                panic!("hung past {DEADLINE:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL the agent: its workers die with it (PR_SET_PDEATHSIG).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Flags of an elastic job of 1-process nodes at `nnodes`, checkpointing
/// every 2 of `steps` steps under `d/ckpt`, logging to `d/log.jsonl`.
fn job(d: &Path, nnodes: &str, steps: usize, port: u16, extra: &[&str]) -> Vec<String> {
    let mut a = train_args(&d.join("log.jsonl"), steps);
    let s = |v: &str| v.to_string();
    a.extend([
        s("--set"),
        s("checkpoint.interval=2"),
        s("--set"),
        s("checkpoint.keep=1000"),
        s("--set"),
        format!("checkpoint.dir=\"{}\"", d.join("ckpt").display()),
        s("--nproc-per-node"),
        s("1"),
        s("--nnodes"),
        s(nnodes),
        s("--rdzv-endpoint"),
        format!("127.0.0.1:{port}"),
        s("--rdzv-id"),
        s("elastic-test"),
        s("--rdzv-conf"),
        s("heartbeat_timeout=2,last_call_timeout=1"),
    ]);
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

/// Steps logged so far.
fn logged(d: &Path) -> usize {
    std::fs::read_to_string(d.join("log.jsonl"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn wait_steps(d: &Path, n: usize, node: &Node) {
    let t0 = Instant::now();
    while logged(d) < n {
        assert!(t0.elapsed() < DEADLINE, "no step {n}:\n{}", node.output());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The step a node's last resume started from ("resumed from ... (step K, ...").
fn resumed_at(out: &str) -> u64 {
    let i = out
        .rfind("resumed from ")
        .unwrap_or_else(|| panic!("no resume:\n{out}"));
    let rest = &out[i..];
    let k = rest.find("(step ").unwrap() + 6;
    rest[k..].split(',').next().unwrap().parse().unwrap()
}

#[test]
fn a_lost_node_leaves_the_other_to_finish_alone_from_the_checkpoint() {
    lost_node("killed", Node::kill);
}

/// A node that goes silent (its agent and worker stopped, connections
/// open: a hung host) is lost after the heartbeat timeout just the same.
#[test]
fn a_silent_node_is_lost_after_the_heartbeat_timeout() {
    lost_node("silent", |n: &mut Node| {
        let pid = n.child.id();
        let kids =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        for p in std::iter::once(pid.to_string()).chain(kids.split_whitespace().map(String::from)) {
            // SAFETY: kill(2) on the test's own child and its workers.
            unsafe { libc::kill(p.parse().unwrap(), libc::SIGSTOP) };
        }
    });
}

fn lost_node(name: &str, lose: impl Fn(&mut Node)) {
    let d = fresh_dir("phalanx-elastic", name);
    let port = free_port();
    let mut args = job(&d, "1:2", 24, port, &[]);
    // Round 0 must hold both nodes however late b starts (it closes as
    // soon as the second joins; the round after the loss expects one).
    let n = args.len();
    args[n - 1] = "heartbeat_timeout=2,last_call_timeout=30".into();
    // Slow steps (every attempt), so that the kill lands mid-run.
    let slow = [("PHALANX_FAULT", "slow:0:150")];
    let mut a = Node::start(&d, "a", &args, &slow);
    a.wait_for("(serving it)");
    let mut b = Node::start(&d, "b", &args, &slow);
    wait_steps(&d, 6, &a);
    lose(&mut b);
    assert_eq!(a.wait(), 0, "{}", a.output());
    b.kill();
    let out = a.output();
    assert!(out.contains("round 0 formed with 2 node(s)"), "{out}");
    assert!(out.contains("lost: no heartbeat for 2s"), "{out}");
    assert!(out.contains("round 1 formed with 1 node(s)"), "{out}");
    // 2 ranks x micro-batch 4 before; one rank keeps the global batch of 8.
    assert!(
        out.contains(
            "elastic: keeping the global batch of 8 on dp 1: micro-batch 4 x grad_accum 2"
        ),
        "{out}"
    );
    assert!(out.contains("done: "), "{out}");
    let k = resumed_at(&out);
    assert!((2..24).contains(&k), "{out}");

    // A 1-node run resumed from that checkpoint gives the same losses.
    let ref_log = d.join("ref.jsonl");
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .arg("train")
        .args(train_args(&ref_log, 24))
        .args(["--nproc-per-node", "1", "--resume"])
        .arg(d.join(format!("ckpt/step-{k:08}")))
        .args([
            "--set",
            &format!("checkpoint.dir=\"{}\"", d.join("ref-ckpt").display()),
        ])
        .env_remove("RANK")
        .env("PHALANX_ELASTIC", "1");
    let r = run_until(c, DEADLINE);
    assert_eq!(r.code, 0, "{r}");
    let want = losses(&ref_log);
    let got: Vec<_> = losses(&d.join("log.jsonl"))
        .into_iter()
        .filter(|l| l.0 >= k)
        .collect();
    assert_eq!(want.len(), 24 - k as usize);
    assert_eq!(got, want, "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_node_that_joins_a_running_job_is_admitted() {
    let d = fresh_dir("phalanx-elastic", "join");
    let port = free_port();
    let args = job(&d, "1:3", 30, port, &[]);
    let slow = [("PHALANX_FAULT", "slow:0:100")];
    let mut a = Node::start(&d, "a", &args, &slow);
    a.wait_for("round 0 formed with 1 node(s)");
    wait_steps(&d, 4, &a);
    let mut c = Node::start(&d, "c", &args, &slow);
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(c.wait(), 0, "{}", c.output());
    let (oa, oc) = (a.output(), c.output());
    assert!(
        oa.contains("1 node(s) asked to join: admitting them"),
        "{oa}"
    );
    assert!(oa.contains("round 1 formed with 2 node(s)"), "{oa}");
    assert!(
        oc.contains("waiting to be admitted at the next round"),
        "{oc}"
    );
    assert!(oc.contains("round 1 formed with 2 node(s)"), "{oc}");
    // Rank 0 (which logs) is on whichever node joined round 1 first.
    let both = format!("{oa}{oc}");
    // The admission stopped the running round at a step boundary with a
    // checkpoint of it: the new round resumes there, no step is lost.
    let i = oa.find("stopping after step ").expect("a graceful stop");
    let stopped: u64 = oa[i + 20..].split(' ').next().unwrap().parse().unwrap();
    assert!(oa.contains("as asked (checkpoint of it saved)"), "{oa}");
    assert_eq!(resumed_at(&both), stopped, "{both}");
    // One rank's global batch of 4 on two ranks: micro-batch 2.
    assert!(
        both.contains("keeping the global batch of 4 on dp 2: micro-batch 2 x grad_accum 1"),
        "{both}"
    );
    let steps: Vec<u64> = losses(&d.join("log.jsonl")).iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..30).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn below_the_minimum_the_rendezvous_fails_saying_why() {
    let d = fresh_dir("phalanx-elastic", "min");
    let args = job(&d, "2:3", 4, free_port(), &["--rdzv-timeout", "2"]);
    let mut a = Node::start(&d, "a", &args, &[]);
    let code = a.wait();
    let out = a.output();
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("only 1 of the --nnodes minimum 2 node(s) joined within 2s"),
        "{out}"
    );
    assert_eq!(logged(&d), 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn worker_failures_count_against_max_restarts() {
    for (restarts, want) in [("0", 137), ("1", 0)] {
        let d = fresh_dir("phalanx-elastic", &format!("fail-{restarts}"));
        let args = job(&d, "1:2", 8, free_port(), &["--max-restarts", restarts]);
        let mut a = Node::start(&d, "a", &args, &[("PHALANX_FAULT", "exit-at-step:0:3")]);
        assert_eq!(a.wait(), want, "{}", a.output());
        let out = a.output();
        if want == 0 {
            assert!(out.contains("restarting (restart 1 of 1)"), "{out}");
            assert!(out.contains("round 1 formed with 1 node(s)"), "{out}");
        } else {
            assert!(out.contains("more than --max-restarts 0"), "{out}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Past --max-restarts on the node that serves the store, the other node
/// is told so (the job failed, more than --max-restarts), not that the
/// store was lost: the serving agent serves until it has left.
#[test]
fn a_serving_agent_past_max_restarts_lets_the_others_hear_it() {
    let d = fresh_dir("phalanx-elastic", "serving-fails");
    let port = free_port();
    let node = |name: &str| {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).args([
            "run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            &format!("127.0.0.1:{port}"),
            "--rdzv-id",
            "serving-fails",
            "--rdzv-conf",
            "heartbeat_timeout=3,last_call_timeout=1",
            "--max-restarts",
            "1",
            "--",
            "sh",
            "-c",
            // Rank 1 fails every round, on whichever node it is.
            "sleep 1; [ \"$RANK\" = 1 ] && exit 3; sleep 20",
        ]);
        Node::spawn(&d, name, c, &[])
    };
    let mut a = node("a");
    a.wait_for("(serving it)");
    let mut b = node("b");
    let (ca, cb) = (a.wait(), b.wait());
    let all = format!("{}\n{}", a.output(), b.output());
    assert!(ca != 0 && cb != 0, "{all}");
    assert!(
        all.matches("more than --max-restarts 1").count() == 2,
        "both nodes name the limit: {all}"
    );
    assert!(!all.contains("lost the rendezvous store"), "{all}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn losing_the_node_that_serves_the_store_fails_the_others_fast() {
    let d = fresh_dir("phalanx-elastic", "host");
    let port = free_port();
    // A long heartbeat timeout: the failure must come from the lost store,
    // well before a lost heartbeat could be noticed.
    let mut args = job(&d, "1:2", 40, port, &[]);
    let n = args.len();
    args[n - 1] = "heartbeat_timeout=100,last_call_timeout=1".into();
    let slow = [("PHALANX_FAULT", "slow:0:100")];
    let mut a = Node::start(&d, "a", &args, &slow);
    a.wait_for("(serving it)");
    let mut b = Node::start(&d, "b", &args, &slow);
    wait_steps(&d, 3, &a);
    a.kill();
    let code = b.wait();
    let out = b.output();
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("lost the rendezvous store at 127.0.0.1:"),
        "{out}"
    );
    assert!(out.contains("single point of failure"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

/// SIGTERM (the scheduler's stop, or Ctrl-C's SIGINT) while an agent waits
/// for nodes ends it at once, not at the end of `--rdzv-timeout` (900 s).
#[test]
fn a_signal_while_waiting_for_nodes_ends_the_agent_at_once() {
    let d = fresh_dir("phalanx-elastic", "signal-waiting");
    let args = job(&d, "2:3", 4, free_port(), &[]);
    let mut a = Node::start(&d, "a", &args, &[]);
    a.wait_for("elastic job");
    // The handlers are installed right after that line.
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    let st = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let code = a.wait();
    let out = a.output();
    assert_eq!(code, 128 + 15, "{out}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(
        out.contains("received signal 15 while waiting in the rendezvous"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A checkpoint holding each rank's comm-hook state (top-k residuals of 2
/// ranks), resumed by an elastic round of another size: the hook starts
/// fresh with a note (else every round would meet the refusal and the job
/// could never go on); outside an elastic job the refusal stands.
#[test]
fn an_elastic_round_of_another_size_starts_the_hook_state_fresh() {
    let d = fresh_dir("phalanx-elastic", "hook");
    let hook = [
        "--set",
        "parallel.comm_hook=\"topk\"",
        "--set",
        "parallel.topk_ratio=0.1",
        "--set",
        "checkpoint.interval=2",
    ];
    let run = |nproc: &str, steps: usize, resume: bool, elastic: bool| {
        let mut c = Command::new(BIN);
        c.current_dir(repo())
            .arg("train")
            .args(train_args(&d.join(format!("log-{nproc}.jsonl")), steps))
            .args(hook)
            .args(["--nproc-per-node", nproc])
            .args([
                "--set",
                &format!(
                    "checkpoint.dir=\"{}\"",
                    d.join(format!("ck-{nproc}")).display()
                ),
            ])
            .env_remove("RANK");
        if resume {
            c.args(["--resume"]).arg(d.join("ck-2"));
        }
        if elastic {
            c.env("PHALANX_ELASTIC", "1");
        }
        run_until(c, DEADLINE)
    };
    let r = run("2", 2, false, false);
    assert_eq!(r.code, 0, "{r}");
    let r = run("1", 4, true, false);
    assert_ne!(r.code, 0, "{r}");
    assert!(r.err.contains("cannot be split or merged"), "{r}");
    let r = run("1", 4, true, true);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.out
            .contains("this elastic round has 1 (dp 1, pp 1, tp 1): the hook starts fresh"),
        "{r}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A membership round is an attempt (`PHALANX_RESTART_COUNT` = the round,
/// from which `phalanx train` resumes) but no failure restart: torchrun's
/// `TORCHELASTIC_RESTART_COUNT` stays at the failure restarts used (0 here,
/// with `--max-restarts 0`; it was the round, above the maximum).
#[test]
fn a_membership_round_is_no_failure_restart() {
    let d = fresh_dir("phalanx-elastic", "restart-count");
    let port = free_port().to_string();
    let cmd = "echo \"R$PHALANX_RESTART_COUNT T$TORCHELASTIC_RESTART_COUNT \
               M$TORCHELASTIC_MAX_RESTARTS\"; trap 'exit 75' USR1; sleep 3 & wait";
    let node = |name: &str| {
        let mut c = Command::new(BIN);
        c.current_dir(&*d)
            .args(["run", "--nproc-per-node", "1", "--nnodes", "1:2"])
            .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
            .args(["--rdzv-id", "count-test"])
            .args(["--rdzv-conf", "heartbeat_timeout=2,last_call_timeout=1"])
            .args(["--", "sh", "-c", cmd]);
        Node::spawn(&d, name, c, &[])
    };
    let mut a = node("a");
    a.wait_for("[rank 0] R0 T0 M0");
    let mut c = node("c");
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(c.wait(), 0, "{}", c.output());
    let both = format!("{}{}", a.output(), c.output());
    assert!(both.contains("round 1 formed with 2 node(s)"), "{both}");
    assert!(both.contains("R1 T0 M0"), "{both}");
    assert!(!both.contains("T1"), "{both}");
    let _ = std::fs::remove_dir_all(&d);
}
