//! The workers of one group: their processes, stdout/stderr pumps with
//! `[rank N]` prefixes and stderr tails, reaping, the root cause of a
//! failure, and stopping them (SIGTERM, then SIGKILL after the grace).

use crate::launch::{grace, say, signalled, signals, Stop, STOPPED_EXIT, STOP_GRACE};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ExitStatus};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lines of stderr kept per rank for the failure report.
const TAIL: usize = 20;
/// How long a worker sent SIGKILL is waited for before the launcher goes
/// on without it.
const KILL_WAIT: Duration = Duration::from_secs(5);

pub(crate) struct Worker {
    pub(crate) rank: usize,
    pub(crate) child: Child,
    /// Its exit status once reaped: from then on its pid (and process
    /// group id) may name another process, and it is never signalled.
    pub(crate) exited: Option<ExitStatus>,
    pub(crate) tail: Arc<Mutex<VecDeque<String>>>,
    pub(crate) pumps: Vec<std::thread::JoinHandle<()>>,
}

/// The failure summary: its text, and whose stderr tails to show.
pub(crate) struct Summary {
    pub(crate) text: String,
    pub(crate) tails: Vec<usize>,
}

/// Name the root cause of `rank`'s failure (before anyone is stopped, so
/// that a hung rank is seen as it is). A rank that exited 1 usually did
/// because of a peer it names (`rank 1 (host) failed: no heartbeat …`):
/// follow who named whom and name that rank, not the messenger.
pub(crate) fn blame(workers: &mut [Worker], rank: usize, code: i32, how: &str) -> Summary {
    let plain = Summary {
        text: format!("rank {rank} failed ({how})"),
        tails: vec![rank],
    };
    if code != 1 {
        return plain;
    }
    let said = |r: usize| -> Vec<String> {
        workers
            .iter()
            .find(|w| w.rank == r)
            .map(|w| w.tail.lock().unwrap().iter().cloned().collect())
            .unwrap_or_default()
    };
    let Some(root) = crate::root_cause::follow(rank, said) else {
        return plain;
    };
    let state = match workers.iter_mut().find(|w| w.rank == root) {
        None => "on another node".to_string(),
        Some(w) => match reap(w) {
            Ok(Some(st)) => describe(st).1,
            _ => crate::root_cause::state(w.child.id())
                .unwrap_or("still running")
                .to_string(),
        },
    };
    Summary {
        text: format!(
            "rank {root} failed ({state}): rank {rank} named it as failed and exited ({how})"
        ),
        tails: vec![root, rank],
    }
}

/// Give workers asked to stop `STOP_GRACE` to get there, then end them.
/// `watch(true)` goes on being called meanwhile: an elastic agent keeps
/// its heartbeat (and does nothing else: no admission or loss is posted
/// while it stops), so that nobody takes a node still saving its
/// checkpoint for lost.
pub(crate) fn finish_stop(
    workers: &mut [Worker],
    watch: &mut dyn FnMut(bool) -> Option<Stop>,
) -> Result<(), String> {
    let deadline = Instant::now() + STOP_GRACE;
    // A signal to the launcher ends the wait: stop them now.
    while poll(workers)?.0 > 0 && Instant::now() < deadline && signalled() == 0 {
        let _ = watch(true);
        std::thread::sleep(Duration::from_millis(20));
    }
    stop_all_ticking(workers, &mut || {
        let _ = watch(true);
    });
    Ok(())
}

/// (workers still running, failed workers with their status).
pub(crate) type Failures = Vec<(usize, (i32, String))>;

/// Order failures root cause first: one killed by a signal or exiting with
/// its own code, then one that exited 1 (usually over a peer's failure),
/// by rank. In an elastic job a rank that stopped as asked (exit 75) is
/// last: it did not fail, whoever else did.
pub(crate) fn root_cause_first(failures: &mut Failures, elastic: bool) {
    failures.sort_by_key(|(rank, (code, _))| (elastic && *code == STOPPED_EXIT, *code == 1, *rank));
}

