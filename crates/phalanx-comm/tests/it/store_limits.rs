//! What clients may cost the rendezvous store: unauthenticated connections
//! are capped (the oldest shed) and cut at a total deadline; authenticated
//! ones store bounded data.

use phalanx_comm::store::{StoreClient, StoreLimits, StoreServer};
use phalanx_comm::CommError;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn server(limits: StoreLimits) -> (StoreServer, String, Vec<u8>) {
    let secret = phalanx_comm::wire::random_bytes(32);
    let s = StoreServer::bind_with("127.0.0.1:0", secret.clone(), limits).unwrap();
    let a = s.addr().to_string();
    (s, a, secret)
}

/// Read the server's 40-byte hello: true if it came, false if the server
/// closed the connection first.
fn greeted(s: &mut TcpStream) -> bool {
    // A hang guard only: the server answers at once or closes at once.
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut hello = [0u8; 40];
    match s.read_exact(&mut hello) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => false,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => false,
        Err(e) => panic!("neither a hello nor a close: {e}"),
    }
}

/// Block until the server closes `s`; returns how long that took.
fn closed_after(s: &mut TcpStream, t0: Instant, limit: Duration) -> Duration {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => t0.elapsed(),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => t0.elapsed(),
        Err(e) => panic!("connection still open after {limit:?}: {e}"),
    }
}

#[test]
fn a_trickling_handshake_is_cut_at_its_total_deadline() {
    let deadline = Duration::from_secs(1);
    let (_s, addr, secret) = server(StoreLimits {
        handshake_timeout: deadline,
        ..StoreLimits::default()
    });
    let t0 = Instant::now();
    let mut s = TcpStream::connect(&addr).unwrap();
    assert!(greeted(&mut s));
    // A correct hello (40 bytes), then all but the last byte of an answer
    // (31 of 32), one byte every 400 ms (~28 s in all): each read succeeds
    // well within the 1 s deadline, and the server never has a whole
    // answer to refuse, so only a deadline on the whole handshake ends it.
    const BYTES: usize = 40 + 31;
    let mut w = s.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        let bytes: Vec<u8> = b"PHALANX1".iter().copied().chain([0u8; 63]).collect();
        for (sent, b) in bytes.iter().enumerate() {
            if w.write_all(&[*b]).is_err() {
                return sent;
            }
            std::thread::sleep(Duration::from_millis(400));
        }
        BYTES
    });
    // 60 s: a hang guard, past the end of the trickle.
    let took = closed_after(&mut s, t0, Duration::from_secs(60));
    // The server measures its deadline from after our connect.
    assert!(took >= deadline, "closed after {took:?}");
    drop(s);
    // The cause: the server closed while the client was still trickling a
    // handshake it had not finished (a server with only per-read timeouts
    // would have waited for all of it).
    let sent = trickle.join().unwrap();
    assert!(
        sent < BYTES,
        "the writer sent all {BYTES} bytes before the close ({took:?})"
    );
    // The store still serves real clients.
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(30)).unwrap();
    c.set("k", b"v").unwrap();
}

#[test]
fn unauthenticated_connections_are_capped_by_shedding_the_oldest() {
    // A handshake deadline far past the test: only shedding can close an
    // idle connection here.
    let (_s, addr, secret) = server(StoreLimits {
        max_pending: 8,
        max_pending_per_ip: 8,
        handshake_timeout: Duration::from_secs(600),
        ..StoreLimits::default()
    });
    let t0 = Instant::now();
    let mut idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    // The newest 8 hold the slots: each was greeted and is still pending
    // (a newcomer is never refused, as it was when the first 8 kept the
    // slots for the whole deadline).
    for (i, s) in idle.iter_mut().enumerate().skip(92) {
        assert!(greeted(s), "connection {i} of 100 was refused");
    }
    // The 92 before them were shed, long before their deadline (30 s: a
    // hang guard).
    for s in idle.iter_mut().take(92) {
        closed_after(s, t0, Duration::from_secs(30));
    }
    for (i, s) in idle.iter_mut().enumerate().skip(92) {
        assert!(still_open(s), "connection {i} was closed");
    }
    // A real client gets in at once, shedding the oldest stranger, and
    // once authenticated it counts against no cap: 8 more strangers do
    // not shed it.
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(30)).unwrap();
    closed_after(&mut idle[92], t0, Duration::from_secs(30));
    // One answered request first: the server has then taken the handshake
    // (the client's connect returns once it has sent its proof, and on a
    // loaded machine the strangers below could otherwise arrive first).
    c.set("k", b"v").unwrap();
    let more: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    assert_eq!(c.get("k").unwrap(), b"v".to_vec());
    drop(more);
}

