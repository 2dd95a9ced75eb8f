//! The store's server: one thread per connection, one map.
//!
//! Before a client has proved it holds the job secret it costs little and
//! cannot linger: at most `max_pending` connections (and
//! `max_pending_per_ip` from one address) are in their handshake at once,
//! each on its own thread; each handshake must finish within
//! `handshake_timeout` in total. A new connection over a cap does not wait
//! and is not refused: it sheds the *oldest* pending one (of its address
//! for the per-address cap, of the address holding the most for the total
//! one). A real rank answers its handshake within a round trip, so the
//! connections that are old when a rank arrives are strangers sitting
//! idle: a flood of them held open (which used to fill the slots for the
//! whole handshake deadline, so that the real ranks, refused and retrying,
//! started 12–26 s late) costs the ranks nothing. A connection stops
//! counting the moment it has authenticated. Sheds are logged at a bounded
//! rate.
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
    /// Handshakes in progress.
    pending: Mutex<Pending>,
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
            pending: Mutex::new(Pending::default()),
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

/// Connections in their handshake, oldest first (ids grow), each with a
/// handle to shed it by.
#[derive(Default)]
struct Pending {
    next: u64,
    conns: std::collections::BTreeMap<u64, (IpAddr, TcpStream)>,
}

impl Pending {
    fn count(&self, ip: IpAddr) -> usize {
        self.conns.values().filter(|(a, _)| *a == ip).count()
    }

    /// Close the oldest pending connection from `ip`; returns its id.
    fn shed_oldest_of(&mut self, ip: IpAddr) -> Option<u64> {
        let id = *self.conns.iter().find(|(_, (a, _))| *a == ip)?.0;
        let (_, s) = self.conns.remove(&id)?;
        // Its thread's next read fails and it returns; its slot is gone
        // already, so it frees nothing twice.
        let _ = s.shutdown(std::net::Shutdown::Both);
        Some(id)
    }

    /// The address holding the most pending connections (a flood's).
    fn busiest(&self) -> Option<IpAddr> {
        let mut n: HashMap<IpAddr, usize> = HashMap::new();
        for (ip, _) in self.conns.values() {
            *n.entry(*ip).or_insert(0) += 1;
        }
        n.into_iter().max_by_key(|(_, c)| *c).map(|(ip, _)| ip)
    }
}

/// Holds one handshake slot; gives it back when dropped (unless it was
/// shed, which gave it back already).
struct PendingSlot<'a> {
    sh: &'a Shared,
    id: u64,
}

impl Drop for PendingSlot<'_> {
    fn drop(&mut self) {
        self.sh.pending.lock().unwrap().conns.remove(&self.id);
    }
}

/// Take a handshake slot for a new connection from `ip`, shedding the
/// oldest pending ones over the caps (see the module docs). Err: `s`
/// cannot be tracked (no descriptor for a handle).
fn take_slot(sh: &Shared, ip: IpAddr, s: &TcpStream) -> std::io::Result<u64> {
    let handle = s.try_clone()?;
    let l = &sh.limits;
    let mut p = sh.pending.lock().unwrap();
    while p.count(ip) >= l.max_pending_per_ip.max(1) {
        p.shed_oldest_of(ip);
        sh.log.log(format_args!(
            "shed the oldest unauthenticated connection from {ip} ({} pending from it at most)",
            l.max_pending_per_ip
        ));
    }
    while p.conns.len() >= l.max_pending.max(1) {
        let Some(busy) = p.busiest() else { break };
        p.shed_oldest_of(busy);
        sh.log.log(format_args!(
            "shed the oldest unauthenticated connection from {busy} ({} pending at most)",
            l.max_pending
        ));
    }
    let id = p.next;
    p.next += 1;
    p.conns.insert(id, (ip, handle));
    Ok(id)
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
        let id = match take_slot(&sh, peer.ip(), &stream) {
            Ok(id) => id,
            Err(e) => {
                sh.log
                    .log(format_args!("refused a connection from {peer}: {e}"));
                continue; // dropping the stream closes it
            }
        };
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("phalanx-store-conn".into())
            .spawn(move || {
                let slot = PendingSlot { sh: &sh2, id };
                if let Err(e) = serve(stream, &sh2, Some(slot)) {
                    if !sh2.stop.load(Ordering::SeqCst) {
                        sh2.log
                            .log(format_args!("dropped connection from {peer}: {e}"));
                    }
                }
            });
        if spawned.is_err() {
            drop(PendingSlot { sh: &sh, id });
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
    // Authenticated: no longer counted against any cap. A connection shed
    // while it finished its handshake is not served (its socket is shut).
    if let Some(slot) = slot {
        if sh.pending.lock().unwrap().conns.remove(&slot.id).is_none() {
            return Err(CommError::Io("shed during its handshake".into()));
        }
        drop(slot); // removes nothing more
    }
    // A client that stops reading its replies must not hold a thread.
    s.set_write_timeout(Some(FRAME_TIMEOUT))?;
    // Nor one whose host vanished: ranks stay connected, idle, for the
    // whole job, so idleness alone cannot end a connection, but the
    // kernel's keepalive probes find a peer that is gone.
    keepalive(&s);
    loop {
        // Between frames, wake every `STOP_POLL` to see whether the server
        // was dropped; a frame once begun must arrive within FRAME_TIMEOUT.
        s.set_read_timeout(Some(STOP_POLL))?;
        match s.peek(&mut [0u8; 1]) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            // EINTR: the server was stopped and continued (Ctrl-Z, a
            // debugger, SIGSTOP); the connection is fine.
            Err(e) if is_timeout(&e) || e.kind() == std::io::ErrorKind::Interrupted => {
                if sh.stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(CommError::Io(e.to_string())),
        }
        if sh.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let frame = read_frame_until(&mut s, Instant::now() + FRAME_TIMEOUT)?;
        let reply = handle(&frame, sh, &s)?;
        wire::write_frame(&mut s, &reply)?;
    }
}

/// How often an idle connection's thread looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(200);
/// The most a request, once begun, or a reply may take on the wire.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Whether the client at the other end of `s` has closed its connection
/// (or it failed). Does not block; bytes waiting to be read (a client that
/// sent its next request early) count as the client still being there.
fn client_gone(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let gone = match s.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !is_timeout(&e) && e.kind() != std::io::ErrorKind::Interrupted,
    };
    s.set_nonblocking(false).is_err() || gone
}

