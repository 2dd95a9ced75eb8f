//! Secrets and hostile clients, as real processes: a job that may span hosts
//! needs a real secret, weak secrets are refused, and a flood of bad clients
//! at the store costs a few log lines.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
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
                ("SLURM_STEP_ID", "0"),
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

/// A single-host job without PHALANX_SECRET (torchrun-, mpirun- or
/// srun-style variables) no longer uses a key any local user can compute
/// (`phalanx-job-<jobid>-127.0.0.1-<port>`): rank 0 makes a random secret
/// in a 0600 file of a 0700 per-user directory, the other rank reads it.
#[test]
fn a_single_host_job_without_a_secret_makes_a_private_one() {
    use std::os::unix::fs::PermissionsExt;
    let rt = phalanx::fsutil::ScratchDir::new("phalanx", "xdg");
    std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o700)).unwrap();
    let port = free_port();
    let p = port.to_string();
    let kids: Vec<_> = (0..2)
        .map(|r| {
            let r = r.to_string();
            let mut c = worker(&[
                ("RANK", &r),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &p),
            ]);
            c.env("XDG_RUNTIME_DIR", &rt);
            c.spawn().unwrap()
        })
        .collect();
    // Hold rank 1 back, so that the job (rank 0's store, the file) is
    // there while we look.
    unsafe { libc::kill(kids[1].id() as i32, libc::SIGSTOP) };
    let dir = rt.join("phalanx");
    let end = Instant::now() + Duration::from_secs(30);
    let file = loop {
        let found = std::fs::read_dir(&dir).ok().and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "secret"))
        });
        if let Some(f) = found {
            break f;
        }
        assert!(
            Instant::now() < end,
            "no secret file in {} within 30 s",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&file), 0o600, "{}", file.display());
    assert_eq!(mode(&dir), 0o700, "{}", dir.display());
    let secret = phalanx_comm::wire::from_hex(std::fs::read_to_string(&file).unwrap().trim())
        .expect("a hex secret");
    assert_eq!(secret.len(), 32);
    // The key anyone could compute opens nothing; the file's secret opens
    // the store (so it is the job's).
    let addr = format!("127.0.0.1:{port}");
    let old = format!("phalanx-job--127.0.0.1-{port}");
    let t = Duration::from_secs(20);
    match phalanx_comm::store::StoreClient::connect(&addr, old.as_bytes(), t) {
        Err(phalanx_comm::CommError::Auth(_)) => {}
        Err(e) => panic!("the computable key: {e}"),
        Ok(_) => panic!("the computable key {old:?} opened the job's store"),
    }
    phalanx_comm::store::StoreClient::connect(&addr, &secret, t).unwrap();
    unsafe { libc::kill(kids[1].id() as i32, libc::SIGCONT) };
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Rank 0 removes it with its group.
    assert!(!file.exists(), "{} left behind", file.display());
    let _ = std::fs::remove_dir_all(&rt);
}

/// A secret directory someone else could enter is refused, naming it.
#[test]
fn a_shared_secret_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let rt = std::env::temp_dir().join(format!("phalanx-xdg-open-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rt);
    std::fs::create_dir_all(rt.join("phalanx")).unwrap();
    std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(rt.join("phalanx"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = worker(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])
    .env("XDG_RUNTIME_DIR", &rt)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot hold the job secret") && err.contains("755"),
        "{err}"
    );
    assert!(err.contains("PHALANX_SECRET"), "{err}");
    let _ = std::fs::remove_dir_all(&rt);
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
            // Long enough for 60 clients on a loaded machine.
            "sleep",
            "5",
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
