//! Network emulation (`Config::net_emulate`, `PHALANX_NET_EMULATE`): a
//! shaped link takes at least what its bandwidth and latency say. Only
//! lower bounds are checked (a loaded machine is slower, never faster).

use phalanx_comm::{threads, Config, NetEmulate, ReduceOp};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

fn cfg(bandwidth_bps: Option<f64>, latency: Duration) -> Config {
    Config {
        net_emulate: Some(NetEmulate {
            bandwidth_bps,
            latency,
        }),
        ..Config::default()
    }
}

/// The fastest of `reps` all-reduces of `elems` f32 on 2 ranks (after one
/// warm-up), as the slower rank saw it.
fn all_reduce_time(cfg: Config, elems: usize, reps: usize) -> Duration {
    let per_rank = threads::run_with(2, cfg, DEADLINE, move |pg| {
        let mut buf = vec![1.0f32; elems];
        pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        let mut times = Vec::new();
        for _ in 0..reps {
            pg.barrier()?;
            let t = Instant::now();
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
            times.push(t.elapsed());
        }
        Ok(times)
    });
    let per_rank: Vec<Vec<Duration>> = per_rank.into_iter().map(|r| r.unwrap()).collect();
    (0..reps)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap())
        .min()
        .unwrap()
}

#[test]
fn bandwidth_bounds_a_1mb_all_reduce() {
    let bytes = 1usize << 20;
    let bps = 100e6;
    // 2 ranks: each sends 2(N-1)/N x 1 MB = 1 MB (ring or one exchange).
    let theory = Duration::from_secs_f64(bytes as f64 * 8.0 / bps);
    let shaped = all_reduce_time(cfg(Some(bps), Duration::ZERO), bytes / 4, 3);
    let free = all_reduce_time(Config::default(), bytes / 4, 3);
    eprintln!("1 MiB all-reduce, 2 ranks: theory {theory:?} at 100 Mbit/s, emulated {shaped:?}, unshaped {free:?}");
    // 0.7x: the token bucket may let a first chunk through at once.
    assert!(
        shaped >= theory.mul_f64(0.7),
        "emulated {shaped:?} vs theory {theory:?}"
    );
}

#[test]
fn latency_delays_a_tiny_all_reduce() {
    let lat = Duration::from_millis(20);
    let t = all_reduce_time(cfg(None, lat), 2, 2);
    eprintln!("8-byte all-reduce with latency 20ms: {t:?}");
    assert!(t >= lat, "{t:?} < {lat:?}");
}

/// Set on the child process that runs a test's body with its environment.
const CHILD: &str = "PHALANX_NETEM_TEST_CHILD";

/// Run this binary's test `name` again as a child process with `env` set
/// (the environment of a running test binary is not changed: other tests
/// run beside it), and fail unless it ran and passed.
fn in_child(name: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test_name!(name).as_str(),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{name} failed in a child:\n{text}");
    assert!(text.contains("1 passed"), "{name} did not run:\n{text}");
}

#[test]
fn bad_env_value_fails_init_naming_variable_and_part() {
    if std::env::var_os(CHILD).is_none() {
        in_child(
            "bad_env_value_fails_init_naming_variable_and_part",
            &[("PHALANX_NET_EMULATE", "bandwidth=fast")],
        );
        return;
    }
    // In the child, with PHALANX_NET_EMULATE set from its start.
    let c = Config::from_env();
    assert!(c.net_emulate.is_none());
    for r in threads::run_with(2, c, DEADLINE, |_pg| Ok(())) {
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("PHALANX_NET_EMULATE") && e.contains("bandwidth `fast`"),
            "{e}"
        );
    }
}

#[test]
fn parser_accepts_the_documented_form() {
    let n = NetEmulate::parse("bandwidth=1gbit,latency=100us")
        .unwrap()
        .unwrap();
    assert_eq!(n.bandwidth_bps, Some(1e9));
    assert_eq!(n.latency, Duration::from_micros(100));
    assert!(NetEmulate::parse("bandwidth=fast")
        .unwrap_err()
        .contains("fast"));
    assert!(NetEmulate::parse("latency=5parsecs")
        .unwrap_err()
        .contains("5parsecs"));
    assert!(NetEmulate::parse("loss=1%")
        .unwrap_err()
        .contains("unknown key `loss`"));
}
