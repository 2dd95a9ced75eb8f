//! Which products run on the CPU's bf16 instructions (`ops::gemm_bf16`):
//! every linear of a bf16 GPT-2 or Llama step (direct layers, the head),
//! and none of an f32 or f16 step. Its own test binary, so that no other
//! test's products move the process-wide count. Skipped (with a note) on a
//! CPU without AVX512-BF16.

use candle_core::{DType, Device};
use phalanx::engine::{Activations, Block, FlatBuffer, Stack};
use phalanx::ledger::{Ledger, Mem};
use phalanx::ops::gemm_bf16;
use phalanx_models::{gpt2, llama};

mod common;
use common::{stack_step, token_ids as ids};

/// bf16 products taken by one forward and backward of `blocks` in `dtype`.
fn products(blocks: Vec<Box<dyn Block>>, vocab: usize, dtype: DType) -> u64 {
    let ledger = Ledger::new();
    let mut stack = Stack::new(blocks, &Device::Cpu, Activations::KeepGraph, &ledger).unwrap();
    stack.set_compute_dtype(dtype);
    let mut params = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Params);
    stack.init_params(params.as_mut_slice(), 3);
    let (x, y) = (ids(2, 8, vocab, 1), ids(2, 8, vocab, 2));
    let mut grads = FlatBuffer::zeros(stack.layout(), &ledger, Mem::Grads);
    let before = gemm_bf16::calls();
    let loss = stack_step(&stack, &params, (&x, &y), &mut grads);
    assert!(loss.is_finite());
    gemm_bf16::calls() - before
}

/// Builds a model's blocks.
type Build<'a> = Box<dyn Fn() -> Vec<Box<dyn Block>> + 'a>;

#[test]
fn bf16_steps_take_every_linear_on_bf16_instructions_and_others_none() {
    if !gemm_bf16::available() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    let g = gpt2::Gpt2Config::new(2, 2, 32, 40, 16);
    let mut l = llama::LlamaConfig::new(2, 4, 2, 32, 48, 40, 16);
    l.qkv_bias = true;
    let runs: [(&str, Build<'_>, u64); 2] = [
        ("gpt2", Box::new(|| gpt2::blocks(&g).unwrap()), 4),
        ("llama", Box::new(|| llama::blocks(&l).unwrap()), 7),
    ];
    for (name, blocks, linears) in &runs {
        // Forward, input gradient and weight gradient of each linear of
        // each layer (a product may be split over threads: at least that).
        let bf16 = products(blocks(), 40, DType::BF16);
        assert!(bf16 >= 2 * 3 * linears, "{name} bf16: {bf16} bf16 products");
        for dtype in [DType::F32, DType::F16] {
            let n = products(blocks(), 40, dtype);
            assert_eq!(n, 0, "{name} {dtype:?}: {n} bf16 products");
        }
    }
}
