//! Setting up the shared-memory data path of same-host pairs (see
//! `super::shm` for the ring itself): the offer exchange over each
//! authenticated Unix socket, and the receiving end handed to a reader
//! thread; the descriptors travel as SCM_RIGHTS ancillary data.

use super::shm::{Ring, RingRx, Segment, Spin};
use super::shm_coll::SLOT_BYTES;
use super::{Stream, Transport};
use crate::config::{Config, TransportPref};
use crate::error::{CommError, Result};
use std::io;
use std::os::fd::AsRawFd;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
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

/// Most descriptors in one offer.
const MAX_OFFER: usize = 2;

/// Offer this side's segments (or none) to the peer on a connected Unix
/// socket: one byte, the number of descriptors attached.
pub(crate) fn send_offer(sock: RawFd, fds: &[&OwnedFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_OFFER);
    let tag = [fds.len() as u8];
    let mut iov = libc::iovec {
        iov_base: tag.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: a msghdr built over live local buffers; the control buffer is
    // large and aligned enough for one descriptor.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let bytes = (fds.len() * std::mem::size_of::<libc::c_int>()) as u32;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = libc::CMSG_SPACE(bytes) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
            for (k, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(
                    (libc::CMSG_DATA(c) as *mut libc::c_int).add(k),
                    fd.as_raw_fd(),
                );
            }
        }
        loop {
            let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
            if n == 1 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 {
                e
            } else {
                io::ErrorKind::WriteZero.into()
            });
        }
    }
}

/// Receive the peer's offer (blocking up to the socket's read timeout):
/// the descriptors it attached, none if it declines.
pub(crate) fn recv_offer(sock: RawFd) -> io::Result<Vec<OwnedFd>> {
    let mut tag = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: tag.as_mut_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: as in send_offer; every descriptor received is wrapped in an
    // OwnedFd at once, so none leaks.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        let n = loop {
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            break n;
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut fds = Vec::new();
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for k in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned((data as *const libc::c_int).add(k));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared-memory offer carried too many descriptors",
            ));
        }
        match tag[0] as usize {
            t if t == fds.len() && t <= MAX_OFFER => Ok(fds),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "malformed shared-memory offer",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_pass_descriptors_and_refuse_unsealed_segments() {
        use std::os::unix::net::UnixStream;
        let (a, b) = UnixStream::pair().unwrap();
        let (_ring, fd) = Ring::create(8192).unwrap();
        let (_seg, sfd) = Segment::create(12288).unwrap();
        send_offer(a.as_raw_fd(), &[&fd, &sfd]).unwrap();
        send_offer(a.as_raw_fd(), &[]).unwrap();
        let mut got = recv_offer(b.as_raw_fd()).unwrap();
        assert_eq!(got.len(), 2);
        assert!(Segment::open(got.pop().unwrap(), 12288).is_ok());
        assert!(Ring::open(got.pop().unwrap()).is_ok());
        assert!(recv_offer(b.as_raw_fd()).unwrap().is_empty());
        // A plain memfd (not sealed) is refused.
        // SAFETY: creating and sizing a memfd we own.
        let plain = unsafe {
            let raw = libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC);
            assert!(raw >= 0);
            assert_eq!(libc::ftruncate(raw, (4096 + 8192) as libc::off_t), 0);
            OwnedFd::from_raw_fd(raw)
        };
        let e = Ring::open(plain).err().unwrap();
        assert!(e.to_string().contains("sealed"), "{e}");
    }
}
