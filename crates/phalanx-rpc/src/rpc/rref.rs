//! Remote references: `remote` leaves a function's result on the worker
//! that ran it (the owner) and returns an `RRef` to it.
//!
//! Reference counting lives at the owner. The creator's reference counts
//! one; an `RRef` sent inside a message counts one more for its receiver,
//! and the sender waits for the owner to count it before the message
//! leaves (so no drop elsewhere can free the value first); dropping the
//! last clone of an `RRef` in a process sends one decrement. Increments,
//! decrements and creations are applied by the owner's reader threads in
//! the order each peer sent them, never on the pool. When the count
//! reaches zero the owner drops the value.
//!
//! A message lists the references it carries in its head, and its
//! receiver holds their counts (`Held`) from the moment it has the whole
//! message: decoding hands each to the `RRef` it builds, and whatever is
//! not decoded (an unknown function, a type mismatch, a late reply, a
//! future dropped unwaited) gives its counts back when dropped. A sender
//! whose message does not leave gives back what it counted.

use super::agent::Agent;
use super::codec::{self, encode, ErrKind, RRefId, Target};
use super::error::{RpcError, RpcResult};
use super::future::RpcFuture;
use super::registry::{FetchFn, Made, Value};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::any::type_name;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

enum State {
    Pending,
    Ready(Value, FetchFn, &'static str),
    Failed(String),
}

struct Owned {
    refs: i64,
    state: State,
}

/// The values this worker owns, by id.
#[derive(Default)]
pub(crate) struct OwnedTable {
    map: Mutex<HashMap<RRefId, Owned>>,
    cv: Condvar,
}

impl OwnedTable {
    pub fn create(&self, id: RRefId) {
        self.map.lock().unwrap().insert(
            id,
            Owned {
                refs: 1,
                state: State::Pending,
            },
        );
    }

    /// The function behind `remote` finished. If every reference was
    /// dropped meanwhile, the value is dropped here.
    pub fn set(&self, id: RRefId, made: Result<Made, (ErrKind, String)>) {
        let mut m = self.map.lock().unwrap();
        if let Some(o) = m.get_mut(&id) {
            o.state = match made {
                Ok(v) => State::Ready(v.value, v.fetch, v.ty),
                Err((_, msg)) => State::Failed(msg),
            };
        }
        drop(m);
        self.cv.notify_all();
    }

    /// A `remote` call refused before its function ran (no such function,
    /// other types): the value fails with `msg`, unless it was set.
    pub fn fail_if_pending(&self, id: RRefId, msg: String) {
        let mut m = self.map.lock().unwrap();
        if let Some(o) = m.get_mut(&id) {
            if matches!(o.state, State::Pending) {
                o.state = State::Failed(msg);
            }
        }
        drop(m);
        self.cv.notify_all();
    }

    pub fn incref(&self, id: RRefId) -> Result<(), String> {
        match self.map.lock().unwrap().get_mut(&id) {
            Some(o) => {
                o.refs += 1;
                Ok(())
            }
            None => Err(format!("the value {id:?} was already freed")),
        }
    }

    pub fn decref(&self, id: RRefId) {
        let mut m = self.map.lock().unwrap();
        let gone = m.get_mut(&id).is_some_and(|o| {
            o.refs -= 1;
            o.refs <= 0
        });
        let v = if gone { m.remove(&id) } else { None };
        drop(m);
        drop(v); // outside the lock: a value's drop may do anything
    }

    /// Wait until the value is made.
    pub fn wait(
        &self,
        id: RRefId,
        deadline: Instant,
    ) -> Result<(Value, FetchFn, &'static str), (ErrKind, String)> {
        let mut m = self.map.lock().unwrap();
        loop {
            match m.get(&id).map(|o| &o.state) {
                None => return Err((ErrKind::Remote, format!("no value {id:?} here (freed)"))),
                Some(State::Ready(v, f, t)) => return Ok((v.clone(), *f, t)),
                Some(State::Failed(msg)) => {
                    return Err((ErrKind::Remote, format!("creating the value failed: {msg}")))
                }
                Some(State::Pending) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err((ErrKind::Remote, "the value was not made in time".into()));
            }
            m = self.cv.wait_timeout(m, left).unwrap().0;
        }
    }

