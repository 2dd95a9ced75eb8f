//! Bytes a rank sends per optimizer step, derived from how the strategies
//! communicate (as `comm_bytes` in the JSON log counts them: rank 0's
//! payload bytes, all groups together).
//!
//! Ring collectives over `N` ranks: all-reduce sends `2(N-1)/N` of the
//! message per rank, reduce-scatter and all-gather `(N-1)/N` each; small
//! all-reduces (tensor parallel's activations) go by recursive doubling
//! ([`all_reduce_bytes`]). Per step,
//! with `Ψ` parameters on the rank's model shard, `m` micro-batches,
//! `g` / `c` bytes per element of reduced gradients / compute dtype:
//!
//! | strategy | per step |
//! |---|---|
//! | DDP | all-reduce of the gradients once (accumulation does not communicate): `2(N-1)/N Ψ g` |
//! | ZeRO-1 | the same all-reduce, then an all-gather of the updated f32 parameters: `+ (N-1)/N Ψ 4` |
//! | ZeRO-2 | reduce-scatter every micro-step `m (N-1)/N Ψ g`, all-gather `(N-1)/N Ψ 4` |
//! | ZeRO-3 | every micro-step: all-gather of each block before its forward and again before its backward (`2 (N-1)/N Ψ c`; the head gathers the tied embedding's unit again, twice), reduce-scatter `(N-1)/N Ψ g` |
//! | tensor parallel `t` | every micro-step, all-reduces of `BTC` activations: 2 per layer forward (attention and MLP outputs), 2 per layer backward, 1 each for the vocabulary-parallel embedding and head, `(4L + 2) 2(t-1)/t BTC c` (`log2 t BTC c` each below the small-message size, except when tp spans the world: the world group all-reduces in place in shared memory, counted as the ring share), plus the vocabulary-parallel cross-entropy's 3 `BT` f32 vectors; recomputation repeats the forward ones; Llama's replicated kv heads (t > n_kv_head) add the k and v output gradients in backward, `2L 2(t-1)/t BT KV c` |
//! | pipeline `p` | stage 0 sends each micro-batch's output `BTC c` forward; a tied embedding's gradient is all-reduced between the first and last stages `V C 4` |
//!
//! Scalars (loss, norm, non-finite flags) add a few bytes.
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx::plan::{comm::bytes_per_step, Declarations, Layout, ModelShape, Param};
//! // A model whose blocks declare a table and a layer of one matrix.
//! let params = Declarations::uniform(
//!     &[1],
//!     vec![Param::new("wte", &[256, 384], Placement::vocab(256))],
//!     vec![Param::new("fc", &[1536, 384], Placement::rows())],
//!     vec![],
//! );
//! let m = ModelShape::gpt2(6, 6, 384, 256, 256).with_params(params);
//! let psi = m.num_params() as u64;
//! let mut l = Layout::ddp(2, 8, 1);
//! assert_eq!(bytes_per_step(&m, &l), 4 * psi);
//! l.zero_stage = 1;
//! assert_eq!(bytes_per_step(&m, &l), 4 * psi + 2 * psi);
//! ```

use super::{memory, Layout, ModelShape};

/// All-reduce: `2(N-1)/N` of the message.
pub fn all_reduce_factor(n: usize) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n - 1) as f64 / n as f64
    }
}

/// Bytes rank 0 sends all-reducing one message of `bytes` over `n` ranks,
/// with the algorithm `phalanx_comm` picks by default: recursive doubling
/// up to its small-message size (2 MiB on 2 ranks, 128 KiB on more;
/// `PHALANX_RD_MAX_BYTES` is not read here), which sends the whole message
/// log2 n times when n is a power of two (otherwise rank 0 hands it to its
/// partner once), and the ring above it (`2(N-1)/N`). On 2 ranks both send
/// the message once.
pub fn all_reduce_bytes(n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let small = if n == 2 { 2 << 20 } else { 128 << 10 };
    if bytes <= small as f64 {
        if n.is_power_of_two() {
            n.trailing_zeros() as f64 * bytes
        } else {
            bytes
        }
    } else {
        all_reduce_factor(n) * bytes
    }
}

