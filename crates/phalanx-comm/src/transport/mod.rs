//! Rank-to-rank transport: a full mesh of authenticated connections, Unix
//! domain stream sockets to ranks on the same host and TCP to the others
//! (`PHALANX_TRANSPORT=tcp` forces TCP everywhere). Both kinds are a
//! `Stream`, so framing, readers, heartbeats and failure handling are one
//! code path.
//!
//! Which path carries a pair's data (`PHALANX_TRANSPORT`):
//!
//! | setting | same host | other hosts |
//! |---|---|---|
//! | `auto` (default) | shared memory (`shm`), Unix socket if it cannot be set up | TCP |
//! | `shm` | shared memory; an error if it cannot be set up | TCP |
//! | `uds` | Unix socket | TCP |
//! | `tcp` | TCP | TCP |
//!
//! Shared memory (`shm`, `shm_link`) is a pair of single-producer
//! single-consumer rings per same-host pair, in memfds passed over the
//! authenticated Unix socket. It carries the same byte stream a socket
//! would, read by the same reader code (`reader`), so every algorithm and
//! sub-group works on it unchanged; the Unix socket stays beside it for
//! heartbeats, ABORT and the goodbye (`reader::Role`). When every rank of
//! the job shares the host, the world group's all-reduce skips the rings:
//! each rank reduces its slice of every rank's chunk in place in shared
//! slots (`shm_coll`). Network emulation shapes sockets, so it turns
//! shared memory off under `auto`.
//!
//! Each connection has a reader thread that drains the socket into an inbox
//! keyed by (peer, channel, sequence). Because the reader always drains, a
//! rank may write a large chunk while its peer writes one back: the classic
//! ring deadlock ("both sides write, nobody reads, both socket buffers fill")
//! cannot happen. Algorithms (`crate::algo`) only see `send` and `recv`.
//!
//! Network emulation (`PHALANX_NET_EMULATE` / `Config::net_emulate`, see
//! `crate::config::NetEmulate`): each connection's sending side delays every
//! data frame's first byte to `latency` after it was handed to `send`, then
//! paces its bytes in chunks of at most 64 KiB through a token bucket of
//! `bandwidth`, so a frame arrives no earlier than send time + latency +
//! size / bandwidth and one host behaves like a cluster on a slow network.
//! Off (one branch per send) when unset.
//!
//! Failure: a peer that closes its socket without saying goodbye, sends an
//! ABORT, or stops sending heartbeats marks the whole transport failed; every
//! pending and later call then returns an error naming that peer.
//!
//! # Security: what is authenticated, and what an on-path attacker can do
//!
//! Every connection, rank to rank and rank to store, starts with the mutual
//! HMAC-SHA256 challenge-response of `crate::wire::handshake` over the job
//! secret; between ranks it also covers the group and both ranks
//! (`wire::handshake_bound`), so an answer is good for one link only.
//! Without the secret nobody can open a connection that is accepted,
//! join as a rank, read or write Phalanx's store, or learn the secret by
//! watching handshakes. Strangers that connect anyway are handshaken
//! concurrently, each within a deadline, and never counted as ranks.
//!
//! torchrun's agent store is a PyTorch TCPStore, with no authentication:
//! anyone who reaches it can rewrite what ranks publish there. So the
//! addresses and Unix socket names ranks publish are signed with the secret
//! (`wire::sign_record`, bound to the group, the kind and the rank), and a
//! rank dials only those that verify (`mesh::connect_mesh`); a rewritten one
//! is an error naming the rank, never a connection through a relay that
//! would sit between two ranks. Rewriting that store can still stop the job.
//!
//! After the handshake, frames carry **no integrity check and no
//! encryption**. Someone who can read and rewrite the traffic between two
//! hosts (root on a router or switch, ARP or DNS spoofing on the LAN, a
//! compromised host on the path) can therefore:
//! - read every tensor, gradient and parameter that crosses hosts;
//! - change payload bytes undetected, silently corrupting gradients,
//!   broadcast weights or anything else a collective carries;
//! - rewrite headers or inject frames into an established TCP connection:
//!   make a rank abort or stop the job with an ABORT / GOODBYE frame that
//!   names any reason, swap or replay messages between channels, or
//!   announce a frame of up to `MAX_DATA_FRAME` (1 GiB) that the receiver
//!   allocates, or send a message of many frames that it joins (growing
//!   as the bytes arrive);
//! - drop or delay traffic, which shows as a dead peer after the heartbeat
//!   timeout (that much no authentication could prevent).
//!
//! They cannot join the job, read or write Phalanx's rendezvous store, or
//! obtain the secret. Between ranks on one host, Unix sockets (abstract names,
//! reachable only from the same network namespace) and loopback TCP have no
//! path to sit on: only root on that host, which can read the processes'
//! memory anyway, could interfere.
//!
//! This is accepted for now because multi-host training runs on a cluster's
//! private network, the same assumption NCCL, Gloo and PyTorch's TCPStore
//! make (and they do not authenticate connections at all); and because a MAC
//! over every byte would need a second pass over each buffer that the
//! reader now receives straight into the caller's memory. Jobs that cross a
//! network you do not trust should run inside a tunnel that provides
//! integrity and confidentiality at line rate (WireGuard, IPsec). The way to
//! close this in Phalanx itself is a session key derived from both
//! handshake nonces and a MAC with a sequence number on every frame.

