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
