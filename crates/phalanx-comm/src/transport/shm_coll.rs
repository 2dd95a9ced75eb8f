//! All-reduce in place in shared memory, for a world whose ranks all share
//! one host (what Open MPI's vader, NCCL's SHM and DeepSpeed's CPU
//! all-reduce do), instead of a ring of messages.
//!
//! Why: over the per-pair rings (`super::shm`) every chunk is copied into
//! a ring, out of it by the peer's reader thread, then reduced: three
//! passes and two thread hand-offs per step. Here each rank copies its
//! chunk once into its own slot, every rank reduces its 1/n slice of the
//! chunk across all slots (in place, in its own slot), and every rank
//! copies the reduced slices out: three passes in all, no reader thread,
//! two barriers per chunk.
//!
//! Each rank has one slot segment (a sealed memfd, passed with its ring in
//! the set-up offer, see `super::shm_link`): a header page with its barrier
//! counter and the call's signature, then two halves used by alternate
//! chunks (counted across calls), so a rank may write chunk k+1 while a
//! slow peer still reads chunk k (chunk k+2 reuses the half only after the
//! first barrier of chunk k+1, which every rank passes after reading
//! chunk k).
//!
//! Small messages, and every message on two ranks, take a direct path with
//! one barrier per chunk: after it, every rank reduces all slots in rank
//! order into its own buffer. With two ranks this moves as many bytes
//! between cores as the sliced path and saves a barrier; with more ranks
//! every rank would read every slot, so only messages up to
//! `DIRECT_MAX_BYTES` go that way.
//!
//! On the sliced path each element is reduced once, by its slice's owner,
//! and copied to the others; on the direct path every rank reduces in the
//! same order. Either way every rank gets bitwise the same result. Only the world group uses it
//! (its calls are serialised on each rank, so one slot per rank is
//! enough); sub-groups use the rings. Any error (deadline, dead peer,
//! different sizes) fails the whole transport: barrier counters would no
//! longer agree.

use super::shm::{futex_wait, futex_wake_n, low_half, Segment, Spin, SLICE};
use super::Transport;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of each half of a slot: one chunk.
pub(crate) const HALF: usize = 512 << 10;
const HEADER: usize = 4096;
/// Size of every rank's slot segment.
pub(crate) const SLOT_BYTES: usize = HEADER + 2 * HALF;
const OFF_EPOCH: usize = 0;
const OFF_WAITERS: usize = 64;
/// The call's signature (element count, dtype, op), one per half (the
/// half of the call's first chunk), checked after the first barrier.
const OFF_SIG: usize = 128;

/// Largest message (bytes) that takes the direct path on more than two
/// ranks.
const DIRECT_MAX_BYTES: usize = 32 << 10;

/// The world's slots, indexed by rank (this rank's own included).
pub(crate) struct ShmWorld {
    slots: Vec<Segment>,
    spin: Spin,
    state: std::sync::Mutex<Barriers>,
}

/// This rank's barrier count (its own epoch word's value), and for each
/// half of its slot the barrier after which no peer reads it any more.
/// Every rank runs the same calls in the same order, so every rank's
/// state, and hence its choice of half, is the same.
struct Barriers {
    epoch: u64,
    free_at: [u64; 2],
}

impl ShmWorld {
    pub fn new(slots: Vec<Segment>, spin: Spin) -> ShmWorld {
        ShmWorld {
            slots,
            spin,
            state: std::sync::Mutex::new(Barriers {
                epoch: 0,
                free_at: [0, 0],
            }),
        }
    }

    fn word64(&self, r: usize, off: usize) -> &AtomicU64 {
        // SAFETY: aligned offsets in the header page of a live mapping.
        unsafe { &*(self.slots[r].ptr().add(off) as *const AtomicU64) }
    }
    fn waiters(&self, r: usize) -> &AtomicU32 {
        // SAFETY: as in word64.
        unsafe { &*(self.slots[r].ptr().add(OFF_WAITERS) as *const AtomicU32) }
    }
    fn half(&self, r: usize, h: usize) -> *mut u8 {
        // SAFETY: inside slot r's mapping.
        unsafe { self.slots[r].ptr().add(HEADER + h * HALF) }
    }
}

