//! The Llama decoder layer as one op with an explicit forward and backward
//! (the fused GPT-2 layer's design, `gpt2::fused`), used by
//! [`super::blocks`] for f32 layers on CPU; Qwen2's q/k/v biases run
//! through it too.
//!
//! ```text
//! forward, x (N, C), N = B T; Q = n_head d, KV = n_kv_head d:
//!   h1 = rms(x) w1;  q = h1 Wq^T + bq (N, Q);  k, v = h1 Wk^T + bk, h1 Wv^T + bv (N, KV)
//!   q, k = rope(q), rope(k);  qkv = [q | repeat_kv(k) | repeat_kv(v)] (N, 3Q)
//!   att, P = causal_attention(qkv);  x1 = x + att Wo^T
//!   h2 = rms(x1) w2;  g, u = h2 Wg^T, h2 Wu^T (N, M);  s = silu(g) u;  y = x1 + s Wd^T
//! backward, dy -> dx, in reverse:
//!   ds = dy Wd;  dg, du = swiglu'(g, u, ds);  dh2 = dg Wg + du Wu
//!   dx1 = rms'(x1, dh2) + dy;  dqkv = attention'(dx1 Wo);  dq = rope^-1(dqkv_q)
//!   dk, dv = rope^-1(sum of each kv head's repeats), sum of repeats
//!   dx = rms'(x, dq Wq + dk Wk + dv Wv) + dx1
//! ```
//!
//! The nine weight gradients (dW = dout^T in) and the biases' go to the
//! weight-gradient tape (`phalanx::ops::tape`) as one piece of work; the
//! norms' gains are given by their kernel with dx. The kernels are the ones
//! the composed layer runs (same RMSNorm, rotary, SwiGLU and attention code,
//! in the same order), so the two agree to float rounding: the composed
//! layer with candle autograd is the reference (`tests/llama_direct.rs`).
//!
//! Why: composed, the layer is ~20 graph nodes, each activation a fresh
//! allocation and each input's gradient a zero-filled tensor candle adds
//! into; here activations live in the thread's reused buffers
//! (`phalanx::ops::buffers`), and with more than one pool thread each
//! share of the batch runs a whole pass on its own thread
//! (`common::direct::run_parts`).
//!
//! `PHALANX_FUSED_LAYER=0` turns it off (the composed layer then runs).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use phalanx::engine::DirectBackward;
use phalanx::ops::buffers::{self, Buf};
use phalanx::ops::cpu::{add_assign, cpu_f32, storage_in, tensor_in, with_f32_any};
use phalanx::ops::tape::{self, DeferredGrad};
use phalanx::ops::{self as k};
use phalanx::simd_dispatch;

use super::config::LlamaConfig;
use super::ops::{rms_row_bwd, rms_row_fwd, swiglu_bwd, swiglu_fwd};
use crate::common::direct::{
    batch_parts, bf16_weights, run_parts, slots_by_param, split_parts, split_parts_mut,
    weight_grads, weight_grads_into, WeightGrad,
};

const WHAT: &str = "direct Llama layer";

/// The layer's parameters, in this order: input_layernorm, q_proj, k_proj,
/// v_proj, o_proj, post_attention_layernorm, gate_proj, up_proj,
/// down_proj; then, under `qkv_bias`, the q, k and v biases.
pub(crate) type Params = Vec<Tensor>;

const LN1: usize = 0;
const WQ: usize = 1;
const WK: usize = 2;
const WV: usize = 3;
const WO: usize = 4;
const LN2: usize = 5;
const WG: usize = 6;
const WU: usize = 7;
const WD: usize = 8;
const BQ: usize = 9;

/// The shapes: batch, time, model width, heads, kv heads, head size, MLP width.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    m: usize,
}

impl Dims {
    fn q(&self) -> usize {
        self.nh * self.d
    }
    fn kv(&self) -> usize {
        self.nkv * self.d
    }
    fn n(&self) -> usize {
        self.b * self.t
    }
    /// The same layer on `b / parts` batch elements.
    fn part(self, parts: usize) -> Self {
        Self {
            b: self.b / parts,
            ..self
        }
    }
}

