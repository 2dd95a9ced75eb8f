//! A store that strangers can write (torchrun's agent store is a PyTorch
//! TCPStore, with no authentication): whoever reaches it can rewrite the
//! addresses ranks publish there. A rank must not dial a rewritten address:
//! a relay at that address could pass the secret handshake through to the
//! real rank and sit in the middle of the link. These tests use Phalanx's
//! own store and rewrite it as a client holding the secret would, which is
//! what anyone can do to a TCPStore.

use phalanx_comm::init::from_store;
use phalanx_comm::store::{StoreClient, StoreServer};
use phalanx_comm::{CommError, Config, TransportPref};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The two ends of a connection a relay dials: what it reads, what it writes.
type Ends = (Box<dyn Read + Send>, Box<dyn Write + Send>);

/// Copy `a` into `b` until either end closes (or 30 s of silence).
fn pipe<A: Read + Send + 'static, B: Write + Send + 'static>(mut a: A, mut b: B) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 64 << 10];
        while let Ok(n) = a.read(&mut buf) {
            if n == 0 || b.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
}

/// Relay every connection accepted by `accept` (for 30 s) to a new one made
/// by `dial`, both ways; counts the connections relayed.
fn relay<S, D>(mut accept: impl FnMut() -> Option<S> + Send + 'static, dial: D) -> Arc<AtomicUsize>
where
    S: Read + Write + Send + 'static,
    D: Fn() -> Option<Ends> + Send + 'static,
    S: TryCloneStream,
{
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            let Some(s) = accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            c.fetch_add(1, Ordering::SeqCst);
            let Some((r, w)) = dial() else { continue };
            pipe(s.clone_stream(), w);
            pipe(r, s);
        }
    });
    count
}

trait TryCloneStream: Sized {
    fn clone_stream(&self) -> Self;
}
impl TryCloneStream for TcpStream {
    fn clone_stream(&self) -> Self {
        let s = self.try_clone().unwrap();
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }
}
impl TryCloneStream for UnixStream {
    fn clone_stream(&self) -> Self {
        let s = self.try_clone().unwrap();
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }
}

fn tcp_to(addr: String) -> impl Fn() -> Option<Ends> {
    move || {
        let s = TcpStream::connect(&addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
        Some((Box::new(s.try_clone().ok()?), Box::new(s)))
    }
}

/// Start `rank` of a 3-rank group on its own thread; its result arrives on
/// the receiver.
fn spawn_rank(
    addr: &str,
    secret: &[u8],
    rank: usize,
    cfg: Config,
) -> Receiver<Result<(), CommError>> {
    let (addr, secret) = (addr.to_string(), secret.to_vec());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = (|| {
            let store = StoreClient::connect(&addr, &secret, Duration::from_secs(5))?;
            let pg = from_store(&store, "p", rank, 3, &secret, cfg, None)?;
            pg.barrier()
        })();
        let _ = tx.send(r);
    });
    rx
}

/// Ranks 0 and 1 publish; then `tamper` rewrites the store and rank 2
/// starts. Rank 2 must fail naming rank 1 and the store, without ever
/// connecting through the relay.
fn rank_two_refuses(
    transport: TransportPref,
    tamper: impl FnOnce(&StoreClient) -> Arc<AtomicUsize>,
) {
    let secret = phalanx_comm::wire::random_bytes(32);
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let addr = server.addr().to_string();
    let cfg = |secs| Config {
        timeout: Duration::from_secs(secs),
        transport,
        ..Config::default()
    };
    let r0 = spawn_rank(&addr, &secret, 0, cfg(20));
    let r1 = spawn_rank(&addr, &secret, 1, cfg(20));
    let watch = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    watch
        .wait(&["p/addr/0", "p/addr/1"], Duration::from_secs(10))
        .unwrap();
    let relayed = tamper(&watch);
    let r2 = spawn_rank(&addr, &secret, 2, cfg(2));
    // 60 s: hang guards; rank 2 gives up at its 2 s deadline.
    let guard = Duration::from_secs(60);
    let e = r2
        .recv_timeout(guard)
        .expect("rank 2 neither connected nor failed")
        .expect_err("rank 2 dialled a rewritten address and the group formed through the relay");
    let msg = e.to_string();
    assert!(matches!(e, CommError::Auth(_)), "{transport:?}: {msg}");
    assert!(msg.contains("rank 1"), "{transport:?}: {msg}");
    assert!(msg.contains("tampered"), "{transport:?}: {msg}");
    assert_eq!(
        relayed.load(Ordering::SeqCst),
        0,
        "{transport:?}: rank 2 dialled the rewritten address"
    );
    // The others hear of it (or time out) rather than wait forever.
    for (r, rx) in [(0, r0), (1, r1)] {
        let res = rx.recv_timeout(guard).expect("a rank hung");
        assert!(
            res.is_err(),
            "{transport:?}: rank {r} formed a group without rank 2"
        );
    }
}