/// One request frame, whole by `deadline`, refusing one over `MAX_FRAME`
/// before allocating.
fn read_frame_until(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    wire::read_exact_until(s, &mut len, deadline, "store request")?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(CommError::Protocol(format!(
            "frame of {len} bytes exceeds the limit of {MAX_FRAME}"
        )));
    }
    let mut buf = vec![0u8; len];
    wire::read_exact_until(s, &mut buf, deadline, "store request")?;
    Ok(buf)
}

/// TCP keepalive on `s`: probes after 30 s of silence, every 10 s, and the
/// connection fails (its blocked read returns an error) after 3 unanswered,
/// so a client whose host vanished frees its thread within about a minute.
/// Best effort: a socket that refuses is served without it.
fn keepalive(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, v: libc::c_int| {
        // SAFETY: `fd` is an open socket for the duration of the call and
        // the option value is a c_int of the size given.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    #[cfg(target_os = "linux")]
    {
        set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30);
        set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10);
        set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
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

/// Serve one request from the client at the other end of `conn` (which a
/// long `wait` watches, to end when its client goes).
fn handle(frame: &[u8], sh: &Shared, conn: &TcpStream) -> Result<Vec<u8>> {
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
            let timeout = Duration::from_millis(r.u64()?)
                .min(crate::config::wait_secs(crate::config::MAX_WAIT_SECS));
            r.finish()?;
            if let Some(e) = keys.iter().find_map(|k| refuse_key(sh, k)) {
                return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
            }
            let deadline = Instant::now() + timeout;
            let mut checked = Instant::now();
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
                // Every `STOP_POLL`, see whether the client is still there:
                // one that crashed while it waited must not hold this
                // thread until its keys appear or its timeout (which may be
                // days) passes.
                if now.duration_since(checked) >= STOP_POLL {
                    if client_gone(conn) {
                        return Err(CommError::Io(format!(
                            "the client went away while waiting for store keys {}",
                            missing
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                    checked = now;
                }
                let nap = (deadline - now).min(STOP_POLL);
                st = sh.changed.wait_timeout(st, nap).unwrap().0;
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
            // missing key matches an empty `expected`); reply the value
            // after. A missing key with a non-empty `expected` stays
            // missing and the reply is `expected`, as PyTorch's TCPStore
            // answers, so code written against either store reads the same.
            let k = r.string()?;
            let expected = r.bytes()?;
            let desired = r.bytes()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let matches = match st.map.get(&k) {
                Some(cur) => cur.as_slice() == expected,
                None if expected.is_empty() => true,
                None => return Ok(w.u8(R_OK).bytes(expected).buf),
            };
            if matches {
                if let Some(e) = refuse_store(sh, &st, &k, desired.len()) {
                    return Ok(w.u8(R_ERROR).bytes(e.as_bytes()).buf);
                }
                insert(&mut st, k.clone(), desired.to_vec());
            }
            let now = st.map.get(&k).cloned().unwrap_or_default();
            drop(st);
            if matches {
                sh.changed.notify_all();
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::mpsc;

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            secret: Vec::new(),
            stop: AtomicBool::new(false),
            limits: StoreLimits::default(),
            pending: Mutex::new(Pending::default()),
            log: RateLimitedLog::new("[phalanx store test]", 5, Duration::from_secs(10)),
        })
    }

    /// A connected pair: (the client's end, the server's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn wait_frame(key: &str, timeout: Duration) -> Vec<u8> {
        Writer::default()
            .u8(OP_WAIT)
            .u64(1)
            .bytes(key.as_bytes())
            .u64(timeout.as_millis() as u64)
            .buf
    }

    /// A wait whose client disconnects ends soon after, not when its keys
    /// appear or its (here one hour) timeout passes.
    #[test]
    fn a_wait_ends_when_its_client_goes() {
        let sh = shared();
        let (client, server_end) = pair();
        let (tx, rx) = mpsc::channel();
        let sh2 = sh.clone();
        std::thread::spawn(move || {
            let frame = wait_frame("never", Duration::from_secs(3600));
            let _ = tx.send(handle(&frame, &sh2, &server_end));
        });
        drop(client);
        // 30 s: a hang guard; it ends within a `STOP_POLL` or two.
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a store wait kept its thread after its client went away");
        let e = r.unwrap_err();
        assert!(e.to_string().contains("never"), "{e}");
    }

    /// A client still connected is not taken for gone: its wait runs to
    /// its own timeout and answers it.
    #[test]
    fn a_wait_with_its_client_runs_to_its_timeout() {
        let sh = shared();
        let (_client, server_end) = pair();
        let frame = wait_frame("absent", 3 * STOP_POLL);
        let reply = handle(&frame, &sh, &server_end).unwrap();
        assert_eq!(reply[0], R_TIMEOUT, "{reply:?}");
        assert!(!client_gone(&server_end));
    }
}
