//! The GPT-2 transformer layer as one op with an explicit forward and
//! backward (llm.c's layer: one pass of kernels each way over buffers the
//! layer owns), used by [`super::blocks`] for f32 layers on CPU.
//!
//!   forward, x (B, T, C):
//!     ln1 = LN(x);  qkv = ln1 Wa^T + ba (N, 3C);  att, P = attention(qkv)
//!     x1  = x + att Wo^T + bo;  ln2 = LN(x1);  h = ln2 Wf^T + bf (N, 4C)
//!     g = gelu(h);  y = x1 + g Wp^T + bp
//!   backward, dy (N, C) -> dx, in reverse; the parameter gradients
//!     (dW = dout^T in, db = sum dout for the four linears; the LayerNorms'
//!     gains and biases) go to the weight-gradient tape (`phalanx::ops::tape`)
//!     that the engine runs every backward of such a block under. Run
//!     at once, that is the ordinary backward; run later, it is the
//!     zero-bubble W pass without recomputation.
//!
//! Why: with candle autograd the same layer is ~12 graph nodes, and candle's
//! backward gives each input of each node a freshly zero-filled gradient it
//! then adds into, and every activation is a fresh allocation. Here the
//! activations live in buffers the thread reuses every step
//! (`phalanx::ops::buffers`), and nothing is zero-filled or added twice.
//! The kernels are the ones the composed layer runs (same LayerNorm, GELU
//! and attention code, same order), so the two agree to float rounding.
//!
//! Threads: with more than one per rank, the batch is split into one share
//! per thread (when they divide it) and the forward and the input-gradient
//! pass run each share whole on its own thread (`ops::cpu::par_parts`): one
//! parallel region per pass instead of one per kernel. The LayerNorm gains'
//! gradients are summed over the shares in share order, so the result does
//! not depend on thread timing. The weight-gradient pass is one region too:
//! each thread takes a share of every dW's and db's output rows, summed
//! over all rows of the batch as unsplit.
//!
//! The engine runs the layer outside candle's graph
//! (`BlockModule::forward_direct`: `layer_direct`); `layer` is the same
//! op as a graph node, for whole-model autograd.
//!
//! `PHALANX_FUSED_LAYER=0` turns it off (the composed layer then runs).

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};
use phalanx::engine::DirectBackward;
use phalanx::ops::buffers::{self, Buf};
use phalanx::ops::cpu::{add_assign, cpu_f32};
use phalanx::ops::tape::{self, DeferredGrad};
use phalanx::ops::{self as k};

thread_local! {
    static OVERRIDE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether the fused layer is on: this thread's [`set_fused_layer`], else
/// `PHALANX_FUSED_LAYER` (default on).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    OVERRIDE.with(|o| o.get()).unwrap_or_else(|| {
        *ON.get_or_init(|| std::env::var("PHALANX_FUSED_LAYER").map_or(true, |v| v != "0"))
    })
}

/// Turns the fused f32 layer on or off for layers built on this thread
/// (`None`: back to `PHALANX_FUSED_LAYER`); for comparisons and tests.
pub fn set_fused_layer(on: Option<bool>) {
    OVERRIDE.with(|o| o.set(on));
}

/// The layer's parameters, in this order: ln_1 w, b; c_attn w (3C, C), b;
/// attn.c_proj w (C, C), b; ln_2 w, b; c_fc w (4C, C), b; mlp.c_proj w
/// (C, 4C), b.
pub(crate) type Params = [Tensor; 12];

const LN1_W: usize = 0;
const ATTN_W: usize = 2;
const PROJ_W: usize = 4;
const LN2_W: usize = 6;
const FC_W: usize = 8;
const MLP_W: usize = 10;

/// What the forward keeps for the backward.
struct Acts {
    ln1: Buf,   // (N, C)
    qkv: Buf,   // (N, 3C)
    probs: Buf, // (B, nh, T, T)
    att: Buf,   // (N, C)
    x1: Buf,    // (N, C)
    ln2: Buf,   // (N, C)
    h: Buf,     // (N, 4C)
    g: Buf,     // (N, 4C)
}

struct FusedLayer {
    /// `None` between a ZeRO-3 forward and its backward
    /// ([`DirectBackward::release_params`]).
    p: Option<Params>,
    n_head: usize,
    eps: f32,
    acts: Mutex<Option<Acts>>,
}

