//! The client side of PyTorch's TCPStore protocol, enough to rendezvous
//! through the store that torchrun's agent already serves on
//! `MASTER_ADDR:MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! The protocol (c10d's `TCPStore`, both its classic and libuv servers) has
//! no framing and no authentication: a request is one query byte followed by
//! its arguments, little-endian; a string or byte vector is a `u64` length
//! then the bytes; a list of keys is a `u64` count then the strings. A new
//! connection first sends `VALIDATE` with a magic number (no reply); this
//! client then sends `PING` with a nonce and expects it back, so a port that
//! is not a TCPStore is refused at connect, not at the first lookup.
//!
//! | query | arguments | reply |
//! |---|---|---|
//! | `SET` (1) | key, value | none |
//! | `COMPARE_SET` (2) | key, expected, desired | the value after |
//! | `GET` (3) | key | value (the key must exist: `CHECK` first) |
//! | `ADD` (4) | key, `i64` | the new `i64` (stored as decimal text) |
//! | `CHECK` (5) | keys | `u8`: 0 all present, 1 not yet |
//! | `GETNUMKEYS` (7) | | `i64` |
//! | `DELETE_KEY` (8) | key | `i64` keys deleted |
//! | `PING` (13) | `u32` nonce | the nonce |
//!
//! torch's own client puts `/` in front of every key; so does this one, so
//! that `TCPStore.get("phalanx/...")` in Python sees the same names. Waits
//! poll `CHECK` (not the server-side `WAIT`), so every wait ends at its own
//! deadline and leaves nothing pending on the connection.

use super::MAX_FRAME;
use crate::error::{CommError, Result};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const GETNUMKEYS: u8 = 7;
const DELETE_KEY: u8 = 8;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
const READY: u8 = 0;

/// One request, built in memory and sent with a single write.
#[derive(Default)]
struct Req(Vec<u8>);

impl Req {
    fn new(q: u8) -> Req {
        Req(vec![q])
    }
    fn u32(mut self, v: u32) -> Req {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Req {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Req {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Req {
        let mut r = self.u64(b.len() as u64);
        r.0.extend_from_slice(b);
        r
    }
    fn key(self, k: &str) -> Req {
        self.bytes(format!("/{k}").as_bytes())
    }
}

fn io(e: std::io::Error) -> CommError {
    match e.kind() {
        // The client's read or write timeout (see `StoreClient`).
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Io(format!(
            "torch TCPStore: no progress within the timeout, is the store still running? ({e})"
        )),
        _ => CommError::Io(format!("torch TCPStore: {e}")),
    }
}

fn send(s: &mut TcpStream, r: Req) -> Result<()> {
    s.write_all(&r.0).map_err(io)
}

fn read_n<const N: usize>(s: &mut TcpStream) -> Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b).map_err(io)?;
    Ok(b)
}

fn read_i64(s: &mut TcpStream) -> Result<i64> {
    Ok(i64::from_le_bytes(read_n::<8>(s)?))
}

fn read_vec(s: &mut TcpStream) -> Result<Vec<u8>> {
    let n = u64::from_le_bytes(read_n::<8>(s)?) as usize;
    if n > MAX_FRAME {
        return Err(CommError::Protocol(format!(
            "torch TCPStore: a {n}-byte value is over the {MAX_FRAME}-byte limit"
        )));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).map_err(io)?;
    Ok(v)
}

/// Validate a fresh connection and check that a TCPStore answers on it.
pub(super) fn hello(s: &mut TcpStream, timeout: Duration) -> Result<()> {
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    let nonce = std::process::id() ^ 0x5048_4c58;
    send(s, Req::new(VALIDATE).u32(MAGIC))?;
    send(s, Req::new(PING).u32(nonce))?;
    let back = u32::from_le_bytes(read_n::<4>(s).map_err(|e| {
        CommError::Protocol(format!(
            "no TCPStore answered (is this torchrun's agent store?): {e}"
        ))
    })?);
    if back != nonce {
        return Err(CommError::Protocol(format!(
            "the server did not answer a TCPStore ping (sent {nonce:#x}, got {back:#x})"
        )));
    }
    Ok(())
}

pub(super) fn set(s: &mut TcpStream, key: &str, value: &[u8]) -> Result<()> {
    send(s, Req::new(SET).key(key).bytes(value))
}

pub(super) fn compare_set(
    s: &mut TcpStream,
    key: &str,
    expected: &[u8],
    desired: &[u8],
) -> Result<Vec<u8>> {
    send(
        s,
        Req::new(COMPARE_SET)
            .key(key)
            .bytes(expected)
            .bytes(desired),
    )?;
    read_vec(s)
}

pub(super) fn add(s: &mut TcpStream, key: &str, delta: i64) -> Result<i64> {
    send(s, Req::new(ADD).key(key).i64(delta))?;
    read_i64(s)
}

pub(super) fn check(s: &mut TcpStream, keys: &[&str]) -> Result<bool> {
    let mut r = Req::new(CHECK).u64(keys.len() as u64);
    for k in keys {
        r = r.key(k);
    }
    send(s, r)?;
    match read_n::<1>(s)?[0] {
        READY => Ok(true),
        1 => Ok(false),
        b => Err(CommError::Protocol(format!(
            "torch TCPStore: unexpected CHECK reply {b}"
        ))),
    }
}

pub(super) fn try_get(s: &mut TcpStream, key: &str) -> Result<Option<Vec<u8>>> {
    if !check(s, &[key])? {
        return Ok(None);
    }
    send(s, Req::new(GET).key(key))?;
    read_vec(s).map(Some)
}

pub(super) fn delete(s: &mut TcpStream, key: &str) -> Result<bool> {
    send(s, Req::new(DELETE_KEY).key(key))?;
    Ok(read_i64(s)? > 0)
}

pub(super) fn num_keys(s: &mut TcpStream) -> Result<u64> {
    send(s, Req::new(GETNUMKEYS))?;
    Ok(read_i64(s)?.max(0) as u64)
}

/// Poll until every key exists; at the deadline, fail naming those missing.
pub(super) fn wait(s: &mut TcpStream, keys: &[&str], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if check(s, keys)? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            let mut missing = Vec::new();
            for k in keys {
                if !check(s, &[k])? {
                    missing.push(*k);
                }
            }
            return Err(CommError::Timeout(format!(
                "store keys not set within {timeout:?}: {}",
                missing.join(", ")
            )));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}
