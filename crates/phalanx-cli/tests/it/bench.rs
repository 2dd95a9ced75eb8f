//! `phalanx bench collectives`: bad input is refused at once, naming the
//! option and value, before any rank starts. `phalanx bench optimizer`:
//! the device's step checked against the host's.

use crate::common;

use std::process::Command;

use common::BIN;

/// Processes of ours still carrying `mark` in their environment.
fn leftovers(mark: &str) -> Vec<String> {
    let needle = format!("PHALANX_TEST_MARK={mark}");
    let mut left = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(env) = std::fs::read(e.path().join("environ")) {
            if env.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
                left.push(name);
            }
        }
    }
    left
}

/// Run `phalanx bench collectives ARGS` outside a job; (exit code, stdout,
/// stderr).
fn bench(args: &[&str]) -> (i32, String, String) {
    let mark = format!("bench-{}-{}", std::process::id(), args.join("_"));
    let out = Command::new(BIN)
        .args(["bench", "collectives", "--nproc", "2"])
        .args(args)
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .env("PHALANX_TEST_MARK", &mark)
        .output()
        .unwrap();
    let left = leftovers(&mark);
    assert!(left.is_empty(), "{args:?} left processes {left:?} running");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn bad_sizes_and_iterations_are_refused_naming_them() {
    // (arguments, what the message must contain)
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--sizes", "8:18446744073709551615", "--iters", "1"],
            &["--sizes", "18446744073709551615 B", "memory"],
        ),
        (
            &["--sizes", "18446744073709551615G"],
            &["--sizes", "18446744073709551615G", "too large"],
        ),
        (
            &["--sizes", "100000G"],
            &["--sizes", "size 107374182400000 B", "available"],
        ),
        (&["--sizes", "0"], &["--sizes", "size 0"]),
        (
            &["--sizes", "7"],
            &["--sizes", "size 7 B", "multiple", "f32"],
        ),
        (&["--sizes", "8,1K,7"], &["size 7 B", "multiple"]),
        (&["--sizes", "12", "--dtype", "f64"], &["size 12 B", "f64"]),
        (&["--sizes", "6:64"], &["size 6 B", "multiple"]),
        (&["--sizes", "0:64"], &["--sizes", "range"]),
        (&["--sizes", "64:8"], &["--sizes", "range"]),
        (
            &["--sizes", "8:64", "--factor", "1"],
            &["--sizes", "factor"],
        ),
        (&["--sizes", "1T"], &["--sizes", "unit"]),
        (&["--sizes", "abc"], &["--sizes", "\"abc\""]),
        (&["--sizes=-8"], &["--sizes", "\"-8\""]),
        (&["--iters", "0"], &["--iters"]),
        (&["--dtype", "f8"], &["--dtype", "f8"]),
        (&["--op", "all_sum"], &["all_sum"]),
        #[cfg(not(feature = "nccl"))]
        (
            &["--backend", "nccl"],
            &["nccl", "not built", "--features nccl"],
        ),
        #[cfg(not(feature = "mpi"))]
        (&["--backend", "mpi"], &["--backend mpi", "not built"]),
        #[cfg(feature = "mpi")]
        (&["--backend", "mpi"], &["--backend mpi", "mpirun"]),
        (
            &["--backend", "carrier-pigeon"],
            &["carrier-pigeon", "shm, uds, tcp"],
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = bench(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        for w in *want {
            assert!(err.contains(w), "{args:?}: {w:?} missing from: {err}");
        }
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.lines().count() == 1, "{args:?}: want one line: {err}");
        // Before any rank started: no rank said anything (its lines carry
        // a "[rank N]" prefix) and nothing was measured.
        assert!(!err.contains("[rank "), "{args:?}: {err}");
        assert!(out.trim().is_empty(), "{args:?}: measured: {out}");
    }
}

/// `--nproc 0` is refused naming `--nproc` (the launcher's own check
/// named `--nproc-per-node`, which was not given).
#[test]
fn no_ranks_is_refused_naming_nproc() {
    let o = Command::new(BIN)
        .args(["bench", "collectives", "--nproc", "0"])
        .env_remove("RANK")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--nproc must be at least 1"), "{err}");
}

