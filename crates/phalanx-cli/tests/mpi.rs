//! `phalanx train` and `phalanx bench collectives` under `mpirun` on the MPI
//! backend (`--features mpi`): the same losses as the native transports.

#![cfg(feature = "mpi")]

mod common;

use common::{fresh_dir, repo, BIN, SMALL};
use std::process::Command;

/// `mpirun -np n phalanx <args>` in the repository: (success, stdout+stderr).
fn mpirun(n: usize, args: &[&str]) -> (bool, String) {
    let o = Command::new("mpirun")
        .args(["--oversubscribe", "-np", &n.to_string(), BIN])
        .args(args)
        .current_dir(repo())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("PHALANX_TIMEOUT", "120")
        .output()
        .expect("mpirun not found: install Open MPI (Debian: openmpi-bin libopenmpi-dev)");
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

fn losses(log: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

/// Train `layout` on `n` ranks under mpirun (MPI backend) and with
/// `phalanx train --nproc-per-node n` (native); the losses must agree.
fn same_losses_as_native(n: usize, name: &str, layout: &[&str]) {
    let d = fresh_dir("phx-mpi", name);
    let mut args = vec!["train", "--set", "train.steps=4"];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(layout);
    let (mpi_log, native_log) = (d.join("mpi.jsonl"), d.join("native.jsonl"));
    let mut a = args.clone();
    a.extend(["--log-json", mpi_log.to_str().unwrap()]);
    let (ok, out) = mpirun(n, &a);
    assert!(ok, "mpirun train {layout:?}:\n{out}");
    let mut a = args.clone();
    let np = n.to_string();
    a.extend(["--nproc-per-node", &np]);
    a.extend(["--log-json", native_log.to_str().unwrap()]);
    let o = Command::new(BIN)
        .args(&a)
        .current_dir(repo())
        .env("PHALANX_BACKEND", "native")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "native train {layout:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (m, nat) = (losses(&mpi_log), losses(&native_log));
    assert_eq!(m.len(), 4, "{out}");
    assert_eq!(m.len(), nat.len());
    for (k, (a, b)) in m.iter().zip(&nat).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "{layout:?} step {k}: mpi {a} vs native {b}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn train_under_mpirun_matches_the_native_backend() {
    same_losses_as_native(2, "ddp", &[]);
    same_losses_as_native(2, "zero3", &["--set", "zero_optimization.stage=3"]);
    // dp 1 x pp 2 x tp 2: sub-groups, point-to-point and TP collectives.
    same_losses_as_native(
        4,
        "3d",
        &["--set", "parallel.tp=2", "--set", "parallel.pp=2"],
    );
}

#[test]
fn bench_collectives_backend_mpi() {
    let (ok, out) = mpirun(
        2,
        &[
            "bench",
            "collectives",
            "--backend",
            "mpi",
            "--op",
            "all",
            "--sizes",
            "8,64K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--check",
        ],
    );
    assert!(ok, "{out}");
    assert!(out.contains("backend mpi (links: mpi)"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_lowercase()))
        .filter(|l| l.contains(" f32 "))
        .collect();
    assert_eq!(rows.len(), 12, "6 ops x 2 sizes:\n{out}");
    assert!(
        rows.iter().all(|r| r.trim_end().ends_with(" 0")),
        "no wrong results:\n{out}"
    );
}
