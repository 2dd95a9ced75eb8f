//! The comm `Backend` seam: what carries a group's messages.
//!
//! `ProcessGroup` is the public face (PyTorch's `ProcessGroup`); a
//! `Backend` is what runs its operations (c10d's `Backend`: gloo, NCCL,
//! MPI). The group does everything that does not depend on the wire, once
//! for every backend:
//! - argument validation (counts, roots, peers), with the same errors;
//! - issue order: a sequence number per collective, one collective at a
//!   time per group, synchronous calls after earlier asynchronous ones;
//! - the asynchronous `Work` queues (one communication thread for
//!   collectives, one for point-to-point receives);
//! - `PHALANX_DEBUG=detail`: the backend only exchanges the signatures,
//!   the group compares them and names each rank's call;
//! - sub-group membership (`new_group`, `split`): the backend only makes
//!   the child's carrier.
//!
//! A backend gets type-erased buffers ([`Bytes`], [`BytesMut`]: the bytes
//! of a `[T]` and its [`DType`]) so the trait is object safe; an
//! implementation gets its typed slice back with [`for_dtype!`] and
//! [`BytesMut::typed`]. Implementations: [`native`] (Phalanx's transports:
//! shared memory, Unix sockets, TCP), `crate::mpi` (feature `mpi`) and
//! [`detached`] (no peers: a group that only says where a rank stands).
//!
//! ```
//! use phalanx_comm::{threads, ReduceOp};
//! // Every group runs on one backend; the world group of `threads::run`
//! // is the native one.
//! let names = threads::run(2, |pg| {
//!     let mut x = [1.0f32; 3];
//!     pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
//!     (pg.backend_name(), x)
//! });
//! assert_eq!(names[0], ("native", [2.0; 3]));
//! ```

pub mod detached;
pub mod native;

use crate::config::Config;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::transport::{Link, Msg};
use std::sync::Arc;
use std::time::Instant;

/// A buffer in CUDA device memory, reduced where it lies by a backend that
/// can ([`Backend::device_ordinal`]): `count` elements of `dtype` at
/// device address `ptr` on CUDA device `ordinal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    pub ptr: u64,
    pub count: usize,
    pub dtype: DType,
    pub ordinal: usize,
    /// The CUDA stream (a raw `CUstream`; 0 is the legacy default stream)
    /// on which the caller queued its writes to the buffer: the collective
    /// is ordered after them on the device (an event recorded there and
    /// waited for on the backend's stream), and the host does not wait for
    /// them. `None`: they are complete.
    pub after: Option<u64>,
}

/// When a device-memory collective returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMode {
    /// Once it is complete.
    Wait,
    /// Once it is launched, where the backend can (NCCL, on its own
    /// stream); [`Backend::settle_device`] waits for the first so many
    /// started ([`Backend::device_mark`]). The caller touches the buffer
    /// only after that.
    Start,
}

/// The bytes of a `[T]`, with `T`'s dtype.
#[derive(Clone, Copy)]
pub struct Bytes<'a> {
    dtype: DType,
    data: &'a [u8],
}

/// The bytes of a `&mut [T]`, with `T`'s dtype.
pub struct BytesMut<'a> {
    dtype: DType,
    data: &'a mut [u8],
}

