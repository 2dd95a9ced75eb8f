//! One parameter-server shard: its rows of every table, its block of
//! every dense vector, the optimizer state, and the trainers' clocks that
//! decide when a pull may be served (see the module docs of `ps`).

use super::{block, PsConfig};
use crate::rpc::{Blob, Registry};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A pull of step `step` by trainer `trainer`: rows `ids[t]` of every table t.
#[derive(Serialize, Deserialize)]
pub struct PullReq {
    pub trainer: u32,
    pub step: u64,
    /// The shard the trainer addresses, of how many (`[j, k]`): a server
    /// list out of shard order is refused, not served another block.
    pub shard: [u32; 2],
    pub ids: Vec<Blob<u64>>,
    /// Wait until every trainer has pushed `step` steps (a final read).
    pub wait_all: bool,
}

#[derive(Serialize, Deserialize)]
pub struct PullResp {
    /// Per table, the rows asked for, `dim` values each.
    pub rows: Vec<Blob<f32>>,
    /// Per dense vector, this server's block.
    pub dense: Vec<Blob<f32>>,
}

/// Gradients of step `step` of trainer `trainer`: per table, distinct row
/// ids and their gradients; per dense vector, this server's block of the
/// gradient (empty: none).
#[derive(Serialize, Deserialize)]
pub struct PushReq {
    pub trainer: u32,
    pub step: u64,
    /// As in [`PullReq`].
    pub shard: [u32; 2],
    pub ids: Vec<Blob<u64>>,
    pub grads: Vec<Blob<f32>>,
    pub dense: Vec<Blob<f32>>,
}

/// What a server saw, for tests and reports.
#[derive(Serialize, Deserialize, Clone, Default, Debug, PartialEq)]
pub struct ServerStats {
    pub pulls: u64,
    pub pushes: u64,
    /// The most steps a pulling trainer was ahead of the slowest trainer.
    pub max_lead: u64,
    /// Rows held (of every table).
    pub rows: u64,
}

struct Row {
    w: Vec<f32>,
    acc: Vec<f32>,
}

struct State {
    rows: Vec<HashMap<u64, Row>>,
    /// This server's block of each dense vector: values, accumulator.
    dense: Vec<(Vec<f32>, Vec<f32>)>,
    /// Steps pushed by each trainer.
    clocks: Vec<u64>,
    /// Synchronous mode: steps applied.
    applied: u64,
    /// Synchronous mode: pushes of steps not applied yet, per trainer.
    waiting: HashMap<u64, Vec<Option<PushReq>>>,
    stats: ServerStats,
}

/// Shard `shard` of `k`.
pub struct Server {
    cfg: PsConfig,
    shard: usize,
    /// Shards in all.
    shards: usize,
    st: Mutex<State>,
    cv: Condvar,
    /// How long a pull may wait for slower trainers. A pull served over RPC
    /// also waits at most nine tenths of the server's RPC timeout, so that
    /// its reason (which trainer it waited for) reaches a caller of the same
    /// timeout instead of the caller's bare timeout.
    pub wait_limit: Duration,
}

impl Server {
    pub fn new(cfg: PsConfig, shard: usize, k: usize) -> Server {
        let dense = cfg
            .dense
            .iter()
            .map(|(_, v)| {
                let (a, b) = block(v.len(), k, shard);
                (v[a..b].to_vec(), vec![cfg.optim.init_acc(); b - a])
            })
            .collect();
        let st = State {
            rows: cfg.tables.iter().map(|_| HashMap::new()).collect(),
            dense,
            clocks: vec![0; cfg.trainers],
            applied: 0,
            waiting: HashMap::new(),
            stats: ServerStats::default(),
        };
        Server {
            cfg,
            shard,
            shards: k,
            st: Mutex::new(st),
            cv: Condvar::new(),
            wait_limit: Duration::from_secs(120),
        }
    }