/// Runs `f` on the parameters as f32 slices (contiguous CPU f32 tensors).
fn with_params<R>(p: &Params, f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
    let held: Vec<_> = p.iter().map(|t| t.storage_and_layout()).collect();
    let mut s = Vec::with_capacity(held.len());
    for (st, l) in &held {
        match &**st {
            Storage::Cpu(CpuStorage::F32(v)) if l.is_contiguous() => {
                s.push(&v[l.start_offset()..l.start_offset() + l.shape().elem_count()])
            }
            _ => bail!("fused GPT-2 layer: parameters must be contiguous f32 on CPU"),
        }
    }
    Ok(f(&s))
}

impl CustomOp1 for FusedLayer {
    fn name(&self) -> &'static str {
        "phalanx-gpt2-layer"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, t, c) = l.shape().dims3()?;
        let x = cpu_f32(s, l)?;
        let (n, nh) = (b * t, self.n_head);
        let mut a = Acts {
            ln1: buffers::take(n * c),
            qkv: buffers::take(n * 3 * c),
            probs: buffers::take(b * nh * t * t),
            att: buffers::take(n * c),
            x1: buffers::take(n * c),
            ln2: buffers::take(n * c),
            h: buffers::take(n * 4 * c),
            g: buffers::take(n * 4 * c),
        };
        let mut y = vec![0f32; n * c];
        let parts = batch_parts(b);
        let bp = b / parts;
        // Each part: its batch elements' rows of every buffer.
        let sp = |v| split_mut(v, parts);
        let (mut ln1, mut qkv, mut probs) = (sp(&mut a.ln1), sp(&mut a.qkv), sp(&mut a.probs));
        let (mut att, mut x1, mut ln2) = (sp(&mut a.att), sp(&mut a.x1), sp(&mut a.ln2));
        let (mut h, mut g, mut ys) = (sp(&mut a.h), sp(&mut a.g), sp(&mut y));
        let work: Vec<_> = x
            .chunks(x.len() / parts)
            .map(|x| {
                Mutex::new(Some(Fwd {
                    x,
                    ln1: ln1.next().unwrap(),
                    qkv: qkv.next().unwrap(),
                    probs: probs.next().unwrap(),
                    att: att.next().unwrap(),
                    x1: x1.next().unwrap(),
                    ln2: ln2.next().unwrap(),
                    h: h.next().unwrap(),
                    g: g.next().unwrap(),
                    y: ys.next().unwrap(),
                }))
            })
            .collect();
        with_params(self.params()?, |p| {
            k::cpu::par_parts(parts, |i| {
                let f = work[i].lock().unwrap().take().expect("each part runs once");
                forward_part(f, p, (bp, t, c, nh), self.eps)
            })
        })?;
        *self.acts.lock().unwrap() = Some(a);
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x_t: &Tensor, _res: &Tensor, dy_t: &Tensor) -> Result<Option<Tensor>> {
        self.backward(x_t, dy_t).map(Some)
    }
}

impl FusedLayer {
    fn params(&self) -> Result<&Params> {
        match &self.p {
            Some(p) => Ok(p),
            None => bail!("fused GPT-2 layer: its parameters were released and not rebound"),
        }
    }

