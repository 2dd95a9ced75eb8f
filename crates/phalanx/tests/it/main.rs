//! The integration tests of `phalanx` that may share a process, in one
//! binary (one link instead of one per file): each file here is a module
//! with its own `//!` header. Tests that read process-wide state (library
//! counters, `/proc/self`, page faults, the environment) are binaries of
//! their own in `tests/`.

#[path = "../common/mod.rs"]
mod common;
#[path = "../../examples/ddp_custom_model.rs"]
#[allow(dead_code)] // the example's main is not run here
mod example;

mod ckpt_dir;
mod ckpt_fuzz;
mod collective_tensor;
mod comm_hooks;
mod config_choices;
mod config_deepspeed;
mod data_batches;
mod data_corpus;
mod data_parquet;
mod data_paths;
mod data_sources;
mod ddp_custom;
mod engine_direct;
mod engine_mlp;
mod fsutil;
mod gemm_bf16;
mod layers;
mod mesh;
mod ops;
mod ops_half;
mod optim;
mod optim_device;
mod tp;

/// Every file in each crate's `tests/it/` is a module of that crate's
/// binary (its `main.rs`): a file left out would never be compiled or run.
#[test]
fn every_file_of_each_crates_tests_it_is_a_module() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    for c in std::fs::read_dir(&crates).unwrap() {
        let here = c.unwrap().path().join("tests/it");
        let Ok(main) = std::fs::read_to_string(here.join("main.rs")) else {
            continue;
        };
        for e in std::fs::read_dir(&here).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if let Some(m) = name.strip_suffix(".rs").filter(|m| *m != "main") {
                let line = format!("\nmod {m};\n");
                assert!(
                    main.contains(&line),
                    "{} is not a module of its main.rs",
                    here.join(&name).display()
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 5, "the crates with a tests/it");
}
