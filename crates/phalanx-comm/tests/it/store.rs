//! The rendezvous store: operations, authentication, bad frames.

use phalanx_comm::store::{StoreClient, StoreServer};
use phalanx_comm::CommError;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn server() -> (StoreServer, String, Vec<u8>) {
    let secret = phalanx_comm::wire::random_bytes(32);
    let s = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let a = s.addr().to_string();
    (s, a, secret)
}

#[test]
fn operations() {
    let (_s, addr, secret) = server();
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    c.set("a", b"1").unwrap();
    assert_eq!(c.get("a").unwrap(), b"1");
    assert_eq!(c.try_get("nope").unwrap(), None);
    assert_eq!(c.add("ctr", 5).unwrap(), 5);
    assert_eq!(c.add("ctr", -2).unwrap(), 3);
    assert!(c.add("a", 1).is_ok()); // "1" is a counter too
    c.set("txt", b"x").unwrap();
    assert!(c.add("txt", 1).is_err());
    assert_eq!(c.compare_set("cas", b"", b"first").unwrap(), b"first");
    assert_eq!(c.compare_set("cas", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(
        c.compare_set("cas", b"first", b"second").unwrap(),
        b"second"
    );
    assert!(c.delete("cas").unwrap());
    assert!(!c.delete("cas").unwrap());
    let n = c.num_keys().unwrap();
    assert_eq!(n, 3);

    // wait: times out naming the key, and wakes when another client sets it.
    let e = c.wait(&["later"], Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(e, CommError::Timeout(ref m) if m.contains("later")),
        "{e}"
    );
    let (addr2, secret2) = (addr.clone(), secret.clone());
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let d = StoreClient::connect(&addr2, &secret2, Duration::from_secs(5)).unwrap();
        d.set("later", b"now").unwrap();
    });
    assert_eq!(c.get("later").unwrap(), b"now");
    h.join().unwrap();
}

#[test]
fn wrong_secret_is_refused_and_others_keep_working() {
    let (_s, addr, secret) = server();
    let good = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    let err = StoreClient::connect(&addr, b"not the secret", Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(matches!(err, CommError::Auth(_)), "{err}");
    good.set("k", b"v").unwrap();
    assert_eq!(good.get("k").unwrap(), b"v");
}

#[test]
fn garbage_and_oversized_frames_are_dropped() {
    let (_s, addr, secret) = server();
    let good = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    // Garbage instead of a handshake.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut sink = Vec::new();
    let _ = raw.read_to_end(&mut sink); // the server closes the connection
                                        // An authenticated client that announces a 1 GiB frame.
    let mut s = TcpStream::connect(&addr).unwrap();
    phalanx_comm::wire::handshake(&mut s, &secret, false, Duration::from_secs(5)).unwrap();
    s.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 4];
    assert!(
        matches!(s.read(&mut buf), Ok(0) | Err(_)),
        "oversized frame must close the connection"
    );
    // A malformed request (unknown opcode) is dropped too.
    let mut s = TcpStream::connect(&addr).unwrap();
    phalanx_comm::wire::handshake(&mut s, &secret, false, Duration::from_secs(5)).unwrap();
    phalanx_comm::wire::write_frame(&mut s, &[200, 1, 2]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
    good.set("still", b"serving").unwrap();
    assert_eq!(good.get("still").unwrap(), b"serving");
}

#[test]
fn port_in_use_is_a_clear_error() {
    let (s, addr, secret) = server();
    let err = StoreServer::bind(&addr, secret).err().unwrap();
    assert!(
        err.to_string().contains("cannot bind") && err.to_string().contains(&addr),
        "{err}"
    );
    drop(s);
}

#[test]
fn transport_refuses_wrong_secret() {
    // A rank with the wrong secret cannot join the mesh; the store itself
    // refuses it first.
    let (_s, addr, _secret) = server();
    let err = StoreClient::connect(&addr, b"bad", Duration::from_secs(2))
        .err()
        .unwrap();
    assert!(err.to_string().contains("authentication"), "{err}");
}

/// A connection the server serves does not outlive the server: once it is
/// dropped, an idle authenticated client (one that sends nothing more, as
/// one whose host vanished) is closed. Its thread used to wait for a
/// frame that never came, forever.
#[test]
fn idle_connections_end_with_the_server() {
    let (s, addr, secret) = server();
    let mut raw = TcpStream::connect(&addr).unwrap();
    phalanx_comm::wire::handshake(&mut raw, &secret, false, Duration::from_secs(5)).unwrap();
    // One request served, so the connection is past its handshake.
    phalanx_comm::wire::write_frame(&mut raw, &[7]).unwrap();
    let reply = phalanx_comm::wire::read_frame(&mut raw, 1 << 10).unwrap();
    assert_eq!(reply[0], 0, "num_keys: {reply:?}");
    drop(s);
    // 60 s: a hang guard; the connection closes as soon as its thread sees
    // the server stop.
    raw.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut b = [0u8; 1];
    let r = raw.read(&mut b);
    assert!(
        matches!(r, Ok(0)),
        "the server's thread kept the connection open after the server was dropped: {r:?}"
    );
}

/// A store that stops reading (its host gone, its buffers full) fails a
/// client's request at the client's timeout instead of blocking it forever
/// in a write.
#[test]
fn a_store_that_stops_reading_fails_the_write_in_time() {
    let secret = phalanx_comm::wire::random_bytes(32);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let s2 = secret.clone();
    // Answers the handshake, then never reads.
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        phalanx_comm::wire::handshake(&mut s, &s2, true, Duration::from_secs(10)).unwrap();
        s
    });
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(2)).unwrap();
    let _held = fake.join().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // More than any socket buffers hold.
        let _ = tx.send(c.set("big", &vec![0u8; 64 << 20]));
    });
    // 60 s: a hang guard, not the property.
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a write to a store that stopped reading never returned");
    let e = r.unwrap_err();
    assert!(matches!(e, CommError::Io(_)), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
}

