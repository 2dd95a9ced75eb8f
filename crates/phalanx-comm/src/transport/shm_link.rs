//! Setting up the shared-memory data path of same-host pairs (see
//! `super::shm` for the ring itself): the offer exchange over each
//! authenticated Unix socket, and the receiving end handed to a reader
//! thread.

use super::shm::{recv_offer, send_offer, Ring, RingRx, Segment, Spin};
use super::shm_coll::SLOT_BYTES;
use super::{Stream, Transport};
use crate::config::{Config, TransportPref};
use crate::error::{CommError, Result};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// (this rank's sending ring, the peer's ring we read), per rank.
pub(crate) type Rings = Vec<Option<(Arc<Ring>, Arc<Ring>)>>;

/// What the offers set up: the rings per peer, and every rank's
/// all-reduce slot (`super::shm_coll`) when every peer shares memory.
pub(crate) struct Offers {
    pub rings: Rings,
    pub slots: Option<Vec<Segment>>,
}

/// Offer every Unix-socket peer a ring (and this rank's all-reduce slot)
/// and take theirs: each side sends one byte (with both descriptors
/// attached, or none to decline) and then reads the peer's. A pair uses shared memory when both offered;
/// under `PHALANX_TRANSPORT=shm` anything else is an error naming the
/// peer. Runs before the reader threads start, so the sockets carry
/// nothing else; every offer is sent before any is read, and one byte
/// always fits in the socket buffer, so the exchange cannot deadlock.
pub(crate) fn exchange(
    peers: &[Option<(Stream, String)>],
    rank: usize,
    cfg: &Config,
    deadline: Instant,
) -> Result<Offers> {
    let forced = cfg.transport == TransportPref::Shm;
    if forced && cfg.net_emulate.is_some() {
        return Err(CommError::Invalid(
            "PHALANX_TRANSPORT=shm cannot be combined with PHALANX_NET_EMULATE, which shapes \
             socket traffic; use PHALANX_TRANSPORT=auto or uds"
                .into(),
        ));
    }
    let offer = matches!(cfg.transport, TransportPref::Auto | TransportPref::Shm)
        && cfg.net_emulate.is_none();
    let peer_err = |j: usize, host: &str, reason: String| CommError::PeerDead {
        rank: j,
        host: host.to_string(),
        reason,
    };
    let mut own = Vec::with_capacity(peers.len());
    let mut warned = false;
    let slot = if offer
        && peers
            .iter()
            .any(|p| matches!(p, Some((Stream::Unix(_), _))))
    {
        match Segment::create(SLOT_BYTES) {
            Ok(s) => Some(s),
            Err(e) if forced => {
                return Err(CommError::Io(format!(
                    "PHALANX_TRANSPORT=shm: rank {rank} cannot create a shared-memory segment: {e}"
                )))
            }
            Err(e) => {
                eprintln!("[phalanx] rank {rank}: no shared memory ({e}); using Unix sockets");
                warned = true;
                None
            }
        }
    } else {
        None
    };
    for (j, p) in peers.iter().enumerate() {
        let Some((Stream::Unix(s), host)) = p else {
            own.push(None);
            continue;
        };
        let ring = if slot.is_some() {
            match Ring::create(
                cfg.shm_ring_bytes
                    .clamp(64 << 10, 1 << 30)
                    .next_power_of_two(),
            ) {
                Ok(r) => Some(r),
                Err(e) if forced => {
                    return Err(CommError::Io(format!(
                    "PHALANX_TRANSPORT=shm: rank {rank} cannot create a shared-memory segment: {e}"
                )))
                }
                Err(e) => {
                    if !warned {
                        eprintln!(
                            "[phalanx] rank {rank}: no shared memory ({e}); using Unix sockets"
                        );
                        warned = true;
                    }
                    None
                }
            }
        } else {
            None
        };
        let fds: Vec<_> = match (&ring, &slot) {
            (Some(r), Some(s)) => vec![&r.1, &s.1],
            _ => vec![],
        };
        send_offer(s.as_raw_fd(), &fds)
            .map_err(|e| peer_err(j, host, format!("shared-memory offer failed: {e}")))?;
        own.push(ring.map(|r| r.0));
    }
    let mut rings = Vec::with_capacity(peers.len());
    let mut slots: Vec<Option<Segment>> = (0..peers.len()).map(|_| None).collect();
    for (j, (p, mine)) in peers.iter().zip(own).enumerate() {
        let Some((Stream::Unix(s), host)) = p else {
            rings.push(None);
            continue;
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))?;
        let theirs = recv_offer(s.as_raw_fd()).map_err(|e| {
            peer_err(
                j,
                host,
                format!("no shared-memory offer received during set-up: {e}"),
            )
        })?;
        let bad = |e: std::io::Error| {
            peer_err(j, host, format!("offered a bad shared-memory segment: {e}"))
        };
        let mut theirs = theirs.into_iter();
        match (mine, theirs.next(), theirs.next()) {
            (Some(tx), Some(ring_fd), Some(slot_fd)) => {
                let rx = Ring::open(ring_fd).map_err(bad)?;
                slots[j] = Some(Segment::open(slot_fd, SLOT_BYTES).map_err(bad)?);
                rings.push(Some((Arc::new(tx), Arc::new(rx))));
            }
            (_, Some(_), None) => {
                return Err(bad(std::io::Error::other(
                    "one descriptor where two belong",
                )))
            }
            (_, theirs, _) if forced => {
                return Err(CommError::Invalid(format!(
                    "PHALANX_TRANSPORT=shm: rank {j} ({host}) shares this host but {}",
                    if theirs.is_none() {
                        "offered no shared memory (its PHALANX_TRANSPORT is uds, or it could not create a segment)"
                    } else {
                        "this rank could not create a segment"
                    }
                )));
            }
            _ => rings.push(None),
        }
    }
    // The in-place all-reduce needs every other rank on this host.
    let all = rings
        .iter()
        .enumerate()
        .all(|(j, r)| j == rank || r.is_some());
    let slots = match slot {
        Some((mine, _fd)) if all => {
            slots[rank] = Some(mine);
            slots.into_iter().collect::<Option<Vec<_>>>()
        }
        _ => None,
    };
    Ok(Offers { rings, slots })
}

/// The receiving end of a peer's ring for its reader thread: reads give up
/// once the transport has failed, is closing or is gone.
pub(crate) fn ring_reader(rx: Arc<Ring>, spin: Spin, t: Weak<Transport>) -> RingRx {
    RingRx::new(
        rx,
        spin,
        Box::new(move || match t.upgrade() {
            None => Some(std::io::ErrorKind::BrokenPipe.into()),
            Some(t)
                if t.closing.load(Ordering::SeqCst) || t.failed_flag.load(Ordering::Acquire) =>
            {
                Some(std::io::ErrorKind::ConnectionAborted.into())
            }
            Some(_) => None,
        }),
    )
}
