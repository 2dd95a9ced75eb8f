//! The integration tests of `phalanx-models` that may share a process, in one
//! binary (one link instead of one per file): each file here is a module
//! with its own `//!` header. Tests that read process-wide state (library
//! counters, `/proc/self`, page faults, the environment) are binaries of
//! their own in `tests/`.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/fixture.rs"]
mod fixture;

mod checkpoint;
mod compression;
mod compression_resume;
mod compression_skip;
mod config;
mod data_paths;
mod ddp_gpt2;
mod diloco;
mod fused_half;
mod fused_layer;
mod gpt2;
mod gpt2_half;
mod grad_slots;
mod hf;
mod llama;
mod llama_direct;
mod llama_hf;
mod llama_parallel;
mod mesh3d;
mod monitor;
mod offload;
mod pipeline;
mod pipeline_memory;
mod placement;
mod plan;
mod plan_declared;
mod plan_llama;
mod precision;
mod qwen2_hf;
mod qwen2_parallel;
mod recompute;
mod tp;
mod zero;
mod zero3_keep;
mod zero_bubble;
mod zeropp;
