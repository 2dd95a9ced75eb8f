//! The integration tests of `phalanx-comm` that may share a process, in one
//! binary (one link instead of one per file): each file here is a module
//! with its own `//!` header. Tests that read process-wide state (library
//! counters, `/proc/self`, page faults, the environment) are binaries of
//! their own in `tests/`.

/// The full name of test `$name` of the calling module in this binary
/// (`module::name`), for `--exact` when a test runs itself again in a child.
macro_rules! test_name {
    ($name:expr) => {
        format!("{}::{}", module_path!().split_once("::").unwrap().1, $name)
    };
}

mod collectives;
mod failures;
mod frames;
mod ft;
mod netem;
mod store;
mod store_limits;
mod strangers;
mod tamper;
mod transport;

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
