//! GPT-2's three kinds of block, with Hugging Face's architecture and names:
//!
//! ```text
//! Embedding (block 0):        x = wte[idx] + wpe[0..T]     (B, T) u32 -> (B, T, C)
//! Layer (blocks 1..=L), pre-LayerNorm:
//!     x = x + attn.c_proj(causal_self_attention(attn.c_attn(ln_1(x))))
//!     x = x + mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(x))))
//! Head (block L+1):           logits = ln_f(x) @ wte^T; loss = mean cross-entropy
//! ```
//!
//! Tied embedding: the head asks for `transformer.wte.weight`, the same name
//! as the embedding, so the engine's layout makes it one parameter owned by
//! block 0. The head's gradient for it is added to the embedding's slot of the
//! flat gradient buffer during the head's backward; the embedding's own
//! contribution is added during block 0's backward. Block 0's "grads ready"
//! hook therefore sees the sum of both uses.
//!
//! Weights are stored as candle `Linear`s: (out, in). HF's `Conv1D` stores
//! (in, out); the transposition happens in `hf.rs` only.
//!
//! The math runs on `phalanx::ops` (linear, layer_norm, causal_attention,
//! gelu, cross_entropy): one autograd node each with a hand-written backward,
//! which is both correct (candle-nn's fused LayerNorm has no backward) and
//! much cheaper in candle's backward than the same layers as small ops.
//!
//! Mixed precision: every tensor follows the dtype of the `VarBuilder` a
//! block is built with (f32, f16 or bf16: the engine casts f32 master
//! weights); the fused ops compute in f32 inside, activations stay in that
//! dtype, the loss (and the logits returned for generation) are f32.
//!
//! Init (GPT-2 / nanoGPT): weights N(0, 0.02), the residual projections
//! (`attn.c_proj`, `mlp.c_proj`) N(0, 0.02 / sqrt(2 n_layer)), biases 0,
//! LayerNorm weight 1 and bias 0. LayerNorm eps 1e-5, dropout 0.
//!
//! ```
//! use phalanx_models::gpt2::{blocks, Gpt2Config};
//! let b = blocks(&Gpt2Config::gpt_tiny()).unwrap();
//! assert_eq!(b.len(), 4 + 2);
//! ```

