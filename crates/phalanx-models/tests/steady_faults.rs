//! A steady training step takes no fresh pages from the kernel once freed
//! memory is kept in the heap (`phalanx::engine::heap`, what
//! `PHALANX_RETAIN_FREED=1` turns on), so the
//! activations, gradients and temporaries of step k reuse step k-1's.
//! Counted as minor page faults (getrusage) over whole steps. Alone in its
//! file: it is the only test of this process, so no other test's threads
//! fault meanwhile.

// glibc only: `retain_freed_memory` sets glibc's malloc options. Elsewhere
// there is nothing to check, so the test does not exist rather than pass.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use candle_core::{Device, Tensor};
use phalanx::engine::heap::{minor_faults, retain_freed_memory};
use phalanx::engine::{Activations, EngineConfig};
use phalanx::optim::{AdamW, AdamWConfig, Optimizer};
use phalanx_models::gpt2::{self, Gpt2Config};
use phalanx_models::llama::{self, LlamaConfig};

#[test]
fn steady_steps_take_no_fresh_pages() {
    // Activations of several MiB (B 8, T 64, C 128: a 4C MLP tensor is 1 MiB),
    // well above glibc's default mmap threshold of 128 KiB. GPT-2's fused
    // layer, then Llama's direct one.
    let ecfg = || EngineConfig {
        seed: 1,
        activations: Activations::KeepGraph,
        ..Default::default()
    };
    let gpt = Gpt2Config::new(2, 4, 128, 256, 64);
    steady(gpt2::engine(&gpt, &Device::Cpu, ecfg()).unwrap(), "GPT-2");
    let llama = LlamaConfig::new(2, 4, 2, 128, 352, 256, 64);
    steady(
        llama::engine(&llama, &Device::Cpu, ecfg()).unwrap(),
        "Llama",
    );
}

fn steady(mut e: phalanx::engine::Engine, what: &str) {
    assert!(
        retain_freed_memory(),
        "glibc's malloc options must take the heap settings"
    );
    let n = e.num_params();
    let mut opt = AdamW::new(AdamWConfig::default(), e.layout(), 0..n, e.ledger());
    let (b, t) = (8, 64);
    let ids: Vec<u32> = (0..(b * (t + 1)) as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 9) % 256)
        .collect();
    let all = Tensor::from_vec(ids, (b, t + 1), &Device::Cpu).unwrap();
    let x = all.narrow(1, 0, t).unwrap().contiguous().unwrap();
    let y = all.narrow(1, 1, t).unwrap().contiguous().unwrap();
    let mut step = || {
        e.zero_grad();
        e.forward_backward(&x, &y, 1.0).unwrap();
        let (p, g) = e.params_and_grads_mut();
        phalanx::optim::clip::clip_grad_norm(g, 1.0);
        opt.step(p, g, 1e-3, 1.0);
    };
    // Warm-up: the optimizer's state, thread stacks, the heap reaching its
    // peak.
    for _ in 0..3 {
        step();
    }
    // Counted over several windows of 4 steps; the quietest one is judged.
    // A steady step that takes fresh pages does so in every window, while
    // faults from outside the step (the kernel's work on a loaded machine)
    // come and go between windows.
    let steps = 4;
    let windows: Vec<u64> = (0..5)
        .map(|_| {
            let before = minor_faults();
            for _ in 0..steps {
                step();
            }
            (minor_faults() - before) / steps
        })
        .collect();
    let per_step = *windows.iter().min().unwrap();
    eprintln!("{what}: {per_step} minor faults per steady step (windows {windows:?})");
    // One step's activations alone span about 2,000 pages; fresh buffers
    // fault on every one of them. A few stray faults (a thread's stack, the
    // allocator's bookkeeping) are allowed.
    assert!(
        per_step < 64,
        "{what}: {per_step} minor faults per steady step (windows {windows:?})"
    );
}
