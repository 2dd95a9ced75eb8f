//! The trainer's side: pull the rows and dense vectors a step needs from
//! every server at once, push the step's gradients to every server (each
//! server gets a push every step, possibly empty, which is its clock).

use super::server::{PullReq, PullResp, PushReq, ServerStats};
use super::{block, shard_of, PsConfig};
use crate::rpc::{Blob, Rpc, RpcError, RpcFuture, RpcResult};
use std::collections::HashMap;

/// What a pull returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Pulled {
    /// Per table, the rows in the order their ids were asked (`dim` each).
    pub rows: Vec<Vec<f32>>,
    /// Every dense vector, whole.
    pub dense: Vec<Vec<f32>>,
}

pub struct PsClient {
    rpc: Rpc,
    servers: Vec<usize>,
    cfg: PsConfig,
    trainer: u32,
    step: u64,
    /// A digest of the push that failed at this step: only the same push
    /// may follow (servers that took it ignore it; another one would be
    /// applied on some shards and dropped on the others).
    failed: Option<u64>,
    /// RPCs made so far (pulls and pushes, one per server each).
    pub calls: u64,
}

impl PsClient {
    /// Trainer `trainer` of `cfg.trainers`, against the named servers
    /// (shard j is `servers[j]`).
    pub fn new(rpc: Rpc, servers: &[String], cfg: PsConfig, trainer: usize) -> RpcResult<PsClient> {
        let servers = servers
            .iter()
            .map(|s| rpc.worker_rank(s))
            .collect::<RpcResult<Vec<_>>>()?;
        if servers.is_empty() || trainer >= cfg.trainers {
            return Err(RpcError::Invalid(format!(
                "trainer {trainer} of {} with {} servers",
                cfg.trainers,
                servers.len()
            )));
        }
        Ok(PsClient {
            rpc,
            servers,
            cfg,
            trainer: trainer as u32,
            step: 0,
            failed: None,
            calls: 0,
        })
    }

    pub fn config(&self) -> &PsConfig {
        &self.cfg
    }

    /// Steps pushed so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The parameters for the next step: rows `ids[t]` of every table t and
    /// every dense vector. Waits as the consistency mode requires.
    pub fn pull(&mut self, ids: &[&[u64]]) -> RpcResult<Pulled> {
        self.pull_at(ids, false)
    }

    /// Like `pull`, once every trainer has pushed as many steps as this
    /// one: the final model.
    pub fn pull_final(&mut self, ids: &[&[u64]]) -> RpcResult<Pulled> {
        self.pull_at(ids, true)
    }

