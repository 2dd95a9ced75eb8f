//! Secrets and hostile clients, as real processes: a job that may span hosts
//! needs a real secret, weak secrets are refused, and a flood of bad clients
//! at the store costs a few log lines.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{BIN, LAUNCHER_VARS};

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A `_test-worker` started by hand with `vars`, as torchrun / mpirun / srun
/// would start it.
fn worker(vars: &[(&str, &str)]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["_test-worker", "--iters", "2"])
        .env("MASTER_PORT", free_port().to_string())
        .env("PHALANX_TIMEOUT", "20")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    c.env_remove("PHALANX_SECRET");
    for (k, v) in vars {
        c.env(k, v);
    }
    c
}

/// (variables, words the error must contain)
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

#[test]
fn jobs_that_may_span_hosts_need_a_strong_secret() {
    let short = "00112233";
    let not_hex = "zz112233445566778899aabbccddeeff";
    let cases: &[Case] = &[
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "1"),
            ],
            &[
                "export PHALANX_SECRET",
                "1 of its 2 ranks are local",
                "torchrun",
            ],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "192.0.2.7"),
            ],
            &["export PHALANX_SECRET", "MASTER_ADDR=192.0.2.7"],
        ),
        (
            &[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ],
            &["export PHALANX_SECRET", "mpirun", "2 of its 4"],
        ),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ],
            &["export PHALANX_SECRET", "srun"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("PHALANX_SECRET", short),
            ],
            &["PHALANX_SECRET is too short", "4 bytes", "at least 16"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("PHALANX_SECRET", not_hex),
            ],
            &["PHALANX_SECRET is not hex"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("PHALANX_SECRET", "00112233445566778899aabbccddeef"),
            ],
            &["PHALANX_SECRET is not hex"],
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("PHALANX_SECRET", "+0112233445566778899aabbccddeeff"),
            ],
            &["PHALANX_SECRET is not hex"],
        ),
    ];
    for (vars, want) in cases {
        let out = worker(vars).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{vars:?}: {err}");
        for w in *want {
            assert!(err.contains(w), "{vars:?}: {w:?} missing from: {err}");
        }
        // The secret itself is never echoed.
        for s in [short, not_hex] {
            assert!(!err.contains(s), "{vars:?}: secret echoed: {err}");
        }
        // Refused before waiting for any other rank: waiting for rank 1,
        // which never comes, ends in a timeout (PHALANX_TIMEOUT=20).
        assert!(!err.contains("timeout"), "{vars:?}: {err}");
    }
}

#[test]
fn a_single_host_job_runs_without_a_secret() {
    let port = free_port().to_string();
    let kids: Vec<_> = (0..2)
        .map(|r| {
            let r = r.to_string();
            worker(&[
                ("RANK", &r),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
            ])
            .spawn()
            .unwrap()
        })
        .collect();
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_flood_of_bad_clients_costs_a_few_log_lines() {
    let port = free_port();
    let t0 = Instant::now();
    let child = Command::new(BIN)
        .args([
            "run",
            "--master-port",
            &port.to_string(),
            "--",
            "sleep",
            "2",
        ])
        .env_remove("PHALANX_SECRET")
        .env_remove("RANK")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut flooded = 0;
    while flooded < 60 && t0.elapsed() < Duration::from_secs(15) {
        let Ok(mut s) = std::net::TcpStream::connect(&addr) else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        // Not the protocol: refused at once, and logged.
        let _ = s.write_all(&[7u8; 40]);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        flooded += 1;
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("[phalanx store]"))
        .collect();
    assert!(
        (5..=8).contains(&lines.len()),
        "{} store lines for 60 bad clients:\n{err}",
        lines.len()
    );
    assert!(err.contains("not speaking the Phalanx protocol"), "{err}");
    assert!(err.contains("55 more such messages suppressed"), "{err}");
}
