//! The health of a running job, as NCCL's and Megatron's straggler
//! detectors and a Prometheus exporter show it.
//!
//! After every step each rank contributes its [`Figures`] (loss, step and
//! compute time, throughput, gradient norm, bytes sent, memory) to one small
//! all-gather over the world. Then:
//!
//! - **stragglers**: a rank whose *compute* time (the step minus the time it
//!   was blocked in communication, [`phalanx_comm::blocked_seconds`]) is more
//!   than `monitor.straggler_factor` × the median of its peers' (the ranks
//!   at the same pipeline stage) for
//!   `monitor.straggler_steps` steps in a row is reported by rank and host.
//!   It must also be [`MIN_GAP_S`] slower than that median: on steps of a
//!   millisecond, timer and scheduler noise passes any ratio.
//!   Compute time is what tells a slow rank apart: in a synchronous step
//!   every rank's wall time is the slowest one's, but only the slow rank
//!   spends it computing; the others spend it waiting. The first step of a
//!   run (warm-up: allocations, page faults) is not judged;
//! - **metrics**: with `monitor.prometheus_port` set, rank 0 serves every
//!   rank's latest figures at `http://HOST:PORT/metrics`
//!   ([`prometheus::Exporter`]).
//!
//! ```
//! use phalanx::monitor::{median, Figures};
//! assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
//! let f = Figures::default();
//! assert_eq!(Figures::from_slice(&f.to_vec()), f);
//! ```

pub mod http;
pub mod prometheus;

use crate::config::MonitorConfig;
use crate::error::Result;
use phalanx_comm::ProcessGroup;

/// One rank's figures after a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    pub step: usize,
    pub loss: f64,
    pub tokens_per_s: f64,
    pub step_s: f64,
    /// The step minus the time blocked in communication.
    pub compute_s: f64,
    pub grad_norm: f64,
    /// Bytes sent since the start of the run.
    pub comm_bytes_total: u64,
    /// fp16 only.
    pub loss_scale: Option<f64>,
    /// Model FLOPs utilisation, where the peak is known.
    pub mfu: Option<f64>,
    /// (kind, bytes): params, grads, optimizer, activations_peak,
    /// working_peak, peak_rss.
    pub memory: [(&'static str, u64); 6],
}

/// The memory kinds of [`Figures::memory`], in order.
pub const MEMORY_KINDS: [&str; 6] = [
    "params",
    "grads",
    "optimizer",
    "activations_peak",
    "working_peak",
    "peak_rss",
];

const WIDTH: usize = 9 + MEMORY_KINDS.len();

impl Figures {
    /// As f64s for the all-gather (an absent value is NaN).
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = vec![
            self.step as f64,
            self.loss,
            self.tokens_per_s,
            self.step_s,
            self.compute_s,
            self.grad_norm,
            self.comm_bytes_total as f64,
            self.loss_scale.unwrap_or(f64::NAN),
            self.mfu.unwrap_or(f64::NAN),
        ];
        v.extend(self.memory.iter().map(|m| m.1 as f64));
        v
    }

    pub fn from_slice(v: &[f64]) -> Figures {
        let opt = |x: f64| (!x.is_nan()).then_some(x);
        let memory = std::array::from_fn(|k| (MEMORY_KINDS[k], v[9 + k] as u64));
        Figures {
            step: v[0] as usize,
            loss: v[1],
            tokens_per_s: v[2],
            step_s: v[3],
            compute_s: v[4],
            grad_norm: v[5],
            comm_bytes_total: v[6] as u64,
            loss_scale: opt(v[7]),
            mfu: opt(v[8]),
            memory,
        }
    }
}

impl Default for Figures {
    fn default() -> Self {
        Figures {
            step: 0,
            loss: 0.0,
            tokens_per_s: 0.0,
            step_s: 0.0,
            compute_s: 0.0,
            grad_norm: 0.0,
            comm_bytes_total: 0,
            loss_scale: None,
            mfu: None,
            memory: std::array::from_fn(|k| (MEMORY_KINDS[k], 0)),
        }
    }
}

/// The median (the mean of the two middle values for an even count).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A rank reported as a straggler.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    pub rank: usize,
    pub host: String,
    /// Its compute time in the last step, and its peers' median.
    pub compute_s: f64,
    pub median_s: f64,
    /// Steps in a row it has been slow.
    pub steps: usize,
}

impl std::fmt::Display for Straggler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "straggler: rank {} on {} computed {:.3} s per step against its peers' median {:.3} s ({:.2}x) for {} steps in a row",
            self.rank,
            self.host,
            self.compute_s,
            self.median_s,
            self.compute_s / self.median_s.max(1e-12),
            self.steps
        )
    }
}

