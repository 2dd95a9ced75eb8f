//! The integration tests of `phalanx-cli` that may share a process, in one
//! binary (one link instead of one per file): each file here is a module
//! with its own `//!` header. Tests that read process-wide state (library
//! counters, `/proc/self`, page faults, the environment) are binaries of
//! their own in `tests/`.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod bench;
mod checkpoint_cmd;
mod cluster_env;
mod data_layouts;
mod elastic;
mod fault_tolerance;
mod ft_train;
mod generate;
mod hf_dir;
mod launcher;
mod llama;
mod outputs;
mod plan;
mod recovery;
mod report;
mod security;
mod tokenize;
mod train;
mod train_deepspeed;
mod train_precision;
