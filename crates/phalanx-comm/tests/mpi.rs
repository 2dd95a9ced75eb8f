//! The MPI backend (`--features mpi`) under `mpirun`: the same collective
//! suite as the native transports, then a rank that dies and a rank that
//! stalls past the deadline.
//!
//! Each `rank_*` test is the body of one rank, ignored in a plain run: a
//! driver test below starts this binary under `mpirun` with `--ignored
//! --exact rank_…` (and sets `PHALANX_MPI_TEST`).

#![cfg(feature = "mpi")]

mod suite;

use phalanx_comm::{init_process_group, Link, ProcessGroup, ReduceOp};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run this binary's test `name` on `n` ranks under `mpirun`; returns
/// (success, combined output). Killed after `limit`.
fn mpirun(n: usize, name: &str, env: &[(&str, &str)], limit: Duration) -> (bool, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", &n.to_string()])
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PHALANX_MPI_TEST", "1")
        .env("PHALANX_BACKEND", "mpi")
        // CI runs as root; Open MPI refuses that unless told.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .expect("mpirun not found: install Open MPI (Debian: openmpi-bin libopenmpi-dev)");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mpirun -np {n} {name} ran past {limit:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (status.success(), text)
}

fn must_pass(n: usize, name: &str) {
    must_pass_with(n, name, &[]);
}

fn must_pass_with(n: usize, name: &str, env: &[(&str, &str)]) {
    // Each rank leaves a file when its body is done (the ranks' outputs
    // interleave, so counting lines of it is not reliable).
    let dir = std::env::temp_dir().join(format!("phx-mpi-{name}-{n}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let mut env = env.to_vec();
    env.push(("PHALANX_MPI_TEST_DONE", d));
    let (ok, out) = mpirun(n, name, &env, Duration::from_secs(120));
    assert!(ok, "mpirun -np {n} {name} failed:\n{out}");
    let done = std::fs::read_dir(&dir).unwrap().count();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(done, n, "{name}: {done} of {n} ranks finished:\n{out}");
}

/// One rank's body: the world group on MPI, then `f`, then shutdown.
fn rank(f: impl FnOnce(&ProcessGroup)) {
    assert!(
        std::env::var_os("PHALANX_MPI_TEST").is_some(),
        "a rank body: run by the driver tests under mpirun"
    );
    let pg = init_process_group().unwrap();
    for j in (0..pg.size()).filter(|&j| j != pg.rank()) {
        assert_eq!(pg.link(j), Some(Link::Mpi));
    }
    f(&pg);
    let r = pg.rank();
    pg.shutdown();
    if let Some(d) = std::env::var_os("PHALANX_MPI_TEST_DONE") {
        std::fs::write(std::path::Path::new(&d).join(format!("rank-{r}")), b"ok").unwrap();
    }
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_small_counts() {
    rank(suite::small_counts);
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_large_counts() {
    rank(|pg| suite::large_counts(pg, 2_000_001));
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_send_recv_async() {
    rank(suite::send_recv_tags_and_async);
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_subgroups() {
    rank(suite::subgroups);
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_bytes_and_agreement() {
    rank(|pg| {
        // Irrational-ish values: every rank must get the same bits.
        let mut x: Vec<f32> = (0..10_007)
            .map(|i| ((i * (pg.rank() + 3)) as f32).sin() / 7.0)
            .collect();
        let before = pg.bytes_sent();
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        // Counted as the ring would move it: 2 (n-1)/n of the buffer.
        let n = pg.size();
        assert_eq!(
            pg.bytes_sent() - before,
            (2 * 10_007 * 4 * (n - 1) / n) as u64
        );
        let mut all = vec![0f32; 10_007 * n];
        pg.all_gather(&x, &mut all).unwrap();
        for k in 1..n {
            assert_eq!(&all[k * 10_007..(k + 1) * 10_007], &all[..10_007]);
        }
    });
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_byte_messages() {
    rank(|pg| {
        let long = Duration::from_secs(30);
        if pg.rank() == 0 {
            for (tag, len) in [(3u64, 0usize), (1 << 40, 5), (9, 100_000)] {
                let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                pg.send_bytes(1, tag, &data, long).unwrap();
            }
        } else {
            // Received in another order than sent, each with its length.
            for (tag, len) in [(9u64, 100_000usize), (3, 0), (1 << 40, 5)] {
                let m = pg.recv_bytes(0, tag, Instant::now() + long).unwrap();
                assert_eq!(m.len(), len);
                assert!(m
                    .bytes()
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 251) as u8));
            }
            // Nothing under this tag: a plain timeout error.
            let e = pg.recv_bytes(0, 77, Instant::now() + Duration::from_millis(200));
            assert!(
                matches!(e, Err(phalanx_comm::CommError::Timeout(_))),
                "{:?}",
                e.err()
            );
        }
        pg.barrier().unwrap();
    });
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_detail_mismatch() {
    rank(|pg| {
        // PHALANX_DEBUG=detail: ranks that call the same collective with
        // different sizes get an error naming each rank's call, on MPI too.
        let mut x = vec![0f32; 3 + pg.rank()];
        let e = pg
            .all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0 called all_reduce(f32, count=3, op=sum)")
                && e.contains("rank 1 called all_reduce(f32, count=4, op=sum)"),
            "{e}"
        );
        // Matching calls go on working.
        let mut y = [1i32];
        pg.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        assert_eq!(y[0], pg.size() as i32);
    });
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_one_dies() {
    rank(|pg| {
        if pg.rank() == 1 {
            eprintln!("rank 1 exits on purpose");
            std::process::exit(7);
        }
        let mut x = [1f32];
        let _ = pg.all_reduce(&mut x, ReduceOp::Sum);
        unreachable!("the all-reduce cannot complete without rank 1");
    });
}

#[test]
#[ignore = "one rank's body, run under mpirun by the driver tests"]
fn rank_one_stalls() {
    rank(|pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(60));
        }
        let mut x = [1f32];
        let _ = pg.all_reduce(&mut x, ReduceOp::Sum);
    });
}

#[test]
fn collective_suite_under_mpirun() {
    for n in [1, 2, 3, 5] {
        must_pass(n, "rank_small_counts");
    }
    for n in [2, 3] {
        must_pass(n, "rank_large_counts");
    }
    must_pass(3, "rank_send_recv_async");
    must_pass(4, "rank_subgroups");
    must_pass(3, "rank_bytes_and_agreement");
    must_pass(2, "rank_byte_messages");
    must_pass_with(2, "rank_detail_mismatch", &[("PHALANX_DEBUG", "detail")]);
}

#[test]
fn a_dead_or_stalled_rank_ends_the_job() {
    // mpirun ends the job when a rank exits early and says which.
    let (ok, out) = mpirun(3, "rank_one_dies", &[], Duration::from_secs(60));
    assert!(!ok, "the job must fail:\n{out}");
    assert!(!out.contains("unreachable"), "{out}");
    // Open MPI names the process: [[job,1],rank].
    assert!(out.contains("],1]"), "mpirun must name rank 1:\n{out}");
    // A stalled rank: the waiting ranks abort at the deadline, naming the op.
    let (ok, out) = mpirun(
        2,
        "rank_one_stalls",
        &[("PHALANX_TIMEOUT", "2")],
        Duration::from_secs(50),
    );
    assert!(!ok, "the job must fail:\n{out}");
    assert!(
        out.contains("rank 0: aborting the MPI job: all_reduce(f32, count=1) did not complete"),
        "{out}"
    );
}
