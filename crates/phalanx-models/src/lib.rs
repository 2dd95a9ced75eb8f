//! Reference models for Phalanx.
//!
//! - [`gpt2`]: GPT-2 with Hugging Face's architecture and safetensors names.
//! - [`llama`]: Llama-family decoders (GQA, RoPE, SwiGLU), HF `LlamaForCausalLM` names.
//! - [`arch`]: the `model` section for both, chosen by `model.arch`.
pub mod arch;
pub mod gpt2;
pub mod llama;
