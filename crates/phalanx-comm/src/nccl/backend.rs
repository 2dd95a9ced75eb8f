//! The NCCL communicator as a comm [`Backend`]: collectives on NCCL,
//! point-to-point messages and signature checks on the native mesh.
//!
//! Status: compiles and its bookkeeping is unit-tested on CPU; not yet run
//! on GPU hardware.
//!
//! Each collective stages the host buffers the trait gives to the device
//! ([`Comm::run`]), runs the NCCL call on the communicator's stream, waits
//! under the call's deadline and copies back. Uneven reduce-scatter and
//! all-gather are padded to the largest count (see `layout`);
//! all-to-all-v is grouped `ncclSend`/`ncclRecv` (its own block is copied
//! on the host). `all_reduce_device` skips the staging: NCCL reduces the
//! caller's device memory in place (`Io::Device`).
//!
//! Point-to-point (`send`, `recv_into`, `recv_message`) and the
//! `PHALANX_DEBUG=detail` signature exchange go over the native mesh the
//! world group also connects: the trait's `send` returns once the data is
//! handed over (the receiver buffers it), which `ncclSend` cannot do (it
//! completes only when the peer posts the matching receive, so two ranks
//! that both send before receiving would deadlock), and the trait's
//! buffers are on the host anyway.

use super::comm::{Comm, Io};
use super::layout::{nccl_device_op, nccl_dtype, nccl_op, offsets, split_color, split_key, Padded};
use super::probe::{NcclApi, Stream};
use crate::backend::{
    dispatch_collectives, Backend, BytesMut, Call, Collectives, DeviceBuf, DeviceMode,
};
use crate::dtype::{Element, ReduceOp};
use crate::error::{invalid, CommError, Result};
use crate::transport::{Link, Msg};
use cudarc::driver::sys::CUdeviceptr;
use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One group on NCCL, beside its native carrier for messages.
pub struct Nccl {
    pub(crate) comm: Comm,
    pub(crate) native: Arc<dyn Backend>,
}

fn bytes<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn bytes_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

/// A reduction's NCCL call: (api, comm, stream, send, receive, NCCL op).
type ReduceLaunch<'a> =
    dyn Fn(&NcclApi, *mut c_void, Stream, CUdeviceptr, CUdeviceptr, c_int) -> c_int + 'a;

/// `ncclAllReduce` of `count` elements of NCCL type `dt`, as a
/// [`ReduceLaunch`]: the caller's send and receive addresses must hold
/// them on the communicator's device.
fn all_reduce_launch(
    count: usize,
    dt: c_int,
) -> impl Fn(&NcclApi, *mut c_void, Stream, CUdeviceptr, CUdeviceptr, c_int) -> c_int {
    move |api, comm, s, src, dst, rop| unsafe {
        // SAFETY: `src`/`dst` hold `count` elements on the device (the
        // caller's contract).
        (api.ncclAllReduce)(
            src as *const c_void,
            dst as *mut c_void,
            count,
            dt,
            rop,
            comm,
            s,
        )
    }
}

/// One NCCL call per rank k with a non-empty block (`call(address,
/// count, k)`, the block at `base + at[k]` elements of `size` bytes),
/// grouped: uneven in-place collectives without a padded copy. The first
/// failing code, else `ncclGroupEnd`'s.
///
/// # Safety
/// Every block lies in the caller's device memory at `base`.
unsafe fn per_block(
    api: &NcclApi,
    base: CUdeviceptr,
    at: &[usize],
    counts: &[usize],
    size: usize,
    call: &mut dyn FnMut(CUdeviceptr, usize, c_int) -> c_int,
) -> c_int {
    // SAFETY: the caller's (every block within its memory).
    let mut rc = unsafe { (api.ncclGroupStart)() };
    for (k, &n) in counts.iter().enumerate() {
        if rc == 0 && n > 0 {
            rc = call(base + (at[k] * size) as u64, n, k as c_int);
        }
    }
    // SAFETY: closes the group opened above.
    let end = unsafe { (api.ncclGroupEnd)() };
    if rc == 0 {
        end
    } else {
        rc
    }
}

impl Nccl {
    /// Run `launch` on the caller's device memory `buf`, ordered after
    /// the writes queued on its stream: waited for, or only launched
    /// (`DeviceMode::Start`; `settle_device` waits, by its mark).
    fn on_device(
        &self,
        c: &Call,
        buf: &DeviceBuf,
        mode: DeviceMode,
        launch: &mut super::comm::Launch,
    ) -> Result<()> {
        let io = Io::Device {
            ptr: buf.ptr,
            after: buf.after,
        };
        match mode {
            DeviceMode::Wait => self.comm.run(c, io, launch),
            DeviceMode::Start => self.comm.start(c, io, launch),
        }
    }