mod mesh;
mod posts;
mod reader;
mod send;
pub(crate) use send::{register, Bucket};
mod shm;
pub(crate) mod shm_coll;
mod shm_link;
mod stream;

pub use mesh::connect_mesh;
pub(crate) use posts::Posts;
pub use stream::{Link, Stream};

use crate::error::{CommError, Result};
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub(crate) const K_DATA: u8 = 1;
pub(crate) const K_HEARTBEAT: u8 = 2;
pub(crate) const K_ABORT: u8 = 3;
pub(crate) const K_GOODBYE: u8 = 4;
pub(crate) const HEADER: usize = 32;
/// The largest single data frame; a longer message travels as several
/// (see `Transport::send`).
pub const MAX_DATA_FRAME: usize = 1 << 30;
/// Header byte 1 of a data frame: more frames of the same message follow.
pub(crate) const F_MORE: u8 = 1;

/// The data frame limit in force: [`MAX_DATA_FRAME`] unless a test
/// lowered it ([`set_frame_limit_for_test`]).
static FRAME_LIMIT: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(MAX_DATA_FRAME);

/// The largest data frame this process sends, and accepts from a peer.
pub(crate) fn frame_limit() -> usize {
    FRAME_LIMIT.load(Ordering::Relaxed)
}

/// Lower the data frame limit of this whole process (clamped to 1 byte ..
/// [`MAX_DATA_FRAME`]), so that a test can send messages of many frames
/// with small buffers. Every rank of a job must use the same limit: set it
/// before any transport starts (a test binary of ranks-as-threads whose
/// tests all set the same value).
#[doc(hidden)]
pub fn set_frame_limit_for_test(bytes: usize) {
    FRAME_LIMIT.store(bytes.clamp(1, MAX_DATA_FRAME), Ordering::Relaxed);
}

/// A received message. The buffer is 8-byte aligned so that it can be viewed
/// as any element type without copying.
pub struct Msg {
    pub(crate) words: Vec<u64>,
    pub(crate) len: usize,
}

impl Msg {
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }
}

