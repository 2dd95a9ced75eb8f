//! Phalanx: distributed training for candle models.
