//! Checking and simulating schedule tables, before (and without) running
//! them.
//!
//! [`Schedule::validate`] checks that a table is complete, ordered and
//! deadlock-free:
//! - every action of rank `s` is on one of its chunks (`chunk % p == s`);
//! - every (micro-batch, chunk) has exactly one forward and exactly one
//!   backward (`B`), or one `I` and one `W` for split schedules;
//! - on its rank a forward precedes its backward, `I` precedes `W`;
//! - a forward's input is there first: the previous chunk's forward on the
//!   same rank, or a `RecvAct` of it; a backward's output gradient likewise;
//!   a send follows the pass that produces it;
//! - every send has exactly one matching receive on the peer and vice versa;
//! - executing all tables together, with sends buffered and receives
//!   blocking (the runtime's semantics), finishes: no rank waits forever.
//!
//! [`Schedule::simulate`] runs the same execution with costs per pass and
//! returns each rank's busy time and bubble: with F = 1, B = 2 and free
//! communication, GPipe and 1F1B give exactly `(p - 1) / (m + p - 1)`.
//!
//! ```
//! use phalanx::strategy::pipeline::{Costs, Schedule, ScheduleKind};
//! let s = Schedule::new(ScheduleKind::Gpipe, 4, 8).unwrap();
//! let sim = s.simulate(&Costs::default()).unwrap();
//! assert!((sim.bubble[0] - 3.0 / 11.0).abs() < 1e-12);
//! ```

use std::collections::{HashMap, HashSet};

use super::schedule::{Action, Schedule};
use crate::error::{Error, Result};

/// Cost of one pass of a whole stage (a chunk costs `1 / v` of it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    pub forward: f64,
    /// Full backward.
    pub backward: f64,
    pub backward_input: f64,
    pub backward_weight: f64,
    /// Latency of one point-to-point message.
    pub comm: f64,
}

impl Default for Costs {
    /// F = 1, B = 2 (= I + W), free communication.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            comm: 0.0,
        }
    }
}

/// The outcome of [`Schedule::simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Time at which the last rank finishes.
    pub makespan: f64,
    /// Busy time per rank.
    pub busy: Vec<f64>,
    /// Idle fraction of the makespan per rank.
    pub bubble: Vec<f64>,
}

fn fail(msg: String) -> Error {
    Error::Check(format!("invalid pipeline schedule: {msg}"))
}

impl Schedule {
    /// Check the table (see the module docs); the error says what is wrong.
    pub fn validate(&self) -> Result<()> {
        let (p, v, m) = (self.p, self.v, self.m);
        let chunks = p * v;
        if self.ranks.len() != p {
            return Err(fail(format!("{} tables for {p} ranks", self.ranks.len())));
        }
        let split = self.kind.split_backward();
        let mut count: HashMap<(&str, usize, usize), usize> = HashMap::new();
        for (r, acts) in self.ranks.iter().enumerate() {
            let mut seen: HashSet<Action> = HashSet::new();
            for a in acts {
                let (name, mb, c) = a.parts();
                if c >= chunks || c % p != r || mb >= m {
                    return Err(fail(format!("rank {r} has {a:?} (p {p}, v {v}, m {m})")));
                }
                if !seen.insert(*a) {
                    return Err(fail(format!("rank {r} runs {a:?} twice")));
                }
                *count.entry((name, mb, c)).or_default() += 1;
                self.check_ready(r, a, &seen)?;
            }
        }
        let passes: &[&str] = if split { &["F", "I", "W"] } else { &["F", "B"] };
        for mb in 0..m {
            for c in 0..chunks {
                for pass in passes {
                    if count.get(&(*pass, mb, c)) != Some(&1) {
                        return Err(fail(format!(
                            "{pass} of micro-batch {mb}, chunk {c} does not appear exactly once"
                        )));
                    }
                }
            }
        }
        let other = if split { "B" } else { "I" };
        if count.keys().any(|k| k.0 == other || (!split && k.0 == "W")) {
            return Err(fail(format!(
                "{} mixes split and full backwards",
                self.kind
            )));
        }
        self.check_matching()?;
        self.simulate(&Costs::default()).map(|_| ())
    }

    /// What must precede action `a` on rank `r` (`seen`: what did, `a` included).
    fn check_ready(&self, r: usize, a: &Action, seen: &HashSet<Action>) -> Result<()> {
        let last = self.p * self.v - 1;
        let local = |c: usize| c % self.p == r;
        let (mb, c) = (a.mb(), a.chunk());
        let need: Vec<Action> = match *a {
            Action::Forward { .. } if c > 0 && local(c - 1) => {
                vec![Action::Forward { mb, chunk: c - 1 }]
            }
            Action::Forward { .. } if c > 0 => vec![Action::RecvAct { mb, chunk: c }],
            Action::Backward { .. } | Action::BackwardInput { .. } => {
                let mut n = vec![Action::Forward { mb, chunk: c }];
                if c < last && local(c + 1) {
                    n.push(if matches!(a, Action::Backward { .. }) {
                        Action::Backward { mb, chunk: c + 1 }
                    } else {
                        Action::BackwardInput { mb, chunk: c + 1 }
                    });
                } else if c < last {
                    n.push(Action::RecvGrad { mb, chunk: c });
                }
                n
            }
            Action::BackwardWeight { .. } => vec![Action::BackwardInput { mb, chunk: c }],
            Action::SendAct { .. } => vec![Action::Forward { mb, chunk: c }],
            Action::SendGrad { .. } => vec![
                Action::Backward { mb, chunk: c },
                Action::BackwardInput { mb, chunk: c },
            ],
            _ => vec![],
        };
        // A send of a gradient needs either kind of input-gradient pass.
        let ok = if matches!(a, Action::SendGrad { .. }) {
            need.iter().any(|n| seen.contains(n))
        } else {
            need.iter().all(|n| seen.contains(n))
        };
        if !ok {
            return Err(fail(format!("rank {r} runs {a:?} before {need:?}")));
        }
        Ok(())
    }

