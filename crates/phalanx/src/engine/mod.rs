//! The single-process training engine: a model as a sequence of blocks, run
//! forward and backward block by block over flat f32 buffers.
//!
//! - [`block`]: the `Block` trait (candle code built from a `VarBuilder`);
//! - [`layout`]: the parameter index (name, shape, offset), block order then
//!   name order, ties;
//! - [`backend`]: the `VarBuilder` backends that record and serve parameters;
//! - [`flat`]: the flat buffers and the `GradSink` trait;
//! - [`stack`]: forward / backward over block ranges, per-block grad hook;
//! - [`model`]: `Engine`, the stack with its parameter and gradient buffers;
//! - [`heap`]: freed memory kept for the next step (no page faults per step);
//! - [`resident`]: off the CPU kernels (CUDA), the parameters' device copies
//!   kept between builds while the flat buffer is unchanged.
//!
//! How the distributed layers plug in:
//! - DDP: `Engine::forward_backward_with(.., hook)`; `hook(b, grads)` runs in
//!   backward order once block b's own gradients are final, so buckets of
//!   `grads` (ranges of the flat buffer) can start an async all-reduce.
//! - ZeRO-1/2: `Layout::shard`, `Layout::decay_segments` and the optimizers'
//!   `[lo, hi)` ranges; `Stack::backward` takes any `GradSink`.
//! - ZeRO-3/FSDP: `Stack::forward/backward` take any `ParamSource`, asked for
//!   block b's flat parameters right before block b is built (gather there,
//!   free after); `layout().block(b).tied` lists the other blocks it reads.
//! - Pipeline: `Engine::forward_range` / `backward_range` on a sub-range,
//!   activation in, input gradient out; several stashes may be in flight.
//! - Tensor parallel: blocks are constructed by model code with their tp
//!   rank/size; the engine sees their (sharded) parameters, each with the
//!   placement its block declared (`crate::placement::declare`).
//!
//! ```
//! use phalanx::engine::{Block, Engine, EngineConfig, FnBlock};
//! let blocks: Vec<Box<dyn Block>> = vec![Box::new(FnBlock::new(
//!     |vb: candle_nn::VarBuilder| candle_nn::linear(2, 3, vb.pp("fc")),
//! ))];
//! let engine = Engine::new(blocks, &candle_core::Device::Cpu, EngineConfig::default()).unwrap();
//! let names: Vec<_> = engine.layout().params().iter().map(|p| (p.name.as_str(), p.offset)).collect();
//! assert_eq!(names, vec![("fc.bias", 0), ("fc.weight", 3)]);
//! ```

pub mod backend;
pub mod block;
pub mod flat;
pub mod heap;
pub mod init;
pub mod layout;
pub mod model;
pub mod resident;
pub mod stack;

pub use crate::placement::{Placement, Rule};
pub use backend::ParamSource;
pub use block::{Block, BlockModule, Ctx, CtxBlock, DirectBackward, FnBlock};
pub use flat::{FlatBuffer, GradSink};
pub use layout::{shard_range, BlockLayout, Layout, ParamDecl, ParamInfo};
pub use model::{Engine, EngineConfig};
pub use stack::{Activations, Stack, Stash};
