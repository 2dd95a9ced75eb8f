//! Shared-memory data path between two ranks on one host.
//!
//! Why: a Unix socket costs two system calls and two kernel copies per
//! chunk, plus a wake-up through the scheduler; a ring in shared memory
//! costs one user-space copy on each side and, while both sides are
//! running, no system call at all (Open MPI's vader and NCCL's SHM
//! transport work the same way).
//!
//! Each direction of a same-host pair is one single-producer
//! single-consumer byte ring in a `memfd`: an anonymous file with no name
//! anywhere (nothing in /dev/shm for another job or user to guess, open or
//! leave behind). The sender creates its ring, seals its size, and passes
//! the descriptor to the receiver over their Unix socket with
//! `SCM_RIGHTS`, after that socket passed the job-secret handshake; both
//! map it and close the descriptor. The kernel frees the memory when the
//! last mapping goes, on every exit path, a crash included.
//!
//! The ring carries exactly the byte stream a socket would (frame headers
//! and payloads, see `super`), so framing, the reader thread, posted
//! receives and every algorithm are shared with the socket transports. The
//! socket stays open beside it for heartbeats, ABORT and the goodbye, so a
//! dead or stopped peer is still detected by its silence there.
//!
//! Waiting: a side that finds the ring empty (or full) spins for a short
//! budget, which is what makes small messages fast when each rank has a
//! core; then it sleeps on a futex on the other side's index (with a
//! timeout, so failures, shutdown and deadlines are always seen). With more
//! ranks than cores the spin budget is zero and it yields once before
//! sleeping, so ranks that share a core do not burn each other's time
//! slices. A side about to sleep raises a flag; the other side issues the
//! wake-up system call only when that flag is up.
//!
//! The peer can write any bytes into the shared header: every index read
//! from it is checked (`head - tail` within the capacity) before use, and
//! the segment's size is sealed so the peer cannot shrink it under us.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The header page: indices and flags, then a magic and the capacity.
const HEADER_PAGE: usize = 4096;
const OFF_HEAD: usize = 0;
const OFF_PROD_WAITING: usize = 8;
const OFF_TAIL: usize = 128;
const OFF_CONS_WAITING: usize = 136;
const OFF_MAGIC: usize = 256;
const OFF_CAP: usize = 264;
const MAGIC: u64 = u64::from_le_bytes(*b"PHXRING1");
/// Largest piece published at once: the consumer starts copying out while
/// the producer still copies in.
const PUBLISH: usize = 256 << 10;
/// Longest sleep between looks at the stop conditions.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// How long a waiting side spins before it sleeps.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spin {
    pub budget: Duration,
    /// Yield the core once before sleeping (ranks outnumber cores).
    pub yield_first: bool,
}

impl Spin {
    /// Spin while every thread that waits on a ring can have a core: each
    /// local rank has two that do (the caller, and the reader thread of
    /// the peer it is waiting for). Otherwise give the core away at once:
    /// measured with 2 ranks on 2 cores, a 50 us spin made an 8-byte
    /// all-reduce 5x slower (59 us against 11 us) and 64 MB ones erratic,
    /// because spinning readers took the cores the ranks' copies needed.
    /// `override_us` is `PHALANX_SHM_SPIN_US`.
    pub fn for_ranks(local_ranks: usize, override_us: Option<f64>) -> Spin {
        Spin::unless_crowded(2 * local_ranks, override_us)
    }

    /// For the in-place all-reduce's barriers, where the only waiters are
    /// the ranks' own calling threads (no reader threads): spin while each
    /// local rank can have a core. Measured with 2 ranks on 2 cores, an
    /// 8-byte all-reduce took 2.2 us spinning against 3.3 us sleeping at
    /// once.
    pub fn for_world(local_ranks: usize, override_us: Option<f64>) -> Spin {
        Spin::unless_crowded(local_ranks, override_us)
    }

    /// Spin 50 us unless `waiters` threads outnumber the cores.
    fn unless_crowded(waiters: usize, override_us: Option<f64>) -> Spin {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let crowded = waiters > cores;
        let budget = match override_us {
            Some(us) => Duration::from_secs_f64(us / 1e6),
            None if crowded => Duration::ZERO,
            None => Duration::from_micros(50),
        };
        Spin {
            budget,
            yield_first: crowded,
        }
    }
}