/// `compare_set` on a missing key with a non-empty `expected` answers
/// `expected` and leaves the key missing, as PyTorch's TCPStore does (it
/// used to answer an empty value).
#[test]
fn compare_set_on_a_missing_key_answers_expected_like_torch() {
    let (_s, addr, secret) = server();
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
    assert_eq!(c.compare_set("gone", b"old", b"new").unwrap(), b"old");
    assert_eq!(c.try_get("gone").unwrap(), None);
    // An empty `expected` still creates it.
    assert_eq!(c.compare_set("gone", b"", b"new").unwrap(), b"new");
    assert_eq!(c.try_get("gone").unwrap(), Some(b"new".to_vec()));
}

/// After a request times out, the client does not read its late reply as
/// the answer to the next request: the connection is dropped and the next
/// call reconnects (authenticating again). It used to keep the connection
/// and read, from then on, the answer to the request before.
#[test]
fn a_timed_out_request_does_not_shift_later_replies() {
    use phalanx_comm::wire;
    let secret = wire::random_bytes(32);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let s2 = secret.clone();
    // A store holding one counter. On the first connection it holds back
    // its reply to the first request until the client either closes the
    // connection or sends another request (and then sends the late reply
    // first, as a slow store would).
    let fake = std::thread::spawn(move || {
        let mut counter = 0i64;
        let mut add = |frame: &[u8]| {
            assert_eq!(frame[0], 4, "expected an add: {frame:?}");
            counter += i64::from_le_bytes(frame[frame.len() - 8..].try_into().unwrap());
            let mut reply = vec![0u8];
            reply.extend_from_slice(&counter.to_le_bytes());
            reply
        };
        let mut first = true;
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            wire::handshake(&mut s, &s2, true, Duration::from_secs(10)).unwrap();
            // Hang guards: no read here waits more than 30 s.
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut held = None;
            while let Ok(frame) = wire::read_frame(&mut s, 1 << 10) {
                let reply = add(&frame);
                if first {
                    first = false;
                    held = Some(reply);
                    continue;
                }
                if let Some(late) = held.take() {
                    let _ = wire::write_frame(&mut s, &late);
                }
                let _ = wire::write_frame(&mut s, &reply);
            }
        }
    });
    // A 1 s timeout: the client waits that long for a reply.
    let c = StoreClient::connect(&addr, &secret, Duration::from_secs(1)).unwrap();
    let e = c.add("n", 1).unwrap_err();
    assert!(matches!(e, CommError::Io(_)), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
    // The first add was applied (the store got it); the second must read
    // its own answer, not the first's late 1.
    assert_eq!(
        c.add("n", 10).unwrap(),
        11,
        "the client read the reply to the timed-out request"
    );
    assert_eq!(c.add("n", 100).unwrap(), 111);
    drop(c);
    fake.join().unwrap();
}
