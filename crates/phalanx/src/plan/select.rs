//! Enumerate the layouts of a job, rank them, explain the choice.
//!
//! Every `dp × tp × pp = world` with tp inside a node and one the model's
//! blocks were declared for ([`ModelShape::tp_ok`]: its heads, and for
//! Llama also the MLP width and the kv heads, split or replicated,
//! divide), pp no deeper than the layers; ZeRO stages 0-3 on the dp axis
//! (≤ 1 with a pipeline, as the strategies compose), fp32 and bf16
//! compute, activation checkpointing off and on, optimizer offload for
//! sharded stages. Layouts that fit rank first, fastest first; the others
//! follow, smallest first.
//!
//! The explanation follows the seed's table: fits on one device → DDP;
//! model states do not fit → ZeRO / FSDP; one layer's matrices too large →
//! tensor parallel; too deep → pipeline; activations too large →
//! activation checkpointing.
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx::plan::{select, Declarations, Hardware, Layout, ModelShape, Param};
//! // A small model whose blocks declare a table and a column-parallel matrix
//! // on 1 or 2 ranks.
//! let params = Declarations::uniform(
//!     &[1, 2],
//!     vec![Param::new("wte", &[256, 384], Placement::vocab(256))],
//!     vec![Param::new("fc", &[1536, 384], Placement::rows())],
//!     vec![],
//! );
//! let m = ModelShape::gpt2(6, 6, 384, 256, 256).with_params(params);
//! let hw = Hardware::new(2, 1, 64 << 30, 100e9, 1e9);
//! let ranked = select::rank(&select::enumerate(&m, &hw, &Layout::ddp(2, 8, 1)), &m, &hw);
//! let best = &ranked[0].layout;
//! assert_eq!((best.dp, best.tp, best.pp, best.zero_stage), (2, 1, 1, 0)); // it fits: DDP
//! ```

use super::{estimate, estimate_with_data, Estimate, Hardware, Layout, ModelShape, Precision};

/// What decides the recommended layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bottleneck {
    Parameters,
    OptimizerState,
    Activations,
    Compute,
    Communication,
}

impl std::fmt::Display for Bottleneck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bottleneck::Parameters => "parameters",
            Bottleneck::OptimizerState => "optimizer state",
            Bottleneck::Activations => "activations",
            Bottleneck::Compute => "compute",
            Bottleneck::Communication => "communication",
        })
    }
}

