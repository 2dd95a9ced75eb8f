//! The CUDA side of the NCCL backend, on the driver API through
//! `cudarc::driver::sys`: a device's primary context, and a "lane" per
//! communicator (a CUDA stream and a device staging buffer that grows to
//! the largest call) that stages host buffers to the device and back.
//!
//! Status: compiles without CUDA; not yet run on GPU hardware.
//!
//! Copies to the device are asynchronous on the lane's stream (ordered
//! before the NCCL kernel). The host never blocks in the driver on a
//! kernel: [`Lane::wait`] polls `cuStreamQuery` (or one started
//! operation's event, `cuEventQuery`) and the caller's check
//! (`ncclCommGetAsyncError`) until the deadline, and only then copies
//! back, when the stream is idle. A collective on memory another stream
//! wrote (candle's) is ordered after those writes on the device
//! ([`Lane::after`]: an event recorded there, waited for here), not by the
//! host waiting for them.

use super::marks::Marks;
use super::probe::{cu_check, cu_error};
use crate::error::Result;
use cudarc::driver::sys as cu;
use std::time::{Duration, Instant};

/// A CUDA device and its primary context (retained for the process's life).
pub struct Device {
    pub ordinal: usize,
    ctx: cu::CUcontext,
}

// SAFETY: a CUDA context handle may be made current on any thread.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// Device `ordinal`'s primary context (the one the CUDA runtime, and so
    /// NCCL, uses), current on this thread.
    pub fn open(ordinal: usize) -> Result<Device> {
        let mut dev: cu::CUdevice = 0;
        // SAFETY: out-parameters; the driver was initialised by `probe::driver`.
        cu_check(
            unsafe { cu::cuDeviceGet(&mut dev, ordinal as i32) },
            &format!("cuDeviceGet({ordinal})"),
        )?;
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        cu_check(
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let d = Device { ordinal, ctx };
        d.bind()?;
        Ok(d)
    }

    /// Make the device current on the calling thread (every backend call
    /// may come from another thread: the caller's, the group's queue).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: a retained primary context.
        cu_check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }
}

/// A stream and a staging buffer on the device, and the events of the
/// operations started on the stream without waiting.
pub struct Lane {
    pub stream: cu::CUstream,
    buf: cu::CUdeviceptr,
    cap: usize,
    /// The operations started ([`Lane::mark`]) and the events after those
    /// not yet known to be complete.
    pub marks: Marks<cu::CUevent>,
    /// Set after an abort: the stream may still hold the aborted kernel, so
    /// the buffer and stream are leaked rather than freed under it.
    pub poisoned: bool,
    /// The buffer came from the stream's memory pool (`cuMemAllocAsync`).
    pooled: bool,
    /// The event [`Lane::after`] records on the caller's stream.
    order: Option<cu::CUevent>,
}

// SAFETY: a lane is used under its communicator's mutex only.
unsafe impl Send for Lane {}

impl Lane {
    /// A new stream on the current device.
    pub fn new() -> Result<Lane> {
        let mut stream: cu::CUstream = std::ptr::null_mut();
        // SAFETY: an out-parameter. CU_STREAM_NON_BLOCKING (1): no
        // implicit synchronisation with the legacy default stream (as
        // PyTorch's NCCL streams); candle's stream and this one are
        // ordered explicitly (an event of candle's waited for here:
        // [`Lane::after`]).
        cu_check(
            unsafe { cu::cuStreamCreate(&mut stream, 1) },
            "cuStreamCreate",
        )?;
        Ok(Lane {
            stream,
            buf: 0,
            cap: 0,
            marks: Marks::default(),
            poisoned: false,
            pooled: false,
            order: None,
        })
    }

    /// A new event without timing (the cheap kind: PyTorch's for stream
    /// ordering).
    fn event() -> Result<cu::CUevent> {
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: an out-parameter. CU_EVENT_DISABLE_TIMING (2).
        cu_check(unsafe { cu::cuEventCreate(&mut ev, 2) }, "cuEventCreate")?;
        Ok(ev)
    }