impl<'a> Bytes<'a> {
    pub fn of<T: Element>(x: &'a [T]) -> Bytes<'a> {
        Bytes {
            dtype: T::DTYPE,
            data: bytemuck::cast_slice(x),
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The slice as `T`s; `T` must be the dtype it was made from.
    pub fn typed<T: Element>(self) -> &'a [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "a backend read a buffer as another dtype"
        );
        bytemuck::cast_slice(self.data)
    }
}

impl<'a> BytesMut<'a> {
    pub fn of<T: Element>(x: &'a mut [T]) -> BytesMut<'a> {
        BytesMut {
            dtype: T::DTYPE,
            data: bytemuck::cast_slice_mut(x),
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The slice as `T`s; `T` must be the dtype it was made from.
    pub fn typed<T: Element>(self) -> &'a mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "a backend wrote a buffer as another dtype"
        );
        bytemuck::cast_slice_mut(self.data)
    }
}

/// Run `$body` with `$T` the element type of `$dtype` (a backend's generic
/// code over [`Element`] behind the type-erased trait).
#[macro_export]
macro_rules! for_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {{
        use $crate::dtype::DType as D;
        match $dtype {
            D::F32 => {
                type $T = f32;
                $body
            }
            D::F64 => {
                type $T = f64;
                $body
            }
            D::F16 => {
                type $T = $crate::f16;
                $body
            }
            D::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            D::I32 => {
                type $T = i32;
                $body
            }
            D::I64 => {
                type $T = i64;
                $body
            }
        }
    }};
}

/// One operation of one group, as its backend sees it.
pub struct Call<'a> {
    /// Group rank -> global (world) rank.
    pub members: &'a [usize],
    /// This process's rank in the group.
    pub me: usize,
    /// The group's id: the same on every member, distinct per group.
    pub gid: u64,
    /// The collective's sequence number in this group (0 for point-to-point).
    pub seq: u64,
    pub deadline: Instant,
    /// The operation's name, for messages.
    pub op: &'static str,
    pub cfg: &'a Config,
}

impl Call<'_> {
    pub fn n(&self) -> usize {
        self.members.len()
    }
}

/// A backend's six collectives, generic over the element type: what a
/// backend writes once. [`dispatch_collectives!`] writes, inside its
/// `impl Backend`, the type-erased [`Backend`] collectives that match the
/// buffer's dtype and call these.
pub trait Collectives {
    fn all_reduce_t<T: Element>(&self, c: &Call, buf: &mut [T], op: ReduceOp) -> Result<()>;
    fn reduce_scatter_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()>;
    fn all_gather_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()>;
    fn broadcast_t<T: Element>(&self, c: &Call, buf: &mut [T], root: usize) -> Result<()>;
    fn reduce_t<T: Element>(
        &self,
        c: &Call,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()>;
    fn all_to_all_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()>;
}

/// The [`Backend`] collectives of a type that implements [`Collectives`]:
/// write `dispatch_collectives!();` inside its `impl Backend`.
macro_rules! dispatch_collectives {
    () => {
        fn all_reduce(
            &self,
            c: &$crate::backend::Call,
            buf: $crate::backend::BytesMut,
            op: $crate::dtype::ReduceOp,
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(buf.dtype(), T => self.all_reduce_t(c, buf.typed::<T>(), op))
        }

        fn reduce_scatter_v(
            &self,
            c: &$crate::backend::Call,
            input: $crate::backend::Bytes,
            counts: &[usize],
            output: $crate::backend::BytesMut,
            op: $crate::dtype::ReduceOp,
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(input.dtype(), T => {
                self.reduce_scatter_t(c, input.typed::<T>(), counts, output.typed::<T>(), op)
            })
        }

        fn all_gather_v(
            &self,
            c: &$crate::backend::Call,
            input: $crate::backend::Bytes,
            counts: &[usize],
            output: $crate::backend::BytesMut,
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(input.dtype(), T => {
                self.all_gather_t(c, input.typed::<T>(), counts, output.typed::<T>())
            })
        }

        fn broadcast(
            &self,
            c: &$crate::backend::Call,
            buf: $crate::backend::BytesMut,
            root: usize,
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(buf.dtype(), T => self.broadcast_t(c, buf.typed::<T>(), root))
        }

        fn reduce(
            &self,
            c: &$crate::backend::Call,
            buf: $crate::backend::BytesMut,
            root: usize,
            op: $crate::dtype::ReduceOp,
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(buf.dtype(), T => self.reduce_t(c, buf.typed::<T>(), root, op))
        }

        fn all_to_all_v(
            &self,
            c: &$crate::backend::Call,
            input: $crate::backend::Bytes,
            send: &[usize],
            output: $crate::backend::BytesMut,
            recv: &[usize],
        ) -> $crate::error::Result<()> {
            use $crate::backend::Collectives;
            $crate::for_dtype!(input.dtype(), T => {
                self.all_to_all_t(c, input.typed::<T>(), send, output.typed::<T>(), recv)
            })
        }
    };
}
pub(crate) use dispatch_collectives;

/// The refusal of a device-memory collective by backend `name`, which
/// `does` host memory only (what `PHALANX_BACKEND=nccl` `instead`).
fn host_only(c: &Call, name: &str, does: &str, instead: &str) -> CommError {
    CommError::Invalid(format!(
        "{}: the {name} backend {does} host memory only, not CUDA device memory \
         (PHALANX_BACKEND=nccl {instead})",
        c.op
    ))
}

/// What runs a group's operations. One value per group (a sub-group's comes
/// from its parent's [`Backend::child`]); every method may be called from
/// the group's caller thread or its communication threads, one collective
/// at a time, point-to-point concurrently with collectives.
///
/// Collectives get buffers already validated by the group (counts cover the
/// buffers, roots and peers in range) and must give every rank bitwise
/// identical results. `ReduceOp::Avg` divides by the group size.
pub trait Backend: Send + Sync {
    /// A short name: `native`, `mpi`.
    fn name(&self) -> &'static str;

