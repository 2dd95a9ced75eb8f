//! The wire format of RPC messages, and `Blob`, the payload that travels
//! beside the serialised message instead of inside it.
//!
//! A message is one frame `[body][head][u32 head length]` followed by one
//! frame per blob. The body is the bincode of the arguments (or result);
//! the head says what to do with it and is written after the body so that
//! the body is serialised straight into the frame, never copied. A `Blob`
//! in the body is only an index: its bytes go out as their own frame,
//! written from the sender's memory to the socket, and the receiver keeps
//! the transport's buffer as the blob's storage (PyTorch's RPC sends
//! tensors beside the pickle the same way). That is what makes a 4 MB
//! tensor cost one copy into the kernel and one out of it.

use super::error::{RpcError, RpcResult};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::RefCell;
use std::marker::PhantomData;

/// Identity of a value owned by a worker: who created the reference, and
/// its number there (unique across the job).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct RRefId {
    pub creator: u32,
    pub seq: u64,
}

/// What a call asks the callee to do.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub(crate) enum Target {
    /// Run the function, return its result.
    Func,
    /// Run the function, keep its result as the value `RRefId` (`remote`).
    Remote(RRefId),
    /// Run a method on the owned value (`RRef::rpc_sync`).
    Method(RRefId),
    /// Return a copy of the owned value (`RRef::to_here`).
    Fetch(RRefId),
    /// One more holder of the owned value (an `RRef` sent to another worker).
    Incref(RRefId),
}

#[derive(Serialize, Deserialize, Debug)]
pub(crate) enum Head {
    Call {
        id: u64,
        func: String,
        args_ty: String,
        ret_ty: String,
        target: Target,
        blobs: u32,
        /// The references the body carries (owner, id), each counted at
        /// its owner for the receiver: one that never decodes the body (an
        /// unknown function, a late reply) still gives the counts back.
        rrefs: Vec<(u32, RRefId)>,
    },
    Reply {
        id: u64,
        /// `None`: the body is the result; `Some(kind)`: the body is an
        /// error message of that kind.
        err: Option<ErrKind>,
        blobs: u32,
        /// As for `Call`.
        rrefs: Vec<(u32, RRefId)>,
    },
    /// A holder of the value dropped its reference.
    Decref(RRefId),
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub(crate) enum ErrKind {
    Remote,
    UnknownFunction,
    TypeMismatch,
    Codec,
}

fn opts() -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .reject_trailing_bytes()
}

/// A serialised message, possibly borrowing the blobs of the value it was
/// made from (`'a`), or owning that value (`keep`).
pub(crate) struct Encoded<'a> {
    pub bytes: Vec<u8>,
    slices: Vec<(*const u8, usize)>,
    /// References to values owned elsewhere that this message carries: each
    /// needs an increment at its owner before the message leaves.
    pub rrefs: Vec<(usize, RRefId)>,
    _keep: Option<Box<dyn std::any::Any + Send>>,
    /// The buffers of the blobs, shared with the `Blob`s serialised: a blob
    /// read through a lock (a `Mutex<Blob>` serialises under its guard and
    /// unlocks on return) and replaced meanwhile stays alive here until
    /// the message is sent.
    _blobs: Vec<BlobKeep>,
    _borrow: PhantomData<&'a ()>,
}

/// A blob's buffer, kept alive for as long as a message points into it.
type BlobKeep = std::sync::Arc<dyn std::any::Any + Send + Sync>;

// SAFETY: the raw slices point into buffers held by `_blobs` (immutable:
// a `Blob` has no mutable access to its elements), so shared across
// threads like &[u8].
unsafe impl Send for Encoded<'_> {}

impl<'a> Encoded<'a> {
    pub fn blobs(&self) -> impl Iterator<Item = &[u8]> + '_ {
        // SAFETY: see the type; the regions live as long as `_blobs`.
        self.slices
            .iter()
            .map(|&(p, n)| unsafe { std::slice::from_raw_parts(p, n) })
    }
    pub fn blob_count(&self) -> u32 {
        self.slices.len() as u32
    }
    /// Append the head, making `bytes` a complete first frame.
    pub fn seal(&mut self, head: &Head) -> RpcResult<()> {
        use bincode::Options;
        let start = self.bytes.len();
        opts()
            .serialize_into(&mut self.bytes, head)
            .map_err(|e| RpcError::Codec(e.to_string()))?;
        let n = (self.bytes.len() - start) as u32;
        self.bytes.extend_from_slice(&n.to_le_bytes());
        Ok(())
    }
    /// The same message, also owning `keep` (which the slices point into).
    pub fn keeping(mut self, keep: Box<dyn std::any::Any + Send>) -> Self {
        self._keep = Some(keep);
        self
    }
    /// Copies of the blobs, as a receiver would hold them (calls to self).
    pub fn blob_copies(&self) -> Vec<Words> {
        self.blobs()
            .map(|b| {
                let mut w = vec![0u64; b.len().div_ceil(8)];
                bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..b.len()].copy_from_slice(b);
                (w, b.len())
            })
            .collect()
    }
}

