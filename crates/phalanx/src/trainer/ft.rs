//! The trainer as one replica group of a fault-tolerant job
//! (`[fault_tolerance]`, `phalanx_comm::ft`). A replica group is an
//! ordinary job inside (DDP, ZeRO, TP, PP over its own ranks); every rank
//! holds a `Manager`, and rank r of each group averages with rank r of the
//! others (the same layout, the same shard).
//!
//! Per step (DDP, ZeRO, TP, PP inside the group):
//! - the quorum: taken before the forward on the first step and after a
//!   step that did not commit; otherwise its check runs in the background
//!   during the forward and backward, and is read after them. After a
//!   membership change every member takes the most advanced member's state
//!   (parameters, optimizer state and its step count, loss scaler, step) by
//!   broadcast, and a step computed before the change runs again;
//! - the gradients' average over the quorum, then a vote inside the group:
//!   a step whose average failed on any rank (a member lost) does not
//!   commit and runs again with the next quorum.
//!
//! Under DiLoCo (`[diloco]`, groups of one rank) the groups meet only at
//! outer steps: every H steps, the quorum, the mean pseudo-gradient of the
//! members that trained through those H steps (a group that rejoined adds
//! nothing), the outer step, and healing after a change.

use super::Trainer;
use crate::error::{Error, Result};
use crate::strategy::state::StateRange;
use phalanx_comm::ft::{Manager, ManagerOpts, Quorum};
use std::ops::Range;

/// A group's fault-tolerance state.
pub(crate) struct Ft {
    pub mgr: Manager,
    /// This rank's share of each step's data: (index, of how many).
    pub shard: (usize, usize),
    /// The quorum of the step being run.
    pub quorum: Option<Quorum>,
    /// Samples committed over the run (each group's batch counted once per
    /// step it committed; torchft's `batches_committed`).
    pub samples_committed: u64,
    /// Take the next quorum before the forward (the first step, and after
    /// a step that did not commit).
    pub sync: bool,
    /// A change found after the forward healed this group: the step to
    /// run next.
    pub resume_at: Option<usize>,
    /// DiLoCo's H: the groups meet every H steps only.
    pub diloco: Option<usize>,
}

fn comm(e: phalanx_comm::CommError) -> Error {
    Error::Comm(e)
}

