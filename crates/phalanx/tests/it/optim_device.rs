//! The optimizer on the device (`optim::DeviceOptimizer`) against the host's
//! fused loops: on the CPU, where both round every op to f32 in the same
//! order, they must agree bit for bit, step after step, whole or in pieces,
//! across a checkpoint of the state, and with 1-bit Adam's frozen variance.

use candle_core::Device;
use phalanx::engine::{Layout, ParamDecl};
use phalanx::ledger::{Ledger, Mem};
use phalanx::optim::{AdamW, AdamWConfig, DeviceOptimizer, Grads, Optimizer, Sgd, SgdConfig};

/// Matrices (decayed) and vectors (not) interleaved: 3 segments per block.
fn layout() -> Layout {
    let block = |i: usize| {
        vec![
            ParamDecl::new(&format!("w{i}"), &[7, 5]),
            ParamDecl::new(&format!("b{i}"), &[5]),
            ParamDecl::new(&format!("u{i}"), &[3, 4]),
        ]
    };
    Layout::new(vec![block(0), block(1)]).unwrap()
}

/// Deterministic values spanning several magnitudes and both signs.
fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let u = (x as f32 / u32::MAX as f32) * 2.0 - 1.0;
            u * scale * if x.is_multiple_of(7) { 30.0 } else { 1.0 }
        })
        .collect()
}

/// Step both optimizers `steps` times on the same gradients (a changing
/// lr and gradient factor) and require bitwise equal parameters and state.
fn same_steps(
    host: &mut dyn Optimizer,
    dev: &mut dyn Optimizer,
    n: usize,
    steps: u32,
    pieces: &[usize],
) {
    let mut p = values(n, 1, 1.0);
    let mut q = p.clone();
    for s in 0..steps {
        let g = values(n, 100 + s, 0.3);
        let lr = 1e-2 / (1.0 + s as f32);
        let scale = 0.25 + 0.5 * s as f32;
        host.step(&mut p, &g, lr, scale);
        if pieces.is_empty() {
            dev.step(&mut q, &g, lr, scale);
        } else {
            // One step in pieces: the cut points `pieces`.
            dev.begin_step();
            let mut cuts = vec![0];
            cuts.extend_from_slice(pieces);
            cuts.push(n);
            for w in cuts.windows(2) {
                let r = w[0]..w[1];
                dev.step_range(r.clone(), &mut q[r.clone()], &g[r], lr, scale);
            }
        }
        assert_eq!(p, q, "parameters after step {}", s + 1);
    }
    let (hs, ht) = host.state().unwrap();
    let (ds, dt) = dev.state().unwrap();
    assert_eq!(ht, dt, "step counts");
    assert_eq!(hs, ds, "state buffers");
}

#[test]
fn adamw_on_the_device_is_the_host_loop_bit_for_bit() {
    let l = layout();
    let n = l.num_params();
    for (wd, range) in [(0.01f32, 0..n), (0.0, 0..n), (0.1, 9..n - 4)] {
        let cfg = AdamWConfig {
            weight_decay: wd,
            ..AdamWConfig::default()
        };
        let mut host = AdamW::new(cfg, &l, range.clone(), &Ledger::new());
        let ledger = Ledger::new();
        let mut dev =
            DeviceOptimizer::adamw(cfg, &l, range.clone(), &ledger, &Device::Cpu).unwrap();
        // The moments, and the weight-decay mask where there is decay.
        let mask = if wd != 0.0 { 4 } else { 0 };
        assert_eq!(ledger.current(Mem::OptState), range.len() * (8 + mask));
        assert_eq!(dev.state_bytes(), host.state_bytes());
        same_steps(&mut host, &mut dev, range.len(), 6, &[]);
        // In pieces that cut segments in the middle, as the disk-streamed
        // ZeRO update does, and in chunks of 7 elements.
        for chunk in [usize::MAX, 7] {
            let mut host = AdamW::new(cfg, &l, range.clone(), &Ledger::new());
            let mut dev =
                DeviceOptimizer::adamw(cfg, &l, range.clone(), &Ledger::new(), &Device::Cpu)
                    .unwrap()
                    .with_chunk(chunk);
            same_steps(&mut host, &mut dev, range.len(), 4, &[3, 20, 21, 50]);
            let mut host = AdamW::new(cfg, &l, range.clone(), &Ledger::new());
            let mut dev =
                DeviceOptimizer::adamw(cfg, &l, range.clone(), &Ledger::new(), &Device::Cpu)
                    .unwrap()
                    .with_chunk(chunk);
            same_steps(&mut host, &mut dev, range.len(), 3, &[]);
        }
    }
}

