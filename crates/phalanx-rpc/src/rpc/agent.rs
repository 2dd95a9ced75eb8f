//! The agent: one per worker. It learns every worker's name, keeps one
//! reader thread per peer that turns frames into work, runs calls on a
//! bounded pool, matches replies to pending calls, and fails the calls
//! pending on a peer that dies.
//!
//! All traffic is variable-length messages on one tag of a process group
//! made for RPC (`ProcessGroup::send_bytes`), so authentication, deadlines
//! and dead-peer detection are the transport's. A transport that loses a
//! peer fails as a whole (as it does for collectives): every call pending
//! anywhere then fails with an error that names the dead worker.

use super::codec::{encode, encode_owned, Encoded, ErrKind, Head, RRefId, Target};
use super::error::{RpcError, RpcResult};
use super::future::{Reply, Slot};
use super::loops;
use super::registry::{Ctx, Kind, Payload, Registry};
use super::rref::Held;
use phalanx_comm::{CommError, ProcessGroup};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The point-to-point tags of RPC messages and of the name exchange.
pub(crate) const TAG: u64 = 0x5250_4300;
const NAME_TAG: u64 = TAG + 1;
/// How often an idle reader looks up from its socket (to notice shutdown).
pub(crate) const POLL: Duration = Duration::from_millis(100);

/// Settings of an agent.
#[derive(Clone, Debug)]
pub struct Options {
    /// Default timeout of a call (`rpc_sync_timeout` overrides it).
    pub timeout: Duration,
    /// Threads that run incoming calls.
    pub threads: usize,
    /// Calls that may wait for a thread in the pool's queue; past that, a
    /// peer's further calls wait in order in its reader, which still takes
    /// the peer's replies (a callback to its caller is not held up).
    pub queue: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_secs(60),
            threads: 4,
            queue: 1024,
        }
    }
}

pub(crate) struct Pending {
    pub to: usize,
    pub func: String,
    pub slot: Arc<Slot>,
    pub deadline: Instant,
    pub timeout: Duration,
}

pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Agent {
    pub pg: ProcessGroup,
    pub rank: usize,
    pub names: Vec<String>,
    pub reg: Registry,
    pub opts: Options,
    pub pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    send_locks: Vec<Mutex<()>>,
    jobs: Mutex<Option<SyncSender<Job>>>,
    pub(crate) owned: super::rref::OwnedTable,
    pub stopping: AtomicBool,
    /// Peers known dead or gone, with the error their calls get.
    gone: Mutex<HashMap<usize, RpcError>>,
    pool: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub me: Weak<Agent>,
}

/// The longest timeout: a longer one (`Duration::MAX` meant as "none") is
/// read as this, so that every deadline is a time that exists.
pub(crate) const LONGEST_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A call's timeout as used: at most [`LONGEST_TIMEOUT`]; zero refused (in
/// `torch.distributed.rpc` it means none; here every call has a deadline).
pub(crate) fn checked_timeout(t: Duration) -> RpcResult<Duration> {
    if t.is_zero() {
        return Err(RpcError::Invalid(
            "a timeout of 0: every call here has a deadline (torch.distributed.rpc reads 0 as \
             none); give a long one instead"
                .into(),
        ));
    }
    Ok(t.min(LONGEST_TIMEOUT))
}

