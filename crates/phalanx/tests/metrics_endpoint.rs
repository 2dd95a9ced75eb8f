//! What a client may cost rank 0's Prometheus endpoint: an endless header
//! is cut at a size, a trickled one at a deadline, idle connections are
//! shed, and the endpoint goes on serving scrapers afterwards.

use phalanx::monitor::http::{HEADER_TIMEOUT, MAX_CONNS, MAX_HEADER};
use phalanx::monitor::prometheus::Exporter;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

fn exporter() -> (Exporter, SocketAddr) {
    let e = Exporter::start("127.0.0.1", 0).unwrap();
    let url = e.url();
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .parse()
        .unwrap();
    (e, addr)
}

/// Everything the server sends until it closes (a reset after a reply
/// counts as a close); panics if it is still open after `limit`.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "still open after {limit:?}");
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("still open after {limit:?}: {e}"),
        }
    }
}

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // 30 s: a hang guard; a served scrape takes milliseconds.
    String::from_utf8(read_until_closed(&mut s, Duration::from_secs(30))).unwrap()
}

/// Threads of this process serving a metrics connection.
fn conn_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim() == "metrics-conn")
        .count()
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kb << 10
}

#[test]
fn an_endless_header_is_cut_and_the_endpoint_still_serves() {
    let (_e, addr) = exporter();
    assert!(scrape(addr).starts_with("HTTP/1.1 200"));
    let before = rss_bytes();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nX-Endless: ")
        .unwrap();
    // Up to 256 MiB of one header line: a server that buffers it all
    // (tiny_http did) takes every byte, and this process (the server is
    // in it) grows by as much.
    const LIMIT: usize = 256 << 20;
    let chunk = vec![b'a'; 64 << 10];
    let mut sent = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let cut = loop {
        if sent >= LIMIT || Instant::now() > deadline {
            break false;
        }
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break true,
        }
    };
    assert!(cut, "the server took {sent} bytes of one header");
    // What it took before the cut is the header limit plus what the
    // kernel's socket buffers held.
    assert!(sent < 64 << 20, "{sent} bytes sent before the cut");
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 32 << 20, "the process grew by {grown} bytes");
    // If the reply got through before the reset, it is a 431.
    let reply = read_until_closed(&mut s, Duration::from_secs(30));
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
        "{reply}"
    );
    assert!(scrape(addr).starts_with("HTTP/1.1 200"));
}

#[test]
fn a_header_just_over_the_limit_gets_431() {
    let (_e, addr) = exporter();
    let mut s = TcpStream::connect(addr).unwrap();
    // Sent whole, then silence: the server reads all of it before it
    // answers, so the answer is not lost to a reset.
    let mut req = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    req.resize(MAX_HEADER + 2048, b'b');
    s.write_all(&req).unwrap();
    let reply = read_until_closed(&mut s, Duration::from_secs(30));
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    assert!(scrape(addr).starts_with("HTTP/1.1 200"));
    // A whole head a little over the limit, ended: 431 too (one read past
    // the limit used to find its end and take it).
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    req.resize(MAX_HEADER + 300, b'b');
    req.extend_from_slice(b"\r\n\r\n");
    s.write_all(&req).unwrap();
    let reply = read_until_closed(&mut s, Duration::from_secs(30));
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
}

#[test]
fn a_trickled_header_is_cut_at_its_deadline_with_408() {
    let (_e, addr) = exporter();
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    let mut w = s.try_clone().unwrap();
    // One byte every 200 ms: every read succeeds, so only a deadline on
    // the whole head ends it (about 10 s of header would follow).
    let trickle = std::thread::spawn(move || {
        let head = b"GET /metrics HTTP/1.1\r\nX-Slow: "
            .iter()
            .chain(&[b's'; 20]);
        for b in head {
            if w.write_all(&[*b]).is_err() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        true
    });
    // 60 s: a hang guard, well past the trickle.
    let reply = read_until_closed(&mut s, Duration::from_secs(60));
    let took = t0.elapsed();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(took >= HEADER_TIMEOUT, "closed after {took:?}");
    drop(s);
    assert!(
        !trickle.join().unwrap(),
        "the trickle finished before the cut"
    );
    assert!(scrape(addr).starts_with("HTTP/1.1 200"));
}

#[test]
fn idle_connections_are_shed_and_scrapes_go_on() {
    let (_e, addr) = exporter();
    let mut idle: Vec<TcpStream> = (0..10 * MAX_CONNS)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // Each scrape is answered although every idle connection is still
    // open on our side and their header deadline is far off (and, being
    // behind them in the accept queue, after all of them were accepted).
    for _ in 0..3 {
        assert!(scrape(addr).starts_with("HTTP/1.1 200"));
    }
    // They hold at most MAX_CONNS threads (a few more may belong to the
    // other tests of this file, which run alongside).
    let serving = conn_threads();
    assert!(serving <= MAX_CONNS + 4, "{serving} connection threads");
    // The oldest were shed to make room: closed without a reply.
    for s in idle.iter_mut().take(MAX_CONNS) {
        let got = read_until_closed(s, Duration::from_secs(30));
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    }
}

/// A bind that fails names the key at fault: the port when it is taken,
/// the host when it is no address of this machine.
#[test]
fn a_failed_bind_names_the_key_at_fault() {
    let (_e, addr) = exporter();
    let taken = Exporter::start("127.0.0.1", addr.port())
        .err()
        .expect("in use");
    assert!(
        taken.to_string().contains("monitor.prometheus_port"),
        "{taken}"
    );
    // (192.0.2.0/24 is documentation's own range: on no machine. A host
    // that allows binding any address, ip_nonlocal_bind, says nothing.)
    if let Err(elsewhere) = Exporter::start("192.0.2.1", 0) {
        assert!(
            elsewhere.to_string().contains("monitor.prometheus_host"),
            "{elsewhere}"
        );
    }
}