/// All-gather or reduce-scatter: `(N-1)/N` of the (whole) message.
pub fn gather_factor(n: usize) -> f64 {
    if n <= 1 {
        0.0
    } else {
        (n - 1) as f64 / n as f64
    }
}

/// Parameters of stage 0's model shard, and of its embedding, by the
/// declared placements (see [`memory::per_rank`]).
fn local_params(m: &ModelShape, l: &Layout) -> (u64, u64) {
    let p = m.rank_params(l.tp);
    let head_p = if l.pp <= 1 { p.head } else { 0 };
    let layers = memory::stage_layers(m, l.pp, 0);
    (
        (layers * p.layer + p.embedding + head_p) as u64,
        p.embedding as u64,
    )
}

/// Bytes rank 0 sends per optimizer step.
pub fn bytes_per_step(m: &ModelShape, l: &Layout) -> u64 {
    let (tp, rest) = bytes_per_step_parts(m, l);
    tp + rest
}

/// [`bytes_per_step`] as (tensor-parallel bytes, the rest): the tp axis is
/// the innermost, inside a node, where the rest may cross nodes.
pub fn bytes_per_step_parts(m: &ModelShape, l: &Layout) -> (u64, u64) {
    let (psi, emb) = local_params(m, l);
    let n = l.dp.max(1);
    let accum = l.grad_accum.max(1) as f64;
    let g = l.reduce_bytes as f64;
    let c = l.compute_bytes() as f64;
    let psi_f = psi as f64;
    let mut bytes = 0.0;
    let mut tp_bytes = 0.0;
    if n > 1 {
        bytes += match l.zero_stage {
            0 => all_reduce_factor(n) * psi_f * g,
            1 => all_reduce_factor(n) * psi_f * g + gather_factor(n) * psi_f * 4.0,
            2 => accum * gather_factor(n) * psi_f * g + gather_factor(n) * psi_f * 4.0,
            _ => {
                // Rank 0 owns the start of the flat buffer (the embedding):
                // in a ring all-gather it sends every piece but rank 1's.
                let shard = psi.div_ceil(n as u64);
                let rank1_in_emb = emb.saturating_sub(shard).min(shard);
                let tied = if l.pp <= 1 && m.tied_embeddings() {
                    (emb - rank1_in_emb) as f64
                } else {
                    0.0
                };
                accum * (2.0 * (gather_factor(n) * psi_f + tied) * c + gather_factor(n) * psi_f * g)
            }
        };
    }
    let bt = (l.micro_batch * m.seq_len) as f64;
    let btc = bt * m.n_embd as f64;
    if l.tp > 1 {
        let layers = memory::stage_layers(m, l.pp, 0) as f64;
        let fwd = 2.0 * layers + 1.0;
        let passes = if l.recomputes(m) { 2.0 } else { 1.0 };
        // A tp axis over the whole world is the world group: on one host
        // its all-reduces run in place in shared memory and count as the
        // ring's share whatever their size (tp across hosts is not a
        // layout the selection proposes).
        let tp_world = l.dp <= 1 && l.pp <= 1;
        let ar = |bytes: f64| {
            if tp_world {
                all_reduce_factor(l.tp) * bytes
            } else {
                all_reduce_bytes(l.tp, bytes)
            }
        };
        // Llama's replicated kv heads (without sequence parallelism): the
        // gradients of the k and v projections' outputs, all-reduced in
        // backward.
        let kv_replicated = if m.kv_split(l.tp) {
            0.0
        } else {
            layers * 2.0 * ar(bt * m.kv_dim() as f64 * c)
        };
        let per_micro = ar(btc * c) * (passes * fwd + fwd)
            + kv_replicated
            + if l.pp <= 1 {
                passes * 3.0 * ar(bt * 4.0)
            } else {
                0.0
            };
        tp_bytes = accum * per_micro;
    }
    if l.pp > 1 {
        // A tied table's gradient (this rank's rows) is summed between the
        // first and last stages.
        let tied = m.declared(l.tp).tied_per_rank() as f64 * 4.0;
        bytes += accum * btc * c + tied;
    }
    (tp_bytes.round() as u64, bytes.round() as u64)
}
