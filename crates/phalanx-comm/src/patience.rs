//! Progress while a rank waits for others at start-up.
//!
//! A rank whose peers never come (a node not started, a wrong
//! `MASTER_ADDR`, rank 0 on another host without `PHALANX_SECRET`) would
//! otherwise print nothing until `PHALANX_TIMEOUT` (300 s by default) ends
//! the wait. A [`Waiting`] says what it waits for after 10 s, 30 s and 60 s,
//! then every minute, with the time left (of `PHALANX_TIMEOUT`, or of the
//! timeout the caller was given); the final timeout error is unchanged.

use std::time::{Duration, Instant};

/// When the first line is printed; waits shorter than this stay silent.
const FIRST: Duration = Duration::from_secs(10);

/// A wait that reports itself now and then (see the module docs).
pub(crate) struct Waiting {
    start: Instant,
    deadline: Instant,
    next: Duration,
}

impl Waiting {
    /// A wait starting now that gives up at `deadline`.
    pub(crate) fn until(deadline: Instant) -> Waiting {
        Waiting::starting(Instant::now(), deadline)
    }

    fn starting(start: Instant, deadline: Instant) -> Waiting {
        Waiting {
            start,
            deadline,
            next: FIRST,
        }
    }

    /// Call from the wait's loop: prints `[phalanx] {what}` to stderr when
    /// a report is due (`what` is only built then).
    pub(crate) fn tick(&mut self, what: impl FnOnce() -> String) {
        if let Some(line) = self.due(Instant::now(), what) {
            eprintln!("{line}");
        }
    }

    /// The line due at `now`, if any.
    fn due(&mut self, now: Instant, what: impl FnOnce() -> String) -> Option<String> {
        let waited = now.saturating_duration_since(self.start);
        if waited < self.next {
            return None;
        }
        // 10 s, 30 s, 60 s, then each minute (a wait that was not polled
        // for a while reports once, not once per missed time).
        while self.next <= waited {
            self.next = match self.next.as_secs() {
                s if s < 30 => Duration::from_secs(30),
                s => Duration::from_secs((s / 60 + 1) * 60),
            };
        }
        let left = self.deadline.saturating_duration_since(now);
        Some(format!(
            "[phalanx] {} ({:.0} s so far; giving up in {:.0} s)",
            what(),
            waited.as_secs_f64(),
            left.as_secs_f64()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_at_10_30_and_60_s_then_each_minute() {
        let t0 = Instant::now();
        let mut w = Waiting::starting(t0, t0 + Duration::from_secs(300));
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut when = Vec::new();
        for s in 0..=250 {
            if let Some(line) = w.due(at(s), || "still waiting for rank 1".into()) {
                when.push(s);
                if s == 10 {
                    assert_eq!(
                        line,
                        "[phalanx] still waiting for rank 1 (10 s so far; giving up in 290 s)"
                    );
                }
            }
        }
        assert_eq!(when, [10, 30, 60, 120, 180, 240]);
        // Polled late: one line, and the next one a minute on.
        let mut w = Waiting::starting(t0, t0 + Duration::from_secs(300));
        assert!(w.due(at(95), String::new).is_some());
        assert!(w.due(at(119), String::new).is_none());
        assert!(w.due(at(120), String::new).is_some());
    }
}