    /// dx from dy; the parameter gradients go to the tape.
    fn backward(&self, x_t: &Tensor, dy_t: &Tensor) -> Result<Tensor> {
        let Some(a) = self.acts.lock().unwrap().take() else {
            bail!(
                "fused GPT-2 layer: backward without forward activations (run it once per forward)"
            )
        };
        if !tape::active() {
            bail!(
                "fused GPT-2 layer: its parameter gradients need the engine's weight-gradient \
                 tape (run it in a phalanx Stack, or set PHALANX_FUSED_LAYER=0)"
            )
        }
        let (b, t, c) = x_t.dims3()?;
        let (n, nh, eps) = (b * t, self.n_head, self.eps);
        let dy_t = dy_t.contiguous()?;
        let mut w = LayerGrads {
            p: self.params()?.clone(),
            dims: (n, c),
            dy: dy_t.clone(),
            dh: buffers::take(n * 4 * c),
            dx1: Buf::default(),
            dqkv: buffers::take(n * 3 * c),
            ln: Vec::new(),
            inputs: None,
        };
        let parts = batch_parts(b);
        let bp = b / parts;
        let mut dx = vec![0f32; n * c];
        let mut dx1 = buffers::take(n * c);
        // The LayerNorms' gain and bias gradients, per part: summed below in
        // part order, so the result does not depend on thread timing.
        let ln_parts: Vec<Mutex<Option<Result<LnGrads>>>> =
            (0..parts).map(|_| Mutex::new(None)).collect();
        k::cpu::with_f32(x_t, |x| {
            k::cpu::with_f32(&dy_t, |dy| {
                with_params(self.params()?, |p| {
                    let sp = |v| split(v, parts);
                    let spm = |v| split_mut(v, parts);
                    let (mut dys, mut hs, mut x1s) = (sp(dy), sp(&a.h), sp(&a.x1));
                    let (mut qkvs, mut probs) = (sp(&a.qkv), sp(&a.probs));
                    let (mut dhs, mut dx1s) = (spm(&mut w.dh), spm(&mut dx1));
                    let (mut dqkvs, mut dxs) = (spm(&mut w.dqkv), spm(&mut dx));
                    let work: Vec<_> = sp(x)
                        .map(|x| {
                            Mutex::new(Some(Bwd {
                                x,
                                dy: dys.next().unwrap(),
                                h: hs.next().unwrap(),
                                x1: x1s.next().unwrap(),
                                qkv: qkvs.next().unwrap(),
                                probs: probs.next().unwrap(),
                                dh: dhs.next().unwrap(),
                                dx1: dx1s.next().unwrap(),
                                dqkv: dqkvs.next().unwrap(),
                                dx: dxs.next().unwrap(),
                            }))
                        })
                        .collect();
                    k::cpu::par_parts(parts, |i| {
                        let bw = work[i].lock().unwrap().take().expect("each part runs once");
                        let r = backward_part(bw, p, (bp, t, c, nh), eps);
                        *ln_parts[i].lock().unwrap() = Some(r);
                    })
                })
            })
        })???;
        let mut ln = [LN1_W, LN1_W + 1, LN2_W, LN2_W + 1].map(|i| (i, vec![0f32; c]));
        for part in ln_parts {
            let g = part.into_inner().unwrap().expect("every part ran")?;
            for ((_, sum), g) in ln.iter_mut().zip(g) {
                add_assign(sum, &g);
            }
        }
        w.dx1 = dx1;
        w.ln = ln.into();
        // W needs the linears' inputs only; qkv, P, x1 and h go back to
        // the pool now.
        w.inputs = Some([a.ln1, a.att, a.ln2, a.g]);
        tape::defer(Box::new(w));
        Tensor::from_vec(dx, (b, t, c), x_t.device())
    }
}

/// The layer's backward for the engine's direct path: the op, and the
/// input it ran on.
struct Direct {
    op: FusedLayer,
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

    fn rebind(&mut self, m: &dyn phalanx::engine::BlockModule) -> Result<()> {
        let Some(v) = m.direct_params() else {
            bail!("fused GPT-2 layer: the rebuilt block has no direct parameters")
        };
        let p: Params = v.try_into().map_err(|v: Vec<Tensor>| {
            candle_core::Error::Msg(format!(
                "fused GPT-2 layer: rebound with {} parameters, not 12",
                v.len()
            ))
        })?;
        self.op.p = Some(p);
        Ok(())
    }
}

/// How many parts to split a batch of `b` over: one per pool thread when
/// they divide it evenly (each then runs the whole layer on its share of
/// the batch), else 1 (the kernels then split their own work).
fn batch_parts(b: usize) -> usize {
    let threads = k::cpu::pool_threads();
    if threads > 1 && b.is_multiple_of(threads) {
        threads
    } else {
        1
    }
}

/// `v` in `parts` equal pieces (the batch parts' rows).
fn split(v: &[f32], parts: usize) -> std::slice::Chunks<'_, f32> {
    v.chunks(v.len() / parts)
}

/// `v` in `parts` equal mutable pieces.
fn split_mut(v: &mut [f32], parts: usize) -> std::slice::ChunksMut<'_, f32> {
    let len = v.len() / parts;
    v.chunks_mut(len)
}

/// One part's rows of the forward's input, activations and output.
struct Fwd<'a> {
    x: &'a [f32],
    ln1: &'a mut [f32],
    qkv: &'a mut [f32],
    probs: &'a mut [f32],
    att: &'a mut [f32],
    x1: &'a mut [f32],
    ln2: &'a mut [f32],
    h: &'a mut [f32],
    g: &'a mut [f32],
    y: &'a mut [f32],
}

