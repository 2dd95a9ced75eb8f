//! The MPI backend (`--features mpi`, `PHALANX_BACKEND=mpi`): a
//! `ProcessGroup` whose operations run on the system MPI library, for
//! clusters whose MPI is tuned for their network (`mpirun`, `srun`).
//!
//! - Every group is a pair of MPI communicators: one for collectives (issued
//!   in the same order on every rank, as `ProcessGroup` already guarantees)
//!   and one for point-to-point messages, so a receive posted on the
//!   point-to-point thread never interferes with a collective.
//! - Sub-groups are `MPI_Comm_split`s of their parent.
//! - A synchronous call is MPI's blocking call (MPI's fastest path), watched
//!   by a watchdog thread; work queued on the communication thread is MPI's
//!   non-blocking call, polled gently while computation runs (Open MPI has
//!   no progress thread) and eagerly once a thread waits for it. Both have
//!   the group's deadline (`PHALANX_TIMEOUT`). MPI cannot cancel a
//!   collective, so a missed deadline names the operation on stderr and
//!   calls `MPI_Abort`, which ends every rank of the job: nothing hangs. A
//!   rank that dies is handled by the launcher (`mpirun` and `srun` end the
//!   job and name the rank).
//! - MPI is initialised with `MPI_THREAD_MULTIPLE` (the communication and
//!   point-to-point threads call it concurrently) and finalised by the world
//!   group's `shutdown`.
//!
//! ```no_run
//! // Under `mpirun -np 2`, with PHALANX_BACKEND=mpi (or auto):
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let mut x = vec![pg.rank() as f32; 4];
//! pg.all_reduce(&mut x, phalanx_comm::ReduceOp::Sum).unwrap();
//! pg.shutdown();
//! ```

mod backend;
mod ops;
mod watchdog;

use crate::error::{CommError, Result};
use mpi::ffi;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
static FINALIZED: AtomicBool = AtomicBool::new(false);

/// The MPI library's own version string (`MPI_Get_library_version`).
pub fn library_version() -> String {
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

fn init() -> Result<()> {
    INIT.get_or_init(|| {
        let mut done: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time.
        unsafe { ffi::MPI_Initialized(&mut done) };
        if done != 0 {
            return Ok(());
        }
        let mut provided: c_int = 0;
        // SAFETY: called once per process (guarded by the OnceLock); MPI
        // accepts null argc/argv.
        let rc = unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            )
        };
        if rc != 0 {
            return Err(format!("MPI_Init_thread failed ({})", error_string(rc)));
        }
        // SAFETY: reading an extern constant.
        if provided < unsafe { ffi::RSMPI_THREAD_MULTIPLE } {
            return Err(format!(
                "this MPI library provides thread level {provided}, but Phalanx's communication \
                 threads need MPI_THREAD_MULTIPLE ({})",
                library_version()
            ));
        }
        Ok(())
    })
    .clone()
    .map_err(CommError::Io)
}

/// MPI's message for an error code.
fn error_string(rc: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_ERROR_STRING (256 in Open MPI).
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.clamp(0, 1024) as usize);
    format!("MPI error {rc}: {}", String::from_utf8_lossy(&buf))
}

/// Turn an MPI return code into a `CommError` naming `what`.
fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError::Io(format!("{what}: {}", error_string(rc))))
    }
}

/// [`check`] with a message made only on failure (for polling loops).
fn check_lazy(rc: c_int, what: &dyn Fn() -> String) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        check(rc, &what())
    }
}

/// How a thread polling MPI paces its looks. Open MPI progresses only
/// inside MPI calls, so a waiter polls as MPI's own blocking calls do.
/// While some thread of this process is blocked on communication it polls
/// eagerly (yielding after a short spin); while none is (background work
/// overlapping computation, an idle receiver) it sleeps between polls,
/// backing off to `cap`, so it does not take the core that computes.
struct Pacer {
    polls: u64,
    nap: Duration,
    cap: Duration,
}

impl Pacer {
    fn new(cap: Duration) -> Pacer {
        Pacer {
            polls: 0,
            nap: Duration::from_micros(5),
            cap,
        }
    }

