//! The `parameter_server` and `rl_cartpole` examples, run as documented:
//! each launches its own ranks as processes and ends with a JSON line.
//! (`cargo test` builds the examples next to the test binaries.)

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    deps.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

/// Run an example with a deadline; its last line, parsed.
fn run(name: &str, args: &[&str]) -> serde_json::Value {
    let mut child = Command::new(example(name))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: {e} (built by `cargo test`?)"));
    let end = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("{name} {args:?} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{name} {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{name}: {e}: {last:?}"))
}

#[test]
fn parameter_server_trains_with_bounded_staleness() {
    let j = run(
        "parameter_server",
        &[
            "--trainers",
            "2",
            "--servers",
            "2",
            "--staleness",
            "1",
            "--steps",
            "60",
        ],
    );
    assert_eq!(
        (j["trainers"].as_u64(), j["servers"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(
        (j["steps"].as_u64(), j["staleness"].as_u64()),
        (Some(60), Some(1))
    );
    assert!(j["final_loss"].as_f64() < j["initial_loss"].as_f64(), "{j}");
    assert!(j["max_lead"].as_u64().unwrap() <= 1, "{j}");
}

#[test]
fn rl_cartpole_solves_the_task() {
    // Synchronous rounds: the same episodes on every run.
    let j = run("rl_cartpole", &["--observers", "2", "--sync"]);
    assert_eq!(j["observers"].as_u64(), Some(2));
    assert!(j["mean_return_last_100"].as_f64().unwrap() >= 195.0, "{j}");
    assert!(j["episodes"].as_u64().unwrap() >= 100, "{j}");
}

/// The pids of `pid`'s children (those its main thread started).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Whether `pid` still runs (a zombie, dead but not yet reaped by
/// whoever adopted it, does not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat[stat.rfind(')').unwrap() + 1..].trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

/// Killing an example's own launcher (SIGTERM: forwarded; SIGKILL: the
/// kernel's parent-death signal) leaves no rank running.
#[test]
fn killing_an_examples_launcher_ends_its_ranks() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGKILL, "SIGKILL")] {
        // Long enough to be running when the signal comes.
        let mut launcher = Command::new(example("parameter_server"))
            .args(["--trainers", "2", "--servers", "1", "--steps", "100000000"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("parameter_server: {e} (built by `cargo test`?)"));
        let pid = launcher.id();
        let start = Instant::now() + Duration::from_secs(60);
        let ranks = loop {
            let kids = children(pid);
            if kids.len() == 3 {
                break kids;
            }
            if Instant::now() > start {
                let _ = launcher.kill();
                panic!("{name}: the launcher started {kids:?}, not 3 ranks, within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, sig) };
        let end = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(st) = launcher.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > end {
                let _ = launcher.kill();
                panic!("{name}: the launcher did not exit within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if sig == libc::SIGTERM {
            assert_eq!(status.code(), Some(128 + sig), "{name}");
        }
        // A few seconds: SIGKILL from the kernel is immediate, SIGTERM
        // gets the ranks' 3 s grace at most.
        let end = Instant::now() + Duration::from_secs(10);
        while ranks.iter().any(|&r| alive(r)) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left: Vec<u32> = ranks.iter().copied().filter(|&r| alive(r)).collect();
        for &r in &left {
            // SAFETY: tidying up the ranks of our own launcher.
            unsafe { libc::kill(r as i32, libc::SIGKILL) };
        }
        assert!(
            left.is_empty(),
            "{name}: ranks {left:?} outlived their launcher"
        );
    }
}

/// Bad flags end an example before it starts any rank, naming the flag
/// (issue 27, item 21): zero or too many ranks, a negative staleness, zero
/// rows (a division by zero), an unknown flag; `--help` prints the usage
/// and runs nothing.
#[test]
fn the_examples_refuse_bad_flags_naming_them() {
    let cases: &[(&str, &[&str], &str)] = &[
        ("parameter_server", &["--servers", "0"], "--servers 0"),
        ("parameter_server", &["--trainers", "0"], "--trainers 0"),
        ("parameter_server", &["--trainers", "200"], "--trainers 200"),
        ("parameter_server", &["--staleness", "-1"], "--staleness -1"),
        ("parameter_server", &["--rows", "0"], "--rows 0"),
        ("parameter_server", &["--lr", "nan"], "--lr NaN"),
        ("parameter_server", &["--optim", "adam"], "--optim adam"),
        ("parameter_server", &["--stalenes", "1"], "\"--stalenes\""),
        ("rl_cartpole", &["--observers", "0"], "--observers 0"),
        ("rl_cartpole", &["--hidden", "0"], "--hidden 0"),
        ("rl_cartpole", &["--fast"], "\"--fast\""),
        ("rpc_bench", &["--size", "1"], "\"--size\""),
    ];
    for (name, args, want) in cases {
        let out = Command::new(example(name))
            .args(*args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name} {args:?}: {err}");
        assert!(err.contains(want), "{name} {args:?}: {err}");
        // Said once: by the launching process, before any rank started.
        assert_eq!(err.matches(want).count(), 1, "{name} {args:?}: {err}");
    }
    for name in ["parameter_server", "rl_cartpole", "rpc_bench"] {
        let out = Command::new(example(name)).arg("--help").output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{name} --help");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("usage: "));
    }
}
