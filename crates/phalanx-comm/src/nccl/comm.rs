//! One NCCL communicator with its device lane: making it (from a unique
//! id, or split from a parent), running one staged operation under the
//! call's deadline, starting one on the caller's device memory without
//! waiting and settling the ones started, all or up to a mark (`start`,
//! `settle`: an event after each), abort and destroy.
//!
//! Status: compiles without CUDA; not yet run on GPU hardware.
//!
//! `ncclCommInitRank` and `ncclCommSplit` block until every member calls
//! them; they run on a helper thread and the caller waits until the
//! deadline, so a missing rank gives a timeout naming the group and rank
//! instead of a hang (the helper stays blocked until the process ends).
//! With `NCCL_COMM_BLOCKING=0` in the environment NCCL makes every
//! communicator non-blocking: creation, splits and launches return
//! `ncclInProgress` while they connect, and are polled under the same
//! deadline ([`super::progress`]); past it a creation or launch is
//! aborted, and a split lets its parent go (its job may still use it), so
//! the first collective or send to a peer that never connects times out
//! too, where a blocking launch would hold it.

use super::cuda::{Device, Lane};
use super::probe::{NcclApi, Stream};
use super::progress::{self, Progress, Waited, IN_PROGRESS};
use crate::backend::Call;
use crate::error::{CommError, Result};
use cudarc::driver::sys as cu;
use std::ffi::{c_int, c_void};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A raw `ncclComm_t` that may cross threads.
#[derive(Clone, Copy)]
pub struct Handle(pub *mut c_void);
// SAFETY: NCCL communicators may be used from any thread (one at a time,
// which `Comm`'s mutex guarantees).
unsafe impl Send for Handle {}

impl Handle {
    /// The raw handle (a method, so that closures capture the `Send` whole).
    pub fn ptr(self) -> *mut c_void {
        self.0
    }
}

struct Inner {
    /// Null once destroyed or aborted.
    comm: Handle,
    lane: Lane,
}

/// The buffers of one operation: host ones staged through the lane, or
/// one already on the device.
pub enum Io<'a> {
    /// One buffer sent and received (all-reduce, broadcast, reduce); the
    /// result is copied back into it when `copy_back`.
    InPlace { buf: &'a mut [u8], copy_back: bool },
    /// `send` goes to the device; `recv_len` bytes come back into `out`
    /// (when given).
    Apart {
        send: &'a [u8],
        recv_len: usize,
        out: Option<&'a mut [u8]>,
    },
    /// Device memory of this communicator's device, sent and received in
    /// place: nothing staged, nothing copied back; ordered after the work
    /// queued so far on the stream `after` (a raw `CUstream`), if given.
    Device {
        ptr: cu::CUdeviceptr,
        after: Option<u64>,
    },
}

/// What launches one operation: `(api, comm, stream, send_dev, recv_dev)`,
/// returning NCCL's code.
pub type Launch<'a> =
    dyn FnMut(&NcclApi, *mut c_void, Stream, cu::CUdeviceptr, cu::CUdeviceptr) -> c_int + 'a;

/// What the job's other channel says of it: the native mesh's failure (a
/// peer's ABORT, crash or silence, or this rank's own abort), asked in
/// every wait. NCCL itself does not notice a peer that stopped: its kernel
/// would wait for it until the deadline.
pub type Peers = Arc<dyn Fn() -> Option<CommError> + Send + Sync>;

/// An NCCL communicator of one group.
pub struct Comm {
    pub api: &'static NcclApi,
    pub dev: Arc<Device>,
    inner: Mutex<Inner>,
    failed: Mutex<Option<CommError>>,
    /// Payload bytes as a ring would send them, shared by a world and its
    /// sub-groups.
    pub bytes: Arc<AtomicU64>,
    /// How long `destroy` lets started work finish before it aborts
    /// instead (the time its creation was given).
    settle_for: Duration,
    /// The job's failure as the native mesh sees it.
    peers: Peers,
}

