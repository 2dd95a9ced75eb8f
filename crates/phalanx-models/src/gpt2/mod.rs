//! GPT-2 (Hugging Face architecture and weights) as a Phalanx block stack.
//!
//! - [`config`]: hyper-parameters, presets `gpt-tiny` and `gpt2-124m`;
//! - [`blocks`]: embedding, transformer layers, head (tied wte);
//! - [`hf`]: `GPT2LMHeadModel` safetensors import / export;
//! - [`tp`]: tensor-parallel placements, reading a rank's slices of HF files;
//! - [`family`]: GPT-2 as a [`crate::family::ModelFamily`] (`model.arch = "gpt2"`);
//! - [`train`]: GPT-2's names for the shared training path ([`crate::train`]).
//!
//! Inputs are token ids (B, T) u32, targets (B, T) u32; the loss is the mean
//! cross-entropy over all B*T targets.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_models::gpt2::{self, Gpt2Config};
//! let cfg = Gpt2Config::new(2, 2, 16, 64, 8);
//! let mut engine = gpt2::engine(&cfg, &Device::Cpu, Default::default()).unwrap();
//! assert_eq!(engine.num_params(), cfg.num_params());
//! let x = Tensor::zeros((2, 8), candle_core::DType::U32, &Device::Cpu).unwrap();
//! let y = Tensor::ones((2, 8), candle_core::DType::U32, &Device::Cpu).unwrap();
//! let loss = engine.forward_backward(&x, &y, 1.0).unwrap();
//! assert!((loss - 64f32.ln()).abs() < 0.1); // ~uniform at init
//! ```

pub mod blocks;
pub mod config;
pub mod family;
mod fused;
mod fused_half;
pub mod hf;
pub mod tp;
pub mod train;

pub use blocks::{blocks, blocks_tp};
pub use config::Gpt2Config;
pub use family::Gpt2Family;
pub use fused::set_fused_layer;

use candle_core::{Device, Result};
use phalanx::engine::{Engine, EngineConfig};

/// A GPT-2 engine: blocks built, parameters allocated and initialised.
pub fn engine(cfg: &Gpt2Config, device: &Device, engine_cfg: EngineConfig) -> Result<Engine> {
    Engine::new(blocks(cfg)?, device, engine_cfg)
}
