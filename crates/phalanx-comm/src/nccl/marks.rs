//! The marks of operations started on a stream without waiting: each gets
//! the next number (1, 2, ...) and the event recorded after it, kept until
//! it is known to be complete. Generic over the event handle, so that the
//! bookkeeping is tested without a GPU.
//!
//! ```
//! use phalanx_comm::nccl::marks::Marks;
//! let mut m = Marks::default();
//! assert_eq!((m.push('a'), m.push('b')), (1, 2));
//! assert_eq!(m.event_of(2).unwrap(), Some('b'));
//! let mut gone = Vec::new();
//! m.retire(Some(1), |e| gone.push(e));
//! assert_eq!((gone, m.event_of(1).unwrap()), (vec!['a'], None));
//! ```

use crate::error::{invalid, Result};
use std::collections::VecDeque;

/// Started operations' marks and events, oldest first.
#[derive(Debug)]
pub struct Marks<E> {
    /// How many were started: the last one's mark.
    started: u64,
    /// The events of those not yet known to be complete.
    events: VecDeque<(u64, E)>,
}

impl<E> Default for Marks<E> {
    fn default() -> Self {
        Marks {
            started: 0,
            events: VecDeque::new(),
        }
    }
}

impl<E: Copy> Marks<E> {
    /// Record an operation started, with the event after it: its mark.
    pub fn push(&mut self, event: E) -> u64 {
        self.started += 1;
        self.events.push_back((self.started, event));
        self.started
    }

    /// How many were started: the last one's mark.
    pub fn started(&self) -> u64 {
        self.started
    }

    /// Whether any started operation is not yet known to be complete.
    pub fn pending(&self) -> bool {
        !self.events.is_empty()
    }

    /// The event after operation `mark`; `None` when it is already known to
    /// be complete (retired), and for mark 0 (a start that launched
    /// nothing before any other: an empty buffer). A mark never given is
    /// refused.
    pub fn event_of(&self, mark: u64) -> Result<Option<E>> {
        if mark > self.started {
            return Err(invalid!(
                "settle_device: mark {mark}, but {} operations were started (marks 1 to {0})",
                self.started
            ));
        }
        Ok(self
            .events
            .iter()
            .find(|(m, _)| *m == mark)
            .map(|&(_, e)| e))
    }

    /// Let go (`destroy`) of the events of the operations up to `mark`
    /// (all: `None`), known to be complete.
    pub fn retire(&mut self, mark: Option<u64>, mut destroy: impl FnMut(E)) {
        while let Some(&(m, e)) = self.events.front() {
            if mark.is_some_and(|k| m > k) {
                break;
            }
            destroy(e);
            self.events.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_count_from_one_and_retire_in_order() {
        let mut m: Marks<u32> = Marks::default();
        assert!(m.event_of(1).is_err(), "nothing started yet");
        assert!(!m.pending());
        let marks: Vec<u64> = (10..15).map(|e| m.push(e)).collect();
        assert_eq!(marks, vec![1, 2, 3, 4, 5]);
        assert!(m.pending());
        assert_eq!(m.started(), 5);
        assert_eq!(m.event_of(3).unwrap(), Some(12));
        // Waiting for 3 completes 1 and 2 with it (one stream, in order).
        let mut gone = Vec::new();
        m.retire(Some(3), |e| gone.push(e));
        assert_eq!(gone, vec![10, 11, 12]);
        for k in 1..=3 {
            assert_eq!(m.event_of(k).unwrap(), None, "mark {k} is complete");
        }
        assert_eq!(m.event_of(4).unwrap(), Some(13));
        // Retiring an earlier mark again retires nothing.
        m.retire(Some(2), |e| gone.push(e));
        assert_eq!(gone.len(), 3);
        // The whole stream idle: every event goes, the count stays.
        m.retire(None, |e| gone.push(e));
        assert_eq!(gone, vec![10, 11, 12, 13, 14]);
        assert_eq!((m.started(), m.event_of(5).unwrap()), (5, None));
        assert!(!m.pending(), "a staged call need not wait");
        assert_eq!(m.push(20), 6);
        let e = m.event_of(7).unwrap_err().to_string();
        assert!(e.contains("mark 7, but 6 operations"), "{e}");
        assert_eq!(m.event_of(0).unwrap(), None, "mark 0: nothing launched");
    }
}
