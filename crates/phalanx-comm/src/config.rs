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
//! | `PHALANX_TRANSPORT` | `auto`: shared memory to ranks on the same host (Unix sockets if it cannot be set up), TCP to others; `shm`: the same, but failing to set up shared memory is an error; `uds`: Unix domain sockets to same-host ranks; `tcp`: TCP everywhere | auto |
//! | `PHALANX_SHM_RING_BYTES` | data bytes of each shared-memory ring (per direction per same-host pair), a power of two | 1 MiB |
//! | `PHALANX_SHM_ALLREDUCE` | `0`: the world group's all-reduce runs over the shared-memory rings instead of in place in shared memory | 1 |
//! | `PHALANX_SHM_SPIN_US` | microseconds a rank waiting on shared memory spins before it sleeps | 50 when there are two cores per local rank, else 0 (yield, then sleep) |
//! | `PHALANX_NET_EMULATE` | emulate a slow network on every link, e.g. `bandwidth=1gbit,latency=100us` (see [`NetEmulate`]); a bad value fails process-group init | off |

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    Auto,
    Ring,
    RecursiveDoubling,
}

/// What the rank-to-rank mesh may use (`PHALANX_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportPref {
    /// Shared memory to ranks on the same host (falling back to Unix
    /// sockets to a peer if it cannot be set up), TCP to the others.
    Auto,
    /// Like `Auto`, but a same-host peer without shared memory is an error
    /// (so a benchmark or test really measures shared memory).
    Shm,
    /// Unix domain sockets to ranks on the same host, TCP to the others.
    Uds,
    /// TCP to every rank, even on the same host.
    Tcp,
}

impl TransportPref {
    /// Parse `auto`, `shm`, `uds` or `tcp` (case-insensitive; empty is auto).
    pub fn parse(s: &str) -> Option<TransportPref> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(TransportPref::Auto),
            "shm" => Some(TransportPref::Shm),
            "uds" | "unix" => Some(TransportPref::Uds),
            "tcp" => Some(TransportPref::Tcp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TransportPref::Auto => "auto",
            TransportPref::Shm => "shm",
            TransportPref::Uds => "uds",
            TransportPref::Tcp => "tcp",
        }
    }
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
    /// Spin budget of a rank waiting on shared memory, in microseconds
    /// (`PHALANX_SHM_SPIN_US`); `None`: chosen from cores and local ranks.
    pub shm_spin_us: Option<f64>,
    /// Data bytes of each shared-memory ring (`PHALANX_SHM_RING_BYTES`,
    /// rounded up to a power of two, at least 64 KiB).
    pub shm_ring_bytes: usize,
    /// All-reduce of the world group in place in shared memory when every
    /// rank shares this host (`PHALANX_SHM_ALLREDUCE`, default on).
    pub shm_all_reduce: bool,
    /// Network emulation on every rank-to-rank link (`PHALANX_NET_EMULATE`);
    /// `None`: off, at the cost of one branch per send.
    pub net_emulate: Option<NetEmulate>,
    /// A `PHALANX_NET_EMULATE` value that did not parse: reported as an
    /// error when a process group is initialised with this configuration.
    #[doc(hidden)]
    pub net_emulate_error: Option<String>,
    /// The address this rank listens on and gives its peers
    /// (`PHALANX_SOCKET_ADDR`, as Gloo's and NCCL's `*_SOCKET_IFNAME` pick
    /// an interface); `None`: the address this rank reaches the store from
    /// (see `transport::mesh`).
    pub advertise: Option<std::net::IpAddr>,
    /// The job has ranks on other hosts (set by `init` from the launcher's
    /// sizes): a loopback address is then no address to give peers.
    pub spans_hosts: bool,
    #[doc(hidden)]
    pub advertise_error: Option<String>,
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
            shm_spin_us: None,
            shm_ring_bytes: 1 << 20,
            shm_all_reduce: true,
            net_emulate: None,
            net_emulate_error: None,
            advertise: None,
            spans_hosts: false,
            advertise_error: None,
        }
    }
}

/// The longest wait any setting may ask for: 10^9 s (about 31 years).
/// Longer is as good as forever, and a deadline of now + a longer time
/// could overflow the clock.
pub const MAX_WAIT_SECS: f64 = 1e9;