#[test]
fn a_small_sweep_still_runs() {
    let mark = format!("bench-ok-{}", std::process::id());
    let out = Command::new(BIN)
        .args([
            "bench",
            "collectives",
            "--nproc",
            "2",
            "--sizes",
            "4:64",
            "--iters",
            "1",
        ])
        .args(["--warmup", "0", "--check", "--json"])
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .env("PHALANX_TEST_MARK", &mark)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for b in ["\"bytes\":4,", "\"bytes\":16,", "\"bytes\":64,"] {
        assert!(so.contains(b), "{b} missing from {so}");
    }
    assert!(leftovers(&mark).is_empty());
}

#[test]
fn every_backend_runs_over_the_links_it_names() {
    for (backend, link) in [
        ("shm", "shm"),
        ("uds", "unix"),
        ("tcp", "tcp"),
        ("auto", "shm"),
    ] {
        let mark = format!("bench-{backend}-{}", std::process::id());
        let out = Command::new(BIN)
            .args(["bench", "collectives", "--nproc", "3", "--op", "all"])
            .args([
                "--sizes", "8,1M", "--iters", "2", "--warmup", "1", "--check",
            ])
            .args(["--backend", backend])
            .env_remove("RANK")
            .env_remove("PHALANX_SECRET")
            .env_remove("PHALANX_TRANSPORT")
            .env("PHALANX_TEST_MARK", &mark)
            .output()
            .unwrap();
        let so = String::from_utf8_lossy(&out.stdout);
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backend}: {so}\n{se}");
        assert!(
            so.contains(&format!("backend {backend} (links: {link})")),
            "{backend}: {so}"
        );
        // Six ops at two sizes, none wrong.
        let rows: Vec<&str> = so
            .lines()
            .filter(|l| !l.contains('#') && !l.trim().is_empty())
            .collect();
        assert_eq!(rows.len(), 12, "{backend}: {so}");
        assert!(rows.iter().all(|l| l.trim_end().ends_with(" 0")), "{so}");
        // And the all-reduce of tensors where they lie (host memory here).
        assert!(
            so.contains("# all_reduce, all_gather and reduce_scatter of tensors in place on cpu")
                && so.contains(", 0 wrong"),
            "{backend}: {so}"
        );
        assert!(leftovers(&mark).is_empty());
    }
}

/// `phalanx bench optimizer ARGS`: (exit code, stdout, stderr).
fn bench_optimizer(args: &[&str]) -> (i32, String, String) {
    common::phalanx(&[&["bench", "optimizer"], args].concat())
}

#[test]
fn the_optimizer_bench_checks_the_device_against_the_host() {
    let (code, out, err) = bench_optimizer(&["--check", "--params", "100k", "--steps", "1"]);
    assert_eq!(code, 0, "{out}\n{err}");
    // Six checks, each within the tolerance: on the CPU bit for bit.
    let checks: Vec<&str> = out.lines().filter(|l| l.starts_with("check ")).collect();
    assert_eq!(checks.len(), 6, "{out}");
    for c in &checks {
        assert!(c.ends_with("difference 0.00e0 (ok)"), "not bitwise: {c}");
    }
    for way in ["host", "device", "device, resident", "device, deferred"] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(way) && l.contains("ms per step")),
            "no timing for {way}: {out}"
        );
    }
    // Bad input names what is wrong; a cuda device needs the feature (or a GPU).
    let (code, _, err) = bench_optimizer(&["--params", "lots"]);
    assert_eq!(code, 1);
    assert!(err.contains("--params") && err.contains("lots"), "{err}");
    // More than the machine holds: refused with the numbers, no abort.
    let (code, _, err) = bench_optimizer(&["--params", "1T", "--steps", "1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("of memory is available"), "{err}");
    let (code, _, err) = bench_optimizer(&["--device", "tpu"]);
    assert_eq!(code, 1);
    assert!(err.contains("--device") && err.contains("tpu"), "{err}");
    let (code, _, err) = bench_optimizer(&["--device", "cuda", "--params", "1k"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cuda"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
