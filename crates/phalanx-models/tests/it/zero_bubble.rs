//! The zero-bubble split backward (B then W) without recomputation: on the
//! reference GPT-2 and Llama stacks, W computes the parameter gradients from
//! the tensors B's ops kept on the tape, rebuilds no block but the token-id
//! embedding, and gives exactly the gradients of one fused backward, with
//! the fused GPT-2 layer and with the composed one.

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use phalanx::engine::{Activations, Block, BlockModule, FlatBuffer, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx_models::gpt2::{self, set_fused_layer, Gpt2Config};
use phalanx_models::llama::{self, LlamaConfig};

use crate::common;
use common::token_ids as ids;

/// Gradients of the whole stack for one batch: (fused backward, B then W,
/// how many blocks W recomputed).
fn both(stack: &Stack, x: &Tensor, y: &Tensor) -> (Vec<f32>, Vec<f32>, usize) {
    let ledger = Ledger::new();
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 3);
    let n = 0..stack.num_blocks();
    let scale = Tensor::new(0.5f32, &Device::Cpu).unwrap();

    let mut full = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let (_, stash) = stack.forward(n.clone(), x, Some(y), &params).unwrap();
    stack
        .backward(stash, &scale, &params, &mut full, &mut |_, _| Ok(()))
        .unwrap();

    let mut split = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let (_, stash) = stack.forward_frozen(n, x, Some(y), &params).unwrap();
    let (_, w) = stack.backward_input(stash, &scale, &params).unwrap();
    assert!(
        split.as_slice().iter().all(|&g| g == 0.0),
        "B touched no gradient"
    );
    let recomputed = w.recomputed_blocks();
    let mut order = vec![];
    stack
        .backward_weight(w, &params, &mut split, &mut |b, _| {
            order.push(b);
            Ok(())
        })
        .unwrap();
    let top_down: Vec<usize> = (0..stack.num_blocks()).rev().collect();
    assert_eq!(order, top_down, "W's hook runs once per block, top first");
    (
        full.as_slice().to_vec(),
        split.as_slice().to_vec(),
        recomputed,
    )
}

/// A block stack on the CPU.
fn stack_of(blocks: Vec<Box<dyn Block>>, act: Activations, ledger: &Ledger) -> Stack {
    Stack::new(blocks, &Device::Cpu, act, ledger).unwrap()
}

fn assert_exact(what: &str, full: &[f32], split: &[f32]) {
    assert!(full.iter().any(|&g| g != 0.0), "{what}: no gradient at all");
    let worst = full
        .iter()
        .zip(split)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert_eq!(worst, 0.0, "{what}: B + W differs from one backward");
}

#[test]
fn gpt2_split_backward_uses_the_tape_and_matches_one_backward() {
    for fused in [true, false] {
        set_fused_layer(Some(fused));
        gpt2_split(fused);
        set_fused_layer(None);
    }
}

#[test]
fn fused_layer_steady_steps_take_every_buffer_from_the_pool() {
    set_fused_layer(Some(true));
    let cfg = Gpt2Config::new(2, 5, 35, 61, 16);
    let ledger = Ledger::new();
    let stack = stack_of(gpt2::blocks(&cfg).unwrap(), Activations::KeepGraph, &ledger);
    let (x, y) = (ids(3, 7, 61, 3), ids(3, 7, 61, 4));
    let mut fresh = vec![];
    for _step in 0..4 {
        let (full, split, _) = both(&stack, &x, &y);
        assert_exact("fused steps", &full, &split);
        fresh.push(phalanx::ops::buffers::fresh_allocations());
    }
    set_fused_layer(None);
    // The pool and its count are per thread: after the first steps, every
    // buffer a step takes comes back from the pool.
    assert!(fresh[0] > 0);
    assert_eq!(
        fresh[1], fresh[3],
        "steady steps allocated fresh buffers: {fresh:?}"
    );
}

