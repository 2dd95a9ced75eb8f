//! Qwen2 (Hugging Face `Qwen2ForCausalLM`, Qwen2 and Qwen2.5 checkpoints):
//! Llama's decoder layer with biases on the q, k and v projections, usually
//! a tied head, rotary θ 1e6 and RMSNorm ε 1e-6.
//!
//! The layer, its tensor-parallel form (the q / k / v biases split as their
//! matrices' rows), HF weight files and KV-cache generation are Llama's
//! ([`crate::llama`], with [`crate::llama::LlamaConfig::qkv_bias`]); this
//! folder holds what Qwen2 says for itself:
//!
//! - [`config`]: presets `qwen2-tiny`, `qwen2-0.5b`, `qwen2.5-1.5b`;
//! - [`hf`]: `config.json` read (`model_type = "qwen2"`), checked, written,
//!   and weights loaded with that check;
//! - [`family`]: the [`crate::llama::family::LlamaDialect`] the registry
//!   makes a family of ([`QWEN2`], `model.arch = "qwen2"`).
//!
//! ```
//! use phalanx_models::{family, qwen2};
//! let cfg = family::build(None, &["model.arch=qwen2".into()]).unwrap();
//! let m = qwen2::model_config(&cfg).unwrap();
//! assert!(m.qkv_bias && m.tie_word_embeddings);
//! assert_eq!((m.rope_theta, m.rms_norm_eps), (1e6, 1e-6));
//! let e = phalanx_models::train::build_engine(&cfg).unwrap();
//! assert_eq!(e.num_params(), m.num_params());
//! assert!(e.layout().find("model.layers.0.self_attn.q_proj.bias").is_some());
//! ```

pub mod config;
pub mod family;
pub mod hf;

pub use family::{model_config, Qwen2, QWEN2};
