//! Llama's three kinds of block, with Hugging Face's `LlamaForCausalLM`
//! architecture and names:
//!
//! ```text
//! Embedding (block 0):       x = embed_tokens[idx]                (B, T) u32 -> (B, T, C)
//! Layer (blocks 1..=L), pre-RMSNorm:
//!     h = input_layernorm(x)
//!     q, k, v = q_proj(h), k_proj(h), v_proj(h)   (B, T, C), (B, T, KV), (B, T, KV)
//!     q, k = rope(q), rope(k)                     rotate-half convention
//!     x = x + o_proj(causal_attention(q, repeat_kv(k), repeat_kv(v)))
//!     x = x + down_proj(silu(gate_proj(h2)) * up_proj(h2)),  h2 = post_attention_layernorm(x)
//! Head (block L+1):          logits = lm_head(norm(x)); loss = mean cross-entropy
//! ```
//!
//! KV = n_kv_head * head_dim. Grouped-query attention repeats each key/value
//! head for its `n_head / n_kv_head` query heads (HF's `repeat_kv`: query head
//! j reads kv head j / n_rep), then runs the same fused causal attention as
//! GPT-2 (`phalanx::ops::causal_attention`, packed [q | k | v]). The repeat is
//! a broadcast, so its backward sums the query heads' gradients into their
//! shared kv head.
//!
//! Rotary embeddings (HF `LlamaRotaryEmbedding`, `rope_type = "default"`):
//! inv_freq_i = 1 / theta^(2i / d) for i < d/2, computed in f32 as HF does;
//! angle (t, i) = t * inv_freq_i; cos/sin tables (T, d) repeat the d/2
//! angles twice (`cat(freqs, freqs)`); `rope(x) = x cos + rotate_half(x) sin`
//! with `rotate_half([x1 | x2]) = [-x2 | x1]` on each head's halves.
//!
//! RMSNorm (HF `LlamaRMSNorm`): in f32, `x / sqrt(mean(x^2) + eps)`, back to
//! the input dtype, times the weight. RMSNorm, rope and SwiGLU run as fused
//! ops with their own backward ([`super::ops`]); the composed candle
//! versions here ([`rms_norm_composed`], [`rope_tables`] + [`apply_rope`])
//! are their reference and the path for other devices.
//!
//! Untied head by default (`lm_head.weight`); with `tie_word_embeddings` the
//! head asks for `model.embed_tokens.weight`, so the engine's layout makes it
//! one parameter owned by block 0 (as GPT-2's wte).
//!
//! Init (HF `LlamaPreTrainedModel`): every Linear and the embedding N(0,
//! 0.02), norms 1, no biases; with `qkv_bias` (Qwen2's layer) q, k and v
//! have biases, initialised to 0.
//!
//! ```
//! use phalanx_models::llama::{blocks, LlamaConfig};
//! let b = blocks(&LlamaConfig::llama_tiny()).unwrap();
//! assert_eq!(b.len(), 4 + 2);
//! ```

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use phalanx::engine::{Block, BlockModule, Ctx};
use phalanx::ops;

use super::config::LlamaConfig;

const STD: f64 = 0.02;

fn normal() -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: STD,
    }
}

/// A bias-free Linear's weight (out, in), HF init.
fn weight(vb: &VarBuilder, name: &str, out_dim: usize, in_dim: usize) -> Result<Tensor> {
    vb.get_with_hints((out_dim, in_dim), &format!("{name}.weight"), normal())
}

/// A Linear's bias (out,) when the layer has one (q / k / v under
/// `qkv_bias`), HF init 0.
pub(crate) fn bias(vb: &VarBuilder, on: bool, name: &str, dim: usize) -> Result<Option<Tensor>> {
    on.then(|| vb.get_with_hints(dim, &format!("{name}.bias"), Init::Const(0.0)))
        .transpose()
}

/// RMSNorm (HF `LlamaRMSNorm`): normalised in f32, scaled in the input dtype.
pub struct RmsNorm {
    pub(crate) w: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub(crate) fn new(vb: &VarBuilder, name: &str, c: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            w: vb.get_with_hints(c, &format!("{name}.weight"), Init::Const(1.0))?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        super::ops::rms_norm(x, &self.w, self.eps)
    }
}

/// RMSNorm from candle ops, exactly HF's (the reference for the fused op,
/// and the path for devices it does not cover).
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?; // (B, T, C)
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?; // (B, T, 1)
    let y = xf.broadcast_div(&(ms + eps)?.sqrt()?)?;
    y.to_dtype(x.dtype())?.broadcast_mul(w)
}

/// HF's inverse frequency of rotary pair i for head size d, in f32:
/// 1 / theta^(2i / d).
pub fn inv_freq(i: usize, d: usize, theta: f64) -> f32 {
    1.0 / (theta as f32).powf((2 * i) as f32 / d as f32)
}

