//! Parallel strategies, applied to a plain `Engine` and a process group.
//!
//! - [`ddp`]: data parallel with bucketed, overlapped gradient all-reduce.
//!
//! Order of application (when more exist): data axis last, around whatever
//! the model axes (tensor, pipeline) did to the engine.

pub mod ddp;

pub use ddp::{Ddp, DdpConfig};
