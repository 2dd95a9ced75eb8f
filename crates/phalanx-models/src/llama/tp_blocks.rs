//! Llama's blocks on one tensor-parallel rank (Megatron-LM's layout):
//!
//! ```text
//! embed_tokens   vocabulary-parallel rows (vocabulary padded to a multiple of tp)
//! q_proj         column-parallel by heads: rank t holds n_head/tp query heads
//! k_proj, v_proj n_kv_head >= tp: column-parallel by kv heads (n_kv_head/tp each);
//!                n_kv_head <  tp: replicated whole; rank t uses kv head t*n_kv/tp
//! o_proj         row-parallel (the columns of its heads)
//! gate/up_proj   column-parallel, down_proj row-parallel
//! norms          replicated; lm_head vocabulary-parallel rows + parallel cross-entropy
//! ```
//!
//! q / k / v biases (`qkv_bias`, Qwen2) are split, or replicated, as their
//! matrices' rows (a replicated bias's gradient takes the same path as its
//! matrix's).
//!
//! Each parameter's placement (`phalanx::placement`) is declared
//! here with it: the slices a rank loads, the gathered whole tensors and the
//! checkpoint regions follow from it.
//!
//! Rank t's query heads [t nh/tp, (t+1) nh/tp) read kv heads
//! [t nkv/tp, ...) in HF's grouping (query head j reads kv head j / n_rep),
//! so a split kv projection keeps every group on one rank.
//!
//! Replicated kv heads: every rank projects all kv heads and keeps the one
//! its queries read. Each rank's gradient of the replicated k/v matrices
//! then holds only its own query heads' part, and the whole is their sum
//! over tp:
//! - without sequence parallelism the projection reads the replicated
//!   (pre-`enter`) normed input, and its output goes through `copy_to_tp`
//!   (identity forward, all-reduce of the gradient backward): every rank
//!   gets the whole weight gradient, and the input gradient of the k/v
//!   path, already whole, is added outside the tp region (not summed
//!   again); replicated weights' gradients are not summed by the trainer;
//! - with it, the projection reads the gathered input like the queries, so
//!   the input gradient is a partial sum that the gather's reduce-scatter
//!   completes, and the weight gradients are partial sums that the trainer
//!   sums over tp as it does for every replicated parameter under sequence
//!   parallelism (the norms' chunks).

use candle_core::{bail, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use phalanx::engine::{Block, BlockModule, Ctx};
use phalanx::ops;
use phalanx::placement::{declare, Placement};
use phalanx::tp::{
    copy_to_tp, vocab_parallel_cross_entropy, vocab_table, RowParallelLinear, Tp,
    VocabParallelEmbedding,
};

use super::blocks::{head_name, repeat_kv, RmsNorm};
use super::config::LlamaConfig;
use super::ops::{rope, swiglu};

fn normal() -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    }
}

/// Are the kv heads split over the tp ranks (else replicated)?
pub fn kv_split(cfg: &LlamaConfig, tp: usize) -> bool {
    cfg.n_kv_head >= tp
}

/// The tensor-parallel shapes a config needs, checked; errors name the keys.
pub fn check(cfg: &LlamaConfig, tp: &Tp) -> Result<()> {
    let n = tp.size();
    tp.part(cfg.n_head, "model.n_head")?;
    tp.part(cfg.intermediate_size, "model.intermediate_size")?;
    if kv_split(cfg, n) {
        tp.part(cfg.n_kv_head, "model.n_kv_head")?;
    } else {
        if !n.is_multiple_of(cfg.n_kv_head) {
            bail!(
                "the tensor-parallel size {n} is not a multiple of model.n_kv_head ({}): \
                 kv heads can be split or replicated, not both",
                cfg.n_kv_head
            )
        }
    }
    Ok(())
}

pub struct TpEmbedding {
    pub(crate) cfg: LlamaConfig,
    pub(crate) tp: Tp,
}

