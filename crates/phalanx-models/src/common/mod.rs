//! What the model families share, so that no family imports another:
//!
//! - [`data`]: the data loader for a model's context and vocabulary;
//! - [`blocks`]: token embeddings with the context check, the head's loss or logits;
//! - [`tp`]: tensor-parallel placements (rules, shards, gathering,
//!   checkpoint placement);
//! - [`hf`]: Hugging Face checkpoint files (single, sharded, `config.json`);
//! - [`plan`]: the planner's parameters, declared by a family's blocks;
//! - [`generate`]: the decoder interface generation runs on.

pub mod blocks;
pub mod data;
pub mod generate;
pub mod hf;
pub mod plan;
pub mod tp;
