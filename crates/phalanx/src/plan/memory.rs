//! Memory per rank: model states (parameters, gradients, optimizer state)
//! by ZeRO stage, and, with the model's shapes, activations, working copies
//! of block parameters, communication buffers and the process's own
//! overhead, as Phalanx's engine holds them on a CPU rank.
//!
//! Model states follow the ZeRO paper's accounting ([`model_states`]):
//! with `k` bytes of optimizer state per parameter and `Ψ` parameters on
//! `N` data-parallel ranks, stage 0 holds `(p + g + k)Ψ`, stage 1
//! `(p + g)Ψ + kΨ/N`, stage 2 `pΨ + (g + k)Ψ/N`, stage 3 `(p + g + k)Ψ/N`.
//!
//! Activations of one GPT-2 layer kept for backward, in elements of the
//! compute dtype, for micro-batch `B`, sequence `T`, width `C`, `H` heads,
//! `t` tensor-parallel ranks (counted from the fused ops of
//! `phalanx_models::gpt2::blocks`, which keep one tensor per op):
//!
//! ```text
//! replicated over tp: input, ln_1, attention projection, residual, ln_2,
//!                     MLP projection, residual                    7 BTC
//! split over tp:      qkv 3BTC, attention output BTC, MLP 4BTC + GELU 4BTC
//!                     = 12 BTC / t, and the softmax probabilities H T² B / t
//! ```
//!
//! (Korthikanti et al. count 34 BTC + 5 H T² B bytes in fp16 with dropout
//! masks and saved pre-softmax scores; the fused kernels here keep less.)
//! A Llama layer keeps the same 7 BTC replicated (input, the two RMSNorm
//! outputs, `o_proj` and `down_proj` outputs, two residuals) and, split,
//! q and rotated q, k, rotated k, v, the kv heads repeated for their query
//! heads, the packed [q | k | v], the attention output, gate, up and SwiGLU
//! output ([`ModelShape::layer_split_activations`]), plus the
//! probabilities. Without tensor parallel a Llama layer runs the direct
//! layer instead, which keeps its input (compute dtype) and, in f32
//! whatever the compute dtype, `3C + 4Q + 3M` per token
//! ([`ModelShape::direct_layer_activations`]) and the probabilities: in
//! half precision that is more than the composed count in half bytes, in
//! fp32 less.
//! Recomputation keeps each block's input (`BTC`) and rebuilds one block's
//! graph at a time. A pipeline stage holds its in-flight micro-batches:
//! `min(m, p - s)` under 1F1B, `m` under GPipe.
//!
//! ```
//! use phalanx::plan::memory::{model_states, ModelStates};
//! // DeepSpeed's 7.5B example: mixed precision Adam, 64 ranks, stage 3:
//! // 16 bytes/param / 64 = 0.25 bytes/param.
//! let s = model_states(7_500_000_000, 64, 3, 2, 2, 12);
//! assert_eq!(s.total(), 7_500_000_000 * 16 / 64);
//! assert_eq!(model_states(1000, 4, 0, 4, 4, 8), ModelStates { params: 4000, grads: 4000, optimizer: 8000 });
//! ```

use super::{Layout, ModelShape};

/// Parameters, gradients and optimizer state held by one rank (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelStates {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
}

impl ModelStates {
    pub fn total(&self) -> u64 {
        self.params
            .saturating_add(self.grads)
            .saturating_add(self.optimizer)
    }
}

/// Model states per rank of `params` parameters sharded over `n` ranks at
/// ZeRO `stage`, with `p`, `g`, `k` bytes per parameter of parameters,
/// gradients and optimizer state. Shards are ⌈Ψ/N⌉ (the largest rank's).
/// Byte counts past `u64::MAX` saturate (they fit nowhere).
pub fn model_states(params: u64, n: usize, stage: u8, p: u64, g: u64, k: u64) -> ModelStates {
    let n = n.max(1) as u64;
    let shard = params.div_ceil(n);
    let (pp, gg, kk) = match stage {
        0 => (params, params, params),
        1 => (params, params, shard),
        2 => (params, shard, shard),
        _ => (shard, shard, shard),
    };
    ModelStates {
        params: pp.saturating_mul(p),
        grads: gg.saturating_mul(g),
        optimizer: kk.saturating_mul(k),
    }
}

