//! A replica group's side of the lighthouse: join, heartbeat, per-step
//! quorum, the process group among a quorum's members, healing and the
//! cross-group average (see the module docs of [`super`]).

use super::{key, parse_members};
use crate::config::Config;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::store::StoreClient;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A group's fault-tolerance settings.
#[derive(Debug, Clone)]
pub struct ManagerOpts {
    /// How long a quorum may take before the group gives up.
    pub quorum_timeout: Duration,
    /// The lighthouse's heartbeat timeout (beats are sent 5 times as often).
    pub heartbeat_timeout: Duration,
    /// Settings of the process group among a quorum's members.
    pub comm: Config,
}

impl Default for ManagerOpts {
    fn default() -> Self {
        ManagerOpts {
            quorum_timeout: Duration::from_secs(60),
            heartbeat_timeout: Duration::from_secs(5),
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
}

pub struct Manager {
    store: StoreClient,
    secret: Vec<u8>,
    id: String,
    inc: u64,
    opts: ManagerOpts,
    stop: Arc<AtomicBool>,
    beat: Option<std::thread::JoinHandle<()>>,
    epoch: u64,
    pg: Option<ProcessGroup>,
    quorum: Option<Quorum>,
}

impl Manager {
    /// Join the lighthouse at `addr` as replica group `id` (a new
    /// incarnation each time) and start heartbeating.
    pub fn connect(addr: &str, secret: &[u8], id: &str, opts: ManagerOpts) -> Result<Manager> {
        if id.is_empty() || id.contains([',', '@', '/']) {
            return Err(CommError::Invalid(format!(
                "replica id {id:?}: must be non-empty, without ',', '@' or '/'"
            )));
        }
        let store = StoreClient::connect(addr, secret, opts.quorum_timeout)
            .map_err(|e| CommError::Io(format!("the lighthouse at {addr}: {e}")))?;
        let hb = StoreClient::connect(addr, secret, opts.quorum_timeout)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, hb_key, every) = (
            stop.clone(),
            key(&format!("hb/{id}")),
            opts.heartbeat_timeout / 5,
        );
        hb.add(&hb_key, 1)?;
        let beat = std::thread::Builder::new()
            .name("phalanx-ft-heartbeat".into())
            .spawn(move || {
                while !s2.load(Ordering::SeqCst) {
                    if hb.add(&hb_key, 1).is_err() {
                        return;
                    }
                    std::thread::sleep(every);
                }
            })?;
        let inc = (store.add(&key("joins"), 1)? - 1) as u64;
        store.set(&key(&format!("join/{inc}")), id.as_bytes())?;
        Ok(Manager {
            store,
            secret: secret.to_vec(),
            id: id.to_string(),
            inc,
            opts,
            stop,
            beat: Some(beat),
            epoch: 0,
            pg: None,
            quorum: None,
        })
    }

    pub fn replica_id(&self) -> &str {
        &self.id
    }

    /// The process group among the current quorum's members.
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.pg.as_ref()
    }

    fn latest_epoch(&self) -> Result<u64> {
        Ok(self
            .store
            .try_get(&key("epoch"))?
            .and_then(|v| String::from_utf8_lossy(&v).parse().ok())
            .unwrap_or(0))
    }

    fn status(&self) -> String {
        self.store
            .try_get(&key("status"))
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_else(|| "no quorum published yet".into())
    }

