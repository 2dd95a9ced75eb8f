//! The per-connection threads: a reader that drains one byte stream (a
//! socket, or a shared-memory ring) into the inbox, and the heartbeat.

use super::*;
use std::io::Read;
use std::sync::Weak;

/// What a reader thread reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Everything a peer sends: a socket without shared memory beside it.
    All,
    /// The control socket of a peer whose data goes through shared memory:
    /// heartbeats, ABORT and the goodbye. A clean goodbye here ends this
    /// reader only; the data reader marks the peer closed when it reaches
    /// the goodbye in the ring, after the data sent before it.
    Control,
    /// The shared-memory ring of a peer (no heartbeats: silence is normal;
    /// reads end when the transport fails or closes).
    Data,
}

pub(crate) fn reader_loop<S: Read>(
    t: Weak<Transport>,
    mut s: S,
    peer: usize,
    host: String,
    hb: Duration,
    role: Role,
) {
    // The message whose frames are arriving (key, data, bytes so far),
    // while its frames say more follow (see `Transport::send`).
    let mut partial: Option<Partial> = None;
    let err = loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = s.read_exact(&mut h) {
            break describe_read_error(e, hb);
        }
        let kind = h[0];
        let chan = u64::from_le_bytes(h[8..16].try_into().unwrap());
        let seq = u64::from_le_bytes(h[16..24].try_into().unwrap());
        let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
        if len > MAX_DATA_FRAME || (kind == K_DATA && len > frame_limit()) {
            break format!("sent a frame of {len} bytes (limit {})", frame_limit());
        }
        let Some(tr) = t.upgrade() else { return };
        match kind {
            K_DATA if h[1] & F_MORE != 0 || partial.is_some() => {
                let key = (peer, chan, seq);
                let p = partial.get_or_insert_with(|| Partial {
                    key,
                    words: Vec::new(),
                    len: 0,
                });
                if let Err(e) = p.read_frame(&mut s, key, len, hb) {
                    break e;
                }
                if h[1] & F_MORE == 0 {
                    let Partial { words, len, .. } = partial.take().unwrap();
                    tr.inbox
                        .lock()
                        .unwrap()
                        .queues
                        .entry(key)
                        .or_default()
                        .push_back(Msg { words, len });
                    tr.arrived.notify_all();
                }
            }
            K_DATA => {
                let key = (peer, chan, seq);
                let mut ib = tr.inbox.lock().unwrap();
                let direct = if ib.queues.get(&key).is_none_or(|q| q.is_empty()) {
                    match ib.posted.get_mut(&key) {
                        Some(q) if q.front().is_some_and(|p| p.len == len) => {
                            let p = q.pop_front();
                            if q.is_empty() {
                                ib.posted.remove(&key);
                            }
                            p
                        }
                        _ => None,
                    }
                } else {
                    None
                };
                if let Some(p) = direct {
                    ib.slots.insert(p.id, Slot::Filling);
                    drop(ib);
                    // SAFETY: whoever posted the region keeps it valid and
                    // untouched while its slot is Filling (`Posts` waits).
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.ptr as *mut u8, p.len) };
                    let res = read_fully(&mut s, dst);
                    let state = if res.is_ok() {
                        Slot::Done
                    } else {
                        Slot::Failed
                    };
                    tr.inbox.lock().unwrap().slots.insert(p.id, state);
                    tr.arrived.notify_all();
                    match res {
                        Ok(()) => continue,
                        Err(e) => break describe_read_error(e, hb),
                    }
                }
                drop(ib);
                let mut words = tr.take_buf(len.div_ceil(8));
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                if let Err(e) = read_fully(&mut s, &mut bytes[..len]) {
                    break describe_read_error(e, hb);
                }
                let mut ib = tr.inbox.lock().unwrap();
                ib.queues
                    .entry((peer, chan, seq))
                    .or_default()
                    .push_back(Msg { words, len });
                drop(ib);
                tr.arrived.notify_all();
            }
            // A heartbeat carries nothing: a length would leave its bytes to
            // be read as the next frame's header.
            K_HEARTBEAT if len != 0 => break format!("sent a heartbeat frame of {len} bytes"),
            K_HEARTBEAT => {}
            K_ABORT => {
                let mut reason = vec![0u8; len.min(1 << 16)];
                let _ = s.read_exact(&mut reason);
                tr.fail(CommError::Aborted(format!(
                    "rank {peer} ({host}) aborted: {}",
                    String::from_utf8_lossy(&reason)
                )));
                return;
            }
            K_GOODBYE => {
                // A goodbye after an error carries that error: pass it on,
                // so the rank that really failed is named everywhere.
                let mut why = vec![0u8; len.min(1 << 16)];
                let _ = s.read_exact(&mut why);
                if why.is_empty() && role == Role::Control {
                    return;
                }
                if why.is_empty() {
                    tr.inbox.lock().unwrap().closed.insert(peer, ());
                    tr.arrived.notify_all();
                } else {
                    tr.fail(CommError::Aborted(format!(
                        "rank {peer} ({host}) stopped after an error: {}",
                        String::from_utf8_lossy(&why)
                    )));
                }
                return;
            }
            other => break format!("sent an unknown frame kind {other}"),
        }
    };
    if let Some(tr) = t.upgrade() {
        if tr.closing.load(Ordering::SeqCst) || tr.inbox.lock().unwrap().closed.contains_key(&peer)
        {
            return;
        }
        tr.fail(CommError::PeerDead {
            rank: peer,
            host,
            reason: err,
        });
    }
}