/// A received buffer: 8-byte aligned words and the length in bytes.
pub(crate) type Words = (Vec<u64>, usize);

#[derive(Default)]
struct EncodeCtx {
    slices: Vec<(*const u8, usize)>,
    keep: Vec<BlobKeep>,
    rrefs: Vec<(usize, RRefId)>,
}

pub(crate) struct DecodeCtx {
    pub blobs: Vec<Option<Words>>,
    pub agent: std::sync::Weak<super::agent::Agent>,
    /// The counted references of the message (see `Head::Call::rrefs`),
    /// taken by the `RRef`s decoded; the rest are given back when dropped.
    pub held: Vec<super::rref::Held>,
}

thread_local! {
    static ENC: RefCell<Option<EncodeCtx>> = const { RefCell::new(None) };
    pub(crate) static DEC: RefCell<Option<DecodeCtx>> = const { RefCell::new(None) };
}

/// Serialise `v`, collecting its blobs and references.
pub(crate) fn encode<T: Serialize + ?Sized>(v: &T) -> RpcResult<Encoded<'_>> {
    use bincode::Options;
    let prev = ENC.with(|c| c.replace(Some(EncodeCtx::default())));
    // `serialize_into`, not `serialize`: the latter runs a sizing pass
    // first, which would record every blob and reference twice.
    let mut bytes = Vec::new();
    let res = opts().serialize_into(&mut bytes, v);
    let ctx = ENC.with(|c| c.replace(prev)).unwrap_or_default();
    res.map_err(|e| RpcError::Codec(e.to_string()))?;
    Ok(Encoded {
        bytes,
        slices: ctx.slices,
        rrefs: ctx.rrefs,
        _keep: None,
        _blobs: ctx.keep,
        _borrow: PhantomData,
    })
}

/// Serialise a value that the message then owns (results on the callee).
pub(crate) fn encode_owned<T: Serialize + Send + 'static>(v: T) -> RpcResult<Encoded<'static>> {
    let b = Box::new(v);
    let p: *const T = &*b;
    // SAFETY: the box's contents never move, and the box lives in `_keep`
    // for as long as the slices that point into it.
    let mut e: Encoded<'static> = unsafe { std::mem::transmute(encode(&*p)?) };
    e._keep = Some(b);
    Ok(e)
}

/// Deserialise `body` with its blobs; `agent` builds received `RRef`s,
/// which take their counts from `held` (those left are given back).
pub(crate) fn decode<T: DeserializeOwned>(
    body: &[u8],
    blobs: Vec<Words>,
    held: Vec<super::rref::Held>,
    agent: std::sync::Weak<super::agent::Agent>,
) -> Result<T, String> {
    use bincode::Options;
    let ctx = DecodeCtx {
        blobs: blobs.into_iter().map(Some).collect(),
        agent,
        held,
    };
    let prev = DEC.with(|c| c.replace(Some(ctx)));
    let res = opts().with_limit(body.len() as u64 + 64).deserialize(body);
    DEC.with(|c| c.replace(prev));
    res.map_err(|e| e.to_string())
}

/// Split a first frame into its body and head.
pub(crate) fn open(frame: &[u8]) -> RpcResult<(&[u8], Head)> {
    use bincode::Options;
    let bad = || RpcError::Codec(format!("malformed frame of {} bytes", frame.len()));
    let n = frame.len().checked_sub(4).ok_or_else(bad)?;
    let hl = u32::from_le_bytes(frame[n..].try_into().unwrap()) as usize;
    let start = n.checked_sub(hl).ok_or_else(bad)?;
    let head = opts()
        .with_limit(hl as u64 + 64)
        .deserialize(&frame[start..n])
        .map_err(|e| RpcError::Codec(format!("malformed head: {e}")))?;
    Ok((&frame[..start], head))
}

pub(crate) fn record_rref(owner: usize, id: RRefId) {
    ENC.with(|c| {
        if let Some(c) = c.borrow_mut().as_mut() {
            c.rrefs.push((owner, id));
        }
    });
}

/// A flat array of plain values (`f32`, `i64`, `u8`, ...) that an RPC moves
/// without copying: the sender's memory goes straight to the socket, and
/// the receiver's blob is the buffer the transport read it into. Use it for
/// tensors and embedding rows; a `Vec<f32>` in the arguments also works,
/// but is copied through the serialiser.
///
/// ```
/// use phalanx_rpc::rpc::Blob;
/// let b = Blob::from(vec![1.0f32, 2.0, 3.0]);
/// assert_eq!(&b[..], &[1.0, 2.0, 3.0]);
/// assert_eq!(b.into_vec(), vec![1.0, 2.0, 3.0]);
/// ```
///
/// A `Blob` is immutable and its buffer shared (`Clone` copies nothing): a
/// message in flight keeps the buffer it points into alive, even when the
/// `Blob` itself is replaced meanwhile (under a `Mutex` in an `RRef`'s
/// value, say).
pub struct Blob<T: bytemuck::Pod> {
    store: Store<T>,
}

