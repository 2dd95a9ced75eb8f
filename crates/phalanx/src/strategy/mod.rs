//! Parallel strategies, applied to a plain `Engine` and a process group.
//!
//! - [`ddp`]: data parallel with bucketed, overlapped gradient all-reduce;
//! - [`zero`]: ZeRO-1/2/3 and FSDP sharding over the same data axis.
//!
//! Order of application (when more exist): data axis last, around whatever
//! the model axes (tensor, pipeline) did to the engine.

pub mod ddp;
pub mod shard;
pub mod zero;

pub use ddp::{Ddp, DdpConfig};
pub use zero::{Zero, ZeroConfig};