impl Agent {
    pub fn start(
        pg: &ProcessGroup,
        name: &str,
        reg: Registry,
        mut opts: Options,
    ) -> RpcResult<Arc<Agent>> {
        opts.timeout = checked_timeout(opts.timeout).inspect_err(|e| {
            // Its peers are about to wait for it in the set-up.
            pg.fail_peers(&format!("Options::timeout: {e}"));
        })?;
        if let Some((n, why)) = reg.min_threads().filter(|(n, _)| opts.threads < *n) {
            let e = format!(
                "Options::threads = {} is too few for the functions this worker serves: {why} \
                 (set threads to at least {n})",
                opts.threads
            );
            // Its peers are about to wait for it in the set-up: they fail
            // at once with this.
            pg.fail_peers(&e);
            return Err(RpcError::Invalid(e));
        }
        let all: Vec<usize> = (0..pg.size()).collect();
        let pg = pg.new_group(&all)?.expect("every rank is a member");
        let names = exchange_names(&pg, name, opts.timeout)?;
        let (tx, rx) = sync_channel::<Job>(opts.queue.max(1));
        let a = Arc::new_cyclic(|me| Agent {
            rank: pg.rank(),
            send_locks: (0..pg.size()).map(|_| Mutex::new(())).collect(),
            pg: pg.clone(),
            names,
            reg,
            opts: opts.clone(),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            jobs: Mutex::new(Some(tx)),
            owned: Default::default(),
            stopping: AtomicBool::new(false),
            gone: Mutex::new(HashMap::new()),
            pool: Mutex::new(Vec::new()),
            me: me.clone(),
        });
        let rx = Arc::new(Mutex::new(rx));
        let mut pool = a.pool.lock().unwrap();
        for i in 0..opts.threads.max(1) {
            let rx = rx.clone();
            pool.push(spawn(format!("rpc-pool-{i}"), move || loops::run_jobs(rx)));
        }
        drop(pool);
        for peer in (0..pg.size()).filter(|&p| p != a.rank) {
            let (w, pg) = (Arc::downgrade(&a), pg.clone());
            spawn(format!("rpc-read-{peer}"), move || {
                loops::read_loop(w, pg, peer)
            });
        }
        let w = Arc::downgrade(&a);
        spawn("rpc-timer".into(), move || loops::timer_loop(w));
        Ok(a)
    }

    pub fn name_of(&self, rank: usize) -> &str {
        self.names.get(rank).map(|s| s.as_str()).unwrap_or("?")
    }

    /// The error a call gets from a failed transport: it names the worker
    /// the transport blames, not merely the one the call went to.
    pub fn comm_error(&self, peer: usize, e: CommError) -> RpcError {
        let dead = |rank: usize| {
            let g = self.pg.global_ranks().iter().position(|&r| r == rank);
            self.name_of(g.unwrap_or(peer)).to_string()
        };
        match e {
            CommError::PeerDead { rank, .. } => RpcError::WorkerDead {
                worker: dead(rank),
                reason: e.to_string(),
            },
            CommError::Aborted(_) | CommError::Io(_) => RpcError::WorkerDead {
                worker: self.name_of(peer).to_string(),
                reason: e.to_string(),
            },
            e => RpcError::Comm(e),
        }
    }

    /// Send one message: its first frame, then its blobs, under the peer's
    /// send lock so that concurrent messages do not interleave.
    pub fn send(&self, to: usize, mut enc: Encoded<'_>, head: &Head) -> RpcResult<()> {
        let lock = self.send_locks.get(to).ok_or_else(|| self.no_rank(to))?;
        enc.seal(head)?;
        let t = self.opts.timeout;
        let _g = lock.lock().unwrap();
        let res = self.pg.send_bytes(to, TAG, &enc.bytes, t).and_then(|_| {
            enc.blobs()
                .try_for_each(|b| self.pg.send_bytes(to, TAG, b, t))
        });
        res.map_err(|e| self.comm_error(to, e))
    }

