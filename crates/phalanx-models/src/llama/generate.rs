//! Llama inference with a KV cache, for `phalanx generate`.
//!
//! The training engine recomputes the whole context for every new token;
//! here each layer keeps the keys (after rotary) and values of the tokens
//! seen so far, so a step costs one token's projections plus attention over
//! the cache. The layers are the training blocks' own modules (built from
//! the engine's parameters), so the math is the one the reference tests
//! check; only attention is recomputed against the cache, with candle ops
//! (no backward is needed).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use phalanx_models::llama::{self, generate::Generator, LlamaConfig};
//! let cfg = LlamaConfig::new(2, 4, 2, 16, 40, 64, 8);
//! let e = llama::engine(&cfg, &Device::Cpu, Default::default()).unwrap();
//! let mut g = Generator::new(&e, &cfg).unwrap();
//! let a = g.step(&[1, 2, 3]).unwrap(); // logits (3, V) for the prompt
//! let b = g.step(&[4]).unwrap();       // (1, V): position 3, from the cache
//! assert_eq!((a.dims(), b.dims(), g.len()), (&[3, 64][..], &[1, 64][..], 4));
//! ```

use candle_core::{bail, DType, IndexOp, Result, Tensor, D};
use candle_nn::VarBuilder;
use phalanx::engine::Engine;

use crate::common::generate::Decoder;

use super::blocks::{repeat_kv, HeadModule, LayerModule, RmsNorm};
use super::config::LlamaConfig;

/// A Llama with per-layer key/value caches (batch 1).
pub struct Generator {
    cfg: LlamaConfig,
    embed: Tensor, // (V, C)
    layers: Vec<LayerModule>,
    head: HeadModule,
    /// Per layer: keys (1, T, KV) after rotary, values (1, T, KV).
    cache: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
}

impl Generator {
    /// From a (whole, f32) engine's parameters.
    pub fn new(engine: &Engine, cfg: &LlamaConfig) -> Result<Self> {
        let mut named = std::collections::HashMap::new();
        for p in engine.layout().params() {
            named.insert(p.name.clone(), engine.param_tensor(&p.name)?);
        }
        let vb = VarBuilder::from_tensors(named, DType::F32, engine.device());
        let layers = (0..cfg.n_layer)
            .map(|i| LayerModule::new(cfg, i, &vb))
            .collect::<Result<Vec<_>>>()?;
        let head = HeadModule {
            norm: RmsNorm::new(&vb, "model.norm", cfg.n_embd, cfg.rms_norm_eps)?,
            lm_head: vb.get((cfg.vocab_size, cfg.n_embd), super::blocks::head_name(cfg))?,
        };
        Ok(Self {
            cfg: *cfg,
            embed: vb.get((cfg.vocab_size, cfg.n_embd), "model.embed_tokens.weight")?,
            layers,
            head,
            cache: vec![None; cfg.n_layer],
            pos: 0,
        })
    }

    /// Tokens seen so far (the cache's length).
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Forget the cache.
    pub fn reset(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = None);
        self.pos = 0;
    }

    /// Feed `ids` (at positions len()..); returns their logits (t, V) f32.
    pub fn step(&mut self, ids: &[u32]) -> Result<Tensor> {
        let t = ids.len();
        if t == 0 {
            bail!("no tokens to feed")
        }
        crate::common::blocks::check_context(self.pos + t, self.cfg.block_size)?;
        let idx = Tensor::from_slice(ids, t, self.embed.device())?;
        let mut x = self.embed.index_select(&idx, 0)?.unsqueeze(0)?; // (1, t, C)
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.input_layernorm.forward(&x)?;
            let (q, k, v) = layer.qk_rope(&h, self.pos)?; // (1, t, C), (1, t, KV) x 2
            let (k, v) = match self.cache[l].take() {
                Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 1)?, Tensor::cat(&[&vc, &v], 1)?),
                None => (k, v),
            };
            let y = self.attend(&q, &k, &v)?; // (1, t, C)
            self.cache[l] = Some((k, v));
            x = (x + phalanx::ops::linear(&y, &layer.o, None)?)?;
            let h2 = layer.post_attention_layernorm.forward(&x)?;
            x = (&x + layer.mlp(&h2)?)?;
        }
        self.pos += t;
        self.head.logits(&x)?.squeeze(0)?.to_dtype(DType::F32) // (t, V)
    }

    /// Causal attention of the new queries q (1, t, C) over all keys and
    /// values (1, T, KV), T = pos + t: query i sits at position pos + i.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (nh, nkv, d) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim());
        let (_, t, c) = q.dims3()?;
        let tk = k.dim(1)?;
        let rep = self.cfg.n_rep();
        let heads = |x: &Tensor, len: usize| -> Result<Tensor> {
            x.reshape((1, len, nh, d))?.transpose(1, 2)?.contiguous() // (1, nh, len, d)
        };
        let q = heads(q, t)?;
        let k = heads(&repeat_kv(k, nkv, rep)?, tk)?;
        let v = heads(&repeat_kv(v, nkv, rep)?, tk)?;
        let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?; // (1, nh, t, T)
        let past = tk - t;
        let mask: Vec<f32> = (0..t * tk)
            .map(|ij| {
                let (i, j) = (ij / tk, ij % tk);
                if j > past + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, tk), q.device())?.to_dtype(s.dtype())?;
        let p = candle_nn::ops::softmax(&s.broadcast_add(&mask)?, D::Minus1)?;
        p.matmul(&v)?.transpose(1, 2)?.reshape((1, t, c)) // (1, t, C)
    }
}

/// [`Generator`] as generation's [`Decoder`]: the prompt's tail that fits
/// is fed in pieces of `prefill_chunk` tokens, then one token per step;
/// when the context is full the cache restarts on the latest half (rotary
/// positions restart too, as a fresh forward of that window would).
pub struct CachedDecoder {
    g: Generator,
    context: usize,
    started: bool,
    chunk: usize,
}

/// Prompt tokens fed at once: a prompt of t tokens at once holds
/// (heads, t, t) scores, 68 GB for 131072 tokens of a 32-head model; in
/// pieces of 128 the scores are (heads, 128, T) and the work the same.
pub const PREFILL_CHUNK: usize = 128;

impl CachedDecoder {
    pub fn new(engine: &Engine, cfg: &LlamaConfig) -> Result<Self> {
        Ok(Self {
            g: Generator::new(engine, cfg)?,
            context: cfg.block_size,
            started: false,
            chunk: PREFILL_CHUNK,
        })
    }

    /// Feed prompts in pieces of `n` tokens (at least 1).
    pub fn prefill_chunk(mut self, n: usize) -> Self {
        self.chunk = n.max(1);
        self
    }

    /// Feed `ids` in pieces; the last piece's logits.
    fn feed(&mut self, ids: &[u32]) -> Result<Tensor> {
        let mut last = None;
        for piece in ids.chunks(self.chunk) {
            last = Some(self.g.step(piece)?);
        }
        last.ok_or_else(|| candle_core::Error::Msg("no tokens to feed".into()))
    }
}

impl Decoder for CachedDecoder {
    fn next_logits(&mut self, ids: &[u32], next: u32) -> phalanx::Result<Vec<f32>> {
        let t = self.context;
        let logits = if !self.started {
            self.started = true;
            self.feed(&ids[ids.len().saturating_sub(t)..])?
        } else if self.g.len() == t {
            self.g.reset();
            self.feed(&ids[ids.len() - (t / 2).max(1)..])?
        } else {
            self.g.step(&[next])?
        };
        let n = logits.dim(0)?;
        Ok(logits.i(n - 1)?.to_vec1()?)
    }
}
