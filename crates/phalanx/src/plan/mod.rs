//! The planner behind `phalanx plan`: for a model shape, a batch and the
//! hardware, predict per rank the memory (parameters, gradients, optimizer
//! state, activations, working copies, communication buffers, a runtime
//! overhead), the bytes communicated per step and the step time of every
//! layout (dp × tp × pp, ZeRO stage, precision, activation checkpointing,
//! optimizer offload), then rank them and say which resource decides.
//!
//! - [`memory`]: the memory calculator (also the model-states-only
//!   calculator of DeepSpeed's `estimate_zero*_model_states_mem_needs`);
//! - [`comm`]: bytes each rank sends per step, from how the strategies
//!   communicate;
//! - [`probe`]: a quick matmul-throughput and link-bandwidth probe;
//! - [`select`]: enumeration, ranking and the explanation;
//! - [`params`]: the parameters as the model's blocks declare them (whole
//!   shapes and placements at each tp size): every per-rank parameter
//!   count comes from them;
//! - [`shape`]: the model (GPT-2 or Llama family): its declared
//!   parameters, activations per token, FLOPs per token.
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx::plan::{estimate, Declarations, Hardware, Layout, ModelShape, Param};
//! // What the blocks of a 6-layer, 384-wide model declare (a model family
//! // records them from its blocks: `phalanx_models::family::plan_shape`):
//! // a token table the head is tied to, and a layer of two matrices and a norm.
//! let wte = Param::new("wte", &[256, 384], Placement::vocab(256));
//! let layer = vec![
//!     Param::new("fc", &[1536, 384], Placement::rows()),
//!     Param::new("proj", &[384, 1536], Placement::cols()),
//!     Param::new("ln", &[384], Placement::Replicate),
//! ];
//! let params = Declarations::uniform(&[1, 2], vec![wte.clone()], layer, vec![wte]);
//! let m = ModelShape::gpt2(6, 6, 384, 256, 256).with_params(params);
//! let n = 256 * 384 + 6 * (2 * 1536 * 384 + 384);
//! assert_eq!(m.num_params(), n);
//! let hw = Hardware::new(2, 1, 64 << 30, 100e9, 1e9);
//! let e = estimate(&m, &Layout::ddp(2, 8, 1), &hw);
//! assert_eq!(e.memory.params, 4 * n as u64);
//! assert_eq!(e.comm_bytes_per_step, 4 * n as u64); // ring all-reduce, 2 ranks
//! // On 2 tensor-parallel ranks each holds half the matrices, the norm whole.
//! let mut tp = Layout::ddp(1, 8, 1);
//! tp.tp = 2;
//! let half = 128 * 384 + 6 * (1536 * 384 + 384);
//! assert_eq!(estimate(&m, &tp, &hw).memory.params, 4 * half as u64);
//! ```

pub mod comm;
pub mod memory;
pub mod params;
pub mod probe;
pub mod select;
pub mod shape;

pub use crate::config::Precision;
pub use memory::{model_states, MemoryEstimate, ModelStates};
pub use params::{BlockParams, Declarations, Declared, Param};
pub use probe::{probe_bandwidth, probe_matmul_flops};
pub use select::{enumerate, explain, rank, Bottleneck, Candidate};
pub use shape::{model_flops_per_token, Family, ModelShape};

/// One way to run the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// ZeRO stage 0 (DDP) - 3 (FULL_SHARD).
    pub zero_stage: u8,
    /// Compute dtype (master weights, gradients and optimizer state stay f32).
    pub precision: Precision,
    /// Recompute every block in its backward (see [`Layout::recomputes`]
    /// for ZeRO-3).
    pub activation_checkpointing: bool,
    /// Optimizer state streamed from files (`offload_optimizer.device = nvme`).
    pub offload_optimizer: bool,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// Pipeline schedule: `true` for GPipe (all micro-batches in flight),
    /// `false` for 1F1B.
    pub gpipe: bool,
    /// Bytes of optimizer state per parameter (8: AdamW; 4: SGD momentum).
    pub optim_bytes_per_param: usize,
    /// Bytes per element gradients travel in (`train.reduce_dtype`).
    pub reduce_bytes: usize,
}