/// `secs` seconds (finite and non-negative) as a `Duration`, at most
/// [`MAX_WAIT_SECS`]: what every timeout setting goes through, so that a
/// value like `1e20` means "a very long time" rather than a panic.
///
/// ```
/// use phalanx_comm::config::{wait_secs, MAX_WAIT_SECS};
/// assert_eq!(wait_secs(1.5).as_millis(), 1500);
/// assert_eq!(wait_secs(1e300).as_secs_f64(), MAX_WAIT_SECS);
/// ```
pub fn wait_secs(secs: f64) -> Duration {
    debug_assert!(secs.is_finite() && secs >= 0.0, "{secs}");
    Duration::from_secs_f64(secs.clamp(0.0, MAX_WAIT_SECS))
}

fn env_f64(name: &str) -> Option<f64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Some(x),
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
            c.timeout = wait_secs(s);
        }
        if let Some(s) = env_f64("PHALANX_HEARTBEAT_TIMEOUT") {
            c.heartbeat_timeout = wait_secs(s);
        }
        c.detail = std::env::var("PHALANX_DEBUG")
            .map(|v| v.eq_ignore_ascii_case("detail"))
            .unwrap_or(false);
        c.algo = match std::env::var("PHALANX_ALGO").as_deref() {
            Ok("ring") => Algo::Ring,
            Ok("rd") => Algo::RecursiveDoubling,
            Err(_) | Ok("auto") => Algo::Auto,
            Ok(v) => {
                eprintln!("[phalanx] ignoring PHALANX_ALGO={v}: expected auto, ring or rd");
                Algo::Auto
            }
        };
        c.transport = match std::env::var("PHALANX_TRANSPORT") {
            Err(_) => TransportPref::Auto,
            Ok(v) => TransportPref::parse(&v).unwrap_or_else(|| {
                eprintln!(
                    "[phalanx] ignoring PHALANX_TRANSPORT={v}: expected auto, shm, uds or tcp"
                );
                TransportPref::Auto
            }),
        };
        if let Some(b) = env_f64("PHALANX_SHM_RING_BYTES") {
            c.shm_ring_bytes = (b as usize).clamp(64 << 10, 1 << 30).next_power_of_two();
        }
        if let Ok(v) = std::env::var("PHALANX_SHM_ALLREDUCE") {
            c.shm_all_reduce = !matches!(v.trim(), "0" | "off" | "false");
        }
        if let Ok(v) = std::env::var("PHALANX_SHM_SPIN_US") {
            match v.trim().parse::<f64>() {
                // At most a second: a spin is a moment, not a wait.
                Ok(x) if x >= 0.0 && x.is_finite() => c.shm_spin_us = Some(x.min(1e6)),
                _ => eprintln!(
                    "[phalanx] ignoring PHALANX_SHM_SPIN_US={v}: expected microseconds >= 0"
                ),
            }
        }
        if let Some(b) = env_f64("PHALANX_RD_MAX_BYTES") {
            c.rd_max_bytes = b as usize;
        }
        if let Some(b) = env_f64("PHALANX_CHUNK_BYTES") {
            c.chunk_bytes = (b as usize).max(64);
        }
        if let Ok(v) = std::env::var("PHALANX_SOCKET_ADDR") {
            match v.trim().parse::<std::net::IpAddr>() {
                Ok(ip) => c.advertise = Some(ip),
                Err(_) if v.trim().is_empty() => {}
                Err(_) => {
                    c.advertise_error = Some(format!(
                        "PHALANX_SOCKET_ADDR={v:?} is not an IP address (this host's address \
                         on the network its peers reach it by)"
                    ))
                }
            }
        }
        if let Ok(v) = std::env::var("PHALANX_NET_EMULATE") {
            match NetEmulate::parse(&v) {
                Ok(n) => c.net_emulate = n,
                Err(e) => c.net_emulate_error = Some(format!("PHALANX_NET_EMULATE={v:?}: {e}")),
            }
        }
        c
    }

    /// The configuration error, if any, that must stop process-group init
    /// (today: an unparsable `PHALANX_NET_EMULATE`).
    pub fn validate(&self) -> crate::error::Result<()> {
        match self
            .net_emulate_error
            .as_ref()
            .or(self.advertise_error.as_ref())
        {
            Some(e) => Err(crate::error::CommError::Invalid(e.clone())),
            None => Ok(()),
        }
    }
}

/// An emulated network link (`PHALANX_NET_EMULATE`), applied on the sending
/// side of every connection between two ranks, each direction separately.
///
/// Model: a message (frame) handed to the transport at time `t` starts
/// transmission no earlier than `t + latency` (one sleep per message before
/// its first byte; messages queued behind it on the same link do not add
/// their latencies to its, they overlap), then its bytes (header included)
/// leave through a token bucket of `bandwidth` bits/s, in chunks of at most
/// 64 KiB, so that a 64 MB message streams at the rate. The data of a
/// message therefore arrives no earlier than `t + latency + size /
/// bandwidth`, plus the real cost of the socket. Heartbeats are not shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetEmulate {
    /// Bits per second; `None`: unlimited.
    pub bandwidth_bps: Option<f64>,
    /// One-way delay added to each message.
    pub latency: Duration,
}

