//! Pipeline schedules as tables: for each pipeline rank, the ordered list of
//! [`Action`]s it runs in one step. One runtime executes any table, so a
//! schedule is data that can be printed, validated and simulated
//! ([`super::check`]) before anything runs.
//!
//! Model chunks ("virtual stages") are numbered `0..p*v` in model order;
//! chunk `c` lives on pipeline rank `c % p` (rank `s` holds `s, s+p, ...`,
//! Megatron's interleaving); `v = 1` except for the interleaved schedule.
//! Communication is explicit: a forward of chunk `c > 0` whose previous chunk
//! lives on another rank is preceded by `RecvAct`, a forward whose next chunk
//! lives elsewhere is followed by `SendAct`, and symmetrically for gradients.
//!
//! - GPipe: all forwards, then all backwards.
//! - 1F1B (PipeDream-flush): `p - s - 1` warm-up forwards on stage `s`, then
//!   one forward / one backward, then the remaining backwards.
//! - Interleaved 1F1B (Megatron): micro-batches in groups of `p` (the last
//!   group may be smaller), each group through chunk 0, 1, ... of the rank;
//!   warm-up `2 (p - s - 1) + (v - 1) p`. With `m % p == 0` this is exactly
//!   Megatron's table. Other `m` (Megatron rejects them) are accepted: when
//!   the shorter last group would deadlock (it can for `p >= 4`), every
//!   rank's warm-up is raised by the smallest amount the dependency check
//!   accepts (at worst all forwards first).
//! - ZB-H1 (zero bubble, Qi et al. 2023): 1F1B with the backward split into
//!   `I` (input gradient, on the critical path) and `W` (weight gradient);
//!   stage `s` runs each `W` `s` backwards late, which moves its weight passes
//!   into the tail bubble. With F = I = W the step takes `3m + p - 1` units
//!   instead of 1F1B's `3m + 3(p - 1)`; at most `p` micro-batches are
//!   between F and W on any stage, `p - s` between F and I as in 1F1B.
//!
//! ```
//! use phalanx::strategy::pipeline::{Schedule, ScheduleKind};
//! let s = Schedule::new(ScheduleKind::OneFOneB, 2, 3).unwrap();
//! assert_eq!(s.to_string(), "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2\n");
//! s.validate().unwrap();
//! ```

use std::fmt;

pub use crate::config::ScheduleKind;
use crate::error::{Error, Result};

/// One step of a rank's table. `chunk` is the global model-chunk index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of micro-batch `mb` through `chunk`.
    Forward { mb: usize, chunk: usize },
    /// Full backward (input and weight gradients).
    Backward { mb: usize, chunk: usize },
    /// Input-gradient half of a split backward (ZB's "B"), printed `I`.
    BackwardInput { mb: usize, chunk: usize },
    /// Weight-gradient half of a split backward (ZB's "W").
    BackwardWeight { mb: usize, chunk: usize },
    /// Send `chunk`'s output to the rank of `chunk + 1`.
    SendAct { mb: usize, chunk: usize },
    /// Receive `chunk`'s input from the rank of `chunk - 1`.
    RecvAct { mb: usize, chunk: usize },
    /// Send the gradient of `chunk`'s input to the rank of `chunk - 1`.
    SendGrad { mb: usize, chunk: usize },
    /// Receive the gradient of `chunk`'s output from the rank of `chunk + 1`.
    RecvGrad { mb: usize, chunk: usize },
}

impl Action {
    pub fn mb(&self) -> usize {
        self.parts().1
    }

    pub fn chunk(&self) -> usize {
        self.parts().2
    }

    /// (short name, micro-batch, chunk).
    pub fn parts(&self) -> (&'static str, usize, usize) {
        use Action::*;
        match *self {
            Forward { mb, chunk } => ("F", mb, chunk),
            Backward { mb, chunk } => ("B", mb, chunk),
            BackwardInput { mb, chunk } => ("I", mb, chunk),
            BackwardWeight { mb, chunk } => ("W", mb, chunk),
            SendAct { mb, chunk } => ("sa", mb, chunk),
            RecvAct { mb, chunk } => ("ra", mb, chunk),
            SendGrad { mb, chunk } => ("sg", mb, chunk),
            RecvGrad { mb, chunk } => ("rg", mb, chunk),
        }
    }

