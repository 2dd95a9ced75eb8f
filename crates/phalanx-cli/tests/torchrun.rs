//! `phalanx train` under real torchrun (from the torch wheel): it
//! rendezvouses through the agent's TCPStore and trains with the losses
//! `phalanx run` gives, under static and c10d rendezvous, `--standalone`,
//! and two agents as two nodes; `--max-restarts` restarts a killed worker's
//! group, which resumes from the latest checkpoint and ends bitwise equal
//! to an uninterrupted run; a config error is the root cause in torchrun's
//! failure summary.
//!
//! These need torchrun: they are ignored by default and run with
//! `cargo test --release -p phalanx-cli --test torchrun -- --ignored`, with
//! `PHALANX_TORCHRUN` naming it (default `torchrun` on PATH). `.ci/run`
//! installs torch in a virtual environment and runs them.

mod common;
use common::*;

use std::process::Command;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(240);

fn torchrun() -> Command {
    let t = std::env::var("PHALANX_TORCHRUN").unwrap_or_else(|_| "torchrun".into());
    let mut c = Command::new(t);
    c.current_dir(repo())
        .env_remove("RANK")
        .env_remove("PHALANX_FAULT")
        .env_remove("PHALANX_RESTART_COUNT")
        .env_remove("TORCHELASTIC_RESTART_COUNT")
        .env_remove("TORCHELASTIC_ERROR_FILE");
    c
}

/// Held by each run on torchrun's default static rendezvous, whose agent
/// listens on port 29500: two at once would meet EADDRINUSE.
static DEFAULT_PORT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn default_port() -> std::sync::MutexGuard<'static, ()> {
    DEFAULT_PORT.lock().unwrap_or_else(|p| p.into_inner())
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// Two torchrun agents as nodes 0 and 1 of one job (static rendezvous at
/// 127.0.0.1:`port`, one `phalanx train TRAIN` rank each), running.
fn two_nodes(
    port: &str,
    train: &[String],
    secret: Option<&str>,
) -> Vec<std::thread::JoinHandle<Run>> {
    (0..2)
        .map(|node| {
            let mut c = torchrun();
            c.args(["--nnodes", "2", "--node-rank", &node.to_string()])
                .args(["--master-addr", "127.0.0.1", "--master-port", port])
                .args(["--nproc-per-node", "1", "--no-python", BIN, "train"])
                .args(train);
            match secret {
                Some(s) => c.env("PHALANX_SECRET", s),
                None => c.env_remove("PHALANX_SECRET"),
            };
            std::thread::spawn(move || run_until(c, DEADLINE))
        })
        .collect()
}

fn dir(name: &str) -> ScratchDir {
    fresh_dir("phalanx-torchrun", name)
}

