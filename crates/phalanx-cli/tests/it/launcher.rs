//! `phalanx run` and multi-process collectives, as real processes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_phalanx");

fn phalanx(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("OMP_NUM_THREADS")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A `PHALANX_FAULT` item that is no fault spec (a typo in a test) is
/// warned of, naming the shape its name takes; good ones are not.
#[test]
fn a_fault_spec_that_is_none_is_warned_of() {
    let out = Command::new(BIN)
        .args(["run", "--nproc-per-node", "1", "--", "true"])
        .env_remove("RANK")
        .env(
            "PHALANX_FAULT",
            "exit-at-step:1:5, exit-in-save:x,bogus:1,slow:0",
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("item exit-in-save:x (exit-in-save:STEP) is no fault spec"),
        "{err}"
    );
    assert!(err.contains("item bogus:1 (known: exit-at-step,"), "{err}");
    assert!(err.contains("item slow:0 (slow:RANK:MS)"), "{err}");
    assert!(!err.contains("exit-at-step:1:5"), "{err}");
}

#[test]
fn workers_get_torchrun_environment_and_prefixed_output() {
    let (code, out, _) = phalanx(&[
        "run",
        "--nproc_per_node",
        "3",
        "--",
        "sh",
        "-c",
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $PHALANX_STORE_HOSTED ${#PHALANX_SECRET} $RAYON_NUM_THREADS",
    ]);
    assert_eq!(code, 0, "{out}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let threads = (cores / 3).max(1);
    for r in 0..3 {
        let want = format!("[rank {r}] {r} 3 {r} 3 127.0.0.1 1 64 {threads}");
        assert!(
            out.lines().any(|l| l == want),
            "missing {want:?} in:\n{out}"
        );
    }
}

#[test]
fn failed_worker_stops_the_others_and_is_named() {
    // Ranks 0 and 2 say so if a signal ends their 60 s sleep; rank 1 fails
    // once both are listening for it.
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "failed-worker");
    let script = format!(
        "d={}; if [ $RANK = 1 ]; then \
           while [ ! -e $d/0 ] || [ ! -e $d/2 ]; do sleep 0.05; done; \
           echo 'something broke' >&2; sleep 0.3; exit 3; fi; \
         trap 'echo \"rank $RANK: stopped by SIGTERM\" >&2; exit 143' TERM; \
         touch $d/$RANK; sleep 60 & wait",
        d.display()
    );
    let (code, _, err) = phalanx(&["run", "--nproc-per-node", "3", "--", "sh", "-c", &script]);
    let _ = std::fs::remove_dir_all(&d);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("rank 1 failed (exit code 3)"), "{err}");
    assert!(err.contains("| something broke"), "{err}");
    // Stopped by the launcher, not by the end of their sleep (which would
    // have let them exit 0 without a word).
    for r in [0, 2] {
        assert!(
            err.contains(&format!("rank {r}: stopped by SIGTERM")),
            "rank {r} was not stopped: {err}"
        );
    }
}

/// Exit 75 (EX_TEMPFAIL) is a stop an elastic agent asks for; in a static
/// job it is a rank's failure, named with its code, and the others are
/// stopped at once rather than after the graceful stop's two minutes.
#[test]
fn exit_75_in_a_static_job_is_a_failure_named_with_its_rank() {
    let t0 = Instant::now();
    let (code, _, err) = phalanx(&[
        "run",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 75; fi; sleep 60",
    ]);
    assert_eq!(code, 75, "{err}");
    assert!(err.contains("rank 1 failed (exit code 75)"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

#[test]
fn restarts_the_group_after_a_failure() {
    // Fails on the first run (PHALANX_RUN_ID=0), succeeds on the restart.
    let (code, out, err) = phalanx(&[
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "if [ $PHALANX_RUN_ID = 0 ] && [ $RANK = 0 ]; then exit 1; fi; echo run $PHALANX_RUN_ID",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("restarting the group (restart 1 of 1)"),
        "{err}"
    );
    assert!(
        out.contains("[rank 0] run 1") && out.contains("[rank 1] run 1"),
        "{out}"
    );
}

#[test]
fn bad_launcher_input_is_a_clear_error() {
    let (code, _, err) = phalanx(&["run", "--nproc-per-node", "0", "--", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("--nproc-per-node must be at least 1"), "{err}");
    let (code, _, err) = phalanx(&["run", "--nnodes", "2", "--node-rank", "0", "--", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("PHALANX_SECRET"), "{err}");
    // A store port already in use.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let (code, _, err) = phalanx(&["run", "--master-port", &port, "--", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot bind") && err.contains(&port), "{err}");
}

#[test]
fn sigterm_is_forwarded_and_workers_stop() {
    let mut child = Command::new(BIN)
        .args(["run", "--nproc-per-node", "2", "--", "sleep", "61.37"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The launcher and its two workers.
    wait_until("workers started", || with_mark("61.37") >= 3);
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let st = wait_or_kill(&mut child, "SIGTERM");
    assert_eq!(st.code(), Some(128 + libc::SIGTERM));
    wait_until("no worker left", || with_mark("61.37") == 0);
}

/// Ctrl-C (SIGINT) and Ctrl-\\ (SIGQUIT) reach the workers as themselves,
/// as under torchrun (they used to get SIGTERM, and SIGQUIT was not
/// caught, leaving them behind), also when the launcher's stdout and
/// stderr are a pipe whose reader is gone (`… 2>&1 | tee log`, both told
/// Ctrl-C: saying so used to panic the launcher, exit 101).
#[test]
fn ctrl_c_and_quit_reach_the_workers_as_themselves_past_a_closed_pipe() {
    for (sig, name, mark) in [
        (libc::SIGINT, "INT", "62.41"),
        (libc::SIGQUIT, "QUIT", "62.43"),
    ] {
        let d = phalanx::fsutil::ScratchDir::new("phalanx", "ctrl-c");
        let script = format!(
            "d={}; trap 'echo {name} > $d/got$RANK; exit 9' {name}; touch $d/ready$RANK; \
             sleep {mark} & wait",
            d.display()
        );
        let mut child = Command::new(BIN)
            .args(["run", "--nproc-per-node", "2", "--", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        drop(child.stderr.take());
        wait_until("workers ready", || {
            d.join("ready0").exists() && d.join("ready1").exists()
        });
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(child.id() as i32, sig);
        }
        let st = wait_or_kill(&mut child, name);
        assert_eq!(st.code(), Some(128 + sig), "SIG{name}: {st:?}");
        for r in 0..2 {
            let got = std::fs::read_to_string(d.join(format!("got{r}"))).unwrap_or_default();
            assert_eq!(got.trim(), name, "rank {r} was not sent SIG{name}");
        }
        wait_until("no worker left", || with_mark(mark) == 0);
    }
}

/// The launcher's exit after `signal`, or a failure (not a hang) if it has
/// not exited well before its workers' 60 s sleep would end on its own.
fn wait_or_kill(child: &mut std::process::Child, signal: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the launcher was still running 30 s after {signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn collectives_across_processes_are_correct() {
    let (code, out, err) = phalanx(&[
        "run",
        "--nproc-per-node",
        "3",
        "--",
        BIN,
        "bench",
        "collectives",
        "--op",
        "all",
        "--sizes",
        "8,100K,3M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--check",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("[rank 0]   "))
        .collect();
    assert_eq!(rows.len(), 18, "{out}");
    for r in rows {
        assert!(r.trim_end().ends_with(" 0"), "wrong results: {r}");
    }
}

/// A free port for a store that rank 0 will host.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Start `n` `_test-worker` processes by hand, as mpirun or srun would:
/// `env(rank)` gives each one's launcher variables; rank 0 hosts the store.
fn spawn_workers(
    n: usize,
    args: &[&str],
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<std::process::Output> {
    let port = free_port();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(BIN)
                .arg("_test-worker")
                .args(args)
                .env_remove("RANK")
                .envs(env(r))
                .env("MASTER_PORT", port.to_string())
                .env("PHALANX_SECRET", "00112233445566778899aabbccddeeff")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    kids.into_iter()
        .map(|k| k.wait_with_output().unwrap())
        .collect()
}

/// Open MPI's variables; one rank aborts mid-collective.
#[test]
fn killed_rank_fails_the_others_naming_it() {
    let n = 3;
    let outs = spawn_workers(
        n,
        &[
            "--die-rank",
            "1",
            "--die-after-ms",
            "400",
            "--iters",
            "100000",
        ],
        |r| {
            vec![
                ("OMPI_COMM_WORLD_RANK".into(), r.to_string()),
                ("OMPI_COMM_WORLD_SIZE".into(), n.to_string()),
                // Only the closed connections can reveal the death: no
                // heartbeat is missed in this test, and a death that went
                // unseen would end in a timeout after 60 s.
                ("PHALANX_HEARTBEAT_TIMEOUT".into(), "600".into()),
                ("PHALANX_TIMEOUT".into(), "60".into()),
            ]
        },
    );
    for (r, out) in outs.into_iter().enumerate() {
        let err = String::from_utf8_lossy(&out.stderr);
        if r == 1 {
            assert!(!out.status.success());
            continue;
        }
        assert_eq!(out.status.code(), Some(1), "rank {r}: {err}");
        // "rank 1 (host) failed: connection closed ...", seen here or
        // passed on by the other survivor; a timeout also names rank 1.
        assert!(err.contains("rank 1 (127.0.0.1:"), "rank {r}: {err}");
        assert!(err.contains(") failed: "), "rank {r}: {err}");
        assert!(!err.contains("timeout"), "rank {r}: {err}");
    }
}

#[test]
fn slurm_variables_start_a_job_too() {
    let outs = spawn_workers(2, &["--iters", "3"], |r| {
        vec![
            ("SLURM_PROCID".into(), r.to_string()),
            ("SLURM_NTASKS".into(), "2".into()),
            ("SLURM_LOCALID".into(), r.to_string()),
            ("SLURM_STEP_ID".into(), "0".into()),
        ]
    });
    for (r, out) in outs.into_iter().enumerate() {
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(so.contains(&format!("rank {r}: ok x[0]=1")), "{so}");
    }
}

/// Wait (up to 30 s) until `ok()`, else fail saying `what`.
fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < end, "not within 30 s: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Processes whose command line holds `mark`.
fn with_mark(mark: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(mark))
                .unwrap_or(false)
        })
        .count()
}

/// The launcher's job is done when its workers are: a grandchild that
/// escaped the worker's process group (`setsid`) is not waited for, and
/// what stayed in the group is ended.
#[test]
fn leftovers_of_finished_workers_neither_hold_nor_outlive_the_job() {
    let d = std::env::temp_dir().join(format!("phalanx-leftovers-{}", std::process::id()));
    for code in [3, 0] {
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // The escaped one leaves a mark once it is in its own session, and
        // the worker waits for it, so that it is out of reach of the
        // worker's group when the launcher ends that.
        let script = format!(
            "d={}; setsid sh -c \"touch $d/escaped; exec sleep 23.17\" & \
             while [ ! -e $d/escaped ]; do sleep 0.05; done; \
             sleep 31.71 & sleep 0.5; exit {code}",
            d.display()
        );
        let (c, _, err) = phalanx(&["run", "--nproc-per-node", "1", "--", "sh", "-c", &script]);
        // Still running when the launcher was done: not waited for (it
        // holds the worker's output open until its sleep ends).
        let escaped = with_mark("23.17");
        // The escaped one is not ours to end; tidy up after the test.
        let _ = Command::new("pkill").args(["-f", "sleep 23.17"]).status();
        assert_eq!(c, code, "{err}");
        assert!(escaped >= 1, "the launcher waited for an escaped process");
        wait_until("the worker's group was ended", || with_mark("31.71") == 0);
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// SIGHUP (a closed terminal) stops the job as SIGTERM does.
#[test]
fn sighup_stops_the_workers() {
    let mut child = Command::new(BIN)
        .args(["run", "--nproc-per-node", "2", "--", "sleep", "47.31"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("workers started", || with_mark("47.31") >= 3);
    unsafe {
        libc::kill(child.id() as i32, libc::SIGHUP);
    }
    let st = wait_or_kill(&mut child, "SIGHUP");
    assert_eq!(st.code(), Some(128 + libc::SIGHUP));
    wait_until("no worker left", || with_mark("47.31") == 0);
}

/// `--nproc-per-node` beyond what the host can hold is refused before any
/// process starts, naming the flag and the cap (it used to fork hundreds of
/// children a second, and `train` sat silent for a minute).
#[test]
fn too_many_local_ranks_are_refused_up_front() {
    let huge = u64::MAX.to_string();
    let cases: [&[&str]; 4] = [
        &["run", "--nproc-per-node", "100000", "--", "sleep", "61.73"],
        &["run", "--nproc-per-node", &huge, "--", "sleep", "61.73"],
        &[
            "run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "100000",
            "--",
            "sleep",
            "61.73",
        ],
        &["train", "--nproc-per-node", "1000"],
    ];
    for args in cases {
        let t0 = Instant::now();
        let (code, out, err) = phalanx(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(
            err.contains("--nproc-per-node") && err.contains("at most"),
            "{args:?}: {err}"
        );
        assert!(err.contains("PHALANX_MAX_LOCAL_RANKS"), "{err}");
        // A liveness bound only: nothing was started, nothing waited for.
        assert!(t0.elapsed() < Duration::from_secs(20), "{args:?}");
    }
    assert_eq!(with_mark("61.73"), 0, "a worker was started");
}

/// SIGTERM while the launcher is still starting workers stops it there:
/// the ones started are stopped and reaped, no more are started.
#[test]
fn sigterm_while_starting_workers_stops_and_reaps_them() {
    const N: usize = 400;
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "spawn");
    let started = d.join("started");
    // Each worker leaves a line, then sleeps (marked to be found).
    let script = format!("echo x >> {}; exec sleep 59.83", started.display());
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--nproc-per-node",
            &N.to_string(),
            "--",
            "sh",
            "-c",
            &script,
        ])
        .env("PHALANX_MAX_LOCAL_RANKS", N.to_string())
        .env_remove("RANK")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let kids = || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .map(|c| c.split_whitespace().count())
            .unwrap_or(0)
    };
    // Mid-way: a few workers exist (60 s: a hang guard).
    let end = Instant::now() + Duration::from_secs(60);
    while kids() < 3 {
        assert!(Instant::now() < end, "no worker started within 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
    let st = wait_or_kill(&mut child, "SIGTERM");
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(st.code(), Some(128 + libc::SIGTERM), "{err}");
    assert!(err.contains("while starting the workers"), "{err}");
    // It stopped starting them: far fewer than N ever ran.
    let ran = std::fs::read_to_string(&started)
        .unwrap_or_default()
        .lines()
        .count();
    assert!(ran < N, "all {N} workers were started after the SIGTERM");
    // And those that did are gone (they ended with the launcher's reaping).
    wait_until("no worker outlives the launcher", || {
        with_mark("59.83") == 0
    });
    let _ = std::fs::remove_dir_all(&d);
}

/// A rank stopped with SIGSTOP makes its peers fail naming it; the
/// launcher's summary names it too (the root cause), not the rank that
/// exited first with "exit code 1".
#[test]
fn the_summary_names_the_stopped_rank_not_its_messenger() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "stopped");
    let err_path = d.join("stderr");
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--nproc-per-node",
            "2",
            // (A stopped rank takes SIGTERM only once continued: it is
            // killed when the shutdown timeout ends.)
            "--shutdown-timeout",
            "3",
            "--",
            BIN,
            "_test-worker",
            "--iters",
            "100000000",
        ])
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .env("PHALANX_HEARTBEAT_TIMEOUT", "1.5")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Rank 1's pid: the worker whose environment says RANK=1.
    let end = Instant::now() + Duration::from_secs(60);
    let rank1 = loop {
        let kids =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        let found = kids.split_whitespace().find(|k| {
            std::fs::read(format!("/proc/{k}/environ"))
                .map(|e| e.split(|b| *b == 0).any(|v| v == b"RANK=1"))
                .unwrap_or(false)
        });
        if let Some(k) = found {
            break k.parse::<i32>().unwrap();
        }
        assert!(Instant::now() < end, "rank 1 did not start within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Past the set-up, into the all-reduce loop (a stop during set-up is
    // named as well, but as a timeout).
    let said = || std::fs::read_to_string(&err_path).unwrap_or_default();
    wait_until("rank 1 past its set-up", || {
        said().contains("rank 1: set up")
    });
    unsafe {
        libc::kill(rank1, libc::SIGSTOP);
    }
    let st = wait_or_kill(&mut child, "SIGSTOP of rank 1");
    let err = said();
    // Rank 0 named rank 1 ...
    assert!(
        err.contains("[rank 0]") && err.contains("rank 1 (127.0.0.1:"),
        "{err}"
    );
    // ... and so does the summary, saying how it stands.
    assert!(
        err.contains("phalanx run: rank 1 failed (stopped (SIGSTOP"),
        "{err}"
    );
    assert!(!err.contains("phalanx run: rank 0 failed"), "{err}");
    assert_eq!(st.code(), Some(1), "{err}");
}

/// `phalanx run` with these variables set (and no other secret).
fn phalanx_with(args: &[&str], vars: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("OMP_NUM_THREADS")
        .envs(vars.iter().copied());
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

const SECRET: &str = "00112233445566778899aabbccddeeff";

/// The launcher reads `PHALANX_SECRET` as its workers do: a short one is
/// refused before any worker starts (not by every worker, restart after
/// restart), and one with a trailing newline is accepted and passed on
/// without it.
#[test]
fn the_launcher_takes_the_secret_its_workers_take() {
    let (code, out, err) = phalanx_with(
        &[
            "run",
            "--max-restarts",
            "3",
            "--",
            "sh",
            "-c",
            "echo started",
        ],
        &[("PHALANX_SECRET", "00ff")],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("PHALANX_SECRET is too short"), "{err}");
    assert!(!out.contains("started"), "{out}");
    let upper = format!("{}\n", SECRET.to_ascii_uppercase());
    let (code, out, err) = phalanx_with(
        &["run", "--", "sh", "-c", "echo \"secret=$PHALANX_SECRET.\""],
        &[("PHALANX_SECRET", &upper)],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("secret={SECRET}.")), "{out}");
}

/// Port 0 where other nodes must find the store is refused up front;
/// alone on loopback (torchrun --standalone's `localhost:0`) a free port
/// is bound and given to the workers.
#[test]
fn port_0_is_refused_unless_one_node_serves_itself() {
    let s = [("PHALANX_SECRET", SECRET)];
    for args in [
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "192.0.2.7",
            "--master-port",
            "0",
        ][..],
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            "127.0.0.1:0",
        ][..],
        &[
            "--nnodes",
            "1:2",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "--rdzv-id",
            "p0",
            // Bounds the wait where port 0 were taken.
            "--rdzv-timeout",
            "20",
        ][..],
    ] {
        let mut a = vec!["run"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--", "true"]);
        let (code, _, err) = phalanx_with(&a, &s);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(":0: port 0") || err.contains("--master-port 0: port 0"),
            "{args:?}: {err}"
        );
    }
    let (code, out, err) = phalanx_with(
        &[
            "run",
            "--nnodes",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            "--rdzv-id",
            "standalone",
            "--",
            "sh",
            "-c",
            "echo port=$MASTER_PORT",
        ],
        &s,
    );
    assert_eq!(code, 0, "{err}");
    let port: u16 = out
        .lines()
        .find_map(|l| l.strip_prefix("[rank 0] port="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in: {out}"));
    assert_ne!(port, 0, "{out}");
}

/// What a PyTorch user brings: torchrun's --standalone and --no-python are
/// taken (what a one-node `phalanx run` does anyway), another torchrun flag
/// is named rather than run as the program, a `.py` file is told to go
/// through its interpreter, the `PET_*` variables Kubeflow sets are read as
/// the flags, `--nproc-per-node cpu` is the host's cores, and workers get
/// torchrun's role variables and unbuffered Python output.
#[test]
fn torchrun_flags_and_variables_a_pytorch_user_brings() {
    let (code, _, err) = phalanx_with(
        &[
            "run",
            "--standalone",
            "--no-python",
            "--nproc-per-node",
            "1",
            "--",
            "true",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = phalanx_with(&["run", "--tee", "3", "--", "true"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown flag --tee"), "{err}");
    let (code, _, err) = phalanx_with(&["run", "--", "no_such_train.py"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("`-- python -u no_such_train.py`"), "{err}");
    // An executable script on PATH is run as it is.
    let bin = phalanx::fsutil::ScratchDir::new("phalanx", "pybin");
    let script = bin.join("hello_phalanx.py");
    std::fs::write(&script, "#!/bin/sh\necho hello from the script\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let (code, out, err) = phalanx_with(&["run", "--", "hello_phalanx.py"], &[("PATH", &path)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("hello from the script"), "{out}");
    let (code, _, err) = phalanx_with(&["run", "--nproc-per-node", "gpu", "--", "true"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("give the number of processes"), "{err}");
    let show = "echo \"$RANK $WORLD_SIZE $ROLE_NAME $ROLE_RANK $PYTHONUNBUFFERED\"";
    let (code, out, err) = phalanx_with(
        &["run", "--", "sh", "-c", show],
        &[("PET_NPROC_PER_NODE", "2")],
    );
    assert_eq!(code, 0, "{err}");
    for r in 0..2 {
        assert!(
            out.contains(&format!("[rank {r}] {r} 2 default {r} 1")),
            "{out}"
        );
    }
    // In a Kubeflow pod that also has RANK and WORLD_SIZE (the operator
    // sets both), `phalanx run` still launches with the PET_* flags.
    let (code, out, err) = phalanx_with(
        &["run", "--", "sh", "-c", show],
        &[
            ("PET_NPROC_PER_NODE", "2"),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("[rank 1] 1 2 default 1 1"), "{out}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let (code, out, err) = phalanx_with(
        &[
            "run",
            "--nproc-per-node",
            "cpu",
            "--",
            "sh",
            "-c",
            "echo $WORLD_SIZE",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("[rank 0] {cores}")), "{out}");
}

/// A worker stopped because another failed gets torchrun's 30 s between
/// SIGTERM and SIGKILL (a save-on-preemption handler finishes; it used to
/// be killed after 3 s), or `--shutdown-timeout`'s.
#[test]
fn stopped_workers_get_the_shutdown_timeout_to_finish() {
    let script = "if [ $RANK = 1 ]; then sleep 1; exit 3; fi; \
                  trap 'sleep 4; echo \"rank 0 saved\" >&2; exit 0' TERM; \
                  sleep 60 & wait";
    let (code, _, err) = phalanx_with(
        &["run", "--nproc-per-node", "2", "--", "sh", "-c", script],
        &[],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("rank 0 saved"), "{err}");
    let (code, _, err) = phalanx_with(
        &[
            "run",
            "--nproc-per-node",
            "2",
            "--shutdown-timeout",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        &[],
    );
    assert_eq!(code, 3, "{err}");
    assert!(!err.contains("rank 0 saved"), "{err}");
}