pub(crate) fn header(kind: u8, chan: u64, seq: u64, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind;
    h[8..16].copy_from_slice(&chan.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

pub(crate) struct Peer {
    /// The peer's TCP listening address, its label in messages.
    pub host: String,
    pub link: Link,
    pub writer: Mutex<Stream>,
    /// The shared-memory ring data frames go through instead of `writer`
    /// (same-host peers; see `shm`).
    pub shm: Option<Mutex<shm::RingTx>>,
    /// The peer's ring that our reader thread drains (for `in_flight`).
    pub shm_rx: Option<Arc<shm::Ring>>,
    /// Token bucket of the emulated link to this peer; used only under
    /// `writer`'s lock and only when network emulation is on.
    pub bucket: Mutex<Bucket>,
    /// A write on `writer` failed part-way through a frame: the byte
    /// stream can no longer be framed, so nothing more is written to it
    /// (`Transport::tear`).
    pub torn: AtomicBool,
}

/// (peer, channel, sequence): what a message is matched by.
pub(crate) type Key = (usize, u64, u64);

/// A receive posted before its data arrived: the reader thread reads the
/// frame straight into `ptr..ptr+len` (the caller's buffer) instead of a
/// pooled buffer, saving a copy.
#[derive(Clone, Copy)]
pub(crate) struct Posted {
    pub id: u64,
    pub ptr: usize,
    pub len: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Slot {
    /// Waiting for its frame.
    Posted,
    /// The reader thread is writing into it.
    Filling,
    /// Filled.
    Done,
    /// The connection failed while filling it.
    Failed,
}

#[derive(Default)]
pub(crate) struct Inbox {
    pub queues: HashMap<Key, VecDeque<Msg>>,
    /// Posted receives per key, oldest first. A frame goes into the oldest
    /// one only when no earlier frame of that key is queued (so frames
    /// stay in order) and the lengths agree.
    pub posted: HashMap<Key, VecDeque<Posted>>,
    pub slots: HashMap<u64, Slot>,
    pub next_slot: u64,
    pub failed: Option<CommError>,
    /// Peers that said goodbye (clean shutdown), with no error implied.
    pub closed: HashMap<usize, ()>,
}

pub struct Transport {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) peers: Vec<Option<Peer>>,
    pub(crate) inbox: Mutex<Inbox>,
    pub(crate) arrived: Condvar,
    pub(crate) failed_flag: AtomicBool,
    pub(crate) closing: AtomicBool,
    /// Closed cleanly here (`close`): later calls fail, saying so.
    pub(crate) shut_here: AtomicBool,
    pool: Mutex<Vec<Vec<u64>>>,
    /// Payload bytes handed to peers so far (every group on this transport).
    sent: std::sync::atomic::AtomicU64,
    /// Emulated network on every link (`None`: off).
    pub(crate) netem: Option<crate::config::NetEmulate>,
    /// Every rank's all-reduce slot, when all ranks share this host's
    /// memory (`shm_coll`).
    pub(crate) shm_world: Option<shm_coll::ShmWorld>,
}

impl Transport {
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// "host:port" of a rank, for error messages.
    pub fn host_of(&self, rank: usize) -> String {
        match self.peers.get(rank).and_then(|p| p.as_ref()) {
            Some(p) => p.host.clone(),
            None => "this process".into(),
        }
    }

    /// `rank` left cleanly (its goodbye was read): it will not send, read
    /// or reach a barrier again, which only waits on shared memory (the
    /// rings, `shm_coll`) would not notice by themselves.
    pub(crate) fn has_left(&self, rank: usize) -> bool {
        self.inbox.lock().unwrap().closed.contains_key(&rank)
    }

    /// The kind of socket that connects this process to `rank` (`None` for
    /// itself).
    pub fn link(&self, rank: usize) -> Option<Link> {
        self.peers
            .get(rank)
            .and_then(|p| p.as_ref())
            .map(|p| p.link)
    }

    /// Payload bytes this process has sent to peers so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Count bytes moved to peers other than by a message (the in-place
    /// shared-memory all-reduce).
    pub(crate) fn count_sent(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The error every call returns once the transport has failed.
    pub fn failure(&self) -> Option<CommError> {
        if !self.failed_flag.load(Ordering::Acquire) {
            return None;
        }
        self.inbox.lock().unwrap().failed.clone()
    }

    /// Record the first failure and wake every waiter.
    pub(crate) fn fail(&self, err: CommError) {
        let mut ib = self.inbox.lock().unwrap();
        if ib.failed.is_none() {
            ib.failed = Some(err);
            self.failed_flag.store(true, Ordering::Release);
        }
        drop(ib);
        self.arrived.notify_all();
    }

    /// Why a wait for data from `from` cannot succeed any more, if it
    /// cannot: the transport failed, or the peer left without sending it.
    fn gone(&self, ib: &Inbox, from: usize, what: &dyn Fn() -> String) -> Option<CommError> {
        if let Some(e) = &ib.failed {
            return Some(e.clone());
        }
        if let Some(e) = self.closed_here() {
            return Some(e);
        }
        ib.closed.contains_key(&from).then(|| CommError::PeerDead {
            rank: from,
            host: self.host_of(from),
            reason: format!("shut down before sending the data for {}", what()),
        })
    }

    /// Whether `from` has bytes in its shared-memory ring that its reader
    /// thread has not delivered yet, within a short grace period (started
    /// in `grace`): data a peer sent before a failure elsewhere (say an
    /// ABORT on a control socket) is still delivered, as it would be on
    /// one socket, instead of losing the race to the failure.
    fn in_flight(&self, from: usize, grace: &mut Option<Instant>) -> bool {
        let unread = self
            .peers
            .get(from)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.shm_rx.as_ref())
            .is_some_and(|r| r.unread());
        let until = *grace.get_or_insert_with(|| Instant::now() + Duration::from_millis(200));
        unread && Instant::now() < until
    }

    /// How long to sleep before looking again (at most 1 s), or the timeout
    /// error naming the awaited peer once `deadline` has passed.
    fn wait_slice(
        &self,
        from: usize,
        deadline: Instant,
        what: &dyn Fn() -> String,
    ) -> Result<Duration> {
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Timeout(format!(
                "{} waited for rank {from} ({}) past the deadline (PHALANX_TIMEOUT)",
                what(),
                self.host_of(from)
            )));
        }
        Ok((deadline - now).min(Duration::from_secs(1)))
    }

    /// Receive the next frame from `from` on (chan, seq), waiting until
    /// `deadline`. `what` describes the operation for a timeout message.
    pub fn recv(
        &self,
        from: usize,
        chan: u64,
        seq: u64,
        deadline: Instant,
        what: &dyn Fn() -> String,
    ) -> Result<Msg> {
        let key = (from, chan, seq);
        let mut grace = None;
        let mut ib = self.inbox.lock().unwrap();
        loop {
            if let Some(q) = ib.queues.get_mut(&key) {
                if let Some(m) = q.pop_front() {
                    if q.is_empty() {
                        ib.queues.remove(&key);
                    }
                    return Ok(m);
                }
            }
            if let Some(e) = self.gone(&ib, from, what) {
                if !self.in_flight(from, &mut grace) {
                    return Err(e);
                }
            }
            let mut slice = self.wait_slice(from, deadline, what)?;
            if grace.is_some() {
                slice = slice.min(Duration::from_millis(5));
            }
            ib = self.arrived.wait_timeout(ib, slice).unwrap().0;
        }
    }

    /// Take a buffer of at least `words` u64s from the pool.
    pub(crate) fn take_buf(&self, words: usize) -> Vec<u64> {
        let mut pool = self.pool.lock().unwrap();
        if let Some(i) = pool.iter().position(|b| b.capacity() >= words) {
            let mut b = pool.swap_remove(i);
            b.resize(words, 0);
            return b;
        }
        drop(pool);
        vec![0u64; words]
    }

    /// Return a message's buffer for reuse, so steady-state collectives do
    /// not allocate (fresh pages cost page faults).
    pub fn recycle(&self, m: Msg) {
        let mut pool = self.pool.lock().unwrap();
        if pool.len() < 32 {
            pool.push(m.words);
        }
    }

    /// An empty set of posted receives from `from` on (chan, seq); add
    /// regions with `Posts::post` in the order the frames will be sent.
    pub(crate) fn posts(&self, from: usize, chan: u64, seq: u64) -> Posts<'_> {
        Posts::new(self, (from, chan, seq))
    }

    pub(crate) fn new(rank: usize, world: usize, peers: Vec<Option<Peer>>) -> Transport {
        Transport {
            rank,
            world,
            peers,
            inbox: Mutex::new(Inbox::default()),
            arrived: Condvar::new(),
            failed_flag: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            shut_here: AtomicBool::new(false),
            pool: Mutex::new(Vec::new()),
            sent: std::sync::atomic::AtomicU64::new(0),
            netem: None,
            shm_world: None,
        }
    }
}