    /// Start a call; its reply fills the returned slot.
    #[allow(clippy::too_many_arguments)]
    pub fn start_call(
        &self,
        to: usize,
        func: &str,
        args_ty: &str,
        ret_ty: &str,
        target: Target,
        enc: RpcResult<Encoded<'_>>,
        timeout: Duration,
    ) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        if let Err(e) = self.check_call(to) {
            slot.fill(Err(e));
            return slot;
        }
        let mut enc = match enc {
            Ok(e) => e,
            Err(e) => {
                slot.fill(Err(e));
                return slot;
            }
        };
        let rrefs = std::mem::take(&mut enc.rrefs);
        if let Err(e) = self.fork_rrefs(&rrefs) {
            slot.fill(Err(e));
            return slot;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().unwrap().insert(
            id,
            Pending {
                to,
                func: func.to_string(),
                slot: slot.clone(),
                deadline: Instant::now() + timeout,
                timeout,
            },
        );
        // A `stop` that failed the pending calls just before this one was
        // among them: nothing would complete it (the readers and the timer
        // end with the agent), so it fails here.
        if self.stopping.load(Ordering::SeqCst) {
            self.release(&rrefs);
            self.complete(id, Err(self.shutdown_error()));
            return slot;
        }
        let head = Head::Call {
            id,
            func: func.to_string(),
            args_ty: args_ty.to_string(),
            ret_ty: ret_ty.to_string(),
            target,
            blobs: enc.blob_count(),
            rrefs: wire_rrefs(&rrefs),
        };
        if to == self.rank {
            let blobs = enc.blob_copies();
            let frame = match enc.seal(&head) {
                Ok(()) => words_of(&enc.bytes),
                Err(e) => {
                    self.release(&rrefs);
                    self.complete(id, Err(e));
                    return slot;
                }
            };
            let body_len = enc.bytes.len() - head_len(&enc.bytes);
            // A call to itself: never handed back.
            let _ = self.dispatch(
                to,
                head,
                Payload {
                    frame,
                    body_len,
                    blobs,
                    held: Vec::new(),
                },
            );
        } else if let Err(e) = self.send(to, enc, &head) {
            // Not delivered: the counts taken for its receiver go back.
            self.release(&rrefs);
            self.complete(id, Err(e));
        }
        slot
    }

    fn check_call(&self, to: usize) -> RpcResult<()> {
        if to >= self.names.len() {
            return Err(self.no_rank(to));
        }
        if self.stopping.load(Ordering::SeqCst) {
            return Err(self.shutdown_error());
        }
        if let Some(e) = self.gone.lock().unwrap().get(&to) {
            return Err(e.clone());
        }
        Ok(())
    }

    fn no_rank(&self, to: usize) -> RpcError {
        RpcError::UnknownWorker(format!(
            "rank {to} (the world has {} workers)",
            self.names.len()
        ))
    }

    fn shutdown_error(&self) -> RpcError {
        RpcError::Shutdown(format!(
            "the agent of {} was shut down",
            self.name_of(self.rank)
        ))
    }

