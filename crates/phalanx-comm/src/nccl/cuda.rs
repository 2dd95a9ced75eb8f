//! The CUDA side of the NCCL backend, on the driver API through
//! `cudarc::driver::sys`: a device's primary context, and a "lane" per
//! communicator (a CUDA stream and a device staging buffer that grows to
//! the largest call) that stages host buffers to the device and back.
//!
//! Status: compiles without CUDA; not yet run on GPU hardware.
//!
//! Copies to the device are asynchronous on the lane's stream (ordered
//! before the NCCL kernel). The host never blocks in the driver on a
//! kernel: [`Lane::wait`] polls `cuStreamQuery` (and the caller's check,
//! `ncclCommGetAsyncError`) until the deadline, and only then copies back,
//! when the stream is idle.

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

/// A stream and a staging buffer on the device.
pub struct Lane {
    pub stream: cu::CUstream,
    buf: cu::CUdeviceptr,
    cap: usize,
    /// Set after an abort: the stream may still hold the aborted kernel, so
    /// the buffer and stream are leaked rather than freed under it.
    pub poisoned: bool,
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
        // ordered explicitly (`collective` synchronises candle's first).
        cu_check(
            unsafe { cu::cuStreamCreate(&mut stream, 1) },
            "cuStreamCreate",
        )?;
        Ok(Lane {
            stream,
            buf: 0,
            cap: 0,
            poisoned: false,
        })
    }

    /// The staging buffer, at least `bytes` long (no staged call is in
    /// flight: each waits for its stream before returning; a started
    /// device-memory one does not use this buffer).
    pub fn ensure(&mut self, bytes: usize) -> Result<cu::CUdeviceptr> {
        if bytes > self.cap {
            if self.buf != 0 {
                // SAFETY: allocated below; the stream is idle.
                unsafe { cu::cuMemFree_v2(self.buf) };
                self.buf = 0;
                self.cap = 0;
            }
            let cap = bytes.next_power_of_two().max(1 << 20);
            let mut p: cu::CUdeviceptr = 0;
            // SAFETY: an out-parameter.
            cu_check(
                unsafe { cu::cuMemAlloc_v2(&mut p, cap) },
                &format!("cuMemAlloc of {cap} bytes for NCCL staging"),
            )?;
            self.buf = p;
            self.cap = cap;
        }
        Ok(self.buf)
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

    /// Poll the stream until its work is done (Ok(true)), `check` fails,
    /// or `deadline` passes (Ok(false): the caller aborts the communicator).
    pub fn wait(&self, deadline: Instant, check: &mut dyn FnMut() -> Result<()>) -> Result<bool> {
        let mut polls = 0u32;
        let mut nap = Duration::from_micros(10);
        loop {
            // SAFETY: a live stream.
            match unsafe { cu::cuStreamQuery(self.stream) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(true),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                rc => return Err(cu_error(rc, "cuStreamQuery")),
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
        // SAFETY: owned handles, freed once; the stream is idle.
        unsafe {
            if self.buf != 0 {
                cu::cuMemFree_v2(self.buf);
            }
            cu::cuStreamDestroy_v2(self.stream);
        }
    }
}
