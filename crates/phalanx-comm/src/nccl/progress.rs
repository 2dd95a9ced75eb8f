//! NCCL's non-blocking calls (`NCCL_COMM_BLOCKING=0`), waited for under a
//! deadline.
//!
//! A communicator made non-blocking returns `ncclInProgress` (7) from its
//! creation, its splits and its launches (a group's end) while they still
//! connect to their peers, instead of blocking inside the call; the caller
//! then polls `ncclCommGetAsyncError` until it says something else, and
//! may abort the communicator meanwhile. That is what lets a deadline
//! cover connection set-up: with blocking communicators (NCCL's default)
//! a peer that never comes holds such a call forever. [`poll`] is the
//! loop, apart from NCCL so that it is tested without a GPU.
//!
//! A blocking creation or split cannot be interrupted at all: it runs on a
//! helper thread, and [`on_helper`] waits for it until the deadline or
//! until `stop` says the job has failed elsewhere (a peer's abort or crash,
//! seen on the native mesh), whichever comes first.
//!
//! ```
//! use phalanx_comm::nccl::progress::{poll, Progress, IN_PROGRESS};
//! use std::time::{Duration, Instant};
//! let mut left = 3;
//! let mut state = || if left == 0 { 0 } else { left -= 1; IN_PROGRESS };
//! let deadline = Instant::now() + Duration::from_secs(5);
//! assert_eq!(poll(deadline, &mut state, &mut || None), Progress::Done(0));
//! ```

use crate::error::CommError;
use std::ffi::c_int;
use std::time::{Duration, Instant};

/// `ncclInProgress`.
pub const IN_PROGRESS: c_int = 7;

/// How polling a call in progress ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// No longer in progress: NCCL's code (0: done).
    Done(c_int),
    /// `stop` said so (an abort from another thread).
    Stopped(CommError),
    /// Still in progress at the deadline.
    TimedOut,
}

/// Poll `state` (the communicator's `ncclCommGetAsyncError`) while it says
/// [`IN_PROGRESS`], until `deadline`, asking `stop` between polls; spins
/// first, then naps (up to 1 ms), as the stream waits do.
pub fn poll(
    deadline: Instant,
    state: &mut dyn FnMut() -> c_int,
    stop: &mut dyn FnMut() -> Option<CommError>,
) -> Progress {
    let mut polls = 0u32;
    let mut nap = Duration::from_micros(10);
    loop {
        let rc = state();
        if rc != IN_PROGRESS {
            return Progress::Done(rc);
        }
        if let Some(e) = stop() {
            return Progress::Stopped(e);
        }
        if Instant::now() >= deadline {
            return Progress::TimedOut;
        }
        polls += 1;
        if polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

/// How waiting for a call on a helper thread ended.
#[derive(Debug, PartialEq)]
pub enum Waited<R> {
    /// The call returned this.
    Done(R),
    /// `stop` said so first; the helper may still be inside the call.
    Stopped(CommError),
    /// Still running at the deadline; the helper may still be inside it.
    TimedOut,
}

/// Run `f` on a helper thread named `name` and wait for what it returns
/// until `deadline`, asking `stop` every millisecond or so: a call that
/// cannot be interrupted (a blocking NCCL creation or split, which waits
/// for every member) is given up instead of waited for forever. A helper
/// given up stays where it is until the process ends.
pub fn on_helper<R: Send + 'static>(
    name: &str,
    deadline: Instant,
    stop: &dyn Fn() -> Option<CommError>,
    f: impl FnOnce() -> R + Send + 'static,
) -> Waited<R> {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        });
    if let Err(e) = spawned {
        return Waited::Stopped(CommError::Io(format!("cannot start a thread: {e}")));
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.min(Duration::from_millis(1))) {
            Ok(r) => return Waited::Done(r),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Waited::Stopped(CommError::Io(format!("the thread {name} panicked")))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(e) = stop() {
            return Waited::Stopped(e);
        }
        if Instant::now() >= deadline {
            return Waited::TimedOut;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_stopped_and_timed_out() {
        let far = Instant::now() + Duration::from_secs(10);
        // Done at once, with NCCL's error code as it is.
        assert_eq!(poll(far, &mut || 3, &mut || None), Progress::Done(3));
        // Stopped: an abort recorded elsewhere ends the wait.
        let mut n = 0;
        let mut stop = || {
            n += 1;
            (n == 5).then(|| CommError::Aborted("peer gone".into()))
        };
        let got = poll(far, &mut || IN_PROGRESS, &mut stop);
        assert_eq!(
            got,
            Progress::Stopped(CommError::Aborted("peer gone".into()))
        );
        // Never done: the deadline ends it.
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(
            poll(soon, &mut || IN_PROGRESS, &mut || None),
            Progress::TimedOut
        );
        assert!(Instant::now() >= soon);
    }

    #[test]
    fn a_helper_is_waited_for_until_done_stopped_or_the_deadline() {
        let far = Instant::now() + Duration::from_secs(30);
        let done = on_helper("t", far, &|| None, || 7);
        assert_eq!(done, Waited::Done(7));
        // A call that never returns: the deadline ends the wait, not the call.
        let soon = Instant::now() + Duration::from_millis(30);
        let hung = || std::thread::sleep(Duration::from_secs(3600));
        assert_eq!(on_helper("t", soon, &|| None, hung), Waited::TimedOut);
        assert!(Instant::now() >= soon);
    }

    /// The job failing elsewhere ends the wait for a call that would never
    /// return, long before the deadline, with the failure as it was seen:
    /// here rank 1 aborts, and rank 0 waits on what its native mesh says.
    #[test]
    fn a_peers_abort_ends_the_wait_naming_it() {
        use crate::{threads, Config};
        let cfg = Config {
            timeout: Duration::from_secs(60),
            ..Config::default()
        };
        let out = threads::run_with(2, cfg, Duration::from_secs(30), |pg| {
            pg.barrier()?;
            if pg.rank() == 1 {
                pg.abort("injected: loss became NaN");
                return Ok(None);
            }
            let t = Instant::now();
            let far = t + Duration::from_secs(60);
            let watch = pg.clone();
            let stop = move || watch.failure();
            let hung = || std::thread::sleep(Duration::from_secs(3600));
            Ok(Some((on_helper("t", far, &stop, hung), t.elapsed())))
        });
        let (w, took) = out.into_iter().next().unwrap().unwrap().unwrap();
        let Waited::Stopped(e) = w else {
            panic!("not stopped: {w:?}")
        };
        let m = e.to_string();
        assert!(
            m.contains("rank 1 (") && m.contains("aborted: injected: loss became NaN"),
            "{m}"
        );
        assert!(took < Duration::from_secs(20), "took {took:?}");
    }
}
