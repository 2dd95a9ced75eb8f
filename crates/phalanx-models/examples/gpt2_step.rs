//! Time GPT-2 training steps on the engine (forward + backward + AdamW).
//!
//! cargo run --release -p phalanx-models --example gpt2_step -- [preset] [B] [T] [steps] [recompute]

use std::time::Instant;

use candle_core::{Device, Tensor};
use phalanx::engine::{Activations, EngineConfig};
use phalanx::optim::{AdamW, AdamWConfig, Optimizer};
use phalanx_models::gpt2::{self, Gpt2Config};

fn main() -> candle_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let cfg = Gpt2Config::preset(&arg(1, "gpt-tiny"))?;
    let (b, t): (usize, usize) = (arg(2, "8").parse().unwrap(), arg(3, "128").parse().unwrap());
    let steps: usize = arg(4, "20").parse().unwrap();
    let activations = if arg(5, "") == "recompute" {
        Activations::Recompute
    } else {
        Activations::KeepGraph
    };
    let dev = Device::Cpu;
    let mut engine = gpt2::engine(
        &cfg,
        &dev,
        EngineConfig {
            seed: 1,
            activations,
            ..Default::default()
        },
    )?;
    let n = engine.num_params();
    let mut opt = AdamW::new(
        AdamWConfig::default(),
        engine.layout(),
        0..n,
        engine.ledger(),
    );
    // A fixed pseudo-random batch: timing, not learning.
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|i| ((i as u32).wrapping_mul(2654435761) >> 9) % cfg.vocab_size as u32)
        .collect();
    let all = Tensor::from_vec(ids, (b, t + 1), &dev)?;
    let (x, y) = (
        all.narrow(1, 0, t)?.contiguous()?,
        all.narrow(1, 1, t)?.contiguous()?,
    );
    let mut times = Vec::new();
    for step in 0..steps {
        let t0 = Instant::now();
        engine.zero_grad();
        let loss = engine.forward_backward(&x, &y, 1.0)?;
        let (p, g) = engine.params_and_grads_mut();
        opt.step(p, g, 1e-3, 1.0);
        let dt = t0.elapsed().as_secs_f64();
        times.push(dt);
        println!("step {step:3} loss {loss:.4} {:.1} ms", dt * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = times[times.len() / 2];
    println!(
        "{n} params, B={b} T={t}: median {:.1} ms/step, {:.0} tok/s",
        med * 1e3,
        (b * t) as f64 / med
    );
    println!("{}", engine.ledger());
    Ok(())
}
