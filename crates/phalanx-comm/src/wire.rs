//! Length-prefixed frames and the challenge-response handshake.
//!
//! Both the rendezvous store and the rank-to-rank transport start every
//! connection with a mutual HMAC-SHA256 challenge-response over the job
//! secret: each side sends a random nonce and must answer the other's with
//! `HMAC(secret, nonce || role || context)`. The secret itself never crosses
//! the wire, and a replayed answer is useless because nonces are fresh. The
//! context is empty for the store; between ranks it names the group and
//! both ranks, so that an answer is good for one link only.
//!
//! What ranks publish in a store that others may write (their addresses,
//! under torchrun's unauthenticated agent store) is signed with the secret
//! too: see [`sign_record`].

use crate::error::{CommError, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

type HmacSha256 = Hmac<Sha256>;

const HELLO: &[u8; 8] = b"PHALANX1";
const NONCE: usize = 32;

/// Fresh random bytes from the operating system.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    getrandom::getrandom(&mut v).expect("operating system random source failed");
    v
}

/// Set by a launcher that made its job's `PHALANX_SECRET` itself (none
/// was exported), to a mark of that secret (`secret_file::made_mark`):
/// ranks holding it hold a secret no service outside the job (a
/// fault-tolerance lighthouse) can hold; a secret exported since is the
/// user's.
pub const SECRET_MADE: &str = "PHALANX_SECRET_MADE";

/// A new job secret as hex, for launchers.
pub fn new_secret_hex() -> String {
    to_hex(&random_bytes(32))
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn mac(secret: &[u8], nonce: &[u8], role: &[u8], context: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC accepts any key length");
    m.update(nonce);
    m.update(role);
    m.update(context);
    m
}

/// Bytes of a signed record's tag: a newline, then the MAC in hex.
const RECORD_TAG: usize = 1 + 2 * 32;

fn record_mac(secret: &[u8], prefix: &str, kind: &str, rank: usize, value: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC accepts any key length");
    m.update(b"phalanx store record v1\0");
    for field in [prefix.as_bytes(), kind.as_bytes(), value] {
        m.update(&(field.len() as u64).to_le_bytes());
        m.update(field);
    }
    m.update(&(rank as u64).to_le_bytes());
    m
}

/// A record for a store that others may write (torchrun's agent store has
/// no authentication): `value`, a newline and `HMAC(secret, prefix, kind,
/// rank, value)` in hex. The MAC binds the value to the group (`prefix`),
/// the kind of record and the rank that published it, so a record can be
/// neither forged nor moved to another rank's or group's key.
pub fn sign_record(secret: &[u8], prefix: &str, kind: &str, rank: usize, value: &[u8]) -> Vec<u8> {
    let tag = record_mac(secret, prefix, kind, rank, value)
        .finalize()
        .into_bytes();
    let mut out = Vec::with_capacity(value.len() + RECORD_TAG);
    out.extend_from_slice(value);
    out.push(b'\n');
    out.extend_from_slice(to_hex(&tag).as_bytes());
    out
}

/// The value of a record made by [`sign_record`] with the same secret,
/// prefix, kind and rank; `None` if it is anything else (forged, moved from
/// another key, signed with another secret, unsigned, cut short).
pub fn open_record<'a>(
    secret: &[u8],
    prefix: &str,
    kind: &str,
    rank: usize,
    record: &'a [u8],
) -> Option<&'a [u8]> {
    let at = record.len().checked_sub(RECORD_TAG)?;
    let (value, tag) = record.split_at(at);
    let tag = from_hex(std::str::from_utf8(tag.strip_prefix(b"\n")?).ok()?)?;
    record_mac(secret, prefix, kind, rank, value)
        .verify_slice(&tag)
        .ok()?;
    Some(value)
}