impl Layout {
    /// Plain DDP over `dp` ranks, fp32, AdamW.
    pub fn ddp(dp: usize, micro_batch: usize, grad_accum: usize) -> Layout {
        Layout {
            dp,
            tp: 1,
            pp: 1,
            zero_stage: 0,
            precision: Precision::Fp32,
            activation_checkpointing: false,
            offload_optimizer: false,
            micro_batch,
            grad_accum,
            gpipe: false,
            optim_bytes_per_param: 8,
            reduce_bytes: 4,
        }
    }

    /// The layout a training config asks for on `world` ranks: its
    /// parallel sizes, stage, precision, checkpointing, offload, optimizer
    /// and reduce dtype; the batch checked, or derived from
    /// `train.global_batch_size`, for its dp size.
    pub fn from_config(
        cfg: &crate::config::TrainConfig,
        world: usize,
    ) -> Result<Layout, crate::config::ConfigError> {
        use crate::config::{OffloadDevice, OptimName, Recompute};
        let dp = cfg.dp_for_world(world)?;
        let (micro, accum) = cfg.batch_for_dp(dp)?;
        Ok(Layout {
            dp,
            tp: cfg.parallel.tp,
            pp: cfg.parallel.pp,
            zero_stage: cfg.sharding()?.stage,
            precision: cfg.precision(),
            activation_checkpointing: cfg.recompute() != Recompute::None,
            offload_optimizer: cfg.zero_optimization.offload_optimizer.device
                == OffloadDevice::Nvme,
            micro_batch: micro,
            grad_accum: accum,
            gpipe: cfg.parallel.pp_schedule.to_string() == "gpipe",
            optim_bytes_per_param: match cfg.optim.name {
                OptimName::Sgd if cfg.optim.momentum == 0.0 => 0,
                OptimName::Sgd => 4,
                _ => 8,
            },
            reduce_bytes: match cfg.train.reduce_dtype {
                Precision::Fp32 => 4,
                _ => 2,
            },
        })
    }

    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// Samples per optimizer step: micro × dp × accum.
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.dp * self.grad_accum
    }

    /// Whether blocks are recomputed in backward: with activation
    /// checkpointing, and under ZeRO-3 unless the model's layers keep their
    /// activations there (the GPT-2 and Llama direct layers, which let
    /// go of their gathered parameters and take them back for the backward).
    pub fn recomputes(&self, m: &ModelShape) -> bool {
        self.activation_checkpointing || (self.zero_stage == 3 && !self.zero3_keeps(m))
    }

    /// Whether ZeRO-3 keeps the layers' activations for this model: the
    /// direct layers (GPT-2's, Llama's and so Qwen2's), which run without
    /// tensor parallelism in any precision.
    pub fn zero3_keeps(&self, m: &ModelShape) -> bool {
        Layout::zero3_keeps_for(m, self.tp)
    }

    /// [`Layout::zero3_keeps`] before a layout is built.
    pub fn zero3_keeps_for(m: &ModelShape, tp: usize) -> bool {
        matches!(m.family, shape::Family::Gpt2 | shape::Family::Llama) && tp == 1
    }

    /// Bytes of one element of the compute dtype.
    pub fn compute_bytes(&self) -> usize {
        match self.precision {
            Precision::Fp32 => 4,
            _ => 2,
        }
    }

    /// A short name: `dp2 tp1 pp1 zero3 fp32 ckpt`.
    pub fn name(&self) -> String {
        format!(
            "dp{} tp{} pp{} zero{} {}{}{}",
            self.dp,
            self.tp,
            self.pp,
            self.zero_stage,
            self.precision,
            if self.activation_checkpointing {
                " ckpt"
            } else {
                ""
            },
            if self.offload_optimizer {
                " offload"
            } else {
                ""
            }
        )
    }
}

/// The machines: ranks, memory per rank, compute and link speeds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hardware {
    /// Ranks per node.
    pub nproc: usize,
    pub nnodes: usize,
    /// Memory one rank may use (bytes).
    pub device_memory: u64,
    /// Matmul throughput of one rank (FLOP/s).
    pub flops: f64,
    /// Bytes per second one rank sends to a peer on its node.
    pub intra_bw: f64,
    /// Bytes per second across nodes.
    pub inter_bw: f64,
}

