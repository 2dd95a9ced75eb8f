//! Deadlines for blocking MPI calls: each call registers (deadline, what)
//! while it runs; one thread wakes at the earliest deadline, or every
//! 100 ms, and if a call is past its deadline, aborts the job naming it. A
//! call costs a mutex lock and a map insertion: the thread is never woken
//! by calls, so a deadline may be seen up to 100 ms late.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_millis(100);

struct Watchdog {
    calls: Mutex<BTreeMap<u64, (Instant, String, Duration)>>,
    tick: Condvar,
    next: AtomicU64,
}

fn dog() -> &'static Watchdog {
    static DOG: OnceLock<&'static Watchdog> = OnceLock::new();
    DOG.get_or_init(|| {
        let d: &'static Watchdog = Box::leak(Box::new(Watchdog {
            calls: Mutex::new(BTreeMap::new()),
            tick: Condvar::new(),
            next: AtomicU64::new(0),
        }));
        std::thread::Builder::new()
            .name("phalanx-mpi-watchdog".into())
            .spawn(move || run(d))
            .expect("spawn the MPI watchdog");
        d
    })
}

fn run(d: &'static Watchdog) {
    let mut calls = d.calls.lock().unwrap();
    loop {
        let now = Instant::now();
        let earliest = calls.values().map(|c| c.0).min();
        match earliest {
            Some(t) if t <= now => {
                let (_, what, limit) = calls.values().find(|c| c.0 == t).unwrap().clone();
                drop(calls);
                super::abort_job(&format!(
                    "{what} did not complete within {limit:?} (PHALANX_TIMEOUT)"
                ));
            }
            t => {
                let nap = t.map_or(TICK, |t| (t - now).min(TICK));
                calls = d.tick.wait_timeout(calls, nap).unwrap().0;
            }
        }
    }
}

/// Removes its call from the watch when dropped.
pub(super) struct Watch(u64);

/// Watch a call until the returned guard is dropped.
pub(super) fn watch(deadline: Instant, what: String, limit: Duration) -> Watch {
    let d = dog();
    let id = d.next.fetch_add(1, Ordering::Relaxed);
    d.calls.lock().unwrap().insert(id, (deadline, what, limit));
    Watch(id)
}

impl Drop for Watch {
    fn drop(&mut self) {
        dog().calls.lock().unwrap().remove(&self.0);
    }
}
