//! A replica group's side of the lighthouse: join, heartbeat, per-step
//! quorum, the process groups among a quorum's members, healing and the
//! cross-group average (see the module docs of [`super`]).
//!
//! A replica group may be several ranks (an ordinary job inside: DDP,
//! ZeRO, TP, PP over its own ranks). Every rank of the group holds a
//! `Manager` ([`Manager::connect_group`] with the group's own process
//! group): the group's first rank joins the lighthouse, heartbeats and
//! decides each quorum, and tells its other ranks by broadcast; rank `r` of
//! each member group then forms a process group with rank `r` of every
//! other member (same layout, same shard), and every collective across
//! groups ends with a vote inside the group, so a group commits a step only
//! when all its ranks' reductions succeeded.

use super::key;

mod lookup;
use crate::config::Config;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::store::StoreClient;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A group's fault-tolerance settings.
#[derive(Debug, Clone)]
pub struct ManagerOpts {
    /// How long a quorum may take before the group gives up.
    pub quorum_timeout: Duration,
    /// The lighthouse's heartbeat timeout (beats are sent 5 times as often).
    pub heartbeat_timeout: Duration,
    /// How long a collective across groups (and the connection of their
    /// process group) may wait for a slow member; `None`: the quorum
    /// timeout. A member that is silent (stopped, or its host gone) is
    /// found sooner, by the links' own heartbeats, after twice the
    /// heartbeat timeout; a killed one at once.
    pub sync_timeout: Option<Duration>,
    /// Settings of the process group among a quorum's members.
    pub comm: Config,
}

impl Default for ManagerOpts {
    fn default() -> Self {
        ManagerOpts {
            quorum_timeout: Duration::from_secs(60),
            heartbeat_timeout: Duration::from_secs(5),
            sync_timeout: None,
            comm: Config::default(),
        }
    }
}

/// One step's quorum, as this group sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Quorum {
    pub epoch: u64,
    /// This group's rank among the members (by replica id).
    pub rank: usize,
    pub size: usize,
    /// The members' replica ids, by rank.
    pub members: Vec<String>,
    /// Whether the membership (or a member's incarnation) changed since the
    /// last quorum: the caller heals before the step.
    pub changed: bool,
    /// The most advanced step among the members, and the rank that holds it.
    pub max_step: u64,
    pub healer: usize,
    /// Whether this group is behind `max_step` (it rejoined).
    pub behind: bool,
    /// Whether this incarnation has not yet completed a heal (its first
    /// quorum, or the ones after a heal that failed): it takes the
    /// healer's state even when not behind, so that all groups start from
    /// the same parameters.
    pub first: bool,
}

/// What the overlapped quorum check found: its connection, the latest
/// epoch, the lighthouse's id.
type Checked = (StoreClient, u64, Vec<u8>);

pub struct Manager {
    store: StoreClient,
    secret: Vec<u8>,
    addr: String,
    id: String,
    inc: u64,
    /// The id of the lighthouse's start this group joined (`ft/lighthouse`):
    /// another one is a restarted lighthouse, which knows no groups.
    generation: Vec<u8>,
    opts: ManagerOpts,
    stop: Arc<AtomicBool>,
    beat: Option<JoinHandle<()>>,
    /// The group's progress ([`Manager::note_progress`]), which the
    /// heartbeat publishes.
    progress: Arc<AtomicU64>,
    epoch: u64,
    /// Among rank `local rank` of each member group.
    pg: Option<ProcessGroup>,
    quorum: Option<Quorum>,
    /// The group's own ranks; `None` for a group of one rank.
    local: Option<ProcessGroup>,
    /// The overlapped quorum check in flight (the group's first rank): the
    /// latest epoch and the lighthouse's id.
    check: Option<JoinHandle<Result<Checked>>>,
    /// The store connection the overlapped check uses.
    poll: Option<StoreClient>,
    /// Quorums this incarnation has formed.
    formed: u64,
    /// Bytes sent by the process groups of earlier epochs.
    sent_before: u64,
    /// Since when the lighthouse has not answered (the first rank, going
    /// on with its quorum meanwhile).
    lost_since: Option<Instant>,
    /// Whether this incarnation has taken part in a heal that completed
    /// ([`Manager::mark_healed`]): until then its quorums are `first`.
    healed: bool,
}

