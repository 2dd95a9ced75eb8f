//! A click-through-rate model trained against a parameter server: a large
//! hashed embedding table (rows made on first touch) and a small dense
//! part, sharded over `--servers` server workers and trained by
//! `--trainers` trainers on synthetic data with a known generating model
//! (`phalanx_rpc::ps::ctr`).
//!
//! ```sh
//! cargo run --release -p phalanx --example parameter_server -- --trainers 2 --servers 1 --staleness 0
//! ```
//! Options: `--staleness S` (0 synchronous, S > 0 bounded staleness, `async`),
//! `--steps`, `--batch`, `--optim adagrad|sgd`, `--lr`, `--rows` (table
//! size), `--seed`. Started by hand it launches its own ranks (servers
//! first, then trainers); under `phalanx run --nproc-per-node K+N` it is
//! one of them. Trainer 0 prints the loss curve on held-out data and a
//! final JSON line.

use phalanx_rpc::ps::ctr::CtrSpec;
use phalanx_rpc::ps::{Optim, PsClient, Server};
use phalanx_rpc::rpc::launch::OrExit;
use phalanx_rpc::rpc::{self, launch, Options, Registry};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: parameter_server [--trainers N] [--servers N] [--staleness S|async] \
[--steps N] [--batch N] [--optim adagrad|sgd] [--lr X] [--vocab N] [--rows N] [--seed N]";

fn main() {
    launch::check_args(
        USAGE,
        &[
            "--trainers",
            "--servers",
            "--staleness",
            "--steps",
            "--batch",
            "--optim",
            "--lr",
            "--vocab",
            "--rows",
            "--seed",
        ],
        &[],
    );
    let most = launch::max_local_ranks();
    let trainers: usize = launch::arg_checked("--trainers", 2, launch::within(1, most - 1));
    let servers: usize = launch::arg_checked("--servers", 1, launch::within(1, most - trainers));
    let st: String = launch::arg("--staleness", "0".to_string());
    let staleness = if st == "async" {
        None
    } else {
        match st.parse::<u64>() {
            Ok(s) => Some(s),
            Err(_) => {
                eprintln!("error: --staleness {st}: a number of steps (0 or more) or `async`");
                std::process::exit(2);
            }
        }
    };
    let steps: u64 = launch::arg_checked("--steps", 1000, |&s| {
        (s > 0)
            .then_some(())
            .ok_or("must be at least 1".to_string())
    });
    let batch: usize = launch::arg_checked("--batch", 256, launch::within(1, 1 << 20));
    let lr: f32 = launch::arg_checked("--lr", 0.5, launch::positive);
    let optim = match launch::arg("--optim", "adagrad".to_string()).as_str() {
        "sgd" => Optim::Sgd { lr },
        "adagrad" => Optim::Adagrad {
            lr,
            init_acc: 0.1,
            eps: 1e-8,
        },
        other => {
            eprintln!("error: --optim {other}: adagrad or sgd");
            std::process::exit(2);
        }
    };
    let spec = CtrSpec {
        fields: 8,
        vocab: launch::arg_checked("--vocab", 10_000, launch::within(1, 1 << 30)),
        rows: launch::arg_checked("--rows", 1 << 22, launch::within(1, 1 << 30)),
        dim: 8,
        seed: launch::arg("--seed", 1),
    };
    // Every flag is checked above, before any rank starts.
    let Some((rank, world)) = launch::rank_of_job() else {
        let code = launch::spawn_ranks(servers + trainers, Duration::from_secs(10));
        std::process::exit(code.unwrap_or_else(|e| {
            eprintln!("parameter_server: {e}");
            2
        }));
    };
    if world != servers + trainers {
        eprintln!("parameter_server: {world} ranks for {servers} servers + {trainers} trainers");
        std::process::exit(2);
    }
    let cfg = spec.ps_config(trainers, optim, staleness);
    let names: Vec<String> = (0..servers).map(|j| format!("ps{j}")).collect();
    let mut reg = Registry::new();
    let name = if rank < servers {
        Server::new(cfg.clone(), rank, servers).serve(&mut reg);
        names[rank].clone()
    } else {
        format!("trainer{}", rank - servers)
    };
    let opts = Options {
        threads: trainers + 2,
        ..Options::default()
    };
    let rpc = rpc::init_rpc_with(&name, rank, world, reg, opts).or_exit("init_rpc");
    if rank >= servers {
        let t = rank - servers;
        let mut c = PsClient::new(rpc.clone(), &names, cfg, t).or_exit("client");
        let eval = spec.batch(u64::MAX, 0, 4096);
        let eval_loss = |c: &mut PsClient, last: bool| {
            let p = if last {
                c.pull_final(&[&eval.ids])
            } else {
                c.pull(&[&eval.ids])
            }
            .or_exit("pull");
            spec.loss(&eval, &p.rows[0], &p.dense[0])
        };
        // The initial model is known everywhere (rows start from their
        // ids): its loss needs no pull, which in the bounded and
        // asynchronous modes could already see other trainers' pushes.
        let init = c.config().clone();
        let rows0: Vec<f32> = eval
            .ids
            .iter()
            .flat_map(|&id| init.init_row(0, id))
            .collect();
        let initial = spec.loss(&eval, &rows0, &init.dense[0].1);
        let t0 = Instant::now();
        for step in 0..steps {
            if t == 0 && step > 0 && step % (steps / 10).max(1) == 0 {
                println!("step {step:5}  eval loss {:.4}", eval_loss(&mut c, false));
            }
            let b = spec.batch(t as u64, step, batch);
            let p = c.pull(&[&b.ids]).or_exit("pull");
            let g = spec.grads(&b, &p.rows[0], &p.dense[0]);
            c.push(&[(&g.ids, &g.rows)], &[g.dense]).or_exit("push");
        }
        let secs = t0.elapsed().as_secs_f64();
        if t == 0 {
            let fin = eval_loss(&mut c, true);
            let stats = c.server_stats().or_exit("stats");
            let ops: u64 = stats.iter().map(|s| s.pulls + s.pushes).sum();
            let rows: u64 = stats.iter().map(|s| s.rows).sum();
            println!("step {steps:5}  eval loss {fin:.4}");
            println!(
                "{{\"initial_loss\": {initial:.5}, \"final_loss\": {fin:.5}, \"steps\": {steps}, \
                 \"trainers\": {trainers}, \"servers\": {servers}, \"staleness\": {}, \
                 \"seconds\": {secs:.3}, \"ps_ops_per_s\": {:.0}, \"trainer_steps_per_s\": {:.0}, \"rows_held\": {rows}, \
                 \"max_lead\": {}, \"bayes_loss\": {:.5}}}",
                staleness.map_or("\"async\"".to_string(), |s| s.to_string()),
                ops as f64 / secs,
                (trainers as u64 * steps) as f64 / secs,
                stats.iter().map(|s| s.max_lead).max().unwrap_or(0),
                eval.bayes_loss()
            );
        }
    }
    rpc.shutdown().or_exit("shutdown");
}
