//! The engine on a small user model written in plain candle-nn: a stack of
//! residual MLP blocks with an input projection and a classification head
//! whose weight is tied to the input projection.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use phalanx::engine::{
    Activations, Block, BlockModule, Ctx, CtxBlock, Engine, EngineConfig, FnBlock,
};
use phalanx::ledger::Mem;
use phalanx::optim::{AdamW, AdamWConfig, Optimizer};

const D_IN: usize = 6;
const D: usize = 16;
const N_MLP: usize = 3;

/// x + fc2(relu(fc1(x)))
struct ResMlp(Linear, Linear);

impl Module for ResMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x + x.apply(&self.0)?.relu()?.apply(&self.1)?
    }
}

/// Head: logits = tanh(x) @ proj.weight (tied with the input projection, (D, D_IN)),
/// mean cross-entropy against class ids.
struct Head {
    w: Tensor,
}

impl BlockModule for Head {
    fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let logits = x.tanh()?.matmul(&self.w)?; // (N, D_IN)
        match ctx.targets {
            Some(t) => candle_nn::loss::cross_entropy(&logits, t),
            None => Ok(logits),
        }
    }
}

fn blocks() -> Vec<Box<dyn Block>> {
    let mut b: Vec<Box<dyn Block>> = vec![Box::new(FnBlock::new(|vb: VarBuilder| {
        linear(D_IN, D, vb.pp("proj"))
    }))];
    for i in 0..N_MLP {
        b.push(Box::new(FnBlock::new(move |vb: VarBuilder| {
            let vb = vb.pp(format!("mlp{i}"));
            Ok(ResMlp(
                linear(D, 2 * D, vb.pp("fc1"))?,
                linear(2 * D, D, vb.pp("fc2"))?,
            ))
        })));
    }
    b.push(Box::new(CtxBlock::new(|vb: VarBuilder| {
        Ok(Head {
            w: vb.get((D, D_IN), "proj.weight")?,
        })
    })));
    b
}

fn engine(activations: Activations) -> Engine {
    let cfg = EngineConfig {
        seed: 7,
        activations,
        ..Default::default()
    };
    Engine::new(blocks(), &Device::Cpu, cfg).unwrap()
}

fn batch(n: usize, seed: u32) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..n * D_IN)
        .map(|i| ((i as u32 + seed).wrapping_mul(2654435761) >> 16) as f32 / 65536.0 * 2.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..n as u32)
        .map(|i| (i * 31 + seed) % D_IN as u32)
        .collect();
    let dev = Device::Cpu;
    (
        Tensor::from_vec(x, (n, D_IN), &dev).unwrap(),
        Tensor::from_vec(y, n, &dev).unwrap(),
    )
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn layout_is_block_then_name_order_with_tie() {
    let e = engine(Activations::KeepGraph);
    let l = e.layout();
    let names: Vec<&str> = l.params().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        &names[..4],
        &[
            "proj.bias",
            "proj.weight",
            "mlp0.fc1.bias",
            "mlp0.fc1.weight"
        ]
    );
    // Offsets are contiguous in that order.
    let mut off = 0;
    for p in l.params() {
        assert_eq!(p.offset, off, "{}", p.name);
        off += p.numel;
    }
    assert_eq!(off, e.num_params());
    // The head owns nothing and reads the tied projection.
    let head = l.block(N_MLP + 1);
    assert!(head.range.is_empty());
    assert_eq!(head.tied, vec![l.index_of("proj.weight").unwrap()]);
}

#[test]
fn block_backward_matches_whole_model_autograd() {
    for mode in [Activations::KeepGraph, Activations::Recompute] {
        let mut e = engine(mode);
        let (x, y) = batch(10, 3);
        let (ref_loss, ref_grads) = e.reference_grads(&x, &y, 1.0).unwrap();
        e.zero_grad();
        let loss = e.forward_backward(&x, &y, 1.0).unwrap();
        assert!(
            (loss - ref_loss).abs() <= 1e-6 * ref_loss.abs(),
            "{mode:?}: {loss} vs {ref_loss}"
        );
        for p in e.layout().params() {
            let (a, b) = (&e.grads_flat()[p.range()], &ref_grads[p.range()]);
            assert!(
                b.iter().any(|&v| v != 0.0),
                "{}: zero reference grad",
                p.name
            );
            let err = rel_err(a, b);
            assert!(err < 1e-5, "{mode:?} {}: rel err {err}", p.name);
        }
    }
}