/// One node, several ways torchrun rendezvouses: each run's losses equal
/// `phalanx run`'s, bit for bit (the same ranks reduce in the same order).
#[test]
#[ignore = "needs torchrun (pip install torch); run with --ignored"]
fn two_ranks_under_torchrun_train_with_phalanx_runs_losses() {
    let d = dir("same");
    let want = reference_losses(&d, 6, &[]);
    assert_eq!(want.len(), 6);
    let port = free_port();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let ways: Vec<(&str, Vec<String>)> = vec![
        ("default", vec![]),
        ("standalone", vec!["--standalone".into()]),
        (
            "static",
            vec![
                "--rdzv-backend".into(),
                "static".into(),
                "--master-addr".into(),
                "127.0.0.1".into(),
                "--master-port".into(),
                port,
            ],
        ),
        (
            "c10d",
            vec![
                "--nnodes".into(),
                "1".into(),
                "--rdzv-backend".into(),
                "c10d".into(),
                "--rdzv-endpoint".into(),
                endpoint,
                "--rdzv-id".into(),
                "job-7".into(),
            ],
        ),
    ];
    for (name, flags) in ways {
        let log = d.join(format!("{name}.jsonl"));
        let mut c = torchrun();
        c.args(&flags)
            .args(["--nproc-per-node", "2", "--no-python", BIN, "train"])
            .args(train_args(&log, 6));
        let held = flags.is_empty().then(default_port);
        let r = run_until(c, DEADLINE);
        drop(held);
        assert_eq!(r.code, 0, "torchrun {name}: {r}");
        assert!(r.out.contains("on 2 rank(s) (dp 2"), "torchrun {name}: {r}");
        assert_eq!(losses(&log), want, "torchrun {name}: {r}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Two torchrun agents on this host as two nodes of one job (static
/// rendezvous, node 0 serving the store), one rank each, the job secret
/// exported to both as a multi-node job needs.
#[test]
#[ignore = "needs torchrun (pip install torch); run with --ignored"]
fn two_torchrun_nodes_form_one_job() {
    let d = dir("nodes");
    let want = reference_losses(&d, 4, &[]);
    let port = free_port();
    let secret = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    let log = d.join("nodes.jsonl");
    let nodes = two_nodes(&port, &train_args(&log, 4), Some(secret));
    for (node, h) in nodes.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_eq!(r.code, 0, "node {node}: {r}");
    }
    assert_eq!(losses(&log), want);
    let _ = std::fs::remove_dir_all(&d);
}

/// Without the job secret, a two-node job refuses to start, and torchrun's
/// summary on each node says how to set it.
#[test]
#[ignore = "needs torchrun (pip install torch); run with --ignored"]
fn a_multi_node_job_without_a_secret_is_refused_in_the_summary() {
    let d = dir("nosecret");
    let port = free_port();
    let nodes = two_nodes(&port, &train_args(&d.join("log.jsonl"), 2), None);
    for (node, h) in nodes.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_ne!(r.code, 0, "node {node}: {r}");
        let summary = &r.err[r.err.find("Root Cause").expect("a summary")..];
        assert!(
            summary.contains("PHALANX_SECRET is not set"),
            "node {node}: {r}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `--max-restarts 1`: rank 1 dies at step 5 of 8 (checkpoints every 2);
/// torchrun restarts the workers with TORCHELASTIC_RESTART_COUNT=1, they
/// resume from step 4, and the run ends bitwise where an uninterrupted one ends.
#[test]
#[ignore = "needs torchrun (pip install torch); run with --ignored"]
fn a_killed_worker_is_restarted_by_torchrun_and_ends_bitwise_equal() {
    let d = dir("restart");
    let ckpt = |name: &str| {
        vec![
            "--set".to_string(),
            "checkpoint.interval=2".into(),
            "--set".into(),
            format!("checkpoint.dir=\"{}\"", d.join(name).display()),
        ]
    };
    let want = reference_losses(&d, 8, &ckpt("ref-ckpt"));
    let log = d.join("restart.jsonl");
    let mut c = torchrun();
    c.args([
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "2",
        "--no-python",
        BIN,
    ])
    .arg("train")
    .args(train_args(&log, 8))
    .args(ckpt("ckpt"))
    .env("PHALANX_FAULT", "exit-at-step:1:5");
    let held = default_port();
    let r = run_until(c, DEADLINE);
    drop(held);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.err.contains("PHALANX_FAULT: rank 1 at step 5"), "{r}");
    assert!(
        r.out
            .contains("restart 1 of this job: resuming from the latest checkpoint"),
        "{r}"
    );
    assert!(r.out.contains("step-00000004 (step 4, saved by"), "{r}");
    let got = losses(&log);
    let steps: Vec<u64> = got.iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..8).collect::<Vec<_>>(), "{r}");
    assert_eq!(got, want, "{r}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A config error is the root cause in torchrun's failure summary (read
/// from the error file every rank writes), not `<N/A>`.
#[test]
#[ignore = "needs torchrun (pip install torch); run with --ignored"]
fn a_config_error_is_the_root_cause_in_torchruns_summary() {
    let mut c = torchrun();
    c.args(["--nproc-per-node", "2", "--no-python", BIN, "train"])
        .args(["--set", "optim.lr=nan"]);
    let held = default_port();
    let r = run_until(c, DEADLINE);
    drop(held);
    assert_ne!(r.code, 0, "{r}");
    assert!(r.err.contains("Root Cause"), "{r}");
    let summary = &r.err[r.err.find("Root Cause").unwrap()..];
    assert!(
        summary.contains("optim.lr") && summary.contains("rank 0 ("),
        "torchrun's summary must carry the message:\n{r}"
    );
    assert!(!summary.contains("error_file: <N/A>"), "{r}");
}