/// What the forward keeps, in this order: h1 (N, C); qkv (N, 3Q), rotated
/// and with kv repeated; the probabilities (B, nh, T, T); att (N, Q); x1,
/// h2 (N, C); g, u, s (N, M).
struct Acts {
    bufs: [Buf; 9],
}

struct DirectLayer {
    /// `None` between a ZeRO-3 forward and its backward.
    p: Option<Params>,
    cfg: LlamaConfig,
    acts: Mutex<Option<Acts>>,
}

/// Rotary tables cos, sin (T, d/2) for positions 0..T.
fn rope_tables(inv: &[f32], t: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(t * inv.len());
    let mut sin = Vec::with_capacity(t * inv.len());
    for p in 0..t {
        for f in inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// Rotates each d-wide head of every token row of `x` (N, heads d), token
/// r at position r % T, by +angle (`sign` 1) or -angle (-1), in place:
/// HF's rotate-half pairs (i, i + d/2), computed as `ops::rope` does.
#[inline(always)]
fn rope_rows(x: &mut [f32], dm: Dims, heads: usize, (cos, sin): (&[f32], &[f32]), sign: f32) {
    let h2 = dm.d / 2;
    for (r, row) in x.chunks_exact_mut(heads * dm.d).enumerate() {
        let pos = r % dm.t;
        let (c, s) = (&cos[pos * h2..][..h2], &sin[pos * h2..][..h2]);
        for head in row.chunks_exact_mut(dm.d) {
            for i in 0..h2 {
                let (a, b, si) = (head[i], head[i + h2], sign * s[i]);
                head[i] = a * c[i] - b * si;
                head[i + h2] = b * c[i] + a * si;
            }
        }
    }
}

/// The forward on one share of the batch: `a` the activations' rows
/// (every element written), `y` the output's.
fn forward_part(
    x: &[f32],
    a: [&mut [f32]; 9],
    y: &mut [f32],
    p: &[&[f32]],
    dm: Dims,
    eps: f32,
    tables: (&[f32], &[f32]),
) {
    let [h1, qkv, probs, att, x1, h2, g, u, s] = a;
    let (n, c, q, kv, m) = (dm.n(), dm.c, dm.q(), dm.kv(), dm.m);
    let bias = |i: usize| p.get(BQ + i).copied();
    for (x, h) in x.chunks_exact(c).zip(h1.chunks_exact_mut(c)) {
        simd_dispatch!(rms_row_fwd(x, p[LN1], h, eps));
    }
    let mut qb = buffers::take(n * q);
    let mut kb = buffers::take(n * kv);
    let mut vb = buffers::take(n * kv);
    k::linear_forward(h1, p[WQ], bias(0), (n, c, q), &mut qb);
    k::linear_forward(h1, p[WK], bias(1), (n, c, kv), &mut kb);
    k::linear_forward(h1, p[WV], bias(2), (n, c, kv), &mut vb);
    simd_dispatch!(rope_rows(&mut qb, dm, dm.nh, tables, 1.0));
    simd_dispatch!(rope_rows(&mut kb, dm, dm.nkv, tables, 1.0));
    // [q | repeat_kv(k) | repeat_kv(v)]: query head j reads kv head j / rep.
    let (d, rep) = (dm.d, dm.nh / dm.nkv);
    for r in 0..n {
        let row = &mut qkv[r * 3 * q..(r + 1) * 3 * q];
        row[..q].copy_from_slice(&qb[r * q..(r + 1) * q]);
        for j in 0..dm.nh {
            let src = r * kv + (j / rep) * d;
            row[q + j * d..q + (j + 1) * d].copy_from_slice(&kb[src..src + d]);
            row[2 * q + j * d..2 * q + (j + 1) * d].copy_from_slice(&vb[src..src + d]);
        }
    }
    drop((qb, kb, vb));
    k::attention_forward(qkv, (dm.b, dm.t, q, dm.nh), att, probs);
    k::linear_forward(att, p[WO], None, (n, q, c), x1);
    add_assign(x1, x);
    for (x, h) in x1.chunks_exact(c).zip(h2.chunks_exact_mut(c)) {
        simd_dispatch!(rms_row_fwd(x, p[LN2], h, eps));
    }
    k::linear_forward(h2, p[WG], None, (n, c, m), g);
    k::linear_forward(h2, p[WU], None, (n, c, m), u);
    simd_dispatch!(swiglu_fwd(g, u, s));
    k::linear_forward(s, p[WD], None, (n, m, c), y);
    add_assign(y, x1);
}

// What the backward writes for the weight pass, by index into `Grads::bufs`.
const DG: usize = 0; // (N, M)
const DU: usize = 1; // (N, M)
const DX1: usize = 2; // (N, C)
const DQ: usize = 3; // (N, Q)
const DK: usize = 4; // (N, KV)
const DV: usize = 5; // (N, KV)

/// The input-gradient pass on one share: dx and the weight pass's output
/// gradients; returns the two norms' gain gradients over these rows.
fn backward_part(
    (x, dy, a): (&[f32], &[f32], [&[f32]; 9]),
    w: [&mut [f32]; 6],
    dx: &mut [f32],
    p: &[&[f32]],
    dm: Dims,
    eps: f32,
    tables: (&[f32], &[f32]),
) -> [Vec<f32>; 2] {
    let (n, c, q, kv, m) = (dm.n(), dm.c, dm.q(), dm.kv(), dm.m);
    let [_h1, qkv, probs, _att, x1, _h2, g, u, _s] = a;
    let [dg, du, dx1, dq, dk, dv] = w;
    let (mut dw1, mut dw2) = (vec![0f32; c], vec![0f32; c]);
    // y = x1 + s Wd^T;  s = silu(g) u
    let mut ds = buffers::take(n * m);
    k::linear_backward_input(dy, p[WD], (n, m, c), &mut ds);
    simd_dispatch!(swiglu_bwd(&ds, g, u, dg, du));
    drop(ds);
    // g, u = h2 Wg^T, h2 Wu^T;  h2 = rms(x1)
    let mut dh = buffers::take(n * c);
    k::linear_backward_input(dg, p[WG], (n, c, m), &mut dh);
    k::linear_backward_input_acc(du, p[WU], (n, c, m), &mut dh);
    for ((x, d), o) in x1
        .chunks_exact(c)
        .zip(dh.chunks_exact(c))
        .zip(dx1.chunks_exact_mut(c))
    {
        simd_dispatch!(rms_row_bwd(x, p[LN2], d, o, &mut dw2, eps));
    }
    add_assign(dx1, dy); // the residual's share
                         // x1 = x + att Wo^T
    let mut datt = buffers::take(n * q);
    k::linear_backward_input(dx1, p[WO], (n, q, c), &mut datt);
    let mut dqkv = buffers::take(n * 3 * q);
    k::attention_backward(qkv, &datt, probs, (dm.b, dm.t, q, dm.nh), &mut dqkv);
    drop(datt);
    // Each kv head's gradient sums its query heads' (repeat_kv's backward).
    let (d, rep) = (dm.d, dm.nh / dm.nkv);
    for r in 0..n {
        let row = &dqkv[r * 3 * q..(r + 1) * 3 * q];
        dq[r * q..(r + 1) * q].copy_from_slice(&row[..q]);
        let (dkr, dvr) = (&mut dk[r * kv..(r + 1) * kv], &mut dv[r * kv..(r + 1) * kv]);
        dkr.fill(0.0);
        dvr.fill(0.0);
        for j in 0..dm.nh {
            let o = (j / rep) * d;
            add_assign(&mut dkr[o..o + d], &row[q + j * d..q + (j + 1) * d]);
            add_assign(&mut dvr[o..o + d], &row[2 * q + j * d..2 * q + (j + 1) * d]);
        }
    }
    drop(dqkv);
    simd_dispatch!(rope_rows(dq, dm, dm.nh, tables, -1.0));
    simd_dispatch!(rope_rows(dk, dm, dm.nkv, tables, -1.0));
    // q, k, v = h1 W^T;  h1 = rms(x)
    k::linear_backward_input(dq, p[WQ], (n, c, q), &mut dh);
    k::linear_backward_input_acc(dk, p[WK], (n, c, kv), &mut dh);
    k::linear_backward_input_acc(dv, p[WV], (n, c, kv), &mut dh);
    for ((x, d), o) in x
        .chunks_exact(c)
        .zip(dh.chunks_exact(c))
        .zip(dx.chunks_exact_mut(c))
    {
        simd_dispatch!(rms_row_bwd(x, p[LN1], d, o, &mut dw1, eps));
    }
    add_assign(dx, dx1);
    [dw1, dw2]
}

impl DirectLayer {
    fn params(&self) -> Result<&Params> {
        match &self.p {
            Some(p) => Ok(p),
            None => bail!("{WHAT}: its parameters were released and not rebound"),
        }
    }

    fn dims(&self, b: usize, t: usize) -> Dims {
        let c = &self.cfg;
        Dims {
            b,
            t,
            c: c.n_embd,
            nh: c.n_head,
            nkv: c.n_kv_head,
            d: c.head_dim(),
            m: c.intermediate_size,
        }
    }

    fn eps(&self) -> f32 {
        self.cfg.rms_norm_eps as f32
    }

    /// dx from dy; the parameter gradients go to the tape.
    fn backward(&self, x_t: &Tensor, dy_t: &Tensor) -> Result<Tensor> {
        let Some(Acts { bufs: a }) = self.acts.lock().unwrap().take() else {
            bail!("{WHAT}: backward without forward activations (run it once per forward)")
        };
        if !tape::active() {
            bail!(
                "{WHAT}: its parameter gradients need the engine's weight-gradient tape (run \
                 it in a phalanx Stack, or set PHALANX_FUSED_LAYER=0)"
            )
        }
        let (b, t, _) = x_t.dims3()?;
        let dm = self.dims(b, t);
        let (n, c, q, kv, m) = (dm.n(), dm.c, dm.q(), dm.kv(), dm.m);
        let dy_t = dy_t.contiguous()?;
        let mut g = [n * m, n * m, n * c, n * q, n * kv, n * kv].map(buffers::take);
        let mut dx = vec![0f32; n * c];
        let parts = batch_parts(b);
        let tables = rope_tables(&self.cfg.inv_freq(), t);
        let tables = (&tables.0[..], &tables.1[..]);
        let bf16 = bf16_weights(self.params()?);
        let norms = k::cpu::with_bf16_products(bf16, || {
            with_f32_any(x_t, |x| {
                with_f32_any(&dy_t, |dy| {
                    crate::common::direct::with_f32_params(self.params()?, WHAT, |p| {
                        let acts = split_parts(a.each_ref().map(|b| &b[..]), parts);
                        let ins = split_parts([x, dy], parts);
                        let outs = split_parts_mut(g.each_mut().map(|b| &mut b[..]), parts);
                        let dxs = split_parts_mut([&mut dx[..]], parts);
                        let work: Vec<_> = ins.into_iter().zip(acts).zip(outs).zip(dxs).collect();
                        run_parts(work, |_, ((([x, dy], a), w), [dx])| {
                            backward_part((x, dy, a), w, dx, p, dm.part(parts), self.eps(), tables)
                        })
                    })
                })
            })
        })???;
        // The gains' gradients summed in part order: independent of timing.
        let (mut dw1, mut dw2) = (vec![0f32; c], vec![0f32; c]);
        for [g1, g2] in norms {
            add_assign(&mut dw1, &g1);
            add_assign(&mut dw2, &g2);
        }
        // The weight pass needs the linears' inputs (h1, att, h2, s) only.
        let [h1, _qkv, _probs, att, _x1, h2, _g, _u, s] = a;
        tape::defer(Box::new(LayerGrads {
            p: self.params()?.clone(),
            dm,
            dy: dy_t,
            outs: g,
            inputs: [h1, att, h2, s],
            norms: [(LN1, dw1), (LN2, dw2)],
        }));
        tensor_in(dx, x_t.dtype(), (b, t, c), x_t.device())
    }
}

impl CustomOp1 for DirectLayer {
    fn name(&self) -> &'static str {
        "phalanx-llama-layer"
    }

    fn cpu_fwd(&self, st: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        phalanx::ops::kernel_ran();
        let (b, t, _) = l.shape().dims3()?;
        let x = cpu_f32(st, l)?;
        let dm = self.dims(b, t);
        let (n, c, q, m) = (dm.n(), dm.c, dm.q(), dm.m);
        let sizes = [
            n * c,
            n * 3 * q,
            b * dm.nh * t * t,
            n * q,
            n * c,
            n * c,
            n * m,
            n * m,
            n * m,
        ];
        let mut a = sizes.map(buffers::take);
        let mut y = vec![0f32; n * c];
        let parts = batch_parts(b);
        let tables = rope_tables(&self.cfg.inv_freq(), t);
        let tables = (&tables.0[..], &tables.1[..]);
        let bf16 = bf16_weights(self.params()?);
        k::cpu::with_bf16_products(bf16, || {
            crate::common::direct::with_f32_params(self.params()?, WHAT, |p| {
                let acts = split_parts_mut(a.each_mut().map(|b| &mut b[..]), parts);
                let xs = split_parts([&x[..]], parts);
                let ys = split_parts_mut([&mut y[..]], parts);
                let work: Vec<_> = xs.into_iter().zip(acts).zip(ys).collect();
                run_parts(work, |_, (([x], a), [y])| {
                    forward_part(x, a, y, p, dm.part(parts), self.eps(), tables)
                });
            })
        })?;
        *self.acts.lock().unwrap() = Some(Acts { bufs: a });
        Ok((storage_in(st.dtype(), y)?, l.shape().clone()))
    }

    fn bwd(&self, x_t: &Tensor, _res: &Tensor, dy_t: &Tensor) -> Result<Option<Tensor>> {
        self.backward(x_t, dy_t).map(Some)
    }
}

/// The layer's parameter gradients, computed when the tape's work runs.
struct LayerGrads {
    p: Params,
    dm: Dims,
    dy: Tensor,
    /// dg, du, dx1, dq, dk, dv (`DG`..`DV`).
    outs: [Buf; 6],
    /// The linears' inputs: h1, att, h2, s.
    inputs: [Buf; 4],
    /// The norms' (index, gain gradient): their kernel gave them with dx.
    norms: [(usize, Vec<f32>); 2],
}

impl LayerGrads {
    /// The weight pass's seven linears as (weight index, bias index), in
    /// the order it runs them: down, gate, up, o, then q, k and v (with
    /// Qwen2's biases).
    fn linears(&self) -> [(usize, Option<usize>); 7] {
        let biased = self.p.len() > BQ;
        let bias = |i: usize| biased.then_some(BQ + i);
        [
            (WD, None),
            (WG, None),
            (WU, None),
            (WO, None),
            (WQ, bias(0)),
            (WK, bias(1)),
            (WV, bias(2)),
        ]
    }

    /// `f` on what the weight pass's linears ([`LayerGrads::linears`])
    /// read, under the layer's product precision.
    fn with_linears<R>(&self, f: impl FnOnce(&[WeightGrad]) -> R) -> Result<R> {
        let dm = self.dm;
        let (c, q, kv, m) = (dm.c, dm.q(), dm.kv(), dm.m);
        let [h1, att, h2, s] = &self.inputs;
        let o = &self.outs;
        k::cpu::with_bf16_products(bf16_weights(&self.p), || {
            with_f32_any(&self.dy, |dy| {
                // (input, output gradient, out, in), in linears()' order.
                let reads: [(&[f32], &[f32], usize, usize); 7] = [
                    (s, dy, c, m),
                    (h2, &o[DG], m, c),
                    (h2, &o[DU], m, c),
                    (att, &o[DX1], c, q),
                    (h1, &o[DQ], q, c),
                    (h1, &o[DK], kv, c),
                    (h1, &o[DV], kv, c),
                ];
                let lins: Vec<WeightGrad> = (self.linears().iter().zip(reads))
                    .map(|(&(_, bias), (x, d, out, inp))| WeightGrad {
                        x,
                        d,
                        out,
                        inp,
                        bias: bias.is_some(),
                    })
                    .collect();
                f(&lins)
            })
        })
    }

    /// The parameters' indices in the order `compute` returns them and
    /// `accumulate_into` takes their slots: each linear's weight (and
    /// bias), then the norms' gains.
    fn order(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .linears()
            .into_iter()
            .flat_map(|(w, b)| std::iter::once(w).chain(b))
            .collect();
        v.extend(self.norms.iter().map(|(i, _)| *i));
        v
    }
}

impl DeferredGrad for LayerGrads {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let n = self.dm.n();
        let dev = self.dy.device();
        let mut grads = self.with_linears(|lins| weight_grads(n, lins))?;
        let mut vals = Vec::with_capacity(self.p.len());
        for (dw, db) in grads.drain(..) {
            vals.push(dw);
            if !db.is_empty() {
                vals.push(db);
            }
        }
        vals.extend(self.norms.iter().map(|(_, g)| g.clone()));
        // Each gradient in its weight's dtype (the contract): an fp16
        // weight's gradient past 65504 becomes the inf the loss scaler
        // skips on, as on the composed path.
        self.order()
            .into_iter()
            .zip(vals)
            .map(|(i, v)| {
                let p = &self.p[i];
                Ok((p.clone(), tensor_in(v, p.dtype(), p.shape(), dev)?))
            })
            .collect()
    }

    fn targets(&self) -> Option<Vec<&Tensor>> {
        Some(self.order().into_iter().map(|i| &self.p[i]).collect())
    }

    fn accumulate_into(&self, slots: Vec<&mut [f32]>) -> Result<()> {
        let order = self.order();
        let mut by_param = slots_by_param(self.p.len(), &order, slots, &self.norms, WHAT)?;
        let n = self.dm.n();
        self.with_linears(|lins| {
            let dst = self.linears().into_iter().map(|(wi, bi)| {
                let dw = by_param[wi].take().expect("every slot given");
                let db = bi.map_or(Default::default(), |b| {
                    by_param[b].take().expect("every slot given")
                });
                (dw, db)
            });
            weight_grads_into(n, lins, dst.collect())
        })
    }

    fn kept(&self) -> Vec<&Tensor> {
        vec![&self.dy]
    }

    fn kept_buffer_bytes(&self) -> usize {
        let a: usize = self.inputs.iter().chain(&self.outs).map(|b| b.len()).sum();
        4 * a
    }
}