#[test]
fn tied_weight_gets_both_contributions() {
    // The tied gradient must differ from what the embedding alone would get:
    // compare with an engine whose head uses its own (untied) copy.
    let mut e = engine(Activations::KeepGraph);
    let (x, y) = batch(8, 1);
    e.zero_grad();
    e.forward_backward(&x, &y, 1.0).unwrap();
    let mut head_only = vec![0f32; e.num_params()];
    let r = e.layout().find("proj.weight").unwrap().range();
    // Run just the head's backward through the stack with a fresh sink.
    let n = e.num_blocks();
    let (h, _s) = e.forward_range(0..n - 1, &x, None).unwrap();
    let (loss, stash) = e.forward_range(n - 1..n, &h, Some(&y)).unwrap();
    let gy = Tensor::new(1f32, &Device::Cpu).unwrap();
    let mut sink = phalanx::engine::FlatBuffer::zeros(e.layout(), e.ledger(), Mem::Grads);
    e.stack()
        .backward(stash, &gy, e.param_source(), &mut sink, &mut |_, _| Ok(()))
        .unwrap();
    head_only[r.clone()].copy_from_slice(&sink.as_slice()[r.clone()]);
    assert!(loss.to_scalar::<f32>().unwrap() > 0.0);
    assert!(head_only[r.clone()].iter().any(|&v| v != 0.0));
    let total = &e.grads_flat()[r.clone()];
    assert!(
        rel_err(total, &head_only[r]) > 1e-3,
        "embedding contribution missing"
    );
}

#[test]
fn hook_runs_in_backward_order_with_final_grads() {
    let mut e = engine(Activations::KeepGraph);
    let (x, y) = batch(6, 2);
    let ranges: Vec<_> = e
        .layout()
        .blocks()
        .iter()
        .map(|b| b.range.clone())
        .collect();
    let mut seen: Vec<(usize, Vec<f32>)> = Vec::new();
    e.zero_grad();
    e.forward_backward_with(&x, &y, 1.0, &mut |b, grads| {
        seen.push((b, grads[ranges[b].clone()].to_vec()));
        Ok(())
    })
    .unwrap();
    let order: Vec<usize> = seen.iter().map(|s| s.0).collect();
    assert_eq!(order, (0..N_MLP + 2).rev().collect::<Vec<_>>());
    for (b, snap) in seen {
        assert_eq!(
            snap.as_slice(),
            &e.grads_flat()[ranges[b].clone()],
            "block {b}"
        );
    }
}

#[test]
fn gradient_accumulation_equals_full_batch() {
    let mut e = engine(Activations::Recompute);
    let (x, y) = batch(8, 5);
    e.zero_grad();
    e.forward_backward(&x, &y, 1.0).unwrap();
    let full = e.grads_flat().to_vec();
    e.zero_grad();
    for k in 0..2 {
        let (xk, yk) = (
            x.narrow(0, 4 * k, 4).unwrap(),
            y.narrow(0, 4 * k, 4).unwrap(),
        );
        e.forward_backward(&xk, &yk, 0.5).unwrap();
    }
    assert!(rel_err(e.grads_flat(), &full) < 1e-5);
    e.zero_grad();
    assert!(e.grads_flat().iter().all(|&g| g == 0.0));
}

#[test]
fn pipeline_ranges_equal_full_backward() {
    let mut e = engine(Activations::KeepGraph);
    let (x, y) = batch(6, 9);
    e.zero_grad();
    let loss = e.forward_backward(&x, &y, 1.0).unwrap();
    let full = e.grads_flat().to_vec();
    e.zero_grad();
    let n = e.num_blocks();
    let (h, s0) = e.forward_range(0..2, &x, None).unwrap();
    let (l, s1) = e.forward_range(2..n, &h, Some(&y)).unwrap();
    assert_eq!(l.to_scalar::<f32>().unwrap(), loss);
    let one = Tensor::new(1f32, &Device::Cpu).unwrap();
    let dh = e
        .backward_range(s1, &one, &mut |_, _| Ok(()))
        .unwrap()
        .unwrap();
    assert_eq!(dh.dims(), h.dims());
    let dx = e
        .backward_range(s0, &dh, &mut |_, _| Ok(()))
        .unwrap()
        .unwrap();
    assert_eq!(dx.dims(), x.dims());
    assert!(rel_err(e.grads_flat(), &full) < 1e-6);
}

