//! The GPT-2 transformer layer as one op with an explicit forward and
//! backward (llm.c's layer: one pass of kernels each way over buffers the
//! layer owns), used by [`super::blocks`] for layers on CPU in f32, bf16 or
//! f16 (parameters and input all of one dtype).
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
//! Half precision (`train.precision = bf16 | fp16`): the kernels stay f32
//! (f32 accumulation, as the f32 layer); the op converts at its boundary
//! ([`super::fused_half`]). The parameters are widened to f32 once per
//! call into pooled buffers; x is widened and y narrowed to x's dtype by
//! each batch part; dx is returned in x's dtype and each parameter
//! gradient goes to the tape in its parameter's dtype. Nothing in between
//! is rounded to half (the residual adds, every activation the next kernel
//! reads), so the fused layer is more accurate than the composed one.
//!
//! The activations kept for the backward (and the W pass) are stored in
//! x's dtype, half the bytes of f32, for a few percent of the layer's
//! time (the measurements, and why: [`super::fused_half`]).
//!
//! `PHALANX_FUSED_LAYER=0` turns it off (the composed layer then runs).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use phalanx::engine::DirectBackward;
use phalanx::ops::buffers::{self, Buf};
use phalanx::ops::cpu::add_assign;
use phalanx::ops::tape::{self, DeferredGrad};
use phalanx::ops::{self as k};

use super::fused_half::{self as half_io, with_src, Dst, Kept, Src};

pub(crate) use crate::common::direct::enabled;
pub use crate::common::direct::set_fused_layer;
use crate::common::direct::{
    batch_parts, bf16_weights, pieces, slots_by_param, weight_grads, weight_grads_into, WeightGrad,
};

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

/// The activations the forward computes and the backward reads, one `T`
/// each: their sizes, f32 buffers, what is kept, a part's rows.
#[derive(Clone, Copy)]
struct Acts<T> {
    ln1: T,   // (N, C)
    qkv: T,   // (N, 3C)
    probs: T, // (B, nh, T, T)
    att: T,   // (N, C)
    x1: T,    // (N, C)
    ln2: T,   // (N, C)
    h: T,     // (N, 4C)
    g: T,     // (N, 4C)
}

impl<T> Acts<T> {
    fn map<U>(self, mut f: impl FnMut(T) -> U) -> Acts<U> {
        Acts {
            ln1: f(self.ln1),
            qkv: f(self.qkv),
            probs: f(self.probs),
            att: f(self.att),
            x1: f(self.x1),
            ln2: f(self.ln2),
            h: f(self.h),
            g: f(self.g),
        }
    }

    fn as_mut(&mut self) -> Acts<&mut T> {
        Acts {
            ln1: &mut self.ln1,
            qkv: &mut self.qkv,
            probs: &mut self.probs,
            att: &mut self.att,
            x1: &mut self.x1,
            ln2: &mut self.ln2,
            h: &mut self.h,
            g: &mut self.g,
        }
    }
}

impl<T> Acts<Vec<T>> {
    /// `parts` pieces each -> each part's pieces.
    fn per_part(self, parts: usize) -> Vec<Acts<T>> {
        let mut it = self.map(Vec::into_iter);
        let mut next = |i: &mut std::vec::IntoIter<T>| i.next().expect("a piece per part");
        (0..parts).map(|_| it.as_mut().map(&mut next)).collect()
    }
}

/// The activations' sizes.
fn sizes(b: usize, t: usize, c: usize, nh: usize) -> Acts<usize> {
    let n = b * t;
    Acts {
        ln1: n * c,
        qkv: n * 3 * c,
        probs: b * nh * t * t,
        att: n * c,
        x1: n * c,
        ln2: n * c,
        h: n * 4 * c,
        g: n * 4 * c,
    }
}

struct FusedLayer {
    /// `None` between a ZeRO-3 forward and its backward
    /// ([`DirectBackward::release_params`]).
    p: Option<Params>,
    n_head: usize,
    eps: f32,
    acts: Mutex<Option<Acts<Kept>>>,
}

