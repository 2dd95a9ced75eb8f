//! Llama's names for the training path every family shares
//! ([`crate::train`]): a config with `model.arch = "llama"` trains there,
//! through the generic strategies (DDP, ZeRO-1/2/3, FSDP, pipeline) and
//! Llama's tensor-parallel blocks and placements.
//!
//! ```no_run
//! use phalanx_models::{family, llama::train::{self, LlamaRun}};
//! let cfg = family::build(None, &["model.arch=llama".into(), "train.steps=10".into()]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let loader = std::sync::Arc::new(train::open_data(&cfg).unwrap());
//! let (report, _trainer) = train::train(&cfg, pg, loader, &LlamaRun::default()).unwrap();
//! println!("final loss {}", report.losses.last().unwrap());
//! ```

pub use super::family::model_config;
pub use crate::train::{
    build_engine, full_named_params, open_data, save, train, trainer, Run as LlamaRun,
};