    /// Register `ps.pull`, `ps.push` and `ps.stats` for this shard.
    pub fn serve(self, reg: &mut Registry) -> Arc<Server> {
        // A waiting pull holds a pool thread until the push it waits for
        // runs: every trainer but the slowest may wait in a pull, and the
        // slowest one's push needs a thread of its own.
        let n = self.cfg.trainers;
        reg.require_threads(
            n,
            &format!(
                "a parameter server shard of {n} trainer(s) needs a pool thread for each: all \
                 but the slowest may wait in a pull for its push, which needs one more"
            ),
        );
        let s = Arc::new(self);
        let (a, b, c) = (s.clone(), s.clone(), s.clone());
        reg.register_fallible("ps.pull", move |c, r: PullReq| {
            let limit = a.wait_limit.min(c.rpc().timeout().mul_f64(0.9));
            a.pull_within(r, limit)
        });
        reg.register_fallible("ps.push", move |_c, r: PushReq| b.push(r));
        reg.register("ps.stats", move |_c, (): ()| c.stats());
        s
    }

    pub fn shard(&self) -> usize {
        self.shard
    }

    pub fn stats(&self) -> ServerStats {
        let st = self.st.lock().unwrap();
        let mut s = st.stats.clone();
        s.rows = st.rows.iter().map(|t| t.len() as u64).sum();
        s
    }

    pub fn pull(&self, r: PullReq) -> Result<PullResp, String> {
        self.pull_within(r, self.wait_limit)
    }

    /// [`Server::pull`], waiting at most `limit` for slower trainers.
    fn pull_within(&self, r: PullReq, limit: Duration) -> Result<PullResp, String> {
        self.check(r.trainer, r.shard, &r.ids)?;
        let deadline = Instant::now().checked_add(limit);
        let mut st = self.st.lock().unwrap();
        // The step every trainer has completed, as far as reads go.
        let done = |st: &State| match self.cfg.staleness {
            Some(0) => st.applied,
            _ => st.clocks.iter().copied().min().unwrap_or(0),
        };
        loop {
            let slowest = done(&st);
            let ready = if r.wait_all {
                slowest >= r.step
            } else {
                match self.cfg.staleness {
                    // Saturating: `u64::MAX` as "any lead" must not wrap.
                    Some(s) => slowest.saturating_add(s) >= r.step,
                    None => true,
                }
            };
            if ready {
                break;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(format!(
                    "pull of step {} by trainer {} waited {limit:?} for the slowest trainer (at \
                     step {slowest})",
                    r.step, r.trainer
                ));
            }
            let left = left.unwrap_or(Duration::from_secs(3600));
            st = self.cv.wait_timeout(st, left).unwrap().0;
        }
        let lead = r.step.saturating_sub(done(&st));
        st.stats.max_lead = st.stats.max_lead.max(lead);
        st.stats.pulls += 1;
        let mut rows = Vec::with_capacity(r.ids.len());
        for (t, ids) in r.ids.iter().enumerate() {
            let mut out = Vec::with_capacity(ids.len() * self.cfg.tables[t].dim);
            for &id in ids.iter() {
                out.extend_from_slice(&self.row(&mut st, t, id).w);
            }
            rows.push(Blob::from(out));
        }
        let dense = st
            .dense
            .iter()
            .map(|(w, _)| Blob::from(w.clone()))
            .collect();
        Ok(PullResp { rows, dense })
    }