    pub fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    pub fn local<T: 'static + Send + Sync>(&self, id: RRefId) -> Option<Arc<T>> {
        match &self.map.lock().unwrap().get(&id)?.state {
            State::Ready(v, ..) => v.clone().downcast::<T>().ok(),
            _ => None,
        }
    }
}

/// A reference to a value of type `T` owned by some worker.
///
/// Clones share one reference; the owner frees the value once every
/// `RRef` to it, on every worker, is dropped. An `RRef` may be sent to
/// other workers inside arguments or results.
pub struct RRef<T> {
    inner: Arc<Inner>,
    _t: PhantomData<fn() -> T>,
}

struct Inner {
    owner: usize,
    id: RRefId,
    agent: Weak<Agent>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(a) = self.agent.upgrade() {
            a.decref_at(self.owner, self.id);
        }
    }
}

/// One count of a reference that a received message carries, held for
/// the receiver until an `RRef` decoded from the message takes it; given
/// back to the owner when dropped untaken.
pub(crate) struct Held(Arc<Inner>);

impl Held {
    pub(crate) fn new(owner: usize, id: RRefId, agent: Weak<Agent>) -> Held {
        Held(Arc::new(Inner { owner, id, agent }))
    }

    fn is(&self, owner: usize, id: RRefId) -> bool {
        self.0.owner == owner && self.0.id == id
    }
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            inner: self.inner.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RRef<{}>({:?} on rank {})",
            type_name::<T>(),
            self.inner.id,
            self.inner.owner
        )
    }
}

impl<T: 'static> RRef<T> {
    pub(crate) fn new(owner: usize, id: RRefId, agent: Weak<Agent>) -> Self {
        RRef {
            inner: Arc::new(Inner { owner, id, agent }),
            _t: PhantomData,
        }
    }

    fn agent(&self) -> RpcResult<Arc<Agent>> {
        self.inner
            .agent
            .upgrade()
            .ok_or_else(|| RpcError::Shutdown("the RPC agent of this RRef is gone".into()))
    }

    /// The owner's rank.
    pub fn owner_rank(&self) -> usize {
        self.inner.owner
    }

    /// The owner's worker name.
    pub fn owner(&self) -> String {
        match self.inner.agent.upgrade() {
            Some(a) => a.name_of(self.inner.owner).to_string(),
            None => format!("worker {}", self.inner.owner),
        }
    }

    pub fn is_owner(&self) -> bool {
        self.inner
            .agent
            .upgrade()
            .is_some_and(|a| a.rank == self.inner.owner)
    }

    /// The value itself, on its owner (once made); `None` elsewhere.
    pub fn local_value(&self) -> Option<Arc<T>>
    where
        T: Send + Sync,
    {
        let a = self.inner.agent.upgrade()?;
        (a.rank == self.inner.owner)
            .then(|| a.owned.local::<T>(self.inner.id))
            .flatten()
    }

    /// A copy of the value, fetched from its owner (waits until it is made).
    pub fn to_here(&self) -> RpcResult<T>
    where
        T: DeserializeOwned,
    {
        let a = self.agent()?;
        let t = a.opts.timeout;
        let enc = encode(&());
        let target = Target::Fetch(self.inner.id);
        let slot = a.start_call(
            self.inner.owner,
            "to_here",
            "",
            type_name::<T>(),
            target,
            enc,
            t,
        );
        RpcFuture::<T>::new(
            slot,
            self.inner.agent.clone(),
            self.inner.owner,
            "to_here",
            t,
        )
        .wait()
    }

    /// Run the method `method` (see `Registry::register_method`) on the
    /// value, on its owner.
    pub fn rpc_sync<A: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        args: &A,
    ) -> RpcResult<R> {
        self.rpc_async(method, args)?.wait()
    }

    pub fn rpc_async<A: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        args: &A,
    ) -> RpcResult<RpcFuture<R>> {
        let a = self.agent()?;
        Ok(self.call(&a, method, args, a.opts.timeout))
    }

    fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        a: &Arc<Agent>,
        method: &str,
        args: &A,
        t: Duration,
    ) -> RpcFuture<R> {
        let (at, rt) = (type_name::<A>(), type_name::<R>());
        let target = Target::Method(self.inner.id);
        let slot = a.start_call(self.inner.owner, method, at, rt, target, encode(args), t);
        RpcFuture::new(slot, self.inner.agent.clone(), self.inner.owner, method, t)
    }
}