/// A mapping of a whole segment, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all shared words are accessed
// through atomics, and the data area is handed between the single producer
// and the single consumer by the release/acquire indices.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Map a whole segment, its pages faulted in now (MAP_POPULATE): measured
/// here, first touches of a fresh ring's pages made the first laps of
/// 64 KiB all-reduces 3x slower (110 us against 34 us).
fn map(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
    // SAFETY: mapping a file we hold, shared, at a kernel-chosen address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Mapping {
        ptr: p as *mut u8,
        len,
    })
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A memfd of `len` bytes, every page allocated (a full tmpfs fails here,
/// not later with SIGBUS in the middle of a collective), its size sealed.
fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: plain system calls on a descriptor we own.
    unsafe {
        let fd = OwnedFd::from_raw_fd(cvt(libc::memfd_create(
            name.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        ))?);
        cvt(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
        cvt(libc::fallocate(fd.as_raw_fd(), 0, 0, len as libc::off_t))?;
        cvt(libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        ))?;
        Ok(fd)
    }
}

/// Size and seals of a segment a peer passed us.
fn check_segment(fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: fstat / fcntl on a descriptor we own.
    let (size, seals) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        cvt(libc::fstat(fd.as_raw_fd(), &mut st))?;
        (
            st.st_size as usize,
            cvt(libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS))?,
        )
    };
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "segment is not sealed against shrinking",
        ));
    }
    Ok(size)
}

/// A plain shared segment of a fixed size (`super::shm_coll`'s slots).
pub(crate) struct Segment {
    map: Mapping,
}

impl Segment {
    pub fn create(len: usize) -> io::Result<(Segment, OwnedFd)> {
        let fd = sealed_memfd(c"phalanx-shm-slot", len)?;
        Ok((
            Segment {
                map: map(&fd, len)?,
            },
            fd,
        ))
    }

    /// Map a peer's segment, which must be sealed and exactly `len` bytes.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<Segment> {
        if check_segment(&fd)? != len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "segment has a bad size",
            ));
        }
        Ok(Segment {
            map: map(&fd, len)?,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.map.ptr
    }
}

/// One direction's ring, mapped.
pub(crate) struct Ring {
    map: Mapping,
    cap: usize,
}

impl Ring {
    /// A fresh ring of `cap` data bytes (a power of two) in a sealed memfd;
    /// returns it with the descriptor to pass to the consumer.
    pub fn create(cap: usize) -> io::Result<(Ring, OwnedFd)> {
        assert!(cap.is_power_of_two() && cap >= 4096);
        let fd = sealed_memfd(c"phalanx-shm-ring", HEADER_PAGE + cap)?;
        let ring = Ring {
            map: map(&fd, HEADER_PAGE + cap)?,
            cap,
        };
        ring.word64(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        ring.word64(OFF_CAP).store(cap as u64, Ordering::Release);
        Ok((ring, fd))
    }

    /// Map a ring a peer created and passed to us, after checking that it
    /// is one (size, seals, magic, capacity).
    pub fn open(fd: OwnedFd) -> io::Result<Ring> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        let size = check_segment(&fd)?;
        let cap = size.wrapping_sub(HEADER_PAGE);
        if size <= HEADER_PAGE || !cap.is_power_of_two() || cap > 1 << 30 {
            return Err(bad("segment has a bad size"));
        }
        let ring = Ring {
            map: map(&fd, size)?,
            cap,
        };
        if ring.word64(OFF_MAGIC).load(Ordering::Relaxed) != MAGIC
            || ring.word64(OFF_CAP).load(Ordering::Acquire) != cap as u64
        {
            return Err(bad("segment is not a ring"));
        }
        Ok(ring)
    }

