//! Building the mesh through the store, and the per-connection threads.

use super::stream::local;
use super::*;
use crate::config::{Config, TransportPref};
use crate::ratelog::RateLimitedLog;
use crate::store::StoreClient;
use crate::wire;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Weak};

/// Socket buffer size asked for on every connection (SO_SNDBUF/SO_RCVBUF):
/// larger buffers let a whole pipeline chunk sit in flight. Measured for
/// Unix sockets too: 256 KiB, 1 MiB, the kernel default and 4 MiB were
/// within noise of each other for 1-64 MB all-reduces here.
const SOCKET_BUFFER: usize = 4 << 20;

/// Connect this rank to every other rank of a `world`-sized job.
///
/// Each rank listens on an ephemeral TCP port of the interface it uses to
/// reach the store and publishes "ip:port" under `{prefix}/addr/{rank}`.
/// Unless `PHALANX_TRANSPORT=tcp`, it also listens on a Unix socket with a
/// random abstract name and publishes "host identity\nname" under
/// `{prefix}/local/{rank}` (before the address, so a reader of the address
/// sees both). Rank i dials every lower rank, over the Unix socket when both
/// share a host identity (falling back to TCP if that fails), over TCP
/// otherwise, and accepts every higher one on either listener; both sides run
/// the secret handshake, then the dialer says who it is. Ranks that disagree
/// on the world size, or two processes that claim one rank, are errors.
pub fn connect_mesh(
    store: &StoreClient,
    prefix: &str,
    rank: usize,
    world: usize,
    secret: &[u8],
    cfg: &Config,
) -> Result<Arc<Transport>> {
    let (timeout, heartbeat_timeout) = (cfg.timeout, cfg.heartbeat_timeout);
    if rank >= world {
        return Err(CommError::Invalid(format!(
            "rank {rank} is out of range for world size {world}"
        )));
    }
    let ws = world.to_string();
    let agreed = store.compare_set(&format!("{prefix}/world_size"), b"", ws.as_bytes())?;
    if agreed != ws.as_bytes() {
        return Err(publish(
            store,
            prefix,
            CommError::Invalid(format!(
                "ranks disagree on the world size: rank {rank} has {world}, another rank registered {}",
                String::from_utf8_lossy(&agreed)
            )),
        ));
    }
    if store.add(&format!("{prefix}/claim/{rank}"), 1)? > 1 {
        return Err(publish(
            store,
            prefix,
            CommError::Invalid(format!("two processes claim rank {rank}")),
        ));
    }
    let deadline = Instant::now() + timeout;

    let ip = match store.local_ip()? {
        ip if ip.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        ip => ip,
    };
    let listener = TcpListener::bind((ip, 0))?;
    let me = listener.local_addr()?.to_string();
    // Same-host peers: a Unix listener, unless TCP is forced or there is no
    // way to tell which peers share this host.
    let mut local_id = None;
    let mut unix_listener = None;
    if cfg.transport == TransportPref::Auto && world > 1 {
        if let Some(id) = local::host_identity() {
            match local::listen(rank) {
                Ok((l, name)) => {
                    store.set(
                        &format!("{prefix}/local/{rank}"),
                        format!("{id}\n{name}").as_bytes(),
                    )?;
                    local_id = Some(id);
                    unix_listener = Some(l);
                }
                Err(e) => eprintln!(
                    "[phalanx] rank {rank}: no Unix socket ({e}); using TCP to every rank"
                ),
            }
        }
    }
    store.set(&format!("{prefix}/addr/{rank}"), me.as_bytes())?;

    // Accept higher ranks on a thread while we dial the lower ones.
    let secret_acc = secret.to_vec();
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_acceptor = StopOnDrop(stop.clone());
    let stop_acc = stop.clone();
    let acceptor = std::thread::spawn(move || {
        accept_higher(
            listener,
            unix_listener,
            rank,
            world,
            &secret_acc,
            deadline,
            &stop_acc,
        )
    });

    let mut peers: Vec<Option<(Stream, String)>> = (0..world).map(|_| None).collect();
    #[allow(clippy::needless_range_loop)] // j is a rank, not just an index
    for j in 0..rank {
        let key = format!("{prefix}/addr/{j}");
        wait_key(store, prefix, &key, deadline).map_err(|e| {
            e.unwrap_or_else(|| {
                CommError::Timeout(format!(
                    "rank {j} never published its address (world size {world})"
                ))
            })
        })?;
        let host = String::from_utf8_lossy(&store.try_get(&key)?.unwrap_or_default()).to_string();
        let mut s = None;
        if let Some(id) = &local_id {
            let theirs = store.try_get(&format!("{prefix}/local/{j}"))?;
            let theirs = String::from_utf8_lossy(theirs.as_deref().unwrap_or_default());
            if let Some((their_id, name)) = theirs.split_once('\n') {
                if their_id == id {
                    match local::dial(name) {
                        Ok(u) => s = Some(Stream::Unix(u)),
                        Err(e) => eprintln!(
                            "[phalanx] rank {rank}: Unix socket to rank {j} ({host}) failed ({e}); using TCP"
                        ),
                    }
                }
            }
        }
        let mut s = match s {
            Some(s) => s,
            None => Stream::Tcp(dial(&host, deadline).map_err(|e| CommError::PeerDead {
                rank: j,
                host: host.clone(),
                reason: format!("cannot connect: {e}"),
            })?),
        };
        wire::handshake_until(&mut s, secret, false, deadline).map_err(|e| {
            CommError::PeerDead {
                rank: j,
                host: host.clone(),
                reason: format!("handshake failed: {e}"),
            }
        })?;
        let mut hello = [0u8; 16];
        hello[..8].copy_from_slice(&(rank as u64).to_le_bytes());
        hello[8..].copy_from_slice(&(world as u64).to_le_bytes());
        s.write_all(&hello)?;
        peers[j] = Some((s, host));
    }
    // Wait for the higher ranks, giving up at once if one of them failed
    // to start (it will never connect).
    let err_key = format!("{prefix}/error");
    while !acceptor.is_finished() {
        match store.wait(&[&err_key], Duration::from_millis(20)) {
            Ok(()) => {
                let e = store.try_get(&err_key)?.unwrap_or_default();
                return Err(CommError::Invalid(format!(
                    "another rank failed to start: {}",
                    String::from_utf8_lossy(&e)
                )));
            }
            Err(CommError::Timeout(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let accepted = acceptor
        .join()
        .map_err(|_| CommError::Io("acceptor thread panicked".into()))??;
    for (j, s, _from) in accepted {
        // Name the peer by its listening address, as every other rank does.
        let host = store
            .try_get(&format!("{prefix}/addr/{j}"))?
            .unwrap_or_default();
        peers[j] = Some((s, String::from_utf8_lossy(&host).to_string()));
    }

    let mut conns = Vec::with_capacity(world);
    let mut readers = Vec::new();
    for (j, p) in peers.into_iter().enumerate() {
        match p {
            None => conns.push(None),
            Some((s, host)) => {
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(Duration::from_secs(1)))?;
                s.set_read_timeout(Some(heartbeat_timeout))?;
                s.set_buffers(SOCKET_BUFFER);
                readers.push((j, s.try_clone()?, host.clone()));
                conns.push(Some(Peer {
                    host,
                    link: s.link(),
                    writer: Mutex::new(s),
                    bucket: Mutex::new(super::Bucket::full()),
                }));
            }
        }
    }
    let mut t = Transport::new(rank, world, conns);
    t.netem = cfg.net_emulate;
    let t = Arc::new(t);
    super::register(&t);
    for (j, s, host) in readers {
        let w = Arc::downgrade(&t);
        std::thread::Builder::new()
            .name(format!("phalanx-rx-{j}"))
            .spawn(move || reader_loop(w, s, j, host, heartbeat_timeout))?;
    }
    if world > 1 {
        let w = Arc::downgrade(&t);
        let every = heartbeat_timeout / 5;
        std::thread::Builder::new()
            .name("phalanx-heartbeat".into())
            .spawn(move || heartbeat_loop(w, every))?;
    }
    Ok(t)
}

/// Record a set-up error where every rank looks, so that ranks waiting for
/// this one report the cause instead of a timeout.
fn publish(store: &StoreClient, prefix: &str, e: CommError) -> CommError {
    let _ = store.set(&format!("{prefix}/error"), e.to_string().as_bytes());
    e
}

/// Wait for `key`, giving up early if another rank published an error.
/// `Err(None)` means the deadline passed.
fn wait_key(
    store: &StoreClient,
    prefix: &str,
    key: &str,
    deadline: Instant,
) -> std::result::Result<(), Option<CommError>> {
    let err_key = format!("{prefix}/error");
    loop {
        if let Ok(Some(e)) = store.try_get(&err_key) {
            return Err(Some(CommError::Invalid(format!(
                "another rank failed to start: {}",
                String::from_utf8_lossy(&e)
            ))));
        }
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(200));
        match store.wait(&[key], slice) {
            Ok(()) => return Ok(()),
            Err(CommError::Timeout(_)) if Instant::now() < deadline => {}
            Err(CommError::Timeout(_)) => return Err(None),
            Err(e) => return Err(Some(e)),
        }
    }
}

fn dial(host: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let addr: std::net::SocketAddr = host.parse().map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad address {host}"),
        )
    })?;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Sets the flag when dropped: stops the acceptor thread when set-up
