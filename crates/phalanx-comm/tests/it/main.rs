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