enum Store<T> {
    Vec(std::sync::Arc<Vec<T>>),
    /// A received buffer and the number of elements in it.
    Words(std::sync::Arc<Vec<u64>>, usize),
}

impl<T: bytemuck::Pod> Blob<T> {
    pub fn as_slice(&self) -> &[T] {
        match &self.store {
            Store::Vec(v) => v,
            Store::Words(w, n) => {
                let bytes = &bytemuck::cast_slice::<u64, u8>(w)[..n * std::mem::size_of::<T>()];
                bytemuck::cast_slice(bytes)
            }
        }
    }
    /// The elements, without a copy when this `Blob` holds the only
    /// reference to a buffer it was made from.
    pub fn into_vec(self) -> Vec<T> {
        match self.store {
            Store::Vec(v) => std::sync::Arc::try_unwrap(v).unwrap_or_else(|v| v.to_vec()),
            Store::Words(..) => self.as_slice().to_vec(),
        }
    }
}

impl<T: bytemuck::Pod> From<Vec<T>> for Blob<T> {
    fn from(v: Vec<T>) -> Self {
        Blob {
            store: Store::Vec(std::sync::Arc::new(v)),
        }
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Blob<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for Blob<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice().iter()).finish()
    }
}

impl<T: bytemuck::Pod> Clone for Blob<T> {
    fn clone(&self) -> Self {
        Blob {
            store: match &self.store {
                Store::Vec(v) => Store::Vec(v.clone()),
                Store::Words(w, n) => Store::Words(w.clone(), *n),
            },
        }
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for Blob<T> {
    fn eq(&self, o: &Self) -> bool {
        self.as_slice() == o.as_slice()
    }
}

impl<T: bytemuck::Pod + Send + Sync> Serialize for Blob<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let bytes: &[u8] = bytemuck::cast_slice(self.as_slice());
        let keep: BlobKeep = match &self.store {
            Store::Vec(v) => v.clone(),
            Store::Words(w, _) => w.clone(),
        };
        let idx = ENC.with(|c| {
            c.borrow_mut().as_mut().map(|c| {
                c.slices.push((bytes.as_ptr(), bytes.len()));
                c.keep.push(keep);
                c.slices.len() - 1
            })
        });
        match idx {
            Some(i) => s.serialize_u32(i as u32),
            None => Err(serde::ser::Error::custom(
                "a Blob can only be serialised by phalanx_rpc::rpc",
            )),
        }
    }
}

impl<'de, T: bytemuck::Pod> Deserialize<'de> for Blob<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let i = u32::deserialize(d)? as usize;
        let size = std::mem::size_of::<T>();
        if std::mem::align_of::<T>() > 8 || size == 0 {
            return Err(D::Error::custom(
                "Blob elements must be aligned to at most 8 bytes",
            ));
        }
        let words = DEC.with(|c| {
            c.borrow_mut()
                .as_mut()
                .and_then(|c| c.blobs.get_mut(i).and_then(|b| b.take()))
        });
        let (w, len) = words.ok_or_else(|| D::Error::custom(format!("blob #{i} is missing")))?;
        if len % size != 0 {
            return Err(D::Error::custom(format!(
                "blob of {len} bytes is not a whole number of {}",
                std::any::type_name::<T>()
            )));
        }
        Ok(Blob {
            store: Store::Words(std::sync::Arc::new(w), len / size),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_blob_replaced_after_serialising_stays_in_the_message() {
        // A value behind a lock serialises under the guard, which is
        // released on return: the message must not point into a buffer
        // that the next writer frees.
        let m = Mutex::new(Blob::from(vec![1.5f32; 4096]));
        let enc = encode(&m).unwrap();
        *m.lock().unwrap() = Blob::from(vec![-7.0f32; 4096]);
        // Reuse the freed memory, were it freed.
        let junk: Vec<Vec<f32>> = (0..16).map(|_| vec![9.0f32; 4096]).collect();
        let sent: Vec<&[u8]> = enc.blobs().collect();
        assert_eq!(sent.len(), 1);
        assert!(
            bytemuck::cast_slice::<u8, f32>(sent[0])
                .iter()
                .all(|&v| v == 1.5),
            "the message holds the values it was made from"
        );
        drop(junk);
    }

    #[test]
    fn a_blob_clone_shares_and_into_vec_copies_only_when_shared() {
        let b = Blob::from(vec![1u8, 2, 3]);
        let p = b.as_ptr();
        let c = b.clone();
        assert_eq!(c.as_ptr(), p, "a clone shares the buffer");
        assert_eq!(c.into_vec(), vec![1, 2, 3]);
        let v = b.into_vec();
        assert_eq!(v.as_ptr(), p, "the last holder gets the buffer back");
    }
}