fn gpt2_split(fused: bool) {
    // Odd sizes: 35 wide, 5 heads, vocab 61, T 7, B 3.
    let cfg = Gpt2Config::new(2, 5, 35, 61, 16);
    let ledger = Ledger::new();
    let stack = stack_of(gpt2::blocks(&cfg).unwrap(), Activations::KeepGraph, &ledger);
    let (x, y) = (ids(3, 7, 61, 1), ids(3, 7, 61, 2));
    let (full, split, recomputed) = both(&stack, &x, &y);
    // Only the token-id embedding is rebuilt (it has no B to keep a tape in).
    assert_eq!(recomputed, 1);
    assert_exact(&format!("gpt2 f32, fused {fused}"), &full, &split);
}

#[test]
fn gpt2_split_backward_in_bf16_and_with_checkpointing() {
    let cfg = Gpt2Config::new(2, 5, 35, 61, 16);
    let (x, y) = (ids(2, 9, 61, 3), ids(2, 9, 61, 4));
    for activations in [Activations::KeepGraph, Activations::Recompute] {
        let ledger = Ledger::new();
        let mut stack = stack_of(gpt2::blocks(&cfg).unwrap(), activations, &ledger);
        stack.set_compute_dtype(DType::BF16);
        let (full, split, recomputed) = both(&stack, &x, &y);
        assert_eq!(recomputed, 1, "{activations:?}");
        assert_exact(&format!("gpt2 bf16 {activations:?}"), &full, &split);
    }
}

#[test]
fn llama_split_backward_uses_the_tape_and_matches_one_backward() {
    // Grouped-query attention (4 heads over 2 kv heads), odd MLP width.
    let cfg = LlamaConfig::new(2, 4, 2, 32, 37, 53, 16);
    let ledger = Ledger::new();
    let stack = stack_of(
        llama::blocks(&cfg).unwrap(),
        Activations::KeepGraph,
        &ledger,
    );
    let (x, y) = (ids(2, 11, 53, 5), ids(2, 11, 53, 6));
    let (full, split, recomputed) = both(&stack, &x, &y);
    assert_eq!(recomputed, 1);
    assert_exact("llama f32", &full, &split);
}

/// A block that claims deferral but computes with candle-nn's linear
/// (matmul + broadcast add, which defer nothing).
struct Claims;

impl Block for Claims {
    fn build(&self, vb: VarBuilder) -> Result<Box<dyn BlockModule>> {
        let l = candle_nn::linear(3, 3, vb.pp("l"))?;
        Ok(Box::new(move |x: &Tensor, _: &phalanx::engine::Ctx| {
            candle_core::Module::forward(&l, x)
        }))
    }
    fn defers_weight_grads(&self) -> bool {
        true
    }
}

#[test]
fn a_block_whose_parameter_escapes_the_tape_is_an_error_not_a_zero_gradient() {
    let ledger = Ledger::new();
    let stack = stack_of(vec![Box::new(Claims)], Activations::KeepGraph, &ledger);
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 0);
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    let (y, stash) = stack.forward_frozen(0..1, &x, None, &params).unwrap();
    let gy = y.ones_like().unwrap();
    let (_, w) = stack.backward_input(stash, &gy, &params).unwrap();
    let mut grads = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let err = stack
        .backward_weight(w, &params, &mut grads, &mut |_, _| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        (err.contains("`l.weight`") || err.contains("`l.bias`"))
            && err.contains("defers_weight_grads"),
        "{err}"
    );
}

#[test]
fn tensor_parallel_split_backward_uses_the_tape_and_matches_one_backward() {
    // tp 2, with and without sequence parallelism: the column-parallel
    // linears (overlapped all-reduce), row-parallel linears and the
    // vocabulary-parallel head defer their weights too.
    for sp in [false, true] {
        let out = phalanx_comm::threads::run(2, move |pg| {
            let cfg = Gpt2Config::new(2, 4, 32, 61, 16);
            let tp = phalanx::tp::Tp::new(pg, sp);
            let ledger = Ledger::new();
            let stack = stack_of(
                gpt2::blocks_tp(&cfg, Some(tp)).unwrap(),
                Activations::KeepGraph,
                &ledger,
            );
            let (x, y) = (ids(2, 6, 61, 7), ids(2, 6, 61, 8));
            both(&stack, &x, &y)
        });
        for (rank, (full, split, recomputed)) in out.iter().enumerate() {
            assert_eq!(*recomputed, 1, "sp {sp} rank {rank}");
            assert_exact(&format!("tp 2 sp {sp} rank {rank}"), full, split);
        }
    }
}
