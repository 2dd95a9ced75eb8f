//! Variable-length messages between two ranks of a group, for protocols
//! whose message sizes the receiver cannot know in advance (RPC).
//!
//! `send`/`recv` move fixed-size typed buffers; these move byte messages
//! of any length on the group's point-to-point channel, under a tag, and
//! hand the receiver the transport's own 8-byte aligned buffer (no copy).
//! They share the transport's authentication, deadlines and dead-peer
//! detection with everything else.
//!
//! ```
//! use std::time::{Duration, Instant};
//! let got = phalanx_comm::threads::run(2, |pg| {
//!     if pg.rank() == 0 {
//!         pg.send_bytes(1, 7, b"hello", Duration::from_secs(10)).unwrap();
//!         Vec::new()
//!     } else {
//!         let deadline = Instant::now() + Duration::from_secs(10);
//!         pg.recv_bytes(0, 7, deadline).unwrap().bytes().to_vec()
//!     }
//! });
//! assert_eq!(got[1], b"hello");
//! ```

use super::ProcessGroup;
use crate::backend::Call;
use crate::error::Result;
use crate::transport::Msg;
use std::time::{Duration, Instant};

impl ProcessGroup {
    /// Send one message of any length to group rank `dst` under `tag`.
    /// Messages from one sender under one tag arrive in the order sent.
    pub fn send_bytes(&self, dst: usize, tag: u64, data: &[u8], timeout: Duration) -> Result<()> {
        self.check_peer(dst)?;
        self.check_open()?;
        let c = Call {
            deadline: Instant::now() + timeout,
            ..self.call("send_bytes", 0)
        };
        self.inner.backend.send(&c, dst, tag, data)
    }

    /// Receive the next message from group rank `src` under `tag`, of
    /// whatever length it has, waiting until `deadline`. Fails at once,
    /// naming the peer, when the peer died or shut down.
    pub fn recv_bytes(&self, src: usize, tag: u64, deadline: Instant) -> Result<Msg> {
        self.check_peer(src)?;
        self.check_open()?;
        let c = Call {
            deadline,
            ..self.call("recv_bytes", 0)
        };
        self.inner.backend.recv_message(&c, src, tag)
    }
}

impl Msg {
    /// The message's buffer (8-byte aligned words) and its length in bytes,
    /// so that a receiver can keep the data without copying it.
    pub fn into_words(self) -> (Vec<u64>, usize) {
        (self.words, self.len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
