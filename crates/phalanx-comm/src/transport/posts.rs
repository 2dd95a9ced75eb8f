//! Receives posted ahead of their frames: the reader thread places a frame
//! straight into the caller's buffer instead of a pooled one (one copy
//! less), and the caller waits for each in order.

use super::{Inbox, Key, Msg, Posted, Slot, Transport};
use crate::error::{CommError, Result};
use std::time::{Duration, Instant};

/// Receives posted ahead of their frames (see `Transport::posts`); dropping
/// it withdraws the ones not yet received (waiting for any being written).
pub(crate) struct Posts<'a> {
    t: &'a Transport,
    key: Key,
    ids: Vec<u64>,
    next: usize,
}

impl<'a> Posts<'a> {
    pub(crate) fn new(t: &'a Transport, key: Key) -> Posts<'a> {
        Posts {
            t,
            key,
            ids: Vec::new(),
            next: 0,
        }
    }

    /// Post the next receive: its frame will be read from the socket
    /// straight into `ptr..ptr+len`.
    ///
    /// # Safety
    /// The region must stay valid, and must be neither read nor written by
    /// anyone else, until `wait` has returned for it or `self` is dropped
    /// (dropping waits for a reader thread that is still writing into it).
    pub unsafe fn post(&mut self, ptr: *mut u8, len: usize) {
        let mut ib = self.t.inbox.lock().unwrap();
        let id = ib.next_slot;
        ib.next_slot += 1;
        ib.slots.insert(id, Slot::Posted);
        ib.posted.entry(self.key).or_default().push_back(Posted {
            id,
            ptr: ptr as usize,
            len,
        });
        self.ids.push(id);
    }

    /// Wait for the next posted receive, in the order they were posted.
    /// `Ok(None)`: its region holds the frame. `Ok(Some(m))`: the frame came
    /// before the receive was posted, or with another length; the caller
    /// checks and copies `m` itself.
    pub fn wait(&mut self, deadline: Instant, what: &dyn Fn() -> String) -> Result<Option<Msg>> {
        let t = self.t;
        let id = *self
            .ids
            .get(self.next)
            .ok_or_else(|| CommError::Invalid("no posted receive left to wait for".into()))?;
        self.next += 1;
        let from = self.key.0;
        let mut grace = None;
        let mut ib = t.inbox.lock().unwrap();
        loop {
            match ib.slots.get(&id).copied() {
                Some(Slot::Done) => {
                    ib.slots.remove(&id);
                    return Ok(None);
                }
                Some(Slot::Failed) => {
                    ib.slots.remove(&id);
                    return Err(ib.failed.clone().unwrap_or_else(|| CommError::PeerDead {
                        rank: from,
                        host: t.host_of(from),
                        reason: format!("connection closed during {}", what()),
                    }));
                }
                Some(Slot::Filling) => {}
                Some(Slot::Posted) | None => {
                    // Frames queued for this key precede every posted one,
                    // and this is the oldest posted receive still waiting:
                    // the first queued frame is its frame.
                    if let Some(q) = ib.queues.get_mut(&self.key) {
                        if let Some(m) = q.pop_front() {
                            if q.is_empty() {
                                ib.queues.remove(&self.key);
                            }
                            withdraw(&mut ib, self.key, id);
                            return Ok(Some(m));
                        }
                    }
                    if let Some(e) = t.gone(&ib, from, what) {
                        if !t.in_flight(from, &mut grace) {
                            return Err(e);
                        }
                    }
                }
            }
            let mut slice = t.wait_slice(from, deadline, what)?;
            if grace.is_some() {
                slice = slice.min(Duration::from_millis(5));
            }
            ib = t.arrived.wait_timeout(ib, slice).unwrap().0;
        }
    }
}

fn withdraw(ib: &mut Inbox, key: Key, id: u64) {
    if let Some(q) = ib.posted.get_mut(&key) {
        q.retain(|p| p.id != id);
        if q.is_empty() {
            ib.posted.remove(&key);
        }
    }
    ib.slots.remove(&id);
}

impl Drop for Posts<'_> {
    fn drop(&mut self) {
        let mut ib = self.t.inbox.lock().unwrap();
        loop {
            let mut filling = false;
            for &id in &self.ids {
                match ib.slots.get(&id) {
                    // The reader thread is writing into the region: it must
                    // finish (or fail: reads time out) before the region is
                    // given back.
                    Some(Slot::Filling) => filling = true,
                    Some(_) => withdraw(&mut ib, self.key, id),
                    None => {}
                }
            }
            if !filling {
                return;
            }
            ib = self
                .t
                .arrived
                .wait_timeout(ib, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }
}