    /// Order the work queued next on this stream after everything queued
    /// so far on `stream` (a raw `CUstream` of this context: candle's),
    /// without the host waiting: an event recorded there and waited for
    /// here. One event serves every call: the wait takes the state of
    /// the record before it, so the event may be recorded again at once
    /// (CUDA's `cuStreamWaitEvent`).
    pub fn after(&mut self, stream: u64) -> Result<()> {
        let ev = match self.order {
            Some(ev) => ev,
            None => *self.order.insert(Self::event()?),
        };
        let other = stream as usize as cu::CUstream;
        // SAFETY: a live event of this lane; `other` is a live stream of
        // the current context (the caller's contract).
        cu_check(unsafe { cu::cuEventRecord(ev, other) }, "cuEventRecord")?;
        // SAFETY: as above.
        cu_check(
            unsafe { cu::cuStreamWaitEvent(self.stream, ev, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Record that an operation was started on the stream (an event after
    /// it); returns its mark ([`Marks`]).
    pub fn mark(&mut self) -> Result<u64> {
        let ev = Self::event()?;
        // SAFETY: a fresh event on this live stream.
        if let Err(e) = cu_check(
            unsafe { cu::cuEventRecord(ev, self.stream) },
            "cuEventRecord",
        ) {
            // SAFETY: created above, destroyed once.
            unsafe { cu::cuEventDestroy_v2(ev) };
            return Err(e);
        }
        Ok(self.marks.push(ev))
    }

    /// Let go of the events of the operations up to `mark` (all: `None`),
    /// known to be complete.
    pub fn retire(&mut self, mark: Option<u64>) {
        // SAFETY: each a recorded event, complete, destroyed once.
        self.marks.retire(mark, |ev| unsafe {
            cu::cuEventDestroy_v2(ev);
        });
    }

    /// The staging buffer, at least `bytes` long (no staged call is in
    /// flight: each waits for its stream before returning; a started
    /// device-memory one does not use this buffer).
    pub fn ensure(&mut self, bytes: usize) -> Result<cu::CUdeviceptr> {
        if bytes > self.cap {
            // Stream-ordered (cuMemFreeAsync, cuMemAllocAsync on this
            // stream): the plain cuMemFree / cuMemAlloc synchronise the
            // whole device, which would wait on whatever NCCL kernel of
            // another communicator is still waiting for its peer (a
            // pipeline link's receive), outside any deadline.
            if self.buf != 0 {
                self.free();
            }
            let cap = bytes.next_power_of_two().max(1 << 20);
            let mut p: cu::CUdeviceptr = 0;
            // SAFETY: an out-parameter, on this live stream.
            let rc = unsafe { cu::cuMemAllocAsync(&mut p, cap, self.stream) };
            if rc == cu::CUresult::CUDA_ERROR_NOT_SUPPORTED {
                // No memory pools on this device: the plain allocation.
                self.pooled = false;
                // SAFETY: an out-parameter.
                cu_check(
                    unsafe { cu::cuMemAlloc_v2(&mut p, cap) },
                    &format!("cuMemAlloc of {cap} bytes for NCCL staging"),
                )?;
            } else {
                cu_check(
                    rc,
                    &format!("cuMemAllocAsync of {cap} bytes for NCCL staging"),
                )?;
                self.pooled = true;
            }
            self.buf = p;
            self.cap = cap;
        }
        Ok(self.buf)
    }

    /// Let go of the staging buffer (ordered on the stream where it came
    /// from the stream's pool).
    fn free(&mut self) {
        // SAFETY: allocated by `ensure`, freed once; nothing queued after
        // this uses it.
        unsafe {
            if self.pooled {
                cu::cuMemFreeAsync(self.buf, self.stream);
            } else {
                cu::cuMemFree_v2(self.buf);
            }
        }
        self.buf = 0;
        self.cap = 0;
    }

    /// Queue a copy of `src` to device address `dst` on the stream.
    pub fn h2d(&self, dst: cu::CUdeviceptr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` lies in the staging buffer (sized by `ensure`);
        // pageable `src` is staged by the driver before this returns.
        cu_check(
            unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.stream) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Copy device address `src` into `dst`, complete when this returns
    /// (after [`Self::wait`]: the stream holds nothing else).
    pub fn d2h(&self, dst: &mut [u8], src: cu::CUdeviceptr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` lies in the staging buffer, `dst` is the caller's.
        cu_check(
            unsafe {
                cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), self.stream)
            },
            "cuMemcpyDtoHAsync",
        )?;
        // A copy to pageable memory "might be synchronous" (CUDA's API
        // synchronisation notes): wait for it before `dst` is read.
        // SAFETY: a live stream.
        cu_check(
            unsafe { cu::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    /// Poll the stream until its work is done (or, given `event`, until
    /// that event is: the work before it) (Ok(true)), `check` fails, or
    /// `deadline` passes (Ok(false): the caller aborts the communicator).
    pub fn wait(
        &self,
        event: Option<cu::CUevent>,
        deadline: Instant,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<bool> {
        let mut polls = 0u32;
        let mut nap = Duration::from_micros(10);
        loop {
            // SAFETY: a live stream; a recorded event not yet destroyed.
            let (rc, what) = match event {
                None => (unsafe { cu::cuStreamQuery(self.stream) }, "cuStreamQuery"),
                Some(ev) => (unsafe { cu::cuEventQuery(ev) }, "cuEventQuery"),
            };
            match rc {
                cu::CUresult::CUDA_SUCCESS => return Ok(true),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                rc => return Err(cu_error(rc, what)),
            }
            check()?;
            polls += 1;
            if polls < 200 {
                std::thread::yield_now();
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.poisoned {
            return;
        }
        self.retire(None);
        if let Some(ev) = self.order.take() {
            // SAFETY: created by `after`, destroyed once (a pending wait on
            // it keeps what it needs: CUDA releases it on completion).
            unsafe { cu::cuEventDestroy_v2(ev) };
        }
        if self.buf != 0 {
            self.free();
        }
        // SAFETY: an owned handle, destroyed once; the stream is idle.
        unsafe { cu::cuStreamDestroy_v2(self.stream) };
    }
}
