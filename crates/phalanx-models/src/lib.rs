//! Reference models for Phalanx.