/// Reap `w` if it exited. What it left in its process group is SIGKILLed
/// first, while its zombie still holds the pid (so that the group id names
/// no other process); once reaped it is never signalled again.
pub(crate) fn reap(w: &mut Worker) -> std::io::Result<Option<ExitStatus>> {
    if let Some(st) = w.exited {
        return Ok(Some(st));
    }
    let pid = w.child.id() as i32;
    // SAFETY: an all-zero siginfo_t is valid; waitid only writes to it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waiting on our own child; WNOWAIT leaves it unreaped.
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: waitid filled in si_pid (0: the child has not exited).
    if unsafe { info.si_pid() } == 0 {
        return Ok(None);
    }
    // SAFETY: the group our unreaped child leads.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    w.exited = w.child.try_wait()?;
    Ok(w.exited)
}

/// The pids of the workers not yet reaped (which therefore still name them).
pub(crate) fn unreaped(workers: &[Worker]) -> Vec<i32> {
    workers
        .iter()
        .filter(|w| w.exited.is_none())
        .map(|w| w.child.id() as i32)
        .collect()
}

pub(crate) fn poll(workers: &mut [Worker]) -> Result<(usize, Failures), String> {
    let mut running = 0;
    let mut failures = Vec::new();
    for w in workers.iter_mut() {
        match reap(w) {
            Ok(None) => running += 1,
            Ok(Some(st)) if st.success() => {}
            Ok(Some(st)) => failures.push((w.rank, describe(st))),
            Err(e) => return Err(format!("waiting for rank {}: {e}", w.rank)),
        }
    }
    Ok((running, failures))
}

pub(crate) fn describe(st: ExitStatus) -> (i32, String) {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => (c, format!("exit code {c}")),
        (None, Some(s)) => (128 + s, format!("killed by signal {s}")),
        _ => (1, "unknown status".into()),
    }
}