    /// The quorum for the step this group is at (`step`). Fast when the
    /// epoch is unchanged; otherwise waits (up to the quorum timeout) for
    /// an epoch that holds this incarnation and connects to its members.
    pub fn quorum(&mut self, step: u64) -> Result<Quorum> {
        let me = format!("{}@{}", self.id, self.inc);
        self.store
            .set(&key(&format!("step/{me}")), step.to_string().as_bytes())?;
        if let (Some(q), true) = (&self.quorum, self.pg.is_some()) {
            if self.latest_epoch()? == q.epoch {
                return Ok(Quorum {
                    changed: false,
                    ..q.clone()
                });
            }
        }
        self.pg = None;
        let deadline = Instant::now() + self.opts.quorum_timeout;
        loop {
            let e = self.latest_epoch()?;
            if e > self.epoch {
                let list = self
                    .store
                    .try_get(&key(&format!("members/{e}")))?
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
                    .unwrap_or_default();
                let members = parse_members(&list);
                self.epoch = e;
                if let Some(rank) = members
                    .iter()
                    .position(|(id, inc)| *id == self.id && *inc == self.inc)
                {
                    match self.connect_epoch(e, rank, &members) {
                        Ok(q) => return Ok(q),
                        // A member gone before the group formed: the
                        // lighthouse drops it; wait for the next epoch.
                        Err(CommError::Invalid(m)) => return Err(CommError::Invalid(m)),
                        Err(_) => self.suspect(),
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout(format!(
                    "replica group {}: no quorum within {:?}: {}",
                    self.id,
                    self.opts.quorum_timeout,
                    self.status()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn connect_epoch(&mut self, e: u64, rank: usize, members: &[(String, u64)]) -> Result<Quorum> {
        // A member that died before connecting is found by the lighthouse
        // within its heartbeat timeout: wait no longer than twice that.
        let cfg = Config {
            timeout: self.opts.heartbeat_timeout * 2 + Duration::from_secs(1),
            ..self.opts.comm.clone()
        };
        let pg = crate::init::from_store(
            &self.store,
            &key(&format!("pg/{e}")),
            rank,
            members.len(),
            &self.secret,
            cfg,
            None,
        )?;
        let mut steps = Vec::with_capacity(members.len());
        for (id, inc) in members {
            let v = self
                .store
                .try_get(&key(&format!("step/{id}@{inc}")))?
                .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok())
                .unwrap_or(0);
            steps.push(v);
        }
        let max_step = steps.iter().copied().max().unwrap_or(0);
        let healer = steps.iter().position(|&s| s == max_step).unwrap_or(0);
        let q = Quorum {
            epoch: e,
            rank,
            size: members.len(),
            members: members.iter().map(|(id, _)| id.clone()).collect(),
            changed: true,
            max_step,
            healer,
            behind: steps[rank] < max_step,
        };
        self.pg = Some(pg);
        self.quorum = Some(q.clone());
        Ok(q)
    }

    /// Tell the lighthouse this epoch's links failed, and drop them.
    fn suspect(&mut self) {
        let _ = self
            .store
            .set(&key(&format!("suspect/{}", self.epoch)), self.id.as_bytes());
        if let Some(pg) = self.pg.take() {
            pg.abort("a member of the quorum was lost");
        }
    }

    /// Wait until the lighthouse publishes a new epoch (a group joined or
    /// was lost); the next `quorum` connects to it.
    pub fn wait_change(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.opts.quorum_timeout;
        while self.latest_epoch()? <= self.epoch {
            if Instant::now() >= deadline {
                return Err(CommError::Timeout(format!(
                    "replica group {}: no new quorum within {:?}: {}",
                    self.id,
                    self.opts.quorum_timeout,
                    self.status()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Run `f` on the quorum's group; a failure (a member lost) marks the
    /// epoch suspect and returns `Ok(false)`: retry after the next `quorum`.
    fn on_group(&mut self, f: impl FnOnce(&ProcessGroup) -> Result<()>) -> Result<bool> {
        let pg = self.pg.as_ref().ok_or_else(|| {
            CommError::Invalid("Manager: call quorum() before a collective".into())
        })?;
        match f(pg) {
            Ok(()) => Ok(true),
            Err(e @ CommError::Invalid(_)) => Err(e),
            Err(e) => {
                eprintln!(
                    "replica group {}: the step's reduction failed ({e}); retrying with the next quorum",
                    self.id
                );
                self.suspect();
                Ok(false)
            }
        }
    }

    /// The cross-group average of `buf` over this step's quorum. `Ok(false)`:
    /// a member was lost, the step does not commit.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T]) -> Result<bool> {
        self.on_group(|pg| pg.all_reduce(buf, ReduceOp::Avg))
    }

    /// Receive the healer's copy of `buf` (every member takes part; the
    /// healer's stays as it is). `Ok(false)`: a member was lost.
    pub fn heal<T: Element>(&mut self, buf: &mut [T]) -> Result<bool> {
        let root = self.quorum.as_ref().map_or(0, |q| q.healer);
        self.on_group(|pg| pg.broadcast(buf, root))
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(pg) = self.pg.take() {
            pg.shutdown();
        }
        if let Some(t) = self.beat.take() {
            let _ = t.join();
        }
    }
}