/// NCCL's asynchronous state of `comm` (`ncclCommGetAsyncError`): 0,
/// [`IN_PROGRESS`], or the error that ended its work.
fn async_state(api: &NcclApi, comm: Handle) -> c_int {
    let mut rc: c_int = 0;
    // SAFETY: a communicator NCCL handed out, not yet destroyed; an
    // out-parameter.
    let call = unsafe { (api.ncclCommGetAsyncError)(comm.ptr(), &mut rc) };
    // The query itself failing (an invalid communicator) is the state: a
    // 0 left in `rc` would read as "done".
    if call != 0 {
        return call;
    }
    rc
}

/// [`async_state`] as a result: work in progress is not an error; an
/// error names `what`.
fn async_check(api: &NcclApi, comm: Handle, what: &dyn Fn() -> String) -> Result<()> {
    match async_state(api, comm) {
        IN_PROGRESS => Ok(()),
        rc => api.check(rc, &|| format!("{} (asynchronous error)", what())),
    }
}

/// Wait for a non-blocking call on `comm` that returned `rc` (see
/// [`super::progress`]): `rc` itself unless it is `ncclInProgress`, else
/// what polling says by `deadline` (`stop`: a failure recorded
/// elsewhere). Past the deadline a timeout naming `what`.
fn settle_call(
    api: &NcclApi,
    comm: Handle,
    rc: c_int,
    deadline: Instant,
    stop: &mut dyn FnMut() -> Option<CommError>,
    what: &dyn Fn() -> String,
) -> Result<()> {
    if rc != IN_PROGRESS {
        return api.check(rc, what);
    }
    let mut state = || async_state(api, comm);
    match progress::poll(deadline, &mut state, stop) {
        Progress::Done(rc) => api.check(rc, what),
        Progress::Stopped(e) => Err(e),
        Progress::TimedOut => Err(CommError::Timeout(format!(
            "{} was still connecting at the deadline (PHALANX_TIMEOUT): a peer did not join",
            what()
        ))),
    }
}

/// Run `f` on a helper thread with the device current; give up at
/// `deadline` with a timeout naming `what`, or when `stop` reports a
/// failure of the job (see [`progress::on_helper`]).
fn blocking<R: Send + 'static>(
    dev: &Arc<Device>,
    deadline: Instant,
    what: String,
    stop: &dyn Fn() -> Option<CommError>,
    f: impl FnOnce() -> Result<R> + Send + 'static,
) -> Result<R> {
    let d = dev.clone();
    let run = move || d.bind().and_then(|_| f());
    match progress::on_helper("phalanx-nccl-init", deadline, stop, run) {
        Waited::Done(r) => r,
        Waited::Stopped(e) => Err(e),
        Waited::TimedOut => Err(CommError::Timeout(format!(
            "{what} did not finish within the timeout (PHALANX_TIMEOUT): a member of the group \
             did not join (is every rank running with PHALANX_BACKEND=nccl?)"
        ))),
    }
}

impl Comm {
    fn wrap(
        api: &'static NcclApi,
        dev: Arc<Device>,
        comm: Handle,
        bytes: Arc<AtomicU64>,
        settle_for: Duration,
        peers: Peers,
    ) -> Result<Comm> {
        dev.bind()?;
        let lane = Lane::new()?;
        Ok(Comm {
            api,
            dev,
            inner: Mutex::new(Inner { comm, lane }),
            failed: Mutex::new(None),
            bytes,
            settle_for: settle_for.max(Duration::from_secs(1)),
            peers,
        })
    }

