//! `[fault_tolerance]`: this job as one replica group of a fault-tolerant
//! job (see `phalanx_comm::ft` and docs/fault_tolerance.md).

use super::{ConfigError, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FaultToleranceConfig {
    /// `HOST:PORT` of `phalanx lighthouse` ("" : off).
    pub lighthouse: String,
    /// This group's index, 0..replicas: its replica id, and which share of
    /// each step's data it reads.
    pub replica_id: usize,
    /// How many replica groups the data is shared among (the most that
    /// train at once).
    pub replicas: usize,
    /// Seconds a quorum may take before this group gives up.
    pub quorum_timeout: f64,
    /// The lighthouse's `--heartbeat-timeout` (heartbeats go 5 times as often).
    pub heartbeat_timeout: f64,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        FaultToleranceConfig {
            lighthouse: String::new(),
            replica_id: 0,
            replicas: 1,
            quorum_timeout: 60.0,
            heartbeat_timeout: 5.0,
        }
    }
}

impl FaultToleranceConfig {
    pub fn enabled(&self) -> bool {
        !self.lighthouse.trim().is_empty()
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        if self.replicas == 0 || self.replica_id >= self.replicas {
            return Err(ConfigError(format!(
                "fault_tolerance.replica_id = {} must be below fault_tolerance.replicas = {}",
                self.replica_id, self.replicas
            )));
        }
        for (k, v) in [
            ("quorum_timeout", self.quorum_timeout),
            ("heartbeat_timeout", self.heartbeat_timeout),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError(format!(
                    "fault_tolerance.{k} must be a positive number of seconds, not {v}"
                )));
            }
        }
        if !self.lighthouse.contains(':') {
            return Err(ConfigError(format!(
                "fault_tolerance.lighthouse = {:?}: expected HOST:PORT",
                self.lighthouse
            )));
        }
        Ok(())
    }
}
