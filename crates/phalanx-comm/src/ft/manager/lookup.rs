//! The group's first rank and the lighthouse: which quorum the group is
//! in (deciding each step, retrying a lighthouse that does not answer,
//! joining a restarted one again), whether it was replaced or dropped, and
//! which members never came to a quorum.

use super::super::{key, parse_members};
use super::Manager;
use crate::error::{CommError, Result};
use crate::store::StoreClient;
use std::time::{Duration, Instant};

/// What one look at the lighthouse found (see `Manager::decide`).
pub(super) enum Look {
    /// The quorum this group is connected to.
    Unchanged,
    /// A new epoch that holds this incarnation.
    Epoch(u64),
    /// Neither yet.
    Wait,
}

impl Manager {
    pub(super) fn latest_epoch(store: &StoreClient) -> Result<u64> {
        Ok(store
            .try_get(&key("epoch"))?
            .and_then(|v| String::from_utf8_lossy(&v).parse().ok())
            .unwrap_or(0))
    }

    pub(super) fn status(&self) -> String {
        self.store
            .try_get(&key("status"))
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_else(|| "no quorum published yet".into())
    }

    /// The group's first rank: `None` if the quorum is unchanged, else the
    /// epoch to connect (waiting up to the quorum timeout for one that
    /// holds this incarnation). Requests to the lighthouse that fail are
    /// tried again until then (the client reconnects): a lighthouse
    /// restarted meanwhile is joined again. A group connected to a quorum
    /// goes on with it while the lighthouse does not answer, for up to the
    /// quorum timeout from the first failed request.
    pub(super) fn decide(&mut self, step: u64) -> Result<Option<u64>> {
        let mut step_set = false;
        if let Some(h) = self.check.take() {
            let checked = h
                .join()
                .map_err(|_| CommError::Io("the quorum check panicked".into()))?;
            match checked {
                Ok((client, e, gen)) => {
                    self.poll = Some(client);
                    self.lost_since = None;
                    step_set = true;
                    if self.unchanged(e, &gen) {
                        return Ok(None);
                    }
                }
                Err(e) if self.connected() => return self.carry_on(e),
                // Looked at again below.
                Err(_) => {}
            }
        }
        let deadline = Instant::now() + self.opts.quorum_timeout;
        let mut first = true;
        loop {
            let lost = match self.look(step, &mut step_set, first)? {
                Ok(Look::Unchanged) => return Ok(None),
                Ok(Look::Epoch(e)) => return Ok(Some(e)),
                Ok(Look::Wait) => None,
                Err(e) if first && self.connected() => return self.carry_on(e),
                Err(e) => Some(e),
            };
            if lost.is_none() {
                self.lost_since = None;
            }
            first = false;
            if Instant::now() >= deadline {
                return Err(self.gave_up("no quorum", lost));
            }
            let pause = if lost.is_some() { 100 } else { 10 };
            std::thread::sleep(Duration::from_millis(pause));
        }
    }

    /// Whether this group holds a quorum and its links.
    fn connected(&self) -> bool {
        self.pg.is_some() && self.quorum.is_some()
    }

    /// The lighthouse did not answer (`e`) while this group holds a quorum:
    /// go on with it (the quorum unchanged) for up to the quorum timeout
    /// from the first such failure, saying so once; then fail.
    fn carry_on(&mut self, e: CommError) -> Result<Option<u64>> {
        let now = Instant::now();
        let since = match self.lost_since {
            Some(t) => t,
            None => {
                eprintln!(
                    "replica group {}: the lighthouse at {} does not answer ({e}); going on with \
                     the current quorum for up to {:?} (fault_tolerance.quorum_timeout)",
                    self.id, self.addr, self.opts.quorum_timeout
                );
                *self.lost_since.insert(now)
            }
        };
        if now - since < self.opts.quorum_timeout {
            return Ok(None);
        }
        Err(self.lighthouse_lost(e))
    }

    /// Whether epoch `e` of the lighthouse `gen` is the quorum this group
    /// is connected to.
    fn unchanged(&self, e: u64, gen: &[u8]) -> bool {
        self.pg.is_some()
            && self.quorum.as_ref().is_some_and(|q| q.epoch == e)
            && gen == self.generation
    }

    /// One look at the lighthouse (see [`Manager::decide`]); `first`: the
    /// unchanged quorum may be taken. The outer error is final (this
    /// incarnation was replaced or dropped), the inner one a failed request
    /// to the lighthouse.
    fn look(&mut self, step: u64, step_set: &mut bool, first: bool) -> Result<Result<Look>> {
        macro_rules! req {
            ($e:expr) => {
                match $e {
                    Ok(v) => v,
                    Err(err) => return Ok(Err(err)),
                }
            };
        }
        let gen = req!(self.store.try_get(&key("lighthouse"))).unwrap_or_default();
        if self.restarted(&gen) {
            req!(self.rejoin(gen));
            *step_set = false;
        } else if self.generation.is_empty() {
            // Joined before the lighthouse published its id.
            self.generation = gen;
        }
        if !*step_set {
            req!(self.store.set(
                &key(&format!("step/{}", self.me())),
                step.to_string().as_bytes(),
            ));
            *step_set = true;
        }
        let e = req!(Manager::latest_epoch(&self.store));
        if first && self.unchanged(e, &self.generation) {
            return Ok(Ok(Look::Unchanged));
        }
        if e > self.epoch {
            let members = req!(self.members(e));
            self.epoch = e;
            if members
                .iter()
                .any(|(id, inc)| *id == self.id && *inc == self.inc)
            {
                return Ok(Ok(Look::Epoch(e)));
            }
            self.check_not_replaced(e, &members)?;
        }
        Ok(Ok(Look::Wait))
    }