/// What the group's first rank decided, as its other ranks receive it.
const UNCHANGED: i64 = 0;
const CONNECT: i64 = 1;
const FAILED: i64 = 2;

impl Manager {
    /// Join the lighthouse at `addr` as replica group `id`, a group of one
    /// rank (a new incarnation each time), and start heartbeating.
    pub fn connect(addr: &str, secret: &[u8], id: &str, opts: ManagerOpts) -> Result<Manager> {
        Manager::connect_group(addr, secret, id, opts, None)
    }

    /// Every rank of replica group `id` calls this with the group's own
    /// process group `local` (`None` or a group of one: a one-rank group).
    /// The group's first rank joins the lighthouse and heartbeats; the
    /// others learn its incarnation. Collective over `local`.
    pub fn connect_group(
        addr: &str,
        secret: &[u8],
        id: &str,
        opts: ManagerOpts,
        local: Option<ProcessGroup>,
    ) -> Result<Manager> {
        if id.is_empty() || id.contains([',', '@', '/']) {
            return Err(CommError::Invalid(format!(
                "replica id {id:?}: must be non-empty, without ',', '@' or '/'"
            )));
        }
        let local = local.filter(|l| l.size() > 1);
        let lead = local.as_ref().is_none_or(|l| l.rank() == 0);
        let store = super::connect(addr, secret, opts.quorum_timeout)?;
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let mut beat = None;
        let mut inc = [0i64];
        let mut generation = Vec::new();
        if lead {
            let ms = |k: &str| -> Result<Option<Duration>> {
                Ok(store
                    .try_get(&key(k))?
                    .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok())
                    .map(Duration::from_millis))
            };
            // A group lost is dropped only after the lighthouse's heartbeat
            // timeout, and the next quorum published after its join
            // timeout: a survivor waiting less gives up first.
            if let Some(hb) = ms("heartbeat_timeout_ms")? {
                let join = ms("join_timeout_ms")?.unwrap_or_default();
                if opts.quorum_timeout <= hb + join {
                    let e = format!(
                        "fault_tolerance.quorum_timeout = {:?} is not above the lighthouse's \
                         heartbeat timeout ({hb:?}) plus its join timeout ({join:?}): a group lost \
                         is dropped only after those, so the others would give up first; raise \
                         it (or start the lighthouse with a shorter --heartbeat-timeout)",
                        opts.quorum_timeout
                    );
                    if let Some(l) = &local {
                        l.fail_peers(&e);
                    }
                    return Err(CommError::Invalid(e));
                }
            }
            generation = store.try_get(&key("lighthouse"))?.unwrap_or_default();
            let hb = super::connect(addr, secret, opts.quorum_timeout)?;
            // The lighthouse judges silence by its own timeout: beat 5
            // times within the shorter of the two, or a lighthouse started
            // with a shorter one drops every group as soon as it joins.
            let theirs = store
                .try_get(&key("heartbeat_timeout_ms"))?
                .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok())
                .map(Duration::from_millis);
            let within = theirs.map_or(opts.heartbeat_timeout, |t| t.min(opts.heartbeat_timeout));
            let (s2, hb_key, every) = (stop.clone(), key(&format!("hb/{id}")), within / 5);
            let (p2, progress_key) = (progress.clone(), key(&format!("progress/{id}")));
            hb.add(&hb_key, 1)?;
            beat = Some(
                std::thread::Builder::new()
                    .name("phalanx-ft-heartbeat".into())
                    .spawn(move || {
                        let mut said = 0;
                        while !s2.load(Ordering::SeqCst) {
                            // A failed beat (the lighthouse restarting) is
                            // tried again: the client reconnects.
                            let _ = hb.add(&hb_key, 1);
                            // Progress, when it moved: the lighthouse keeps
                            // a member that others find absent from a
                            // quorum while it works (DiLoCo's inner steps).
                            let p = p2.load(Ordering::Relaxed);
                            if s2.load(Ordering::SeqCst) {
                                break;
                            }
                            if p != said && hb.set(&progress_key, p.to_string().as_bytes()).is_ok()
                            {
                                said = p;
                            }
                            std::thread::sleep(every);
                        }
                    })?,
            );
            inc[0] = store.add(&key("joins"), 1)? - 1;
            store.set(&key(&format!("join/{}", inc[0])), id.as_bytes())?;
        }
        if let Some(l) = &local {
            l.broadcast(&mut inc, 0)?;
        }
        Ok(Manager {
            store,
            secret: secret.to_vec(),
            addr: addr.to_string(),
            id: id.to_string(),
            inc: inc[0] as u64,
            generation,
            opts,
            stop,
            beat,
            progress,
            epoch: 0,
            pg: None,
            quorum: None,
            local,
            check: None,
            poll: None,
            formed: 0,
            sent_before: 0,
            lost_since: None,
            healed: false,
        })
    }

    /// Bytes this rank has sent to the other groups (every epoch's links).
    pub fn bytes_sent(&self) -> u64 {
        self.sent_before + self.pg.as_ref().map_or(0, |pg| pg.bytes_sent())
    }

    /// This epoch's links, taken out (their bytes counted).
    fn take_pg(&mut self) -> Option<ProcessGroup> {
        let pg = self.pg.take()?;
        self.sent_before += pg.bytes_sent();
        Some(pg)
    }

    /// Whether `flag` holds on any member (every rank of every group
    /// calls it). `Ok(None)`: a member was lost.
    pub fn any(&mut self, flag: bool) -> Result<Option<bool>> {
        let mut v = [i32::from(flag)];
        let ok = self.on_group(|pg| pg.all_reduce(&mut v, ReduceOp::Max))?;
        Ok(ok.then_some(v[0] == 1))
    }

    /// Say that the group made progress (a step done, inner steps too):
    /// the heartbeat publishes it, and the lighthouse does not drop a member
    /// the others find absent from a quorum while its progress moves (a
    /// DiLoCo group in its inner steps meets the others only at its next
    /// outer step). Cheap: an atomic store.
    pub fn note_progress(&self, step: u64) {
        self.progress.store(step + 1, Ordering::Relaxed);
    }

    pub fn replica_id(&self) -> &str {
        &self.id
    }

    /// The process group among the current quorum's members (rank
    /// `local rank` of each).
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.pg.as_ref()
    }

    fn lead(&self) -> bool {
        self.local.as_ref().is_none_or(|l| l.rank() == 0)
    }

    fn me(&self) -> String {
        format!("{}@{}", self.id, self.inc)
    }

    /// Start the check that the next [`Manager::quorum`] needs, in the
    /// background (the group's first rank; nothing on the others), so
    /// that it overlaps the forward: with the members unchanged the
    /// quorum then costs no round trip. Does nothing before a quorum.
    pub fn start_quorum(&mut self, step: u64) -> Result<()> {
        if !self.lead() || self.check.is_some() || self.pg.is_none() || self.quorum.is_none() {
            return Ok(());
        }
        // A new connection (the last check failed) is made in the check
        // too: a lighthouse that does not answer is then a failed check,
        // which `decide` carries on from, not an error of this step.
        let poll = self.poll.take();
        let (addr, secret, timeout) = (
            self.addr.clone(),
            self.secret.clone(),
            self.opts.quorum_timeout,
        );
        let step_key = key(&format!("step/{}", self.me()));
        self.check = Some(
            std::thread::Builder::new()
                .name("phalanx-ft-quorum".into())
                .spawn(move || {
                    let client = match poll {
                        Some(c) => c,
                        None => super::connect(&addr, &secret, timeout)?,
                    };
                    client.set(&step_key, step.to_string().as_bytes())?;
                    let e = Manager::latest_epoch(&client)?;
                    let gen = client.try_get(&key("lighthouse"))?.unwrap_or_default();
                    Ok((client, e, gen))
                })?,
        );
        Ok(())
    }

    /// `v` from the group's first rank to its other ranks.
    fn local_bcast(&self, v: &mut [i64]) -> Result<()> {
        match &self.local {
            Some(l) => l.broadcast(v, 0),
            None => Ok(()),
        }
    }

    /// Whether every rank of the group says `ok` (a failure of the group's
    /// own ranks is an error: the group cannot go on).
    fn local_all(&self, ok: bool) -> Result<bool> {
        let mut v = [i32::from(ok)];
        if let Some(l) = &self.local {
            l.all_reduce(&mut v, ReduceOp::Min)?;
        }
        Ok(v[0] == 1)
    }

    /// The quorum for the step this group is at (`step`). Fast when the
    /// epoch is unchanged (no round trip at all after [`start_quorum`]);
    /// otherwise waits (up to the quorum timeout) for an epoch that holds
    /// this incarnation and connects to its members. Collective over the
    /// group's own ranks.
    ///
    /// [`start_quorum`]: Manager::start_quorum
    pub fn quorum(&mut self, step: u64) -> Result<Quorum> {
        loop {
            // The decision, the epoch, and this group's incarnation (new
            // after joining a restarted lighthouse).
            let mut d = [UNCHANGED, 0, 0];
            let mut failed = None;
            if self.lead() {
                match self.decide(step) {
                    Ok(None) => {}
                    Ok(Some(e)) => d = [CONNECT, e as i64, self.inc as i64],
                    Err(e) => {
                        d = [FAILED, 0, 0];
                        failed = Some(e);
                    }
                }
            }
            self.local_bcast(&mut d)?;
            match d[0] {
                UNCHANGED => {
                    let q = self.quorum.as_ref().ok_or_else(|| {
                        CommError::Invalid("ft: the group's ranks disagree on the quorum".into())
                    })?;
                    // The same members, all stepping together since
                    // the last change: no one is behind.
                    return Ok(Quorum {
                        changed: false,
                        first: false,
                        behind: false,
                        ..q.clone()
                    });
                }
                FAILED => {
                    return Err(failed.unwrap_or_else(|| {
                        CommError::Timeout(format!(
                            "replica group {}: its first rank found no quorum within {:?}",
                            self.id, self.opts.quorum_timeout
                        ))
                    }))
                }
                _ => {}
            }
            let e = d[1] as u64;
            self.epoch = e;
            self.inc = d[2] as u64;
            self.quorum = None;
            if let Some(pg) = self.take_pg() {
                pg.shutdown();
            }
            let members = self.members(e)?;
            let rank = members
                .iter()
                .position(|(id, inc)| *id == self.id && *inc == self.inc);
            let ok = match rank {
                Some(r) => match self.connect_epoch(e, r, members.len()) {
                    Ok(()) => true,
                    // Two groups of different layouts (or configs) would
                    // fail the same way with every epoch. (A peer's failure
                    // it published while connecting, a member lost in the
                    // set-up, is `Aborted` and retried with the next epoch.)
                    Err(err @ CommError::Invalid(_)) => return Err(err),
                    Err(err) => {
                        eprintln!(
                            "replica group {}: connecting to epoch {e}'s members failed: {err}",
                            self.id
                        );
                        false
                    }
                },
                None => false,
            };
            if !self.local_all(ok)? {
                // A member gone before the group formed: the lighthouse
                // drops it (a dead one by its heartbeats, an absent one by
                // the members' reports); wait for the next epoch.
                // (Not for an epoch given up for a newer one: the
                // lighthouse has moved on, and nobody was timed out.)
                let outrun = Self::latest_epoch(&self.store).is_ok_and(|l| l > e);
                if self.lead() && !outrun {
                    self.report_absent(e, rank, &members);
                }
                self.suspect();
                continue;
            }
            let rank = rank.expect("connected");
            // The members' steps, read once by the first rank.
            let mut s = [0i64; 3];
            if self.lead() {
                let mut steps = Vec::with_capacity(members.len());
                for (id, inc) in &members {
                    let v = self
                        .store
                        .try_get(&key(&format!("step/{id}@{inc}")))?
                        .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok())
                        .unwrap_or(0);
                    steps.push(v);
                }
                let max_step = steps.iter().copied().max().unwrap_or(0);
                let healer = steps.iter().position(|&s| s == max_step).unwrap_or(0);
                s = [
                    max_step as i64,
                    healer as i64,
                    i64::from(steps[rank] < max_step),
                ];
            }
            self.local_bcast(&mut s)?;
            let q = Quorum {
                epoch: e,
                rank,
                size: members.len(),
                members: members.iter().map(|(id, _)| id.clone()).collect(),
                changed: true,
                max_step: s[0] as u64,
                healer: s[1] as usize,
                behind: s[2] == 1,
                first: !self.healed,
            };
            self.formed += 1;
            self.quorum = Some(q.clone());
            return Ok(q);
        }
    }

    fn connect_epoch(&mut self, e: u64, rank: usize, size: usize) -> Result<()> {
        // A member may be slow (its step is longer, or under DiLoCo it is
        // still in its inner steps): wait for it up to the sync timeout;
        // a silent one is found by the links' heartbeats.
        let cfg = Config {
            timeout: self.opts.sync_timeout.unwrap_or(self.opts.quorum_timeout),
            heartbeat_timeout: self.opts.heartbeat_timeout * 2,
            ..self.opts.comm.clone()
        };
        let r = self.local.as_ref().map_or(0, |l| l.rank());
        let prefix = key(&format!("pg/{e}/{r}"));
        // A newer epoch formed while this one's members meet (one counted
        // in it was lost meanwhile, or a group joined) means this one may
        // never complete: a watcher gives it up at once, as the set-up's
        // error every waiting member reads (`Aborted`: the next epoch is
        // tried), instead of waiting out the timeout for the lost member.
        let (store, secret) = (&self.store, &self.secret);
        let met = AtomicBool::new(false);
        let pg = std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                while !met.load(Ordering::SeqCst) {
                    // (Woken at once when the set-up ends.)
                    std::thread::park_timeout(Duration::from_millis(200));
                    if met.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(later) = Self::latest_epoch(store) else {
                        continue;
                    };
                    if later > e && !met.load(Ordering::SeqCst) {
                        let why = format!(
                            "the lighthouse formed epoch {later} while epoch {e}'s members met \
                             (a member it counted was lost, or a group joined): epoch {e} is \
                             given up"
                        );
                        let _ = store.set(&format!("{prefix}/error"), why.as_bytes());
                        return;
                    }
                }
            });
            // (Set however the set-up ends, a panic too: the scope waits
            // for the watcher.)
            struct Met<'a>(&'a AtomicBool, std::thread::Thread);
            impl Drop for Met<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                    self.1.unpark();
                }
            }
            let _met = Met(&met, watcher.thread().clone());
            crate::init::from_store(store, &prefix, rank, size, secret, cfg, None)
        })?;
        self.pg = Some(pg);
        Ok(())
    }

    /// Drop this epoch's links; the first rank tells the lighthouse they
    /// failed.
    fn suspect(&mut self) {
        if self.lead() {
            let _ = self
                .store
                .set(&key(&format!("suspect/{}", self.epoch)), self.id.as_bytes());
        }
        if let Some(pg) = self.take_pg() {
            pg.abort("a member of the quorum was lost");
        }
    }

    /// Run `f` on the quorum's group, then vote inside the group: `Ok(true)`
    /// when every rank's `f` succeeded; otherwise the epoch is suspect, the
    /// links are dropped and the caller retries after the next `quorum`.
    fn on_group(&mut self, f: impl FnOnce(&ProcessGroup) -> Result<()>) -> Result<bool> {
        let pg = self.pg.as_ref().ok_or_else(|| {
            CommError::Invalid("Manager: call quorum() before a collective".into())
        })?;
        let ok = match f(pg) {
            Ok(()) => true,
            Err(e @ CommError::Invalid(_)) => return Err(e),
            // Members that call with different sizes (another model, another
            // layout) would fail so with every quorum: fatal, unlike a member
            // lost. ("never called" is a timeout under PHALANX_DEBUG=detail.)
            Err(e @ CommError::Desync(_)) if !e.to_string().contains("never called") => {
                return Err(e)
            }
            Err(e) => {
                // Ranks there are the members' places in the quorum, and
                // its deadline is the fault-tolerance one.
                let who = self.quorum.as_ref().map_or(String::new(), |q| {
                    let m: Vec<String> = q
                        .members
                        .iter()
                        .enumerate()
                        .map(|(r, id)| format!("rank {r} = group {id}"))
                        .collect();
                    format!(" [{}]", m.join(", "))
                });
                // (`sync_timeout` is the API's; `phalanx train` sets none.)
                let wait = match self.opts.sync_timeout {
                    Some(t) => format!("ManagerOpts::sync_timeout: {t:?}"),
                    None => format!(
                        "fault_tolerance.quorum_timeout: {:?}",
                        self.opts.quorum_timeout
                    ),
                };
                eprintln!(
                    "replica group {}: the step's reduction failed ({e}){who} (the wait across \
                     groups is {wait}); retrying with the next quorum",
                    self.id
                );
                false
            }
        };
        let all = self.local_all(ok)?;
        if !all {
            self.suspect();
        }
        Ok(all)
    }

    /// The cross-group average of `buf` over this step's quorum (each rank
    /// of the group with the same rank of the others). `Ok(false)`: a
    /// member was lost, the step does not commit.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T]) -> Result<bool> {
        self.on_group(|pg| pg.all_reduce(buf, ReduceOp::Avg))
    }

    /// The average of `buf` over the members that `participate` (the others
    /// add nothing: a group that rejoined has no contribution of its own
    /// yet). `Ok(None)`: a member was lost; `Ok(Some(0))`: no member took
    /// part, `buf` is all zeros; else how many did, `buf` their mean.
    pub fn average_participants(
        &mut self,
        buf: &mut Vec<f32>,
        participate: bool,
    ) -> Result<Option<usize>> {
        if !participate {
            buf.iter_mut().for_each(|x| *x = 0.0);
        }
        buf.push(if participate { 1.0 } else { 0.0 });
        let ok = self.on_group(|pg| pg.all_reduce(buf.as_mut_slice(), ReduceOp::Sum));
        let n = buf.pop().unwrap_or(0.0) as usize;
        if !ok? {
            return Ok(None);
        }
        if n > 0 {
            // As ReduceOp::Avg divides: the same bits as an all-member mean.
            buf.iter_mut().for_each(|x| *x /= n as f32);
        }
        Ok(Some(n))
    }

    /// Every member's `digest` (of its state), by member rank: each rank
    /// of the group with the same rank of the others. `Ok(None)`: a member
    /// was lost.
    pub fn all_digests(&mut self, digest: i64) -> Result<Option<Vec<i64>>> {
        let n = self.quorum.as_ref().map_or(1, |q| q.size);
        let mut all = vec![0i64; n];
        let ok = self.on_group(|pg| pg.all_gather(&[digest], &mut all))?;
        Ok(ok.then_some(all))
    }

    /// Every member's `text` (its settings, say), by member rank: each rank
    /// of the group with the same rank of the others. `Ok(None)`: a member
    /// was lost.
    pub fn all_texts(&mut self, text: &str) -> Result<Option<Vec<String>>> {
        const MOST: i64 = 16 << 20;
        let n = self.quorum.as_ref().map_or(1, |q| q.size);
        // Four bytes to an element (the last one padded with zeros); the
        // lengths go in bytes.
        let words = |bytes: usize| bytes.div_ceil(4);
        let mine: Vec<i32> = text
            .as_bytes()
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                i32::from_le_bytes(w)
            })
            .collect();
        let mut lens = vec![0i64; n];
        let mut all: Vec<i32> = Vec::new();
        let ok = self.on_group(|pg| {
            pg.all_gather(&[text.len() as i64], &mut lens)?;
            if let Some(l) = lens.iter().find(|&&l| !(0..=MOST).contains(&l)) {
                return Err(CommError::Invalid(format!(
                    "a member's text of {l} bytes (at most {MOST})"
                )));
            }
            let counts: Vec<usize> = lens.iter().map(|&l| words(l as usize)).collect();
            all = vec![0; counts.iter().sum()];
            pg.all_gather_v(&mine, &counts, &mut all)
        })?;
        if !ok {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        for l in lens {
            let n = words(l as usize);
            let bytes: Vec<u8> = all[at..at + n]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .take(l as usize)
                .collect();
            out.push(String::from_utf8_lossy(&bytes).into_owned());
            at += n;
        }
        Ok(Some(out))
    }

    /// The caller's heal after a quorum completed: later quorums are no
    /// longer this incarnation's `first` (a heal that failed, a member
    /// lost during it, leaves the next quorum `first` still, so the group
    /// still takes the healer's state).
    pub fn mark_healed(&mut self) {
        self.healed = true;
    }

    /// Receive the healer's copy of `buf` (every member takes part; the
    /// healer's stays as it is). `Ok(false)`: a member was lost.
    pub fn heal<T: Element>(&mut self, buf: &mut [T]) -> Result<bool> {
        let root = self.quorum.as_ref().map_or(0, |q| q.healer);
        self.on_group(|pg| pg.broadcast(buf, root))
    }
}

