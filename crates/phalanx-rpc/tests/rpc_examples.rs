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