    /// Whether the producer has published bytes the consumer has not read.
    pub fn unread(&self) -> bool {
        self.head().load(Ordering::Acquire) != self.tail().load(Ordering::Acquire)
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: aligned offsets inside the header page, which lives as
        // long as `self`; shared words are only accessed atomically.
        unsafe { &*(self.map.ptr.add(off) as *const AtomicU64) }
    }
    fn word32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in word64.
        unsafe { &*(self.map.ptr.add(off) as *const AtomicU32) }
    }
    fn head(&self) -> &AtomicU64 {
        self.word64(OFF_HEAD)
    }
    fn tail(&self) -> &AtomicU64 {
        self.word64(OFF_TAIL)
    }
    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header page.
        unsafe { self.map.ptr.add(HEADER_PAGE) }
    }

    /// Copy `src` into the data area at stream position `pos` (wrapping).
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let off = (pos as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - off);
        // SAFETY: both pieces lie inside the data area; the producer owns
        // bytes [head, tail + cap) until it publishes them.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), src.len() - first);
        }
    }

    /// Copy from the data area at stream position `pos` into `dst`.
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let off = (pos as usize) & (self.cap - 1);
        let first = dst.len().min(self.cap - off);
        // SAFETY: as in copy_in; the consumer owns [tail, head).
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.data(),
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }
}

/// The 32-bit word of a 64-bit index that changes with it (its low half),
/// for futex calls: the index never moves by 2^32 between two looks, since
/// it moves by at most the capacity while the other side waits.
pub(crate) fn low_half(w: &AtomicU64) -> *const u32 {
    let p = w as *const AtomicU64 as *const u32;
    if cfg!(target_endian = "little") {
        p
    } else {
        // SAFETY: the other half of the same 8-byte word.
        unsafe { p.add(1) }
    }
}

pub(crate) fn futex_wait(word: *const u32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a mapped, aligned word; shared (not PRIVATE)
    // because the other side may be another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word,
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wake up to `n` sleepers on `word`.
pub(crate) fn futex_wake_n(word: *const u32, n: i32) {
    // SAFETY: FUTEX_WAKE on a mapped, aligned word.
    unsafe {
        libc::syscall(libc::SYS_futex, word, libc::FUTEX_WAKE, n);
    }
}

fn futex_wake(word: *const u32) {
    futex_wake_n(word, 1)
}

/// Wait until `word` differs from `old`: spin, maybe yield, then sleep on
/// a futex for at most `slice` with `flag` raised. Returns the value seen
/// (`old` again when the slice ran out).
fn wait_change(word: &AtomicU64, old: u64, flag: &AtomicU32, spin: Spin, slice: Duration) -> u64 {
    let v = word.load(Ordering::Acquire);
    if v != old {
        return v;
    }
    if !spin.budget.is_zero() {
        let t0 = Instant::now();
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            let v = word.load(Ordering::Acquire);
            if v != old {
                return v;
            }
            if t0.elapsed() >= spin.budget {
                break;
            }
        }
    }
    if spin.yield_first {
        std::thread::yield_now();
        let v = word.load(Ordering::Acquire);
        if v != old {
            return v;
        }
    }
    flag.store(1, Ordering::SeqCst);
    let v = word.load(Ordering::SeqCst);
    if v == old {
        futex_wait(low_half(word), old as u32, slice);
    }
    flag.store(0, Ordering::Relaxed);
    word.load(Ordering::Acquire)
}

/// Publish a new index value and wake the other side if it sleeps.
fn publish(word: &AtomicU64, v: u64, flag: &AtomicU32) {
    word.store(v, Ordering::SeqCst);
    if flag.load(Ordering::SeqCst) != 0 {
        futex_wake(low_half(word));
    }
}

/// The sending end of a ring (one per peer, used under the peer's lock).
pub(crate) struct RingTx {
    ring: Arc<Ring>,
    head: u64,
    spin: Spin,
}

impl RingTx {
    pub fn new(ring: Arc<Ring>, spin: Spin) -> RingTx {
        RingTx {
            head: ring.head().load(Ordering::Acquire),
            ring,
            spin,
        }
    }