/// The forward on `b` batch elements (every element of the outputs written).
fn forward_part(a: Fwd, p: &[&[f32]], (b, t, c, nh): (usize, usize, usize, usize), eps: f32) {
    let n = b * t;
    k::layer_norm_forward(a.x, p[LN1_W], p[LN1_W + 1], eps, a.ln1);
    let lin = (n, c, 3 * c);
    k::linear_forward(a.ln1, p[ATTN_W], Some(p[ATTN_W + 1]), lin, a.qkv);
    k::attention_forward(a.qkv, (b, t, c, nh), a.att, a.probs);
    let lin = (n, c, c);
    k::linear_forward(a.att, p[PROJ_W], Some(p[PROJ_W + 1]), lin, a.x1);
    add_assign(a.x1, a.x); // x1 = x + proj (the composed layer's add)
    k::layer_norm_forward(a.x1, p[LN2_W], p[LN2_W + 1], eps, a.ln2);
    let lin = (n, c, 4 * c);
    k::linear_forward(a.ln2, p[FC_W], Some(p[FC_W + 1]), lin, a.h);
    k::gelu_forward(a.h, a.g);
    let lin = (n, 4 * c, c);
    k::linear_forward(a.g, p[MLP_W], Some(p[MLP_W + 1]), lin, a.y);
    add_assign(a.y, a.x1);
}

/// One part's rows of what the backward reads and writes.
struct Bwd<'a> {
    x: &'a [f32],
    dy: &'a [f32],
    h: &'a [f32],
    x1: &'a [f32],
    qkv: &'a [f32],
    probs: &'a [f32],
    dh: &'a mut [f32],
    dx1: &'a mut [f32],
    dqkv: &'a mut [f32],
    dx: &'a mut [f32],
}

/// The LayerNorms' gradients: ln_1 gain, bias; ln_2 gain, bias.
type LnGrads = [Vec<f32>; 4];

/// The input-gradient pass on `b` batch elements: dx, and what the
/// weight gradients need (dh, dx1, dqkv); returns the LayerNorms'
/// gradients over these rows.
fn backward_part(
    a: Bwd,
    p: &[&[f32]],
    (b, t, c, nh): (usize, usize, usize, usize),
    eps: f32,
) -> Result<LnGrads> {
    let n = b * t;
    let [mut dw1, mut db1, mut dw2, mut db2] = std::array::from_fn(|_| vec![0f32; c]);
    // y = x1 + g Wp^T + bp
    let mut dg = buffers::take(n * 4 * c);
    k::linear_backward_input(a.dy, p[MLP_W], (n, 4 * c, c), &mut dg);
    k::gelu_backward(a.h, &dg, a.dh);
    drop(dg);
    // h = ln2 Wf^T + bf;  ln2 = LN(x1)
    let mut dln2 = buffers::take(n * c);
    k::linear_backward_input(a.dh, p[FC_W], (n, c, 4 * c), &mut dln2);
    k::layer_norm_backward_into(a.x1, p[LN2_W], &dln2, eps, a.dx1, &mut dw2, &mut db2)?;
    drop(dln2);
    // The residual's share; then x1 = x + att Wo^T + bo.
    add_assign(a.dx1, a.dy);
    let mut datt = buffers::take(n * c);
    k::linear_backward_input(a.dx1, p[PROJ_W], (n, c, c), &mut datt);
    k::attention_backward(a.qkv, &datt, a.probs, (b, t, c, nh), a.dqkv);
    drop(datt);
    // qkv = ln1 Wa^T + ba;  ln1 = LN(x)
    let mut dln1 = buffers::take(n * c);
    k::linear_backward_input(a.dqkv, p[ATTN_W], (n, c, 3 * c), &mut dln1);
    k::layer_norm_backward_into(a.x, p[LN1_W], &dln1, eps, a.dx, &mut dw1, &mut db1)?;
    add_assign(a.dx, a.dx1); // and the residual's
    Ok([dw1, db1, dw2, db2])
}

/// (weight index, its input, the output gradient, out, in) of a linear.
type Lin<'a> = (usize, &'a [f32], &'a [f32], usize, usize);

/// The layer's parameter gradients, computed when the tape's work runs.
struct LayerGrads {
    p: Params,
    dims: (usize, usize),
    dy: Tensor,
    dh: Buf,
    dx1: Buf,
    dqkv: Buf,
    /// The LayerNorms' (index, gradient): their kernel gives them with dx.
    ln: Vec<(usize, Vec<f32>)>,
    /// The inputs of the four linears: ln1, att, ln2, g.
    inputs: Option<[Buf; 4]>,
}