    /// Tell the owners of the references a message carries that one more
    /// worker will hold them, and wait until they know: otherwise this
    /// worker could drop its own reference, and the owner free the value,
    /// before the receiver's reference is counted. If one fails, those
    /// counted already are given back.
    fn fork_rrefs(&self, rrefs: &[(usize, RRefId)]) -> RpcResult<()> {
        for (i, &(owner, id)) in rrefs.iter().enumerate() {
            let counted = if owner == self.rank {
                self.owned
                    .incref(id)
                    .map_err(|m| RpcError::Codec(format!("cannot send the reference: {m}")))
            } else {
                let t = self.opts.timeout;
                let slot = self.start_call(owner, "", "", "", Target::Incref(id), encode(&()), t);
                super::future::RpcFuture::<()>::new(slot, self.me.clone(), owner, "", t).wait()
            };
            if let Err(e) = counted {
                self.release(&rrefs[..i]);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Give back one count of each reference (counted for a message that
    /// did not leave).
    fn release(&self, rrefs: &[(usize, RRefId)]) {
        for &(owner, id) in rrefs {
            self.decref_at(owner, id);
        }
    }

    /// Drop one count of the value `id` owned by `owner`.
    pub(crate) fn decref_at(&self, owner: usize, id: RRefId) {
        if owner == self.rank {
            self.owned.decref(id);
        } else if let Ok(enc) = encode(&()) {
            // Fire and forget: a dead owner has nothing left to free.
            let _ = self.send(owner, enc, &Head::Decref(id));
        }
    }

    /// Hold the counts of the references a received message lists, until
    /// its body is decoded or dropped. An owner outside the world is
    /// skipped: there is no count there to give back.
    fn hold(&self, rrefs: &[(u32, RRefId)]) -> Vec<Held> {
        rrefs
            .iter()
            .filter(|(owner, _)| (*owner as usize) < self.names.len())
            .map(|&(owner, id)| Held::new(owner as usize, id, self.me.clone()))
            .collect()
    }

    /// Fill a pending call's slot (once; late replies are dropped).
    pub fn complete(&self, id: u64, r: RpcResult<Reply>) {
        if let Some(p) = self.pending.lock().unwrap().remove(&id) {
            p.slot.fill(r);
        }
    }

    /// A message from `from` (or from this worker, for calls to itself).
    /// A call from a peer comes back as the job to queue, which its reader
    /// queues (see `loops::read_loop`); everything else is done here.
    #[must_use]
    pub fn dispatch(&self, from: usize, head: Head, mut p: Payload) -> Option<Job> {
        match head {
            Head::Reply { id, err, rrefs, .. } => {
                // A late reply is dropped by `complete`: with it, its counts.
                p.held = self.hold(&rrefs);
                self.complete(id, Ok(Reply { err, payload: p }));
                None
            }
            Head::Decref(id) => {
                self.owned.decref(id);
                None
            }
            Head::Call {
                id,
                target: Target::Incref(r),
                ..
            } => {
                let res = self.owned.incref(r).map_err(|m| (ErrKind::Remote, m));
                self.reply(from, id, res.and_then(|_| ok_unit()));
                None
            }
            Head::Call {
                id,
                func,
                args_ty,
                ret_ty,
                target,
                rrefs,
                ..
            } => {
                // Counts held from here: a call refused before its
                // arguments are decoded gives them back.
                p.held = self.hold(&rrefs);
                // Registered here, before any later message from this peer
                // (a Decref) is looked at: the order of the peer's frames.
                if let Target::Remote(r) = target {
                    self.owned.create(r);
                }
                let me = self.me.upgrade()?;
                let job = move || {
                    let res = me.serve(from, &func, &args_ty, &ret_ty, target, p);
                    me.reply(from, id, res);
                };
                if from != self.rank {
                    return Some(Box::new(job));
                }
                let tx = self.jobs.lock().unwrap().clone()?;
                // A call to this worker itself. Made from a pool thread, it
                // runs here: queued, it would wait for a pool thread while
                // holding one (calls nested as deep as the pool is wide
                // would wait each other out until the timeout), and a full
                // queue would hold every such thread forever. From another
                // thread it is queued when there is room, else run here too.
                if super::loops::ON_POOL.with(|p| p.get()) {
                    job();
                } else if let Err(TrySendError::Full(job)) = tx.try_send(Box::new(job)) {
                    job();
                }
                None
            }
        }
    }

    /// Queue a peer's call for the pool, waiting for room (a reader that
    /// ends hands its waiting calls over so: they were received, and run).
    pub fn queue_job_waiting(&self, job: Job) {
        if let Some(tx) = self.jobs.lock().unwrap().clone() {
            let _ = tx.send(job);
        }
    }

    /// Queue a peer's call for the pool: `Err` gives it back when the
    /// queue is full (and drops it once the agent stops).
    pub fn queue_job(&self, job: Job) -> Result<(), Job> {
        let Some(tx) = self.jobs.lock().unwrap().clone() else {
            return Ok(());
        };
        match tx.try_send(job) {
            Err(TrySendError::Full(job)) => Err(job),
            _ => Ok(()),
        }
    }

    /// Run one call on a pool thread; a panic becomes the caller's error.
    fn serve(
        &self,
        from: usize,
        func: &str,
        args_ty: &str,
        ret_ty: &str,
        target: Target,
        p: Payload,
    ) -> Result<Encoded<'static>, (ErrKind, String)> {
        let Some(me) = self.me.upgrade() else {
            return Err((ErrKind::Remote, "the callee is shutting down".into()));
        };
        let ctx = Ctx {
            rpc: super::Rpc::from_agent(me),
            caller: from,
        };
        let deadline = Instant::now() + self.opts.timeout;
        let run = || -> Result<Encoded<'static>, (ErrKind, String)> {
            if let Target::Fetch(r) = target {
                let (v, fetch, ty) = self.owned.wait(r, deadline)?;
                if ty != ret_ty {
                    return Err(mismatch(format!(
                        "the value is a {ty}, the caller asked for {ret_ty}"
                    )));
                }
                return fetch(&v).map_err(|e| (ErrKind::Codec, e.to_string()));
            }
            let e = self
                .reg
                .get(func)
                .ok_or((ErrKind::UnknownFunction, String::new()))?;
            if e.args_ty != args_ty || e.ret_ty != ret_ty {
                return Err(mismatch(format!(
                    "it takes {} and returns {}; the caller sent {args_ty} and expects {ret_ty}",
                    e.args_ty, e.ret_ty
                )));
            }
            match (target, &e.kind) {
                (Target::Func, Kind::Func { call, .. }) => call(&ctx, p),
                (Target::Remote(r), Kind::Func { make, .. }) => {
                    let made = make(&ctx, p);
                    let ok = made.is_ok();
                    self.owned.set(r, made);
                    if ok {
                        ok_unit()
                    } else {
                        Err((ErrKind::Remote, "see the RRef".into()))
                    }
                }
                (Target::Method(r), Kind::Method { self_ty, call }) => {
                    let (v, _, ty) = self.owned.wait(r, deadline)?;
                    if ty != *self_ty {
                        return Err(mismatch(format!(
                            "it is a method of {self_ty}, the RRef holds a {ty}"
                        )));
                    }
                    call(&ctx, &v, p)
                }
                (Target::Method(_), Kind::Func { .. }) => Err(mismatch(
                    "it is a function; call it with rpc_sync, not through an RRef".into(),
                )),
                (_, Kind::Method { self_ty, .. }) => Err(mismatch(format!(
                    "it is a method of {self_ty}; call it through an RRef"
                ))),
                (Target::Fetch(_) | Target::Incref(_), _) => unreachable!("handled above"),
            }
        };
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        let res = res.unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            if let Target::Remote(r) = target {
                self.owned
                    .set(r, Err((ErrKind::Remote, format!("panicked: {msg}"))));
            }
            Err((ErrKind::Remote, format!("panicked: {msg}")))
        });
        // A `remote` refused before its function ran leaves no value: the
        // RRef's users learn why at once, not at their timeout.
        if let (Target::Remote(r), Err((kind, msg))) = (target, &res) {
            let why = match kind {
                ErrKind::UnknownFunction => {
                    format!(
                        "no function `{func}` is registered on {}",
                        self.name_of(self.rank)
                    )
                }
                ErrKind::TypeMismatch => format!("`{func}`: type mismatch: {msg}"),
                _ => msg.clone(),
            };
            self.owned.fail_if_pending(r, why);
        }
        res
    }