/// cos and sin tables (T, d) for positions `start..start + t` from the
/// d/2 inverse frequencies (`LlamaConfig::inv_freq`), in `dtype`.
pub fn rope_tables(
    inv: &[f32],
    start: usize,
    t: usize,
    dtype: DType,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let head_dim = 2 * inv.len();
    let mut cos = Vec::with_capacity(t * head_dim);
    let mut sin = Vec::with_capacity(t * head_dim);
    // Angles in f32, as HF computes them; each repeated for both halves.
    for p in start..start + t {
        for _ in 0..2 {
            for f in inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    let cos = Tensor::from_vec(cos, (t, head_dim), dev)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, head_dim), dev)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// `x cos + rotate_half(x) sin` for x (B, T, H, d) and tables (T, d).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_b, t, _h, d) = x.dims4()?;
    let cos = cos.reshape((1, t, 1, d))?;
    let sin = sin.reshape((1, t, 1, d))?;
    let x1 = x.narrow(3, 0, d / 2)?;
    let x2 = x.narrow(3, d / 2, d / 2)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], 3)?; // (B, T, H, d)
    x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
}

/// HF `repeat_kv` on the last dim: (B, T, KV) -> (B, T, KV * n_rep), each
/// kv head's d columns repeated n_rep times in a row.
pub fn repeat_kv(x: &Tensor, n_kv: usize, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, t, kv) = x.dims3()?;
    let d = kv / n_kv;
    x.reshape((b, t, n_kv, 1, d))?
        .broadcast_as((b, t, n_kv, n_rep, d))?
        .contiguous()?
        .reshape((b, t, kv * n_rep))
}

// ---------------------------------------------------------------- embedding

pub struct Embedding {
    cfg: LlamaConfig,
}

struct EmbeddingModule {
    wte: Tensor, // (V, C)
    block_size: usize,
}

impl Block for Embedding {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        Ok(Box::new(EmbeddingModule {
            wte: vb.get_with_hints(
                (c.vocab_size, c.n_embd),
                "model.embed_tokens.weight",
                normal(),
            )?,
            block_size: c.block_size,
        }))
    }
}

impl BlockModule for EmbeddingModule {
    fn forward(&self, idx: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        // (B, T, C)
        crate::common::blocks::token_embeddings(&self.wte, idx, self.block_size)
    }
}

// ---------------------------------------------------------- decoder layer

pub struct Layer {
    cfg: LlamaConfig,
    index: usize,
}

pub(crate) struct LayerModule {
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) q: Tensor, // (Q, C), Q = n_head * head_dim (= C by default)
    pub(crate) k: Tensor, // (KV, C)
    pub(crate) v: Tensor, // (KV, C)
    /// q, k, v biases (Q), (KV), (KV) under `qkv_bias`.
    pub(crate) qkv_b: [Option<Tensor>; 3],
    pub(crate) o: Tensor, // (C, Q)
    pub(crate) post_attention_layernorm: RmsNorm,
    pub(crate) gate: Tensor, // (M, C)
    pub(crate) up: Tensor,   // (M, C)
    pub(crate) down: Tensor, // (C, M)
    pub(crate) cfg: LlamaConfig,
    /// Built by the engine, which collects the weight-gradient tape: the
    /// direct layer may run (its parameter gradients leave only that way).
    tape_collected: bool,
}

impl Block for Layer {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        Ok(Box::new(LayerModule::new(&self.cfg, self.index, &vb)?))
    }
}

impl LayerModule {
    pub(crate) fn new(cfg: &LlamaConfig, index: usize, vb: &VarBuilder) -> Result<Self> {
        let (c, kv, m, eps) = (
            cfg.n_embd,
            cfg.kv_dim(),
            cfg.intermediate_size,
            cfg.rms_norm_eps,
        );
        let vb = vb.pp(format!("model.layers.{index}"));
        Ok(Self {
            input_layernorm: RmsNorm::new(&vb, "input_layernorm", c, eps)?,
            q: weight(&vb, "self_attn.q_proj", cfg.q_dim(), c)?,
            k: weight(&vb, "self_attn.k_proj", kv, c)?,
            v: weight(&vb, "self_attn.v_proj", kv, c)?,
            qkv_b: [
                bias(&vb, cfg.qkv_bias, "self_attn.q_proj", cfg.q_dim())?,
                bias(&vb, cfg.qkv_bias, "self_attn.k_proj", kv)?,
                bias(&vb, cfg.qkv_bias, "self_attn.v_proj", kv)?,
            ],
            o: weight(&vb, "self_attn.o_proj", c, cfg.q_dim())?,
            post_attention_layernorm: RmsNorm::new(&vb, "post_attention_layernorm", c, eps)?,
            gate: weight(&vb, "mlp.gate_proj", m, c)?,
            up: weight(&vb, "mlp.up_proj", m, c)?,
            down: weight(&vb, "mlp.down_proj", c, m)?,
            cfg: *cfg,
            tape_collected: phalanx::ops::tape::will_collect(),
        })
    }

