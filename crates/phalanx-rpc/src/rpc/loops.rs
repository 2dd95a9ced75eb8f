//! The agent's threads: one reader per peer (frames in, work out), the
//! pool that runs calls, and the timer that fails calls past their timeout.

use super::agent::{Agent, Job, POLL, TAG};
use super::codec::{self, Head, Words};
use super::error::RpcError;
use super::registry::Payload;
use phalanx_comm::{CommError, ProcessGroup};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

thread_local! {
    /// Set on the pool's threads: a call they make to their own worker
    /// runs where they are (see `Agent::dispatch`).
    pub(crate) static ON_POOL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) fn run_jobs(rx: Arc<Mutex<Receiver<Job>>>) {
    ON_POOL.with(|p| p.set(true));
    loop {
        let job = rx.lock().unwrap().recv();
        match job {
            Ok(j) => j(),
            Err(_) => return,
        }
    }
}

/// One peer's reader: frames in, work out. Holds the agent only while
/// handling a message, so that dropping the last `Rpc` ends it.
///
/// A call goes to the pool's queue; when that is full it waits, in order,
/// in `backlog`, and the reader goes on reading: a reply from this peer
/// (to a call a pool thread made to it, maybe from inside one of its
/// calls) must not wait behind calls that wait for that very thread.
pub(crate) fn read_loop(w: Weak<Agent>, pg: ProcessGroup, peer: usize) {
    let mut backlog: VecDeque<Job> = VecDeque::new();
    loop {
        match w.upgrade() {
            Some(a) if !a.stopping.load(Ordering::SeqCst) => {
                while let Some(job) = backlog.pop_front() {
                    if let Err(job) = a.queue_job(job) {
                        backlog.push_front(job);
                        break;
                    }
                }
            }
            _ => return,
        }
        // With calls waiting, look again soon for room in the queue.
        let wait = if backlog.is_empty() {
            POLL
        } else {
            Duration::from_millis(1)
        };
        let m = match pg.recv_bytes(peer, TAG, Instant::now() + wait) {
            Ok(m) => m,
            Err(CommError::Timeout(_)) => continue,
            Err(e) => {
                if let Some(a) = w.upgrade() {
                    a.peer_gone(peer, e);
                    backlog.drain(..).for_each(|job| a.queue_job_waiting(job));
                }
                return;
            }
        };
        let Some(a) = w.upgrade() else { return };
        let (frame, len) = m.into_words();
        let bytes = &bytemuck::cast_slice::<u64, u8>(&frame)[..len];
        let (body_len, head) = match codec::open(bytes) {
            Ok((body, head)) => (body.len(), head),
            Err(e) => {
                // Frames come from authenticated peers; a bad one is a bug
                // or a version mismatch, reported, never a crash.
                eprintln!("rpc: dropping a message from {}: {e}", a.name_of(peer));
                continue;
            }
        };
        let nb = match &head {
            Head::Call { blobs, .. } | Head::Reply { blobs, .. } => *blobs as usize,
            Head::Decref(_) => 0,
        };
        let deadline = Instant::now() + a.opts.timeout;
        // `nb` comes from the wire: reserve little, grow as frames arrive.
        let mut blobs: Vec<Words> = Vec::with_capacity(nb.min(64));
        for _ in 0..nb {
            match pg.recv_bytes(peer, TAG, deadline) {
                Ok(b) => blobs.push(b.into_words()),
                Err(e) => {
                    a.peer_gone(peer, e);
                    // The calls received before still run.
                    backlog.drain(..).for_each(|job| a.queue_job_waiting(job));
                    return;
                }
            }
        }
        let p = Payload {
            frame,
            body_len,
            blobs,
            held: Vec::new(),
        };
        if let Some(job) = a.dispatch(peer, head, p) {
            if !backlog.is_empty() {
                backlog.push_back(job);
            } else if let Err(job) = a.queue_job(job) {
                backlog.push_back(job);
            }
        }
    }
}

/// Fails calls that ran past their timeout (futures polled without
/// `wait` rely on it).
pub(crate) fn timer_loop(w: Weak<Agent>) {
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let Some(a) = w.upgrade() else { return };
        if a.stopping.load(Ordering::SeqCst) && a.pending.lock().unwrap().is_empty() {
            return;
        }
        let now = Instant::now();
        let mut pend = a.pending.lock().unwrap();
        let late: Vec<u64> = pend
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(p) = pend.remove(&id) {
                p.slot.fill(Err(RpcError::Timeout {
                    worker: a.name_of(p.to).to_string(),
                    func: p.func.clone(),
                    after: p.timeout,
                }));
            }
        }
    }
}