    fn reply(&self, to: usize, id: u64, res: Result<Encoded<'static>, (ErrKind, String)>) {
        // References in a result are counted for the caller before it can
        // see them, as for arguments.
        let mut rrefs = Vec::new();
        let res = res.and_then(|mut e| {
            let r = std::mem::take(&mut e.rrefs);
            match self.fork_rrefs(&r) {
                Ok(()) => {
                    rrefs = r;
                    Ok(e)
                }
                Err(err) => Err((ErrKind::Remote, format!("cannot return a reference: {err}"))),
            }
        });
        let (enc, err) = match res {
            Ok(e) => (e, None),
            Err((k, m)) => match encode_owned(m) {
                Ok(e) => (e, Some(k)),
                Err(_) => return,
            },
        };
        let head = Head::Reply {
            id,
            err,
            blobs: enc.blob_count(),
            rrefs: wire_rrefs(&rrefs),
        };
        if to == self.rank {
            let blobs = enc.blob_copies();
            let mut enc = enc;
            if enc.seal(&head).is_err() {
                self.release(&rrefs);
                return;
            }
            let body_len = enc.bytes.len() - head_len(&enc.bytes);
            let p = Payload {
                frame: words_of(&enc.bytes),
                body_len,
                blobs,
                held: self.hold(&wire_rrefs(&rrefs)),
            };
            self.complete(id, Ok(Reply { err, payload: p }));
        } else if self.send(to, enc, &head).is_err() {
            // A caller that died cannot be answered; the counts taken for
            // it go back.
            self.release(&rrefs);
        }
    }

