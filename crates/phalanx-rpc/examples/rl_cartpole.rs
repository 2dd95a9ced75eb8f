//! Distributed reinforcement learning on cart-pole: one learner (rank 0)
//! owns the policy; `--observers` observers (ranks 1..) each step their own
//! copy of the environment with the policy the learner sends them and
//! return what they played with its gradients (or, with `--learner-grads`,
//! trajectories for the learner to differentiate); the learner updates the
//! policy by REINFORCE with a learned baseline (`phalanx_rpc::rl`).
//!
//! ```sh
//! cargo run --release -p phalanx --example rl_cartpole -- --observers 2
//! ```
//! Options: `--sync` (synchronous rounds, reproducible), `--learner-grads`
//! (observers send trajectories and the learner differentiates them),
//! `--max-episodes`, `--seed`, `--lr`, `--hidden`, `--no-stop`
//! (play all episodes instead of stopping once solved). Started by hand it
//! launches its own ranks; under `phalanx run --nproc-per-node N+1` it is
//! one of them. The learner prints progress and a final JSON line.

use phalanx_rpc::rl::{self, LearnerConfig};
use phalanx_rpc::rpc::launch::OrExit;
use phalanx_rpc::rpc::{self, launch, Options, Registry};
use std::time::Duration;

const USAGE: &str = "usage: rl_cartpole [--observers N] [--hidden N] [--lr X] [--max-episodes N] \
[--seed N] [--no-stop] [--sync] [--learner-grads]";

fn main() {
    launch::check_args(
        USAGE,
        &[
            "--observers",
            "--hidden",
            "--lr",
            "--max-episodes",
            "--seed",
        ],
        &["--no-stop", "--sync", "--learner-grads"],
    );
    let most = launch::max_local_ranks();
    let observers: usize = launch::arg_checked("--observers", 2, launch::within(1, most - 1));
    // Every rank checks the learner's settings before any work starts.
    let d = LearnerConfig::default();
    let cfg = LearnerConfig {
        hidden: launch::arg_checked("--hidden", d.hidden, launch::within(1, 1 << 16)),
        lr: launch::arg_checked("--lr", d.lr, launch::positive),
        max_episodes: launch::arg_checked(
            "--max-episodes",
            d.max_episodes,
            launch::within(1, 1 << 30),
        ),
        seed: launch::arg("--seed", d.seed),
        stop_when_solved: !std::env::args().any(|a| a == "--no-stop"),
        asynchronous: !std::env::args().any(|a| a == "--sync"),
        observer_grads: !std::env::args().any(|a| a == "--learner-grads"),
        ..d
    };
    let Some((rank, world)) = launch::rank_of_job() else {
        let code = launch::spawn_ranks(observers + 1, Duration::from_secs(10));
        std::process::exit(code.unwrap_or_else(|e| {
            eprintln!("rl_cartpole: {e}");
            2
        }));
    };
    if world != observers + 1 {
        eprintln!("rl_cartpole: {world} ranks for a learner and {observers} observers");
        std::process::exit(2);
    }
    let mut reg = Registry::new();
    rl::serve_observer(&mut reg);
    let name = if rank == 0 {
        "learner".to_string()
    } else {
        format!("observer{rank}")
    };
    let rpc = rpc::init_rpc_with(&name, rank, world, reg, Options::default()).or_exit("init_rpc");
    if rank == 0 {
        let names: Vec<String> = (1..world).map(|r| format!("observer{r}")).collect();
        let rep = rl::learn(&rpc, &names, &cfg).or_exit("learn");
        for (i, chunk) in rep.returns.chunks(100).enumerate() {
            let m = chunk.iter().sum::<f32>() / chunk.len() as f32;
            println!(
                "episodes {:5}..{:5}  mean return {m:6.1}",
                i * 100,
                i * 100 + chunk.len()
            );
        }
        println!(
            "{{\"episodes\": {}, \"mean_return_last_100\": {:.2}, \"observers\": {observers}, \
             \"seconds\": {:.3}, \"solved_at\": {}, \"env_steps\": {}, \"env_steps_per_s\": {:.0}}}",
            rep.returns.len(),
            rep.mean_last(100),
            rep.seconds,
            rep.solved_at.map_or("null".into(), |e| e.to_string()),
            rep.env_steps,
            rep.env_steps as f64 / rep.seconds
        );
    }
    rpc.shutdown().or_exit("shutdown");
}
