//! `phalanx bench optimizer`: the optimizer's step on the device against the
//! host's fused loop, on this machine's CPU or GPU.
//!
//! `--check` first steps a small model (matrices that decay, vectors that
//! do not) with both, in chunks of 7 elements, in pieces that cut
//! parameters in the middle, with 1-bit Adam's frozen variance, with the
//! parameters and gradients already on the device, and SGD with Nesterov
//! momentum, and compares every parameter after every step: the largest
//! difference relative to the parameter's size must stay within `--tol`
//! (on the CPU they are equal bit for bit). Then it times one step over
//! `--params` elements (AdamW), each way:
//!
//! - `host`: the host's loop (what `offload_optimizer.device = "cpu"` runs);
//! - `device`: the device optimizer given host buffers (ZeRO-2/3's and
//!   the pipeline's step: gradients and parameters up, parameters down);
//! - `device, resident`: parameters and gradients already on the device,
//!   the new parameters written back to the host buffer (DDP with its
//!   gradients reduced on the host: a compression hook, ranks sharing a
//!   GPU);
//! - `device, deferred`: nothing crosses (DDP and ZeRO-1 with their
//!   gradients on the device: one data-parallel rank, or over NCCL; the
//!   host's copy waits on the device until read).
//!
//! A step that reads back waits for the device; the deferred way's steps
//! do not, so it reads one element after its last step, and times all of
//! its steps (the first included) up to that read.

use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Args;
use phalanx::config::{Choice, DeviceKind};
use phalanx::engine::{Layout, ParamDecl};
use phalanx::ledger::Ledger;
use phalanx::optim::{AdamW, AdamWConfig, DeviceOptimizer, Grads, Optimizer, Sgd, SgdConfig};

#[derive(Args, Debug, Clone)]
pub struct OptimBenchOpts {
    /// The device the state goes on: cpu (candle's CPU ops, the
    /// device-generic path) or cuda (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Elements stepped in the timing (a count: 16M, 124M, 1.3B).
    #[arg(long, default_value = "16M")]
    pub params: String,
    /// Timed steps per way (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Check the device's results against the host's first.
    #[arg(long)]
    pub check: bool,
    /// Largest difference allowed by `--check`, relative to the
    /// parameter's size (|a - b| / max(1, |b|)).
    #[arg(long, default_value_t = 1e-6)]
    pub tol: f64,
}

pub fn main(o: &OptimBenchOpts) -> i32 {
    match run(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx bench optimizer: {e}");
            1
        }
    }
}

fn run(o: &OptimBenchOpts) -> Result<(), String> {
    let kind = DeviceKind::parse_name(&o.device).map_err(|e| format!("--device: {e}"))?;
    let dev = kind.device().map_err(|e| e.to_string())?;
    let n = phalanx::plan::parse_count(&o.params).map_err(|e| format!("--params: {e}"))? as usize;
    if o.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    println!("device: {} ({:?})", o.device, dev.location());
    if o.check {
        check(&dev, o.tol)?;
    }
    time(&dev, n, o.steps)
}

/// A small model: three blocks of a matrix (decays), a vector (does not)
/// and another matrix.
fn small_layout() -> Layout {
    let block = |i: usize| {
        vec![
            ParamDecl::new(&format!("w{i}"), &[9, 7]),
            ParamDecl::new(&format!("b{i}"), &[7]),
            ParamDecl::new(&format!("u{i}"), &[5, 4]),
        ]
    };
    Layout::new((0..3).map(block).collect()).expect("a valid layout")
}

/// Deterministic values over several magnitudes, both signs.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            u * scale * if x.is_multiple_of(11) { 40.0 } else { 1.0 }
        })
        .collect()
}

/// How one way of stepping the device optimizer runs a step.
#[derive(Clone, Copy)]
enum Way {
    Whole,
    Pieces,
    Resident,
}

/// Step `host` and `dev` alike and return the largest relative difference.
fn compare(
    host: &mut dyn Optimizer,
    dev: &mut DeviceOptimizer,
    device: &Device,
    way: Way,
) -> Result<f64, String> {
    let e = |e: candle_core::Error| e.to_string();
    let n = host.range().len();
    let mut p = values(n, 1, 1.0);
    let mut q = p.clone();
    let on = Tensor::from_slice(&q, n, device).map_err(e)?;
    let mut worst = 0f64;
    for s in 0..6u64 {
        let g = values(n, 100 + s, 0.3);
        let (lr, scale) = (1e-2 / (1.0 + s as f32), 0.25 + 0.5 * s as f32);
        host.step(&mut p, &g, lr, scale);
        match way {
            Way::Whole => dev.step(&mut q, &g, lr, scale),
            Way::Pieces => {
                dev.begin_step();
                let cuts = [0, 3, 20, 21, 50, n];
                for w in cuts.windows(2) {
                    let r = w[0]..w[1];
                    dev.step_range(r.clone(), &mut q[r.clone()], &g[r], lr, scale);
                }
            }
            Way::Resident => {
                let gt = Tensor::from_slice(&g, n, device).map_err(e)?;
                dev.step_on(Some(&mut q), &on, Grads::Device(&gt), lr, scale)
                    .map_err(e)?;
                let back = on.to_vec1::<f32>().map_err(e)?;
                if back != q {
                    return Err("step_on: the device tensor and the host buffer differ".into());
                }
            }
        }
        for (a, b) in q.iter().zip(&p) {
            let d = ((a - b).abs() / b.abs().max(1.0)) as f64;
            if !d.is_finite() {
                return Err(format!("a non-finite parameter: {a} against {b}"));
            }
            worst = worst.max(d);
        }
    }
    Ok(worst)
}