    /// q (B, T, C) and k (B, T, KV) with rotary embeddings applied at
    /// positions `start..`.
    pub(crate) fn qk_rope(&self, h: &Tensor, start: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _c) = h.dims3()?;
        let (nh, nkv, d) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim());
        let [qb, kb, vb] = &self.qkv_b;
        let q = ops::linear(h, &self.q, qb.as_ref())?; // (B, T, C)
        let k = ops::linear(h, &self.k, kb.as_ref())?; // (B, T, KV)
        let v = ops::linear(h, &self.v, vb.as_ref())?; // (B, T, KV)
        let inv = self.cfg.inv_freq();
        let q =
            super::ops::rope(&q.reshape((b, t, nh, d))?, &inv, start)?.reshape((b, t, nh * d))?;
        let k =
            super::ops::rope(&k.reshape((b, t, nkv, d))?, &inv, start)?.reshape((b, t, nkv * d))?;
        Ok((q, k, v))
    }

    fn attention(&self, h: &Tensor) -> Result<Tensor> {
        let (nkv, rep) = (self.cfg.n_kv_head, self.cfg.n_rep());
        let (q, k, v) = self.qk_rope(h, 0)?;
        let qkv = Tensor::cat(
            &[&q, &repeat_kv(&k, nkv, rep)?, &repeat_kv(&v, nkv, rep)?],
            2,
        )?; // (B, T, 3C)
        let y = ops::causal_attention(&qkv, self.cfg.n_head)?; // (B, T, C)
        ops::linear(&y, &self.o, None)
    }

    pub(crate) fn mlp(&self, h: &Tensor) -> Result<Tensor> {
        let g = ops::linear(h, &self.gate, None)?; // (B, T, M)
        let u = ops::linear(h, &self.up, None)?; // (B, T, M)
        ops::linear(&super::ops::swiglu(&g, &u)?, &self.down, None) // (B, T, C)
    }
}

impl LayerModule {
    /// The parameters in [`super::direct::Params`] order.
    fn params(&self) -> super::direct::Params {
        let mut p = vec![
            self.input_layernorm.w.clone(),
            self.q.clone(),
            self.k.clone(),
            self.v.clone(),
            self.o.clone(),
            self.post_attention_layernorm.w.clone(),
            self.gate.clone(),
            self.up.clone(),
            self.down.clone(),
        ];
        p.extend(self.qkv_b.iter().flatten().cloned());
        p
    }

    /// f32, bf16 or f16 on CPU (parameters in x's dtype), built by the
    /// engine: the direct layer applies.
    fn fusable(&self, x: &Tensor) -> bool {
        self.tape_collected
            && crate::common::direct::enabled()
            && phalanx::ops::host_kernels(x.device())
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && self
                .params()
                .iter()
                .all(|t| t.dtype() == x.dtype() && phalanx::ops::host_kernels(t.device()))
    }
}

impl BlockModule for LayerModule {
    fn forward_direct(
        &self,
        x: &Tensor,
        _ctx: &Ctx,
    ) -> Result<Option<(Tensor, Box<dyn phalanx::engine::DirectBackward>)>> {
        if !self.fusable(x) {
            return Ok(None);
        }
        phalanx::ops::kernel_ran();
        super::direct::layer_direct(x, self.params(), &self.cfg).map(Some)
    }

    fn direct_params(&self) -> Option<Vec<Tensor>> {
        Some(self.params())
    }

    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        if self.fusable(x) {
            return super::direct::layer(x, self.params(), &self.cfg);
        }
        let x = (x + self.attention(&self.input_layernorm.forward(x)?)?)?;
        &x + self.mlp(&self.post_attention_layernorm.forward(&x)?)?
    }
}

// --------------------------------------------------------------------- head

pub struct Head {
    cfg: LlamaConfig,
}

pub(crate) struct HeadModule {
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Tensor, // (V, C)
}

/// The name the head's matrix has: its own, or the embedding's when tied.
pub fn head_name(cfg: &LlamaConfig) -> &'static str {
    if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    }
}

impl Block for Head {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        Ok(Box::new(HeadModule {
            norm: RmsNorm::new(&vb, "model.norm", c.n_embd, c.rms_norm_eps)?,
            lm_head: vb.get_with_hints((c.vocab_size, c.n_embd), head_name(c), normal())?,
        }))
    }
}

impl HeadModule {
    /// Logits (B, T, V) in the compute dtype.
    pub(crate) fn logits(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear(&self.norm.forward(x)?, &self.lm_head, None)
    }
}

impl BlockModule for HeadModule {
    /// With targets: the scalar mean cross-entropy. Without: logits (B, T, V) f32.
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        crate::common::blocks::loss_or_logits(&self.logits(x)?, ctx) // (B, T, V) logits
    }
}

/// The blocks of a Llama: embedding, `n_layer` decoder layers, head.
pub fn blocks(cfg: &LlamaConfig) -> Result<Vec<Box<dyn Block>>> {
    cfg.validate()?;
    let mut out: Vec<Box<dyn Block>> = vec![Box::new(Embedding { cfg: *cfg })];
    for index in 0..cfg.n_layer {
        out.push(Box::new(Layer { cfg: *cfg, index }));
    }
    out.push(Box::new(Head { cfg: *cfg }));
    Ok(out)
}