/// Raise this rank's epoch to `e` and wait until every rank's is at least
/// `e`; spins, then sleeps on the laggard's epoch word. Gives up with the
/// transport's failure, or a timeout naming the laggard at `deadline`.
fn barrier(
    t: &Transport,
    w: &ShmWorld,
    e: u64,
    deadline: Instant,
    op: &dyn Fn() -> String,
) -> Result<()> {
    let me = t.rank;
    w.word64(me, OFF_EPOCH).store(e, Ordering::SeqCst);
    if w.waiters(me).load(Ordering::SeqCst) != 0 {
        futex_wake_n(low_half(w.word64(me, OFF_EPOCH)), i32::MAX);
    }
    for r in (0..w.slots.len()).filter(|&r| r != me) {
        let word = w.word64(r, OFF_EPOCH);
        let t0 = Instant::now();
        loop {
            let v = word.load(Ordering::Acquire);
            if v >= e {
                break;
            }
            let spun = t0.elapsed();
            if spun < w.spin.budget {
                // Spin; after a microsecond, yield between looks: if the
                // laggard shares this core (ranks are not pinned) it runs
                // now instead of after the budget, and with a core of its
                // own the yield returns at once.
                std::hint::spin_loop();
                if spun > Duration::from_micros(1) {
                    std::thread::yield_now();
                }
                continue;
            }
            if let Some(f) = t.failure() {
                return Err(f);
            }
            // Left cleanly without reaching this barrier (its epoch is
            // raised before its goodbye is sent: look once more).
            if t.has_left(r) && word.load(Ordering::Acquire) < e {
                return Err(CommError::PeerDead {
                    rank: r,
                    host: t.host_of(r),
                    reason: format!("shut down before reaching {}", op()),
                });
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout(format!(
                    "{} waited for rank {r} ({}) past the deadline (PHALANX_TIMEOUT)",
                    op(),
                    t.host_of(r)
                )));
            }
            if w.spin.yield_first {
                std::thread::yield_now();
                if word.load(Ordering::Acquire) >= e {
                    break;
                }
            }
            w.waiters(r).fetch_add(1, Ordering::SeqCst);
            if word.load(Ordering::SeqCst) == v {
                futex_wait(low_half(word), v as u32, SLICE);
            }
            w.waiters(r).fetch_sub(1, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// All-reduce `buf` over the whole world through the slots (see the
/// module docs); `Avg` is left to the caller, as for the other algorithms.
pub(crate) fn all_reduce<T: Element>(
    t: &Transport,
    w: &ShmWorld,
    buf: &mut [T],
    op: ReduceOp,
    deadline: Instant,
    what: &dyn Fn() -> String,
) -> Result<()> {
    let failing = FailOnUnwind(t);
    let res = run(t, w, buf, op, deadline, what);
    std::mem::forget(failing);
    if let Err(e) = &res {
        // Barrier counts no longer agree: nothing more can run.
        t.fail(e.clone());
    }
    res
}

/// Fails the transport if dropped, that is when a panic unwinds through
/// an all-reduce part-way: as for an error, this rank's barrier count no
/// longer agrees with its peers'.
struct FailOnUnwind<'a>(&'a Transport);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        self.0.fail(CommError::Aborted(format!(
            "rank {}: an in-place shared-memory all-reduce panicked part-way",
            self.0.rank
        )));
    }
}

