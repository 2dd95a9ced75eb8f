//! Fused ops with their own backward, for training on CPU.
//!
//! candle-nn's fused `layer_norm` and `softmax_last_dim` have no backward,
//! and the composed versions allocate many full-size tensors. These ops do
//! one pass forward and one pass backward, vectorised and threaded on
//! candle's pool. All take f32, f16 or bf16 CPU tensors (other devices fall
//! back to candle's composed ops where one exists, or return an error).
//!
//! Mixed precision: half tensors stay half in storage (what autograd keeps),
//! but every kernel widens its inputs to f32 at the boundary, computes and
//! accumulates in f32 exactly as the f32 path does, and narrows its output
//! (and each gradient) to the dtype of the corresponding input. The
//! cross-entropy loss is always f32. Helpers: `cpu::{cpu_f32, with_f32_any,
//! storage_in, tensor_in}`.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! let x = Var::new(&[0.5f32, -1.0], &Device::Cpu).unwrap();
//! let y = phalanx::ops::gelu(x.as_tensor()).unwrap().sum_all().unwrap();
//! let g = y.backward().unwrap();
//! assert!(g.get(x.as_tensor()).is_some());
//! ```

mod attention;
mod bias;
pub mod buffers;
pub mod cpu;
mod cross_entropy;
mod gelu;
pub mod gemm_bf16;
mod layer_norm;
pub(crate) mod linear;
mod softmax;
pub mod tape;

pub use attention::{
    attention_backward, attention_forward, causal_attention, BLOCK as ATTENTION_BLOCK,
};
pub use bias::add_bias;
pub use cross_entropy::cross_entropy;
pub use gelu::{exp_approx, gelu, gelu_backward, gelu_forward, tanh_approx};
pub use layer_norm::{
    layer_norm, layer_norm_backward, layer_norm_backward_into, layer_norm_forward,
};
pub use linear::{
    linear, linear_backward_bias, linear_backward_bias_cols, linear_backward_input,
    linear_backward_input_acc, linear_backward_weight, linear_backward_weight_rows_acc,
    linear_forward, sgemm, sgemm_strided, Mat,
};
pub use softmax::{causal_softmax, softmax_last_dim};

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use candle_core::{Device, Result, Tensor};

/// [`set_host_kernels`]'s override: 0 none (read `PHALANX_HOST_KERNELS`),
/// 1 on, 2 off.
static HOST_KERNELS: AtomicU8 = AtomicU8::new(0);

/// Whether a tensor on `dev` takes Phalanx's CPU kernels (these ops' own
/// passes, the families' direct layers): on the CPU, unless they were
/// turned off with `PHALANX_HOST_KERNELS=0` or [`set_host_kernels`].
/// Otherwise the op runs candle's composed ops, the path a CUDA device
/// takes: turning the CPU kernels off runs that device-generic path on the
/// CPU, where a test can hold it against the fused one.
pub fn host_kernels(dev: &Device) -> bool {
    dev.is_cpu() && host_kernels_on()
}

/// Counts one run of a CPU kernel (each op's `cpu_fwd`, each direct layer's
/// forward): the kernels call it first thing.
pub fn kernel_ran() {
    KERNEL_RUNS.fetch_add(1, Ordering::Relaxed);
}

/// How many CPU kernels have run in this process, so that a test can tell
/// which path ran (the tensor-parallel exchanges, the same code on both
/// paths, are not counted).
pub fn kernel_runs() -> usize {
    KERNEL_RUNS.load(Ordering::Relaxed)
}

static KERNEL_RUNS: AtomicUsize = AtomicUsize::new(0);

fn host_kernels_on() -> bool {
    static ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match HOST_KERNELS.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => *ENV.get_or_init(|| std::env::var("PHALANX_HOST_KERNELS").map_or(true, |v| v != "0")),
    }
}

/// Turns the CPU kernels on or off for the whole process (`None`: back to
/// `PHALANX_HOST_KERNELS`, default on); for comparisons and tests.
pub fn set_host_kernels(on: Option<bool>) {
    let v = match on {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    };
    HOST_KERNELS.store(v, Ordering::Relaxed);
}

/// `f` applied to `x` on the host: a CPU tensor as it is, a device tensor
/// copied to host memory and the result copied back (both copies are
/// differentiable). For the ops whose passes exist only on the CPU: the
/// tensor-parallel exchanges where the group's backend reduces host memory
/// only (ranks sharing a GPU).
pub fn on_host(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.device().is_cpu() {
        return f(x);
    }
    f(&x.to_device(&Device::Cpu)?)?.to_device(x.device())
}
