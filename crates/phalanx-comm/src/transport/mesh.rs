//! Building the mesh through the store.

use super::reader::{heartbeat_loop, reader_loop, Role};
use super::stream::local;
use super::*;
use crate::config::{Config, TransportPref};
use crate::ratelog::RateLimitedLog;
use crate::store::StoreClient;
use crate::wire;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::sync::Arc;

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
/// sees both). Both records are signed with the job secret
/// (`wire::sign_record`) and a peer uses only records that verify (see
/// `read_signed`): the store may be one anyone can write. Rank i dials every
/// lower rank, over the Unix socket when both share a host identity (falling
/// back to TCP if that fails), over TCP otherwise, and accepts every higher
/// one on either listener; the dialer says who it is, then both sides run
/// the secret handshake bound to the group and both ranks. Ranks that
/// disagree on the world size, or two processes that claim one rank, are
/// errors.
///
/// Over every Unix socket the two ranks then offer each other a
/// shared-memory ring for their data (`super::shm_link`), unless
/// `PHALANX_TRANSPORT=uds` or network emulation is on.
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

    let ip = listen_ip(store.local_ip()?, cfg).map_err(|e| publish(store, prefix, e))?;
    let listener = TcpListener::bind((ip, 0))?;
    let me = listener.local_addr()?.to_string();
    // Same-host peers: a Unix listener, unless TCP is forced or there is no
    // way to tell which peers share this host.
    let mut local_id = None;
    let mut unix_listener = None;
    if cfg.transport != TransportPref::Tcp && world > 1 {
        let id = local::host_identity();
        if id.is_none() && cfg.transport == TransportPref::Shm {
            return Err(publish(
                store,
                prefix,
                CommError::Invalid(format!(
                    "PHALANX_TRANSPORT=shm: rank {rank} cannot tell which ranks share its host \
                     (/proc/sys/kernel/random/boot_id or /proc/self/ns/net unreadable)"
                )),
            ));
        }
        if let Some(id) = id {
            match local::listen(rank) {
                Ok((l, name)) => {
                    let value = format!("{id}\n{name}");
                    store.set(
                        &format!("{prefix}/local/{rank}"),
                        &wire::sign_record(secret, prefix, "local", rank, value.as_bytes()),
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
    store.set(
        &format!("{prefix}/addr/{rank}"),
        &wire::sign_record(secret, prefix, "addr", rank, me.as_bytes()),
    )?;

    // Accept higher ranks on a thread while we dial the lower ones.
    let secret_acc = secret.to_vec();
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_acceptor = StopOnDrop(stop.clone());
    let stop_acc = stop.clone();
    let me_acc = Arc::new(Me {
        prefix: prefix.to_string(),
        rank,
        world,
    });
    let acceptor = std::thread::spawn(move || {
        accept_higher(
            listener,
            unix_listener,
            me_acc,
            &secret_acc,
            deadline,
            &stop_acc,
        )
    });

    let mut peers: Vec<Option<(Stream, String)>> = (0..world).map(|_| None).collect();
    let mut waiting = crate::patience::Waiting::until(deadline);
    #[allow(clippy::needless_range_loop)] // j is a rank, not just an index
    for j in 0..rank {
        let key = format!("{prefix}/addr/{j}");
        let mut waited = || {
            waiting.tick(|| format!("rank {rank}: still waiting for rank {j} of {world} to start"))
        };
        wait_key(store, prefix, &key, deadline, &mut waited).map_err(|e| {
            e.unwrap_or_else(|| {
                CommError::Timeout(format!(
                    "rank {j} never published its address (world size {world})"
                ))
            })
        })?;
        let signed = |kind| read_signed(store, prefix, kind, rank, j, secret, deadline);
        let host = signed("addr")
            .map_err(|e| publish(store, prefix, e))?
            .map(|v| String::from_utf8_lossy(&v).to_string())
            .unwrap_or_default();
        // Rank j's Unix socket, where it shares this host.
        let mut unix = None;
        if let Some(id) = &local_id {
            let theirs = signed("local").map_err(|e| publish(store, prefix, e))?;
            let theirs = String::from_utf8_lossy(theirs.as_deref().unwrap_or_default());
            if let Some((their_id, name)) = theirs.split_once('\n') {
                if their_id == id {
                    unix = Some(name.to_string());
                }
            }
        }
        let lower = Lower {
            prefix,
            rank,
            world,
            j,
            host: &host,
            unix: unix.as_deref(),
        };
        let s = lower.join(secret, deadline)?;
        peers[j] = Some((s, host));
    }
    // Wait for the higher ranks, giving up at once if one of them failed
    // to start (it will never connect).
    let err_key = format!("{prefix}/error");
    while !acceptor.is_finished() {
        match store.wait(&[&err_key], Duration::from_millis(20)) {
            // (An error published just as the last link came is too late
            // for this rank: it has met every peer.)
            Ok(()) if acceptor.is_finished() => break,
            Ok(()) => {
                let e = store.try_get(&err_key)?.unwrap_or_default();
                return Err(peer_failed(&e));
            }
            Err(CommError::Timeout(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let accepted = acceptor
        .join()
        .map_err(|_| CommError::Io("acceptor thread panicked".into()))??;
    for (j, s, from) in accepted {
        // Name the peer by its listening address, as every other rank does
        // (by where it came from, should its record not verify).
        let host = store
            .try_get(&format!("{prefix}/addr/{j}"))?
            .and_then(|v| {
                wire::open_record(secret, prefix, "addr", j, &v)
                    .map(|v| String::from_utf8_lossy(v).to_string())
            })
            .unwrap_or(from);
        peers[j] = Some((s, host));
    }

    let offers = super::shm_link::exchange(&peers, rank, cfg, deadline)
        .map_err(|e| publish(store, prefix, e))?;
    let rings = offers.rings;
    let spin = super::shm::Spin::for_ranks(
        1 + rings.iter().filter(|r| r.is_some()).count(),
        cfg.shm_spin_us,
    );
    let mut conns = Vec::with_capacity(world);
    let mut readers = Vec::new();
    let mut ring_readers = Vec::new();
    for ((j, p), ring) in peers.into_iter().enumerate().zip(rings) {
        match p {
            None => conns.push(None),
            Some((s, host)) => {
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(Duration::from_secs(1)))?;
                s.set_read_timeout(Some(heartbeat_timeout))?;
                s.set_buffers(SOCKET_BUFFER);
                let role = if ring.is_some() {
                    Role::Control
                } else {
                    Role::All
                };
                readers.push((j, s.try_clone()?, host.clone(), role));
                let link = if ring.is_some() { Link::Shm } else { s.link() };
                let shm_rx = ring.as_ref().map(|r| r.1.clone());
                let shm = ring.map(|(tx, rx)| {
                    ring_readers.push((j, rx, host.clone()));
                    Mutex::new(super::shm::RingTx::new(tx, spin))
                });
                conns.push(Some(Peer {
                    host,
                    link,
                    writer: Mutex::new(s),
                    shm,
                    shm_rx,
                    bucket: Mutex::new(super::Bucket::full()),
                    torn: AtomicBool::new(false),
                }));
            }
        }
    }
    let mut t = Transport::new(rank, world, conns);
    t.netem = cfg.net_emulate;
    t.shm_world = offers.slots.map(|slots| {
        let spin = super::shm::Spin::for_world(slots.len(), cfg.shm_spin_us);
        super::shm_coll::ShmWorld::new(slots, spin)
    });
    let t = Arc::new(t);
    super::register(&t);
    for (j, s, host, role) in readers {
        let w = Arc::downgrade(&t);
        std::thread::Builder::new()
            .name(format!("phalanx-rx-{j}"))
            .spawn(move || reader_loop(w, s, j, host, heartbeat_timeout, role))?;
    }
    for (j, rx, host) in ring_readers {
        let w = Arc::downgrade(&t);
        let rx = super::shm_link::ring_reader(rx, spin, Arc::downgrade(&t));
        std::thread::Builder::new()
            .name(format!("phalanx-shm-{j}"))
            .spawn(move || reader_loop(w, rx, j, host, heartbeat_timeout, Role::Data))?;
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

/// The error another rank published under `{prefix}/error` (`publish`),
/// as this rank reports it: `Aborted`, since the set-up was given up
/// elsewhere (this rank's own arguments may be fine; the ft manager
/// retries it, and ends on an `Invalid` of its own).
fn peer_failed(published: &[u8]) -> CommError {
    CommError::Aborted(format!(
        "another rank failed to start: {}",
        String::from_utf8_lossy(published)
    ))
}

/// Wait for `key`, giving up early if another rank published an error.
/// `Err(None)` means the deadline passed.
fn wait_key(
    store: &StoreClient,
    prefix: &str,
    key: &str,
    deadline: Instant,
    mut waited: impl FnMut(),
) -> std::result::Result<(), Option<CommError>> {
    let err_key = format!("{prefix}/error");
    loop {
        waited();
        if let Ok(Some(e)) = store.try_get(&err_key) {
            return Err(Some(peer_failed(&e)));
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

/// Rank j's record `kind` (`addr` or `local`) under `prefix`, checked
/// against the job secret (see `wire::sign_record`); `None` if there is
/// none. Under torchrun's agent store anyone who reaches the store can
/// rewrite it, and dialling a rewritten address would let a relay there
/// pass the handshake through to the real rank and sit in the middle.
///
/// A record that does not verify is read again until `deadline`, then is
/// an `Auth` error naming the rank: rank j writes its records once, before
/// anyone reads them, but a stranger may have written the key first (or a
/// job with another secret left it), and rank j's own write then replaces
/// it. Failing at once would gain nothing against someone who can write
/// the store (they can stop the job in many ways); never dialling what did
/// not verify is what matters.
fn read_signed(
    store: &StoreClient,
    prefix: &str,
    kind: &str,
    rank: usize,
    j: usize,
    secret: &[u8],
    deadline: Instant,
) -> Result<Option<Vec<u8>>> {
    let key = format!("{prefix}/{kind}/{j}");
    let mut warned = false;
    loop {
        let Some(v) = store.try_get(&key)? else {
            return Ok(None);
        };
        if let Some(value) = wire::open_record(secret, prefix, kind, j, &v) {
            return Ok(Some(value.to_vec()));
        }
        let what = match kind {
            "addr" => "address",
            _ => "Unix socket name",
        };
        if Instant::now() >= deadline {
            return Err(CommError::Auth(format!(
                "rank {rank}: the {what} published for rank {j} ({key}) does not carry the job \
                 secret's signature, so it was not dialled: the store may have been tampered \
                 with (anyone who can reach an unauthenticated store such as torchrun's can \
                 rewrite it), or rank {j} runs with another PHALANX_SECRET"
            )));
        }
        if let Ok(Some(e)) = store.try_get(&format!("{prefix}/error")) {
            return Err(peer_failed(&e));
        }
        if !warned {
            warned = true;
            eprintln!(
                "[phalanx] rank {rank}: the {what} published for rank {j} ({key}) does not carry \
                 the job secret's signature; not dialling it, waiting for a signed one"
            );
        }
        std::thread::sleep(
            deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50)),
        );
    }
}

/// The context both ends of the link from `dialer` to `acceptor` mix into
/// the handshake (`wire::handshake_bound`): the group and both ranks.
fn link_context(prefix: &str, dialer: usize, acceptor: usize) -> Vec<u8> {
    let mut c = b"phalanx mesh link\0".to_vec();
    c.extend_from_slice(&(prefix.len() as u64).to_le_bytes());
    c.extend_from_slice(prefix.as_bytes());
    c.extend_from_slice(&(dialer as u64).to_le_bytes());
    c.extend_from_slice(&(acceptor as u64).to_le_bytes());
    c
}

/// This rank, as its acceptor knows it.
struct Me {
    prefix: String,
    rank: usize,
    world: usize,
}

/// A lower rank this rank dials during set-up.
struct Lower<'a> {
    prefix: &'a str,
    rank: usize,
    world: usize,
    j: usize,
    /// Rank j's TCP listening address.
    host: &'a str,
    /// Rank j's Unix socket name, where it shares this host.
    unix: Option<&'a str>,
}

impl Lower<'_> {
    /// Connect, handshake and say who we are. A connection cut short
    /// (rank j sheds its oldest pending handshakes when strangers flood
    /// its listener) is dialled again until `deadline`; a wrong secret is
    /// final.
    fn join(&self, secret: &[u8], deadline: Instant) -> Result<Stream> {
        loop {
            match self.try_join(secret, deadline) {
                Ok(s) => return Ok(s),
                Err(e @ CommError::PeerDead { .. }) => return Err(e),
                Err(e) if matches!(e, CommError::Auth(_)) || Instant::now() >= deadline => {
                    return Err(self.dead(format!("handshake failed: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// One attempt of [`Lower::join`]: `PeerDead` when rank j cannot be
    /// reached at all, another error when the handshake or hello failed.
    fn try_join(&self, secret: &[u8], deadline: Instant) -> Result<Stream> {
        let (rank, j, host) = (self.rank, self.j, self.host);
        let unix = self.unix.and_then(|name| match local::dial(name) {
            Ok(u) => Some(Stream::Unix(u)),
            Err(e) => {
                eprintln!(
                    "[phalanx] rank {rank}: Unix socket to rank {j} ({host}) failed ({e}); using TCP"
                );
                None
            }
        });
        let mut s = match unix {
            Some(s) => s,
            None => Stream::Tcp(
                dial(host, deadline).map_err(|e| self.dead(format!("cannot connect: {e}")))?,
            ),
        };
        // Who we are first, so that rank j can bind the handshake to both
        // of us; a false claim fails it.
        let mut hello = [0u8; 16];
        hello[..8].copy_from_slice(&(rank as u64).to_le_bytes());
        hello[8..].copy_from_slice(&(self.world as u64).to_le_bytes());
        s.write_all(&hello)?;
        let context = link_context(self.prefix, rank, j);
        wire::handshake_bound(&mut s, secret, false, deadline, &context)?;
        Ok(s)
    }

    fn dead(&self, reason: String) -> CommError {
        CommError::PeerDead {
            rank: self.j,
            host: self.host.to_string(),
            reason,
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

/// Hello and handshake on one accepted connection, within `until`. The
/// hello (the dialer's rank and world size) comes first and is bound into
/// the handshake (`link_context`), so a connection admitted as rank j was
/// dialled by rank j, to this rank, in this group.
fn admit(mut s: Stream, addr: String, me: &Me, secret: &[u8], until: Instant) -> Admitted {
    let res = (|| -> Result<(usize, usize)> {
        s.set_nonblocking(false)?;
        s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut hello = [0u8; 16];
        wire::read_exact_until(&mut s, &mut hello, until, "hello")?;
        let j = u64::from_le_bytes(hello[..8].try_into().unwrap());
        let world = u64::from_le_bytes(hello[8..].try_into().unwrap());
        // Not a rank this one accepts (a world size that differs is
        // reported once the handshake shows it comes from a rank).
        if world == me.world as u64 && (j <= me.rank as u64 || j >= world) {
            return Err(CommError::Protocol(format!(
                "hello from rank {j}, which does not dial rank {} of {}",
                me.rank, me.world
            )));
        }
        let (j, world) = (j as usize, world as usize);
        let context = link_context(&me.prefix, j, me.rank);
        wire::handshake_bound(&mut s, secret, true, until, &context)?;
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
/// them; at most `MAX_PENDING` are in flight (a newcomer sheds the
/// oldest), and those still pending when set-up ends are shut down.
fn accept_higher(
    listener: TcpListener,
    unix: Option<UnixListener>,
    me: Arc<Me>,
    secret: &[u8],
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(usize, Stream, String)>> {
    let (rank, world) = (me.rank, me.world);
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
    // Oldest first (ids grow), so that the oldest can be shed.
    let mut pending: std::collections::BTreeMap<u64, Stream> = Default::default();
    let mut next_id = 0u64;
    // Handshakes finished while the listeners were drained, to collect.
    let mut ready: std::collections::VecDeque<(u64, Admitted)> = Default::default();
    let mut waiting = crate::patience::Waiting::until(deadline);
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
                    // Finished handshakes first: a real rank whose
                    // handshake is done (its dialer has returned) must not
                    // be the oldest one shed.
                    while let Ok((id, a)) = rx.try_recv() {
                        pending.remove(&id);
                        ready.push_back((id, a));
                    }
                }
                if pending.len() >= MAX_PENDING {
                    // Shed the oldest, as the store does: a flood of idle
                    // strangers then cannot hold every slot while a real
                    // rank, arriving after them, is refused (and one cut
                    // short dials again, see `Lower::join`).
                    if let Some((_, old)) = pending.pop_first() {
                        let _ = old.shutdown(std::net::Shutdown::Both);
                    }
                    log.log(format_args!(
                        "{MAX_PENDING} handshakes pending: shed the oldest for a connection from {addr}"
                    ));
                }
                let id = next_id;
                next_id += 1;
                if let Ok(c) = s.try_clone() {
                    pending.insert(id, c);
                }
                let until = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
                let (tx, secret, me) = (tx.clone(), secret.clone(), me.clone());
                let spawned = std::thread::Builder::new()
                    .name("phalanx-handshake".into())
                    .spawn(move || {
                        let _ = tx.send((id, admit(s, addr, &me, &secret, until)));
                    });
                if let Err(e) = spawned {
                    pending.remove(&id);
                    log.log(format_args!("cannot start a handshake thread: {e}"));
                }
            }
            // Collect finished handshakes, waiting a little for one.
            let mut wait = Duration::from_millis(5);
            loop {
                let (id, a) = match ready.pop_front() {
                    Some(x) => x,
                    None => match rx.recv_timeout(wait) {
                        Ok(x) => x,
                        Err(_) => break,
                    },
                };
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
            let missing = || -> Vec<usize> {
                (rank + 1..world)
                    .filter(|j| !got.iter().any(|g| g.0 == *j))
                    .collect()
            };
            if Instant::now() >= deadline {
                return Err(CommError::Timeout(format!(
                    "rank {rank}: ranks {:?} never connected (world size {world})",
                    missing()
                )));
            }
            waiting.tick(|| {
                // (The first few: a large job's list would fill the line.)
                let m = missing();
                let shown: Vec<String> = m.iter().take(8).map(|j| j.to_string()).collect();
                let more = match m.len().saturating_sub(8) {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                format!(
                    "rank {rank}: still waiting for ranks [{}]{more} of {world} to connect",
                    shown.join(", ")
                )
            });
        }
        Ok(got)
    })();
    // Strangers still in their handshake: end them now.
    for s in pending.values() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    result
}

/// The address this rank listens on and publishes: `PHALANX_SOCKET_ADDR`
/// where given; else the address it reaches the store from, unless that is
/// loopback in a job with ranks on other hosts. That happens when node 0's
/// host name resolves to 127.0.1.1 there (Debian's and Ubuntu's
/// `/etc/hosts`): peers on other hosts could not dial it, so the first
/// address of an interface that is up and not loopback is taken instead
/// (loopback still on a host without one).
fn listen_ip(store_side: IpAddr, cfg: &Config) -> Result<IpAddr> {
    if let Some(ip) = cfg.advertise {
        return Ok(ip);
    }
    if !store_side.is_loopback() {
        return Ok(store_side);
    }
    if !cfg.spans_hosts {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    // No other interface: no other host can reach this one anyway (a job
    // of "nodes" on one host, as tests run them), so loopback it is.
    Ok(interface_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// The first IPv4 (else IPv6) address of an interface that is up and not
/// loopback.
pub fn interface_ip() -> Option<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found: Option<IpAddr> = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        if !up || lo || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr whose family says its type.
        let ip = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(std::net::Ipv6Addr::from(a.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        // Link-local IPv6 needs a scope id to be dialled: skip it.
        if let IpAddr::V6(v6) = ip {
            if (v6.segments()[0] & 0xffc0) == 0xfe80 {
                continue;
            }
        }
        if ip.is_loopback() {
            continue;
        }
        match (found, ip) {
            (None, _) | (Some(IpAddr::V6(_)), IpAddr::V4(_)) => found = Some(ip),
            _ => {}
        }
    }
    // SAFETY: freeing the list getifaddrs allocated.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod listen_tests {
    use super::*;

    #[test]
    fn the_listen_address_follows_the_override_the_store_and_the_job() {
        let cfg = |advertise, spans_hosts| Config {
            advertise,
            spans_hosts,
            ..Config::default()
        };
        let lo = IpAddr::V4(Ipv4Addr::new(127, 0, 1, 1));
        let net = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
        assert_eq!(listen_ip(net, &cfg(None, true)).unwrap(), net);
        assert_eq!(
            listen_ip(lo, &cfg(None, false)).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(listen_ip(lo, &cfg(Some(net), true)).unwrap(), net);
        // Spanning hosts from a loopback store link: an interface's
        // address (loopback only on a host without one).
        let ip = listen_ip(lo, &cfg(None, true)).unwrap();
        assert_eq!(ip.is_loopback(), interface_ip().is_none(), "{ip}");
        if let Some(i) = interface_ip() {
            // One this host can listen on.
            std::net::TcpListener::bind((i, 0)).unwrap();
        }
    }
}