    /// `buf` lies on this communicator's device.
    fn on_my_device(&self, c: &Call, buf: &DeviceBuf) -> Result<()> {
        let ordinal = self.comm.dev.ordinal;
        if buf.ordinal != ordinal {
            return Err(invalid!(
                "{}: the buffer is on CUDA device {} but this NCCL communicator on device {ordinal}",
                c.op,
                buf.ordinal
            ));
        }
        Ok(())
    }

    /// Count what a ring would send, for `bytes_sent`.
    fn count(&self, b: usize) {
        self.comm.bytes.fetch_add(b as u64, Ordering::Relaxed);
    }

    fn rooted_t<T: Element>(
        &self,
        c: &Call,
        x: &mut [T],
        root: usize,
        op: Option<ReduceOp>,
    ) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        let (dt, count, r) = (nccl_dtype(T::DTYPE), x.len(), root as c_int);
        self.count(std::mem::size_of_val(x));
        let mine = c.me == root;
        match op {
            None => {
                let io = Io::InPlace {
                    buf: bytes_mut(x),
                    copy_back: !mine,
                };
                self.comm.run(c, io, &mut |api, comm, s, src, dst| unsafe {
                    // SAFETY: `src`/`dst` hold `count` elements on the device.
                    (api.ncclBroadcast)(
                        src as *const c_void,
                        dst as *mut c_void,
                        count,
                        dt,
                        r,
                        comm,
                        s,
                    )
                })
            }
            Some(op) => {
                self.reduce_in_place(c, x, op, mine, &|api, comm, s, src, dst, rop| unsafe {
                    // SAFETY: as above.
                    (api.ncclReduce)(
                        src as *const c_void,
                        dst as *mut c_void,
                        count,
                        dt,
                        rop,
                        r,
                        comm,
                        s,
                    )
                })
            }
        }
    }

    /// A reduction of `x` in place on the staged buffer (all-reduce, or
    /// reduce to a root): `launch(api, comm, stream, src, dst, nccl_op)`,
    /// the result copied back when `copy_back`, and divided there by the
    /// group size for `Avg` (NCCL sums).
    fn reduce_in_place<T: Element>(
        &self,
        c: &Call,
        x: &mut [T],
        op: ReduceOp,
        copy_back: bool,
        launch: &ReduceLaunch<'_>,
    ) -> Result<()> {
        let (rop, div) = nccl_op(op);
        let io = Io::InPlace {
            buf: bytes_mut(x),
            copy_back,
        };
        self.comm.run(c, io, &mut |api, comm, s, src, dst| {
            launch(api, comm, s, src, dst, rop)
        })?;
        if div && copy_back {
            T::div_by(x, c.n());
        }
        Ok(())
    }
}

impl Collectives for Nccl {
    fn all_reduce_t<T: Element>(&self, c: &Call, x: &mut [T], op: ReduceOp) -> Result<()> {
        let n = c.n();
        if x.is_empty() {
            return Ok(());
        }
        let (dt, count) = (nccl_dtype(T::DTYPE), x.len());
        self.count(2 * (n - 1) * std::mem::size_of_val(x) / n);
        self.reduce_in_place(c, x, op, true, &all_reduce_launch(count, dt))
    }

