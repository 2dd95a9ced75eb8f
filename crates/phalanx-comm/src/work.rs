//! `Work`: the handle of an asynchronous collective, and the per-group
//! communication thread that runs them in issue order (like an NCCL stream).

use crate::error::{CommError, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

thread_local! {
    /// Nanoseconds this thread spent blocked in communication, and how
    /// deep in nested timers it is (only the outermost one counts).
    static BLOCKED: std::cell::Cell<(u64, u32)> = const { std::cell::Cell::new((0, 0)) };
}

/// Seconds the calling thread has spent blocked in communication so far:
/// waiting for asynchronous work, draining its group's queue, or running a
/// blocking collective (including the wait for its peers). A training step
/// minus the change in this is the step's compute time, which is what
/// straggler detection compares between ranks (a slow rank waits little;
/// the others wait for it).
pub fn blocked_seconds() -> f64 {
    BLOCKED.with(|c| c.get().0) as f64 * 1e-9
}

thread_local! {
    /// True on a group's communication threads (set when they start).
    static COMM_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a communication thread running queued
/// asynchronous work (which overlaps computation on other threads).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn on_comm_thread() -> bool {
    COMM_THREAD.with(|c| c.get())
}

/// Threads of this process blocked in communication right now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Whether some thread of this process is blocked waiting on communication
/// (so a backend that must poll for progress should poll eagerly).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn anyone_waiting() -> bool {
    WAITING.load(Ordering::Relaxed) > 0
}

/// Counts the time until it is dropped into [`blocked_seconds`].
pub(crate) struct BlockedTimer(Instant);

impl BlockedTimer {
    pub(crate) fn start() -> BlockedTimer {
        BLOCKED.with(|c| {
            let (ns, depth) = c.get();
            if depth == 0 {
                WAITING.fetch_add(1, Ordering::Relaxed);
            }
            c.set((ns, depth + 1));
        });
        BlockedTimer(Instant::now())
    }
}

impl Drop for BlockedTimer {
    fn drop(&mut self) {
        let dt = self.0.elapsed().as_nanos() as u64;
        BLOCKED.with(|c| {
            let (ns, depth) = c.get();
            if depth == 1 {
                WAITING.fetch_sub(1, Ordering::Relaxed);
            }
            c.set(if depth == 1 {
                (ns + dt, 0)
            } else {
                (ns, depth - 1)
            });
        });
    }
}

struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    done: Condvar,
}

/// The result of an asynchronous operation, available once it completes.
///
/// ```
/// use phalanx_comm::{threads, ReduceOp};
/// let out = threads::run(2, |pg| {
///     let work = pg.all_reduce_async(vec![pg.rank() as f32 + 1.0; 3], ReduceOp::Sum);
///     // ... compute something else here while the reduction runs ...
///     work.wait().unwrap()
/// });
/// assert_eq!(out[0], vec![3.0; 3]);
/// ```
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    limit: Duration,
    /// The operation, named in a timeout ("all_reduce_async").
    op: &'static str,
}

impl<T> Work<T> {
    /// Block until the operation finishes; returns its output (for example
    /// the reduced buffer) or its error.
    pub fn wait(self) -> Result<T> {
        let _blocked = BlockedTimer::start();
        let deadline = Instant::now() + self.limit;
        let mut v = self.slot.value.lock().unwrap();
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout(format!(
                    "{} did not complete within {:.0?} of this wait",
                    self.op, self.limit
                )));
            }
            v = self.slot.done.wait_timeout(v, deadline - now).unwrap().0;
        }
    }

    /// True once `wait` would return without blocking.
    pub fn is_completed(&self) -> bool {
        self.slot.value.lock().unwrap().is_some()
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A FIFO of jobs run by one thread, with a count of jobs not yet finished so
/// that synchronous calls can wait for earlier asynchronous ones.
pub(crate) struct Queue {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
    name: String,
}

impl Queue {
    pub fn new(name: String) -> Queue {
        Queue {
            tx: Mutex::new(None),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
            name,
        }
    }

    /// Queue `f`; its result goes to the returned `Work`.
    pub fn submit<T: Send + 'static>(
        &self,
        op: &'static str,
        limit: Duration,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            done: Condvar::new(),
        });
        let s2 = slot.clone();
        let pending = self.pending.clone();
        *pending.0.lock().unwrap() += 1;
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|_| Err(CommError::Io("communication job panicked".into())));
            *s2.value.lock().unwrap() = Some(r);
            s2.done.notify_all();
            let (m, cv) = &*pending;
            *m.lock().unwrap() -= 1;
            cv.notify_all();
        });
        let mut tx = self.tx.lock().unwrap();
        if tx.is_none() {
            let (t, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || {
                    COMM_THREAD.with(|c| c.set(true));
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .expect("spawn communication thread");
            *tx = Some(t);
        }
        tx.as_ref()
            .unwrap()
            .send(job)
            .expect("communication thread alive");
        Work {
            slot,
            limit: limit * 2 + Duration::from_secs(5),
            op,
        }
    }

    /// Wait until every queued job has finished.
    pub fn drain(&self) {
        let _blocked = BlockedTimer::start();
        let (m, cv) = &*self.pending;
        let mut n = m.lock().unwrap();
        while *n > 0 {
            n = cv.wait(n).unwrap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_that_runs_out_names_the_operation() {
        // A slot nothing fills: the wait ends at its limit, saying what.
        let work: Work<()> = Work {
            slot: Arc::new(Slot {
                value: Mutex::new(None),
                done: Condvar::new(),
            }),
            limit: Duration::from_millis(20),
            op: "all_gather_async",
        };
        let e = work.wait().unwrap_err().to_string();
        assert!(e.contains("all_gather_async did not complete"), "{e}");
    }
}
