//! Parallel strategies, applied to a plain `Engine` and a process group.
//!
//! - [`ddp`]: data parallel with bucketed, overlapped gradient all-reduce;
//! - [`zero`]: ZeRO-1/2/3 and FSDP sharding over the same data axis;
//! - [`pipeline`]: pipeline parallelism over the mesh's `pp` axis (GPipe,
//!   1F1B, interleaved 1F1B, ZB-H1).
//!
//! Order of application (when more exist): data axis last, around whatever
//! the model axes (tensor, pipeline) did to the engine.

pub mod ddp;
pub mod pipeline;
pub mod shard;
pub mod zero;

pub use ddp::{Ddp, DdpConfig};
pub use zero::{Zero, ZeroConfig};
