//! Monitoring a running job: stragglers found by rank, the Prometheus
//! endpoint serving every rank's figures during a run, what a non-finite
//! gradient does (`train.on_nonfinite`), and a rank's error reaching its
//! peers.

use crate::common;
use common::*;
use phalanx::trainer::{Report, RunOptions};
use phalanx_models::gpt2::train::{self, GptRun};
use std::io::{Read, Write};
use std::time::Duration;

/// Run `steps` steps on `world` ranks (threads) with global rank `slow`
/// delayed by `delay` per step; every rank's report (or error).
fn run_with(
    world: usize,
    steps: usize,
    extra: &[&str],
    slow: Option<(usize, Duration)>,
) -> Vec<Result<Report, String>> {
    let mut e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    e.push(format!("train.steps={steps}"));
    let cfg = config(world, 1, &e);
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        if let Some((r, d)) = slow {
            phalanx::fault::inject_delay(r, d);
        }
        t.run(&RunOptions::default()).map_err(|e| e.to_string())
    })
}

#[test]
fn a_slow_rank_is_reported_by_rank_and_host() {
    let out = run_with(
        3,
        6,
        &["monitor.straggler_factor=3", "monitor.straggler_steps=2"],
        // Long enough to stand out on a loaded 2-core machine running
        // other tests at the same time.
        Some((1, Duration::from_millis(1500))),
    );
    for (r, o) in out.iter().enumerate() {
        let rep = o.as_ref().unwrap();
        let ranks: Vec<usize> = rep.stragglers.iter().map(|s| s.1.rank).collect();
        assert_eq!(ranks, vec![1], "rank {r}: {:?}", rep.stragglers);
        let (step, s) = &rep.stragglers[0];
        // Step 0 (warm-up) is not judged: steps 1 and 2 are the first two
        // (a loaded machine may make one of them look fast).
        assert!(
            (2..6).contains(step),
            "reported after 2 slow steps in a row, at {step}"
        );
        assert!(s.compute_s > 3.0 * s.median_s, "{s}");
        assert_eq!(s.host, phalanx::monitor::hostname());
    }
}

#[test]
fn without_a_slow_rank_nobody_is_reported() {
    let out = run_with(2, 5, &["monitor.straggler_factor=3"], None);
    for o in out {
        assert!(o.unwrap().stragglers.is_empty());
    }
}

fn get(url_port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", url_port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

#[test]
fn the_metrics_endpoint_serves_every_rank_during_the_run() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let set = format!("monitor.prometheus_port={port}");
    let trainer = std::thread::spawn(move || {
        run_with(
            2,
            40,
            &[&set, "train.precision=fp16"],
            Some((1, Duration::from_millis(100))),
        )
    });
    let want = [
        "phalanx_step{",
        "phalanx_loss{",
        "phalanx_tokens_per_second{",
        "phalanx_step_seconds{",
        "phalanx_compute_seconds{",
        "phalanx_grad_norm{",
        "phalanx_comm_bytes_total{",
        "phalanx_loss_scale{",
        "phalanx_mfu{",
        "phalanx_straggler{",
    ];
    let mut seen = None;
    for _ in 0..200 {
        if let Some(b) = get(port, "/metrics") {
            if want.iter().all(|w| b.contains(w)) && b.contains("rank=\"1\"") {
                seen = Some(b);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = seen.expect("the endpoint served every metric during the run");
    assert!(body.contains("kind=\"params\""), "{body}");
    assert!(body.contains("kind=\"peak_rss\""), "{body}");
    assert!(body.contains("# TYPE phalanx_comm_bytes counter"), "{body}");
    let missing = get(port, "/nope").unwrap_or_default();
    assert!(missing.contains("404"), "{missing}");
    for r in trainer.join().unwrap() {
        r.unwrap();
    }
    // The endpoint ends with the run.
    assert!(get(port, "/metrics").is_none());
}

#[test]
fn a_port_in_use_stops_every_rank_before_training() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let set = format!("monitor.prometheus_port={port}");
    for (r, o) in run_with(2, 3, &[&set], None).into_iter().enumerate() {
        let e = o.unwrap_err();
        assert!(e.contains("prometheus_port"), "rank {r}: {e}");
    }
}

#[test]
fn non_finite_gradients_stop_naming_the_rank_or_are_skipped() {
    let go = |on: &str| {
        let cfg = config(2, 1, &[format!("train.on_nonfinite={on}")]);
        let loader = loader(cfg.seq_len().unwrap());
        phalanx_comm::threads::run(2, move |pg| {
            let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
            phalanx::fault::inject_overflow(2, 1);
            let mut out = Vec::new();
            for k in 0..5 {
                match t.step(k) {
                    Ok(s) => out.push(Ok((s.skipped, s.loss))),
                    Err(e) => {
                        out.push(Err(e.to_string()));
                        break;
                    }
                }
            }
            out
        })
    };
    for rank in go("stop") {
        let e = rank[2].as_ref().unwrap_err();
        // Under DDP the all-reduce has spread rank 1's inf to every rank.
        assert!(e.contains("step 2") && e.contains("rank(s) [0, 1]"), "{e}");
        assert!(e.contains("on_nonfinite"), "{e}");
    }
    for rank in go("skip") {
        let skipped: Vec<bool> = rank.iter().map(|r| r.as_ref().unwrap().0).collect();
        assert_eq!(skipped, vec![false, false, true, false, false]);
        assert!(rank[4].as_ref().unwrap().1.is_finite());
    }
}

/// A rank whose step fails aborts the job with its error: its peers, waiting
/// for it in the step's all-reduce, fail at once naming it and its reason
/// (without the abort they hear only that it shut down).
#[test]
fn a_ranks_error_reaches_its_peers_with_its_reason() {
    let cfg = config(3, 1, &["train.steps=6".to_string()]);
    let loader = loader(cfg.seq_len().unwrap());
    let out = phalanx_comm::threads::run(3, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        phalanx::fault::inject_error(2, 1);
        let e = t.run(&RunOptions::default()).unwrap_err().to_string();
        phalanx::fault::clear();
        e
    });
    let why = "injected error at step 2 on rank 1 (test hook)";
    assert_eq!(out[1], why);
    for r in [0, 2] {
        let e = &out[r];
        assert!(
            e.contains("rank 1 (") && e.contains(&format!("aborted: {why}")),
            "rank {r}: {e}"
        );
    }
}
