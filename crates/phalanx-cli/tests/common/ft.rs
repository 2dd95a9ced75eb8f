//! Fault-tolerance test helpers: processes with their outputs in files, a
//! lighthouse on a free port, and `phalanx train` replica groups.

use super::{repo, BIN};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(120);
pub const SECRET: &str = "5a5b5c5d5e5f606162636465666768695a5b5c5d5e5f60616263646566676869";

/// A child process (in a process group of its own, so that a launcher
/// and its ranks are signalled together), its stdout and stderr in files.
pub struct Proc {
    pub child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
}

impl Proc {
    pub fn start(d: &Path, name: &str, args: &[&str]) -> Proc {
        let mut c = Command::new(BIN);
        c.args(args);
        Proc::spawn(d, name, c)
    }

    /// Start `c` with the job secret, its output to `d/name.{out,err}`.
    pub fn spawn(d: &Path, name: &str, mut c: Command) -> Proc {
        use std::os::unix::process::CommandExt;
        let (out, err) = (d.join(format!("{name}.out")), d.join(format!("{name}.err")));
        let child = c
            .env("PHALANX_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        Proc { child, out, err }
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn output(&self) -> String {
        format!(
            "--- stdout\n{}--- stderr\n{}",
            self.stdout(),
            std::fs::read_to_string(&self.err).unwrap_or_default()
        )
    }

    /// Wait until stdout holds `what`.
    pub fn wait_for(&mut self, what: &str) {
        self.wait_for_more(what, 0);
    }

    /// Wait until stdout holds `what` more than `seen` times (an event
    /// after a point where it had been said `seen` times already).
    pub fn wait_for_more(&mut self, what: &str, seen: usize) {
        let t0 = Instant::now();
        while self.stdout().matches(what).count() <= seen {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "exited before {what:?}:\n{}",
                self.output()
            );
            assert!(t0.elapsed() < DEADLINE, "no {what:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn wait(&mut self) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().unwrap_or(-1);
            }
            assert!(t0.elapsed() < DEADLINE, "hung:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Signal the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the test's own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Signal the process and every process it started (its group).
    pub fn signal_group(&self, sig: i32) {
        // SAFETY: kill(2) on the test's own child's process group.
        unsafe { libc::kill(-(self.child.id() as i32), sig) };
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal_group(libc::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// A lighthouse on a free port (1 s heartbeat timeout, 0.3 s join
/// timeout); its address.
pub fn lighthouse(d: &Path, min: &str) -> (Proc, String) {
    lighthouse_with(d, min, "0.3")
}

/// As [`lighthouse`], waiting `join` seconds for more groups to arrive
/// together before a change that adds groups.
pub fn lighthouse_with(d: &Path, min: &str, join: &str) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    (lighthouse_at(d, "lighthouse", &addr, min, join), addr)
}

/// A lighthouse at `addr` (its output in `d/name.*`).
pub fn lighthouse_at(d: &Path, name: &str, addr: &str, min: &str, join: &str) -> Proc {
    let mut lh = Proc::start(
        d,
        name,
        &[
            "lighthouse",
            "--bind",
            addr,
            "--min-replicas",
            min,
            "--heartbeat-timeout",
            "1",
            "--join-timeout",
            join,
        ],
    );
    lh.wait_for("phalanx lighthouse at");
    lh
}

/// `phalanx train` as replica group `g` of `replicas`, with `nproc` local
/// ranks, in the repository (1 s heartbeat timeout): `args` are the rest
/// of its command line; `fault` its `PHALANX_FAULT`, if any; `threads`
/// its kernels' threads per rank (`RAYON_NUM_THREADS`), if set: a
/// bitwise comparison with another layout needs the same.
pub struct Group<'a> {
    pub nproc: usize,
    pub addr: &'a str,
    pub replicas: usize,
    pub fault: Option<&'a str>,
    pub threads: Option<usize>,
    /// More environment for every rank (e.g. `PHALANX_HOST_KERNELS=0`).
    pub env: &'a [(&'a str, &'a str)],
}

impl<'a> Group<'a> {
    /// Groups of one rank, no fault, of a job of two groups.
    pub fn one_rank_of_two(addr: &'a str) -> Group<'a> {
        Group {
            nproc: 1,
            addr,
            replicas: 2,
            fault: None,
            threads: None,
            env: &[],
        }
    }

    pub fn start(&self, d: &Path, name: &str, g: usize, args: &[String]) -> Proc {
        train_group(d, name, self, g, args)
    }
}

fn train_group(d: &Path, name: &str, grp: &Group, g: usize, args: &[String]) -> Proc {
    let (nproc, addr, replicas) = (grp.nproc, grp.addr, grp.replicas);
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", &nproc.to_string()])
        .args(args)
        .args(["--set", &format!("fault_tolerance.lighthouse=\"{addr}\"")])
        .args(["--set", &format!("fault_tolerance.replica_id={g}")])
        .args(["--set", &format!("fault_tolerance.replicas={replicas}")])
        .args(["--set", "fault_tolerance.heartbeat_timeout=1"]);
    for v in super::LAUNCHER_VARS {
        c.env_remove(v);
    }
    match grp.fault {
        Some(f) => c.env("PHALANX_FAULT", f),
        None => c.env_remove("PHALANX_FAULT"),
    };
    if let Some(t) = grp.threads {
        c.env("RAYON_NUM_THREADS", t.to_string());
    }
    c.envs(grp.env.iter().copied());
    Proc::spawn(d, name, c)
}