struct TpEmbeddingModule {
    wte: VocabParallelEmbedding,
    block_size: usize,
}

impl Block for TpEmbedding {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        Ok(Box::new(TpEmbeddingModule {
            wte: VocabParallelEmbedding::new(
                &self.tp,
                &vb,
                "model.embed_tokens.weight",
                c.vocab_size,
                c.n_embd,
            )?,
            block_size: c.block_size,
        }))
    }
}

impl BlockModule for TpEmbeddingModule {
    fn forward(&self, idx: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        crate::common::blocks::check_context(idx.dim(1)?, self.block_size)?;
        self.wte.forward(idx) // (B, T, C), or (B, T/tp, C) sequence-parallel
    }
}

pub struct TpLayer {
    pub(crate) cfg: LlamaConfig,
    pub(crate) index: usize,
    pub(crate) tp: Tp,
}

struct TpLayerModule {
    input_layernorm: RmsNorm,
    q: Tensor, // (Q/tp, C), Q = n_head * head_dim
    k: Tensor, // (KV/tp, C) split, or (KV, C) replicated
    v: Tensor,
    /// q, k, v biases under `qkv_bias`: the rows of their matrices.
    qkv_b: [Option<Tensor>; 3],
    o: RowParallelLinear, // (C, Q/tp)
    post_attention_layernorm: RmsNorm,
    gate: Tensor, // (M/tp, C)
    up: Tensor,   // (M/tp, C)
    down: RowParallelLinear,
    cfg: LlamaConfig,
    tp: Tp,
}

impl Block for TpLayer {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let (cfg, tp) = (&self.cfg, &self.tp);
        let n = tp.size();
        let (c, kv, m, eps) = (
            cfg.n_embd,
            cfg.kv_dim(),
            cfg.intermediate_size,
            cfg.rms_norm_eps,
        );
        let vb = vb.pp(format!("model.layers.{}", self.index));
        let w = |name: &str, o: usize, i: usize, p: Placement| {
            declare(&vb, (o, i), &format!("{name}.weight"), normal(), p)
        };
        // A q / k / v bias is placed as its matrix's rows.
        let b = |name: &str, o: usize, p: Placement| -> Result<Option<Tensor>> {
            cfg.qkv_bias
                .then(|| declare(&vb, o, &format!("{name}.bias"), Init::Const(0.0), p))
                .transpose()
        };
        let (rows, cols) = (Placement::rows(), Placement::cols());
        // kv heads split by heads, or replicated whole when tp > n_kv_head.
        let (kv_rows, kv_place) = match kv_split(cfg, n) {
            true => (kv / n, rows),
            false => (kv, Placement::Replicate),
        };
        Ok(Box::new(TpLayerModule {
            input_layernorm: RmsNorm::new(&vb, "input_layernorm", c, eps)?,
            q: w("self_attn.q_proj", cfg.q_dim() / n, c, rows)?,
            k: w("self_attn.k_proj", kv_rows, c, kv_place)?,
            v: w("self_attn.v_proj", kv_rows, c, kv_place)?,
            qkv_b: [
                b("self_attn.q_proj", cfg.q_dim() / n, rows)?,
                b("self_attn.k_proj", kv_rows, kv_place)?,
                b("self_attn.v_proj", kv_rows, kv_place)?,
            ],
            o: RowParallelLinear::from_parts(
                tp,
                w("self_attn.o_proj", c, cfg.q_dim() / n, cols)?,
                None,
            ),
            post_attention_layernorm: RmsNorm::new(&vb, "post_attention_layernorm", c, eps)?,
            gate: w("mlp.gate_proj", m / n, c, rows)?,
            up: w("mlp.up_proj", m / n, c, rows)?,
            down: RowParallelLinear::from_parts(tp, w("mlp.down_proj", c, m / n, cols)?, None),
            cfg: *cfg,
            tp: tp.clone(),
        }))
    }
}

