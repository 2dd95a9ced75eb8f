//! `phalanx lighthouse`: the coordinator of fault-tolerant replica groups
//! (`phalanx_comm::ft`), and `_ft-worker`, a replica group of one process
//! training a toy model through it, for the fault-tolerance tests.

use clap::Args;
use phalanx_comm::ft::{Lighthouse, LighthouseOpts, Manager, ManagerOpts};
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct LighthouseArgs {
    /// HOST:PORT to serve at.
    #[arg(long, default_value = "0.0.0.0:29510")]
    pub bind: String,
    /// Fewest live replica groups a quorum may have.
    #[arg(long = "min-replicas", alias = "min_replicas", default_value_t = 1)]
    pub min_replicas: usize,
    /// Seconds a change with new groups waits for more to arrive.
    #[arg(long = "join-timeout", default_value_t = 0.5)]
    pub join_timeout: f64,
    /// Seconds of silence after which a group is lost.
    #[arg(long = "heartbeat-timeout", default_value_t = 5.0)]
    pub heartbeat_timeout: f64,
}

fn secret() -> Result<Vec<u8>, String> {
    match std::env::var("PHALANX_SECRET") {
        Ok(s) if !s.is_empty() => phalanx_comm::wire::parse_secret(&s),
        _ => Err(
            "the lighthouse and its replica groups need the same PHALANX_SECRET (hex), e.g. \
             `export PHALANX_SECRET=$(openssl rand -hex 32)`"
                .into(),
        ),
    }
}

fn secs(name: &str, v: f64) -> Result<Duration, String> {
    if v.is_finite() && v > 0.0 {
        Ok(phalanx_comm::config::wait_secs(v))
    } else {
        Err(format!(
            "--{name} {v}: expected a positive number of seconds"
        ))
    }
}

pub fn main(a: &LighthouseArgs) -> i32 {
    let run = || -> Result<(), String> {
        if a.min_replicas == 0 {
            return Err("--min-replicas must be at least 1".into());
        }
        let opts = LighthouseOpts {
            min_replicas: a.min_replicas,
            join_timeout: secs("join-timeout", a.join_timeout)?,
            heartbeat_timeout: secs("heartbeat-timeout", a.heartbeat_timeout)?,
        };
        let lh = Lighthouse::start(&a.bind, secret()?, opts).map_err(|e| e.to_string())?;
        println!(
            "phalanx lighthouse at {} (min {} replica group(s)); Ctrl-C stops it",
            lh.addr(),
            a.min_replicas
        );
        crate::launch::catch_signals();
        while crate::launch::signalled() == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    };
    match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx lighthouse: error: {e}");
            2
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct FtWorkerArgs {
    #[arg(long)]
    pub lighthouse: String,
    #[arg(long = "replica-id")]
    pub replica_id: String,
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Sleep per step (ms), so that tests can act mid-run.
    #[arg(long = "step-ms", default_value_t = 20)]
    pub step_ms: u64,
    #[arg(long = "heartbeat-timeout", default_value_t = 1.0)]
    pub heartbeat_timeout: f64,
    #[arg(long = "quorum-timeout", default_value_t = 30.0)]
    pub quorum_timeout: f64,
}

/// The toy model: x (D values) pulled by each group towards its own
/// target; the cross-group average of the gradients x - target(group, step)
/// is applied with SGD, so every group at a step holds the same x.
const D: usize = 1024;

fn target(group: &str, step: u64, i: usize) -> f32 {
    let h = group.bytes().fold(step.wrapping_mul(31), |a, b| {
        a.wrapping_mul(131).wrapping_add(b as u64)
    });
    ((h.wrapping_add(i as u64 * 7919) % 1000) as f32) / 500.0 - 1.0
}

fn digest(x: &[f32]) -> u64 {
    x.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One replica group of one process: prints a line per committed step
/// (`step S committed by N group(s) epoch E digest H`) and, on healing,
/// `healed at step S from NAME`.
pub fn worker(a: &FtWorkerArgs) -> i32 {
    let run = || -> Result<(), String> {
        let opts = ManagerOpts {
            quorum_timeout: secs("quorum-timeout", a.quorum_timeout)?,
            heartbeat_timeout: secs("heartbeat-timeout", a.heartbeat_timeout)?,
            ..ManagerOpts::default()
        };
        let e = |e: phalanx_comm::CommError| e.to_string();
        let mut m = Manager::connect(&a.lighthouse, &secret()?, &a.replica_id, opts).map_err(e)?;
        let mut x = vec![0.5f32; D];
        let mut step = 0u64;
        let mut committed = 0u64;
        while step < a.steps {
            let q = m.quorum(step).map_err(e)?;
            if q.changed {
                // Everyone takes the healer's state: x and the step.
                let mut state: Vec<f32> = x.clone();
                state.push(step as f32);
                if !m.heal(&mut state).map_err(e)? {
                    continue;
                }
                let healed_step = state.pop().unwrap() as u64;
                if q.behind {
                    println!(
                        "healed at step {healed_step} from {} (was at step {step})",
                        q.members[q.healer]
                    );
                }
                x = state;
                step = healed_step;
                if step >= a.steps {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(a.step_ms));
            let mut g: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| v - target(&a.replica_id, step, i))
                .collect();
            if !m.all_reduce(&mut g).map_err(e)? {
                continue; // not committed: retry this step with the next quorum
            }
            for (v, gi) in x.iter_mut().zip(&g) {
                *v -= 0.1 * gi;
            }
            step += 1;
            committed += q.size as u64;
            println!(
                "step {step} committed by {} group(s) epoch {} digest {:016x}",
                q.size,
                q.epoch,
                digest(&x)
            );
        }
        println!(
            "done: step {step}, {committed} group-steps committed, digest {:016x}",
            digest(&x)
        );
        Ok(())
    };
    match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("replica group {}: error: {e}", a.replica_id);
            1
        }
    }
}