    /// A peer's reader failed: fail the calls pending on that peer (all of
    /// them when the transport as a whole failed).
    pub(crate) fn peer_gone(&self, peer: usize, e: CommError) {
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        let err = self.comm_error(peer, e);
        self.gone.lock().unwrap().insert(peer, err.clone());
        let all = self.pg.failure().is_some();
        let mut pend = self.pending.lock().unwrap();
        let ids: Vec<u64> = pend
            .iter()
            .filter(|(_, p)| p.to == peer || (all && p.to != self.rank))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(p) = pend.remove(&id) {
                p.slot.fill(Err(err.clone()));
            }
        }
    }

    /// Stop serving: no new calls, readers and pool wind down. Calls still
    /// pending fail now: with the readers gone no reply can reach them,
    /// and the timer ends with the agent (`start_call` fails those that
    /// slip in after this).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.jobs.lock().unwrap().take();
        let pend: Vec<Pending> = self
            .pending
            .lock()
            .unwrap()
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in pend {
            p.slot.fill(Err(RpcError::Shutdown(format!(
                "the agent of {} stopped while {} on {} was pending",
                self.name_of(self.rank),
                if p.func.is_empty() {
                    "a call"
                } else {
                    p.func.as_str()
                },
                self.name_of(p.to)
            ))));
        }
    }

    pub fn join_pool(&self) {
        let hs: Vec<_> = self.pool.lock().unwrap().drain(..).collect();
        for h in hs {
            let _ = h.join();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

/// References as a message's head lists them.
fn wire_rrefs(rrefs: &[(usize, RRefId)]) -> Vec<(u32, RRefId)> {
    rrefs.iter().map(|&(o, id)| (o as u32, id)).collect()
}

fn mismatch(m: String) -> (ErrKind, String) {
    (ErrKind::TypeMismatch, m)
}

fn ok_unit() -> Result<Encoded<'static>, (ErrKind, String)> {
    encode_owned(()).map_err(|e| (ErrKind::Codec, e.to_string()))
}

fn head_len(frame: &[u8]) -> usize {
    let n = frame.len() - 4;
    u32::from_le_bytes(frame[n..].try_into().unwrap()) as usize + 4
}

fn words_of(b: &[u8]) -> Vec<u64> {
    let mut w = vec![0u64; b.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..b.len()].copy_from_slice(b);
    w
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .expect("spawn rpc thread")
}

/// Every worker sends its name to every other; names must be distinct.
fn exchange_names(pg: &ProcessGroup, name: &str, timeout: Duration) -> RpcResult<Vec<String>> {
    let (me, n) = (pg.rank(), pg.size());
    for p in (0..n).filter(|&p| p != me) {
        pg.send_bytes(p, NAME_TAG, name.as_bytes(), timeout)?;
    }
    let deadline = Instant::now() + timeout;
    let mut names = Vec::with_capacity(n);
    for p in 0..n {
        if p == me {
            names.push(name.to_string());
            continue;
        }
        let m = pg.recv_bytes(p, NAME_TAG, deadline)?;
        names.push(String::from_utf8_lossy(m.bytes()).into_owned());
    }
    for (i, a) in names.iter().enumerate() {
        if let Some(j) = names[..i].iter().position(|b| b == a) {
            return Err(RpcError::Invalid(format!(
                "workers {j} and {i} are both named {a:?}; worker names must be distinct"
            )));
        }
    }
    Ok(names)
}