    /// Append `parts` to the stream, waiting for space as needed. `check`
    /// runs whenever the ring stays full for a sleep slice; its error ends
    /// the write (a partly written frame is harmless then: the transport
    /// has failed or the deadline passed, and nothing more is sent).
    pub fn write_all(
        &mut self,
        parts: &[&[u8]],
        check: &mut dyn FnMut() -> crate::error::Result<()>,
    ) -> crate::error::Result<()> {
        let r = &*self.ring;
        let cap = r.cap as u64;
        for part in parts {
            let mut rest: &[u8] = part;
            let mut tail = r.tail().load(Ordering::Acquire);
            while !rest.is_empty() {
                let used = self.head.wrapping_sub(tail);
                if used > cap {
                    return Err(crate::error::CommError::Protocol(
                        "the peer corrupted the shared-memory ring (tail ahead of head)".into(),
                    ));
                }
                let free = (cap - used) as usize;
                if free == 0 {
                    let t =
                        wait_change(r.tail(), tail, r.word32(OFF_PROD_WAITING), self.spin, SLICE);
                    if t == tail {
                        check()?;
                    }
                    tail = t;
                    continue;
                }
                let n = free.min(rest.len()).min(PUBLISH);
                r.copy_in(self.head, &rest[..n]);
                self.head = self.head.wrapping_add(n as u64);
                publish(r.head(), self.head, r.word32(OFF_CONS_WAITING));
                rest = &rest[n..];
                tail = r.tail().load(Ordering::Acquire);
            }
        }
        Ok(())
    }
}

/// Why the receiving end stops waiting: `Some(e)` ends the read with `e`.
pub(crate) type StopCheck = Box<dyn Fn() -> Option<io::Error> + Send>;

/// The receiving end of a ring, read like a socket by the reader thread.
pub(crate) struct RingRx {
    ring: Arc<Ring>,
    tail: u64,
    spin: Spin,
    stop: StopCheck,
}

impl RingRx {
    pub fn new(ring: Arc<Ring>, spin: Spin, stop: StopCheck) -> RingRx {
        RingRx {
            tail: ring.tail().load(Ordering::Acquire),
            ring,
            spin,
            stop,
        }
    }
}

impl io::Read for RingRx {
    /// Blocks until at least one byte is there (looking at the stop check
    /// every sleep slice), then copies what is there, up to `buf.len()`.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let r = &*self.ring;
        let mut head = r.head().load(Ordering::Acquire);
        while head == self.tail {
            let h = wait_change(r.head(), head, r.word32(OFF_CONS_WAITING), self.spin, SLICE);
            if h == head {
                if let Some(e) = (self.stop)() {
                    return Err(e);
                }
            }
            head = h;
        }
        let avail = head.wrapping_sub(self.tail);
        if avail > r.cap as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer corrupted the shared-memory ring (head beyond capacity)",
            ));
        }
        let n = (avail as usize).min(buf.len());
        r.copy_out(self.tail, &mut buf[..n]);
        self.tail = self.tail.wrapping_add(n as u64);
        publish(r.tail(), self.tail, r.word32(OFF_PROD_WAITING));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn never() -> StopCheck {
        Box::new(|| None)
    }

    #[test]
    fn ring_carries_a_stream_larger_than_itself_in_order() {
        let (ring, fd) = Ring::create(4096).unwrap();
        let peer = Arc::new(Ring::open(fd).unwrap());
        let spin = Spin {
            budget: Duration::from_micros(5),
            yield_first: false,
        };
        let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let want = data.clone();
        let mut tx = RingTx::new(Arc::new(ring), spin);
        let h = std::thread::spawn(move || {
            for piece in data.chunks(77_777) {
                tx.write_all(&[piece], &mut || Ok(())).unwrap();
            }
        });
        let mut rx = RingRx::new(peer, spin, never());
        let mut got = vec![0u8; want.len()];
        rx.read_exact(&mut got).unwrap();
        h.join().unwrap();
        assert!(got == want, "bytes differ");
    }

    #[test]
    fn full_ring_writer_gives_up_when_checked_and_reader_stops() {
        let (ring, fd) = Ring::create(4096).unwrap();
        let peer = Arc::new(Ring::open(fd).unwrap());
        let spin = Spin::for_ranks(1, None);
        let mut tx = RingTx::new(Arc::new(ring), spin);
        let mut checks = 0;
        let err = tx
            .write_all(&[&[1u8; 10_000]], &mut || {
                checks += 1;
                Err(crate::error::CommError::Timeout("deadline".into()))
            })
            .unwrap_err();
        assert!(matches!(err, crate::error::CommError::Timeout(_)));
        assert_eq!(checks, 1);
        let mut rx = RingRx::new(
            peer,
            spin,
            Box::new(|| Some(io::ErrorKind::ConnectionAborted.into())),
        );
        let mut buf = vec![0u8; 8192];
        // The 4096 bytes that fit are there; then the stop check ends it.
        assert_eq!(rx.read(&mut buf).unwrap(), 4096);
        let e = rx.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
    }
}