    fn reduce_scatter_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, esz) = (c.n(), std::mem::size_of::<T>());
        let p = Padded::of(counts);
        if p.max == 0 {
            return Ok(());
        }
        let (rop, div) = nccl_op(op);
        let (dt, m) = (nccl_dtype(T::DTYPE), p.max);
        self.count((n - 1) * m * esz);
        let mut launch = |api: &super::probe::NcclApi, comm, s, src: u64, dst: u64| unsafe {
            // SAFETY: `src` holds n * m elements, `dst` m.
            (api.ncclReduceScatter)(
                src as *const c_void,
                dst as *mut c_void,
                m,
                dt,
                rop,
                comm,
                s,
            )
        };
        if p.even {
            let io = Io::Apart {
                send: bytes(input),
                recv_len: m * esz,
                out: Some(bytes_mut(output)),
            };
            self.comm.run(c, io, &mut launch)?;
        } else {
            let mut padded = vec![0u8; n * m * esz];
            p.pad(counts, esz, bytes(input), &mut padded);
            let mut mine = vec![0u8; m * esz];
            let io = Io::Apart {
                send: &padded,
                recv_len: m * esz,
                out: Some(&mut mine),
            };
            self.comm.run(c, io, &mut launch)?;
            let out = bytes_mut(output);
            let len = out.len();
            out.copy_from_slice(&mine[..len]);
        }
        if div {
            T::div_by(output, n);
        }
        Ok(())
    }

    fn all_gather_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        let (n, esz) = (c.n(), std::mem::size_of::<T>());
        let p = Padded::of(counts);
        if p.max == 0 {
            return Ok(());
        }
        let (dt, m) = (nccl_dtype(T::DTYPE), p.max);
        self.count((n - 1) * m * esz);
        let mut launch = |api: &super::probe::NcclApi, comm, s, src: u64, dst: u64| unsafe {
            // SAFETY: `src` holds m elements, `dst` n * m.
            (api.ncclAllGather)(src as *const c_void, dst as *mut c_void, m, dt, comm, s)
        };
        if p.even {
            let io = Io::Apart {
                send: bytes(input),
                recv_len: n * m * esz,
                out: Some(bytes_mut(output)),
            };
            return self.comm.run(c, io, &mut launch);
        }
        let mut mine = vec![0u8; m * esz];
        mine[..std::mem::size_of_val(input)].copy_from_slice(bytes(input));
        let mut all = vec![0u8; n * m * esz];
        let io = Io::Apart {
            send: &mine,
            recv_len: n * m * esz,
            out: Some(&mut all),
        };
        self.comm.run(c, io, &mut launch)?;
        p.cut(counts, esz, &all, bytes_mut(output));
        Ok(())
    }

    fn broadcast_t<T: Element>(&self, c: &Call, buf: &mut [T], root: usize) -> Result<()> {
        self.rooted_t(c, buf, root, None)
    }

    fn reduce_t<T: Element>(
        &self,
        c: &Call,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        self.rooted_t(c, buf, root, Some(op))
    }

    fn all_to_all_t<T: Element>(
        &self,
        c: &Call,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        let (me, esz, dt) = (c.me, std::mem::size_of::<T>(), nccl_dtype(T::DTYPE));
        let (so, ro) = (offsets(send), offsets(recv));
        let remote = |k: &[usize]| k.iter().enumerate().any(|(j, &x)| j != me && x > 0);
        if remote(send) || remote(recv) {
            self.count((send.iter().sum::<usize>() - send[me]) * esz);
            let io = Io::Apart {
                send: bytes(input),
                recv_len: std::mem::size_of_val(output),
                out: Some(bytes_mut(output)),
            };
            self.comm.run(c, io, &mut |api, comm, s, src, dst| unsafe {
                // SAFETY: offsets and counts lie within the staged buffers
                // (validated by the group); grouped so that NCCL pairs them.
                let mut rc = (api.ncclGroupStart)();
                for j in (0..send.len()).filter(|&j| j != me) {
                    if rc == 0 && send[j] > 0 {
                        let p = src + (so[j] * esz) as u64;
                        rc = (api.ncclSend)(p as *const c_void, send[j], dt, j as c_int, comm, s);
                    }
                    if rc == 0 && recv[j] > 0 {
                        let p = dst + (ro[j] * esz) as u64;
                        rc = (api.ncclRecv)(p as *mut c_void, recv[j], dt, j as c_int, comm, s);
                    }
                }
                let end = (api.ncclGroupEnd)();
                if rc == 0 {
                    end
                } else {
                    rc
                }
            })?;
        }
        output[ro[me]..ro[me] + recv[me]].copy_from_slice(&input[so[me]..so[me] + send[me]]);
        Ok(())
    }
}