/// Send everyone still running the signal this launcher received (Ctrl-C
/// reaches a worker as SIGINT, as under torchrun), else SIGTERM; SIGKILL
/// after the grace period, or at once when another signal comes meanwhile
/// (a second Ctrl-C); reap. `tick` is called while it waits (an elastic
/// agent's heartbeat: the grace may outlast the heartbeat timeout, and a
/// node stopping its workers is not lost).
pub(crate) fn stop_all_ticking(workers: &mut [Worker], tick: &mut dyn FnMut()) {
    let sig = match signalled() {
        0 => libc::SIGTERM,
        s => s,
    };
    let seen = signals();
    for pid in unreaped(workers) {
        // SAFETY: signalling the process group our (unreaped) child leads.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
    let deadline = Instant::now() + grace();
    for w in workers.iter_mut() {
        loop {
            match reap(w) {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline || signals() > seen => {
                    // (std's kill never signals a reaped child.)
                    let _ = w.child.kill();
                    // A process in uninterruptible sleep (a dead NFS
                    // mount, a driver call) outlives SIGKILL until the
                    // call returns: wait for it a while, then go on
                    // without it (init reaps it once the launcher exits).
                    let until = Instant::now() + KILL_WAIT;
                    while matches!(reap(w), Ok(None)) {
                        if Instant::now() >= until {
                            say!(
                                "phalanx run: rank {} (pid {}) did not exit {:?} after SIGKILL \
                 (uninterruptible sleep?); going on without it",
                                w.rank,
                                w.child.id(),
                                KILL_WAIT
                            );
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    break;
                }
                Ok(None) => {
                    tick();
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
    end_leftovers(workers);
}

/// After the workers exited: SIGKILL what is left in their process groups
/// (`reap` did for those reaped), and let the output pumps finish, but at
/// most briefly: a process that escaped the group may hold the pipe open
/// for as long as it likes.
pub(crate) fn end_leftovers(workers: &mut [Worker]) {
    for pid in unreaped(workers) {
        // SAFETY: signalling the process group our (unreaped) child leads.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_millis(500);
    for w in workers.iter_mut() {
        for p in w.pumps.drain(..) {
            while !p.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if p.is_finished() {
                let _ = p.join();
            }
            // Otherwise the pump is left to end with the process.
        }
    }
}

/// Copy a worker's output line by line with a `[rank N]` prefix.
pub(crate) fn pump(
    src: impl std::io::Read + Send + 'static,
    rank: usize,
    is_err: bool,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&buf);
            let line = line.trim_end_matches(['\n', '\r']);
            if is_err {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {line}");
            }
            if let Some(t) = &tail {
                let mut t = t.lock().unwrap();
                if t.len() == TAIL {
                    t.pop_front();
                }
                t.push_back(line.to_string());
            }
        }
    })
}
#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn failed(list: &[(usize, i32)]) -> Failures {
        list.iter()
            .map(|&(r, c)| (r, (c, format!("exit code {c}"))))
            .collect()
    }

    #[test]
    fn a_rank_that_stopped_as_asked_is_never_the_root_cause_of_an_elastic_failure() {
        let mut f = failed(&[(0, STOPPED_EXIT), (1, 1), (2, STOPPED_EXIT)]);
        root_cause_first(&mut f, true);
        assert_eq!(f[0].0, 1, "{f:?}");
        // A code of its own still comes before exit 1, and a signal too.
        let mut f = failed(&[(0, STOPPED_EXIT), (1, 1), (3, 137)]);
        root_cause_first(&mut f, true);
        assert_eq!((f[0].0, f[1].0, f[2].0), (3, 1, 0), "{f:?}");
        // In a static job exit 75 is a failure like any other code.
        let mut f = failed(&[(1, 1), (2, STOPPED_EXIT)]);
        root_cause_first(&mut f, false);
        assert_eq!(f[0].0, 2, "{f:?}");
    }

    /// Rank 0's worker running `sh -c script` (its stdout piped when
    /// `piped`), started as the launcher starts its workers.
    fn worker(script: &str, piped: bool) -> Worker {
        let mut c = Command::new("sh");
        c.args(["-c", script])
            .stdin(Stdio::null())
            .stdout(if piped { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::null());
        phalanx_comm::child::die_with_launcher(&mut c);
        Worker {
            rank: 0,
            child: c.spawn().unwrap(),
            exited: None,
            tail: Arc::new(Mutex::new(VecDeque::new())),
            pumps: Vec::new(),
        }
    }

    /// While workers finish a graceful stop, the agent's watch (its
    /// heartbeat) goes on.
    #[test]
    fn the_watch_goes_on_while_workers_finish_their_stop() {
        let mut workers = vec![worker("sleep 0.3; exit 75", false)];
        let mut calls = 0;
        finish_stop(&mut workers, &mut |stopping| {
            assert!(stopping, "a stopping group only keeps its heartbeat");
            calls += 1;
            None
        })
        .unwrap();
        assert!(workers[0].exited.is_some());
        assert!(calls > 0);
    }

    /// Whether `pid` is a live (not zombie) `sleep`.
    fn sleeping(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            let after = s.rsplit_once(") ").map_or("", |(_, a)| a);
            s.contains("(sleep)") && !after.starts_with('Z')
        })
    }

    /// A worker reaped by `poll` is marked so (and never signalled again:
    /// its pid may be another process's by then); what it left in its
    /// process group is ended as it is reaped, not when the whole group is.
    #[test]
    fn a_reaped_worker_is_marked_and_its_leftovers_ended_at_once() {
        let mut w = worker("sleep 30 & echo $!; exit 3", true);
        let mut line = String::new();
        BufReader::new(w.child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        let mut workers = vec![w];
        let deadline = Instant::now() + Duration::from_secs(20);
        let failures = loop {
            let (running, failures) = poll(&mut workers).unwrap();
            if running == 0 {
                break failures;
            }
            assert!(Instant::now() < deadline, "the worker never exited");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(failures[0].1 .0, 3);
        assert!(workers[0].exited.is_some());
        assert!(unreaped(&workers).is_empty());
        while sleeping(grandchild) {
            assert!(
                Instant::now() < deadline,
                "the worker's leftover (pid {grandchild}) still runs"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // Polled again: the status kept, nothing waited on or signalled.
        assert_eq!(poll(&mut workers).unwrap().1[0].1 .0, 3);
        stop_all_ticking(&mut workers, &mut || {});
    }
}