#[derive(Serialize, Deserialize)]
struct Wire {
    owner: u32,
    id: RRefId,
    ty: String,
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        codec::record_rref(self.inner.owner, self.inner.id);
        Wire {
            owner: self.inner.owner as u32,
            id: self.inner.id,
            ty: type_name::<T>().to_string(),
        }
        .serialize(s)
    }
}

impl<'de, T: 'static> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let w = Wire::deserialize(d)?;
        let owner = w.owner as usize;
        // The message's count for this reference, if it listed it (it
        // does, unless it is from an older sender).
        let (agent, held) = codec::DEC
            .with(|c| {
                c.borrow_mut().as_mut().map(|c| {
                    let i = c.held.iter().position(|h| h.is(owner, w.id));
                    (c.agent.clone(), i.map(|i| c.held.swap_remove(i)))
                })
            })
            .ok_or_else(|| {
                D::Error::custom("an RRef can only be received through phalanx_rpc::rpc")
            })?;
        // An owner outside the world has no count to give back, and no
        // connection to give it back on.
        if let Some(world) = agent.upgrade().map(|a| a.names.len()) {
            if owner >= world {
                return Err(D::Error::custom(format!(
                    "received an RRef owned by rank {owner}, but the world has {world} workers"
                )));
            }
        }
        // Built first, so that a mismatch below still gives back the count
        // the sender took for this reference.
        let r = match held {
            Some(Held(inner)) => RRef {
                inner,
                _t: PhantomData,
            },
            None => RRef::new(owner, w.id, agent),
        };
        if w.ty != type_name::<T>() {
            return Err(D::Error::custom(format!(
                "received an RRef<{}> where an RRef<{}> was expected",
                w.ty,
                type_name::<T>()
            )));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::{Options, Registry, Rpc};

    /// A reference naming an owner outside the world is refused where it
    /// is received, and one that exists anyway fails its calls: it used to
    /// index the agent's per-peer send locks out of bounds (a panic; on a
    /// reader thread, a peer silently no longer read).
    #[test]
    fn a_reference_owned_outside_the_world_is_refused() {
        phalanx_comm::threads::run(1, |pg| {
            let rpc = Rpc::start(&pg, "w0", Registry::new(), Options::default()).unwrap();
            let id = RRefId {
                creator: 0,
                seq: u64::MAX,
            };
            let wire = Wire {
                owner: 7,
                id,
                ty: type_name::<i64>().to_string(),
            };
            let body = encode(&wire).unwrap().bytes;
            let got = codec::decode::<RRef<i64>>(&body, Vec::new(), Vec::new(), rpc.weak());
            let e = got.expect_err("an RRef owned by rank 7 of 1 was accepted");
            assert!(e.contains("rank 7"), "{e}");
            // Built some other way: its calls fail, and so does nothing
            // else when it is dropped.
            let r = RRef::<i64>::new(7, id, rpc.weak());
            let e = r.to_here().unwrap_err();
            assert!(
                matches!(e, RpcError::UnknownWorker(ref m) if m.contains('7')),
                "{e}"
            );
            drop(r);
            rpc.shutdown().unwrap();
        });
    }
}
