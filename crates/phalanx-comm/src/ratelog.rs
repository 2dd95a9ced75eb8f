//! Logging that a hostile peer cannot turn into a flood: a burst of lines
//! per window, then one line saying how many were left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(crate) struct RateLimitedLog {
    prefix: String,
    burst: u32,
    window: Duration,
    state: Mutex<Window>,
}

struct Window {
    start: Instant,
    printed: u32,
    suppressed: u64,
}

impl RateLimitedLog {
    /// At most `burst` lines per `window`, each starting with `prefix`.
    pub(crate) fn new(prefix: impl Into<String>, burst: u32, window: Duration) -> Self {
        RateLimitedLog {
            prefix: prefix.into(),
            burst,
            window,
            state: Mutex::new(Window {
                start: Instant::now(),
                printed: 0,
                suppressed: 0,
            }),
        }
    }

    pub(crate) fn log(&self, msg: impl std::fmt::Display) {
        let mut w = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if now.duration_since(w.start) >= self.window {
            self.flush(&mut w);
            w.start = now;
            w.printed = 0;
        }
        if w.printed < self.burst {
            w.printed += 1;
            eprintln!("{} {msg}", self.prefix);
            if w.printed == self.burst {
                eprintln!(
                    "{} (more messages like this in the next {:.0} s are counted, not printed)",
                    self.prefix,
                    self.window
                        .saturating_sub(now.duration_since(w.start))
                        .as_secs_f64()
                );
            }
        } else {
            w.suppressed += 1;
        }
    }

    /// Print the count of suppressed messages now, if any.
    pub(crate) fn flush_now(&self) {
        let mut w = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.flush(&mut w);
    }

    fn flush(&self, w: &mut Window) {
        if w.suppressed > 0 {
            eprintln!(
                "{} {} more such messages suppressed",
                self.prefix, w.suppressed
            );
            w.suppressed = 0;
        }
    }
}

impl Drop for RateLimitedLog {
    fn drop(&mut self) {
        self.flush_now();
    }
}