impl Backend for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }

    dispatch_collectives!();

    fn device_ordinal(&self) -> Option<usize> {
        Some(self.comm.dev.ordinal)
    }

    /// `ncclAllReduce` on the caller's device memory, in place, on the
    /// communicator's stream: no staging, no copy back (`Avg` is NCCL's).
    fn all_reduce_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<()> {
        self.on_my_device(c, &buf)?;
        let rop = nccl_device_op(op, buf.dtype).map_err(|e| invalid!("{}: {e}", c.op))?;
        if buf.count == 0 {
            return Ok(());
        }
        let (n, dt, count) = (c.n(), nccl_dtype(buf.dtype), buf.count);
        self.count(2 * (n - 1) * count * buf.dtype.size() / n);
        // `src` = `dst` = the caller's `count` elements on this device
        // (`ProcessGroup::all_reduce_device`'s contract).
        let launch = all_reduce_launch(count, dt);
        self.on_device(c, &buf, mode, &mut |api, comm, s, src, dst| {
            launch(api, comm, s, src, dst, rop)
        })
    }

    /// The mark of the last operation started on the communicator's
    /// stream.
    fn device_mark(&self) -> u64 {
        self.comm.started()
    }

    /// Wait for the started operation `mark` (its event: later ones may
    /// still run), or for the communicator's stream (`None`: every one).
    fn settle_device(&self, c: &Call, mark: Option<u64>) -> Result<()> {
        self.comm.settle(c, mark)
    }

    fn device_done(&self, c: &Call, mark: u64) -> Result<bool> {
        self.comm.done(c, mark)
    }

    /// `ncclSend` of the caller's device memory to `peer`, started on the
    /// communicator's stream (a one-way link: its peer only receives).
    fn send_device(&self, c: &Call, buf: DeviceBuf, peer: usize) -> Result<()> {
        self.on_my_device(c, &buf)?;
        if buf.count == 0 {
            return Ok(());
        }
        let (dt, count, to) = (nccl_dtype(buf.dtype), buf.count, peer as c_int);
        self.count(count * buf.dtype.size());
        self.on_device(
            c,
            &buf,
            DeviceMode::Start,
            &mut |api, comm, s, src, _| unsafe {
                // SAFETY: `src` holds `count` elements on this device (the
                // caller's contract).
                (api.ncclSend)(src as *const c_void, count, dt, to, comm, s)
            },
        )
    }

    /// `ncclRecv` from `peer` into the caller's device memory, started on
    /// the communicator's stream.
    fn recv_device(&self, c: &Call, buf: DeviceBuf, peer: usize) -> Result<()> {
        self.on_my_device(c, &buf)?;
        if buf.count == 0 {
            return Ok(());
        }
        let (dt, count, from) = (nccl_dtype(buf.dtype), buf.count, peer as c_int);
        self.on_device(
            c,
            &buf,
            DeviceMode::Start,
            &mut |api, comm, s, _, dst| unsafe {
                // SAFETY: `dst` holds room for `count` elements on this device.
                (api.ncclRecv)(dst as *mut c_void, count, dt, from, comm, s)
            },
        )
    }

    /// The gather in place on the caller's device memory: equal blocks
    /// are one `ncclAllGather` (this rank's block as the send buffer, its
    /// in-place form); uneven ones, one `ncclBroadcast` in place from each
    /// rank of its block, grouped (no padded copy).
    fn all_gather_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        counts: &[usize],
        mode: DeviceMode,
    ) -> Result<()> {
        self.on_my_device(c, &buf)?;
        if buf.count == 0 {
            return Ok(());
        }
        let (dt, size) = (nccl_dtype(buf.dtype), buf.dtype.size());
        self.count(buf.count * size - counts[c.me] * size);
        let at = offsets(counts);
        let even = counts.windows(2).all(|w| w[0] == w[1]);
        self.on_device(c, &buf, mode, &mut |api, comm, s, _, dst| unsafe {
            // SAFETY: `dst` holds the sum of `counts` elements on this
            // device (the group checked the counts against `buf`); every
            // block lies within it.
            if even {
                let mine = dst + (at[c.me] * size) as u64;
                return (api.ncclAllGather)(
                    mine as *const c_void,
                    dst as *mut c_void,
                    counts[0],
                    dt,
                    comm,
                    s,
                );
            }
            per_block(api, dst, &at, counts, size, &mut |p, n, k| {
                (api.ncclBroadcast)(p as *const c_void, p as *mut c_void, n, dt, k, comm, s)
            })
        })
    }

    /// The reduce-scatter in place on the caller's device memory: equal
    /// blocks are one `ncclReduceScatter` (this rank's block as the
    /// receive buffer, its in-place form); uneven ones, one `ncclReduce`
    /// in place of each rank's block to that rank, grouped (no padded
    /// copy).
    fn reduce_scatter_device(
        &self,
        c: &Call,
        buf: DeviceBuf,
        counts: &[usize],
        op: ReduceOp,
        mode: DeviceMode,
    ) -> Result<()> {
        self.on_my_device(c, &buf)?;
        let rop = nccl_device_op(op, buf.dtype).map_err(|e| invalid!("{}: {e}", c.op))?;
        if buf.count == 0 {
            return Ok(());
        }
        let (dt, size) = (nccl_dtype(buf.dtype), buf.dtype.size());
        self.count(buf.count * size - counts[c.me] * size);
        let at = offsets(counts);
        let even = counts.windows(2).all(|w| w[0] == w[1]);
        self.on_device(c, &buf, mode, &mut |api, comm, s, src, _| unsafe {
            // SAFETY: `src` holds the sum of `counts` elements on this
            // device (the group checked the counts against `buf`); every
            // block lies within it.
            if even {
                let mine = src + (at[c.me] * size) as u64;
                return (api.ncclReduceScatter)(
                    src as *const c_void,
                    mine as *mut c_void,
                    counts[0],
                    dt,
                    rop,
                    comm,
                    s,
                );
            }
            per_block(api, src, &at, counts, size, &mut |p, n, k| {
                (api.ncclReduce)(p as *const c_void, p as *mut c_void, n, dt, rop, k, comm, s)
            })
        })
    }

    fn exchange_signatures(&self, c: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.native.exchange_signatures(c, mine)
    }

    fn send(&self, c: &Call, dst: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.native.send(c, dst, tag, data)
    }

    fn recv_into(&self, c: &Call, src: usize, tag: u64, buf: &mut [u8]) -> Result<()> {
        self.native.recv_into(c, src, tag, buf)
    }

    fn recv_message(&self, c: &Call, src: usize, tag: u64) -> Result<Msg> {
        self.native.recv_message(c, src, tag)
    }

    /// `ncclCommSplit` of this group's communicator (and the native
    /// carrier's child for messages), checked to have `want` members.
    fn child(
        &self,
        c: &Call,
        color: Option<u32>,
        key: i64,
        want: usize,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let native = self.native.child(c, color, key, want)?;
        // Every member arrives (with the deadline, and dead peers named by
        // the mesh) before NCCL's blocking split.
        let mut one = [1i32];
        self.native
            .all_reduce(c, BytesMut::of(&mut one), ReduceOp::Sum)?;
        let sub = self.comm.split(c, split_color(color), split_key(key))?;
        let (Some(sub), Some(native)) = (sub, native) else {
            return Ok(None);
        };
        let mut n = [1i32];
        let probe = Call {
            op: "new_group",
            ..*c
        };
        let nc = Nccl { comm: sub, native };
        // The child's size, from NCCL itself: a sum of ones over it.
        let members: Vec<usize> = (0..want).collect();
        let sc = Call {
            members: &members,
            me: 0,
            ..probe
        };
        nc.comm.run(
            &sc,
            Io::InPlace {
                buf: bytemuck::cast_slice_mut(&mut n),
                copy_back: true,
            },
            &mut |api, comm, s, src, dst| unsafe {
                // SAFETY: one i32 on the device.
                (api.ncclAllReduce)(
                    src as *const c_void,
                    dst as *mut c_void,
                    1,
                    nccl_dtype(crate::DType::I32),
                    0,
                    comm,
                    s,
                )
            },
        )?;
        if n[0] as usize != want {
            return Err(invalid!(
                "ncclCommSplit gave a group of {} ranks where {want} were asked for (two groups' \
                 colors collided); create the groups in another order",
                n[0]
            ));
        }
        Ok(Some(Arc::new(nc)))
    }

    fn bytes_sent(&self) -> u64 {
        self.native.bytes_sent() + self.comm.bytes.load(Ordering::Relaxed)
    }

    fn in_place_all_reduces(&self) -> u64 {
        0
    }

    /// The native link that carries point-to-point messages.
    fn link(&self, me: usize, global: usize) -> Option<Link> {
        self.native.link(me, global)
    }

    fn failure(&self) -> Option<CommError> {
        self.comm.failure().or_else(|| self.native.failure())
    }

    /// `ncclCommDestroy`, then a goodbye on the mesh.
    fn closed(&self) -> Option<CommError> {
        self.native.closed()
    }

    fn shutdown(&self) {
        self.comm.destroy();
        self.native.shutdown();
    }

    /// The mesh's abort first (peers fail with `reason`), then
    /// `ncclCommAbort`: a peer waiting in NCCL then hears the reason before
    /// it can see NCCL's own transport error.
    fn abort(&self, reason: &str) {
        self.native.abort(reason);
        self.comm.abort(reason);
    }

    fn crash_for_test(&self) {
        self.native.crash_for_test();
        std::process::abort()
    }
}