/// returns early.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Most connections in their handshake at once on one rank's listeners.
const MAX_PENDING: usize = 64;
/// Each connection must finish the handshake and hello within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a handshake thread found on one accepted connection.
enum Admitted {
    /// A peer with the secret that says it is rank `j` of `world`.
    Rank {
        j: usize,
        world: usize,
        s: Stream,
        addr: String,
    },
    Refused {
        addr: String,
        why: CommError,
    },
}

/// Handshake and hello on one accepted connection, within `until`.
fn admit(mut s: Stream, addr: String, secret: &[u8], until: Instant) -> Admitted {
    let res = (|| -> Result<(usize, usize)> {
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        wire::handshake_until(&mut s, secret, true, until)?;
        let mut hello = [0u8; 16];
        wire::read_exact_until(&mut s, &mut hello, until, "hello")?;
        let j = u64::from_le_bytes(hello[..8].try_into().unwrap()) as usize;
        let world = u64::from_le_bytes(hello[8..].try_into().unwrap()) as usize;
        Ok((j, world))
    })();
    match res {
        Ok((j, world)) => Admitted::Rank { j, world, s, addr },
        Err(why) => Admitted::Refused { addr, why },
    }
}

/// Accept the higher ranks. Every connection is handshaken on its own
/// thread with its own deadline, so strangers (port scanners, idle or slow
/// clients, wrong secrets) neither delay the real ranks nor get counted as
/// them; at most `MAX_PENDING` are in flight, and those still pending when
/// set-up ends are shut down.
fn accept_higher(
    listener: TcpListener,
    unix: Option<UnixListener>,
    rank: usize,
    world: usize,
    secret: &[u8],
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(usize, Stream, String)>> {
    listener.set_nonblocking(true)?;
    if let Some(u) = &unix {
        u.set_nonblocking(true)?;
    }
    let log = RateLimitedLog::new(
        format!("[phalanx] rank {rank}:"),
        5,
        Duration::from_secs(10),
    );
    let secret: Arc<[u8]> = secret.into();
    let (tx, rx) = std::sync::mpsc::channel::<(u64, Admitted)>();
    // Connections in their handshake, to shut down if set-up ends first.
    let mut pending: std::collections::HashMap<u64, Stream> = Default::default();
    let mut next_id = 0u64;
    let result = (|| {
        let mut got: Vec<(usize, Stream, String)> = Vec::new();
        let expected = world - rank - 1;
        while got.len() < expected {
            // Take every connection waiting on either listener.
            loop {
                let next = match listener.accept() {
                    Ok((s, addr)) => Ok((Stream::Tcp(s), addr.to_string())),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => match &unix {
                        Some(u) => u
                            .accept()
                            .map(|(s, _)| (Stream::Unix(s), "a local Unix socket".to_string())),
                        None => Err(e),
                    },
                    Err(e) => Err(e),
                };
                let (s, addr) = match next {
                    Ok(x) => x,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
                    Err(e) => return Err(e.into()),
                };
                if pending.len() >= MAX_PENDING {
                    log.log(format_args!(
                        "refused a connection from {addr}: {MAX_PENDING} handshakes already pending"
                    ));
                    continue;
                }
                let id = next_id;
                next_id += 1;
                if let Ok(c) = s.try_clone() {
                    pending.insert(id, c);
                }
                let until = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
                let (tx, secret) = (tx.clone(), secret.clone());
                let spawned = std::thread::Builder::new()
                    .name("phalanx-handshake".into())
                    .spawn(move || {
                        let _ = tx.send((id, admit(s, addr, &secret, until)));
                    });
                if let Err(e) = spawned {
                    pending.remove(&id);
                    log.log(format_args!("cannot start a handshake thread: {e}"));
                }
            }
            // Collect finished handshakes, waiting a little for one.
            let mut wait = Duration::from_millis(5);
            while let Ok((id, a)) = rx.recv_timeout(wait) {
                wait = Duration::ZERO;
                pending.remove(&id);
                match a {
                    Admitted::Refused { addr, why } => {
                        log.log(format_args!("refused a connection from {addr}: {why}"))
                    }
                    Admitted::Rank {
                        j,
                        world: their_world,
                        s,
                        addr,
                    } => {
                        if their_world != world {
                            return Err(CommError::Invalid(format!(
                                "ranks disagree on the world size: rank {j} has {their_world}, rank {rank} has {world}"
                            )));
                        }
                        if j <= rank || j >= world || got.iter().any(|g| g.0 == j) {
                            log.log(format_args!(
                                "unexpected hello from rank {j} at {addr}; dropped"
                            ));
                            continue;
                        }
                        got.push((j, s, addr));
                    }
                }
                if got.len() == expected {
                    break;
                }
            }
            if got.len() == expected {
                break;
            }
            if stop.load(Ordering::SeqCst) {
                return Err(CommError::Aborted("set-up abandoned".into()));
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (rank + 1..world)
                    .filter(|j| !got.iter().any(|g| g.0 == *j))
                    .collect();
                return Err(CommError::Timeout(format!(
                    "rank {rank}: ranks {missing:?} never connected (world size {world})"
                )));
            }
        }
        Ok(got)
    })();
    // Strangers still in their handshake: end them now.
    for s in pending.values() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    result
}

fn reader_loop(t: Weak<Transport>, mut s: Stream, peer: usize, host: String, hb: Duration) {
    let err = loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = s.read_exact(&mut h) {
            break describe_read_error(e, hb);
        }
        let kind = h[0];
        let chan = u64::from_le_bytes(h[8..16].try_into().unwrap());
        let seq = u64::from_le_bytes(h[16..24].try_into().unwrap());
        let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
        if len > MAX_DATA_FRAME {
            break format!("sent a frame of {len} bytes (limit {MAX_DATA_FRAME})");
        }
        let Some(tr) = t.upgrade() else { return };
        match kind {
            K_DATA => {
                let key = (peer, chan, seq);
                let mut ib = tr.inbox.lock().unwrap();
                let direct = if ib.queues.get(&key).is_none_or(|q| q.is_empty()) {
                    match ib.posted.get_mut(&key) {
                        Some(q) if q.front().is_some_and(|p| p.len == len) => {
                            let p = q.pop_front();
                            if q.is_empty() {
                                ib.posted.remove(&key);
                            }
                            p
                        }
                        _ => None,
                    }
                } else {
                    None
                };
                if let Some(p) = direct {
                    ib.slots.insert(p.id, Slot::Filling);
                    drop(ib);
                    // SAFETY: whoever posted the region keeps it valid and
                    // untouched while its slot is Filling (`Posts` waits).
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.ptr as *mut u8, p.len) };
                    let res = read_fully(&mut s, dst);
                    let state = if res.is_ok() {
                        Slot::Done
                    } else {
                        Slot::Failed
                    };
                    tr.inbox.lock().unwrap().slots.insert(p.id, state);
                    tr.arrived.notify_all();
                    match res {
                        Ok(()) => continue,
                        Err(e) => break describe_read_error(e, hb),
                    }
                }
                drop(ib);
                let mut words = tr.take_buf(len.div_ceil(8));
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                if let Err(e) = read_fully(&mut s, &mut bytes[..len]) {
                    break describe_read_error(e, hb);
                }
                let mut ib = tr.inbox.lock().unwrap();
                ib.queues
                    .entry((peer, chan, seq))
                    .or_default()
                    .push_back(Msg { words, len });
                drop(ib);
                tr.arrived.notify_all();
            }
            K_HEARTBEAT => {}
            K_ABORT => {
                let mut reason = vec![0u8; len.min(1 << 16)];
                let _ = s.read_exact(&mut reason);
                tr.fail(CommError::Aborted(format!(
                    "rank {peer} ({host}) aborted: {}",
                    String::from_utf8_lossy(&reason)
                )));
                return;
            }
            K_GOODBYE => {
                // A goodbye after an error carries that error: pass it on,
                // so the rank that really failed is named everywhere.
                let mut why = vec![0u8; len.min(1 << 16)];
                let _ = s.read_exact(&mut why);
                if why.is_empty() {
                    tr.inbox.lock().unwrap().closed.insert(peer, ());
                    tr.arrived.notify_all();
                } else {
                    tr.fail(CommError::Aborted(format!(
                        "rank {peer} ({host}) stopped after an error: {}",
                        String::from_utf8_lossy(&why)
                    )));
                }
                return;
            }
            other => break format!("sent an unknown frame kind {other}"),
        }
    };
    if let Some(tr) = t.upgrade() {
        if tr.closing.load(Ordering::SeqCst) || tr.inbox.lock().unwrap().closed.contains_key(&peer)
        {
            return;
        }
        tr.fail(CommError::PeerDead {
            rank: peer,
            host,
            reason: err,
        });
    }
}

/// read_exact that tolerates read timeouts in the middle of a payload as
/// long as bytes keep coming (the timeout is for a silent peer).
fn read_fully(s: &mut Stream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn describe_read_error(e: std::io::Error, hb: Duration) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "connection closed (process exited or crashed)".into(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!(
                "no heartbeat for {:.1} s (host down or process stopped)",
                hb.as_secs_f64()
            )
        }
        _ => format!("connection error: {e}"),
    }
}

fn heartbeat_loop(t: Weak<Transport>, every: Duration) {
    let h = header(K_HEARTBEAT, 0, 0, 0);
    loop {
        std::thread::sleep(every);
        let Some(tr) = t.upgrade() else { return };
        if tr.closing.load(Ordering::SeqCst) || tr.failed_flag.load(Ordering::Acquire) {
            return;
        }
        for p in tr.peers.iter().flatten() {
            // A busy writer is already sending bytes, which is as good.
            if let Ok(mut w) = p.writer.try_lock() {
                let _ = tr.write_all(&mut w, &h, Instant::now() + every);
            }
        }
    }
}