/// `addr/1` rewritten to a relay in front of the real rank 1.
#[test]
fn a_rewritten_address_is_refused_not_dialled() {
    rank_two_refuses(TransportPref::Tcp, |store| {
        let real = String::from_utf8_lossy(&store.get("p/addr/1").unwrap()).to_string();
        // What rank 1 published is "ip:port", maybe with more after a newline.
        let real = real.split('\n').next().unwrap().to_string();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        store
            .set("p/addr/1", l.local_addr().unwrap().to_string().as_bytes())
            .unwrap();
        relay(move || l.accept().ok().map(|(s, _)| s), tcp_to(real))
    });
}

/// `local/1` (rank 1's Unix socket name) rewritten to a relay's abstract
/// socket, in front of the real rank 1's.
#[cfg(target_os = "linux")]
#[test]
fn a_rewritten_unix_socket_name_is_refused_not_dialled() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    rank_two_refuses(TransportPref::Uds, |store| {
        let local = String::from_utf8_lossy(&store.get("p/local/1").unwrap()).to_string();
        // "host identity\nsocket name", maybe with more after a newline.
        let mut lines = local.split('\n');
        let host = lines.next().unwrap().to_string();
        let real = lines.next().unwrap().to_string();
        let name = format!("phalanx-tamper-{}", std::process::id());
        let l = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
        l.set_nonblocking(true).unwrap();
        store
            .set("p/local/1", format!("{host}\n{name}").as_bytes())
            .unwrap();
        let to_real = move || -> Option<Ends> {
            let a = SocketAddr::from_abstract_name(real.as_bytes()).ok()?;
            let s = UnixStream::connect_addr(&a).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
            Some((Box::new(s.try_clone().ok()?), Box::new(s)))
        };
        relay(move || l.accept().ok().map(|(s, _)| s), to_real)
    });
}

/// A signed record opens only with its own secret, group, kind and rank:
/// forged, moved to another rank's or group's key, or altered, it does not.
#[test]
fn a_signed_record_opens_only_where_it_was_published() {
    use phalanx_comm::wire::{open_record, sign_record};
    let (k, other) = (b"job secret 0123456789", b"another secret 0123");
    let rec = sign_record(k, "p", "addr", 1, b"10.0.0.1:4000");
    assert_eq!(
        open_record(k, "p", "addr", 1, &rec),
        Some(&b"10.0.0.1:4000"[..])
    );
    assert_eq!(open_record(other, "p", "addr", 1, &rec), None);
    assert_eq!(open_record(k, "p", "addr", 2, &rec), None);
    assert_eq!(open_record(k, "q", "addr", 1, &rec), None);
    assert_eq!(open_record(k, "p", "local", 1, &rec), None);
    assert_eq!(open_record(k, "p", "addr", 1, b"10.0.0.1:4000"), None);
    assert_eq!(open_record(k, "p", "addr", 1, b""), None);
    let mut bad = rec.clone();
    bad[0] ^= 1;
    assert_eq!(open_record(k, "p", "addr", 1, &bad), None);
    assert_eq!(open_record(k, "p", "addr", 1, &rec[1..]), None);
}

/// The handshake's context must agree: a dial meant for one link (rank 2
/// to rank 1) passed on to another rank's listener (rank 0 expects a dial
/// from rank 2 to itself) fails on both sides, though both hold the secret.
#[test]
fn a_handshake_bound_to_other_ranks_fails() {
    use phalanx_comm::wire::handshake_bound;
    let secret = phalanx_comm::wire::random_bytes(32);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    for (dial, accept, ok) in [
        (&b"2->1"[..], &b"2->1"[..], true),
        (b"2->1", b"2->0", false),
    ] {
        let s2 = secret.clone();
        let d = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            handshake_bound(&mut c, &s2, false, deadline, dial)
        });
        let (mut a, _) = l.accept().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let acc = handshake_bound(&mut a, &secret, true, deadline, accept);
        let dial = d.join().unwrap();
        assert_eq!((acc.is_ok(), dial.is_ok()), (ok, ok), "{acc:?} {dial:?}");
        if !ok {
            assert!(matches!(acc, Err(CommError::Auth(_))), "{acc:?}");
        }
    }
}