/// One rank's predicted memory (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryEstimate {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// Activations at the peak (kept for backward, plus the backward's
    /// transient gradients).
    pub activations: u64,
    /// Block parameters materialised as compute-dtype tensors (all of a
    /// rank's blocks when graphs are kept; one or a few blocks when
    /// recomputing or under ZeRO-3).
    pub working: u64,
    /// Gradient buckets and staging buffers in flight.
    pub comm_buffers: u64,
    /// The process itself: binary, threads, allocator, the token data.
    pub overhead: u64,
}

impl MemoryEstimate {
    pub fn model_states(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
    pub fn total(&self) -> u64 {
        self.model_states() + self.activations + self.working + self.comm_buffers + self.overhead
    }
}

/// The fixed resident memory of a training process on this CPU build
/// (binary, candle's and the transport's threads, allocator arenas),
/// measured with a one-layer, 32-wide model (README, "Planning").
pub const PROCESS_OVERHEAD: u64 = 12 << 20;

/// Bytes a token of the training data takes in memory: a text corpus is
/// tokenized into `u32`s held by every rank (nanoGPT / llm.c `.bin` files
/// are memory-mapped and count as they are touched).
pub const BYTES_PER_TOKEN: u64 = 4;

/// Blocks of a pipeline stage: the embedding goes with stage 0, the head
/// with the last; layers split as evenly as parameters allow.
pub fn stage_layers(m: &ModelShape, pp: usize, stage: usize) -> usize {
    let pp = pp.max(1);
    let base = m.n_layer / pp;
    let extra = m.n_layer % pp;
    base + usize::from(stage < extra)
}

/// Bytes one layer keeps for backward (see the module docs).
fn layer_activation_bytes(m: &ModelShape, l: &Layout) -> u64 {
    let cb = l.compute_bytes() as u64;
    if !m.direct_layer(l.tp) {
        return layer_activations(m, l) * cb;
    }
    let (b, t, c, h) = (
        l.micro_batch as u64,
        m.seq_len as u64,
        m.n_embd as u64,
        m.n_head as u64,
    );
    let kept = b * t * m.direct_layer_activations() as u64 + h * t * t * b;
    b * t * c * cb + 4 * kept
}

/// Elements one composed layer keeps for backward (see the module docs).
fn layer_activations(m: &ModelShape, l: &Layout) -> u64 {
    let (b, t, c, h) = (
        l.micro_batch as u64,
        m.seq_len as u64,
        m.n_embd as u64,
        m.n_head as u64,
    );
    let tp = l.tp.max(1) as u64;
    let btc = b * t * c;
    // Tensor parallel adds Megatron's f and g: a copy of each LayerNorm
    // output entering a column-parallel matmul and the all-reduced output
    // of each row-parallel one (4 BTC, replicated).
    let f_g = if tp > 1 { 4 * btc } else { 0 };
    let split = b * t * m.layer_split_activations(l.tp) as u64;
    7 * btc + f_g + split + h * t * t * b / tp
}

/// Elements the head keeps: ln_f output, logits and their gradient
/// (the vocabulary split over tp).
fn head_activations(m: &ModelShape, l: &Layout) -> u64 {
    let bt = (l.micro_batch * m.seq_len) as u64;
    bt * m.n_embd as u64 + 2 * bt * m.vocab_size.div_ceil(l.tp.max(1)) as u64
}

/// Transient elements of one layer's backward: the gradients of its
/// widest intermediates (MLP hidden and GELU, or gate, up and SwiGLU)
/// alive together.
fn layer_backward_transient(m: &ModelShape, l: &Layout) -> u64 {
    (l.micro_batch * m.seq_len * m.layer_backward_transient(l.tp)) as u64
}

/// Per-rank memory of the most loaded rank (the stage with the most
/// micro-batches in flight: stage 0).
pub fn per_rank(m: &ModelShape, l: &Layout) -> MemoryEstimate {
    per_rank_with_data(m, l, 0)
}

/// [`per_rank`] with `data_tokens` tokens of training data held in memory.
pub fn per_rank_with_data(m: &ModelShape, l: &Layout, data_tokens: u64) -> MemoryEstimate {
    let tp = l.tp.max(1);
    let pp = l.pp.max(1);
    let cb = l.compute_bytes() as u64;
    // Parameters this rank's model shard holds: stage 0's layers, the
    // embedding, and the head when pp = 1, each block's as its declared
    // placements put it on one of tp ranks (matrices and column-parallel
    // biases split, the vocabulary padded; norms, row-parallel biases and
    // replicated kv heads whole).
    let layers = stage_layers(m, pp, 0);
    let p = m.rank_params(tp);
    let (layer_p, emb_p) = (p.layer, p.embedding);
    let head_p = if pp == 1 { p.head } else { 0 };
    let local = (layers * layer_p + emb_p + head_p) as u64;
    let k = l.optim_bytes_per_param as u64;
    let mut s = model_states(local, l.dp, l.zero_stage, 4, 4, k);
    if l.offload_optimizer {
        // The update streams the state through one chunk of 2^20 elements.
        s.optimizer = s.optimizer.min((1 << 20) * k);
    }
    // Activations of stage 0: in-flight micro-batches of its blocks.
    let in_flight = if pp == 1 {
        1
    } else if l.gpipe {
        l.grad_accum.max(1)
    } else {
        l.grad_accum.max(1).min(pp)
    } as u64;
    let btc = (l.micro_batch * m.seq_len * m.n_embd) as u64;
    let layer_act = layer_activation_bytes(m, l);
    let head_act = if pp == 1 { head_activations(m, l) } else { 0 };
    let blocks = layers as u64 + 1 + u64::from(pp == 1);
    // Keeping graphs, the peak is at the end of the forward (every graph
    // alive, no gradient yet); recomputing, it is in a block's backward
    // (the rebuilt graph, its gradients, buckets in flight).
    let activations = if l.recomputes(m) {
        (in_flight * blocks * btc + layer_backward_transient(m, l)) * cb
            + layer_act.max(head_act * cb)
    } else {
        in_flight * (layers as u64 * layer_act + (btc + head_act) * cb)
    };
    let block_p = layer_p.max(emb_p).max(head_p) as u64;
    let working = if l.zero_stage == 3 {
        // The current block and the one prefetched, gathered flat; the
        // current one materialised as tensors; in its backward, the
        // recomputed graph's parameter gradients (tensors) and the copy
        // staged for the reduce-scatter.
        5 * block_p * cb
    } else if l.recomputes(m) {
        block_p * cb
    } else {
        // Every block's tensors stay alive with its graph; the head
        // materialises a tied embedding again.
        let tied = pp == 1 && m.tied_embeddings();
        (local + if tied { emb_p as u64 } else { 0 }) * cb
    };
    let comm_buffers = match l.zero_stage {
        // DDP's bucket copies (f32) come from a pool that keeps them from
        // one step to the next (`strategy::pool`): a whole gradient's
        // worth, alive through the forward's peak too.
        0 | 1 if l.dp > 1 => local * 4,
        3 if l.dp > 1 => 2 * block_p * 4,
        2 if l.dp > 1 && l.recomputes(m) => 2 * block_p * 4,
        _ => 0,
    };
    MemoryEstimate {
        params: s.params,
        grads: s.grads,
        optimizer: s.optimizer,
        activations,
        working,
        comm_buffers,
        overhead: PROCESS_OVERHEAD + data_tokens * BYTES_PER_TOKEN,
    }
}