#[test]
fn ledger_counts_model_states_and_activations() {
    let mut e = engine(Activations::Recompute);
    let n = e.num_params();
    let opt = AdamW::new(AdamWConfig::default(), e.layout(), 0..n, e.ledger());
    let ledger = e.ledger().clone();
    assert_eq!(ledger.model_state_bytes(), 16 * n);
    assert_eq!(opt.state_bytes(), 8 * n);
    let (x, y) = batch(10, 1);
    let (_loss, stash) = e.forward_range(0..e.num_blocks(), &x, Some(&y)).unwrap();
    // Recompute saves each block's input: x (10, D_IN) then N_MLP + 1 activations (10, D).
    let want = 4 * (10 * D_IN + (N_MLP + 1) * 10 * D);
    assert_eq!(ledger.current(Mem::Activations), want);
    let one = Tensor::new(1f32, &Device::Cpu).unwrap();
    e.backward_range(stash, &one, &mut |_, _| Ok(())).unwrap();
    assert_eq!(ledger.current(Mem::Activations), 0);
    assert_eq!(ledger.peak(Mem::Activations), want);
    assert_eq!(ledger.current(Mem::Working), 0);
    assert!(ledger.peak(Mem::Working) > 0);
    drop(opt);
    assert_eq!(ledger.model_state_bytes(), 8 * n);
}

#[test]
fn training_reduces_loss() {
    let mut e = engine(Activations::KeepGraph);
    let n = e.num_params();
    let mut opt = AdamW::new(AdamWConfig::default(), e.layout(), 0..n, e.ledger());
    let (x, y) = batch(32, 4);
    let first = e.eval_loss(&x, &y).unwrap();
    for _ in 0..60 {
        e.zero_grad();
        e.forward_backward(&x, &y, 1.0).unwrap();
        let (p, g) = e.params_and_grads_mut();
        opt.step(p, g, 1e-2, 1.0);
    }
    let last = e.eval_loss(&x, &y).unwrap();
    assert!(last < 0.5 * first, "{first} -> {last}");
}

#[test]
fn op_without_backward_is_reported() {
    // candle-nn's LayerNorm on contiguous input uses a fused op with no
    // backward: the engine must say so instead of training nothing.
    let blocks: Vec<Box<dyn Block>> = vec![
        Box::new(FnBlock::new(|vb: VarBuilder| {
            candle_nn::layer_norm(D_IN, 1e-5, vb.pp("ln"))
        })),
        Box::new(CtxBlock::new(|_vb: VarBuilder| {
            Ok(|x: &Tensor, _c: &Ctx| x.sum_all())
        })),
    ];
    let mut e = Engine::new(blocks, &Device::Cpu, EngineConfig::default()).unwrap();
    let (x, y) = batch(4, 0);
    let err = e.forward_backward(&x, &y, 1.0).unwrap_err().to_string();
    assert!(err.contains("received no gradient"), "{err}");
}

#[test]
fn eval_and_logits_need_no_grads() {
    let e = engine(Activations::KeepGraph);
    let (x, _y) = batch(5, 0);
    let logits = e.forward(&x).unwrap();
    assert_eq!(logits.dims(), &[5, D_IN]);
    assert_eq!(logits.dtype(), DType::F32);
    assert!(!logits.track_op());
}

#[test]
fn engine_and_stash_can_move_to_rank_threads() {
    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}
    assert_send::<Engine>();
    assert_sync::<Engine>();
    assert_send::<phalanx::engine::Stash>();
    // And it runs on another thread (ranks are threads in tests).
    let handle = std::thread::spawn(|| {
        let mut e = engine(Activations::Recompute);
        let (x, y) = batch(4, 1);
        e.forward_backward(&x, &y, 1.0).unwrap()
    });
    assert!(handle.join().unwrap().is_finite());
}