impl Hardware {
    pub fn new(nproc: usize, nnodes: usize, device_memory: u64, flops: f64, bw: f64) -> Self {
        Hardware {
            nproc,
            nnodes,
            device_memory,
            flops,
            intra_bw: bw,
            inter_bw: bw,
        }
    }

    pub fn world(&self) -> usize {
        self.nproc * self.nnodes
    }
}

/// Everything predicted for one layout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub layout: Layout,
    /// The most loaded rank's memory.
    pub memory: MemoryEstimate,
    /// Bytes rank 0 sends per step (as `comm_bytes` in the JSON log).
    pub comm_bytes_per_step: u64,
    pub compute_seconds: f64,
    pub comm_seconds: f64,
    /// compute (with recomputation and the pipeline bubble) + the part of
    /// communication that does not overlap it.
    pub step_seconds: f64,
    pub fits: bool,
}

/// Predict one layout on `hw`; `l.tp` is a size the model's blocks were
/// declared for ([`ModelShape::tp_ok`]; others panic).
pub fn estimate(m: &ModelShape, l: &Layout, hw: &Hardware) -> Estimate {
    estimate_with_data(m, l, hw, 0)
}

/// [`estimate`] with `data_tokens` tokens of training data held by every
/// rank ([`memory::per_rank_with_data`]).
pub fn estimate_with_data(m: &ModelShape, l: &Layout, hw: &Hardware, data_tokens: u64) -> Estimate {
    let memory = memory::per_rank_with_data(m, l, data_tokens);
    let (tp_bytes, rest) = comm::bytes_per_step_parts(m, l);
    let comm_bytes = tp_bytes + rest;
    let (compute_seconds, comm_seconds, step_seconds) = step_time(m, l, hw, tp_bytes, rest);
    Estimate {
        layout: *l,
        memory,
        comm_bytes_per_step: comm_bytes,
        compute_seconds,
        comm_seconds,
        step_seconds,
        fits: memory.total() <= hw.device_memory,
    }
}

/// (compute, communication, step) seconds.
fn step_time(
    m: &ModelShape,
    l: &Layout,
    hw: &Hardware,
    tp_bytes: u64,
    rest: u64,
) -> (f64, f64, f64) {
    let tokens = (l.global_batch() * m.seq_len) as f64;
    // Forward is a third of the 6N: recomputation adds one more forward.
    let recompute = if l.recomputes(m) { 4.0 / 3.0 } else { 1.0 };
    let world = l.world().max(1) as f64;
    let work = tokens * model_flops_per_token(m) * recompute / world;
    let m_micro = l.grad_accum.max(1) as f64;
    let bubble = if l.pp > 1 {
        (m_micro + l.pp as f64 - 1.0) / m_micro
    } else {
        1.0
    };
    // Offloaded optimizer state is read and written back every step,
    // at an assumed 2 GB/s of NVMe.
    let offload = if l.offload_optimizer {
        let s = memory::model_states(
            m.num_params() as u64 / (l.tp * l.pp).max(1) as u64,
            l.dp,
            l.zero_stage,
            4,
            4,
            l.optim_bytes_per_param as u64,
        );
        2.0 * s.optimizer as f64 / 2e9
    } else {
        0.0
    };
    let compute = work / hw.flops.max(1.0) * bubble + offload;
    // Data-parallel and pipeline traffic crosses nodes when the job does;
    // the tp axis, innermost, stays inside a node when it fits in one.
    let bw = if hw.nnodes > 1 {
        hw.inter_bw
    } else {
        hw.intra_bw
    };
    let tp_bw = if l.tp <= hw.nproc { hw.intra_bw } else { bw };
    let comm = rest as f64 / bw.max(1.0) + tp_bytes as f64 / tp_bw.max(1.0);
    // Gradient reduction overlaps backward (two thirds of compute); tensor
    // parallel collectives and ZeRO-3 gathers sit on the critical path in
    // part: count what exceeds the overlappable window.
    let window = if l.tp > 1 { 0.0 } else { compute * 2.0 / 3.0 };
    let exposed = (comm - window).max(0.0) + comm.min(window) * 0.1;
    (compute, comm, compute + exposed)
}

/// The most parameters [`parse_count`] takes: far beyond any model, and
/// small enough that every byte count of it fits in a `u64`.
pub const MAX_PARAMS: u64 = 1_000_000_000_000_000;