impl TpLayerModule {
    fn attention(&self, h: &Tensor) -> Result<Tensor> {
        let n = self.tp.size();
        let d = self.cfg.head_dim();
        let nh = self.cfg.n_head / n;
        let he = self.tp.enter(h)?; // (B, T, C) on every rank
        let (b, t, _c) = he.dims3()?;
        let [qb, kb, vb] = &self.qkv_b;
        let q = ops::linear(&he, &self.q, qb.as_ref())?; // (B, T, nh d)
        let (k, v, nkv) = if kv_split(&self.cfg, n) {
            let nkv = self.cfg.n_kv_head / n;
            (
                ops::linear(&he, &self.k, kb.as_ref())?,
                ops::linear(&he, &self.v, vb.as_ref())?,
                nkv,
            )
        } else {
            // All kv heads from the replicated input; keep this rank's one
            // (see the module doc for the two gradient paths).
            let head = self.tp.rank() * self.cfg.n_kv_head / n;
            let pick = |w: &Tensor, b: Option<&Tensor>| -> Result<Tensor> {
                let k = if self.tp.sequence_parallel {
                    ops::linear(&he, w, b)?
                } else {
                    copy_to_tp(&ops::linear(h, w, b)?, &self.tp.pg)?
                };
                k.narrow(2, head * d, d)
            };
            (pick(&self.k, kb.as_ref())?, pick(&self.v, vb.as_ref())?, 1)
        };
        let inv = self.cfg.inv_freq();
        let q = rope(&q.reshape((b, t, nh, d))?, &inv, 0)?.reshape((b, t, nh * d))?;
        let k = rope(&k.reshape((b, t, nkv, d))?, &inv, 0)?.reshape((b, t, nkv * d))?;
        let rep = nh / nkv;
        let qkv = Tensor::cat(
            &[&q, &repeat_kv(&k, nkv, rep)?, &repeat_kv(&v, nkv, rep)?],
            2,
        )?; // (B, T, 3 nh d)
        let y = ops::causal_attention(&qkv, nh)?; // (B, T, nh d)
        self.o.forward(&y)
    }

    fn mlp(&self, h: &Tensor) -> Result<Tensor> {
        let he = self.tp.enter(h)?; // (B, T, C)
        let g = ops::linear(&he, &self.gate, None)?; // (B, T, M/tp)
        let u = ops::linear(&he, &self.up, None)?;
        self.down.forward(&swiglu(&g, &u)?)
    }
}

impl BlockModule for TpLayerModule {
    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        let x = (x + self.attention(&self.input_layernorm.forward(x)?)?)?;
        &x + self.mlp(&self.post_attention_layernorm.forward(&x)?)?
    }
}

pub struct TpHead {
    pub(crate) cfg: LlamaConfig,
    pub(crate) tp: Tp,
}

struct TpHeadModule {
    norm: RmsNorm,
    lm_head: Tensor, // (V_pad/tp, C)
    tp: Tp,
    vocab: usize,
}

impl Block for TpHead {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        Ok(Box::new(TpHeadModule {
            norm: RmsNorm::new(&vb, "model.norm", c.n_embd, c.rms_norm_eps)?,
            lm_head: vocab_table(&self.tp, &vb, head_name(c), c.vocab_size, c.n_embd)?,
            tp: self.tp.clone(),
            vocab: c.vocab_size,
        }))
    }
}

impl BlockModule for TpHeadModule {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let h = self.tp.enter(&self.norm.forward(x)?)?; // (B, T, C)
        let (b, t, _c) = h.dims3()?;
        let logits = ops::linear(&h, &self.lm_head, None)?; // (B, T, V_pad/tp)
        let Some(targets) = ctx.targets else {
            bail!("full logits are not assembled under tensor parallelism (generate with tp = 1)")
        };
        let vl = logits.dim(2)?;
        vocab_parallel_cross_entropy(&logits.reshape((b * t, vl))?, targets, &self.tp, self.vocab)
    }
}
