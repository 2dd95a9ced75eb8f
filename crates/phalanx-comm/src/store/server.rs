//! The store's server: one thread per connection, one map.
//!
//! Before a client has proved it holds the job secret it costs little and
//! cannot linger: at most `max_pending` connections (and
//! `max_pending_per_ip` from one address) are in their handshake at once,
//! later ones are closed at once; each handshake must finish within
//! `handshake_timeout` in total; refusals are logged at a bounded rate.
//! After it, keys, values and the total stored are bounded, so even a
//! client with the secret cannot exhaust the launcher's memory.

use super::*;
use crate::error::{CommError, Result};
use crate::ratelog::RateLimitedLog;
use crate::wire::{self, Reader, Writer};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bounds on what clients may cost the store.
#[derive(Debug, Clone)]
pub struct StoreLimits {
    /// Connections still in their handshake, from anyone.
    pub max_pending: usize,
    /// Connections still in their handshake from one IP address.
    pub max_pending_per_ip: usize,
    /// The whole handshake must finish within this.
    pub handshake_timeout: Duration,
    /// Longest key, in bytes.
    pub max_key: usize,
    /// Longest value, in bytes.
    pub max_value: usize,
    /// Keys plus values held at once, in bytes.
    pub max_total: usize,
}

impl Default for StoreLimits {
    /// 64 pending (16 per address), 10 s handshakes, 4 KiB keys, 1 MiB
    /// values, 64 MiB in all: a job's rendezvous needs a few hundred bytes
    /// per rank.
    fn default() -> Self {
        StoreLimits {
            max_pending: 64,
            max_pending_per_ip: 16,
            handshake_timeout: Duration::from_secs(10),
            max_key: 4 << 10,
            max_value: 1 << 20,
            max_total: 64 << 20,
        }
    }
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// Bytes of keys and values in `map`.
    bytes: usize,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    secret: Vec<u8>,
    stop: AtomicBool,
    limits: StoreLimits,
    /// Handshakes in progress, by client address.
    pending: Mutex<HashMap<IpAddr, usize>>,
    log: RateLimitedLog,
}

/// A running store server; it stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl StoreServer {
    /// Bind and start serving with the default limits. Bind to loopback for
    /// single-host jobs; a port already in use is reported as such.
    pub fn bind(addr: &str, secret: Vec<u8>) -> Result<StoreServer> {
        Self::bind_with(addr, secret, StoreLimits::default())
    }

    /// Bind and start serving with explicit limits.
    pub fn bind_with(addr: &str, secret: Vec<u8>, limits: StoreLimits) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Io(format!("cannot bind the rendezvous store to {addr}: {e}"))
        })?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            secret,
            stop: AtomicBool::new(false),
            limits,
            pending: Mutex::new(HashMap::new()),
            log: RateLimitedLog::new("[phalanx store]", 5, Duration::from_secs(10)),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("phalanx-store".into())
            .spawn(move || accept_loop(listener, sh))?;
        Ok(StoreServer { addr, shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        self.shared.log.flush_now();
        // Wake the accept loop so it sees the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Holds one handshake slot of an address; gives it back when dropped.
struct PendingSlot<'a> {
    sh: &'a Shared,
    ip: IpAddr,
}

impl Drop for PendingSlot<'_> {
    fn drop(&mut self) {
        let mut p = self.sh.pending.lock().unwrap();
        if let Some(n) = p.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.ip);
            }
        }
    }
}

/// Take a handshake slot for `ip`, or say why there is none.
fn take_slot(sh: &Shared, ip: IpAddr) -> std::result::Result<PendingSlot<'_>, String> {
    let mut p = sh.pending.lock().unwrap();
    let total: usize = p.values().sum();
    let mine = p.get(&ip).copied().unwrap_or(0);
    if total >= sh.limits.max_pending {
        return Err(format!(
            "{total} unauthenticated connections already pending (limit {})",
            sh.limits.max_pending
        ));
    }
    if mine >= sh.limits.max_pending_per_ip {
        return Err(format!(
            "{mine} unauthenticated connections from {ip} already pending (limit {})",
            sh.limits.max_pending_per_ip
        ));
    }
    *p.entry(ip).or_insert(0) += 1;
    Ok(PendingSlot { sh, ip })
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    for conn in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else {
            // Out of descriptors, most likely: do not spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        // Count the slot here, before any thread exists for it.
        match take_slot(&sh, peer.ip()) {
            Ok(slot) => std::mem::forget(slot),
            Err(why) => {
                sh.log
                    .log(format_args!("refused a connection from {peer}: {why}"));
                continue; // dropping the stream closes it
            }
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("phalanx-store-conn".into())
            .spawn(move || {
                let slot = PendingSlot {
                    sh: &sh2,
                    ip: peer.ip(),
                };
                if let Err(e) = serve(stream, &sh2, Some(slot)) {
                    if !sh2.stop.load(Ordering::SeqCst) {
                        sh2.log
                            .log(format_args!("dropped connection from {peer}: {e}"));
                    }
                }
            });
        if spawned.is_err() {
            drop(PendingSlot {
                sh: &sh,
                ip: peer.ip(),
            });
            sh.log.log(format_args!(
                "refused a connection from {peer}: cannot start a thread"
            ));
        }
    }
}

fn serve(mut s: TcpStream, sh: &Shared, slot: Option<PendingSlot<'_>>) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(sh.limits.handshake_timeout))?;
    let deadline = Instant::now() + sh.limits.handshake_timeout;
    wire::handshake_until(&mut s, &sh.secret, true, deadline)?;
    drop(slot);
    s.set_read_timeout(None)?;
    // A client that stops reading its replies must not hold a thread.
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    loop {
        let frame = match wire::read_frame(&mut s, MAX_FRAME) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(CommError::Protocol(e.to_string())),
        };
        if sh.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reply = handle(&frame, sh)?;
        wire::write_frame(&mut s, &reply)?;
    }
}