/// True if the server has neither sent anything more nor closed `s`.
fn still_open(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut b = [0u8; 1];
    matches!(
        s.read(&mut b),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
    )
}

#[test]
fn stored_data_is_bounded() {
    let limits = StoreLimits {
        max_key: 64,
        max_value: 1000,
        max_total: 4000,
        ..StoreLimits::default()
    };
    let (_s, addr, secret) = server(limits);
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let long_key = "k".repeat(65);
    type Op = Box<dyn Fn(&StoreClient) -> Result<(), CommError>>;
    // (what, the operation, words the error must contain)
    let cases: Vec<(&str, Op, &[&str])> = vec![
        (
            "value over max_value",
            Box::new(|c| c.set("big", &[0u8; 1001])),
            &["\"big\"", "1001 bytes", "limit of 1000"],
        ),
        (
            "key over max_key on set",
            Box::new({
                let k = long_key.clone();
                move |c| c.set(&k, b"v")
            }),
            &["key of 65 bytes", "limit of 64"],
        ),
        (
            "key over max_key on get",
            Box::new({
                let k = long_key.clone();
                move |c| c.try_get(&k).map(|_| ())
            }),
            &["key of 65 bytes"],
        ),
        (
            "key over max_key on wait",
            Box::new({
                let k = long_key.clone();
                move |c| c.wait(&[&k], Duration::from_millis(10))
            }),
            &["key of 65 bytes"],
        ),
        (
            "key over max_key on add",
            Box::new({
                let k = long_key.clone();
                move |c| c.add(&k, 1).map(|_| ())
            }),
            &["key of 65 bytes"],
        ),
        (
            "value over max_value on compare_set",
            Box::new(|c| c.compare_set("cas", b"", &[1u8; 1001]).map(|_| ())),
            &["\"cas\"", "limit of 1000"],
        ),
    ];
    for (what, op, want) in &cases {
        let err = op(&c).err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(matches!(err, CommError::Invalid(_)), "{what}: {err}");
        for w in *want {
            assert!(err.to_string().contains(w), "{what}: {w:?} missing: {err}");
        }
    }
    // The total: three values of 1000 fit, a fourth does not; replacing or
    // deleting one frees its bytes.
    for k in ["a", "b", "c"] {
        c.set(k, &[0u8; 1000]).unwrap();
    }
    let err = c.set("d", &[0u8; 1000]).err().unwrap().to_string();
    assert!(err.contains("total limit of 4000"), "{err}");
    c.set("a", b"small").unwrap();
    c.set("d", &[0u8; 900]).unwrap();
    assert!(c.delete("b").unwrap());
    c.set("e", &[0u8; 1000]).unwrap();
    // The connection survives every refusal.
    assert_eq!(c.get("a").unwrap(), b"small");
}

#[test]
fn default_limits_refuse_a_huge_value() {
    let (_s, addr, secret) = server(StoreLimits::default());
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let err = c.set("x", &vec![0u8; 2 << 20]).err().unwrap().to_string();
    assert!(err.contains("limit of 1048576"), "{err}");
    c.set("x", &vec![0u8; 1 << 20]).unwrap();
}
