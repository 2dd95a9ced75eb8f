//! The store's client: one connection, blocking requests. It speaks either
//! Phalanx's own authenticated protocol or, under torchrun, PyTorch's
//! TCPStore protocol to the agent's store (see [`super::torch`]).
//!
//! A request that fails part-way (a read or write timeout, a reset) leaves
//! the connection in an unknown state: the late reply, or the rest of a
//! half-sent request, may still be on it, and the next request would read
//! the answer to this one. So such a connection is dropped, and the next
//! call connects afresh (with the same handshake as at connect) instead.

use super::*;
use crate::error::{CommError, Result};
use crate::wire::{self, Reader, Writer};
use std::io::Write;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct StoreClient {
    /// None after a request failed part-way: the next call reconnects.
    conn: Mutex<Option<TcpStream>>,
    addr: String,
    timeout: Duration,
    /// The job secret for Phalanx's store (kept to reconnect); None for a
    /// torch TCPStore.
    secret: Option<Vec<u8>>,
    /// Which server is at the other end.
    torch: bool,
    /// What the server is, for messages ("the rendezvous store").
    what: &'static str,
}

impl StoreClient {
    /// Connect, retrying until `timeout` (the server may start after us,
    /// e.g. when rank 0 hosts it under mpirun), then authenticate.
    pub fn connect(addr: &str, secret: &[u8], timeout: Duration) -> Result<StoreClient> {
        Self::connect_retrying(addr, timeout, Some(secret), "the rendezvous store")
    }

