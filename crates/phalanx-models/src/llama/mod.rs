//! Llama-family decoders (Hugging Face `LlamaForCausalLM` architecture and
//! weights) as a Phalanx block stack: RMSNorm, rotary embeddings
//! (rotate-half), SwiGLU MLP, grouped-query attention, untied head.
//!
//! - [`config`]: hyper-parameters, presets `llama-tiny`, `llama-60m`,
//!   `tinyllama-1.1b`, and the `model` section (`model.arch = "llama"`);
//! - [`blocks`]: embedding, decoder layers, head;
//! - [`ops`]: fused RMSNorm, rotary and SwiGLU with their backward;
//! - [`hf`]: safetensors import / export, single file or sharded;
//! - [`hf_config`]: HF `config.json` read, checked, written;
//! - [`tp`], [`tp_blocks`]: tensor parallel (Megatron layout, GQA-aware);
//! - [`family`]: Llama as a [`crate::family::ModelFamily`] (`model.arch = "llama"`);
//! - [`train`]: Llama's names for the shared training path ([`crate::train`]);
//! - [`generate`]: inference with a KV cache.
//!
//! Inputs are token ids (B, T) u32, targets (B, T) u32; the loss is the mean
//! cross-entropy over all B*T targets.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_models::llama::{self, LlamaConfig};
//! let cfg = LlamaConfig::new(2, 4, 2, 16, 40, 64, 8);
//! let mut engine = llama::engine(&cfg, &Device::Cpu, Default::default()).unwrap();
//! assert_eq!(engine.num_params(), cfg.num_params());
//! let x = Tensor::zeros((2, 8), candle_core::DType::U32, &Device::Cpu).unwrap();
//! let y = Tensor::ones((2, 8), candle_core::DType::U32, &Device::Cpu).unwrap();
//! let loss = engine.forward_backward(&x, &y, 1.0).unwrap();
//! assert!((loss - 64f32.ln()).abs() < 0.1); // ~uniform at init
//! ```

pub mod blocks;
pub mod config;
mod direct;
pub mod family;
pub mod generate;
pub mod hf;
pub mod hf_config;
pub mod ops;
pub mod tp;
pub mod tp_blocks;
pub mod train;

pub use blocks::blocks;
pub use config::LlamaConfig;
pub use family::LLAMA;

use candle_core::{Device, Result};
use phalanx::engine::{Engine, EngineConfig};

/// A Llama engine: blocks built, parameters allocated and initialised.
pub fn engine(cfg: &LlamaConfig, device: &Device, engine_cfg: EngineConfig) -> Result<Engine> {
    Engine::new(blocks(cfg)?, device, engine_cfg)
}