    /// Whether the lighthouse's id `gen` (as read now) is another start's
    /// than the one this group joined (neither unknown: a lighthouse
    /// publishes its id just after it starts serving).
    fn restarted(&self, gen: &[u8]) -> bool {
        !gen.is_empty() && !self.generation.is_empty() && gen != self.generation
    }

    /// Join a restarted lighthouse (id `gen`), which knows no groups, as a
    /// new incarnation; its epochs count from 0 again.
    fn rejoin(&mut self, gen: Vec<u8>) -> Result<()> {
        let inc = self.store.add(&key("joins"), 1)? - 1;
        self.store
            .set(&key(&format!("join/{inc}")), self.id.as_bytes())?;
        eprintln!(
            "replica group {}: the lighthouse at {} restarted (it knows no groups): joined it \
             again as incarnation {inc}",
            self.id, self.addr
        );
        self.inc = inc as u64;
        self.generation = gen;
        self.epoch = 0;
        // The quorum of the old lighthouse is no quorum of this one (whose
        // epochs count from 0 again: its epoch 1 is another).
        self.quorum = None;
        // Epochs of the new lighthouse without this group are no drop.
        self.formed = 0;
        Ok(())
    }

    /// The error of a wait for `what` that ran out its quorum timeout: the
    /// lighthouse unreachable (`lost`, its last failure), or no quorum.
    fn gave_up(&self, what: &str, lost: Option<CommError>) -> CommError {
        match lost {
            Some(e) => self.lighthouse_lost(e),
            None => CommError::Timeout(format!(
                "replica group {}: {what} within {:?}: {}",
                self.id,
                self.opts.quorum_timeout,
                self.status()
            )),
        }
    }

    /// The error of a lighthouse unreachable for the whole quorum timeout.
    fn lighthouse_lost(&self, e: CommError) -> CommError {
        CommError::Io(format!(
            "replica group {}: lost the lighthouse at {} for {:?} (fault_tolerance.quorum_timeout): \
             {e}; a lighthouse restarted at that address within the timeout is joined again",
            self.id, self.addr, self.opts.quorum_timeout
        ))
    }

    /// An epoch without this incarnation fails at once where waiting
    /// could not help: another incarnation holds this replica id (a second
    /// group started with the same id, or this one's restart), or this
    /// incarnation was a member and has been dropped (its heartbeats
    /// stopped, or the others found it absent from a quorum; it must
    /// restart to rejoin and heal).
    fn check_not_replaced(&self, e: u64, members: &[(String, u64)]) -> Result<()> {
        if let Some((_, inc)) = members
            .iter()
            .find(|(id, inc)| *id == self.id && *inc > self.inc)
        {
            return Err(CommError::Invalid(format!(
                "replica group {}: the replica id joined again as incarnation {inc} (this one is \
                 {}): two groups started with the same fault_tolerance.replica_id?",
                self.id, self.inc
            )));
        }
        if self.formed > 0 {
            return Err(CommError::Io(format!(
                "replica group {}: dropped from the quorum (epoch {e}: {}): the lighthouse saw its \
                 heartbeats stop, or the other groups found it absent from a quorum; restart it to \
                 rejoin and heal from them",
                self.id,
                self.status()
            )));
        }
        Ok(())
    }

    /// After a failed connection to epoch `e`'s members (the group's first
    /// rank): tell the lighthouse which members never published an address
    /// on any of the group's layers. Such a member heartbeats (else the
    /// lighthouse would have dropped it) but does not come to the quorum (a
    /// hung step, a stuck write); the lighthouse drops it when it is found
    /// absent twice running, instead of the others reconnecting to it
    /// forever.
    pub(super) fn report_absent(&self, e: u64, me: Option<usize>, members: &[(String, u64)]) {
        let layers = self.local.as_ref().map_or(1, |l| l.size());
        let absent: Vec<String> = members
            .iter()
            .enumerate()
            .filter(|(j, _)| Some(*j) != me)
            .filter(|(j, _)| {
                (0..layers).any(|r| {
                    matches!(
                        self.store.try_get(&key(&format!("pg/{e}/{r}/addr/{j}"))),
                        Ok(None)
                    )
                })
            })
            .map(|(_, (id, inc))| format!("{id}@{inc}"))
            .collect();
        if absent.is_empty() {
            return;
        }
        eprintln!(
            "replica group {}: epoch {e}: {} never came to the quorum (the lighthouse counted \
             them when it formed it: stopped since, or too slow for \
             fault_tolerance.quorum_timeout); reported to the lighthouse",
            self.id,
            absent.join(", ")
        );
        let _ = self.store.set(
            &key(&format!("absent/{e}/{}", self.id)),
            absent.join(",").as_bytes(),
        );
    }

    pub(super) fn members(&self, e: u64) -> Result<Vec<(String, u64)>> {
        let list = self
            .store
            .try_get(&key(&format!("members/{e}")))?
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default();
        Ok(parse_members(&list))
    }

    /// Wait until the lighthouse publishes a new epoch (a group joined or
    /// was lost); the next `quorum` connects to it. One rank's call.
    pub fn wait_change(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.opts.quorum_timeout;
        loop {
            let looked = Manager::latest_epoch(&self.store).and_then(|e| {
                let gen = self.store.try_get(&key("lighthouse"))?.unwrap_or_default();
                // A restarted lighthouse: the next quorum joins it.
                Ok(e > self.epoch || self.restarted(&gen))
            });
            let lost = match looked {
                Ok(true) => return Ok(()),
                Ok(false) => None,
                Err(e) => Some(e),
            };
            if Instant::now() >= deadline {
                return Err(self.gave_up("no new quorum", lost));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