    fn all_reduce(&self, c: &Call, buf: BytesMut, op: ReduceOp) -> Result<()>;
    /// Block k of `input` has `counts[k]` elements; `output` gets block `me`.
    fn reduce_scatter_v(
        &self,
        c: &Call,
        input: Bytes,
        counts: &[usize],
        output: BytesMut,
        op: ReduceOp,
    ) -> Result<()>;
    /// Rank k contributes `counts[k]` elements to `output`, in rank order.
    fn all_gather_v(
        &self,
        c: &Call,
        input: Bytes,
        counts: &[usize],
        output: BytesMut,
    ) -> Result<()>;
    fn broadcast(&self, c: &Call, buf: BytesMut, root: usize) -> Result<()>;
    /// Root's `buf` gets the reduction; the others' stay as they were.
    fn reduce(&self, c: &Call, buf: BytesMut, root: usize, op: ReduceOp) -> Result<()>;
    /// `input` holds `send[j]` elements for rank j; `output` `recv[i]` from i.
    fn all_to_all_v(
        &self,
        c: &Call,
        input: Bytes,
        send: &[usize],
        output: BytesMut,
        recv: &[usize],
    ) -> Result<()>;

    /// The CUDA device whose memory [`Backend::all_reduce_device`] reduces
    /// in place (NCCL); `None`, the default: host memory only.
    fn device_ordinal(&self) -> Option<usize> {
        None
    }

    /// All-reduce `buf` in device memory, in place, without staging it
    /// through the host. The caller's writes to it are complete or queued
    /// on `buf.after`, and it touches it again only after the return.
    /// The default refuses: this backend reduces host memory only.
    /// `mode` says whether it returns once complete or once launched.
    fn all_reduce_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<()> {
        let _ = (buf, op, mode);
        Err(host_only(
            c,
            self.name(),
            "reduces",
            "reduces it where it lies",
        ))
    }

    /// How many device collectives were started on this backend so far
    /// ([`DeviceMode::Start`]): read right after a start, the mark that
    /// [`Backend::settle_device`] waits for to know that one complete. The
    /// default starts none.
    fn device_mark(&self) -> u64 {
        0
    }

    /// Wait, until the call's deadline, until the first `mark` device
    /// collectives started ([`DeviceMode::Start`]) are complete (every
    /// one: `None`); later ones may still run. The default has none in
    /// flight.
    fn settle_device(&self, c: &Call, mark: Option<u64>) -> Result<()> {
        let _ = (c, mark);
        Ok(())
    }

    /// Whether the device operation started with `mark` is complete,
    /// without waiting (a failure reported by the backend is an error).
    /// The default has none in flight.
    fn device_done(&self, c: &Call, mark: u64) -> Result<bool> {
        let _ = (c, mark);
        Ok(true)
    }

    /// Send `buf`, in device memory, to group rank `peer`, started without
    /// waiting ([`DeviceMode::Start`]: its mark waits for it). No tags:
    /// messages between two ranks match in the order sent and received, so
    /// a group carries one direction of one pair (the pipeline's links).
    /// The caller's obligations are [`Backend::all_reduce_device`]'s. The
    /// default refuses: this backend sends host memory only.
    fn send_device(&self, c: &Call, buf: DeviceBuf, peer: usize) -> Result<()> {
        let _ = (buf, peer);
        Err(host_only(c, self.name(), "sends", "sends it where it lies"))
    }

