//! The metrics endpoint's HTTP server: just enough HTTP/1.x for a
//! scraper's `GET`, bounded in what any client may cost rank 0.
//!
//! A general-purpose server buffers a request head for as long as a client
//! sends it (`tiny_http` grew rank 0 from 105 MB to 980 MB in 24 s on one
//! unterminated header). Here:
//!
//! - the request head (request line and headers) is at most
//!   [`MAX_HEADER`] bytes: past that the client gets `431` and is closed;
//! - it must arrive whole within [`HEADER_TIMEOUT`] of the connect, however
//!   it trickles: past that the client gets `408` and is closed;
//! - at most [`MAX_CONNS`] connections are served at once; a new one sheds
//!   the oldest (a scraper sends its request at once, so the oldest is the
//!   one most likely to be idle or slow on purpose);
//! - a reply is written with a [`WRITE_TIMEOUT`], so a client that never
//!   reads cannot hold a thread either;
//! - every reply closes the connection (no keep-alive), so nothing is
//!   buffered across requests.
//!
//! Memory is thus bounded by `MAX_CONNS` × (`MAX_HEADER` + a read chunk)
//! plus the replies, and threads by `MAX_CONNS`.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest request head accepted, in bytes (Prometheus sends ~200).
pub const MAX_HEADER: usize = 8 << 10;
/// How long a client has from its connect to the end of its request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing one reply may block on a client that does not read.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once.
pub const MAX_CONNS: usize = 16;

/// A reply: status, content type, body.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn text(status: u16, body: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.as_bytes().to_vec(),
        }
    }
}

/// What answers a request for a path (the request target as sent).
pub type Handler = Arc<dyn Fn(&str) -> Reply + Send + Sync>;

/// Connections being served, oldest first, with a handle to shut each.
#[derive(Default)]
struct Conns {
    next: u64,
    open: BTreeMap<u64, TcpStream>,
}

/// Serve `listener` until `stop` is set (checked every 50 ms).
pub fn serve(listener: TcpListener, stop: Arc<AtomicBool>, handler: Handler) {
    // Non-blocking accepts, so that a drop of the exporter is seen promptly
    // without a wake-up connection.
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let conns = Arc::new(Mutex::new(Conns::default()));
    while !stop.load(Ordering::Relaxed) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            // Out of descriptors, most likely: do not spin.
            Err(_) => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let id = {
            let mut c = conns.lock().unwrap();
            while c.open.len() >= MAX_CONNS {
                let (_, oldest) = c.open.pop_first().expect("not empty");
                // Its thread sees the connection end and returns.
                let _ = oldest.shutdown(Shutdown::Both);
            }
            let id = c.next;
            c.next += 1;
            c.open.insert(id, handle);
            id
        };
        let (conns2, handler2) = (conns.clone(), handler.clone());
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                answer(stream, &*handler2);
                conns2.lock().unwrap().open.remove(&id);
            });
        if spawned.is_err() {
            // Dropping the entry closes the connection.
            conns.lock().unwrap().open.remove(&id);
        }
    }
}

/// Read one request head within the limits and answer it.
fn answer(mut s: TcpStream, handler: &dyn Fn(&str) -> Reply) {
    let deadline = Instant::now() + HEADER_TIMEOUT;
    if s.set_nonblocking(false).is_err() || s.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    let head = match read_head(&mut s, deadline) {
        Ok(h) => h,
        Err(Some(reply)) => return send(&mut s, &reply, true),
        Err(None) => return,
    };
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let line = String::from_utf8_lossy(line);
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let reply = match (method, target, version) {
        (Some(m), Some(t), Some(v)) if v.starts_with("HTTP/1.") && parts.next().is_none() => {
            if m == "GET" || m == "HEAD" {
                let r = handler(t);
                return send(&mut s, &r, m == "GET");
            }
            Reply::text(405, "only GET and HEAD are served\n")
        }
        _ => Reply::text(400, "not an HTTP/1.x request line\n"),
    };
    send(&mut s, &reply, true);
}

/// The request head, up to its blank line; or the reply that refuses it
/// (`None`: the client is gone, nothing to answer).
fn read_head(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, Option<Reply>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let end = head_end(&buf);
        // (A whole head read in one go is measured too, not only one that
        // is still coming.)
        if end.unwrap_or(buf.len()) > MAX_HEADER {
            return Err(Some(Reply::text(
                431,
                &format!("request header over {MAX_HEADER} bytes\n"),
            )));
        }
        if let Some(end) = end {
            buf.truncate(end);
            return Ok(buf);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Some(Reply::text(
                408,
                &format!(
                    "request header not complete within {} s\n",
                    HEADER_TIMEOUT.as_secs()
                ),
            )));
        }
        // A timeout per read, re-armed with what is left of the whole.
        if s.set_read_timeout(Some(left)).is_err() {
            return Err(None);
        }
        match s.read(&mut chunk) {
            Ok(0) => return Err(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return Err(None),
        }
    }
}

/// Where the head ends (before its blank line), if it has.
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = buf.windows(2).position(|w| w == b"\n\n");
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn send(s: &mut TcpStream, r: &Reply, body: bool) {
    let reason = match r.status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        _ => "",
    };
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        r.content_type,
        r.body.len()
    );
    if r.status == 405 {
        out += "Allow: GET, HEAD\r\n";
    }
    out += "\r\n";
    let mut bytes = out.into_bytes();
    if body {
        bytes.extend_from_slice(&r.body);
    }
    // A client that hung up or stopped reading is its own business.
    let _ = s.write_all(&bytes);
    let _ = s.shutdown(Shutdown::Write);
}
