//! `RpcFuture`: the result of a call that is still on its way. `wait()`
//! blocks for it; it is also a `std::future::Future`, woken by the reader
//! thread that receives the reply (or by the agent's timer at the call's
//! timeout).

use super::agent::Agent;
use super::codec::{self, ErrKind};
use super::error::{RpcError, RpcResult};
use super::registry::Payload;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// A reply as received: an error of `err`'s kind, or the result.
pub(crate) struct Reply {
    pub err: Option<ErrKind>,
    pub payload: Payload,
}

/// Where a reply lands.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<(Option<RpcResult<Reply>>, Option<Waker>)>,
    cv: Condvar,
}

impl Slot {
    pub fn fill(&self, r: RpcResult<Reply>) {
        let mut s = self.state.lock().unwrap();
        if s.0.is_none() {
            s.0 = Some(r);
        }
        let w = s.1.take();
        drop(s);
        self.cv.notify_all();
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// A call in flight; `wait()` gives its result.
#[must_use = "a call's result (or error) is only seen through its future"]
pub struct RpcFuture<R> {
    slot: Arc<Slot>,
    agent: Weak<Agent>,
    to: usize,
    func: String,
    deadline: Instant,
    timeout: Duration,
    _r: PhantomData<fn() -> R>,
}

impl<R: DeserializeOwned> RpcFuture<R> {
    pub(crate) fn new(
        slot: Arc<Slot>,
        agent: Weak<Agent>,
        to: usize,
        func: &str,
        timeout: Duration,
    ) -> Self {
        RpcFuture {
            slot,
            agent,
            to,
            func: func.to_string(),
            deadline: Instant::now() + timeout,
            timeout,
            _r: PhantomData,
        }
    }

    /// Block until the reply, the call's timeout, or the callee's death.
    pub fn wait(self) -> RpcResult<R> {
        let mut s = self.slot.state.lock().unwrap();
        loop {
            if let Some(r) = s.0.take() {
                drop(s);
                return self.finish(r);
            }
            let left = self.backstop().saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timeout_error());
            }
            s = self.slot.cv.wait_timeout(s, left).unwrap().0;
        }
    }

    /// The agent's timer fails late calls (and a stopping agent the calls
    /// still pending); this deadline, a little later, is a backstop should
    /// neither come.
    fn backstop(&self) -> Instant {
        self.deadline + Duration::from_secs(1)
    }

    /// Whether the reply (or an error) is here, so that `wait` will not block.
    pub fn is_ready(&self) -> bool {
        self.slot.state.lock().unwrap().0.is_some()
    }

    fn timeout_error(&self) -> RpcError {
        RpcError::Timeout {
            worker: self.worker(),
            func: self.func.clone(),
            after: self.timeout,
        }
    }

    fn worker(&self) -> String {
        match self.agent.upgrade() {
            Some(a) => a.name_of(self.to).to_string(),
            None => format!("worker {}", self.to),
        }
    }

    fn finish(&self, r: RpcResult<Reply>) -> RpcResult<R> {
        let reply = r?;
        let p = reply.payload;
        let body = &bytemuck::cast_slice::<u64, u8>(&p.frame)[..p.body_len];
        let Some(kind) = reply.err else {
            return codec::decode::<R>(body, p.blobs, p.held, self.agent.clone()).map_err(|e| {
                RpcError::Codec(format!(
                    "the reply of {} from {} is not a {}: {e}",
                    self.func,
                    self.worker(),
                    std::any::type_name::<R>()
                ))
            });
        };
        let msg: String = codec::decode(body, Vec::new(), Vec::new(), Weak::new())
            .unwrap_or_else(|e| format!("<undecodable error: {e}>"));
        let (worker, func) = (self.worker(), self.func.clone());
        Err(match kind {
            ErrKind::Remote => RpcError::Remote {
                worker,
                func,
                message: msg,
            },
            ErrKind::UnknownFunction => RpcError::UnknownFunction { worker, func },
            ErrKind::TypeMismatch => RpcError::TypeMismatch {
                worker,
                func,
                detail: msg,
            },
            ErrKind::Codec => RpcError::Codec(format!("{func} on {worker}: {msg}")),
        })
    }
}

impl<R: DeserializeOwned> Future for RpcFuture<R> {
    type Output = RpcResult<R>;
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut s = this.slot.state.lock().unwrap();
        match s.0.take() {
            Some(r) => {
                drop(s);
                Poll::Ready(this.finish(r))
            }
            // Past the backstop (see `wait`): a poller that looks again
            // (`wait_any` does, often) is not left waiting for good.
            None if Instant::now() >= this.backstop() => Poll::Ready(Err(this.timeout_error())),
            None => {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Wait for whichever of `futs` finishes first; returns its index and
/// result, and leaves `None` in its place. `None` when none is left.
pub fn wait_any<R: DeserializeOwned>(
    futs: &mut [Option<RpcFuture<R>>],
) -> Option<(usize, RpcResult<R>)> {
    struct Signal(std::sync::mpsc::Sender<usize>, usize);
    impl std::task::Wake for Signal {
        fn wake(self: Arc<Self>) {
            let _ = self.0.send(self.1);
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    loop {
        if futs.iter().all(|f| f.is_none()) {
            return None;
        }
        for (i, slot) in futs.iter_mut().enumerate() {
            let Some(f) = slot.as_mut() else { continue };
            let waker = Waker::from(Arc::new(Signal(tx.clone(), i)));
            let mut cx = Context::from_waker(&waker);
            if let Poll::Ready(r) = std::pin::Pin::new(f).poll(&mut cx) {
                *slot = None;
                return Some((i, r));
            }
        }
        // Woken by a reply, the agent's timer or its stop; looking again
        // every 100 ms also ends each future at its own backstop deadline.
        let _ = rx.recv_timeout(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wait_any` ends a future nobody completes (its agent gone, so no
    /// timer) at the future's own deadline; it used to wait forever.
    #[test]
    fn wait_any_ends_a_future_at_its_own_deadline() {
        let slot = Arc::new(Slot::default());
        let f = RpcFuture::<u8>::new(slot, Weak::new(), 3, "never", Duration::from_millis(10));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut futs = vec![Some(f)];
            let _ = tx.send(wait_any(&mut futs));
        });
        // 30 s: a hang guard; it ends about a second after the deadline.
        let got = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("wait_any never ended a future past its deadline");
        match got {
            Some((0, Err(RpcError::Timeout { func, .. }))) => assert_eq!(func, "never"),
            other => panic!(
                "{:?}",
                other.map(|(i, r)| (i, r.map_err(|e| e.to_string())))
            ),
        }
    }
}
