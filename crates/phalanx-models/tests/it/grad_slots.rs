//! The direct layers' weight pass written straight into the flat gradient
//! buffer (`GradSink::slots` + `DeferredGrad::accumulate_into`: gemms that
//! add into the buffer) against the same pass returned as tensors and
//! added by the sink (`compute` + `GradSink::accumulate`): identical from
//! zeroed gradients, within rounding on top of earlier ones (gradient
//! accumulation), for GPT-2's fused layer and Llama's (with Qwen2's
//! biases), f32 and bf16; fp16 weights keep the rounded path.

use candle_core::{DType, Device, Tensor};
use phalanx::engine::{Activations, FlatBuffer, GradSink, ParamInfo, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx_models::common::direct::set_fused_layer;
use phalanx_models::{gpt2, llama};

use crate::common;
use common::token_ids as ids;

/// A sink that only adds returned gradients: the path without slots.
struct NoSlots<'a>(&'a mut FlatBuffer);

impl GradSink for NoSlots<'_> {
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> candle_core::Result<()> {
        self.0.accumulate(p, grad)
    }
}

/// The flat buffer itself, counting the slots it hands out (not those
/// only asked for).
struct Counting<'a>(&'a mut FlatBuffer, usize);

impl GradSink for Counting<'_> {
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> candle_core::Result<()> {
        self.0.accumulate(p, grad)
    }
    fn slots(&mut self, ps: &[&ParamInfo]) -> Option<Vec<&mut [f32]>> {
        let slots = self.0.slots(ps);
        self.1 += slots.as_ref().map_or(0, Vec::len);
        slots
    }
}

/// The flat gradients after one backward into a buffer holding `start`,
/// through slots (`direct`) or without; and how many slots were taken.
fn grads(stack: &Stack, start: &[f32], direct: bool) -> (Vec<f32>, usize) {
    let ledger = Ledger::new();
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 5);
    params
        .as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, p)| *p += 0.01 * ((i % 11) as f32 - 5.0));
    let (x, y) = (ids(4, 9, 37, 1), ids(4, 9, 37, 2));
    let mut g = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    g.as_mut_slice().copy_from_slice(start);
    let (_, stash) = stack
        .forward(0..stack.num_blocks(), &x, Some(&y), &params)
        .unwrap();
    let one = Tensor::new(1f32, &Device::Cpu).unwrap();
    let taken = if direct {
        let mut sink = Counting(&mut g, 0);
        stack
            .backward(stash, &one, &params, &mut sink, &mut |_, _| Ok(()))
            .unwrap();
        sink.1
    } else {
        let mut sink = NoSlots(&mut g);
        stack
            .backward(stash, &one, &params, &mut sink, &mut |_, _| Ok(()))
            .unwrap();
        0
    };
    (g.as_slice().to_vec(), taken)
}

/// (largest difference, largest magnitude of `b`).
fn worst(a: &[f32], b: &[f32]) -> (f32, f32) {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (worst, scale)
}

fn check(name: &str, mut stack: Stack) {
    let n = stack.layout().num_params();
    let zeros = vec![0f32; n];
    let earlier: Vec<f32> = (0..n).map(|i| 0.3 * ((i % 7) as f32 - 3.0)).collect();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        stack.set_compute_dtype(dtype);
        let what = format!("{name}, {dtype:?}");
        let (a, taken) = grads(&stack, &zeros, true);
        let (b, _) = grads(&stack, &zeros, false);
        assert!(a.iter().any(|v| *v != 0.0), "{what}: no gradient");
        if dtype == DType::F16 {
            // fp16 gradients are rounded to fp16 (where an overflow turns
            // into the inf the loss scaler looks for): no slots, and the
            // same values as the path without them.
            assert_eq!(taken, 0, "{what}: fp16 weights took slots");
            assert_eq!(a, b, "{what}: differs from returned gradients");
            // Each layer weight's gradient is in fp16 (one contribution
            // each, from zero: exactly representable).
            for p in stack.layout().params() {
                if p.block == 0 || p.block + 1 == stack.num_blocks() {
                    continue; // embeddings and head (a tied table sums two)
                }
                let off = a[p.range()]
                    .iter()
                    .find(|v| half::f16::from_f32(**v).to_f32() != **v);
                assert!(
                    off.is_none(),
                    "{what}: {} holds {off:?}, not an fp16 value",
                    p.name
                );
            }
            continue;
        }
        // Every layer's weights went through slots: 2 layers' worth at least.
        assert!(taken >= 2 * 9, "{what}: {taken} slots taken");
        if dtype == DType::F32 {
            assert_eq!(a, b, "{what}: slots differ from returned gradients");
        } else {
            // compute() rounds a half parameter's gradient to its dtype
            // (GPT-2); the slots keep f32.
            let (worst, scale) = worst(&a, &b);
            assert!(worst <= 1e-2 * scale, "{what}: {worst:e} of {scale:e}");
        }
        let (a, _) = grads(&stack, &earlier, true);
        let (b, _) = grads(&stack, &earlier, false);
        let (worst, scale) = worst(&a, &b);
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
        assert!(
            worst <= tol * scale,
            "{what}, accumulated: {worst:e} of {scale:e}"
        );
    }
}

#[test]
fn weight_pass_into_slots_equals_the_returned_gradients() {
    set_fused_layer(Some(true));
    let ledger = Ledger::new();
    let act = Activations::KeepActivations;
    let cfg = gpt2::Gpt2Config::new(2, 3, 24, 37, 16);
    let s = Stack::new(gpt2::blocks(&cfg).unwrap(), &Device::Cpu, act, &ledger).unwrap();
    check("GPT-2", s);
    // (layers, heads, kv heads, C, MLP, vocab, block): grouped-query.
    let mut cfg = llama::LlamaConfig::new(2, 6, 2, 36, 50, 37, 16);
    for bias in [false, true] {
        cfg.qkv_bias = bias;
        let s = Stack::new(llama::blocks(&cfg).unwrap(), &Device::Cpu, act, &ledger).unwrap();
        check(&format!("Llama, bias {bias}"), s);
    }
    set_fused_layer(None);
}