impl Manager {
    /// Leave after an error: the members' pending and later collectives
    /// with this group fail at once (naming `reason`), instead of waiting
    /// for a goodbye after a step that will not come.
    pub fn abort(&mut self, reason: &str) {
        if let Some(pg) = self.take_pg() {
            pg.abort(&format!("replica group {} stopped: {reason}", self.id));
        }
    }

    /// Take the quorum's last collective as failed on this rank (its
    /// result unusable): drop the links and report the epoch, as a failed
    /// collective does; the caller retries with the next quorum.
    pub fn fail_epoch(&mut self) {
        self.suspect();
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // A quorum check in flight is not waited for either: it may be
        // connecting to a lighthouse that does not answer (up to the
        // quorum timeout), and holds only its own connection.
        drop(self.check.take());
        if let Some(pg) = self.take_pg() {
            pg.shutdown();
        }
        // The heartbeat thread sees the stop flag after its current beat;
        // not waited for: a beat to a lighthouse that does not answer may
        // take seconds, and holds nothing of this group's.
        if self.beat.take().is_some() {
            self.leave();
        }
    }
}

impl Manager {
    /// Tell the lighthouse that this incarnation has stopped (its run
    /// finished or failed): it drops the group at once, so the others'
    /// next quorum forms without it instead of after the heartbeat
    /// timeout. Waits at most [`LEAVE_WAIT`] for the lighthouse: on a
    /// separate connection, left behind if it does not answer.
    fn leave(&self) {
        let (addr, secret) = (self.addr.clone(), self.secret.clone());
        let (k, inc) = (key(&format!("left/{}", self.id)), self.inc.to_string());
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = std::thread::Builder::new()
            .name("phalanx-ft-leave".into())
            .spawn(move || {
                let _ = super::connect(&addr, &secret, LEAVE_WAIT)
                    .and_then(|c| c.set(&k, inc.as_bytes()));
                let _ = tx.send(());
            });
        if sent.is_ok() {
            let _ = rx.recv_timeout(LEAVE_WAIT);
        }
    }
}

/// How long a stopping group waits for the lighthouse to take its leave.
const LEAVE_WAIT: Duration = Duration::from_secs(2);