    /// Forward and backward passes (not communication).
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
        )
    }

    /// The pass that releases the micro-batch's stash of this chunk.
    pub fn is_last_backward(&self) -> bool {
        matches!(
            self,
            Action::Backward { .. } | Action::BackwardWeight { .. }
        )
    }

    /// Short name with the rank's local chunk index when `v > 1`: `F3`,
    /// `F3.1` (micro-batch 3, second chunk of the rank).
    pub fn label(&self, p: usize, v: usize) -> String {
        let (n, mb, c) = self.parts();
        if v > 1 {
            format!("{n}{mb}.{}", c / p)
        } else {
            format!("{n}{mb}")
        }
    }
}

/// The tables of one step for every pipeline rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// Pipeline ranks.
    pub p: usize,
    /// Micro-batches per step.
    pub m: usize,
    /// Model chunks per rank.
    pub v: usize,
    /// `ranks[s]`: rank `s`'s actions, in order.
    pub ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// Build (and validate) the table of `kind` for `p` ranks and `m`
    /// micro-batches.
    pub fn new(kind: ScheduleKind, p: usize, m: usize) -> Result<Schedule> {
        let v = kind.chunks_per_rank();
        if p == 0 || m == 0 {
            return Err(Error::Check(format!(
                "a pipeline needs p >= 1 ranks and m >= 1 micro-batches (got p {p}, m {m})"
            )));
        }
        if matches!(kind, ScheduleKind::Interleaved { .. }) && v < 2 {
            return Err(Error::Check(format!(
                "interleaved needs v >= 2 model chunks per rank (got {v}); use 1f1b"
            )));
        }
        let make = |compute: Vec<Vec<Action>>| Schedule {
            kind,
            p,
            m,
            v,
            ranks: with_comm(p, v, compute),
        };
        let s = match kind {
            ScheduleKind::Gpipe => make(gpipe(p, m)),
            ScheduleKind::OneFOneB => make(one_f_one_b(p, m)),
            ScheduleKind::ZbH1 => make(zb_h1(p, m)),
            ScheduleKind::Interleaved { v } => {
                // Megatron's warm-up first; raise it only if it deadlocks.
                let total = m * v;
                let mut extra = 0;
                loop {
                    let s = make(interleaved(p, m, v, extra));
                    if extra >= total || s.validate().is_ok() {
                        break s;
                    }
                    extra += 1;
                }
            }
        };
        s.validate()?;
        Ok(s)
    }

    /// Rank of model chunk `c`.
    pub fn owner(&self, chunk: usize) -> usize {
        chunk % self.p
    }

    /// Number of model chunks (`p * v`).
    pub fn num_chunks(&self) -> usize {
        self.p * self.v
    }

    /// The compute actions of rank `s`, in order.
    pub fn compute(&self, s: usize) -> impl Iterator<Item = &Action> {
        self.ranks[s].iter().filter(|a| a.is_compute())
    }

    /// Most (micro-batch, chunk) stashes alive at once on each rank: from
    /// the forward to the backward that releases it (W for split ones).
    pub fn peak_in_flight(&self) -> Vec<usize> {
        self.peak(|a| a.is_last_backward())
    }

    /// As `peak_in_flight`, counting a split backward's stash until its
    /// input pass `I` (what 1F1B's memory bound is about).
    pub fn peak_before_input_grad(&self) -> Vec<usize> {
        self.peak(|a| matches!(a, Action::Backward { .. } | Action::BackwardInput { .. }))
    }

    fn peak(&self, release: impl Fn(&Action) -> bool) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|acts| {
                let (mut cur, mut peak) = (0usize, 0usize);
                for a in acts {
                    if matches!(a, Action::Forward { .. }) {
                        cur += 1;
                        peak = peak.max(cur);
                    } else if release(a) {
                        cur -= 1;
                    }
                }
                peak
            })
            .collect()
    }
}