impl Ft {
    /// Join the lighthouse the config names, with the job secret. Every
    /// rank of the group calls it (collective over the group).
    pub fn connect(cfg: &crate::config::TrainConfig, mesh: &crate::mesh::DeviceMesh) -> Result<Ft> {
        let f = &cfg.fault_tolerance;
        let world = mesh.world();
        let diloco = cfg.diloco.on().then_some(cfg.diloco.inner_steps);
        if diloco.is_some() && world.size() != 1 {
            return Err(Error::Check(format!(
                "fault_tolerance with diloco: a replica group is one rank in this build (each group \
                 is one DiLoCo worker; start it with --nproc-per-node 1), not {}",
                world.size()
            )));
        }
        let made = |s: &str| {
            std::env::var(phalanx_comm::wire::SECRET_MADE)
                .is_ok_and(|m| m == phalanx_comm::secret_file::made_mark(s))
        };
        let secret =
            match std::env::var("PHALANX_SECRET") {
                Ok(s) if !s.is_empty() && !made(&s) => {
                    phalanx_comm::wire::parse_secret(&s).map_err(Error::Check)?
                }
                _ => return Err(Error::Check(
                    "fault_tolerance: the lighthouse and its groups need the same PHALANX_SECRET: \
                     export the lighthouse's to every group (none was exported here: the one \
                     this job's launcher made for its own ranks is no secret the lighthouse \
                     holds)"
                        .into(),
                )),
            };
        // While a group's first rank waits for a quorum (up to
        // quorum_timeout), its other ranks wait in a broadcast bounded by
        // the job's collective timeout: one shorter would end the group
        // with a broadcast timeout instead of the lighthouse's status.
        let comm_timeout = world.config().timeout;
        if world.size() > 1 && phalanx_comm::config::wait_secs(f.quorum_timeout) >= comm_timeout {
            return Err(Error::Check(format!(
                "fault_tolerance.quorum_timeout = {} s is not below the collective timeout \
                 ({} s, PHALANX_TIMEOUT), which bounds the wait of a replica group's other ranks \
                 while its first rank waits for the quorum: lower it or raise PHALANX_TIMEOUT",
                f.quorum_timeout,
                comm_timeout.as_secs_f64()
            )));
        }
        let opts = ManagerOpts {
            quorum_timeout: phalanx_comm::config::wait_secs(f.quorum_timeout),
            heartbeat_timeout: phalanx_comm::config::wait_secs(f.heartbeat_timeout),
            // The links across groups take the job's PHALANX_* settings
            // (transport, PHALANX_SOCKET_ADDR, detail checks, emulation);
            // groups are on other hosts, so a loopback address (a group on
            // the lighthouse's host whose name resolves to 127.0.1.1) is
            // no address to give them.
            comm: phalanx_comm::Config {
                spans_hosts: true,
                ..phalanx_comm::Config::from_env()
            },
            ..ManagerOpts::default()
        };
        let mgr = Manager::connect_group(
            &f.lighthouse,
            &secret,
            &f.replica_id.to_string(),
            opts,
            Some(world.clone()),
        )
        .map_err(comm)?;
        // Group i reads share i of `replicas`; inside it, its dp ranks split
        // that share as in a plain job.
        let (dp_rank, dp) = (mesh.dp().rank(), mesh.dp_size);
        Ok(Ft {
            mgr,
            shard: (f.replica_id * dp + dp_rank, f.replicas * dp),
            quorum: None,
            samples_committed: 0,
            sync: true,
            resume_at: None,
            diloco,
        })
    }
}

/// One range of healed state: parameters and optimizer buffers by name.
struct Healed {
    range: Range<usize>,
    group: Option<usize>,
    kinds: Vec<(String, Vec<f32>)>,
}

impl Healed {
    fn from_ranges(ranges: &[StateRange], body: &[f32]) -> Vec<Healed> {
        let mut at = 0;
        let mut take = |n: usize| {
            let v = body[at..at + n].to_vec();
            at += n;
            v
        };
        ranges
            .iter()
            .map(|r| {
                let n = r.range.len();
                let mut kinds = vec![("param".to_string(), take(n))];
                for (name, _) in &r.optim {
                    kinds.push((name.to_string(), take(n)));
                }
                Healed {
                    range: r.range.clone(),
                    group: r.group,
                    kinds,
                }
            })
            .collect()
    }

    /// As f64s (exact for the f32 values and the counts).
    fn encode(all: &[Healed]) -> Vec<f64> {
        let mut v = vec![all.len() as f64];
        for h in all {
            v.extend([
                h.range.start as f64,
                h.range.end as f64,
                h.group.map_or(-1.0, |g| g as f64),
                h.kinds.len() as f64,
            ]);
            for (name, vals) in &h.kinds {
                v.push(name.len() as f64);
                v.extend(name.bytes().map(f64::from));
                v.extend(vals.iter().map(|&x| x as f64));
            }
        }
        v
    }