    /// `ncclCommInitRank` of rank `rank` of `size` with the shared `id`;
    /// given up when `peers` reports the job failed.
    pub fn init(
        api: &'static NcclApi,
        dev: Arc<Device>,
        id: [u8; super::id::ID_BYTES],
        rank: usize,
        size: usize,
        deadline: Instant,
        peers: Peers,
    ) -> Result<Comm> {
        let what = format!(
            "ncclCommInitRank (rank {rank} of {size}, CUDA device {}, {} {})",
            dev.ordinal,
            api.path,
            api.version()
        );
        let w = what.clone();
        // What destroy may wait for started work: the time this call was
        // given (the group's timeout).
        let given = deadline.saturating_duration_since(Instant::now());
        let p = peers.clone();
        let h = blocking(&dev, deadline, what, &|| peers(), move || {
            let mut uid = super::layout::UniqueId { internal: [0; 128] };
            for (d, s) in uid.internal.iter_mut().zip(id) {
                *d = s as std::ffi::c_char;
            }
            let mut comm: *mut c_void = std::ptr::null_mut();
            // SAFETY: an out-parameter; the id came from ncclGetUniqueId on rank 0.
            let rc =
                unsafe { (api.ncclCommInitRank)(&mut comm, size as c_int, uid, rank as c_int) };
            let what =
                || format!("{w} (two ranks on one GPU are refused by NCCL: one rank per device)");
            let mut stop = || p();
            if let Err(e) = settle_call(api, Handle(comm), rc, deadline, &mut stop, &what) {
                if rc == IN_PROGRESS {
                    // SAFETY: a communicator still connecting, given up.
                    unsafe { (api.ncclCommAbort)(comm) };
                }
                return Err(e);
            }
            Ok(Handle(comm))
        })?;
        Comm::wrap(api, dev, h, Arc::new(AtomicU64::new(0)), given, peers)
    }

    /// A fresh unique id (`ncclGetUniqueId`, on group rank 0).
    pub fn unique_id(api: &NcclApi) -> Result<[u8; super::id::ID_BYTES]> {
        let mut uid = super::layout::UniqueId { internal: [0; 128] };
        // SAFETY: an out-parameter.
        api.check(unsafe { (api.ncclGetUniqueId)(&mut uid) }, &|| {
            "ncclGetUniqueId".into()
        })?;
        Ok(uid.internal.map(|c| c as u8))
    }

    /// `ncclCommSplit` of this communicator (collective over it): `None`
    /// for a rank without a color.
    pub fn split(&self, c: &Call, color: c_int, key: c_int) -> Result<Option<Comm>> {
        let mut inner = self.lock_inner()?;
        let parent = self.live(&inner, c)?;
        let api = self.api;
        let what = format!(
            "ncclCommSplit of group {:x} (rank {}, global rank {})",
            c.gid, c.me, c.members[c.me]
        );
        let (w, deadline, p) = (what.clone(), c.deadline, self.peers.clone());
        let peers = || (self.peers)();
        let h = blocking(&self.dev, c.deadline, what, &peers, move || {
            // Non-blocking (inherited from the parent), NCCL writes the new
            // communicator through this pointer when the split's job ends,
            // which may be after this call gave up: a heap slot, freed
            // only once the job is known to have written it (else leaked).
            let slot: *mut *mut c_void = Box::into_raw(Box::new(std::ptr::null_mut()));
            // SAFETY: a live parent; a null config inherits the parent's;
            // `slot` outlives any write to it.
            let rc = unsafe {
                (api.ncclCommSplit)(parent.ptr(), color, key, slot, std::ptr::null_mut())
            };
            // In progress: the job belongs to the parent, which says when
            // it is done (`ncclCommGetAsyncError`).
            let r = settle_call(api, parent, rc, deadline, &mut || p(), &|| w.clone());
            match r {
                // The job may still write the slot: let it go.
                Err(e) if rc == IN_PROGRESS => Err(e),
                r => {
                    // SAFETY: NCCL is done with the slot (the call returned
                    // without a job, or its job was polled as done);
                    // allocated above, freed once.
                    let out = unsafe { *Box::from_raw(slot) };
                    r.map(|_| Handle(out))
                }
            }
        });
        let h = match h {
            Ok(h) => h,
            Err(e) => {
                // Given up (the deadline, or the job failed elsewhere), the
                // helper thread may still be inside `ncclCommSplit` on the
                // parent, or NCCL's job of a non-blocking split still on
                // it: the parent is let go (leaked, failed), since aborting
                // or destroying it would free a communicator in use.
                inner.comm = Handle(std::ptr::null_mut());
                inner.lane.poisoned = true;
                return Err(self.fail(e));
            }
        };
        drop(inner);
        if h.0.is_null() {
            return Ok(None);
        }
        let settle_for = self.settle_for;
        Comm::wrap(
            self.api,
            self.dev.clone(),
            h,
            self.bytes.clone(),
            settle_for,
            self.peers.clone(),
        )
        .map(Some)
    }