/// A ranked layout.
pub type Candidate = Estimate;

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `hw.world()` ranks; batch, optimizer and reduce-dtype
/// settings come from `base` (its `grad_accum` is kept, or derived from
/// `base.global_batch()` when dp changes: the global batch stays fixed).
pub fn enumerate(m: &ModelShape, hw: &Hardware, base: &Layout) -> Vec<Layout> {
    let world = hw.world().max(1);
    let global = base.global_batch().max(1);
    let mut out = Vec::new();
    for tp in divisors(hw.nproc.max(1)) {
        if !m.tp_ok(tp) {
            continue;
        }
        for pp in divisors(world / tp) {
            if pp > m.n_layer.max(1) {
                continue;
            }
            let dp = world / (tp * pp);
            // Keep the global batch: micro fixed, accum derived where it
            // divides, else micro derived with accum fixed.
            let (micro, accum) = if global.is_multiple_of(base.micro_batch * dp) {
                (base.micro_batch, global / (base.micro_batch * dp))
            } else if global.is_multiple_of(dp * base.grad_accum) {
                (global / (dp * base.grad_accum), base.grad_accum)
            } else {
                continue;
            };
            let stages: &[u8] = match (dp, pp) {
                (1, _) => &[0],
                (_, 1) => &[0, 1, 2, 3],
                _ => &[0, 1],
            };
            for &stage in stages {
                for precision in [Precision::Fp32, Precision::Bf16] {
                    for ckpt in [false, true] {
                        if stage == 3 && !ckpt && !Layout::zero3_keeps_for(m, tp) {
                            continue; // this model's ZeRO-3 recomputes anyway
                        }
                        for offload in [false, true] {
                            if offload && stage == 0 {
                                continue;
                            }
                            out.push(Layout {
                                dp,
                                tp,
                                pp,
                                zero_stage: stage,
                                precision,
                                activation_checkpointing: ckpt,
                                offload_optimizer: offload,
                                micro_batch: micro,
                                grad_accum: accum,
                                ..*base
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Estimate every layout and sort: fitting ones by step time (then peak
/// memory), then the rest by peak memory.
pub fn rank(layouts: &[Layout], m: &ModelShape, hw: &Hardware) -> Vec<Candidate> {
    sort(layouts.iter().map(|l| estimate(m, l, hw)).collect())
}

/// Sort estimates as [`rank`] does (after adjusting them): step times
/// within 1% of each other count as equal, and then the simpler layout
/// wins (the seed's order: DDP, then ZeRO stages, tensor parallel,
/// pipeline, checkpointing, offload), then the smaller.
pub fn sort(mut v: Vec<Candidate>) -> Vec<Candidate> {
    let bucket = |c: &Candidate| (c.step_seconds.max(1e-12).ln() / 1.01f64.ln()).round() as i64;
    let complexity = |l: &Layout| {
        (l.zero_stage as usize)
            + 4 * (l.tp > 1) as usize
            + 4 * (l.pp > 1) as usize
            + 2 * l.activation_checkpointing as usize
            + 3 * l.offload_optimizer as usize
            + (l.precision != Precision::Fp32) as usize
    };
    v.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then_with(|| {
            if a.fits {
                bucket(a)
                    .cmp(&bucket(b))
                    .then(complexity(&a.layout).cmp(&complexity(&b.layout)))
                    .then(a.memory.total().cmp(&b.memory.total()))
            } else {
                a.memory.total().cmp(&b.memory.total())
            }
        })
    });
    v
}

/// The plain layout the seed's table starts from: DDP over every rank,
/// the same precision and batch, no checkpointing, no offload.
pub fn plain_ddp(best: &Layout, hw: &Hardware) -> Layout {
    let world = hw.world().max(1);
    let global = best.global_batch();
    let accum = (global / (best.micro_batch * world)).max(1);
    Layout {
        dp: world,
        tp: 1,
        pp: 1,
        zero_stage: 0,
        activation_checkpointing: false,
        offload_optimizer: false,
        grad_accum: accum,
        ..*best
    }
}

/// Why DDP alone does not do, as the largest memory term of the plain
/// layout, or, when it fits, what bounds its step time.
pub fn bottleneck(m: &ModelShape, best: &Candidate, hw: &Hardware) -> Bottleneck {
    bottleneck_with_data(m, best, hw, 0)
}

/// [`bottleneck`] with `data_tokens` tokens of training data held by every
/// rank, as the candidates counted them ([`estimate_with_data`]).
pub fn bottleneck_with_data(
    m: &ModelShape,
    best: &Candidate,
    hw: &Hardware,
    data_tokens: u64,
) -> Bottleneck {
    let ddp = estimate_with_data(m, &plain_ddp(&best.layout, hw), hw, data_tokens);
    if !ddp.fits {
        let e = &ddp.memory;
        let terms = [
            (e.params + e.grads + e.working, Bottleneck::Parameters),
            (e.optimizer, Bottleneck::OptimizerState),
            (e.activations, Bottleneck::Activations),
        ];
        return terms.iter().max_by_key(|t| t.0).unwrap().1;
    }
    if best.step_seconds - best.compute_seconds > best.compute_seconds {
        Bottleneck::Communication
    } else {
        Bottleneck::Compute
    }
}

/// A paragraph on the recommended layout (the first of `ranked`).
pub fn explain(m: &ModelShape, ranked: &[Candidate], hw: &Hardware) -> String {
    explain_with_data(m, ranked, hw, 0)
}

/// [`explain`] for candidates that count `data_tokens` tokens of training
/// data held by every rank: plain DDP is judged with them too, so the
/// paragraph agrees with the table.
pub fn explain_with_data(
    m: &ModelShape,
    ranked: &[Candidate],
    hw: &Hardware,
    data_tokens: u64,
) -> String {
    use super::human_bytes as h;
    let Some(best) = ranked.first() else {
        return "no layout of this job exists (check --nproc / --nnodes against the model's heads and layers)".into();
    };
    let dev = h(hw.device_memory);
    if !best.fits {
        return format!(
            "no layout fits in {dev} per rank; the smallest, {}, needs {} per rank. Add ranks, shorten the micro-batch or the sequence, or offload.",
            best.layout.name(),
            h(best.memory.total())
        );
    }
    let l = &best.layout;
    let ddp = estimate_with_data(m, &plain_ddp(l, hw), hw, data_tokens);
    let e = &ddp.memory;
    let why = bottleneck_with_data(m, best, hw, data_tokens);
    let mut s = String::new();
    if ddp.fits {
        s += &format!(
            "Plain DDP fits ({} of {dev} per rank)",
            h(ddp.memory.total())
        );
    } else {
        s += &format!(
            "Plain DDP over {} ranks would need {} per rank, more than {dev}: parameters + gradients {}, optimizer state {}, activations {}; the largest is {why}",
            hw.world(),
            h(e.total()),
            h(e.params + e.grads + e.working),
            h(e.optimizer),
            h(e.activations)
        );
    }
    let mut moves = Vec::new();
    if l.zero_stage > 0 {
        moves.push(format!(
            "ZeRO-{} shards {} over the {} data-parallel ranks",
            l.zero_stage,
            match l.zero_stage {
                1 => "the optimizer state",
                2 => "gradients and optimizer state",
                _ => "parameters, gradients and optimizer state",
            },
            l.dp
        ));
    }
    if l.tp > 1 {
        let layer = m.layer_params() as u64 * 16;
        moves.push(format!(
            "tensor parallel {} splits each layer's matrices ({} of model states per layer)",
            l.tp,
            h(layer)
        ));
    }
    if l.pp > 1 {
        moves.push(format!(
            "a {}-stage pipeline splits the {} layers (bubble (p-1)/(m+p-1) = {:.2})",
            l.pp,
            m.n_layer,
            (l.pp - 1) as f64 / (l.grad_accum + l.pp - 1) as f64
        ));
    }
    if l.activation_checkpointing {
        moves.push("activation checkpointing keeps only each block's input".into());
    }
    if l.offload_optimizer {
        moves.push("the optimizer state is offloaded to files".into());
    }
    if l.precision != Precision::Fp32 {
        moves.push(format!("{} compute halves activations", l.precision));
    }
    if !moves.is_empty() {
        s += &format!("; {}", moves.join("; "));
    }
    let exposed = best.step_seconds - best.compute_seconds;
    s += &format!(
        ". Recommended: {} at {} per rank, est. {:.3} s/step, bound by {} (compute {:.3} s, communication {:.3} s of which {:.3} s not overlapped).",
        l.name(),
        h(best.memory.total()),
        best.step_seconds,
        if exposed > best.compute_seconds {
            "communication"
        } else {
            "compute"
        },
        best.compute_seconds,
        best.comm_seconds,
        exposed
    );
    s
}
