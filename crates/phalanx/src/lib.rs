//! Phalanx: distributed training for candle models.
pub mod checkpoint;
pub mod collective;
pub mod config;
pub mod data;
pub mod device;
pub mod engine;
pub mod error;
pub mod fault;
pub mod fsutil;
pub mod ledger;
pub mod mesh;
pub mod monitor;
pub mod ops;
pub mod optim;
pub mod placement;
pub mod plan;
pub mod precision;
pub mod report;
pub mod strategy;
pub mod tp;
pub mod trainer;

pub use error::{Error, Result};
