//! The device a rank computes on (`train.device`), opened once per process.
//!
//! - `cpu`: candle's CPU device; Phalanx's own CPU kernels run the ops
//!   ([`crate::ops::host_kernels`]).
//! - `cuda` (feature `cuda`): CUDA device local rank modulo the number of
//!   visible devices, as PyTorch's `device_ids=[local_rank]` (several ranks on
//!   one GPU is a test set-up). The model's ops run on it through candle's
//!   CUDA backend (the composed layers, cuBLAS products); the flat parameter
//!   and gradient buffers stay in host memory, the parameters' device
//!   copies are kept while they are unchanged ([`crate::engine::resident`]:
//!   at most one upload per optimizer step), each block's gradients are
//!   read back after the backward that reduces them (never under DDP with
//!   one data-parallel rank or over NCCL, which reduces them on the
//!   device), and the optimizer's state and step are on
//!   the device ([`crate::optim::DeviceOptimizer`]) unless offloaded.
//!
//! candle gives each `Device::new_cuda` call its own context handle and
//! stream, and tensors of two handles cannot meet, so the handle is made once
//! per ordinal and shared by every caller of [`open_cuda`].
//!
//! ```
//! // A build without the `cuda` feature names it.
//! let built = phalanx::device::cuda_built();
//! assert!(built.is_ok() || built.unwrap_err().contains("--features cuda"));
//! ```

use candle_core::Device;

/// This process's local rank, from the launcher's variables as process-group
/// init reads them (`LOCAL_RANK` under torchrun and `phalanx run`,
/// `OMPI_COMM_WORLD_LOCAL_RANK` under mpirun, `SLURM_LOCALID` under srun;
/// 0 for a single process).
pub fn local_rank() -> Result<usize, String> {
    // The sizes only: an MPI job has no store address or secret to check.
    phalanx_comm::JobSizes::from_env()
        .map(|e| e.local_rank)
        .map_err(|e| e.to_string())
}

/// What a build without the `cuda` feature says when asked for CUDA.
const NOT_BUILT: &str = "train.device = \"cuda\": this build has no CUDA backend; \
     build with `cargo build --release --features cuda` (docs/gpu.md), \
     or train with train.device = \"cpu\"";

/// Whether this build can compute on CUDA (checked when the config is
/// built, before anything starts); the error names the feature.
pub fn cuda_built() -> Result<(), String> {
    match cfg!(feature = "cuda") {
        true => Ok(()),
        false => Err(NOT_BUILT.into()),
    }
}

/// The CUDA device this rank computes on (the local rank modulo the device
/// count); the same handle on every call.
#[cfg(feature = "cuda")]
pub fn open_cuda() -> Result<Device, String> {
    cuda::open(local_rank()?)
}

/// The CUDA device this rank computes on: refused, naming the feature.
#[cfg(not(feature = "cuda"))]
pub fn open_cuda() -> Result<Device, String> {
    Err(NOT_BUILT.into())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use candle_core::Device;

    /// CUDA device `local_rank % count`, opened on first use.
    pub fn open(local_rank: usize) -> Result<Device, String> {
        static OPEN: Mutex<Option<HashMap<usize, Device>>> = Mutex::new(None);
        let count = CudaContext::device_count().map_err(|e| {
            format!(
                "train.device = \"cuda\": the NVIDIA driver did not start ({:?}); \
                 is this a machine with an NVIDIA GPU and its driver?",
                e.0
            )
        })?;
        if count <= 0 {
            let vis = std::env::var("CUDA_VISIBLE_DEVICES")
                .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
                .unwrap_or_default();
            return Err(format!(
                "train.device = \"cuda\": the driver sees no CUDA device{vis}"
            ));
        }
        let ordinal = local_rank % count as usize;
        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        let open = open.get_or_insert_with(HashMap::new);
        if let Some(d) = open.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Device::new_cuda(ordinal).map_err(|e| {
            format!("train.device = \"cuda\": opening CUDA device {ordinal} of {count}: {e}")
        })?;
        keep_pool_memory(&d);
        open.insert(ordinal, d.clone());
        Ok(d)
    }

    /// cudarc allocates from the device's default memory pool
    /// (`cuMemAllocAsync`), whose release threshold is 0: every
    /// synchronisation (a loss read back, a write-back) would hand the
    /// freed memory to the OS, and the next step map it again. Keep it, as
    /// PyTorch's `cudaMallocAsync` backend does. A failure only costs that
    /// speed: it is reported, not fatal.
    fn keep_pool_memory(d: &Device) {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let Ok(cuda) = d.as_cuda_device() else {
            return;
        };
        let ctx = cuda.cuda_stream().context().clone();
        let r = ctx
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))
            .and_then(|()| {
                let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
                let mut keep: u64 = u64::MAX;
                // SAFETY: the context is bound on this thread; `pool` is
                // written by the driver, `keep` outlives the call.
                unsafe {
                    sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                        .result()
                        .and_then(|()| {
                            sys::cuMemPoolSetAttribute(
                                pool,
                                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                &mut keep as *mut u64 as *mut std::ffi::c_void,
                            )
                            .result()
                        })
                        .map_err(|e| format!("{e:?}"))
                }
            });
        if let Err(e) = r {
            eprintln!("note: the CUDA memory pool keeps releasing freed memory ({e}): steps may be slower");
        }
    }
}
