//! Tunables of a process group, read from the environment once.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `PHALANX_TIMEOUT` | seconds any blocking call may wait | 300 |
//! | `PHALANX_DEBUG` | `detail`: check every collective's signature across ranks first | off |
//! | `PHALANX_ALGO` | all-reduce algorithm: `auto`, `ring`, `rd` | auto |
//! | `PHALANX_RD_MAX_BYTES` | `auto` uses recursive doubling / trees up to this size | 2 MiB for 2 ranks, 128 KiB for more (measured crossovers on loopback) |
//! | `PHALANX_CHUNK_BYTES` | ring pipeline chunk | 512 KiB |
//! | `PHALANX_HEARTBEAT_TIMEOUT` | seconds of silence before a peer is declared dead | 5 |
//! | `PHALANX_TRANSPORT` | `auto`: Unix domain sockets to ranks on the same host, TCP to others; `tcp`: TCP everywhere | auto |

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    Auto,
    Ring,
    RecursiveDoubling,
}

/// Which sockets the rank-to-rank mesh may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportPref {
    /// Unix domain sockets to ranks on the same host, TCP to the others.
    Auto,
    /// TCP to every rank, even on the same host.
    Tcp,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub timeout: Duration,
    pub detail: bool,
    pub algo: Algo,
    pub rd_max_bytes: usize,
    pub chunk_bytes: usize,
    pub heartbeat_timeout: Duration,
    pub transport: TransportPref,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(300),
            detail: false,
            algo: Algo::Auto,
            rd_max_bytes: 0,
            chunk_bytes: 512 << 10,
            heartbeat_timeout: Duration::from_secs(5),
            transport: TransportPref::Auto,
        }
    }
}

fn env_f64(name: &str) -> Option<f64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse::<f64>() {
        Ok(x) if x > 0.0 => Some(x),
        _ => {
            eprintln!("[phalanx] ignoring {name}={v}: expected a positive number");
            None
        }
    }
}

impl Config {
    /// The size up to which latency-optimal algorithms (recursive doubling,
    /// trees) beat the pipelined ring / chain for `n` ranks. Measured here:
    /// with 2 ranks one exchange beats the ring's two steps up to ~2 MB;
    /// with 3-4 ranks the ring wins from ~128 KB.
    pub fn small_message_bytes(&self, n: usize) -> usize {
        match (self.rd_max_bytes, n) {
            (0, 2) => 2 << 20,
            (0, _) => 128 << 10,
            (b, _) => b,
        }
    }

    pub fn from_env() -> Config {
        let mut c = Config::default();
        if let Some(s) = env_f64("PHALANX_TIMEOUT") {
            c.timeout = Duration::from_secs_f64(s);
        }
        if let Some(s) = env_f64("PHALANX_HEARTBEAT_TIMEOUT") {
            c.heartbeat_timeout = Duration::from_secs_f64(s);
        }
        c.detail = std::env::var("PHALANX_DEBUG")
            .map(|v| v.eq_ignore_ascii_case("detail"))
            .unwrap_or(false);
        c.algo = match std::env::var("PHALANX_ALGO").as_deref() {
            Ok("ring") => Algo::Ring,
            Ok("rd") => Algo::RecursiveDoubling,
            _ => Algo::Auto,
        };
        c.transport = match std::env::var("PHALANX_TRANSPORT") {
            Err(_) => TransportPref::Auto,
            Ok(v) if v.eq_ignore_ascii_case("tcp") => TransportPref::Tcp,
            Ok(v) if v.is_empty() || v.eq_ignore_ascii_case("auto") => TransportPref::Auto,
            Ok(v) => {
                eprintln!("[phalanx] ignoring PHALANX_TRANSPORT={v}: expected auto or tcp");
                TransportPref::Auto
            }
        };
        if let Some(b) = env_f64("PHALANX_RD_MAX_BYTES") {
            c.rd_max_bytes = b as usize;
        }
        if let Some(b) = env_f64("PHALANX_CHUNK_BYTES") {
            c.chunk_bytes = (b as usize).max(64);
        }
        c
    }
}
