//! The store's server: one thread per authenticated connection, one map.

use super::*;
use crate::error::{CommError, Result};
use crate::wire::{self, Reader, Writer};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    secret: Vec<u8>,
    stop: AtomicBool,
}

/// A running store server; it stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl StoreServer {
    /// Bind and start serving. Bind to loopback for single-host jobs; a
    /// port already in use is reported as such.
    pub fn bind(addr: &str, secret: Vec<u8>) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Io(format!("cannot bind the rendezvous store to {addr}: {e}"))
        })?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            secret,
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("phalanx-store".into())
            .spawn(move || accept_loop(listener, sh))?;
        Ok(StoreServer { addr, shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Wake the accept loop so it sees the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    for conn in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        let sh = sh.clone();
        let _ = std::thread::Builder::new()
            .name("phalanx-store-conn".into())
            .spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into());
                if let Err(e) = serve(stream, &sh) {
                    if !sh.stop.load(Ordering::SeqCst) {
                        eprintln!("[phalanx store] dropped connection from {peer}: {e}");
                    }
                }
            });
    }
}

fn serve(mut s: TcpStream, sh: &Shared) -> Result<()> {
    s.set_nodelay(true)?;
    wire::handshake(&mut s, &sh.secret, true, Duration::from_secs(10))?;
    loop {
        let frame = match wire::read_frame(&mut s, MAX_FRAME) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(CommError::Protocol(e.to_string())),
        };
        if sh.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reply = handle(&frame, sh)?;
        wire::write_frame(&mut s, &reply)?;
    }
}

fn handle(frame: &[u8], sh: &Shared) -> Result<Vec<u8>> {
    let mut r = Reader::new(frame);
    let op = r.u8()?;
    let w = Writer::default();
    let reply = match op {
        OP_SET => {
            let k = r.string()?;
            let v = r.bytes()?.to_vec();
            r.finish()?;
            sh.state.lock().unwrap().map.insert(k, v);
            sh.changed.notify_all();
            w.u8(R_OK)
        }
        OP_GET => {
            let k = r.string()?;
            r.finish()?;
            match sh.state.lock().unwrap().map.get(&k) {
                Some(v) => w.u8(R_OK).bytes(v),
                None => w.u8(R_NOT_FOUND),
            }
        }
        OP_WAIT => {
            let n = r.u64()? as usize;
            if n > 1 << 16 {
                return Err(CommError::Protocol(format!("wait for {n} keys")));
            }
            let keys: Vec<String> = (0..n).map(|_| r.string()).collect::<Result<_>>()?;
            let timeout = Duration::from_millis(r.u64()?);
            r.finish()?;
            let deadline = Instant::now() + timeout;
            let mut st = sh.state.lock().unwrap();
            loop {
                let missing: Vec<&String> =
                    keys.iter().filter(|k| !st.map.contains_key(*k)).collect();
                if missing.is_empty() {
                    break w.u8(R_OK);
                }
                let now = Instant::now();
                if now >= deadline || sh.stop.load(Ordering::SeqCst) {
                    let names: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
                    break w.u8(R_TIMEOUT).bytes(names.join(", ").as_bytes());
                }
                st = sh.changed.wait_timeout(st, deadline - now).unwrap().0;
            }
        }
        OP_ADD => {
            let k = r.string()?;
            let delta = r.i64()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let cur = match st.map.get(&k) {
                Some(v) => match std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    Some(n) => n,
                    None => {
                        return Ok(w
                            .u8(R_ERROR)
                            .bytes(format!("key {k} is not a counter").as_bytes())
                            .buf)
                    }
                },
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            st.map.insert(k, new.to_string().into_bytes());
            drop(st);
            sh.changed.notify_all();
            w.u8(R_OK).i64(new)
        }
        OP_CAS => {
            // Set to `desired` if the current value equals `expected` (a
            // missing key matches an empty `expected`); reply the value after.
            let k = r.string()?;
            let expected = r.bytes()?;
            let desired = r.bytes()?;
            r.finish()?;
            let mut st = sh.state.lock().unwrap();
            let matches = match st.map.get(&k) {
                Some(cur) => cur.as_slice() == expected,
                None => expected.is_empty(),
            };
            if matches {
                st.map.insert(k.clone(), desired.to_vec());
            }
            let now = st.map.get(&k).cloned().unwrap_or_default();
            drop(st);
            sh.changed.notify_all();
            w.u8(R_OK).bytes(&now)
        }
        OP_DELETE => {
            let k = r.string()?;
            r.finish()?;
            let existed = sh.state.lock().unwrap().map.remove(&k).is_some();
            w.u8(R_OK).u8(existed as u8)
        }
        OP_NUM_KEYS => {
            r.finish()?;
            let n = sh.state.lock().unwrap().map.len();
            w.u8(R_OK).u64(n as u64)
        }
        other => return Err(CommError::Protocol(format!("unknown store opcode {other}"))),
    };
    Ok(reply.buf)
}