    /// Pause before the next look. True when it is time to read the clock
    /// (every 1024 eager polls, every sleeping one).
    fn pause(&mut self) -> bool {
        self.polls += 1;
        if self.polls <= 64 {
            return false;
        }
        if crate::work::anyone_waiting() {
            self.nap = Duration::from_micros(5);
            std::thread::yield_now();
            self.polls.is_multiple_of(1024)
        } else {
            std::thread::sleep(self.nap);
            self.nap = (self.nap * 2).min(self.cap);
            true
        }
    }
}

fn finalized() -> Result<()> {
    if FINALIZED.load(Ordering::SeqCst) {
        return Err(CommError::Aborted(
            "the MPI process group was shut down".into(),
        ));
    }
    Ok(())
}

/// An MPI communicator handle this process owns (freed on drop).
struct Raw(ffi::MPI_Comm);
// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE, so a communicator may
// be used from any thread.
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

impl Raw {
    /// Duplicate `c` and make its errors return codes instead of aborting.
    fn dup(c: ffi::MPI_Comm) -> Result<Raw> {
        // SAFETY: a null handle, filled by MPI_Comm_dup.
        let mut out: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        check(unsafe { ffi::MPI_Comm_dup(c, &mut out) }, "MPI_Comm_dup")?;
        let raw = Raw(out);
        check(
            unsafe { ffi::MPI_Comm_set_errhandler(raw.0, ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )?;
        Ok(raw)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if !FINALIZED.load(Ordering::SeqCst) {
            // SAFETY: this handle came from MPI_Comm_dup or _split and is
            // freed once, here.
            unsafe { ffi::MPI_Comm_free(&mut self.0) };
        }
    }
}

/// A send in flight: MPI owns `buf` until the request completes.
struct InFlight {
    req: ffi::MPI_Request,
    _buf: Vec<u8>,
}
// SAFETY: requests and their buffers are only touched under the mutex.
unsafe impl Send for InFlight {}

/// One process group on MPI.
pub struct Comm {
    coll: Raw,
    p2p: Raw,
    rank: usize,
    size: usize,
    /// World rank of each member.
    members: Vec<usize>,
    timeout: Duration,
    /// Point-to-point sends not yet known to be complete.
    sends: Mutex<Vec<InFlight>>,
    /// Payload bytes counted as a ring would move them, shared by all groups.
    bytes: Arc<AtomicU64>,
    world: bool,
}

impl Comm {
    /// The world group: every process of the MPI job.
    pub fn world(timeout: Duration) -> Result<Comm> {
        init()?;
        // SAFETY: reading an extern constant.
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        let coll = Raw::dup(world)?;
        let p2p = Raw::dup(world)?;
        let (rank, size) = rank_size(&coll)?;
        Ok(Comm {
            coll,
            p2p,
            rank,
            size,
            members: (0..size).collect(),
            timeout,
            sends: Mutex::new(Vec::new()),
            bytes: Arc::new(AtomicU64::new(0)),
            world: true,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn members(&self) -> &[usize] {
        &self.members
    }
    pub fn bytes_sent(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// `MPI_Comm_split` of this group: members with the same non-negative
    /// `color` form a group ordered by `key`; others get `None`. Collective.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Comm>> {
        finalized()?;
        // Everyone arrives first (with a deadline): the split itself blocks.
        self.barrier()?;
        let c = match color {
            Some(c) => (c & 0x3fff_ffff) as c_int,
            // SAFETY: reading an extern constant.
            None => unsafe { ffi::RSMPI_UNDEFINED },
        };
        let key = key.clamp(c_int::MIN as i64, c_int::MAX as i64) as c_int;
        // SAFETY: a null handle, filled by MPI_Comm_split.
        let mut out: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        check(
            unsafe { ffi::MPI_Comm_split(self.coll.0, c, key, &mut out) },
            "MPI_Comm_split",
        )?;
        if color.is_none() {
            return Ok(None);
        }
        let split = Raw(out);
        let coll = Raw::dup(split.0)?;
        let p2p = Raw::dup(split.0)?;
        drop(split);
        let (rank, size) = rank_size(&coll)?;
        let mut sub = Comm {
            coll,
            p2p,
            rank,
            size,
            members: Vec::new(),
            timeout: self.timeout,
            sends: Mutex::new(Vec::new()),
            bytes: self.bytes.clone(),
            world: false,
        };
        let mut members = vec![0i64; size];
        sub.all_gather_v(
            &[self.members[self.rank] as i64],
            &vec![1; size],
            &mut members,
        )?;
        sub.members = members.into_iter().map(|m| m as usize).collect();
        Ok(Some(sub))
    }

    /// Wait until `req` completes, polling it as [`Pacer`] says. Past the
    /// deadline the job is aborted (MPI cannot cancel a collective).
    fn wait(&self, req: &mut ffi::MPI_Request, what: &dyn Fn() -> String) -> Result<Status> {
        let deadline = self.deadline();
        let mut pace = Pacer::new(Duration::from_micros(200));
        loop {
            let mut flag: c_int = 0;
            // SAFETY: a zeroed status is a valid out-parameter.
            let mut st: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            check_lazy(unsafe { ffi::MPI_Test(req, &mut flag, &mut st) }, what)?;
            if flag != 0 {
                return Ok(Status(st));
            }
            if pace.pause() && Instant::now() > deadline {
                abort_job(&format!(
                    "{} did not complete within {:?} (PHALANX_TIMEOUT)",
                    what(),
                    self.timeout
                ));
            }
        }
    }

    /// Run a blocking MPI call under the watchdog: past the deadline the
    /// watchdog aborts the job, naming `what`.
    fn blocking(&self, what: &dyn Fn() -> String, call: impl FnOnce() -> c_int) -> Result<()> {
        let _watch = watchdog::watch(self.deadline(), what(), self.timeout);
        check(call(), &what())
    }

    /// Drop the sends that have completed.
    fn reap_sends(&self) -> Result<()> {
        let mut sends = self.sends.lock().unwrap();
        let mut err = Ok(());
        sends.retain_mut(|s| {
            let mut flag: c_int = 0;
            // SAFETY: the request is live until it tests complete.
            let rc = unsafe { ffi::MPI_Test(&mut s.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if rc != 0 {
                err = check(rc, "send");
                return false;
            }
            flag == 0
        });
        err
    }

    /// Wait for every send in flight (before shutdown).
    fn flush_sends(&self) -> Result<()> {
        let mut sends = std::mem::take(&mut *self.sends.lock().unwrap());
        for s in sends.iter_mut() {
            self.wait(&mut s.req, &|| "a point-to-point send".into())?;
        }
        Ok(())
    }

    /// Leave: wait for sends, then (for the world group) meet every rank
    /// and finalise MPI. Later calls on any group fail.
    pub fn shutdown(&self) {
        let _ = self.flush_sends();
        if self.world && !FINALIZED.load(Ordering::SeqCst) {
            let _ = self.barrier();
            FINALIZED.store(true, Ordering::SeqCst);
            // SAFETY: every communicator call after this is refused by `finalized()`.
            unsafe { ffi::MPI_Finalize() };
        }
    }

    /// Abort every rank of the job with `reason`.
    pub fn abort(&self, reason: &str) -> ! {
        abort_job(reason)
    }
}

/// What `MPI_Test` reported of a completed request.
struct Status(ffi::MPI_Status);

fn rank_size(c: &Raw) -> Result<(usize, usize)> {
    let (mut r, mut n): (c_int, c_int) = (0, 0);
    check(unsafe { ffi::MPI_Comm_rank(c.0, &mut r) }, "MPI_Comm_rank")?;
    check(unsafe { ffi::MPI_Comm_size(c.0, &mut n) }, "MPI_Comm_size")?;
    Ok((r as usize, n as usize))
}

fn abort_job(reason: &str) -> ! {
    let mut r: c_int = -1;
    // SAFETY: MPI is initialised whenever a Comm exists.
    unsafe { ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut r) };
    eprintln!("[phalanx] rank {r}: aborting the MPI job: {reason}");
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    std::process::exit(1)
}

/// Counts and displacements as MPI's `int`s, refusing what does not fit.
fn ints(xs: &[usize], what: &str) -> Result<Vec<c_int>> {
    xs.iter()
        .map(|&x| {
            c_int::try_from(x).map_err(|_| {
                crate::error::invalid!(
                    "{what}: {x} elements is more than one MPI call can carry (2^31 - 1)"
                )
            })
        })
        .collect()
}

fn displs(counts: &[usize], what: &str) -> Result<Vec<c_int>> {
    let offs: Vec<usize> = counts
        .iter()
        .scan(0usize, |a, &c| {
            let o = *a;
            *a += c;
            Some(o)
        })
        .collect();
    ints(&offs, what)
}