/// A byte stream whose read timeout can be read and set: what the handshake
/// needs from a connection (TCP or Unix domain).
pub trait ReadTimeout {
    fn read_timeout(&self) -> std::io::Result<Option<Duration>>;
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl ReadTimeout for TcpStream {
    fn read_timeout(&self) -> std::io::Result<Option<Duration>> {
        TcpStream::read_timeout(self)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

impl ReadTimeout for UnixStream {
    fn read_timeout(&self) -> std::io::Result<Option<Duration>> {
        UnixStream::read_timeout(self)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
}

/// Run the mutual handshake within `timeout` in all (see `handshake_until`).
pub fn handshake<S: Read + Write + ReadTimeout>(
    s: &mut S,
    secret: &[u8],
    server: bool,
    timeout: Duration,
) -> Result<()> {
    handshake_until(s, secret, server, Instant::now() + timeout)
}

/// Run the mutual handshake. `server` says which side of the connection we
/// are (the roles are mixed into the MACs so one side's answer cannot be
/// reflected back as the other's). Fails with `Auth` on a wrong secret, and
/// with `Timeout` once `deadline` passes: the deadline bounds the whole
/// exchange, so a peer that sends one byte at a time cannot stretch it.
/// The same handshake runs on TCP and Unix domain connections.
pub fn handshake_until<S: Read + Write + ReadTimeout>(
    s: &mut S,
    secret: &[u8],
    server: bool,
    deadline: Instant,
) -> Result<()> {
    handshake_bound(s, secret, server, deadline, &[])
}

/// [`handshake_until`] with `context` mixed into both answers: the two
/// sides succeed only if they agree on it. The rank-to-rank transport
/// passes the group and both ranks (dialer and acceptor), so an answer
/// given on one link is no good on any other: a relay that passes one
/// rank's dial on to a different rank fails the handshake. An empty
/// context is the plain handshake.
pub fn handshake_bound<S: Read + Write + ReadTimeout>(
    s: &mut S,
    secret: &[u8],
    server: bool,
    deadline: Instant,
    context: &[u8],
) -> Result<()> {
    let old = s.read_timeout()?;
    let (my_role, peer_role): (&[u8], &[u8]) = if server {
        (b"server", b"client")
    } else {
        (b"client", b"server")
    };
    if Instant::now() >= deadline {
        return Err(CommError::Timeout(
            "handshake: no time left before the set-up deadline".into(),
        ));
    }
    let my_nonce = random_bytes(NONCE);
    let mut out = Vec::with_capacity(HELLO.len() + NONCE);
    out.extend_from_slice(HELLO);
    out.extend_from_slice(&my_nonce);
    s.write_all(&out)?;

    let mut hello = [0u8; 8 + NONCE];
    read_exact_until(s, &mut hello, deadline, "handshake hello")?;
    if &hello[..8] != HELLO {
        return Err(CommError::Protocol(
            "peer is not speaking the Phalanx protocol".into(),
        ));
    }
    let peer_nonce = &hello[8..];
    // Answer the peer's challenge, then check its answer to ours.
    let answer = mac(secret, peer_nonce, my_role, context)
        .finalize()
        .into_bytes();
    s.write_all(&answer)?;
    let mut theirs = [0u8; 32];
    read_exact_until(s, &mut theirs, deadline, "handshake answer")?;
    mac(secret, &my_nonce, peer_role, context)
        .verify_slice(&theirs)
        .map_err(|_| CommError::Auth("peer does not hold the job secret".into()))?;
    s.set_read_timeout(old)?;
    Ok(())
}

/// `read_exact` that gives up at `deadline` in total, however the bytes
/// trickle in. Leaves the read timeout set to at most what was left.
pub fn read_exact_until<S: Read + ReadTimeout>(
    s: &mut S,
    mut buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero timeout is refused by the socket API ("cannot set a 0
        // duration timeout"): a spent deadline is a timeout of ours.
        if left.is_zero() {
            return Err(CommError::Timeout(format!(
                "{what}: peer did not send it in time"
            )));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(buf) {
            Ok(0) => return Err(CommError::Protocol(format!("{what}: connection closed"))),
            Ok(n) => buf = &mut buf[n..],
            Err(e) => match e.kind() {
                std::io::ErrorKind::Interrupted
                | std::io::ErrorKind::WouldBlock
                | std::io::ErrorKind::TimedOut => {}
                _ => return Err(CommError::Io(format!("{what}: {e}"))),
            },
        }
    }
    Ok(())
}

/// The shortest job secret accepted from the environment, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;

/// Parse a job secret given as hex (`PHALANX_SECRET`): at least
/// `MIN_SECRET_BYTES` bytes of it. The error says what is wrong and how to
/// make a good one, without echoing the secret.
pub fn parse_secret(hex: &str) -> std::result::Result<Vec<u8>, String> {
    let how = "e.g. `export PHALANX_SECRET=$(openssl rand -hex 32)`";
    let hex = hex.trim();
    let bytes = from_hex(hex).ok_or_else(|| {
        format!(
            "PHALANX_SECRET is not hex (want an even number of the digits 0-9 a-f, {} characters given); {how}",
            hex.len()
        )
    })?;
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "PHALANX_SECRET is too short: {} bytes ({} hex digits), at least {MIN_SECRET_BYTES} bytes ({} hex digits) are needed; {how}",
            bytes.len(),
            hex.len(),
            2 * MIN_SECRET_BYTES
        ));
    }
    Ok(bytes)
}

/// Write one frame: u32 little-endian length, then the payload.
pub fn write_frame(s: &mut impl Write, payload: &[u8]) -> Result<()> {
    let len =
        u32::try_from(payload.len()).map_err(|_| CommError::Protocol("frame too large".into()))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    Ok(())
}

/// Read one frame, refusing any longer than `max` bytes before allocating.
pub fn read_frame(s: &mut impl Read, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// A cursor over a received frame that turns short or bad input into errors.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(CommError::Protocol("truncated frame".into()));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn i64(&mut self) -> Result<i64> {
        Ok(self.u64()? as i64)
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u64()? as usize;
        self.take(n)
    }
    pub fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| CommError::Protocol("key is not UTF-8".into()))
    }
    pub fn finish(&self) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(CommError::Protocol("trailing bytes in frame".into()))
        }
    }
}

/// Builder for outgoing frames, the mirror of `Reader`.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(self, v: i64) -> Self {
        self.u64(v as u64)
    }
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.buf.extend_from_slice(b);
        self
    }
}
