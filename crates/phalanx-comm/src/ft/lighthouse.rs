//! The lighthouse: decides, from the replica groups' joins and heartbeats,
//! which groups take part in each quorum (an *epoch*), and publishes it in
//! its store.
//!
//! It serves a Phalanx store (authenticated with the job secret) and runs
//! one thread that every 20 ms:
//! - reads new joins (`ft/joins`, `ft/join/{j}` = replica id): join j is
//!   that replica's incarnation j (a restarted group joins again);
//! - reads every candidate's heartbeat counter (`ft/hb/{id}`): one that did
//!   not move for `heartbeat_timeout` is dead and dropped (it must join
//!   again);
//! - publishes a new epoch (`ft/members/{e}` = `id@inc,...` sorted by id,
//!   then `ft/epoch` = e) when the live set differs from the last epoch's:
//!   at once when groups were lost or re-joined, `join_timeout` after the
//!   first joiner of a change (to gather the ones arriving together), and
//!   only with at least `min_replicas` live groups (below that,
//!   `ft/status` says why and the groups wait);
//! - republishes the same live set as a new epoch when a member reported
//!   its collective failed (`ft/suspect/{e}`) and no one was found dead
//!   within `heartbeat_timeout`, so the groups rebuild their links;
//! - drops a member that others report absent from a quorum
//!   (`ft/absent/{e}/{reporter}` = `id@inc,...`: it heartbeats, but never
//!   came to connect) in two epochs running, its progress
//!   (`ft/progress/{id}`, which its heartbeat publishes) not moving
//!   between them: a hung group would otherwise have the others reconnect
//!   to it forever, and a busy one (DiLoCo's inner steps) comes later;
//! - skips a join slot counted but still unwritten after
//!   `heartbeat_timeout` (its group died between the two writes), so that
//!   it does not block every later join.
//!
//! Its heartbeat timeout is published (`ft/heartbeat_timeout_ms`): groups
//! beat five times within the shorter of theirs and this one; so is its
//! join timeout (`ft/join_timeout_ms`), and an id of this start
//! (`ft/lighthouse`): a lighthouse restarted at the same address holds no
//! joins, and the groups, seeing another id, join it again.