/// One line per rank; `{:#}` also shows the communication actions.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (s, acts) in self.ranks.iter().enumerate() {
            let names: Vec<String> = acts
                .iter()
                .filter(|a| f.alternate() || a.is_compute())
                .map(|a| a.label(self.p, self.v))
                .collect();
            writeln!(f, "rank {s}: {}", names.join(" "))?;
        }
        Ok(())
    }
}

fn fwd(mb: usize, chunk: usize) -> Action {
    Action::Forward { mb, chunk }
}

fn bwd(mb: usize, chunk: usize) -> Action {
    Action::Backward { mb, chunk }
}

fn gpipe(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|s| {
            let f = (0..m).map(|j| fwd(j, s));
            f.chain((0..m).map(|j| bwd(j, s))).collect()
        })
        .collect()
}

fn one_f_one_b(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|s| {
            let w = (p - s - 1).min(m);
            let mut o: Vec<Action> = (0..w).map(|j| fwd(j, s)).collect();
            for i in 0..m - w {
                o.extend([fwd(w + i, s), bwd(i, s)]);
            }
            o.extend((m - w..m).map(|j| bwd(j, s)));
            o
        })
        .collect()
}

fn zb_h1(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|s| {
            let w = (p - s - 1).min(m);
            // Stage s runs W(j) after I(j + s): later stages, whose last I
            // comes earliest, keep more weight passes for their tail.
            let delay = s;
            let mut o: Vec<Action> = (0..w).map(|j| fwd(j, s)).collect();
            let mut next_w = 0;
            let mut input = |o: &mut Vec<Action>, i: usize| {
                o.push(Action::BackwardInput { mb: i, chunk: s });
                if i >= delay {
                    o.push(Action::BackwardWeight {
                        mb: next_w,
                        chunk: s,
                    });
                    next_w += 1;
                }
            };
            for i in 0..m - w {
                o.push(fwd(w + i, s));
                input(&mut o, i);
            }
            for j in m - w..m {
                input(&mut o, j);
            }
            let done = o
                .iter()
                .filter(|a| matches!(a, Action::BackwardWeight { .. }))
                .count();
            o.extend((done..m).map(|j| Action::BackwardWeight { mb: j, chunk: s }));
            o
        })
        .collect()
}

/// Megatron's order: micro-batches in groups of `p` (last one shorter),
/// each group through the rank's chunks in order (reversed for backwards).
fn interleaved(p: usize, m: usize, v: usize, extra: usize) -> Vec<Vec<Action>> {
    let mut order = Vec::with_capacity(m * v);
    for lo in (0..m).step_by(p) {
        let hi = (lo + p).min(m);
        for c in 0..v {
            order.extend((lo..hi).map(|j| (j, c)));
        }
    }
    let total = m * v;
    (0..p)
        .map(|s| {
            let f = |k: usize| fwd(order[k].0, order[k].1 * p + s);
            let b = |k: usize| bwd(order[k].0, (v - 1 - order[k].1) * p + s);
            let w = (2 * (p - s - 1) + (v - 1) * p + extra).min(total);
            let mut o: Vec<Action> = (0..w).map(f).collect();
            for i in 0..total - w {
                o.extend([f(w + i), b(i)]);
            }
            o.extend((total - w..total).map(b));
            o
        })
        .collect()
}

/// Insert the sends and receives each compute action implies.
fn with_comm(p: usize, v: usize, compute: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    let last = p * v - 1;
    let owner = |c: usize| c % p;
    compute
        .into_iter()
        .enumerate()
        .map(|(r, acts)| {
            let mut o = Vec::with_capacity(acts.len() * 2);
            for a in acts {
                let (mb, c) = (a.mb(), a.chunk());
                match a {
                    Action::Forward { .. } => {
                        if c > 0 && owner(c - 1) != r {
                            o.push(Action::RecvAct { mb, chunk: c });
                        }
                        o.push(a);
                        if c < last && owner(c + 1) != r {
                            o.push(Action::SendAct { mb, chunk: c });
                        }
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        if c < last && owner(c + 1) != r {
                            o.push(Action::RecvGrad { mb, chunk: c });
                        }
                        o.push(a);
                        if c > 0 && owner(c - 1) != r {
                            o.push(Action::SendGrad { mb, chunk: c });
                        }
                    }
                    _ => o.push(a),
                }
            }
            o
        })
        .collect()
}