    fn live(&self, inner: &Inner, c: &Call) -> Result<Handle> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if inner.comm.0.is_null() {
            return Err(CommError::Aborted(format!(
                "{}: the NCCL communicator of group {:x} was shut down",
                c.op, c.gid
            )));
        }
        Ok(inner.comm)
    }

    /// The communicator's state, or (a call panicked holding it, and its
    /// state is unknown) the communicator's failure: every later call
    /// returns it, and `destroy` aborts rather than waits.
    fn lock_inner(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| {
            self.fail(CommError::Aborted(
                "an earlier call panicked inside this NCCL communicator".into(),
            ))
        })
    }

    /// For the paths that must go on (settle, done, destroy): the state
    /// even after a panic, the panic recorded first as the communicator's
    /// failure, so that `destroy` aborts rather than waits on it.
    fn lock_even_poisoned(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| {
            self.fail(CommError::Aborted(
                "an earlier call panicked inside this NCCL communicator".into(),
            ));
            p.into_inner()
        })
    }

    fn fail(&self, e: CommError) -> CommError {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(e).clone()
    }

    /// This communicator's failure, or else the job's as the native mesh
    /// sees it (then recorded as this communicator's too, so every wait
    /// ends with it and `destroy` aborts rather than waits).
    pub fn failure(&self) -> Option<CommError> {
        let own = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        own.or_else(|| (self.peers)().map(|e| self.fail(e)))
    }

    /// Stage and run one operation: copy the send bytes to the device (host
    /// buffers), call `launch(api, comm, stream, send_dev, recv_dev)`, wait
    /// for it until the call's deadline, and copy the received bytes back
    /// (see [`Io`]).
    pub fn run(&self, c: &Call, io: Io, launch: &mut Launch) -> Result<()> {
        let mut inner = self.lock_inner()?;
        let recv = self.launch_locked(&mut inner, c, &io, launch)?;
        self.wait_locked(&mut inner, c, None)?;
        // The stream is idle: every operation started before is complete.
        inner.lane.retire(None);
        match io {
            Io::InPlace {
                buf,
                copy_back: true,
            } => inner.lane.d2h(buf, recv),
            Io::Apart { out: Some(out), .. } => inner.lane.d2h(out, recv),
            _ => Ok(()),
        }
    }

    /// Launch one operation on the caller's device memory (`io`: an
    /// [`Io::Device`]) and return without waiting for it: an event is
    /// recorded after it, and [`Comm::settle`] waits for it by its mark,
    /// which [`Comm::started`] then reads.
    pub fn start(&self, c: &Call, io: Io, launch: &mut Launch) -> Result<()> {
        // A staged one would return with the staging buffer in use.
        debug_assert!(matches!(io, Io::Device { .. }), "only device memory starts");
        let mut inner = self.lock_inner()?;
        self.launch_locked(&mut inner, c, &io, launch)?;
        // Launched: without its event nothing could wait for it alone, so
        // a failure here fails the communicator (what waits aborts it).
        inner.lane.mark().map(|_| ()).map_err(|e| self.fail(e))
    }

    /// How many operations were started ([`Comm::start`]): the last one's
    /// mark.
    pub fn started(&self) -> u64 {
        let inner = self.lock_even_poisoned();
        inner.lane.marks.started()
    }

    /// Wait until the operation started with `mark` (and so every one
    /// launched before it on this communicator's stream) is complete, or
    /// with `None` every operation launched, until the call's deadline
    /// (past it, or on NCCL's asynchronous error, the communicator is
    /// aborted).
    pub fn settle(&self, c: &Call, mark: Option<u64>) -> Result<()> {
        // A lock poisoned by a panic elsewhere still settles (this may run
        // while unwinding: `collective::Started`'s drop).
        let mut inner = self.lock_even_poisoned();
        self.dev.bind()?;
        let event = match mark {
            None => None,
            Some(m) => match inner.lane.marks.event_of(m)? {
                Some(ev) => Some(ev),
                // Known to be complete (a later wait saw it done); a
                // failure recorded since still reports.
                None => return self.failure().map_or(Ok(()), Err),
            },
        };
        self.wait_locked(&mut inner, c, event)?;
        inner.lane.retire(mark);
        Ok(())
    }

    /// Whether the operation started with `mark` is complete, without
    /// waiting (NCCL's asynchronous error, or an abort, is an error).
    pub fn done(&self, c: &Call, mark: u64) -> Result<bool> {
        let mut inner = self.lock_even_poisoned();
        if let Some(e) = self.failure() {
            self.abort_locked(&mut inner);
            return Err(e);
        }
        let Some(ev) = inner.lane.marks.event_of(mark)? else {
            return Ok(true);
        };
        let comm = self.live(&inner, c)?;
        self.dev.bind()?;
        // SAFETY: a recorded event not yet destroyed.
        match unsafe { cu::cuEventQuery(ev) } {
            cu::CUresult::CUDA_SUCCESS => {
                inner.lane.retire(Some(mark));
                Ok(true)
            }
            cu::CUresult::CUDA_ERROR_NOT_READY => {
                if let Err(e) = async_check(self.api, comm, &|| self.what(c)) {
                    self.abort_locked(&mut inner);
                    return Err(self.fail(e));
                }
                Ok(false)
            }
            rc => {
                let e = super::probe::cu_error(rc, "cuEventQuery");
                self.abort_locked(&mut inner);
                Err(self.fail(e))
            }
        }
    }

    /// What a failure names: the operation, group, ranks and device.
    fn what(&self, c: &Call) -> String {
        format!(
            "{} on group {:x} (rank {}, global rank {}, CUDA device {})",
            c.op, c.gid, c.me, c.members[c.me], self.dev.ordinal
        )
    }

    /// Stage `io`'s send bytes and launch; returns the receive address.
    fn launch_locked(
        &self,
        inner: &mut Inner,
        c: &Call,
        io: &Io,
        launch: &mut Launch,
    ) -> Result<cu::CUdeviceptr> {
        let comm = self.live(inner, c)?;
        self.dev.bind()?;
        if !matches!(io, Io::Device { .. }) && inner.lane.marks.pending() {
            // A copy from pageable memory first waits, inside the driver
            // and with no deadline, for the stream's earlier work: a
            // started collective whose peer died would hold it there
            // forever. Wait for that work here, under the call's deadline.
            self.wait_locked(inner, c, None)?;
            inner.lane.retire(None);
        }
        let (base, recv) = match io {
            Io::Device { ptr, after } => {
                if let Some(s) = after {
                    inner.lane.after(*s).map_err(|e| self.fail(e))?;
                }
                (*ptr, *ptr)
            }
            Io::InPlace { buf, .. } => {
                let base = inner.lane.ensure(buf.len())?;
                inner.lane.h2d(base, buf)?;
                (base, base)
            }
            Io::Apart { send, recv_len, .. } => {
                let send_room = send.len().next_multiple_of(256);
                let base = inner.lane.ensure(send_room + recv_len)?;
                inner.lane.h2d(base, send)?;
                (base, base + send_room as u64)
            }
        };
        let stream = inner.lane.stream as Stream;
        let rc = launch(self.api, comm.0, stream, base, recv);
        // Non-blocking: launched once NCCL no longer says in progress.
        let mut stop = || self.failure();
        let r = settle_call(self.api, comm, rc, c.deadline, &mut stop, &|| self.what(c));
        if let Err(e) = r {
            // Part of a group may have been launched: abort, so that a
            // later destroy does not wait for it.
            self.abort_locked(inner);
            return Err(self.fail(e));
        }
        Ok(recv)
    }

    /// Wait for the stream (or, given `event`, for the work before that
    /// event) until the call's deadline, watching NCCL's asynchronous
    /// error and an abort from another thread; past the deadline, or on
    /// an error, abort the communicator.
    fn wait_locked(&self, inner: &mut Inner, c: &Call, event: Option<cu::CUevent>) -> Result<()> {
        // A failure recorded meanwhile (an `abort` that found the lock
        // taken, a peer gone): what was launched is aborted now, not left
        // running on a live communicator.
        if let Some(e) = self.failure() {
            self.abort_locked(inner);
            return Err(e);
        }
        let comm = self.live(inner, c)?;
        let api = self.api;
        let mut check = || {
            // An `abort` from another thread ends the wait.
            if let Some(e) = self.failure() {
                return Err(e);
            }
            async_check(api, comm, &|| self.what(c))
        };
        let done = inner.lane.wait(event, c.deadline, &mut check);
        match done {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.abort_locked(inner);
                Err(self.fail(CommError::Timeout(format!(
                    "{} did not complete within {:?} (PHALANX_TIMEOUT); the NCCL communicator \
                     was aborted",
                    self.what(c),
                    c.cfg.timeout
                ))))
            }
            Err(e) => {
                self.abort_locked(inner);
                Err(self.fail(e))
            }
        }
    }

    fn abort_locked(&self, inner: &mut Inner) {
        if !inner.comm.0.is_null() {
            // SAFETY: a live communicator, aborted once, then forgotten.
            unsafe { (self.api.ncclCommAbort)(inner.comm.0) };
            inner.comm = Handle(std::ptr::null_mut());
            inner.lane.poisoned = true;
        }
    }

    /// `ncclCommAbort`: pending work ends, later calls fail with `reason`.
    /// Does not wait for the lock (a hung call holds it): the failure is
    /// recorded first, and the communicator aborted when the lock is free.
    pub fn abort(&self, reason: &str) {
        self.fail(CommError::Aborted(reason.to_string()));
        if let Ok(mut inner) = self.inner.try_lock() {
            self.abort_locked(&mut inner);
        }
    }

    /// `ncclCommDestroy` once the work started on it is done; `ncclCommAbort`
    /// instead where it failed, or where that work is still running after
    /// `settle_for` (destroy waits for NCCL's stream, which would wait
    /// forever for a peer that is gone).
    pub fn destroy(&self) {
        // May run while unwinding (`Drop`): a poisoned lock still destroys.
        let mut inner = self.lock_even_poisoned();
        if inner.comm.0.is_null() {
            return;
        }
        let _ = self.dev.bind();
        let comm = inner.comm;
        let settled = self.failure().is_none() && {
            let mut check = || async_check(self.api, comm, &|| "ncclCommDestroy".into());
            let deadline = Instant::now() + self.settle_for;
            matches!(inner.lane.wait(None, deadline, &mut check), Ok(true))
        };
        if settled {
            // SAFETY: a live communicator, destroyed once, then forgotten.
            unsafe { (self.api.ncclCommDestroy)(comm.0) };
            inner.comm = Handle(std::ptr::null_mut());
        } else {
            self.abort_locked(&mut inner);
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.destroy();
        // The lane's stream and buffer are freed next, in this device's
        // context (`destroy` may have run before, from `shutdown`).
        let _ = self.dev.bind();
    }
}
