//! Functions callable by name: each is stored with the names of its
//! argument and result types, so that a caller using other types gets a
//! `TypeMismatch` error instead of garbage (bincode is not self-describing),
//! and with the code that (de)serialises them, monomorphised here.

use super::codec::{encode, encode_owned, Encoded, ErrKind, Words};
use super::error::RpcResult;
use super::Rpc;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::any::{type_name, Any};
use std::collections::HashMap;
use std::sync::Arc;

/// What a function knows about the call it serves.
pub struct Ctx {
    pub(crate) rpc: Rpc,
    pub(crate) caller: usize,
}

impl Ctx {
    /// This worker's agent, to make calls of its own.
    pub fn rpc(&self) -> &Rpc {
        &self.rpc
    }
    /// The calling worker's name.
    pub fn caller(&self) -> &str {
        self.rpc.worker_name(self.caller)
    }
    pub fn caller_rank(&self) -> usize {
        self.caller
    }
}

/// Arguments as received: the first frame (its body is the first
/// `body_len` bytes), the blobs, and the counts of the references the body
/// carries (given back if the body is dropped undecoded).
pub(crate) struct Payload {
    pub frame: Vec<u64>,
    pub body_len: usize,
    pub blobs: Vec<Words>,
    pub held: Vec<super::rref::Held>,
}

impl Payload {
    pub fn decode<T: DeserializeOwned>(self, ctx: &Ctx) -> Result<T, Fail> {
        let body = &bytemuck::cast_slice::<u64, u8>(&self.frame)[..self.body_len];
        super::codec::decode(body, self.blobs, self.held, ctx.rpc.weak()).map_err(|e| {
            (
                ErrKind::Codec,
                format!("cannot decode the arguments as {}: {e}", type_name::<T>()),
            )
        })
    }
}

pub(crate) type Fail = (ErrKind, String);
pub(crate) type Value = Arc<dyn Any + Send + Sync>;
/// Serialise a copy of an owned value (`RRef::to_here`).
pub(crate) type FetchFn = fn(&Value) -> RpcResult<Encoded<'static>>;

/// A value made by `remote`, to keep on this worker.
pub(crate) struct Made {
    pub value: Value,
    pub fetch: FetchFn,
    pub ty: &'static str,
}

type CallFn = dyn Fn(&Ctx, Payload) -> Result<Encoded<'static>, Fail> + Send + Sync;
type MakeFn = dyn Fn(&Ctx, Payload) -> Result<Made, Fail> + Send + Sync;
type MethodFn = dyn Fn(&Ctx, &Value, Payload) -> Result<Encoded<'static>, Fail> + Send + Sync;

pub(crate) enum Kind {
    Func {
        call: Box<CallFn>,
        make: Box<MakeFn>,
    },
    Method {
        self_ty: &'static str,
        call: Box<MethodFn>,
    },
}

pub(crate) struct Entry {
    pub args_ty: &'static str,
    pub ret_ty: &'static str,
    pub kind: Kind,
}

fn fetch<R: Serialize + Send + Sync + 'static>(v: &Value) -> RpcResult<Encoded<'static>> {
    let keep = v.clone();
    let r: &R = v.downcast_ref::<R>().expect("checked when stored");
    let p: *const R = r;
    // SAFETY: `keep` holds the Arc, so the value outlives the message.
    let e: Encoded<'static> = unsafe { std::mem::transmute(encode(&*p)?) };
    Ok(e.keeping(Box::new(keep)))
}

/// The functions a worker serves, built before `init_rpc` so that no call
/// can arrive before its function is known.
///
/// ```
/// let mut reg = phalanx_rpc::rpc::Registry::new();
/// reg.register("add", |_ctx, (a, b): (i64, i64)| a + b);
/// reg.register_fallible("div", |_ctx, (a, b): (i64, i64)| {
///     a.checked_div(b).ok_or_else(|| format!("{a} / {b}: division by zero"))
/// });
/// ```
#[derive(Default, Clone)]
pub struct Registry {
    map: HashMap<String, Arc<Entry>>,
    /// The fewest pool threads (`Options::threads`) the functions need,
    /// and why: the largest asked for.
    min_threads: Option<(usize, String)>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// The functions served need at least `n` pool threads (some of them
    /// wait, on a pool thread, for calls that need a thread of their own);
    /// `Rpc::start` with fewer is refused with `why`.
    pub fn require_threads(&mut self, n: usize, why: &str) -> &mut Self {
        if self.min_threads.as_ref().is_none_or(|(m, _)| n > *m) {
            self.min_threads = Some((n, why.to_string()));
        }
        self
    }

    /// What [`Registry::require_threads`] asked for, if anything.
    pub fn min_threads(&self) -> Option<(usize, &str)> {
        self.min_threads.as_ref().map(|(n, w)| (*n, w.as_str()))
    }

    /// Serve `f` under `name`.
    pub fn register<A, R, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&Ctx, A) -> R + Send + Sync + 'static,
    {
        self.register_fallible(name, move |c, a| Ok(f(c, a)))
    }

    /// Serve `f` under `name`; its `Err` reaches the caller as
    /// `RpcError::Remote` with the message.
    pub fn register_fallible<A, R, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&Ctx, A) -> Result<R, String> + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let g = f.clone();
        let call = move |c: &Ctx, p: Payload| -> Result<Encoded<'static>, Fail> {
            let r = f(c, p.decode::<A>(c)?).map_err(|m| (ErrKind::Remote, m))?;
            encode_owned(r).map_err(|e| (ErrKind::Codec, e.to_string()))
        };
        let make = move |c: &Ctx, p: Payload| -> Result<Made, Fail> {
            let r = g(c, p.decode::<A>(c)?).map_err(|m| (ErrKind::Remote, m))?;
            Ok(Made {
                value: Arc::new(r),
                fetch: fetch::<R>,
                ty: type_name::<R>(),
            })
        };
        self.insert(
            name,
            type_name::<A>(),
            type_name::<R>(),
            Kind::Func {
                call: Box::new(call),
                make: Box::new(make),
            },
        )
    }

    /// Serve `f` as a method of values of type `T` owned here: callers
    /// reach it through an `RRef<T>` (`RRef::rpc_sync`). Put interior
    /// mutability (a `Mutex`) in `T` for methods that change it.
    pub fn register_method<T, A, R, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&Ctx, &T, A) -> Result<R, String> + Send + Sync + 'static,
    {
        let call = move |c: &Ctx, v: &Value, p: Payload| -> Result<Encoded<'static>, Fail> {
            let this = v.downcast_ref::<T>().ok_or_else(|| {
                (
                    ErrKind::TypeMismatch,
                    format!("method needs an RRef to {}", type_name::<T>()),
                )
            })?;
            let r = f(c, this, p.decode::<A>(c)?).map_err(|m| (ErrKind::Remote, m))?;
            encode_owned(r).map_err(|e| (ErrKind::Codec, e.to_string()))
        };
        self.insert(
            name,
            type_name::<A>(),
            type_name::<R>(),
            Kind::Method {
                self_ty: type_name::<T>(),
                call: Box::new(call),
            },
        )
    }

    fn insert(&mut self, name: &str, a: &'static str, r: &'static str, kind: Kind) -> &mut Self {
        let e = Entry {
            args_ty: a,
            ret_ty: r,
            kind,
        };
        self.map.insert(name.to_string(), Arc::new(e));
        self
    }

    pub(crate) fn get(&self, name: &str) -> Option<Arc<Entry>> {
        self.map.get(name).cloned()
    }

    /// Names of the registered functions, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.map.keys().cloned().collect();
        v.sort();
        v
    }
}