/// Why `key` (with a value of `value` bytes, replacing one of `old` bytes if
/// the key exists) may not be stored, if it may not.
fn refuse_store(sh: &Shared, st: &State, key: &str, value: usize) -> Option<String> {
    let l = &sh.limits;
    if let Some(e) = refuse_key(sh, key) {
        return Some(e);
    }
    if value > l.max_value {
        return Some(format!(
            "value of {value} bytes for store key {key:?} exceeds the limit of {} bytes",
            l.max_value
        ));
    }
    let old = st.map.get(key).map_or(0, |v| key.len() + v.len());
    let new = st.bytes - old + key.len() + value;
    (new > l.max_total).then(|| {
        format!(
            "storing key {key:?} ({value} bytes) would bring the store to {new} bytes, over its total limit of {} bytes",
            l.max_total
        )
    })
}

fn refuse_key(sh: &Shared, key: &str) -> Option<String> {
    (key.len() > sh.limits.max_key).then(|| {
        format!(
            "store key of {} bytes (starting {:?}) exceeds the limit of {} bytes",
            key.len(),
            key.chars().take(32).collect::<String>(),
            sh.limits.max_key
        )
    })
}

/// Insert under the limits already checked, keeping the byte count.
fn insert(st: &mut State, key: String, value: Vec<u8>) {
    let add = key.len() + value.len();
    if let Some(old) = st.map.insert(key.clone(), value) {
        st.bytes -= key.len() + old.len();
    }
    st.bytes += add;
}

fn handle(frame: &[u8], sh: &Shared) -> Result<Vec<u8>> {
    let mut r = Reader::new(frame);
    let op = r.u8()?;
    let w = Writer::default();
    let reply = match op {
        OP_SET => {
            let k = r.string()?;
            let v = r.bytes()?.to_vec();
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            if let Some(e) = refuse_store(sh, &st, &k, v.len()) {
                return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
            }
            insert(&mut st, k, v);
            drop(st);
            sh.changed.notify_all();
            w.u8(R_OK)
        }
        OP_GET => {
            let k = r.string()?;
            r.finish()?;
            if let Some(e) = refuse_key(sh, &k) {
                return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
            }
            match sh.state.lock().unwrap().map.get(&k) {
                Some(v) => w.u8(R_OK).bytes(v),
                None => w.u8(R_NOT_FOUND),
            }
        }
        OP_WAIT => {
            let n = r.u64()? as usize;
            if n > 1 << 16 {
                return Err(CommError::Protocol(format!("wait for {n} keys")));
            }
            let keys: Vec<String> = (0..n).map(|_| r.string()).collect::<Result<_>>()?;
            let timeout = Duration::from_millis(r.u64()?);
            r.finish()?;
            if let Some(e) = keys.iter().find_map(|k| refuse_key(sh, k)) {
                return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
            }
            let deadline = Instant::now() + timeout;
            let mut st = sh.state.lock().unwrap();
            loop {
                let missing: Vec<&String> =
                    keys.iter().filter(|k| !st.map.contains_key(*k)).collect();
                if missing.is_empty() {
                    break w.u8(R_OK);
                }
                let now = Instant::now();
                if now >= deadline || sh.stop.load(Ordering::SeqCst) {
                    let names: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
                    break w.u8(R_TIMEOUT).bytes(names.join(", ").as_bytes());
                }
                st = sh.changed.wait_timeout(st, deadline - now).unwrap().0;
            }
        }
        OP_ADD => {
            let k = r.string()?;
            let delta = r.i64()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let cur = match st.map.get(&k) {
                Some(v) => match std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    Some(n) => n,
                    None => {
                        return Ok(w
                            .u8(R_ERROR)
                            .bytes(format!("key {k} is not a counter").as_bytes())
                            .buf)
                    }
                },
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            let v = new.to_string().into_bytes();
            if let Some(e) = refuse_store(sh, &st, &k, v.len()) {
                return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
            }
            insert(&mut st, k, v);
            drop(st);
            sh.changed.notify_all();
            w.u8(R_OK).i64(new)
        }
        OP_CAS => {
            // Set to `desired` if the current value equals `expected` (a
            // missing key matches an empty `expected`); reply the value after.
            let k = r.string()?;
            let expected = r.bytes()?;
            let desired = r.bytes()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let matches = match st.map.get(&k) {
                Some(cur) => cur.as_slice() == expected,
                None => expected.is_empty(),
            };
            if matches {
                if let Some(e) = refuse_store(sh, &st, &k, desired.len()) {
                    return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
                }
                insert(&mut st, k.clone(), desired.to_vec());
            }
            let now = st.map.get(&k).cloned().unwrap_or_default();
            drop(st);
            sh.changed.notify_all();
            w.u8(R_OK).bytes(&now)
        }
        OP_DELETE => {
            let k = r.string()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let old = st.map.remove(&k);
            if let Some(v) = &old {
                st.bytes -= k.len() + v.len();
            }
            let existed = old.is_some();
            w.u8(R_OK).u8(existed as u8)
        }
        OP_NUM_KEYS => {
            r.finish()?;
            let n = sh.state.lock().unwrap().map.len();
            w.u8(R_OK).u64(n as u64)
        }
        other => return Err(CommError::Protocol(format!("unknown store opcode {other}"))),
    };
    Ok(reply.buf)
}
