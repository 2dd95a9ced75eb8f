//! Phalanx RPC: remote calls between workers and what is built on them,
//! beside the training crate (it needs only `phalanx-comm`).
//!
//! - [`rpc`]: `rpc_sync`, `rpc_async`, `remote` / `RRef` (PyTorch's
//!   `torch.distributed.rpc`);
//! - [`ps`]: a parameter server (sharded sparse and dense parameters,
//!   bounded staleness);
//! - [`rl`]: distributed reinforcement learning (cart-pole observers and a
//!   REINFORCE learner).
//!
//! ```
//! use phalanx_rpc::rpc::{Options, Registry, Rpc};
//! let got = phalanx_comm::threads::run(2, |pg| {
//!     let mut reg = Registry::new();
//!     reg.register("double", |_ctx, x: i64| 2 * x);
//!     let rpc = Rpc::start(&pg, &format!("w{}", pg.rank()), reg, Options::default()).unwrap();
//!     let y = if pg.rank() == 0 { rpc.rpc_sync::<_, i64>("w1", "double", &21i64).unwrap() } else { 0 };
//!     rpc.shutdown().unwrap();
//!     y
//! });
//! assert_eq!(got[0], 42);
//! ```
pub mod ps;
pub mod rl;
pub mod rpc;