/// Runs `f` on the parameters as f32 slices (CPU tensors; half ones are
/// widened into pooled buffers, once per call).
fn with_params<R>(p: &Params, f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
    crate::common::direct::with_f32_params(p, "fused GPT-2 layer", f)
}

impl CustomOp1 for FusedLayer {
    fn name(&self) -> &'static str {
        "phalanx-gpt2-layer"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        phalanx::ops::kernel_ran();
        let (b, t, c) = l.shape().dims3()?;
        let (dtype, nh) = (s.dtype(), self.n_head);
        let x = Src::of(s, l)?;
        let size = sizes(b, t, c, nh);
        let mut y = half_io::Output::new(dtype, b * t * c)?;
        // f32 buffers for every activation (kept as they are for f32), and
        // for half, the half ones each part narrows them into.
        let mut a = size.map(buffers::take);
        let mut half = match dtype {
            DType::F32 => None,
            _ => Some(size.map(|len| Kept::half(dtype, len))),
        };
        let mut xs = x.scratch();
        let parts = batch_parts(b);
        let bp = b / parts;
        // Each part: its batch elements' rows of every buffer.
        let acts = a.as_mut().map(|v| pieces(v, parts)).per_part(parts);
        let keeps = match &mut half {
            Some(h) => h.as_mut().map(|k| k.dsts(parts)).per_part(parts),
            None => Vec::new(),
        };
        let (mut keeps, mut xss) = (keeps.into_iter(), pieces(&mut xs, parts).into_iter());
        let work: Vec<_> = x
            .pieces(parts)
            .into_iter()
            .zip(acts)
            .zip(y.pieces(parts))
            .map(|((x, a), (y, y_half))| {
                Mutex::new(Some(Fwd {
                    x,
                    xs: xss.next().unwrap(),
                    a,
                    keep: keeps.next(),
                    y,
                    y_half,
                }))
            })
            .collect();
        let bf16 = bf16_weights(self.params()?);
        k::cpu::with_bf16_products(bf16, || {
            with_params(self.params()?, |p| {
                k::cpu::par_parts(parts, |i| {
                    let f = work[i].lock().unwrap().take().expect("each part runs once");
                    forward_part(f, p, (bp, t, c, nh), self.eps)
                })
            })
        })?;
        drop(work);
        // Half: the f32 buffers go back to the pool.
        let kept = half.unwrap_or_else(|| a.map(Kept::F32));
        *self.acts.lock().unwrap() = Some(kept);
        Ok((y.storage(), l.shape().clone()))
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
        let (n, nh, eps, dtype) = (b * t, self.n_head, self.eps, x_t.dtype());
        let (x_t, dy_t) = (x_t.contiguous()?, dy_t.contiguous()?);
        let mut w = LayerGrads {
            p: self.params()?.clone(),
            dims: (n, c),
            dy: dy_t.clone(),
            dh: buffers::take(n * 4 * c),
            dx1: buffers::take(n * c),
            dqkv: buffers::take(n * 3 * c),
            ln: Vec::new(),
            inputs: None,
        };
        let parts = batch_parts(b);
        let bp = b / parts;
        let mut dx = half_io::Output::new(dtype, n * c)?;
        // The LayerNorms' gain and bias gradients, per part: summed below in
        // part order, so the result does not depend on thread timing.
        let ln_parts: Vec<Mutex<Option<Result<LnGrads>>>> =
            (0..parts).map(|_| Mutex::new(None)).collect();
        with_src(&x_t, |x| {
            with_src(&dy_t, |dy| {
                // What the input-gradient pass reads; f32 scratch for each
                // half one (each part widens its rows where it reads them).
                let srcs = [x, dy, a.h.src(), a.x1.src(), a.qkv.src(), a.probs.src()];
                let mut scratch = srcs.map(|s| s.scratch());
                let mut srcs = srcs.map(|s| s.pieces(parts).into_iter());
                let mut scr = scratch.each_mut().map(|b| pieces(b, parts).into_iter());
                let spm = |v| pieces(v, parts).into_iter();
                let (mut dhs, mut dx1s, mut dqkvs) =
                    (spm(&mut w.dh), spm(&mut w.dx1), spm(&mut w.dqkv));
                let work: Vec<_> = dx
                    .pieces(parts)
                    .into_iter()
                    .map(|(dx, dx_half)| {
                        Mutex::new(Some(Bwd {
                            src: srcs.each_mut().map(|s| s.next().unwrap()),
                            scratch: scr.each_mut().map(|s| s.next().unwrap()),
                            dh: dhs.next().unwrap(),
                            dx1: dx1s.next().unwrap(),
                            dqkv: dqkvs.next().unwrap(),
                            dx,
                            dx_half,
                        }))
                    })
                    .collect();
                let bf16 = bf16_weights(self.params()?);
                k::cpu::with_bf16_products(bf16, || {
                    with_params(self.params()?, |p| {
                        k::cpu::par_parts(parts, |i| {
                            let bw = work[i].lock().unwrap().take().expect("each part runs once");
                            let r = backward_part(bw, p, (bp, t, c, nh), eps);
                            *ln_parts[i].lock().unwrap() = Some(r);
                        })
                    })
                })
            })
        })?;
        let mut ln = [LN1_W, LN1_W + 1, LN2_W, LN2_W + 1].map(|i| (i, vec![0f32; c]));
        for part in ln_parts {
            let g = part.into_inner().unwrap().expect("every part ran")?;
            for ((_, sum), g) in ln.iter_mut().zip(g) {
                add_assign(sum, &g);
            }
        }
        w.ln = ln.into();
        // W needs the linears' inputs only; qkv, P, x1 and h go back to
        // the pool now.
        w.inputs = Some([a.ln1, a.att, a.ln2, a.g]);
        tape::defer(Box::new(w));
        k::cpu::tensor_of(dx.storage(), (b, t, c), x_t.device())
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

