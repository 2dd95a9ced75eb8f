//! Reference models for Phalanx.
//!
//! - [`gpt2`]: GPT-2 with Hugging Face's architecture and safetensors names.
pub mod gpt2;
