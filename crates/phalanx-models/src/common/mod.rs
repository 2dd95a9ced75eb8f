//! What the model families share, so that no family imports another:
//!
//! - [`data`]: the data loader for a model's context and vocabulary;
//! - [`blocks`]: token embeddings with the context check, the head's loss or logits;
//! - [`tp`]: tensor-parallel placements (rules, shards, gathering,
//!   checkpoint placement);
//! - [`hf`]: Hugging Face checkpoint files (single, sharded, `config.json`);
//! - [`backed`]: a config's size checked against its weight files before allocating;
//! - [`plan`]: the planner's parameters, declared by a family's blocks;
//! - [`generate`]: the decoder interface generation runs on.

pub mod backed;
pub mod blocks;
pub mod data;
pub mod direct;
pub mod generate;
pub mod hf;
pub mod plan;
pub mod tp;