    fn pull_at(&mut self, ids: &[&[u64]], wait_all: bool) -> RpcResult<Pulled> {
        let k = self.servers.len();
        // Distinct ids per (server, table), and where each one lands.
        let mut per: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); ids.len()]; k];
        let mut at: Vec<HashMap<u64, (usize, usize)>> = vec![HashMap::new(); ids.len()];
        for (t, list) in ids.iter().enumerate() {
            for &id in list.iter() {
                at[t].entry(id).or_insert_with(|| {
                    let s = shard_of(id, k);
                    per[s][t].push(id);
                    (s, per[s][t].len() - 1)
                });
            }
        }
        let futs: Vec<RpcFuture<PullResp>> = per
            .into_iter()
            .enumerate()
            .map(|(s, lists)| {
                let req = PullReq {
                    trainer: self.trainer,
                    step: self.step,
                    shard: [s as u32, k as u32],
                    ids: lists.into_iter().map(Blob::from).collect(),
                    wait_all,
                };
                self.rpc.rpc_async(self.servers[s], "ps.pull", &req)
            })
            .collect();
        self.calls += k as u64;
        let resps = futs
            .into_iter()
            .map(|f| f.wait())
            .collect::<RpcResult<Vec<_>>>()?;
        let rows = ids
            .iter()
            .enumerate()
            .map(|(t, list)| {
                let dim = self.cfg.tables[t].dim;
                let mut out = Vec::with_capacity(list.len() * dim);
                for id in list.iter() {
                    let (s, i) = at[t][id];
                    out.extend_from_slice(&resps[s].rows[t][i * dim..(i + 1) * dim]);
                }
                out
            })
            .collect();
        let dense = (0..self.cfg.dense.len())
            .map(|j| {
                resps
                    .iter()
                    .flat_map(|r| r.dense[j].iter().copied())
                    .collect()
            })
            .collect();
        Ok(Pulled { rows, dense })
    }

    /// Push this step's gradients: per table, distinct ids and their
    /// gradients (`dim` each, concatenated); per dense vector, its whole
    /// gradient (empty: none). Then the next step begins. If it fails, the
    /// step does not advance and the same push may be made again: a server
    /// that took it already ignores it the second time. Another push is
    /// refused until then (it would be taken by some shards only).
    pub fn push(&mut self, rows: &[(&[u64], &[f32])], dense: &[Vec<f32>]) -> RpcResult<()> {
        let digest = digest(rows, dense);
        if self.failed.is_some_and(|d| d != digest) {
            return Err(RpcError::Invalid(format!(
                "the push of step {} failed on some server, which others may have taken: push \
                 the same gradients again before any other",
                self.step
            )));
        }
        let k = self.servers.len();
        let nt = self.cfg.tables.len();
        if rows.len() != nt {
            return Err(RpcError::Invalid(format!(
                "{} gradient lists for {nt} tables",
                rows.len()
            )));
        }
        let mut ids: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); nt]; k];
        let mut grads: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); nt]; k];
        for (t, (list, g)) in rows.iter().enumerate() {
            let dim = self.cfg.tables[t].dim;
            if g.len() != list.len() * dim {
                return Err(RpcError::Invalid(format!(
                    "table {t}: {} gradient values for {} rows of {dim}",
                    g.len(),
                    list.len()
                )));
            }
            for (i, &id) in list.iter().enumerate() {
                let s = shard_of(id, k);
                ids[s][t].push(id);
                grads[s][t].extend_from_slice(&g[i * dim..(i + 1) * dim]);
            }
        }
        let futs: Vec<RpcFuture<()>> = (0..k)
            .map(|s| {
                let dense_blocks = dense
                    .iter()
                    .map(|g| {
                        if g.is_empty() {
                            return Blob::from(Vec::new());
                        }
                        let (a, b) = block(g.len(), k, s);
                        Blob::from(g[a..b].to_vec())
                    })
                    .collect();
                let req = PushReq {
                    trainer: self.trainer,
                    step: self.step,
                    shard: [s as u32, k as u32],
                    ids: std::mem::take(&mut ids[s])
                        .into_iter()
                        .map(Blob::from)
                        .collect(),
                    grads: std::mem::take(&mut grads[s])
                        .into_iter()
                        .map(Blob::from)
                        .collect(),
                    dense: dense_blocks,
                };
                self.rpc.rpc_async(self.servers[s], "ps.push", &req)
            })
            .collect();
        self.calls += k as u64;
        // Every future is waited for: the first error is the push's.
        let errs: Vec<RpcError> = futs.into_iter().filter_map(|f| f.wait().err()).collect();
        if let Some(e) = errs.into_iter().next() {
            self.failed = Some(digest);
            return Err(e);
        }
        self.failed = None;
        self.step += 1;
        Ok(())
    }

    /// Every server's statistics, by shard.
    pub fn server_stats(&self) -> RpcResult<Vec<ServerStats>> {
        self.servers
            .iter()
            .map(|&s| self.rpc.rpc_sync(s, "ps.stats", &()))
            .collect()
    }
}

/// A digest of a push's content (ids, gradient bits).
fn digest(rows: &[(&[u64], &[f32])], dense: &[Vec<f32>]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (ids, g) in rows {
        ids.hash(&mut h);
        g.iter().for_each(|x| x.to_bits().hash(&mut h));
    }
    for g in dense {
        g.len().hash(&mut h);
        g.iter().for_each(|x| x.to_bits().hash(&mut h));
    }
    h.finish()
}