/// What the monitor saw after a step.
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// Every rank's figures, by global rank.
    pub ranks: Vec<Figures>,
    /// Ranks that are stragglers now.
    pub stragglers: Vec<usize>,
    /// Those that became stragglers at this step (to report once).
    pub new: Vec<Straggler>,
}

/// How much slower than its peers' median a rank must compute, besides
/// `monitor.straggler_factor` × it, to count as slow: 10 ms, so that noise
/// on sub-millisecond steps (0.0014 s against 0.0010 s) is not reported.
pub const MIN_GAP_S: f64 = 0.01;

/// Straggler detection over consecutive steps. Ranks are compared with
/// their peers only, the ranks that do the same work (a pipeline's stages
/// differ by design): `peers[r]` names rank r's group, and a rank alone in
/// its group is never judged.
#[derive(Debug, Clone)]
pub struct Detector {
    factor: f64,
    steps: usize,
    streak: Vec<usize>,
    peers: Vec<usize>,
}

impl Detector {
    pub fn new(peers: Vec<usize>, factor: f64, steps: usize) -> Detector {
        Detector {
            factor,
            steps: steps.max(1),
            streak: vec![0; peers.len()],
            peers,
        }
    }

    /// The median compute time of rank `r`'s peers (itself left out: with
    /// one peer, a rank of two counted in its own median would need to be
    /// 1.86x slower to pass 1.3x), or `None` when it has none.
    pub fn peer_median(&self, compute: &[f64], r: usize) -> Option<f64> {
        let others: Vec<f64> = (0..compute.len())
            .filter(|&q| q != r && self.peers[q] == self.peers[r])
            .map(|q| compute[q])
            .collect();
        (!others.is_empty()).then(|| median(&others))
    }

    /// Feed one step's compute times (by rank); returns (stragglers now,
    /// those new at this step) as ranks.
    pub fn feed(&mut self, compute: &[f64]) -> (Vec<usize>, Vec<usize>) {
        let (mut now, mut new) = (Vec::new(), Vec::new());
        for (r, &c) in compute.iter().enumerate() {
            let m = self.peer_median(compute, r).unwrap_or(0.0);
            let slow = m > 0.0 && c > self.factor * m && c - m >= MIN_GAP_S;
            self.streak[r] = if slow { self.streak[r] + 1 } else { 0 };
            if self.streak[r] >= self.steps {
                now.push(r);
                if self.streak[r] == self.steps {
                    new.push(r);
                }
            }
        }
        (now, new)
    }

    pub fn streak(&self, rank: usize) -> usize {
        self.streak[rank]
    }
}

/// Gathers figures, detects stragglers and feeds the exporter.
pub struct Monitor {
    world: ProcessGroup,
    hosts: Vec<String>,
    detector: Detector,
    exporter: Option<prometheus::Exporter>,
    /// Steps seen: the first (warm-up: allocation, page faults) is not
    /// judged.
    seen: usize,
}

/// This machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

