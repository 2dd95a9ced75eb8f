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