fn run<T: Element>(
    t: &Transport,
    w: &ShmWorld,
    buf: &mut [T],
    op: ReduceOp,
    deadline: Instant,
    what: &dyn Fn() -> String,
) -> Result<()> {
    let (n, me) = (w.slots.len(), t.rank);
    let esz = std::mem::size_of::<T>();
    let per = HALF / esz;
    // Poisoned: a panic left this rank's barrier count part-way through a
    // call (and the transport failed, see `FailOnUnwind`).
    let mut st = w.state.lock().map_err(|_| {
        CommError::Aborted(format!(
            "rank {me}: an earlier in-place shared-memory all-reduce panicked part-way"
        ))
    })?;
    let sig = [
        buf.len() as u64,
        (T::DTYPE.code() as u64) << 8 | op.code() as u64,
    ];
    let total = buf.len();
    let direct = n == 2 || std::mem::size_of_val(buf) <= DIRECT_MAX_BYTES;
    for (k, start) in (0..total).step_by(per).enumerate() {
        let chunk = &mut buf[start..(start + per).min(total)];
        // A half that no peer reads any more (one extra barrier if neither
        // is free yet, the same on every rank).
        let h = loop {
            if let Some(h) = (0..2).find(|&h| st.free_at[h] <= st.epoch) {
                break h;
            }
            st.epoch += 1;
            barrier(t, w, st.epoch, deadline, what)?;
        };
        let len = chunk.len();
        if k == 0 {
            // Beside the half: peers read it while they read the half.
            w.word64(me, OFF_SIG + 16 * h)
                .store(sig[0], Ordering::Relaxed);
            w.word64(me, OFF_SIG + 16 * h + 8)
                .store(sig[1], Ordering::Relaxed);
        }
        // SAFETY: our own half, which no peer reads until the barrier below
        // (every peer finished reading it before barrier `free_at[h]`).
        unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), w.half(me, h) as *mut T, len);
        }
        st.epoch += 1;
        barrier(t, w, st.epoch, deadline, what)?;
        if k == 0 {
            check_signatures(w, me, n, h, sig, what)?;
        }
        if direct {
            // Every rank reduces every slot, in rank order, into its buffer.
            // SAFETY: the halves h are not written again before every rank
            // passes the next barrier (`free_at`).
            unsafe {
                if me != 0 {
                    std::ptr::copy_nonoverlapping(
                        w.half(0, h) as *const T,
                        chunk.as_mut_ptr(),
                        len,
                    );
                }
                for r in 1..n {
                    let other = std::slice::from_raw_parts(w.half(r, h) as *const T, len);
                    T::reduce_into(op, chunk, other);
                }
            }
            st.free_at[h] = st.epoch + 1;
            continue;
        }
        // Reduce our slice across all slots into our own slot.
        let slices = super::super::algo::ranges(&super::super::algo::even_split(len, n));
        let slice = slices[me].clone();
        if !slice.is_empty() {
            // SAFETY: slice `me` of every slot's half h is read by us only
            // until the next barrier, and written (in our slot) by us only.
            unsafe {
                let acc = std::slice::from_raw_parts_mut(
                    (w.half(me, h) as *mut T).add(slice.start),
                    slice.len(),
                );
                for r in (0..n).filter(|&r| r != me) {
                    let other = std::slice::from_raw_parts(
                        (w.half(r, h) as *const T).add(slice.start),
                        slice.len(),
                    );
                    T::reduce_into(op, acc, other);
                }
            }
        }
        st.epoch += 1;
        barrier(t, w, st.epoch, deadline, what)?;
        // Every slice is reduced: copy each from its owner's slot.
        for (r, s) in slices.into_iter().enumerate() {
            // SAFETY: slot r's half h is not written again before every
            // rank passes the next barrier (`free_at`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (w.half(r, h) as *const T).add(s.start),
                    chunk.as_mut_ptr().add(s.start),
                    s.len(),
                );
            }
        }
        st.free_at[h] = st.epoch + 1;
    }
    Ok(())
}

/// Every rank must have called this all-reduce with the same count, dtype
/// and op (read after the first barrier of the call).
fn check_signatures(
    w: &ShmWorld,
    me: usize,
    n: usize,
    h: usize,
    sig: [u64; 2],
    what: &dyn Fn() -> String,
) -> Result<()> {
    for r in (0..n).filter(|&r| r != me) {
        let theirs = [
            w.word64(r, OFF_SIG + 16 * h).load(Ordering::Relaxed),
            w.word64(r, OFF_SIG + 16 * h + 8).load(Ordering::Relaxed),
        ];
        if theirs != sig {
            return Err(CommError::Desync(format!(
                "{}: rank {r} called it with {} elements, dtype/op code {:#x}, \
                 rank {me} with {} elements, {:#x} (set PHALANX_DEBUG=detail to see each call)",
                what(),
                theirs[0],
                theirs[1],
                sig[0],
                sig[1]
            )));
        }
    }
    Ok(())
}