impl Monitor {
    /// Collective over `world`: learns every rank's host and peer group
    /// (`group`: this rank's, e.g. its pipeline stage), and on global rank 0
    /// starts the exporter when `cfg.prometheus_port` is set (an address
    /// that cannot be bound is an error, before training starts).
    pub fn new(world: &ProcessGroup, group: usize, cfg: &MonitorConfig) -> Result<Monitor> {
        const HOST: usize = 64;
        // Host names travel as one i32 per byte (64 at most).
        let mut mine = [0i32; HOST];
        for (d, b) in mine.iter_mut().zip(hostname().bytes()) {
            *d = b as i32;
        }
        let mut all = vec![0i32; HOST * world.size()];
        world.all_gather(&mine, &mut all)?;
        let hosts = all
            .chunks(HOST)
            .map(|c| {
                let bytes: Vec<u8> = c
                    .iter()
                    .take_while(|&&b| b != 0)
                    .map(|&b| b as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .collect();
        let mut peers = vec![0i64; world.size()];
        world.all_gather(&[group as i64], &mut peers)?;
        let peers = peers.into_iter().map(|g| g as usize).collect();
        // Whether rank 0's exporter started is agreed, so a bind failure
        // stops every rank with rank 0's message.
        let mut exporter = None;
        let mut err = None;
        if world.rank() == 0 && cfg.prometheus_port != 0 {
            match prometheus::Exporter::start(&cfg.prometheus_host, cfg.prometheus_port) {
                Ok(e) => exporter = Some(e),
                Err(e) => err = Some(e),
            }
        }
        let mut failed = [err.is_some() as i32];
        world.all_reduce(&mut failed, phalanx_comm::ReduceOp::Max)?;
        if let Some(e) = err {
            return Err(e);
        }
        if failed[0] != 0 {
            return Err(crate::error::Error::Check(
                "rank 0 could not start the Prometheus exporter (monitor.prometheus_port)".into(),
            ));
        }
        Ok(Monitor {
            world: world.clone(),
            hosts,
            detector: Detector::new(peers, cfg.straggler_factor, cfg.straggler_steps),
            exporter,
            seen: 0,
        })
    }

    /// Where the exporter serves, on rank 0 when it runs.
    pub fn metrics_url(&self) -> Option<String> {
        self.exporter.as_ref().map(|e| e.url())
    }

    /// Collective over the world, after every step.
    pub fn after_step(&mut self, mine: &Figures) -> Result<Health> {
        let v = mine.to_vec();
        let mut all = vec![0f64; WIDTH * self.world.size()];
        self.world.all_gather(&v, &mut all)?;
        let ranks: Vec<Figures> = all.chunks(WIDTH).map(Figures::from_slice).collect();
        let compute: Vec<f64> = ranks.iter().map(|f| f.compute_s).collect();
        self.seen += 1;
        let (stragglers, new) = if self.seen > 1 {
            self.detector.feed(&compute)
        } else {
            (Vec::new(), Vec::new())
        };
        let new = new
            .into_iter()
            .map(|r| Straggler {
                rank: r,
                host: self.hosts[r].clone(),
                compute_s: compute[r],
                median_s: self.detector.peer_median(&compute, r).unwrap_or(0.0),
                steps: self.detector.streak(r),
            })
            .collect();
        if let Some(e) = &self.exporter {
            e.update(&ranks, &self.hosts, &stragglers);
        }
        Ok(Health {
            ranks,
            stragglers,
            new,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_slow_for_enough_steps_in_a_row_is_reported_once() {
        let mut d = Detector::new(vec![0; 4], 1.3, 3);
        let fast = [1.0, 1.0, 1.1, 1.0];
        let slow = [1.0, 2.0, 1.1, 1.0];
        assert_eq!(d.feed(&slow), (vec![], vec![]));
        assert_eq!(d.feed(&slow), (vec![], vec![]));
        assert_eq!(d.feed(&slow), (vec![1], vec![1]));
        assert_eq!(d.feed(&slow), (vec![1], vec![]), "reported once");
        assert_eq!(d.feed(&fast), (vec![], vec![]), "recovered");
        // A streak broken by one fast step starts again.
        d.feed(&slow);
        d.feed(&slow);
        d.feed(&fast);
        assert_eq!(d.feed(&slow), (vec![], vec![]));
    }

    #[test]
    fn ranks_are_judged_against_their_peers_only() {
        // Two pipeline stages of two ranks each: stage 1 is slower by
        // design; rank 3 is slow among its peers.
        let mut d = Detector::new(vec![0, 0, 1, 1], 1.3, 1);
        assert_eq!(d.feed(&[1.0, 1.0, 3.0, 3.1]), (vec![], vec![]));
        assert_eq!(d.feed(&[1.0, 1.0, 3.0, 7.0]), (vec![3], vec![3]));
        // Alone in its group, a rank is never judged.
        let mut d = Detector::new(vec![0, 1], 1.3, 1);
        assert_eq!(d.feed(&[1.0, 9.0]), (vec![], vec![]));
        // With one peer, 1.5x its peer is past 1.3x (a median counting the
        // rank itself, 1.25, would not have judged it).
        let mut d = Detector::new(vec![0, 0], 1.3, 1);
        assert_eq!(d.feed(&[1.0, 1.5]), (vec![1], vec![1]));
        assert_eq!(d.peer_median(&[1.0, 1.5], 1), Some(1.0));
    }

    #[test]
    fn noise_on_sub_millisecond_steps_is_not_a_straggler() {
        // 1.4x its peer, but only 0.4 ms slower: timer noise.
        let mut d = Detector::new(vec![0, 0], 1.3, 1);
        assert_eq!(d.feed(&[0.0010, 0.0014]), (vec![], vec![]));
        // A 16 ms step, 12 ms slower than its peer's 4 ms, is one.
        assert_eq!(d.feed(&[0.004, 0.016]), (vec![1], vec![1]));
        // 20 % slower on 10 ms steps: under the ratio, as before.
        let mut d = Detector::new(vec![0, 0], 1.3, 1);
        assert_eq!(d.feed(&[0.010, 0.012]), (vec![], vec![]));
    }
}
