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
}
