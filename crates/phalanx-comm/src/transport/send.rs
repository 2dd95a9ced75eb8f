//! The sending side of a transport: data frames (and over an emulated
//! link, paced), the raw writes with their deadlines, a stream torn by a
//! frame that failed part-way, and the frames that end a connection: the
//! ABORT, the goodbye, and the close of every live transport at exit.

use super::*;
use std::io::Write;

/// Largest chunk the emulated link paces at once (and the bucket's depth).
const NETEM_CHUNK: usize = 64 << 10;

/// Token bucket of one emulated link direction, in bytes.
pub(crate) struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    pub(crate) fn full() -> Bucket {
        Bucket {
            tokens: NETEM_CHUNK as f64,
            last: Instant::now(),
        }
    }

    /// When `n` bytes (at most the depth) may leave at `rate` bytes/s;
    /// takes them from the bucket, which may go negative until then.
    fn take(&mut self, n: usize, rate: f64) -> Instant {
        let now = Instant::now();
        let cap = NETEM_CHUNK as f64;
        self.tokens = (self.tokens + (now - self.last).as_secs_f64() * rate).min(cap);
        self.last = now;
        self.tokens -= n as f64;
        if self.tokens >= 0.0 {
            now
        } else {
            now + crate::config::wait_secs(-self.tokens / rate)
        }
    }
}

impl Transport {
    /// A frame to `to` failed part-way with `e`: the peer can no longer
    /// tell where frames begin, so nothing more may be written to it (no
    /// heartbeat, ABORT or goodbye), and the transport fails: every
    /// pending and later call reports it.
    pub(crate) fn tear(&self, to: usize, p: &Peer, e: &CommError) {
        p.torn.store(true, Ordering::SeqCst);
        self.fail(CommError::PeerDead {
            rank: to,
            host: p.host.clone(),
            reason: format!("a message to it failed part-way ({e}), which ends the connection"),
        });
    }