impl NetEmulate {
    /// Parse `bandwidth=<n>{kbit,mbit,gbit},latency=<n>{us,ms}` (either key
    /// optional, in any order). `Ok(None)` for an empty string. Errors name
    /// the bad part.
    pub fn parse(s: &str) -> std::result::Result<Option<NetEmulate>, String> {
        let mut n = NetEmulate {
            bandwidth_bps: None,
            latency: Duration::ZERO,
        };
        let mut any = false;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=value (keys: bandwidth, latency)"))?;
            let (k, v) = (k.trim(), v.trim());
            match k.to_ascii_lowercase().as_str() {
                "bandwidth" => {
                    let x = number_with_unit(v, &[("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)])
                        .map_err(|e| format!("bandwidth `{v}`: {e}"))?;
                    if x == 0.0 {
                        return Err(format!("bandwidth `{v}`: expected a positive rate"));
                    }
                    n.bandwidth_bps = Some(x);
                }
                "latency" => {
                    let x = number_with_unit(v, &[("us", 1e-6), ("ms", 1e-3)])
                        .map_err(|e| format!("latency `{v}`: {e}"))?;
                    n.latency = wait_secs(x);
                }
                _ => {
                    return Err(format!(
                        "unknown key `{k}` in `{part}` (keys: bandwidth, latency)"
                    ))
                }
            }
            any = true;
        }
        Ok(any.then_some(n))
    }
}

/// `v` as a positive number followed by one of `units` (case-insensitive),
/// scaled by the unit's factor.
fn number_with_unit(v: &str, units: &[(&str, f64)]) -> std::result::Result<f64, String> {
    let names: Vec<&str> = units.iter().map(|u| u.0).collect();
    let lower = v.to_ascii_lowercase();
    let split = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(split);
    let factor = units
        .iter()
        .find(|u| u.0 == unit.trim())
        .map(|u| u.1)
        .ok_or_else(|| format!("expected a number with a unit in {names:?}"))?;
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x * factor),
        _ => Err(format!("expected a number with a unit in {names:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_emulate_parses() {
        let n = NetEmulate::parse("bandwidth=1gbit,latency=100us")
            .unwrap()
            .unwrap();
        assert_eq!(n.bandwidth_bps, Some(1e9));
        assert_eq!(n.latency, Duration::from_micros(100));
        let n = NetEmulate::parse(" latency = 20ms ").unwrap().unwrap();
        assert_eq!(
            (n.bandwidth_bps, n.latency),
            (None, Duration::from_millis(20))
        );
        let n = NetEmulate::parse("bandwidth=100Mbit").unwrap().unwrap();
        assert_eq!(n.bandwidth_bps, Some(1e8));
        assert_eq!(NetEmulate::parse("").unwrap(), None);
    }

    #[test]
    fn net_emulate_errors_name_the_bad_part() {
        let e = NetEmulate::parse("bandwidth=fast").unwrap_err();
        assert!(e.contains("bandwidth") && e.contains("fast"), "{e}");
        let e = NetEmulate::parse("latency=5parsecs").unwrap_err();
        assert!(e.contains("latency") && e.contains("5parsecs"), "{e}");
        let e = NetEmulate::parse("bandwidth=1gbit,jitter=1ms").unwrap_err();
        assert!(e.contains("unknown key `jitter`"), "{e}");
        let e = NetEmulate::parse("bandwidth").unwrap_err();
        assert!(e.contains("key=value"), "{e}");
        let e = NetEmulate::parse("bandwidth=0mbit").unwrap_err();
        assert!(e.contains("positive"), "{e}");
        // Absurd but well-formed: a very long time, not a panic.
        let n = NetEmulate::parse(&format!("latency={}ms", "9".repeat(40)))
            .unwrap()
            .unwrap();
        assert_eq!(n.latency.as_secs_f64(), MAX_WAIT_SECS);
    }

    #[test]
    fn bad_net_emulate_fails_validate_naming_the_variable() {
        let c = Config {
            net_emulate_error: Some("PHALANX_NET_EMULATE=\"x\": bad".into()),
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("PHALANX_NET_EMULATE"), "{e}");
    }
}