use super::{key, parse_members};
use crate::error::Result;
use crate::store::{StoreClient, StoreServer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `phalanx lighthouse` settings.
#[derive(Debug, Clone)]
pub struct LighthouseOpts {
    /// Fewest live replica groups a quorum may have.
    pub min_replicas: usize,
    /// How long a change with new groups waits for more to arrive.
    pub join_timeout: Duration,
    /// Silence after which a group is dead.
    pub heartbeat_timeout: Duration,
}

impl Default for LighthouseOpts {
    fn default() -> Self {
        LighthouseOpts {
            min_replicas: 1,
            join_timeout: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(5),
        }
    }
}

/// A running lighthouse; dropping it stops it.
pub struct Lighthouse {
    server: StoreServer,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One candidate group, as the lighthouse tracks it.
struct Candidate {
    inc: u64,
    beats: i64,
    moved: Instant,
}

impl Lighthouse {
    /// Serve at `bind` (`HOST:PORT`, port 0 for any) with the job secret.
    pub fn start(bind: &str, secret: Vec<u8>, opts: LighthouseOpts) -> Result<Lighthouse> {
        let server = StoreServer::bind(bind, secret.clone())?;
        let addr = server.addr().to_string();
        let store = super::connect(&addr, &secret, Duration::from_secs(10))?;
        store.set(
            &key("heartbeat_timeout_ms"),
            opts.heartbeat_timeout.as_millis().to_string().as_bytes(),
        )?;
        store.set(
            &key("join_timeout_ms"),
            opts.join_timeout.as_millis().to_string().as_bytes(),
        )?;
        // Last: a group that reads this id reads the timeouts too.
        store.set(
            &key("lighthouse"),
            &crate::wire::new_secret_hex().as_bytes()[..16],
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("phalanx-lighthouse".into())
            .spawn(move || {
                let mut q = Quorums::new(opts);
                while !s2.load(Ordering::SeqCst) {
                    if let Err(e) = q.tick(&store) {
                        eprintln!("phalanx lighthouse: {e}");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })?;
        Ok(Lighthouse {
            server,
            stop,
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.addr()
    }
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The quorum logic, one `tick` at a time.
struct Quorums {
    opts: LighthouseOpts,
    joins_seen: u64,
    candidates: BTreeMap<String, Candidate>,
    epoch: u64,
    members: Vec<(String, u64)>,
    /// When a change that adds groups was first seen.
    change_since: Option<Instant>,
    /// When the current epoch's suspect report was first seen.
    suspect_since: Option<Instant>,
    /// When the next join slot was first found counted but unwritten.
    slot_since: Option<Instant>,
    /// Slots skipped so: read again every tick, in case the write was
    /// only late.
    skipped: std::collections::BTreeSet<u64>,
    /// When the last tick ran.
    last_tick: Option<Instant>,
    /// Members reported absent (`id@inc`), with the last epoch they were
    /// and their progress then (`ft/progress/{id}`).
    absent: BTreeMap<String, (u64, Option<Vec<u8>>)>,
    status: String,
}

impl Quorums {
    fn new(opts: LighthouseOpts) -> Quorums {
        Quorums {
            opts,
            joins_seen: 0,
            candidates: BTreeMap::new(),
            epoch: 0,
            members: Vec::new(),
            change_since: None,
            suspect_since: None,
            slot_since: None,
            skipped: Default::default(),
            absent: BTreeMap::new(),
            last_tick: None,
            status: String::new(),
        }
    }

    fn tick(&mut self, store: &StoreClient) -> Result<()> {
        let now = Instant::now();
        // Ticks come every 20 ms: a gap of half the heartbeat timeout means
        // the lighthouse itself was stopped (SIGSTOP, a debugger, a host
        // that froze), not the groups; their silence is counted from now.
        if let Some(last) = self.last_tick.replace(now) {
            if now - last > self.opts.heartbeat_timeout / 2 {
                eprintln!(
                    "phalanx lighthouse: {:.1?} since the last look (was it stopped?): the \
                     groups' heartbeats are judged from now",
                    now - last
                );
                self.candidates.values_mut().for_each(|c| c.moved = now);
            }
        }
        let joins = store.add(&key("joins"), 0)? as u64;
        while self.joins_seen < joins {
            let j = self.joins_seen;
            let Some(id) = store.try_get(&key(&format!("join/{j}")))? else {
                // Counted, not yet written: next tick, unless it stays so.
                let since = *self.slot_since.get_or_insert(now);
                if now - since > self.opts.heartbeat_timeout {
                    eprintln!(
                        "phalanx lighthouse: join {j} was counted but not written within the \
                         heartbeat timeout (its group stopped while joining?); skipped"
                    );
                    self.skipped.insert(j);
                    self.joins_seen += 1;
                    self.slot_since = None;
                    continue;
                }
                break;
            };
            self.slot_since = None;
            let id = String::from_utf8_lossy(&id).into_owned();
            self.admit(store, id, j, now)?;
            self.joins_seen += 1;
        }
        // A skipped slot written late: its group joins after all (unless
        // its id joined again since, as a later incarnation).
        for j in self.skipped.clone() {
            if let Some(id) = store.try_get(&key(&format!("join/{j}")))? {
                self.skipped.remove(&j);
                let id = String::from_utf8_lossy(&id).into_owned();
                if self.candidates.get(&id).is_none_or(|c| c.inc < j) {
                    self.admit(store, id, j, now)?;
                }
            }
        }
        let mut dead = Vec::new();
        for (id, c) in self.candidates.iter_mut() {
            // A group that stopped said so (`left/{id}` = its incarnation):
            // dropped now, not after its heartbeat timeout.
            let left = store.try_get(&key(&format!("left/{id}")))?;
            if left.is_some_and(|v| v == c.inc.to_string().as_bytes()) {
                dead.push(id.clone());
                continue;
            }
            let beats = store.add(&key(&format!("hb/{id}")), 0)?;
            if beats != c.beats {
                c.beats = beats;
                c.moved = now;
            } else if now - c.moved > self.opts.heartbeat_timeout {
                dead.push(id.clone());
            }
        }
        for id in dead {
            self.candidates.remove(&id);
        }
        let suspect = self.epoch > 0
            && store
                .try_get(&key(&format!("suspect/{}", self.epoch)))?
                .is_some();
        if suspect {
            self.drop_absent(store)?;
        }
        let live: Vec<(String, u64)> = self
            .candidates
            .iter()
            .map(|(id, c)| (id.clone(), c.inc))
            .collect();
        if live == self.members {
            self.change_since = None;
            // Everyone alive, yet a member's collective failed: rebuild.
            if suspect {
                let since = *self.suspect_since.get_or_insert(now);
                if now - since > self.opts.heartbeat_timeout && live.len() >= self.opts.min_replicas
                {
                    self.publish(store, live)?;
                }
            }
            return Ok(());
        }
        if live.len() < self.opts.min_replicas {
            let status = format!(
                "{} replica group(s) alive ({}), fewer than --min-replicas {}",
                live.len(),
                live.iter()
                    .map(|(id, _)| id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                self.opts.min_replicas
            );
            if status != self.status {
                store.set(&key("status"), status.as_bytes())?;
                self.status = status;
            }
            return Ok(());
        }
        // Only losses (or re-joins of members): at once. New groups: after
        // the join timeout, to take the ones arriving together in one change.
        let adds = live
            .iter()
            .any(|(id, _)| !self.members.iter().any(|(m, _)| m == id));
        if adds {
            let since = *self.change_since.get_or_insert(now);
            if now - since < self.opts.join_timeout {
                return Ok(());
            }
        }
        self.publish(store, live)
    }

    /// Take join `j` of replica `id` as a candidate (its incarnation `j`).
    fn admit(&mut self, store: &StoreClient, id: String, j: u64, now: Instant) -> Result<()> {
        let beats = store.add(&key(&format!("hb/{id}")), 0)?;
        self.candidates.insert(
            id,
            Candidate {
                inc: j,
                beats,
                moved: now,
            },
        );
        Ok(())
    }

    /// Drop the members reported absent in this epoch and the one before.
    fn drop_absent(&mut self, store: &StoreClient) -> Result<()> {
        let e = self.epoch;
        let mut reported = Vec::new();
        for (reporter, _) in &self.members {
            if let Some(v) = store.try_get(&key(&format!("absent/{e}/{reporter}")))? {
                reported.extend(parse_members(&String::from_utf8_lossy(&v)));
            }
        }
        for (id, inc) in reported {
            let name = format!("{id}@{inc}");
            // Reported again within this epoch (every tick while it is
            // suspect): the progress stays the one first seen in it, so
            // that a step as long as the epochs between is kept.
            if self.absent.get(&name).is_some_and(|(at, _)| *at == e) {
                continue;
            }
            let progress = store.try_get(&key(&format!("progress/{id}")))?;
            let before = self.absent.insert(name.clone(), (e, progress.clone()));
            let current = self.candidates.get(&id).is_some_and(|c| c.inc == inc);
            if let (Some((p, was)), true) = (before, current) {
                if p + 1 != e {
                    continue;
                }
                if progress.is_some() && progress != was {
                    // Busy, not hung: its steps go on (DiLoCo's inner
                    // steps, a long step); it comes at its next quorum.
                    eprintln!(
                        "phalanx lighthouse: replica group {name} was absent from the quorums of \
                         epochs {p} and {e} but its steps go on (at {}): kept",
                        String::from_utf8_lossy(progress.as_deref().unwrap_or_default())
                    );
                    continue;
                }
                eprintln!(
                    "phalanx lighthouse: dropping replica group {name}: absent from the \
                     quorums of epochs {p} and {e} while it heartbeats, its steps not moving \
                     (hung?)"
                );
                self.candidates.remove(&id);
            }
        }
        Ok(())
    }

    fn publish(&mut self, store: &StoreClient, live: Vec<(String, u64)>) -> Result<()> {
        let e = self.epoch + 1;
        let list = live
            .iter()
            .map(|(id, inc)| format!("{id}@{inc}"))
            .collect::<Vec<_>>()
            .join(",");
        debug_assert_eq!(parse_members(&list).len(), live.len());
        store.set(&key(&format!("members/{e}")), list.as_bytes())?;
        store.set(&key("epoch"), e.to_string().as_bytes())?;
        self.status = format!("epoch {e}: {list}");
        store.set(&key("status"), self.status.as_bytes())?;
        self.epoch = e;
        self.members = live;
        self.change_since = None;
        self.suspect_since = None;
        Ok(())
    }
}
