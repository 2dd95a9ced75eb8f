//! Point-to-point messages: `send`, and `recv` in issue order with the
//! `recv_async`s of the same source and tag posted before it (messages do
//! not overtake each other, as in MPI).

use super::ProcessGroup;
use crate::dtype::Element;
use crate::error::{invalid, CommError, Result};
use std::sync::Mutex;
use std::time::Instant;

impl ProcessGroup {
    /// Send `buf` to group rank `dst` under `tag`; returns once the data is
    /// handed to the transport (the receiver buffers it).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u64) -> Result<()> {
        self.check_peer(dst)?;
        self.check_open()?;
        let c = self.call("send", 0);
        self.inner
            .backend
            .send(&c, dst, tag, bytemuck::cast_slice(buf))
    }

    /// Receive exactly `buf.len()` elements from group rank `src` under
    /// `tag`, after every receive of the same source and tag posted before
    /// with [`ProcessGroup::recv_async`] (messages are taken in issue order,
    /// as MPI's do not overtake each other).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.check_peer(src)?;
        let deadline = Instant::now() + self.inner.cfg.timeout;
        self.inner.posted.wait_for(src, tag, deadline)?;
        self.recv_now(buf, src, tag)
    }

    pub(super) fn recv_now<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.check_open()?;
        let c = self.call("recv", 0);
        self.inner
            .backend
            .recv_into(&c, src, tag, bytemuck::cast_slice_mut(buf))
    }

    pub(super) fn check_peer(&self, p: usize) -> Result<()> {
        if p >= self.size() || p == self.rank() {
            return Err(invalid!(
                "peer {p} is not another rank of this group (size {})",
                self.size()
            ));
        }
        Ok(())
    }
}

/// Counts of receives posted and not yet done, per (source, tag).
#[derive(Default)]
pub(super) struct Posted {
    open: Mutex<std::collections::HashMap<(usize, u64), usize>>,
    done: std::sync::Condvar,
}

impl Posted {
    pub(super) fn add(&self, src: usize, tag: u64) {
        *self.open.lock().unwrap().entry((src, tag)).or_default() += 1;
    }

    pub(super) fn finish_on_drop(&self, src: usize, tag: u64) -> impl Drop + '_ {
        struct Finish<'a>(&'a Posted, usize, u64);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                self.0.finish(self.1, self.2);
            }
        }
        Finish(self, src, tag)
    }

    fn finish(&self, src: usize, tag: u64) {
        let mut open = self.open.lock().unwrap();
        if let Some(n) = open.get_mut(&(src, tag)) {
            *n -= 1;
            if *n == 0 {
                open.remove(&(src, tag));
            }
        }
        drop(open);
        self.done.notify_all();
    }

    /// Wait until no receive of (src, tag) is posted, until `deadline`.
    fn wait_for(&self, src: usize, tag: u64, deadline: Instant) -> Result<()> {
        let mut open = self.open.lock().unwrap();
        while open.contains_key(&(src, tag)) {
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout(format!(
                    "recv(tag={tag}) from rank {src} waited past the deadline (PHALANX_TIMEOUT) for \
                     a receive of the same source and tag posted before it with recv_async"
                )));
            }
            open = self.done.wait_timeout(open, deadline - now).unwrap().0;
        }
        Ok(())
    }
}