#[test]
fn frozen_variance_on_the_device_is_the_host_loop() {
    let l = layout();
    let n = l.num_params();
    let cfg = AdamWConfig::default();
    let mut host = AdamW::new(cfg, &l, 0..n, &Ledger::new());
    let mut dev = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu).unwrap();
    host.freeze_variance_after(2).unwrap();
    dev.freeze_variance_after(2).unwrap();
    same_steps(&mut host, &mut dev, n, 5, &[]);
    // In pieces and chunks, where the untouched variance is a view of the
    // buffer it would be written back into.
    for (chunk, pieces) in [(usize::MAX, &[3usize, 20, 21, 50][..]), (7, &[])] {
        let mut host = AdamW::new(cfg, &l, 0..n, &Ledger::new());
        let mut dev = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu)
            .unwrap()
            .with_chunk(chunk);
        host.freeze_variance_after(2).unwrap();
        dev.freeze_variance_after(2).unwrap();
        same_steps(&mut host, &mut dev, n, 5, pieces);
    }
}

#[test]
fn sgd_on_the_device_is_the_host_loop_bit_for_bit() {
    let l = layout();
    let n = l.num_params();
    for (momentum, nesterov, wd) in [
        (0.9f32, false, 0.01f32),
        (0.9, true, 0.0),
        (0.0, false, 0.05),
    ] {
        let cfg = SgdConfig {
            momentum,
            nesterov,
            weight_decay: wd,
        };
        let mut host = Sgd::new(cfg, &l, 0..n, &Ledger::new());
        let mut dev = DeviceOptimizer::sgd(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu).unwrap();
        assert_eq!(dev.state_bytes(), host.state_bytes());
        same_steps(&mut host, &mut dev, n, 5, &[]);
        let mut host = Sgd::new(cfg, &l, 0..n, &Ledger::new());
        let mut dev = DeviceOptimizer::sgd(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu)
            .unwrap()
            .with_chunk(11);
        same_steps(&mut host, &mut dev, n, 3, &[10, 40]);
    }
}

#[test]
fn device_state_moves_through_a_checkpoint_to_the_host_and_back() {
    let l = layout();
    let n = l.num_params();
    let cfg = AdamWConfig::default();
    let mut dev = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu).unwrap();
    let mut p = values(n, 3, 1.0);
    for s in 0..3 {
        dev.step(&mut p, &values(n, 50 + s, 0.2), 1e-2, 1.0);
    }
    // Save from the device, resume on the host, and the reverse.
    let (bufs, t) = dev.state().unwrap();
    let mut host = AdamW::new(cfg, &l, 0..n, &Ledger::new());
    let mut back = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu).unwrap();
    for (name, v) in &bufs {
        host.load_state(name, v).unwrap();
        back.load_state(name, v).unwrap();
    }
    host.set_step_count(t);
    back.set_step_count(t);
    let (mut a, mut b, mut c) = (p.clone(), p.clone(), p.clone());
    let g = values(n, 99, 0.2);
    dev.step(&mut a, &g, 1e-2, 1.0);
    host.step(&mut b, &g, 1e-2, 1.0);
    back.step(&mut c, &g, 1e-2, 1.0);
    assert_eq!(a, b);
    assert_eq!(a, c);
    // A wrong name or length is an error, not a panic.
    let e = back.load_state("momentum_buffer", &bufs[0].1).unwrap_err();
    assert!(e.to_string().contains("momentum_buffer"), "{e}");
    let e = back.load_state("exp_avg", &bufs[0].1[1..]).unwrap_err();
    assert!(e.to_string().contains("values for a range of"), "{e}");
    assert!(
        DeviceOptimizer::sgd(SgdConfig::default(), &l, 0..n, &Ledger::new(), &Device::Cpu)
            .unwrap()
            .freeze_variance_after(1)
            .is_err()
    );
}