    pub fn push(&self, r: PushReq) -> Result<(), String> {
        self.check(r.trainer, r.shard, &r.ids)?;
        for (t, ids) in r.ids.iter().enumerate() {
            let want = ids.len() * self.cfg.tables[t].dim;
            if r.grads.get(t).map(|g| g.len()) != Some(want) {
                return Err(format!("push: table {t} needs {want} gradient values"));
            }
        }
        let mut st = self.st.lock().unwrap();
        for (j, g) in r.dense.iter().enumerate() {
            let n = st.dense.get(j).map(|d| d.0.len());
            if !g.is_empty() && Some(g.len()) != n {
                return Err(format!(
                    "push: dense block {j} has {} values, not {n:?}",
                    g.len()
                ));
            }
        }
        let (trainer, step) = (r.trainer as usize, r.step);
        // A step this trainer pushed already (its clock is past it): a
        // retry after the push failed on another shard, which left the
        // trainer at this step. It was applied here (or, synchronous, is
        // waiting in its slot): taking it again would apply the gradient
        // twice, or leave a step that never fills.
        if step < st.clocks[trainer] {
            return Ok(());
        }
        st.stats.pushes += 1;
        st.clocks[trainer] = st.clocks[trainer].max(step + 1);
        if self.cfg.staleness == Some(0) {
            let n = self.cfg.trainers;
            st.waiting
                .entry(step)
                .or_insert_with(|| (0..n).map(|_| None).collect())[trainer] = Some(r);
            // Apply every complete step, in order.
            loop {
                let a = st.applied;
                let full = st
                    .waiting
                    .get(&a)
                    .is_some_and(|w| w.iter().all(|p| p.is_some()));
                if !full {
                    break;
                }
                let reqs: Vec<PushReq> = st
                    .waiting
                    .remove(&a)
                    .unwrap()
                    .into_iter()
                    .flatten()
                    .collect();
                self.apply(&mut st, &reqs);
                st.applied += 1;
            }
        } else {
            self.apply(&mut st, std::slice::from_ref(&r));
        }
        drop(st);
        self.cv.notify_all();
        Ok(())
    }

    fn check(&self, trainer: u32, shard: [u32; 2], ids: &[Blob<u64>]) -> Result<(), String> {
        if trainer as usize >= self.cfg.trainers {
            return Err(format!("trainer {trainer} of {}", self.cfg.trainers));
        }
        let [j, k] = shard.map(|x| x as usize);
        if (j, k) != (self.shard, self.shards) {
            return Err(format!(
                "trainer {trainer} addressed shard {j} of {k} at shard {} of {}: the servers \
                 given to PsClient must be every shard, in shard order",
                self.shard, self.shards
            ));
        }
        if ids.len() != self.cfg.tables.len() {
            return Err(format!(
                "{} id lists for {} tables",
                ids.len(),
                self.cfg.tables.len()
            ));
        }
        Ok(())
    }

    fn row<'a>(&self, st: &'a mut State, t: usize, id: u64) -> &'a mut Row {
        let acc0 = self.cfg.optim.init_acc();
        st.rows[t].entry(id).or_insert_with(|| {
            let w = self.cfg.init_row(t, id);
            let acc = vec![acc0; w.len()];
            Row { w, acc }
        })
    }

    /// Sum the gradients of `reqs` (in their order: trainer order in the
    /// synchronous mode), scale by 1/trainers, and update.
    fn apply(&self, st: &mut State, reqs: &[PushReq]) {
        let scale = 1.0 / self.cfg.trainers as f32;
        for t in 0..self.cfg.tables.len() {
            let dim = self.cfg.tables[t].dim;
            let mut sums: HashMap<u64, Vec<f32>> = HashMap::new();
            let mut order: Vec<u64> = Vec::new();
            for r in reqs {
                for (i, &id) in r.ids[t].iter().enumerate() {
                    let g = &r.grads[t][i * dim..(i + 1) * dim];
                    match sums.get_mut(&id) {
                        Some(s) => s.iter_mut().zip(g).for_each(|(s, g)| *s += g),
                        None => {
                            order.push(id);
                            sums.insert(id, g.to_vec());
                        }
                    }
                }
            }
            for id in order {
                let g: Vec<f32> = sums[&id].iter().map(|s| s * scale).collect();
                let row = self.row(st, t, id);
                self.cfg.optim.apply(&mut row.w, &mut row.acc, &g);
            }
        }
        for j in 0..st.dense.len() {
            let mut sum: Option<Vec<f32>> = None;
            for r in reqs {
                let Some(g) = r.dense.get(j).filter(|g| !g.is_empty()) else {
                    continue;
                };
                match &mut sum {
                    Some(s) => s.iter_mut().zip(g.iter()).for_each(|(s, g)| *s += g),
                    None => sum = Some(g.to_vec()),
                }
            }
            if let Some(s) = sum {
                let g: Vec<f32> = s.iter().map(|s| s * scale).collect();
                let (w, acc) = &mut st.dense[j];
                self.cfg.optim.apply(w, acc, &g);
            }
        }
    }
}