impl DeferredGrad for LayerGrads {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let (n, c) = self.dims;
        let [ln1, att, ln2, g] = self.inputs.as_ref().expect("set before deferral");
        let dev = self.dy.device();
        let mut out = Vec::with_capacity(12);
        let mut push = |i: usize, v: Vec<f32>| -> Result<()> {
            let t = Tensor::from_vec(v, self.p[i].shape(), dev)?;
            out.push((self.p[i].clone(), t));
            Ok(())
        };
        k::cpu::with_f32(&self.dy, |dy| -> Result<()> {
            let linears: [Lin; 4] = [
                (MLP_W, g, dy, c, 4 * c),
                (FC_W, ln2, &self.dh, 4 * c, c),
                (PROJ_W, att, &self.dx1, c, c),
                (ATTN_W, ln1, &self.dqkv, 3 * c, c),
            ];
            // One parallel region for the whole pass: each thread computes
            // its share of every dW's and db's output rows, over all rows of
            // the batch (so each element's sum is the unsplit one).
            let parts = k::cpu::pool_threads().min(c);
            let mut grads: Vec<(Vec<f32>, Vec<f32>)> = linears
                .iter()
                .map(|l| (vec![0f32; l.3 * l.4], vec![0f32; l.3]))
                .collect();
            let mut shares: Vec<Vec<(&mut [f32], &mut [f32])>> =
                (0..parts).map(|_| Vec::new()).collect();
            for ((dw, db), l) in grads.iter_mut().zip(&linears) {
                let (o, inp) = (l.3, l.4);
                let (mut dw, mut db) = (&mut dw[..], &mut db[..]);
                for (p, share) in shares.iter_mut().enumerate() {
                    let rows = o * (p + 1) / parts - o * p / parts;
                    let (w0, w1) = std::mem::take(&mut dw).split_at_mut(rows * inp);
                    let (b0, b1) = std::mem::take(&mut db).split_at_mut(rows);
                    share.push((w0, b0));
                    (dw, db) = (w1, b1);
                }
            }
            let work: Vec<_> = shares.into_iter().map(|s| Mutex::new(Some(s))).collect();
            k::cpu::par_parts(parts, |p| {
                let share = work[p].lock().unwrap().take().expect("each part runs once");
                for (&(_, x, d, o, inp), (dw, db)) in linears.iter().zip(share) {
                    let o0 = o * p / parts;
                    k::linear_backward_weight_rows(x, d, (n, inp, o), o0, dw);
                    k::linear_backward_bias_cols(d, o, o0, db);
                }
            });
            for ((dw, db), (i, ..)) in grads.into_iter().zip(linears) {
                push(i, dw)?;
                push(i + 1, db)?;
            }
            Ok(())
        })??;
        for (i, g) in &self.ln {
            push(*i, g.clone())?;
        }
        Ok(out)
    }

    fn kept(&self) -> Vec<&Tensor> {
        vec![&self.dy]
    }

    fn kept_buffer_bytes(&self) -> usize {
        let a: usize = self.inputs.iter().flatten().map(|b| b.len()).sum();
        4 * (a + self.dh.len() + self.dx1.len() + self.dqkv.len())
    }
}

/// The layer on `x` (B, T, C), f32: one graph node whose input gradient is
/// computed by its backward and whose parameter gradients go to the tape.
pub(crate) fn layer(x: &Tensor, p: Params, n_head: usize, eps: f32) -> Result<Tensor> {
    x.contiguous()?.apply_op1(FusedLayer {
        p: Some(p),
        n_head,
        eps,
        acts: Mutex::new(None),
    })
}

/// The layer on `x` with no graph node: the output, and its backward for
/// the engine to call (`BlockModule::forward_direct`).
pub(crate) fn layer_direct(
    x: &Tensor,
    p: Params,
    n_head: usize,
    eps: f32,
) -> Result<(Tensor, Box<dyn DirectBackward>)> {
    let op = FusedLayer {
        p: Some(p),
        n_head,
        eps,
        acts: Mutex::new(None),
    };
    let x = x.contiguous()?;
    let y = x.apply_op1_no_bwd(&op)?;
    Ok((y, Box::new(Direct { op, x })))
}
