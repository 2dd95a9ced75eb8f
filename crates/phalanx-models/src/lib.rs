//! Reference models for Phalanx.
//!
//! - [`gpt2`]: GPT-2 with Hugging Face's architecture and safetensors names.
//! - [`llama`]: Llama-family decoders (GQA, RoPE, SwiGLU), HF `LlamaForCausalLM` names.
//! - [`arch`]: the `model` section for both, chosen by `model.arch`.
//! - [`hf_tokenizer`]: Hugging Face `tokenizer.json` files (`data.tokenizer`).
pub mod arch;
pub mod gpt2;
pub mod hf_tokenizer;
pub mod llama;
