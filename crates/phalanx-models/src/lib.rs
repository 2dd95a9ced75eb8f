//! Reference models for Phalanx, one folder per family, each a
//! [`family::ModelFamily`] in the registry:
//!
//! - [`gpt2`]: GPT-2 with Hugging Face's architecture and safetensors names.
//! - [`llama`]: Llama-family decoders (GQA, RoPE, SwiGLU), HF `LlamaForCausalLM` names.
//! - [`qwen2`]: Qwen2 (`Qwen2ForCausalLM`): Llama's layer with q / k / v biases.
//! - [`family`]: the `ModelFamily` trait, the registry (by `model.arch`, by
//!   an HF `config.json`), and the `model` section of every family.
//! - [`train`]: the training path every family takes; [`dcp`]: distributed
//!   checkpoints to and from HF files, any family.
//! - [`common`]: what the families share (data, embeddings, tensor-parallel
//!   placements, HF files, the decoder interface).
//! - [`hf_tokenizer`]: Hugging Face `tokenizer.json` files (`data.tokenizer`).
pub mod common;
pub mod dcp;
pub mod family;
pub mod gpt2;
pub mod hf_tokenizer;
pub mod llama;
pub mod qwen2;
pub mod train;

/// The registry's former name (`arch::build`, `arch::plan_shape`).
pub use family as arch;