    /// Every send has exactly one receive on the right peer, and back.
    fn check_matching(&self) -> Result<()> {
        let mut sends: HashMap<(bool, usize, usize), usize> = HashMap::new();
        let mut recvs: HashMap<(bool, usize, usize), usize> = HashMap::new();
        for (r, acts) in self.ranks.iter().enumerate() {
            for a in acts {
                // Key: (is activation, mb, receiving chunk).
                let (key, peer_chunk) = match *a {
                    Action::SendAct { mb, chunk } => ((true, mb, chunk + 1), chunk + 1),
                    Action::SendGrad { mb, chunk } if chunk > 0 => {
                        ((false, mb, chunk - 1), chunk - 1)
                    }
                    Action::RecvAct { mb, chunk } if chunk > 0 => ((true, mb, chunk), chunk - 1),
                    Action::RecvGrad { mb, chunk } => ((false, mb, chunk), chunk + 1),
                    Action::SendGrad { .. } | Action::RecvAct { .. } => {
                        return Err(fail(format!("rank {r}: {a:?} has no peer chunk")))
                    }
                    _ => continue,
                };
                if peer_chunk >= self.p * self.v || peer_chunk % self.p == r {
                    return Err(fail(format!("rank {r}: {a:?} has no remote peer")));
                }
                let map = match a {
                    Action::SendAct { .. } | Action::SendGrad { .. } => &mut sends,
                    _ => &mut recvs,
                };
                *map.entry(key).or_default() += 1;
            }
        }
        for (k, n) in sends.iter() {
            if *n != 1 || recvs.get(k) != Some(&1) {
                return Err(fail(format!(
                    "send {k:?} x{n} has no single matching receive"
                )));
            }
        }
        if let Some(k) = recvs.keys().find(|k| !sends.contains_key(k)) {
            return Err(fail(format!("receive {k:?} has no matching send")));
        }
        Ok(())
    }

    /// Run all tables together (sends buffered, receives blocking) with
    /// `costs`; an error names the ranks left waiting if it deadlocks.
    pub fn simulate(&self, costs: &Costs) -> Result<Simulation> {
        let p = self.p;
        let scale = 1.0 / self.v as f64;
        let mut pc = vec![0usize; p];
        let mut t = vec![0f64; p];
        let mut busy = vec![0f64; p];
        // (is activation, mb, receiving chunk) -> time the data is there.
        let mut sent: HashMap<(bool, usize, usize), f64> = HashMap::new();
        let mut progress = true;
        while progress {
            progress = false;
            for r in 0..p {
                while let Some(a) = self.ranks[r].get(pc[r]) {
                    let cost = match *a {
                        Action::Forward { .. } => costs.forward,
                        Action::Backward { .. } => costs.backward,
                        Action::BackwardInput { .. } => costs.backward_input,
                        Action::BackwardWeight { .. } => costs.backward_weight,
                        Action::SendAct { mb, chunk } => {
                            sent.insert((true, mb, chunk + 1), t[r] + costs.comm);
                            0.0
                        }
                        Action::SendGrad { mb, chunk } => {
                            sent.insert((false, mb, chunk - 1), t[r] + costs.comm);
                            0.0
                        }
                        Action::RecvAct { mb, chunk } | Action::RecvGrad { mb, chunk } => {
                            let key = (matches!(a, Action::RecvAct { .. }), mb, chunk);
                            match sent.get(&key) {
                                Some(&at) => t[r] = t[r].max(at),
                                None => break,
                            }
                            0.0
                        }
                    } * if a.is_compute() { scale } else { 1.0 };
                    t[r] += cost;
                    busy[r] += cost;
                    pc[r] += 1;
                    progress = true;
                }
            }
        }
        let stuck: Vec<String> = (0..p)
            .filter(|&r| pc[r] < self.ranks[r].len())
            .map(|r| format!("rank {r} at {:?}", self.ranks[r][pc[r]]))
            .collect();
        if !stuck.is_empty() {
            return Err(fail(format!(
                "{} deadlocks: {}",
                self.kind,
                stuck.join(", ")
            )));
        }
        let makespan = t.iter().cloned().fold(0.0, f64::max);
        let bubble = busy.iter().map(|b| 1.0 - b / makespan).collect();
        Ok(Simulation {
            makespan,
            busy,
            bubble,
        })
    }
}
