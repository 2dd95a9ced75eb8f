//! Blocks that run outside candle's graph (`BlockModule::forward_direct`):
//! the engine calls their own backward, which hands the parameters'
//! gradients to the weight-gradient tape. The same block through candle
//! autograd must give the same gradients, in the full backward, under
//! activation recomputation, and split into zero-bubble's B and W passes.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Result, Tensor};
use candle_nn::VarBuilder;
use phalanx::engine::{
    Activations, Block, BlockModule, Ctx, CtxBlock, DirectBackward, FlatBuffer, Stack,
};
use phalanx::ledger::{Ledger, Mem};
use phalanx::ops::tape;

const D: usize = 5;

/// Direct backwards run so far (all tests; each compares differences).
static DIRECT_BACKWARDS: AtomicUsize = AtomicUsize::new(0);

/// y = x + x * w (w (D,) scales each feature).
struct Scale {
    direct: bool,
    name: &'static str,
}

struct ScaleModule {
    w: Tensor,
    direct: bool,
}

struct ScaleBack {
    x: Tensor,
    w: Tensor,
}

impl DirectBackward for ScaleBack {
    fn backward(self: Box<Self>, dy: &Tensor) -> Result<Tensor> {
        DIRECT_BACKWARDS.fetch_add(1, Ordering::Relaxed);
        // dw = sum over rows of dy * x, to the tape; dx = dy + dy * w.
        let dw = (dy * &self.x)?.sum(0)?;
        assert!(tape::defer(Box::new(tape::Ready(vec![(
            self.w.clone(),
            dw
        )]))));
        dy + dy.broadcast_mul(&self.w)?
    }
}

impl BlockModule for ScaleModule {
    fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
        x + x.broadcast_mul(&self.w)?
    }

    fn forward_direct(
        &self,
        x: &Tensor,
        _ctx: &Ctx,
    ) -> Result<Option<(Tensor, Box<dyn DirectBackward>)>> {
        if !self.direct {
            return Ok(None);
        }
        let (x, w) = (x.detach(), self.w.clone());
        let y = (&x + x.broadcast_mul(&w.detach())?)?;
        Ok(Some((y, Box::new(ScaleBack { x, w }))))
    }
}

impl Block for Scale {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        Ok(Box::new(ScaleModule {
            w: vb.pp(self.name).get(D, "w")?,
            direct: self.direct,
        }))
    }

    fn defers_weight_grads(&self) -> bool {
        self.direct
    }
}

fn blocks(direct: bool) -> Vec<Box<dyn Block>> {
    vec![
        Box::new(Scale { direct, name: "s0" }),
        Box::new(Scale { direct, name: "s1" }),
        // Loss: mean of tanh(x)^2 weighted by a head parameter.
        Box::new(CtxBlock::new(|vb: VarBuilder| {
            struct Head(Tensor);
            impl BlockModule for Head {
                fn forward(&self, x: &Tensor, _ctx: &Ctx) -> Result<Tensor> {
                    x.tanh()?.sqr()?.broadcast_mul(&self.0)?.mean_all()
                }
            }
            Ok(Head(vb.get(D, "head")?))
        })),
    ]
}

/// The flat gradient and the input gradient of one backward.
fn grads(direct: bool, act: Activations, split: bool) -> (Vec<f32>, Vec<f32>) {
    let ledger = Ledger::new();
    let stack = Stack::new(blocks(direct), &Device::Cpu, act, &ledger).unwrap();
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    for (i, p) in params.as_mut_slice().iter_mut().enumerate() {
        *p = 0.3 + 0.1 * (i % 7) as f32;
    }
    let x: Vec<f32> = (0..3 * D).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = Tensor::from_vec(x, (3, D), &Device::Cpu).unwrap();
    let mut g = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let scale = Tensor::new(1f32, &Device::Cpu).unwrap();
    let dx = if split {
        let (_, stash) = stack.forward_frozen(0..3, &x, None, &params).unwrap();
        let (dx, w) = stack.backward_input(stash, &scale, &params).unwrap();
        stack
            .backward_weight(w, &params, &mut g, &mut |_, _| Ok(()))
            .unwrap();
        dx
    } else {
        let (_, stash) = stack.forward(0..3, &x, None, &params).unwrap();
        stack
            .backward(stash, &scale, &params, &mut g, &mut |_, _| Ok(()))
            .unwrap()
    };
    let dx = dx.unwrap().flatten_all().unwrap().to_vec1().unwrap();
    (g.as_slice().to_vec(), dx)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn direct_blocks_match_candle_autograd() {
    let (g_ref, dx_ref) = grads(false, Activations::KeepGraph, false);
    assert!(g_ref.iter().all(|g| *g != 0.0), "{g_ref:?}");
    for (act, split) in [
        (Activations::KeepGraph, false),
        (Activations::Recompute, false),
        (Activations::KeepGraph, true),
        (Activations::Recompute, true),
    ] {
        let before = DIRECT_BACKWARDS.load(Ordering::Relaxed);
        let (g, dx) = grads(true, act, split);
        // Both scale blocks ran their own backward.
        assert_eq!(DIRECT_BACKWARDS.load(Ordering::Relaxed), before + 2);
        let what = format!("{act:?}, split {split}");
        assert!(max_diff(&g, &g_ref) < 1e-6, "{what}: {g:?} vs {g_ref:?}");
        assert!(
            max_diff(&dx, &dx_ref) < 1e-6,
            "{what}: {dx:?} vs {dx_ref:?}"
        );
    }
}