    fn peer(&self, rank: usize) -> Result<&Peer> {
        self.peers
            .get(rank)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| {
                CommError::Invalid(format!(
                    "no connection to rank {rank} (world size {})",
                    self.world
                ))
            })
    }

    /// Send one message to `to`. Blocks while the socket is full, but
    /// checks for failure every second and gives up at `deadline`.
    ///
    /// A message longer than the frame limit goes as several frames, all
    /// but the last marked `F_MORE`, written under one hold of the link so
    /// that no other frame comes between them; the peer's reader joins
    /// them into one message. So any length works on every path, and the
    /// receiver sees what it would see for a single frame.
    pub fn send(
        &self,
        to: usize,
        chan: u64,
        seq: u64,
        data: &[u8],
        deadline: Instant,
    ) -> Result<()> {
        if let Some(e) = self.failure().or_else(|| self.closed_here()) {
            return Err(e);
        }
        let p = self.peer(to)?;
        self.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
        let limit = frame_limit();
        // At least one frame: an empty message is an empty frame.
        let frames = data.len().div_ceil(limit).max(1);
        let piece = |i: usize| -> ([u8; HEADER], &[u8]) {
            let part = &data[(i * limit).min(data.len())..((i + 1) * limit).min(data.len())];
            let mut h = header(K_DATA, chan, seq, part.len());
            if i + 1 < frames {
                h[1] = F_MORE;
            }
            (h, part)
        };
        let handed = self.netem.map(|_| Instant::now());
        if let Some(ring) = &p.shm {
            let mut tx = ring.lock().unwrap();
            let mut check = || match self.failure() {
                Some(f) => Err(f),
                // Gone without draining its ring: the rest would never fit.
                None if self.has_left(to) => Err(CommError::PeerDead {
                    rank: to,
                    host: p.host.clone(),
                    reason: "shut down without reading what was sent to it".into(),
                }),
                None if Instant::now() >= deadline => Err(CommError::Timeout(format!(
                    "sending to rank {to} ({}): the peer stopped reading its shared-memory ring",
                    p.host
                ))),
                None => Ok(()),
            };
            for i in 0..frames {
                let (h, part) = piece(i);
                tx.write_all(&[&h, part], &mut check)?;
            }
            return Ok(());
        }
        let mut w = p.writer.lock().unwrap();
        // Bytes of this message written, if it fails part-way.
        let mut wrote = 0;
        let res = (0..frames).try_for_each(|i| {
            let (h, part) = piece(i);
            self.write_frame(&mut w, p, handed, &h, part, deadline, &mut wrote)
        });
        if let (Err(e), true) = (&res, wrote > 0) {
            self.tear(to, p, e);
        }
        drop(w);
        res.map_err(|e| match self.failure_after_send_error() {
            Some(f) => f,
            None => match e {
                CommError::Timeout(m) => {
                    CommError::Timeout(format!("sending to rank {to} ({}): {m}", p.host))
                }
                other => CommError::PeerDead {
                    rank: to,
                    host: p.host.clone(),
                    reason: format!("send failed: {other}"),
                },
            },
        })
    }

    /// Write one data frame (header `h`, payload `data`) on `w`: paced
    /// over an emulated link (handed to `send` at `handed`), else in one
    /// write when small.
    #[allow(clippy::too_many_arguments)]
    fn write_frame(
        &self,
        w: &mut Stream,
        p: &Peer,
        handed: Option<Instant>,
        h: &[u8],
        data: &[u8],
        deadline: Instant,
        wrote: &mut usize,
    ) -> Result<()> {
        if let (Some(ne), Some(t0)) = (self.netem, handed) {
            self.send_emulated(w, p, ne, t0, h, data, deadline, wrote)
        } else if data.len() <= 64 << 10 {
            // One write for small messages: one packet, lower latency.
            let mut buf = Vec::with_capacity(HEADER + data.len());
            buf.extend_from_slice(h);
            buf.extend_from_slice(data);
            self.write_all(w, &buf, deadline, wrote)
        } else {
            self.write_all(w, h, deadline, wrote)
                .and_then(|_| self.write_all(w, data, deadline, wrote))
        }
    }

    /// `send` over an emulated link (see the module docs): wait until
    /// `latency` after `t0`, then write header and data paced by the bucket.
    #[allow(clippy::too_many_arguments)]
    fn send_emulated(
        &self,
        w: &mut Stream,
        p: &Peer,
        ne: crate::config::NetEmulate,
        t0: Instant,
        h: &[u8],
        data: &[u8],
        deadline: Instant,
        wrote: &mut usize,
    ) -> Result<()> {
        self.sleep_until(t0 + ne.latency, deadline)?;
        let Some(bps) = ne.bandwidth_bps else {
            return self
                .write_all(w, h, deadline, wrote)
                .and_then(|_| self.write_all(w, data, deadline, wrote));
        };
        let rate = bps / 8.0;
        let mut bucket = p.bucket.lock().unwrap();
        for part in [h, data] {
            for chunk in part.chunks(NETEM_CHUNK) {
                let at = bucket.take(chunk.len(), rate);
                self.sleep_until(at, deadline)?;
                self.write_all(w, chunk, deadline, wrote)?;
            }
        }
        Ok(())
    }

    /// Sleep until `t` in steps of at most 10 ms, giving up early if the
    /// transport fails or `deadline` passes.
    fn sleep_until(&self, t: Instant, deadline: Instant) -> Result<()> {
        loop {
            let now = Instant::now();
            if now >= t {
                return Ok(());
            }
            if let Some(f) = self.failure() {
                return Err(f);
            }
            if now >= deadline {
                return Err(CommError::Timeout(
                    "emulated network (PHALANX_NET_EMULATE) held the message past the deadline"
                        .into(),
                ));
            }
            std::thread::sleep((t - now).min(Duration::from_millis(10)));
        }
    }

    /// The recorded failure after a send failed. A peer that aborted wrote
    /// its reason and then closed: our send may see the closed socket before
    /// our reader thread has read that reason, so give the reader a moment
    /// (error path only) to record it, and report the reason, not the
    /// broken pipe.
    fn failure_after_send_error(&self) -> Option<CommError> {
        let until = Instant::now() + Duration::from_millis(500);
        loop {
            if let Some(f) = self.failure() {
                return Some(f);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Write `buf` whole, adding to `wrote` what went out (a frame that
    /// fails part-way tears the stream: see [`Peer::tear_if`]).
    pub(crate) fn write_all(
        &self,
        s: &mut Stream,
        mut buf: &[u8],
        deadline: Instant,
        wrote: &mut usize,
    ) -> Result<()> {
        while !buf.is_empty() {
            match s.write(buf) {
                Ok(0) => return Err(CommError::Io("connection closed".into())),
                Ok(n) => {
                    buf = &buf[n..];
                    *wrote += n;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if let Some(f) = self.failure() {
                        return Err(f);
                    }
                    if Instant::now() >= deadline {
                        return Err(CommError::Timeout("peer stopped reading".into()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Close every socket without a word, as a crashed process does. For
    /// failure tests of ranks-as-threads.
    #[doc(hidden)]
    pub fn crash_for_test(&self) {
        self.closing.store(true, Ordering::SeqCst);
        for p in self.peers.iter().flatten() {
            if let Ok(w) = p.writer.lock() {
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Tear the transport down: tell peers why, then close every socket.
    pub fn abort(&self, reason: &str) {
        self.fail(CommError::Aborted(format!(
            "aborted on this rank ({}): {reason}",
            self.rank
        )));
        self.closing.store(true, Ordering::SeqCst);
        // A send in progress on another thread (a bucket's all-reduce)
        // holds a writer: it gives up within its write timeout (1 s) once
        // it sees the failure recorded above, so wait for it rather than
        // skip that peer, who would then hear nothing until the process
        // exits. Past the deadline the peer is skipped still.
        let deadline = Instant::now() + Duration::from_millis(1500);
        for p in self.peers.iter().flatten() {
            let mut w = loop {
                match p.writer.try_lock() {
                    Ok(w) => break Some(w),
                    Err(std::sync::TryLockError::Poisoned(e)) => {
                        // A panic mid-write may have torn the stream too.
                        p.torn.store(true, Ordering::SeqCst);
                        break Some(e.into_inner());
                    }
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(_) => break None,
                }
            };
            if let Some(w) = w.as_mut() {
                if !p.torn.load(Ordering::SeqCst) {
                    // One deadline for the whole abort, with a moment for
                    // each peer's frame however long the waits took.
                    let h = header(K_ABORT, 0, 0, reason.len());
                    let until = deadline.max(Instant::now() + Duration::from_millis(100));
                    let _ = self.write_raw(w, &h, reason.as_bytes(), until);
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    fn write_raw(
        &self,
        w: &mut Stream,
        h: &[u8],
        body: &[u8],
        deadline: Instant,
    ) -> std::io::Result<()> {
        w.set_write_timeout(Some(Duration::from_millis(200)))?;
        let mut buf = h.to_vec();
        buf.extend_from_slice(body);
        let mut off = 0;
        while off < buf.len() && Instant::now() < deadline {
            match w.write(&buf[off..]) {
                Ok(n) => off += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        w.set_write_timeout(Some(Duration::from_secs(1)))
    }
}

impl Transport {
    /// Clean shutdown: a goodbye lets peers tell "finished" from "crashed"
    /// (after a failure, the goodbye carries it). Idempotent.
    pub fn close(&self) {
        if self.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(500);
        let why = match self.failure() {
            Some(e) => e.to_string(),
            // Unwinding from a panic is a failure, not a clean exit.
            None if std::thread::panicking() => format!("rank {} panicked", self.rank),
            None => String::new(),
        };
        for p in self.peers.iter().flatten() {
            // Through the ring too, behind the data sent before it: the
            // peer's ring reader marks us closed only after that data. If
            // the peer stopped draining the ring, the goodbye on the socket
            // says so, so that the peer fails at once instead of waiting for
            // a goodbye in the ring that never comes.
            let mut why = why.clone();
            if let Some(Ok(mut tx)) = p.shm.as_ref().map(|r| r.lock()) {
                let h = header(K_GOODBYE, 0, 0, why.len());
                let mut check = || match Instant::now() >= deadline {
                    true => Err(CommError::Timeout("goodbye".into())),
                    false => Ok(()),
                };
                if tx.write_all(&[&h, why.as_bytes()], &mut check).is_err() && why.is_empty() {
                    why = format!(
                        "rank {} shut down while its shared-memory ring to this rank was full",
                        self.rank
                    );
                }
            }
            if let Ok(mut w) = p.writer.lock() {
                if !p.torn.load(Ordering::SeqCst) {
                    let h = header(K_GOODBYE, 0, 0, why.len());
                    let _ = self.write_raw(&mut w, &h, why.as_bytes(), deadline);
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
        // Later calls on this rank fail at once, saying why (see
        // `closed_here`), without recording a failure: a clean close is
        // not one (NCCL's communicators are then destroyed, not aborted).
        self.shut_here.store(true, Ordering::SeqCst);
        // Waits in progress (another thread, a group sharing this
        // transport) end now, saying why (see `gone`).
        let _ib = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        self.arrived.notify_all();
    }

    /// The error for a call on this rank after its clean shutdown (instead
    /// of a send into a ring nobody reads, or a wait that blames a peer).
    pub fn closed_here(&self) -> Option<CommError> {
        (self.shut_here.load(Ordering::SeqCst) && !self.failed_flag.load(Ordering::Acquire)).then(
            || {
                CommError::Aborted(format!(
                    "it was shut down on this rank ({}) (ProcessGroup::shutdown, as \
                     destroy_process_group): communicating again needs a new one",
                    self.rank
                ))
            },
        )
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.close();
    }
}

/// Transports alive in this process, closed cleanly at exit: a rank that
/// finishes and calls `std::process::exit` must not look crashed to peers
/// still completing their last collective.
static LIVE: Mutex<Vec<std::sync::Weak<Transport>>> = Mutex::new(Vec::new());

extern "C" fn close_all_at_exit() {
    if let Ok(live) = LIVE.lock() {
        for t in live.iter().filter_map(|w| w.upgrade()) {
            t.close();
        }
    }
}

pub(crate) fn register(t: &std::sync::Arc<Transport>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registering a plain extern "C" function with the C runtime.
    ONCE.call_once(|| unsafe {
        libc::atexit(close_all_at_exit);
    });
    let mut live = LIVE.lock().unwrap();
    live.retain(|w| w.strong_count() > 0);
    live.push(std::sync::Arc::downgrade(t));
}