/// The layer's backward for the engine's direct path: the op, and its input.
struct Direct {
    op: DirectLayer,
    x: Tensor,
}

impl DirectBackward for Direct {
    fn backward(self: Box<Self>, dy: &Tensor) -> Result<Tensor> {
        self.op.backward(&self.x, dy)
    }

    fn release_params(&mut self) -> bool {
        self.op.p = None;
        true
    }

    fn kept_bytes(&self) -> usize {
        let acts = self.op.acts.lock().unwrap();
        acts.as_ref()
            .map_or(0, |a| a.bufs.iter().map(|b| 4 * b.len()).sum())
    }

    fn rebind(&mut self, m: &dyn phalanx::engine::BlockModule) -> Result<()> {
        let Some(v) = m.direct_params() else {
            bail!("{WHAT}: the rebuilt block has no direct parameters")
        };
        check_params(&v, &self.op.cfg)?;
        self.op.p = Some(v);
        Ok(())
    }
}

fn check_params(p: &Params, cfg: &LlamaConfig) -> Result<()> {
    let want = if cfg.qkv_bias { BQ + 3 } else { BQ };
    if p.len() != want {
        bail!("{WHAT}: {} parameters, not {want}", p.len())
    }
    Ok(())
}

fn op(p: Params, cfg: &LlamaConfig) -> Result<DirectLayer> {
    check_params(&p, cfg)?;
    Ok(DirectLayer {
        p: Some(p),
        cfg: *cfg,
        acts: Mutex::new(None),
    })
}

/// The layer on `x` (B, T, C), f32: one graph node whose input gradient is
/// computed by its backward and whose parameter gradients go to the tape.
pub(crate) fn layer(x: &Tensor, p: Params, cfg: &LlamaConfig) -> Result<Tensor> {
    x.contiguous()?.apply_op1(op(p, cfg)?)
}

/// The layer on `x` with no graph node: the output, and its backward for
/// the engine to call (`BlockModule::forward_direct`).
pub(crate) fn layer_direct(
    x: &Tensor,
    p: Params,
    cfg: &LlamaConfig,
) -> Result<(Tensor, Box<dyn DirectBackward>)> {
    let op = op(p, cfg)?;
    let x = x.contiguous()?;
    let y = x.apply_op1_no_bwd(&op)?;
    Ok((y, Box::new(Direct { op, x })))
}