use candle_core::{bail, DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use phalanx::engine::{Block, BlockModule, Ctx, DirectBackward, Placement};
use phalanx::ops;
use phalanx::tp::{
    linear_params, vocab_parallel_cross_entropy, vocab_table, ColumnParallelLinear,
    RowParallelLinear, Tp, VocabParallelEmbedding, COLUMN_PARALLEL, ROW_PARALLEL,
};

use super::config::Gpt2Config;
use crate::common::blocks::{loss_or_logits, token_embeddings};

const LN_EPS: f32 = 1e-5;
const STD: f64 = 0.02;

fn normal(stdev: f64) -> Init {
    Init::Randn { mean: 0.0, stdev }
}

/// A Linear: weight (out, in), bias (out,); GPT-2 init.
struct Linear {
    w: Tensor,
    b: Tensor,
}

impl Linear {
    fn new(vb: &VarBuilder, name: &str, in_dim: usize, out_dim: usize, stdev: f64) -> Result<Self> {
        Ok(Self {
            w: vb.get_with_hints((out_dim, in_dim), &format!("{name}.weight"), normal(stdev))?,
            b: vb.get_with_hints(out_dim, &format!("{name}.bias"), Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear(x, &self.w, Some(&self.b))
    }
}

/// LayerNorm parameters; applied with the fused `phalanx::ops::layer_norm`.
struct LayerNorm {
    w: Tensor,
    b: Tensor,
}

impl LayerNorm {
    fn new(vb: &VarBuilder, name: &str, c: usize) -> Result<Self> {
        Ok(Self {
            w: vb.get_with_hints(c, &format!("{name}.weight"), Init::Const(1.0))?,
            b: vb.get_with_hints(c, &format!("{name}.bias"), Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm(x, &self.w, &self.b, LN_EPS)
    }
}

// ---------------------------------------------------------------- embedding

pub struct Embedding {
    cfg: Gpt2Config,
    tp: Option<Tp>,
}

struct EmbeddingModule {
    wte: Tensor,
    wpe: Tensor,
    block_size: usize,
}

/// Tensor parallel: wte's rows split over the ranks (vocabulary padded to
/// a multiple of tp), wpe replicated; under sequence parallelism each rank
/// keeps its chunk of the sequence.
struct TpEmbeddingModule {
    wte: VocabParallelEmbedding,
    wpe: Tensor,
    tp: Tp,
}

impl Block for Embedding {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        if let Some(tp) = &self.tp {
            return Ok(Box::new(TpEmbeddingModule {
                wte: VocabParallelEmbedding::new(
                    tp,
                    &vb,
                    "transformer.wte.weight",
                    c.vocab_size,
                    c.n_embd,
                )?,
                wpe: vb.get_with_hints(
                    (c.block_size, c.n_embd),
                    "transformer.wpe.weight",
                    normal(STD),
                )?,
                tp: tp.clone(),
            }));
        }
        Ok(Box::new(EmbeddingModule {
            wte: vb.get_with_hints(
                (c.vocab_size, c.n_embd),
                "transformer.wte.weight",
                normal(STD),
            )?,
            wpe: vb.get_with_hints(
                (c.block_size, c.n_embd),
                "transformer.wpe.weight",
                normal(STD),
            )?,
            block_size: c.block_size,
        }))
    }
}

impl BlockModule for EmbeddingModule {
    fn forward(&self, idx: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        let tok = token_embeddings(&self.wte, idx, self.block_size)?; // (B, T, C)
        let pos = self.wpe.narrow(0, 0, tok.dim(1)?)?; // (T, C)
        ops::add_bias(&tok, &pos)
    }
}

impl BlockModule for TpEmbeddingModule {
    fn forward(&self, idx: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        let (_b, t) = idx.dims2()?;
        let tok = self.wte.forward(idx)?; // (B, T, C), or (B, T/tp, C) sequence-parallel
        let pos = if self.tp.sequence_parallel {
            let tl = self.tp.part(t, "sequence length")?;
            self.wpe.narrow(0, self.tp.rank() * tl, tl)?
        } else {
            self.wpe.narrow(0, 0, t)?
        };
        ops::add_bias(&tok, &pos)
    }
}

// ---------------------------------------------------------- transformer layer

pub struct Layer {
    cfg: Gpt2Config,
    index: usize,
    tp: Option<Tp>,
}

/// Tensor parallel (Megatron): heads split over the ranks (c_attn
/// column-parallel, attn.c_proj row-parallel), the MLP's hidden units too
/// (c_fc column-, mlp.c_proj row-parallel); LayerNorms replicated.
struct TpLayerModule {
    ln_1: LayerNorm,
    c_attn: ColumnParallelLinear, // (3C/tp, C): rows [q | k | v] of this rank's heads
    attn_proj: RowParallelLinear,
    ln_2: LayerNorm,
    c_fc: ColumnParallelLinear,
    mlp_proj: RowParallelLinear,
    n_head_local: usize,
}

impl BlockModule for TpLayerModule {
    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        let qkv = self.c_attn.forward(&self.ln_1.forward(x)?)?; // (B, T, 3C/tp)
        let y = ops::causal_attention(&qkv, self.n_head_local)?; // (B, T, C/tp)
        let x = (x + self.attn_proj.forward(&y)?)?;
        let h = self.c_fc.forward(&self.ln_2.forward(&x)?)?; // (B, T, 4C/tp)
        &x + self.mlp_proj.forward(&ops::gelu(&h)?)?
    }
}

struct LayerModule {
    ln_1: LayerNorm,
    c_attn_w: Tensor, // (3C, C): rows [q | k | v]
    c_attn_b: Tensor, // (3C,)
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
    n_head: usize,
    /// Built by the engine, which collects the weight-gradient tape: the
    /// fused layer may run (its parameter gradients leave only that way).
    tape_collected: bool,
}

impl Block for Layer {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = self.cfg.n_embd;
        let vb = vb.pp(format!("transformer.h.{}", self.index));
        // Residual projections are scaled so the residual stream's variance
        // does not grow with depth (GPT-2 paper, section 2.3).
        let proj_std = STD / (2.0 * self.cfg.n_layer as f64).sqrt();
        if let Some(tp) = &self.tp {
            let n_head_local = tp.part(self.cfg.n_head, "model.n_head")?;
            let (c3, c4) = (tp.part(3 * c, "3 n_embd")?, tp.part(4 * c, "4 n_embd")?);
            let cl = c / tp.size();
            // c_attn's rows are [q | k | v]: each of the three is split by heads.
            let qkv = Placement::Shard {
                dim: 0,
                groups: 3,
                full: None,
            };
            let lin = |name: &str, o: usize, i: usize, std: f64, p| {
                linear_params(&vb, name, (o, i), std, true, p)
            };
            let (aw, ab) = lin("attn.c_attn", c3, c, STD, (qkv, qkv))?;
            let (pw, pb) = lin("attn.c_proj", c, cl, proj_std, ROW_PARALLEL)?;
            let (fw, fb) = lin("mlp.c_fc", c4, c, STD, COLUMN_PARALLEL)?;
            let (mw, mb) = lin("mlp.c_proj", c, c4, proj_std, ROW_PARALLEL)?;
            return Ok(Box::new(TpLayerModule {
                ln_1: LayerNorm::new(&vb, "ln_1", c)?,
                c_attn: ColumnParallelLinear::from_parts(tp, aw, ab),
                attn_proj: RowParallelLinear::from_parts(tp, pw, pb),
                ln_2: LayerNorm::new(&vb, "ln_2", c)?,
                c_fc: ColumnParallelLinear::from_parts(tp, fw, fb),
                mlp_proj: RowParallelLinear::from_parts(tp, mw, mb),
                n_head_local,
            }));
        }
        Ok(Box::new(LayerModule {
            ln_1: LayerNorm::new(&vb, "ln_1", c)?,
            c_attn_w: vb.get_with_hints((3 * c, c), "attn.c_attn.weight", normal(STD))?,
            c_attn_b: vb.get_with_hints(3 * c, "attn.c_attn.bias", Init::Const(0.0))?,
            attn_proj: Linear::new(&vb, "attn.c_proj", c, c, proj_std)?,
            ln_2: LayerNorm::new(&vb, "ln_2", c)?,
            c_fc: Linear::new(&vb, "mlp.c_fc", c, 4 * c, STD)?,
            mlp_proj: Linear::new(&vb, "mlp.c_proj", 4 * c, c, proj_std)?,
            n_head: self.cfg.n_head,
            tape_collected: phalanx::ops::tape::will_collect(),
        }))
    }
}

impl LayerModule {
    fn attention(&self, x: &Tensor) -> Result<Tensor> {
        let qkv = ops::linear(x, &self.c_attn_w, Some(&self.c_attn_b))?; // (B, T, 3C)
        let y = ops::causal_attention(&qkv, self.n_head)?; // (B, T, C)
        self.attn_proj.forward(&y)
    }

    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.forward(x)?; // (B, T, 4C)
        self.mlp_proj.forward(&ops::gelu(&h)?) // (B, T, C)
    }
}

impl LayerModule {
    /// The parameters in [`super::fused::Params`] order.
    fn params(&self) -> super::fused::Params {
        [
            self.ln_1.w.clone(),
            self.ln_1.b.clone(),
            self.c_attn_w.clone(),
            self.c_attn_b.clone(),
            self.attn_proj.w.clone(),
            self.attn_proj.b.clone(),
            self.ln_2.w.clone(),
            self.ln_2.b.clone(),
            self.c_fc.w.clone(),
            self.c_fc.b.clone(),
            self.mlp_proj.w.clone(),
            self.mlp_proj.b.clone(),
        ]
    }

    /// On CPU in f32, bf16 or f16 (input and parameters of one dtype),
    /// built by the engine: the explicit forward / backward of `fused`
    /// applies (half precision converting at its boundary).
    fn fusable(&self, x: &Tensor) -> bool {
        let p = self.params();
        let dtype = x.dtype();
        self.tape_collected
            && super::fused::enabled()
            && phalanx::ops::host_kernels(x.device())
            && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
            && p.iter()
                .all(|t| t.dtype() == dtype && phalanx::ops::host_kernels(t.device()))
    }
}

impl BlockModule for LayerModule {
    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        if self.fusable(x) {
            return super::fused::layer(x, self.params(), self.n_head, LN_EPS);
        }
        let x = (x + self.attention(&self.ln_1.forward(x)?)?)?;
        &x + self.mlp(&self.ln_2.forward(&x)?)?
    }

    fn forward_direct(
        &self,
        x: &Tensor,
        _ctx: &Ctx,
    ) -> Result<Option<(Tensor, Box<dyn DirectBackward>)>> {
        if !self.fusable(x) {
            return Ok(None);
        }
        phalanx::ops::kernel_ran();
        super::fused::layer_direct(x, self.params(), self.n_head, LN_EPS).map(Some)
    }

    fn direct_params(&self) -> Option<Vec<Tensor>> {
        Some(self.params().to_vec())
    }
}

// --------------------------------------------------------------------- head

pub struct Head {
    cfg: Gpt2Config,
    tp: Option<Tp>,
}

/// Tensor parallel: logits sharded over the (padded) vocabulary and a
/// vocabulary-parallel cross-entropy: no rank holds the full logits.
struct TpHeadModule {
    ln_f: LayerNorm,
    wte: Tensor, // (V_pad/tp, C), tied with the embedding's shard
    tp: Tp,
    vocab: usize,
}

impl BlockModule for TpHeadModule {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        // f (or the sequence all-gather) and the logits as one
        // column-parallel linear: backward overlaps the collective on the
        // input gradient with the embedding's gradient.
        let logits = self
            .tp
            .column_linear(&self.ln_f.forward(x)?, &self.wte, None)?; // (B, T, V_pad/tp)
        let (b, t, _) = logits.dims3()?;
        let Some(targets) = ctx.targets else {
            bail!("full logits are not assembled under tensor parallelism (generate with tp = 1)")
        };
        let vl = logits.dim(2)?;
        vocab_parallel_cross_entropy(&logits.reshape((b * t, vl))?, targets, &self.tp, self.vocab)
    }
}

struct HeadModule {
    ln_f: LayerNorm,
    wte: Tensor,
}

impl Block for Head {
    /// Every parameter is a direct argument of a deferring op (linear,
    /// the norms, bias): the zero-bubble W pass needs no recomputation.
    fn defers_weight_grads(&self) -> bool {
        true
    }

    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let c = &self.cfg;
        if let Some(tp) = &self.tp {
            return Ok(Box::new(TpHeadModule {
                ln_f: LayerNorm::new(&vb, "transformer.ln_f", c.n_embd)?,
                wte: vocab_table(tp, &vb, "transformer.wte.weight", c.vocab_size, c.n_embd)?,
                tp: tp.clone(),
                vocab: c.vocab_size,
            }));
        }
        Ok(Box::new(HeadModule {
            ln_f: LayerNorm::new(&vb, "transformer.ln_f", c.n_embd)?,
            // Tied: the same name as the embedding's table (see module doc).
            wte: vb.get_with_hints(
                (c.vocab_size, c.n_embd),
                "transformer.wte.weight",
                normal(STD),
            )?,
        }))
    }
}