fn check(dev: &Device, tol: f64) -> Result<(), String> {
    let l = small_layout();
    let n = l.num_params();
    let adam = AdamWConfig::default();
    let sgd = SgdConfig {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 0.01,
    };
    let e = |e: candle_core::Error| e.to_string();
    let mut failed = 0;
    for (what, freeze, chunk, way) in [
        ("AdamW, whole", 0, usize::MAX, Way::Whole),
        ("AdamW, chunks of 7", 0, 7, Way::Whole),
        ("AdamW, pieces", 0, usize::MAX, Way::Pieces),
        ("AdamW, frozen variance after 2, pieces", 2, 5, Way::Pieces),
        ("AdamW, resident, chunks of 7", 0, 7, Way::Resident),
        ("SGD nesterov, chunks of 7", 0, 7, Way::Whole),
    ] {
        let ledger = Ledger::new();
        let (mut host, dev_opt): (Box<dyn Optimizer>, _) = if what.starts_with("SGD") {
            (
                Box::new(Sgd::new(sgd, &l, 0..n, &ledger)),
                DeviceOptimizer::sgd(sgd, &l, 0..n, &ledger, dev),
            )
        } else {
            (
                Box::new(AdamW::new(adam, &l, 0..n, &ledger)),
                DeviceOptimizer::adamw(adam, &l, 0..n, &ledger, dev),
            )
        };
        let mut dev_opt = dev_opt.map_err(e)?.with_chunk(chunk);
        if freeze > 0 {
            host.freeze_variance_after(freeze)?;
            dev_opt.freeze_variance_after(freeze)?;
        }
        let worst = compare(host.as_mut(), &mut dev_opt, dev, way)?;
        let ok = worst <= tol;
        failed += !ok as usize;
        println!(
            "check {what}: 6 steps, largest relative difference {worst:.2e} ({})",
            if ok { "ok" } else { "FAILED" }
        );
    }
    if failed > 0 {
        return Err(format!("{failed} check(s) beyond --tol {tol:e}"));
    }
    Ok(())
}

fn time(dev: &Device, n: usize, steps: usize) -> Result<(), String> {
    let e = |e: candle_core::Error| e.to_string();
    // A matrix (decays) of nine tenths of the elements, a vector (does
    // not) of the rest.
    let vector = (n / 10).max(1);
    let cols = 1024.min(n - vector.min(n)).max(1);
    let rows = ((n - vector.min(n)) / cols).max(1);
    let l = Layout::new(vec![vec![
        ParamDecl::new("w", &[rows, cols]),
        ParamDecl::new("b", &[vector]),
    ]])
    .map_err(|e| e.to_string())?;
    let n = l.num_params();
    // Parameters, gradients, two moments and a copy for each way: refused
    // with the numbers rather than aborted by a failed allocation.
    const BUFFERS: usize = 6;
    let need = n.saturating_mul(4 * BUFFERS);
    if let Some(avail) = crate::bench_collectives::available_memory().filter(|&a| need > a) {
        return Err(format!(
            "--params {n}: about {:.1} GiB ({BUFFERS} f32 buffers of that size), but {:.1} GiB \
             of memory is available",
            need as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        ));
    }
    let cfg = AdamWConfig::default();
    let (mut p, g) = (values(n, 3, 1.0), values(n, 4, 0.1));
    println!(
        "AdamW over {n} elements ({:.2} GiB of parameters), {steps} timed steps each:",
        n as f64 * 4.0 / (1u64 << 30) as f64
    );
    let report = |way: &str, secs: f64| {
        println!(
            "  {way:<18} {:>9.2} ms per step  {:>7.2} G elements/s",
            secs * 1e3,
            n as f64 / secs / 1e9
        );
    };
    let timed = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        f()?; // untimed: first touch, allocations, kernel loads
        let t = Instant::now();
        for _ in 0..steps {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() / steps as f64)
    };
    let mut host = AdamW::new(cfg, &l, 0..n, &Ledger::new());
    let host_s = timed(&mut || {
        host.step(&mut p, &g, 1e-4, 1.0);
        Ok(())
    })?;
    report("host", host_s);
    drop(host);
    let mut opt = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), dev).map_err(e)?;
    let dev_s = timed(&mut || {
        opt.step(&mut p, &g, 1e-4, 1.0);
        Ok(())
    })?;
    report("device", dev_s);
    let on = Tensor::from_slice(&p, n, dev).map_err(e)?;
    let gt = Tensor::from_slice(&g, n, dev).map_err(e)?;
    let res_s = timed(&mut || {
        opt.step_on(Some(&mut p), &on, Grads::Device(&gt), 1e-4, 1.0)
            .map_err(|e| e.to_string())
    })?;
    report("device, resident", res_s);
    // One element read at the end waits for the device's queue, so the
    // time is the device's, not the launches'.
    let t = Instant::now();
    for _ in 0..=steps {
        opt.step_on(None, &on, Grads::Device(&gt), 1e-4, 1.0)
            .map_err(e)?;
    }
    on.narrow(0, 0, 1)
        .and_then(|x| x.to_vec1::<f32>())
        .map_err(e)?;
    let def_s = t.elapsed().as_secs_f64() / (steps + 1) as f64;
    report("device, deferred", def_s);
    println!(
        "host / device, deferred: {:.2}x; host / device, resident: {:.2}x; host / device: {:.2}x",
        host_s / def_s,
        host_s / res_s,
        host_s / dev_s
    );
    Ok(())
}