    fn kept_bytes(&self) -> usize {
        let acts = self.op.acts.lock().unwrap();
        acts.as_ref().map_or(0, |a| {
            let Acts {
                ln1,
                qkv,
                probs,
                att,
                x1,
                ln2,
                h,
                g,
            } = a;
            [ln1, qkv, probs, att, x1, ln2, h, g]
                .iter()
                .map(|k| k.bytes())
                .sum()
        })
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

/// One part's rows of the forward's input, activations and output, and
/// for half precision, where the activations are kept and y goes.
struct Fwd<'a> {
    x: Src<'a>,
    /// x widened (half), else empty.
    xs: &'a mut [f32],
    a: Acts<&'a mut [f32]>,
    keep: Option<Acts<Dst<'a>>>,
    y: &'a mut [f32],
    y_half: Option<Dst<'a>>,
}

/// The forward on `b` batch elements (every element of the outputs
/// written); each activation is narrowed to its half copy right after the
/// kernel that computed it, while it is in cache.
fn forward_part(f: Fwd, p: &[&[f32]], (b, t, c, nh): (usize, usize, usize, usize), eps: f32) {
    let n = b * t;
    let Fwd {
        x,
        xs,
        a,
        mut keep,
        y,
        mut y_half,
    } = f;
    macro_rules! keep {
        ($($f:ident),*) => {
            if let Some(k) = &mut keep {
                $(k.$f.store(a.$f);)*
            }
        };
    }
    let x = x.get(xs);
    k::layer_norm_forward(x, p[LN1_W], p[LN1_W + 1], eps, a.ln1);
    keep!(ln1);
    let lin = (n, c, 3 * c);
    k::linear_forward(a.ln1, p[ATTN_W], Some(p[ATTN_W + 1]), lin, a.qkv);
    keep!(qkv);
    k::attention_forward(a.qkv, (b, t, c, nh), a.att, a.probs);
    keep!(att, probs);
    let lin = (n, c, c);
    k::linear_forward(a.att, p[PROJ_W], Some(p[PROJ_W + 1]), lin, a.x1);
    add_assign(a.x1, x); // x1 = x + proj (the composed layer's add)
    keep!(x1);
    k::layer_norm_forward(a.x1, p[LN2_W], p[LN2_W + 1], eps, a.ln2);
    keep!(ln2);
    let lin = (n, c, 4 * c);
    k::linear_forward(a.ln2, p[FC_W], Some(p[FC_W + 1]), lin, a.h);
    keep!(h);
    k::gelu_forward(a.h, a.g);
    keep!(g);
    let lin = (n, 4 * c, c);
    k::linear_forward(a.g, p[MLP_W], Some(p[MLP_W + 1]), lin, y);
    add_assign(y, a.x1);
    half_io::store(&mut y_half, y);
}

/// One part's rows of what the backward reads (x, dy, h, x1, qkv, P: each
/// with its f32 scratch, empty for f32) and writes.
struct Bwd<'a> {
    src: [Src<'a>; 6],
    scratch: [&'a mut [f32]; 6],
    dh: &'a mut [f32],
    dx1: &'a mut [f32],
    dqkv: &'a mut [f32],
    dx: &'a mut [f32],
    dx_half: Option<Dst<'a>>,
}

/// The LayerNorms' gradients: ln_1 gain, bias; ln_2 gain, bias.
type LnGrads = [Vec<f32>; 4];

/// The input-gradient pass on `b` batch elements: dx, and what the
/// weight gradients need (dh, dx1, dqkv); returns the LayerNorms'
/// gradients over these rows. Half inputs are widened where they are read.
fn backward_part(
    a: Bwd,
    p: &[&[f32]],
    (b, t, c, nh): (usize, usize, usize, usize),
    eps: f32,
) -> Result<LnGrads> {
    let n = b * t;
    let [x, dy, h, x1, qkv, probs] = a.src;
    let [sx, sdy, sh, sx1, sqkv, sprobs] = a.scratch;
    let [mut dw1, mut db1, mut dw2, mut db2] = std::array::from_fn(|_| vec![0f32; c]);
    // y = x1 + g Wp^T + bp
    let dy = dy.get(sdy);
    let mut dg = buffers::take(n * 4 * c);
    k::linear_backward_input(dy, p[MLP_W], (n, 4 * c, c), &mut dg);
    k::gelu_backward(h.get(sh), &dg, a.dh);
    drop(dg);
    // h = ln2 Wf^T + bf;  ln2 = LN(x1)
    let mut dln2 = buffers::take(n * c);
    k::linear_backward_input(a.dh, p[FC_W], (n, c, 4 * c), &mut dln2);
    let x1 = x1.get(sx1);
    k::layer_norm_backward_into(x1, p[LN2_W], &dln2, eps, a.dx1, &mut dw2, &mut db2)?;
    drop(dln2);
    // The residual's share; then x1 = x + att Wo^T + bo.
    add_assign(a.dx1, dy);
    let mut datt = buffers::take(n * c);
    k::linear_backward_input(a.dx1, p[PROJ_W], (n, c, c), &mut datt);
    let dims = (b, t, c, nh);
    k::attention_backward(qkv.get(sqkv), &datt, probs.get(sprobs), dims, a.dqkv);
    drop(datt);
    // qkv = ln1 Wa^T + ba;  ln1 = LN(x)
    let mut dln1 = buffers::take(n * c);
    k::linear_backward_input(a.dqkv, p[ATTN_W], (n, c, 3 * c), &mut dln1);
    let x = x.get(sx);
    k::layer_norm_backward_into(x, p[LN1_W], &dln1, eps, a.dx, &mut dw1, &mut db1)?;
    add_assign(a.dx, a.dx1); // and the residual's
    let mut dx_half = a.dx_half;
    half_io::store(&mut dx_half, a.dx);
    Ok([dw1, db1, dw2, db2])
}

/// The weight pass's linears by weight index (each bias is the next), in
/// the order it runs them: the MLP's projection and fc, the attention's
/// projection and c_attn.
const LINEARS: [usize; 4] = [MLP_W, FC_W, PROJ_W, ATTN_W];

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
    inputs: Option<[Kept; 4]>,
}

impl LayerGrads {
    /// `f` on what the weight pass's four linears ([`LINEARS`]) read,
    /// under the layer's product precision.
    fn with_linears<R>(&self, f: impl FnOnce(&[WeightGrad]) -> R) -> Result<R> {
        let c = self.dims.1;
        let inputs = self.inputs.as_ref().expect("set before deferral");
        let [ln1, att, ln2, g] = inputs.each_ref().map(|k| k.src().wide());
        k::cpu::with_bf16_products(bf16_weights(&self.p), || {
            let what = "fused GPT-2 layer";
            crate::common::direct::with_f32_params(std::slice::from_ref(&self.dy), what, |dy| {
                let dy = dy[0];
                // (input, output gradient, out, in), in LINEARS' order.
                let reads: [(&[f32], &[f32], usize, usize); 4] = [
                    (&g, dy, c, 4 * c),
                    (&ln2, &self.dh, 4 * c, c),
                    (&att, &self.dx1, c, c),
                    (&ln1, &self.dqkv, 3 * c, c),
                ];
                let lins = reads.map(|(x, d, out, inp)| WeightGrad {
                    x,
                    d,
                    out,
                    inp,
                    bias: true,
                });
                f(&lins)
            })
        })
    }