    /// Receive the next message from group rank `peer` into `buf`, in
    /// device memory, started without waiting, as [`Backend::send_device`].
    fn recv_device(&self, c: &Call, buf: DeviceBuf, peer: usize) -> Result<()> {
        let _ = (buf, peer);
        Err(host_only(
            c,
            self.name(),
            "receives into",
            "receives it where it lies",
        ))
    }

    /// All-gather in place in device memory: `buf` holds rank k's block of
    /// `counts[k]` elements after the blocks before it (the counts cover
    /// it: validated by the group); this rank's block is its contribution,
    /// and every block is its owner's on return. The caller's obligations
    /// are [`Backend::all_reduce_device`]'s. The default refuses: this
    /// backend gathers into host memory only.
    fn all_gather_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        counts: &[usize],
        mode: DeviceMode,
    ) -> Result<()> {
        let _ = (buf, counts, mode);
        Err(host_only(c, self.name(), "gathers into", "gathers there"))
    }

    /// Reduce-scatter in place in device memory: `buf` holds each rank's
    /// whole contribution, rank k's block of `counts[k]` elements after
    /// the blocks before it (the counts cover it: validated by the group);
    /// on return block `rank` holds the reduced block and the others are
    /// unspecified. The caller's obligations are
    /// [`Backend::all_reduce_device`]'s. The default refuses: this backend
    /// reduces host memory only.
    fn reduce_scatter_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        counts: &[usize],
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<()> {
        let _ = (buf, counts, op, mode);
        Err(host_only(
            c,
            self.name(),
            "reduces",
            "reduces it where it lies",
        ))
    }

    /// `PHALANX_DEBUG=detail`: send `mine` (this rank's encoded signature,
    /// the same length on every rank) to the group and return every rank's,
    /// in group order, before the collective runs.
    fn exchange_signatures(&self, c: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Send `data` to group rank `dst` under `tag`; returns once the backend
    /// holds it (the receiver buffers it).
    fn send(&self, c: &Call, dst: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receive exactly `buf.len()` bytes from group rank `src` under `tag`.
    fn recv_into(&self, c: &Call, src: usize, tag: u64, buf: &mut [u8]) -> Result<()>;
    /// Receive the next message from `src` under `tag`, of any length.
    fn recv_message(&self, c: &Call, src: usize, tag: u64) -> Result<Msg>;

    /// The carrier of a sub-group this rank joins (`color` is `None` for
    /// ranks that join none; `want` members, ordered by `key`). Collective
    /// over the parent group `c`.
    fn child(
        &self,
        c: &Call,
        color: Option<u32>,
        key: i64,
        want: usize,
    ) -> Result<Option<Arc<dyn Backend>>>;

    /// Payload bytes this process has sent (collectives that move no
    /// messages count what a ring would send), over every group sharing the
    /// backend's connections.
    fn bytes_sent(&self) -> u64;
    /// All-reduces of this group done in place in shared memory, without
    /// messages (0 for a backend that has no such path).
    fn in_place_all_reduces(&self) -> u64;
    /// The link to global rank `global` (`None` for this process).
    fn link(&self, me: usize, global: usize) -> Option<Link>;
    /// The failure that broke the backend, if any (checked before each
    /// collective).
    fn failure(&self) -> Option<CommError>;
    /// Leave cleanly: peers see a goodbye, not a crash.
    fn shutdown(&self);
    /// The error for a call after this rank's clean [`Backend::shutdown`]
    /// (not a failure: nothing is aborted for it); `None` before.
    fn closed(&self) -> Option<CommError> {
        None
    }
    /// Tear down: pending and later calls here and on peers fail with `reason`.
    fn abort(&self, reason: &str);
    /// Whether `abort` ends the whole job on the spot instead of returning
    /// (MPI's `MPI_Abort`).
    fn abort_ends_job(&self) -> bool {
        false
    }
    /// Die as a crashed process would (tests of failure detection).
    fn crash_for_test(&self);
}