    /// [`StoreClient::connect`] to a store that messages call `what` (the
    /// fault-tolerance lighthouse serves one: "the lighthouse").
    pub fn connect_to(
        what: &'static str,
        addr: &str,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<StoreClient> {
        Self::connect_retrying(addr, timeout, Some(secret), what)
    }

    /// Connect to a PyTorch TCPStore (torchrun's agent store), retrying
    /// until `timeout`. That store has no authentication: the ranks still
    /// authenticate each other with the job secret when they connect.
    pub fn connect_torch(addr: &str, timeout: Duration) -> Result<StoreClient> {
        Self::connect_retrying(addr, timeout, None, "torchrun's store")
    }

    /// `secret`: Phalanx's store; None: a torch TCPStore.
    fn connect_retrying(
        addr: &str,
        timeout: Duration,
        secret: Option<&[u8]>,
        what: &'static str,
    ) -> Result<StoreClient> {
        let deadline = Instant::now() + timeout;
        let mut waiting = crate::patience::Waiting::until(deadline);
        let mut last_err;
        loop {
            match try_connect(addr, secret, write_timeout(timeout)) {
                Ok(s) => {
                    return Ok(StoreClient {
                        conn: Mutex::new(Some(s)),
                        addr: addr.to_string(),
                        timeout,
                        secret: secret.map(<[u8]>::to_vec),
                        torch: secret.is_none(),
                        what,
                    })
                }
                // A wrong secret, or no TCPStore at the other end: final.
                Err(CommError::Auth(m)) => {
                    return Err(CommError::Auth(format!("{what} at {addr}: {m}")))
                }
                Err(CommError::Protocol(m)) if secret.is_none() => {
                    return Err(CommError::Protocol(format!("{what} at {addr}: {m}")))
                }
                Err(e) => last_err = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout(format!(
                    "could not reach {what} at {addr} within {timeout:?}: {last_err}"
                )));
            }
            waiting.tick(|| format!("still trying to reach {what} at {addr}: {last_err}"));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether this client speaks to a PyTorch TCPStore.
    pub fn is_torch(&self) -> bool {
        self.torch
    }

    /// Run `f` on the connection, first reconnecting if an earlier request
    /// failed part-way. If `f` fails, the connection may hold a late reply
    /// or part of a request, so it is dropped: the next call reconnects
    /// rather than read this request's answer as its own.
    fn with_conn<T>(&self, f: impl FnOnce(&mut TcpStream) -> Result<T>) -> Result<T> {
        let mut conn = self.conn.lock().unwrap();
        if conn.is_none() {
            let what = self.what;
            let s = try_connect(
                &self.addr,
                self.secret.as_deref(),
                write_timeout(self.timeout),
            )
            .map_err(|e| {
                CommError::Io(format!(
                    "cannot reconnect to {what} at {} (its connection was dropped after a failed request): {e}",
                    self.addr
                ))
            })?;
            *conn = Some(s);
        }
        let r = f(conn.as_mut().expect("connected above"));
        // A `Timeout` is a whole answer (torch's polled wait: keys not set
        // in time); anything else may have stopped mid-exchange.
        if matches!(r, Err(ref e) if !matches!(e, CommError::Timeout(_))) {
            *conn = None;
        }
        r
    }

    /// How long a reply may take beyond the time the server may wait: the
    /// client's timeout, within 1 to 10 s.
    fn reply_slack(&self) -> Duration {
        self.timeout
            .clamp(Duration::from_secs(1), Duration::from_secs(10))
    }

    /// Run one torch-protocol exchange with a read deadline.
    fn torch_op<T>(
        &self,
        wait: Duration,
        f: impl FnOnce(&mut TcpStream) -> Result<T>,
    ) -> Result<T> {
        let slack = self.reply_slack();
        self.with_conn(|s| {
            s.set_read_timeout(Some(wait.saturating_add(slack)))?;
            f(s)
        })
        .map_err(|e| match e {
            CommError::Io(m) => CommError::Io(format!("{m} (store at {})", self.addr)),
            e => e,
        })
    }

    /// The local address this client uses to reach the store: the address
    /// peers on other hosts can reach us at.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        self.with_conn(|s| Ok(s.local_addr()?.ip()))
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn request(&self, req: Writer, wait: Duration) -> Result<Vec<u8>> {
        let len = u32::try_from(req.buf.len())
            .map_err(|_| CommError::Protocol("store request too large".into()))?;
        let slack = self.reply_slack();
        self.with_conn(|s| {
            s.set_read_timeout(Some(wait.saturating_add(slack)))?;
            s.write_all(&[&len.to_le_bytes()[..], &req.buf].concat())
                .map_err(|e| {
                    let why = match e.kind() {
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                            "it took none of a request for {:?}: is it still running? ({e})",
                            write_timeout(self.timeout)
                        ),
                        _ => e.to_string(),
                    };
                    CommError::Io(format!("rendezvous store at {}: {why}", self.addr))
                })?;
            wire::read_frame(s, MAX_FRAME).map_err(|e| {
                let why = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                        format!("no reply within {:?} ({e})", wait.saturating_add(slack))
                    }
                    _ => e.to_string(),
                };
                CommError::Io(format!("rendezvous store at {}: {why}", self.addr))
            })
        })
    }

    fn ok<'a>(&self, reply: &'a [u8]) -> Result<Reader<'a>> {
        let mut r = Reader::new(reply);
        match r.u8()? {
            R_OK => Ok(r),
            R_ERROR => Err(CommError::Invalid(
                String::from_utf8_lossy(r.bytes()?).into(),
            )),
            s => Err(CommError::Protocol(format!("unexpected store status {s}"))),
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| torch::set(s, key, value));
        }
        let rep = self.request(
            Writer::default()
                .u8(OP_SET)
                .bytes(key.as_bytes())
                .bytes(value),
            Duration::ZERO,
        )?;
        self.ok(&rep).map(|_| ())
    }

    /// Get a key, waiting for it up to the client's timeout (TCPStore's `get`).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key], self.timeout)?;
        self.try_get(key)?
            .ok_or_else(|| CommError::Protocol(format!("key {key} vanished")))
    }

    /// Get a key if present, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| torch::try_get(s, key));
        }
        let rep = self.request(
            Writer::default().u8(OP_GET).bytes(key.as_bytes()),
            Duration::ZERO,
        )?;
        let mut r = Reader::new(&rep);
        match r.u8()? {
            R_OK => Ok(Some(r.bytes()?.to_vec())),
            R_NOT_FOUND => Ok(None),
            R_ERROR => Err(CommError::Invalid(
                String::from_utf8_lossy(r.bytes()?).into(),
            )),
            s => Err(CommError::Protocol(format!("unexpected store status {s}"))),
        }
    }

    /// Wait until all keys exist, or fail naming the missing ones.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| torch::wait(s, keys, timeout));
        }
        let mut w = Writer::default().u8(OP_WAIT).u64(keys.len() as u64);
        for k in keys {
            w = w.bytes(k.as_bytes());
        }
        w = w.u64(timeout.as_millis() as u64);
        let rep = self.request(w, timeout)?;
        let mut r = Reader::new(&rep);
        match r.u8()? {
            R_OK => Ok(()),
            R_TIMEOUT => Err(CommError::Timeout(format!(
                "store keys not set within {:?}: {}",
                timeout,
                String::from_utf8_lossy(r.bytes()?)
            ))),
            R_ERROR => Err(CommError::Invalid(
                String::from_utf8_lossy(r.bytes()?).into(),
            )),
            s => Err(CommError::Protocol(format!("unexpected store status {s}"))),
        }
    }

    /// Atomically add `delta` to a counter key (missing = 0); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| torch::add(s, key, delta));
        }
        let rep = self.request(
            Writer::default()
                .u8(OP_ADD)
                .bytes(key.as_bytes())
                .i64(delta),
            Duration::ZERO,
        )?;
        self.ok(&rep)?.i64()
    }

    /// Set `key` to `desired` if it currently equals `expected` (missing key
    /// matches empty `expected`); returns the value after the call, except
    /// that a missing key with a non-empty `expected` returns `expected`
    /// and stays missing, as PyTorch's TCPStore does.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| {
                torch::compare_set(s, key, expected, desired)
            });
        }
        let rep = self.request(
            Writer::default()
                .u8(OP_CAS)
                .bytes(key.as_bytes())
                .bytes(expected)
                .bytes(desired),
            Duration::ZERO,
        )?;
        Ok(self.ok(&rep)?.bytes()?.to_vec())
    }

    /// Delete a key; true if it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        if self.torch {
            return self.torch_op(Duration::ZERO, |s| torch::delete(s, key));
        }
        let rep = self.request(
            Writer::default().u8(OP_DELETE).bytes(key.as_bytes()),
            Duration::ZERO,
        )?;
        Ok(self.ok(&rep)?.u8()? == 1)
    }

    pub fn num_keys(&self) -> Result<u64> {
        if self.torch {
            return self.torch_op(Duration::ZERO, torch::num_keys);
        }
        let rep = self.request(Writer::default().u8(OP_NUM_KEYS), Duration::ZERO)?;
        self.ok(&rep)?.u64()
    }
}

/// How long one write to the store may block: the client's timeout, within
/// 1 to 30 s (a request is at most a few MiB; a store that takes none of
/// it for that long is not reading).
fn write_timeout(timeout: Duration) -> Duration {
    timeout.clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// One connection attempt: Phalanx's handshake with `secret`, or torch's
/// validate-and-ping without one.
fn try_connect(addr: &str, secret: Option<&[u8]>, write_timeout: Duration) -> Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| CommError::Io(format!("cannot resolve {addr}: {e}")))?
        .collect();
    let mut last = CommError::Io(format!("no address for {addr}"));
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
            Ok(mut s) => {
                s.set_nodelay(true)?;
                // A store that stops reading (its host gone, its buffers
                // full) fails a request instead of blocking it for good.
                s.set_write_timeout(Some(write_timeout))?;
                match secret {
                    Some(k) => wire::handshake(&mut s, k, false, Duration::from_secs(10))?,
                    None => torch::hello(&mut s, Duration::from_secs(10))?,
                }
                return Ok(s);
            }
            Err(e) => last = CommError::Io(e.to_string()),
        }
    }
    Err(last)
}
