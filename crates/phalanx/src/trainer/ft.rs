//! The trainer as one replica group of a fault-tolerant job
//! (`[fault_tolerance]`, `phalanx_comm::ft`): every step starts with the
//! lighthouse's quorum; after a membership change every member takes the
//! most advanced member's state (parameters, optimizer state and its step
//! count, loss scaler, step) by broadcast; the gradients are averaged over
//! the quorum, and a step whose average failed (a member lost) does not
//! commit and runs again with the next quorum.
//!
//! In this build a replica group is one rank (`phalanx train
//! --nproc-per-node 1`); a larger group is refused with an error.

use super::Trainer;
use crate::error::{Error, Result};
use crate::strategy::state::StateRange;
use phalanx_comm::ft::{Manager, ManagerOpts, Quorum};
use std::time::Duration;

/// A group's fault-tolerance state.
pub(crate) struct Ft {
    pub mgr: Manager,
    /// This group's share of each step's data: (index, of how many).
    pub shard: (usize, usize),
    /// The quorum of the step being run.
    pub quorum: Option<Quorum>,
    /// Samples committed over the run (each group's batch counted once per
    /// step it committed; torchft's `batches_committed`).
    pub samples_committed: u64,
}

fn comm(e: phalanx_comm::CommError) -> Error {
    Error::Comm(e)
}

impl Ft {
    /// Join the lighthouse the config names, with the job secret.
    pub fn connect(cfg: &crate::config::TrainConfig, world: usize) -> Result<Ft> {
        let f = &cfg.fault_tolerance;
        if world != 1 {
            return Err(Error::Check(format!(
                "fault_tolerance: a replica group is one rank in this build (start each group \
                 with --nproc-per-node 1), not {world}"
            )));
        }
        let secret = match std::env::var("PHALANX_SECRET") {
            Ok(s) if !s.is_empty() => phalanx_comm::wire::parse_secret(&s).map_err(Error::Check)?,
            _ => {
                return Err(Error::Check(
                    "fault_tolerance: the lighthouse and its groups need the same PHALANX_SECRET"
                        .into(),
                ))
            }
        };
        let opts = ManagerOpts {
            quorum_timeout: Duration::from_secs_f64(f.quorum_timeout),
            heartbeat_timeout: Duration::from_secs_f64(f.heartbeat_timeout),
            ..ManagerOpts::default()
        };
        let mgr = Manager::connect(&f.lighthouse, &secret, &f.replica_id.to_string(), opts)
            .map_err(comm)?;
        Ok(Ft {
            mgr,
            shard: (f.replica_id, f.replicas),
            quorum: None,
            samples_committed: 0,
        })
    }
}

impl Trainer {
    /// Before step `k`: the quorum, and healing after a change. Returns the
    /// step to run (a group behind jumps to the others' step).
    pub(super) fn ft_begin(&mut self, k: usize, lead: bool) -> Result<usize> {
        loop {
            let ft = self.ft.as_mut().expect("fault tolerance on");
            let q = ft.mgr.quorum(k as u64).map_err(comm)?;
            ft.quorum = Some(q.clone());
            if !q.changed {
                return Ok(k);
            }
            match self.ft_heal(&q, k)? {
                Some(step) => {
                    if lead {
                        println!(
                            "fault tolerance: quorum {} of {} group(s) [{}]{}",
                            q.epoch,
                            q.size,
                            q.members.join(", "),
                            if q.behind {
                                format!(
                                    "; healed from group {} at step {step} (was at step {k})",
                                    q.members[q.healer]
                                )
                            } else {
                                String::new()
                            }
                        );
                    }
                    return Ok(step);
                }
                None => continue, // a member was lost while healing
            }
        }
    }

    /// Every member takes the healer's state; `None` if a member was lost.
    fn ft_heal(&mut self, q: &Quorum, k: usize) -> Result<Option<usize>> {
        let ranges = self.strat.save_state(&self.engine)?;
        // One flat message: the step, the optimizer step, the scaler (as
        // JSON bytes, one per value), then each range's parameters and
        // optimizer buffers.
        let scaler = serde_json::to_vec(&self.scaler).map_err(|e| Error::Check(e.to_string()))?;
        let mut head = vec![k as f64, ranges.first().map_or(0, |r| r.optim_step) as f64];
        head.push(scaler.len() as f64);
        let mut scaler_buf = [0f64; 256];
        if scaler.len() > scaler_buf.len() {
            return Err(Error::Check("loss scaler state too large to heal".into()));
        }
        for (d, b) in scaler_buf.iter_mut().zip(&scaler) {
            *d = *b as f64;
        }
        head.extend_from_slice(&scaler_buf);
        let mut body: Vec<f32> = Vec::new();
        for r in &ranges {
            body.extend_from_slice(&r.params);
            for (_, v) in &r.optim {
                body.extend_from_slice(v);
            }
        }
        let ft = self.ft.as_mut().expect("fault tolerance on");
        if !ft.mgr.heal(&mut head).map_err(comm)? || !ft.mgr.heal(&mut body).map_err(comm)? {
            return Ok(None);
        }
        if !q.behind && q.rank == q.healer {
            return Ok(Some(k)); // ours is the state everyone took
        }
        // Rebuild the ranges from the healer's values and load them.
        let mut at = 0;
        let mut healed: Vec<StateRange> = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let n = r.range.len();
            let params = body[at..at + n].to_vec();
            at += n;
            let mut optim = Vec::new();
            for (name, _) in &r.optim {
                optim.push((*name, body[at..at + n].to_vec()));
                at += n;
            }
            healed.push(StateRange {
                params,
                optim,
                ..r.clone()
            });
        }
        let mut fill = |range: std::ops::Range<usize>, name: &str| -> Result<Option<Vec<f32>>> {
            let r = healed
                .iter()
                .find(|h| h.range.start <= range.start && range.end <= h.range.end)
                .ok_or_else(|| Error::Check(format!("healing: no state for {range:?}")))?;
            let local = range.start - r.range.start..range.end - r.range.start;
            if name == "param" {
                return Ok(Some(r.params[local].to_vec()));
            }
            Ok(r.optim
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v[local].to_vec()))
        };
        self.strat
            .load_state(&mut self.engine, &mut fill, head[1] as u64)?;
        let len = head[2] as usize;
        let bytes: Vec<u8> = head[3..3 + len].iter().map(|&v| v as u8).collect();
        self.scaler = serde_json::from_slice(&bytes).map_err(|e| Error::Check(e.to_string()))?;
        Ok(Some(head[0] as usize))
    }

    /// After the backward: the gradients' average over the quorum. False:
    /// a member was lost, the step does not commit.
    pub(super) fn ft_reduce(&mut self) -> Result<bool> {
        let ft = self.ft.as_mut().expect("fault tolerance on");
        let ok = ft
            .mgr
            .all_reduce(self.engine.grads_flat_mut())
            .map_err(comm)?;
        if ok {
            let size = ft.quorum.as_ref().map_or(1, |q| q.size);
            ft.samples_committed += (size * self.global_batch) as u64;
        }
        Ok(ok)
    }
}