/// A message of several frames, joined as its frames arrive (never
/// placed in a posted region: those take single frames only). Memory
/// grows with the bytes that really came, not with a length announced.
struct Partial {
    key: Key,
    words: Vec<u64>,
    len: usize,
}

impl Partial {
    /// Append the next frame (`len` bytes for `key`) from `s`; `Err` with
    /// what ends the connection.
    fn read_frame<S: Read>(
        &mut self,
        s: &mut S,
        key: Key,
        len: usize,
        hb: Duration,
    ) -> std::result::Result<(), String> {
        if key != self.key {
            return Err(format!(
                "sent a frame for channel {} #{} in the middle of a message for channel {} #{}",
                key.1, key.2, self.key.1, self.key.2
            ));
        }
        let end = self.len + len;
        self.words.resize(end.div_ceil(8), 0);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        read_fully(s, &mut bytes[self.len..end]).map_err(|e| describe_read_error(e, hb))?;
        self.len = end;
        Ok(())
    }
}

/// read_exact that tolerates read timeouts in the middle of a payload as
/// long as bytes keep coming (the timeout is for a silent peer).
fn read_fully<S: Read>(s: &mut S, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn describe_read_error(e: std::io::Error, hb: Duration) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "connection closed (process exited or crashed)".into(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!(
                "no heartbeat for {:.1} s (host down or process stopped)",
                hb.as_secs_f64()
            )
        }
        _ => format!("connection error: {e}"),
    }
}

pub(crate) fn heartbeat_loop(t: Weak<Transport>, every: Duration) {
    let h = header(K_HEARTBEAT, 0, 0, 0);
    loop {
        std::thread::sleep(every);
        let Some(tr) = t.upgrade() else { return };
        if tr.closing.load(Ordering::SeqCst) || tr.failed_flag.load(Ordering::Acquire) {
            return;
        }
        for (peer, p) in tr.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            // A busy writer is already sending bytes, which is as good.
            if let Ok(mut w) = p.writer.try_lock() {
                let mut wrote = 0;
                let r = tr.write_all(&mut w, &h, Instant::now() + every, &mut wrote);
                if let (Err(e), true) = (&r, wrote > 0) {
                    tr.tear(peer, p, e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a reader makes of `bytes` from peer 1: the failure recorded.
    fn read(bytes: Vec<u8>) -> Option<CommError> {
        let t = Arc::new(Transport::new(0, 2, vec![None, None]));
        let s = std::io::Cursor::new(bytes);
        reader_loop(
            Arc::downgrade(&t),
            s,
            1,
            "h".into(),
            Duration::from_secs(1),
            Role::All,
        );
        t.failure()
    }

    /// A heartbeat that announces a length would leave its bytes to be
    /// taken for the next header: the connection ends, saying so.
    #[test]
    fn a_heartbeat_with_a_length_ends_the_connection() {
        let mut bytes = header(K_HEARTBEAT, 0, 0, 32).to_vec();
        // A data frame's header hidden in the heartbeat's "payload".
        bytes.extend_from_slice(&header(K_DATA, 7, 0, 0));
        let e = read(bytes)
            .expect("the reader failed the transport")
            .to_string();
        assert!(e.contains("heartbeat frame of 32 bytes"), "{e}");
        // A plain heartbeat, then the end of the stream: no such complaint.
        let e = read(header(K_HEARTBEAT, 0, 0, 0).to_vec()).map(|e| e.to_string());
        assert!(
            e.as_ref().is_none_or(|e| !e.contains("heartbeat frame")),
            "{e:?}"
        );
    }
}