#[test]
fn a_step_on_parameters_already_on_the_device_is_the_same_step() {
    let l = layout();
    let n = l.num_params();
    let cfg = AdamWConfig::default();
    let mut host = AdamW::new(cfg, &l, 0..n, &Ledger::new());
    let mut dev = DeviceOptimizer::adamw(cfg, &l, 0..n, &Ledger::new(), &Device::Cpu)
        .unwrap()
        .with_chunk(13);
    let mut p = values(n, 5, 1.0);
    let mut q = p.clone();
    let on = candle_core::Tensor::from_slice(&q, n, &Device::Cpu).unwrap();
    for s in 0..4 {
        let g = values(n, 70 + s, 0.3);
        host.step(&mut p, &g, 1e-2, 0.5);
        if s % 2 == 0 {
            dev.step_on(Some(&mut q), &on, Grads::Host(&g), 1e-2, 0.5)
                .unwrap();
        } else {
            // Gradients that never left the device.
            let gt = candle_core::Tensor::from_slice(&g, n, &Device::Cpu).unwrap();
            dev.step_on(Some(&mut q), &on, Grads::Device(&gt), 1e-2, 0.5)
                .unwrap();
        }
        assert_eq!(p, q, "step {}", s + 1);
        // The device tensor was updated in place to the same values.
        assert_eq!(on.to_vec1::<f32>().unwrap(), q);
    }
    // A tensor of the wrong shape is refused.
    let bad = candle_core::Tensor::zeros(n - 1, candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = dev
        .step_on(
            Some(&mut q),
            &bad,
            Grads::Host(&values(n, 1, 1.0)),
            1e-2,
            1.0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("device parameters"), "{e}");
    let e = dev
        .step_on(Some(&mut q), &on, Grads::Device(&bad), 1e-2, 1.0)
        .unwrap_err();
    assert!(e.to_string().contains("device gradients must be"), "{e}");
    // The sum of squares on the device (f64 throughout) is the host's
    // (f32 lanes over 1024 elements, then f64) up to the host's rounding.
    let g = values(n, 8, 2.0);
    let gt = candle_core::Tensor::from_slice(&g, n, &Device::Cpu).unwrap();
    let host_ss = phalanx::optim::clip::sum_squares(&g);
    let dev_ss = phalanx::optim::device::sum_squares(&gt).unwrap();
    assert!(
        (host_ss - dev_ss).abs() <= 1e-6 * host_ss,
        "{host_ss} vs {dev_ss}"
    );
}

#[test]
fn parameters_on_the_device_for_a_host_optimizer_are_refused_before_any_step() {
    use phalanx::optim::step::{finish_step, Update};
    use phalanx::precision::LossScaler;
    let l = layout();
    let n = l.num_params();
    let out = phalanx_comm::threads::run(1, move |world| {
        let mut host = AdamW::new(AdamWConfig::default(), &l, 0..n, &Ledger::new());
        let mut p = values(n, 1, 1.0);
        let g = values(n, 2, 0.1);
        let dev = candle_core::Tensor::from_slice(&p, n, &Device::Cpu).unwrap();
        let before = p.clone();
        let u = vec![Update {
            params: &mut p,
            grads: &g,
            opt: &mut host,
            on_device: Some(&dev),
        }];
        let mut scaler = LossScaler::fixed(1.0);
        let e = finish_step(&world, 1.0, u, &mut scaler, 1e-2, 0.0, 0).unwrap_err();
        (e.to_string(), p == before, host.step_count())
    });
    let (e, unchanged, steps) = &out[0];
    assert!(e.contains("optimizer on the host"), "{e}");
    assert!(*unchanged && *steps == 0, "a step was taken");
}