impl BlockModule for HeadModule {
    /// With targets: the scalar mean cross-entropy. Without: logits (B, T, V).
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let logits = ops::linear(&self.ln_f.forward(x)?, &self.wte, None)?; // (B, T, V)
        loss_or_logits(&logits, ctx)
    }
}

/// The blocks of a GPT-2: embedding, `n_layer` layers, head.
pub fn blocks(cfg: &Gpt2Config) -> Result<Vec<Box<dyn Block>>> {
    blocks_tp(cfg, None)
}

/// The blocks for one tensor-parallel rank (`tp` = None: the whole model).
pub fn blocks_tp(cfg: &Gpt2Config, tp: Option<Tp>) -> Result<Vec<Box<dyn Block>>> {
    let tp = tp.filter(|t| t.size() > 1);
    cfg.validate()?;
    if let Some(t) = &tp {
        if !cfg.n_head.is_multiple_of(t.size()) {
            bail!(
                "model.n_head ({}) is not divisible by the tensor-parallel size {}",
                cfg.n_head,
                t.size()
            )
        }
    }
    let mut out: Vec<Box<dyn Block>> = vec![Box::new(Embedding {
        cfg: *cfg,
        tp: tp.clone(),
    })];
    for index in 0..cfg.n_layer {
        out.push(Box::new(Layer {
            cfg: *cfg,
            index,
            tp: tp.clone(),
        }));
    }
    out.push(Box::new(Head { cfg: *cfg, tp }));
    Ok(out)
}
