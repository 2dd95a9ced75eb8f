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

/// Every file in this directory is a module of this binary: a file
/// left out would never be compiled or run.
#[test]
fn every_file_here_is_a_module() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it");
    let main = include_str!("main.rs");
    for e in std::fs::read_dir(&here).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        if let Some(m) = name.strip_suffix(".rs").filter(|m| *m != "main") {
            let line = format!("\nmod {m};\n");
            assert!(
                main.contains(&line),
                "tests/it/{name} is not a module of tests/it/main.rs"
            );
        }
    }
}