/// Parse a parameter count: `7B`, `1.3b`, `350M`, `125m`, `20k`, `1e9`,
/// `7000000`; at least 1 (after rounding) and at most [`MAX_PARAMS`].
pub fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || {
        format!("cannot read the parameter count {s:?}: write a number with an optional suffix K, M, B or T (e.g. 7B, 350M, 1.3e9)")
    };
    if t.is_empty() {
        return Err(bad());
    }
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') | Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("the parameter count {s:?} must be positive"));
    }
    let n = (v * mult).round();
    if n > MAX_PARAMS as f64 {
        return Err(format!(
            "the parameter count {s:?} is more than the planner counts (at most 1e15, 1000T)"
        ));
    }
    if n < 1.0 {
        return Err(format!("the parameter count {s:?} rounds to 0 parameters"));
    }
    Ok(n as u64)
}

/// Bytes written for people: `1.50 GiB`.
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// Parse a memory size: `16GiB`, `16G`, `512MB`, `1e9`, `80GB` (`K`, `M`,
/// `G`, `T` alone are binary, as `free -h` and Slurm's `--mem` read them;
/// a bare number is bytes); at least 1 MiB, at most 1 EiB.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let bad = || {
        format!("cannot read the memory size {s:?}: write e.g. 16GiB, 512MiB, 80GB or a number of bytes")
    };
    let units: [(&str, f64); 19] = [
        ("kib", 1024.0),
        ("mib", 1048576.0),
        ("gib", 1073741824.0),
        ("tib", 1099511627776.0),
        ("pib", 1125899906842624.0),
        ("eib", 1152921504606846976.0),
        ("kb", 1e3),
        ("mb", 1e6),
        ("gb", 1e9),
        ("tb", 1e12),
        ("pb", 1e15),
        ("eb", 1e18),
        ("k", 1024.0),
        ("m", 1048576.0),
        ("g", 1073741824.0),
        ("t", 1099511627776.0),
        ("p", 1125899906842624.0),
        ("e", 1152921504606846976.0),
        ("b", 1.0),
    ];
    let (num, mult) = units
        .iter()
        .find(|(u, _)| lower.ends_with(u))
        .map(|(u, m)| (&t[..t.len() - u.len()], *m))
        .unwrap_or((t, 1.0));
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    let bytes = v * mult;
    if !(1048576.0..=1152921504606846976.0).contains(&bytes) {
        let side = if bytes < 1048576.0 {
            "below 1MiB"
        } else {
            "above 1EiB"
        };
        return Err(format!(
            "the memory size {s:?} is {side}: give between 1MiB and 1EiB (a bare number is bytes)"
        ));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_sizes_parse() {
        assert_eq!(parse_count("7B").unwrap(), 7_000_000_000);
        assert_eq!(parse_count("1.3b").unwrap(), 1_300_000_000);
        assert_eq!(parse_count("350M").unwrap(), 350_000_000);
        assert_eq!(parse_count("12345").unwrap(), 12345);
        assert!(parse_count("7Q").unwrap_err().contains("7Q"));
        assert!(parse_count("-3B").is_err());
        assert_eq!(parse_count("1e15").unwrap(), MAX_PARAMS);
        assert_eq!(parse_count("1000T").unwrap(), MAX_PARAMS);
        for big in ["1.1e15", "2e18", "1e30", "20000T"] {
            assert!(parse_count(big).unwrap_err().contains(big), "{big}");
        }
        for zero in ["0.4", "0.0001K"] {
            assert!(
                parse_count(zero).unwrap_err().contains("rounds to 0"),
                "{zero}"
            );
        }
        assert_eq!(parse_count("0.5").unwrap(), 1);
        assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("16K").unwrap_err().contains("1MiB"));
        assert_eq!(parse_bytes("1T").unwrap(), 1 << 40);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert!(parse_bytes("2048B").unwrap_err().contains("1MiB"));
        for bad in ["0.5", "1e30", "-1G"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        // The bounds the message gives are sizes it reads.
        assert!(parse_bytes("0").unwrap_err().contains("below 1MiB"));
        assert_eq!(parse_bytes("1EiB").unwrap(), 1 << 60);
        assert_eq!(parse_bytes("2PiB").unwrap(), 2 << 50);
        assert!(parse_bytes("2EiB").unwrap_err().contains("above 1EiB"));
    }
}