    fn decode(v: &[f64], out: &mut Vec<Healed>) -> Result<()> {
        let bad = || Error::Check("healing: a malformed state message".into());
        let mut at = 0;
        let mut next = |n: usize| -> Result<&[f64]> {
            let s = v.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        let count = next(1)?[0] as usize;
        for _ in 0..count {
            let h = next(4)?;
            let (start, end, group, nk) = (h[0] as usize, h[1] as usize, h[2], h[3] as usize);
            let mut kinds = Vec::with_capacity(nk);
            for _ in 0..nk {
                let len = next(1)?[0] as usize;
                let name: String = next(len)?.iter().map(|&b| b as u8 as char).collect();
                let vals = next(end - start)?.iter().map(|&x| x as f32).collect();
                kinds.push((name, vals));
            }
            out.push(Healed {
                range: start..end,
                group: (group >= 0.0).then_some(group as usize),
                kinds,
            });
        }
        Ok(())
    }

    /// The values of `range` for `kind` (`param`, an optimizer buffer, or
    /// a DiLoCo group's `group{g}/...`), pieced together from the ranges
    /// that cover it (a DDP replica writes 1/dp of the state).
    fn fill(all: &[Healed], range: Range<usize>, kind: &str) -> Result<Option<Vec<f32>>> {
        let (group, name) = crate::strategy::state::split_group_kind(kind);
        let mut pieces: Vec<(Range<usize>, &[f32])> = all
            .iter()
            .filter(|h| h.group == group && h.range.start < range.end && range.start < h.range.end)
            .filter_map(|h| {
                let v = &h.kinds.iter().find(|(n, _)| n == name)?.1;
                let lo = range.start.max(h.range.start);
                let hi = range.end.min(h.range.end);
                Some((lo..hi, &v[lo - h.range.start..hi - h.range.start]))
            })
            .collect();
        if pieces.is_empty() {
            return Ok(None);
        }
        pieces.sort_by_key(|(r, _)| r.start);
        let mut out = Vec::with_capacity(range.len());
        for (r, v) in pieces {
            if r.start == range.start + out.len() {
                out.extend_from_slice(v);
            }
        }
        if out.len() != range.len() {
            return Err(Error::Check(format!(
                "healing: the healer's state covers {} of the {} values of {kind} in {range:?}",
                out.len(),
                range.len()
            )));
        }
        Ok(Some(out))
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
                ft.sync = false;
                return Ok(k);
            }
            if let Some(step) = self.ft_heal_and_say(&q, k, lead)? {
                self.ft.as_mut().expect("on").sync = false;
                return Ok(step);
            }
        }
    }

    /// After the forward and backward of step `k` (whose quorum check was
    /// started before them): `None` if the members are unchanged; else this
    /// group healed and the step to run next (the step's gradients were
    /// computed before the change and are dropped).
    pub(super) fn ft_after_forward(&mut self, k: usize, lead: bool) -> Result<Option<usize>> {
        let ft = self.ft.as_mut().expect("fault tolerance on");
        let q = ft.mgr.quorum(k as u64).map_err(comm)?;
        ft.quorum = Some(q.clone());
        if !q.changed {
            return Ok(None);
        }
        match self.ft_heal_and_say(&q, k, lead)? {
            Some(step) => Ok(Some(step)),
            None => {
                // A member lost while healing: a fresh quorum first.
                self.ft.as_mut().expect("on").sync = true;
                Ok(Some(k))
            }
        }
    }

    fn ft_heal_and_say(&mut self, q: &Quorum, k: usize, lead: bool) -> Result<Option<usize>> {
        let Some(step) = self.ft_heal(q, k)? else {
            return Ok(None);
        };
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
        Ok(Some(step))
    }

    /// Every member receives the healer's state (rank r of each group from
    /// rank r of the healer); a group behind, or on its first quorum, loads
    /// it. `None` if a member was lost.
    fn ft_heal(&mut self, q: &Quorum, k: usize) -> Result<Option<usize>> {
        if self.ft_check_settings(q)?.is_none() {
            return Ok(None);
        }
        // Only where some member needs it (behind, or not yet healed): a
        // plain loss leaves the others' state as it is, and the whole state
        // (parameters and every optimizer buffer) is not sent across the
        // groups' links for nothing.
        let ft = self.ft.as_mut().expect("fault tolerance on");
        match ft.mgr.any(q.behind || q.first).map_err(comm)? {
            None => return Ok(None),
            Some(false) => {
                ft.mgr.mark_healed();
                return Ok(Some(k));
            }
            Some(true) => {}
        }
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
        ft.mgr.mark_healed();
        if !(q.behind || q.first) || q.rank == q.healer {
            return Ok(Some(k)); // ours is the state everyone took
        }
        // What this rank received, and what the group's other ranks with
        // the same flat layout (the same tp rank) received: a rank writes
        // only part of the state (a DDP replica 1/dp of it, a ZeRO rank
        // its shard, a pipeline stage its own blocks and a tied weight
        // only from its first stage), and together they hold all of it,
        // as a checkpoint would give it.
        let mut healed = Healed::from_ranges(&ranges, &body);
        let world = self.mesh.world().clone();
        if world.size() > 1 {
            let tp = self.mesh.coords().tp;
            let mut mine = vec![tp as f64];
            mine.extend(Healed::encode(&healed));
            let mut lens = vec![0i64; world.size()];
            world.all_gather(&[mine.len() as i64], &mut lens)?;
            let counts: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
            let mut all = vec![0f64; counts.iter().sum()];
            world.all_gather_v(&mine, &counts, &mut all)?;
            healed.clear();
            let mut at = 0;
            for c in counts {
                let msg = &all[at..at + c];
                if msg.first() == Some(&(tp as f64)) {
                    Healed::decode(&msg[1..], &mut healed)?;
                }
                at += c;
            }
        }
        let mut fill = |range: Range<usize>, kind: &str| Healed::fill(&healed, range, kind);
        self.strat
            .load_state(&mut self.engine, &mut fill, head[1] as u64)?;
        let len = head[2] as usize;
        let bytes: Vec<u8> = head[3..3 + len].iter().map(|&v| v as u8).collect();
        self.scaler = serde_json::from_slice(&bytes).map_err(|e| Error::Check(e.to_string()))?;
        Ok(Some(head[0] as usize))
    }

    /// After a membership change: every member trains with the same
    /// settings (see [`shared_settings`]). The reference is the members
    /// that were in the quorum before (their settings passed then), or,
    /// when every member is new (the start), the healer. A new group that
    /// differs from it stops, naming the first key that differs; the others
    /// go on without it. `None`: a member was lost.
    fn ft_check_settings(&mut self, q: &Quorum) -> Result<Option<()>> {
        let mine = shared_settings(&self.cfg);
        let text = mine.to_string();
        let h = fnv(text.bytes().map(u64::from)) as i64;
        let ft = self.ft.as_mut().expect("fault tolerance on");
        let Some(all) = ft.mgr.all_digests(h).map_err(comm)? else {
            return Ok(None);
        };
        if all.iter().all(|&d| d == h) {
            return Ok(Some(()));
        }
        // Every rank of every group takes this path (the digests are the
        // same everywhere), so the collectives below match.
        let Some(firsts) = ft.mgr.all_digests(i64::from(q.first)).map_err(comm)? else {
            return Ok(None);
        };
        let Some(texts) = ft.mgr.all_texts(&text).map_err(comm)? else {
            return Ok(None);
        };
        let r = (0..all.len()).find(|&i| firsts[i] == 0).unwrap_or(q.healer);
        let differ = |i: usize| -> String {
            let theirs: serde_json::Value = serde_json::from_str(&texts[i]).unwrap_or_default();
            let reference: serde_json::Value = serde_json::from_str(&texts[r]).unwrap_or_default();
            let names = (
                format!("group {}", q.members[i]),
                format!("group {}", q.members[r]),
            );
            // Keys come as `.optim.lr`: without the leading dot.
            crate::data::resume::first_difference_as("", &theirs, &reference, (&names.0, &names.1))
                .map(|d| d.trim_start_matches('.').to_string())
                .unwrap_or_default()
        };
        let me = ft.mgr.replica_id().to_string();
        if q.first && h != all[r] {
            return Err(Error::Check(format!(
                "replica group {me} does not train with the settings of the quorum ({}); every \
                 group must train the same model the same way",
                differ(q.rank)
            )));
        }
        if self.mesh.world().rank() == 0 {
            for i in (0..all.len()).filter(|&i| all[i] != all[r]) {
                eprintln!(
                    "warning: replica group {} (new to the quorum) trains with other settings \
                     ({}): it stops, and replica group {me} goes on without it",
                    q.members[i],
                    differ(i)
                );
            }
        }
        Ok(Some(()))
    }

    /// `parallel.check_params_every`: after step `done`, every group of
    /// the quorum holds bitwise the same state (rank r of each group the
    /// same shard), or the run stops naming the groups that differ.
    pub(super) fn ft_check_identical(&mut self, done: usize) -> Result<()> {
        // Parameters, every optimizer buffer and the optimizer's step
        // (under DiLoCo the parameters only: each group's inner optimizer
        // is its own).
        let inner_own = self.ft.as_ref().is_some_and(|f| f.diloco.is_some());
        let mut words = Vec::new();
        for r in self.strat.save_state(&self.engine)? {
            words.push(crate::strategy::ddp::digest(&r.params) as u64);
            if inner_own {
                continue;
            }
            words.extend(
                r.optim
                    .iter()
                    .map(|(_, v)| crate::strategy::ddp::digest(v) as u64),
            );
            words.push(r.optim_step);
        }
        let h = fnv(words);
        let ft = self.ft.as_mut().expect("fault tolerance on");
        let Some(all) = ft.mgr.all_digests(h as i64).map_err(comm)? else {
            ft.sync = true;
            return Ok(()); // a member lost: checked again next time
        };
        let q = ft.quorum.as_ref().expect("a quorum");
        let differ: Vec<&str> = (0..all.len())
            .filter(|&i| all[i] != all[0])
            .map(|i| q.members[i].as_str())
            .collect();
        let mut bad = [i32::from(!differ.is_empty())];
        self.mesh
            .world()
            .all_reduce(&mut bad, phalanx_comm::ReduceOp::Max)?;
        if bad[0] == 0 {
            return Ok(());
        }
        Err(Error::Check(format!(
            "replica groups diverged after step {done}: {} differ from group {} \
             (parallel.check_params_every = {})",
            if differ.is_empty() {
                "another rank's shards".to_string()
            } else {
                format!("group(s) {}", differ.join(", "))
            },
            q.members[0],
            self.cfg.parallel.check_params_every
        )))
    }

    /// After the backward: the gradients' average over the quorum. False:
    /// a member was lost, the step does not commit.
    pub(super) fn ft_reduce(&mut self) -> Result<bool> {
        let ft = self.ft.as_mut().expect("fault tolerance on");
        let ok = ft
            .mgr
            .all_reduce(self.strat.step_grads(&mut self.engine))
            .map_err(comm)?;
        if ok {
            let size = ft.quorum.as_ref().map_or(1, |q| q.size);
            ft.samples_committed += (size * self.global_batch) as u64;
        } else {
            ft.sync = true;
        }
        Ok(ok)
    }

    /// DiLoCo over a quorum, after `done` steps: the outer step if one is
    /// due and this group trained through its H steps (`contribute`; not
    /// if it has `applied` it already), then
    /// healing after a change. Retried with the next quorum until it
    /// commits. Returns the step to go on from.
    pub(super) fn ft_outer(
        &mut self,
        done: usize,
        contribute: bool,
        applied: bool,
        lead: bool,
    ) -> Result<usize> {
        let mut contribute = contribute;
        // Whether this group has applied the outer step after `done`. A
        // group whose average succeeded while another's failed (a member
        // lost at its very end) is ahead of it at the same step: it
        // reports 2 * done + 1, so that the retry heals the others from
        // it rather than apply their pseudo-gradients again over its
        // applied step (or leave the groups apart, no one behind). A group
        // resumed from a checkpoint of step `done` (saved after its outer
        // step) has applied it (`applied` given).
        let mut applied = applied;
        loop {
            let ft = self.ft.as_mut().expect("fault tolerance on");
            let h = ft.diloco.expect("DiLoCo");
            let at = 2 * done as u64 + u64::from(applied);
            let q = ft.mgr.quorum(at).map_err(comm)?;
            ft.quorum = Some(q.clone());
            let take_part = contribute && !q.behind;
            let d = self.strat.diloco_mut().expect("the DiLoCo strategy");
            let mut delta = if take_part {
                d.pseudo_gradient(&self.engine)
            } else {
                vec![0.0; self.engine.num_params()]
            };
            let ft = self.ft.as_mut().expect("fault tolerance on");
            let Some(n) = ft
                .mgr
                .average_participants(&mut delta, take_part)
                .map_err(comm)?
            else {
                continue; // a member lost: the next quorum, without it
            };
            if crate::fault::outer_average_lost(done) {
                ft.mgr.fail_epoch();
                continue;
            }
            ft.samples_committed += (n * h * self.global_batch) as u64;
            if take_part && n > 0 {
                let d = self.strat.diloco_mut().expect("the DiLoCo strategy");
                d.apply_outer(&mut self.engine, done, &delta)?;
                applied = true;
                if lead && (q.changed || n != q.size) {
                    println!(
                        "fault tolerance: outer step after step {done} over {n} of {} group(s) [{}]",
                        q.size,
                        q.members.join(", ")
                    );
                }
            }
            // Taken: a retry below must not take it again.
            contribute = false;
            let at = if q.changed {
                match self.ft_heal_and_say(&q, done, lead)? {
                    Some(step) => step,
                    None => continue,
                }
            } else {
                done
            };
            // Every member (a group that just joined too) is here after
            // each outer step: where the groups compare their states.
            if self.cfg.parallel.check_params_every > 0 {
                self.ft_check_identical(at)?;
            }
            return Ok(at);
        }
    }
}

