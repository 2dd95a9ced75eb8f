//! Phalanx: distributed training for candle models.
pub mod data;
pub mod config;
