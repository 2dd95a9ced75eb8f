//! GPT-2's names for the training path every family shares
//! ([`crate::train`]): a GPT-2 config (from [`super::config::build`] or
//! [`crate::family::build`]) trains there.
//!
//! ```no_run
//! use phalanx_models::gpt2::{config, train::{self, GptRun}};
//! let cfg = config::build(None, &["train.steps=10".into()]).unwrap();
//! let pg = phalanx_comm::init_process_group().unwrap();
//! let loader = std::sync::Arc::new(train::open_data(&cfg).unwrap());
//! let (report, trainer) = train::train(&cfg, pg, loader, &GptRun::default()).unwrap();
//! println!("final loss {}", report.losses.last().unwrap());
//! ```

pub use super::family::model_config;
pub use crate::common::data::{open_data_for, BUILTIN_CORPUS, DEFAULT_CORPUS_PATH};
pub use crate::train::{
    build_engine, full_named_params, open_data, save, train, trainer, Run as GptRun,
};