/// FNV-1a over 64-bit words: a digest that is the same in every process
/// (std's hasher is not promised to be).
fn fnv(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(0xcbf29ce484222325, |h, w| {
        (h ^ w).wrapping_mul(0x100000001b3)
    })
}

/// The settings every replica group must share: what decides the training
/// math (the model, the optimizer, batch and steps, precision, the layout
/// and ZeRO, DiLoCo, the data's seed and order) and how many groups share
/// the data. Not paths (a group's host may keep the data elsewhere), logs,
/// checkpoints or evaluation.
fn shared_settings(cfg: &crate::config::TrainConfig) -> serde_json::Value {
    let v = serde_json::to_value(cfg).unwrap_or_default();
    let mut out = serde_json::Map::new();
    for k in [
        "model",
        "train",
        "optim",
        "parallel",
        "zero_optimization",
        "diloco",
        "fp16",
        "bf16",
    ] {
        if let Some(x) = v.get(k) {
            out.insert(k.to_string(), x.clone());
        }
    }
    if let Some(t) = out.get_mut("train").and_then(|t| t.as_object_mut()) {
        t.remove("eval_interval");
        t.remove("eval_batches");
    }
    out.insert(
        "data".into(),
        serde_json::json!({"seed": v["data"]["seed"], "shuffle": v["data"]["shuffle"]}),
    );
    out.insert(
        "fault_tolerance".into(),
        serde_json::json!({"replicas": v["fault_tolerance"]["replicas"]}),
    );
    // Where a group keeps its files (an NVMe offload directory) is its own.
    fn no_paths(v: &mut serde_json::Value) {
        if let Some(o) = v.as_object_mut() {
            o.retain(|k, _| !(k.contains("path") || k.ends_with("dir")));
            o.values_mut().for_each(no_paths);
        }
    }
    let mut out = serde_json::Value::Object(out);
    no_paths(&mut out);
    out
}