    /// The parameters' indices in the order `compute` returns them and
    /// `accumulate_into` takes their slots: each linear's weight and bias,
    /// then the LayerNorms'.
    fn order(&self) -> Vec<usize> {
        let mut v: Vec<usize> = LINEARS.into_iter().flat_map(|i| [i, i + 1]).collect();
        v.extend(self.ln.iter().map(|(i, _)| *i));
        v
    }
}

impl DeferredGrad for LayerGrads {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let n = self.dims.0;
        let dev = self.dy.device();
        let grads = self.with_linears(|lins| weight_grads(n, lins))?;
        let vals = grads
            .into_iter()
            .flat_map(|(dw, db)| [dw, db])
            .chain(self.ln.iter().map(|(_, g)| g.clone()));
        // Each gradient in its parameter's dtype.
        self.order()
            .into_iter()
            .zip(vals)
            .map(|(i, v)| {
                let t = half_io::tensor(self.p[i].dtype(), v, self.p[i].shape(), dev)?;
                Ok((self.p[i].clone(), t))
            })
            .collect()
    }

    fn targets(&self) -> Option<Vec<&Tensor>> {
        Some(self.order().into_iter().map(|i| &self.p[i]).collect())
    }

    /// In f32, the flat buffer's precision, whatever the parameters' dtype
    /// (`compute` rounds a half parameter's gradient to it); the engine
    /// keeps fp16 weights on `compute`, where an overflow shows as inf.
    fn accumulate_into(&self, slots: Vec<&mut [f32]>) -> Result<()> {
        let what = "fused GPT-2 layer";
        let mut by_param = slots_by_param(self.p.len(), &self.order(), slots, &self.ln, what)?;
        let n = self.dims.0;
        self.with_linears(|lins| {
            let dst = LINEARS.iter().map(|&i| {
                let dw = by_param[i].take().expect("every slot given");
                (dw, by_param[i + 1].take().expect("every slot given"))
            });
            weight_grads_into(n, lins, dst.collect())
        })
    }

    fn kept(&self) -> Vec<&Tensor> {
        vec![&self.dy]
    }

    fn kept_buffer_bytes(&self) -> usize {
        let a: usize = self.inputs.iter().flatten().map(Kept::bytes).sum();
        a + 4 * (self.dh.len() + self.dx1.len() + self.dqkv.len())
    }
}

/// The layer on `x` (B, T, C), f32, bf16 or f16: one graph node whose
/// input gradient is computed by its backward and whose parameter
/// gradients go to the tape.
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
