//! Phalanx: distributed training for candle models.
pub mod config;
pub mod data;
pub mod engine;
pub mod ledger;
pub mod ops;
pub mod optim;
