//! Optimizers, clipping and schedules against hand-computed references.

use phalanx::engine::{shard_range, Layout, ParamDecl};
use phalanx::ledger::{Ledger, Mem};
use phalanx::optim::clip::{clip_grad_norm, clip_scale, sum_squares};
use phalanx::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};

/// Two parameters: a (2, 3) matrix (decayed) then, by name order, a (3,) bias.
/// "a.w" sorts before "b.bias", so the matrix comes first.
fn layout() -> Layout {
    Layout::new(vec![vec![
        ParamDecl::new("b.bias", &[3]),
        ParamDecl::new("a.w", &[2, 3]),
    ]])
    .unwrap()
}

fn grads_at(step: usize) -> Vec<f32> {
    (0..9)
        .map(|i| ((i * 7 + step * 3) % 11) as f32 / 5.0 - 1.0)
        .collect()
}

#[test]
fn decay_mask_follows_ndim() {
    let l = layout();
    assert_eq!(l.find("a.w").unwrap().offset, 0);
    assert_eq!(l.decay_mask(0..9), [vec![true; 6], vec![false; 3]].concat());
    // A shard cutting through the matrix.
    assert_eq!(l.decay_segments(4..8), vec![(0..2, true), (2..4, false)]);
}

#[test]
fn adamw_matches_hand_computation() {
    let l = layout();
    let cfg = AdamWConfig {
        beta1: 0.8,
        beta2: 0.9,
        eps: 1e-6,
        weight_decay: 0.5,
    };
    let mut opt = AdamW::new(cfg, &l, 0..9, &Ledger::new());
    let mut p: Vec<f32> = (0..9).map(|i| i as f32 * 0.1 - 0.3).collect();
    // Reference in f64, written out from the paper / PyTorch docs.
    let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let (mut m, mut v) = (vec![0f64; 9], vec![0f64; 9]);
    let lrs = [0.1f32, 0.05, 0.2, 0.01];
    for (t, &lr) in lrs.iter().enumerate() {
        let g = grads_at(t);
        let scale = 0.5f32; // a clipping factor, fused into the step
        opt.step(&mut p, &g, lr, scale);
        let t = (t + 1) as i32;
        for i in 0..9 {
            let gi = g[i] as f64 * scale as f64;
            m[i] = 0.8 * m[i] + 0.2 * gi;
            v[i] = 0.9 * v[i] + 0.1 * gi * gi;
            let mhat = m[i] / (1.0 - 0.8f64.powi(t));
            let vhat = v[i] / (1.0 - 0.9f64.powi(t));
            let wd = if i < 6 { 0.5 } else { 0.0 }; // matrix only
            rp[i] = rp[i] * (1.0 - lr as f64 * wd) - lr as f64 * mhat / (vhat.sqrt() + 1e-6);
        }
    }
    for i in 0..9 {
        assert!(
            (p[i] as f64 - rp[i]).abs() < 1e-6,
            "param {i}: {} vs {}",
            p[i],
            rp[i]
        );
    }
    assert_eq!(opt.step_count(), 4);
    let (om, ov) = opt.state();
    for i in 0..9 {
        assert!((om[i] as f64 - m[i]).abs() < 1e-6 && (ov[i] as f64 - v[i]).abs() < 1e-6);
    }
}

#[test]
fn adamw_first_step_is_sign_sized() {
    // With bias correction the first update is lr * g / (|g| + eps) = +-lr.
    let l = Layout::new(vec![vec![ParamDecl::new("b", &[2])]]).unwrap();
    let mut opt = AdamW::new(
        AdamWConfig {
            eps: 0.0,
            ..Default::default()
        },
        &l,
        0..2,
        &Ledger::new(),
    );
    let mut p = vec![0f32, 0.0];
    opt.step(&mut p, &[3.0, -0.001], 0.1, 1.0);
    assert!(
        (p[0] + 0.1).abs() < 1e-6 && (p[1] - 0.1).abs() < 1e-6,
        "{p:?}"
    );
}

#[test]
fn sharded_step_equals_full_step_restricted() {
    let l = layout();
    let cfg = AdamWConfig {
        weight_decay: 0.3,
        ..Default::default()
    };
    let p0: Vec<f32> = (0..9).map(|i| (i as f32 - 4.0) * 0.2).collect();
    // 2 ranks: shards 0..5 (matrix) and 5..9 (matrix end + bias: the mask
    // changes inside the shard); 4 ranks: uneven shards 3, 3, 3, 0.
    for world in [2usize, 4] {
        let mut sharded = p0.clone();
        let ledger = Ledger::new();
        let mut shards: Vec<AdamW> = (0..world)
            .map(|r| AdamW::new(cfg, &l, shard_range(9, r, world), &ledger))
            .collect();
        assert_eq!(ledger.current(Mem::OptState), 9 * 8);
        let mut full_w = p0.clone();
        let mut opt_w = AdamW::new(cfg, &l, 0..9, &Ledger::new());
        for t in 0..3 {
            let g = grads_at(t);
            opt_w.step(&mut full_w, &g, 0.1, 1.0);
            for s in shards.iter_mut() {
                let r = s.range();
                s.step(&mut sharded[r.clone()], &g[r], 0.1, 1.0);
            }
        }
        assert_ne!(full_w, p0);
        assert_eq!(sharded, full_w, "world {world}");
    }
}

#[test]
fn sgd_momentum_matches_hand_computation() {
    let l = layout();
    for nesterov in [false, true] {
        let cfg = SgdConfig {
            momentum: 0.9,
            nesterov,
            weight_decay: 0.1,
        };
        let ledger = Ledger::new();
        let mut opt = Sgd::new(cfg, &l, 0..9, &ledger);
        assert_eq!(ledger.current(Mem::OptState), 9 * 4);
        let mut p: Vec<f32> = (0..9).map(|i| i as f32 * 0.1).collect();
        let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut buf = [0f64; 9];
        for t in 0..3 {
            let g = grads_at(t);
            opt.step(&mut p, &g, 0.05, 1.0);
            for i in 0..9 {
                let wd = if i < 6 { 0.1 } else { 0.0 };
                let gi = g[i] as f64 + wd * rp[i];
                buf[i] = if t == 0 { gi } else { 0.9 * buf[i] + gi };
                let d = if nesterov { gi + 0.9 * buf[i] } else { buf[i] };
                rp[i] -= 0.05 * d;
            }
        }
        for i in 0..9 {
            assert!(
                (p[i] as f64 - rp[i]).abs() < 1e-6,
                "nesterov={nesterov} {i}"
            );
        }
    }
    // Without momentum no state is held.
    let ledger = Ledger::new();
    let _plain = Sgd::new(SgdConfig::default(), &l, 0..9, &ledger);
    assert_eq!(ledger.current(Mem::OptState), 0);
}

#[test]
fn clipping_by_global_norm() {
    let mut g = vec![3.0f32, 0.0, 4.0, 0.0];
    let norm = clip_grad_norm(&mut g, 2.5);
    assert_eq!(norm, 5.0);
    let after = sum_squares(&g).sqrt();
    assert!((after - 2.5).abs() < 1e-5, "{after}");
    // Under the limit: untouched, norm still reported.
    let mut g2 = vec![0.3f32, 0.4];
    assert!((clip_grad_norm(&mut g2, 1.0) - 0.5).abs() < 1e-7);
    assert_eq!(g2, vec![0.3, 0.4]);
    // Shards: the sum of the shards' sums of squares gives the global scale.
    let g: Vec<f32> = (0..1001).map(|i| (i as f32).sin()).collect();
    let parts: f64 = (0..3)
        .map(|r| sum_squares(&g[shard_range(g.len(), r, 3)]))
        .sum();
    let (n1, s1) = clip_scale(parts, 1.0);
    let (n2, s2) = clip_scale(sum_squares(&g), 1.0);
    assert!((n1 - n2).abs() < 1e-4 && (s1 - s2).abs() < 1e-7);
    assert!(s1 < 1.0);
}

#[test]
fn schedule_values() {
    let s = LrSchedule::WarmupCosine {
        max_lr: 6e-4,
        min_lr: 6e-5,
        warmup: 100,
        decay_steps: 1100,
    };
    assert!((s.lr(0) - 6e-6).abs() < 1e-10);
    assert!((s.lr(49) - 3e-4).abs() < 1e-9);
    assert!((s.lr(99) - 6e-4).abs() < 1e-9);
    assert!((s.lr(100) - 6e-4).abs() < 1e-9);
    assert!((s.lr(600) - 3.3e-4).abs() < 1e-9); // halfway: (max + min) / 2
    let quarter = 6e-5 + 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()) * 5.4e-4;
    assert!((s.lr(350) as f64 - quarter).abs() < 1e-9);
    assert!((s.lr(1100) - 6e-5).abs() < 1e-12);
    assert!((s.lr(5000) - 6e-5).abs() < 1e-12);
    // Monotone decay after warmup.
    assert!((100..1100).all(|t| s.lr(t + 1) <= s.lr(t)));
    assert_eq!(LrSchedule::Constant { lr: 0.1 }.lr(12345), 0.1);
}

#[test]
fn shard_ranges_cover_any_size() {
    for n in [0usize, 1, 7, 10, 1001] {
        for world in 1..6 {
            let rs: Vec<_> = (0..world).map(|r| shard_range(n, r, world)).collect();
            assert_eq!(rs[0].start, 0);
            assert_eq!(rs[world - 1].end, n);
            for w in rs.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(rs.iter().all(|r| r.len() <= n.div_ceil(world)));
        }
    }
}

/// AdamW with its variance frozen after step F (1-bit Adam, for top-k):
/// step F+1 on takes the gradient as the momentum in sum form and keeps v,
/// so the update is linear: a gradient held back one step and delivered
/// with the next moves the parameters exactly as far as delivering it at
/// once (no weight decay), which plain Adam does not.
#[test]
fn adamw_with_a_frozen_variance_is_linear_in_what_it_is_handed() {
    let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2, 4])]]).unwrap();
    let cfg = AdamWConfig {
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let warm: Vec<Vec<f32>> = (0..3)
        .map(|t| (0..8).map(|i| ((i * 3 + t) as f32).sin()).collect())
        .collect();
    let (a, b): (Vec<f32>, Vec<f32>) = (
        (0..8).map(|i| 0.5 + i as f32 * 0.1).collect(),
        (0..8).map(|i| -0.3 + i as f32 * 0.05).collect(),
    );
    let zero = vec![0f32; 8];
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    // (freeze?, the two deliveries after the warm-up) -> final parameters
    let run = |freeze: bool, first: &[f32], second: &[f32]| {
        let ledger = Ledger::new();
        let mut opt = AdamW::new(cfg, &layout, 0..8, &ledger);
        if freeze {
            opt.freeze_variance_after(3).unwrap();
        }
        let mut p = vec![1f32; 8];
        for g in warm.iter().map(|g| g.as_slice()).chain([first, second]) {
            opt.step(&mut p, g, 1e-2, 1.0);
        }
        (p, opt.state().1.to_vec())
    };
    let (at_once, v1) = run(true, &sum, &zero);
    let (later, v2) = run(true, &a, &b);
    for (x, y) in at_once.iter().zip(&later) {
        assert!((x - y).abs() < 1e-6, "frozen: {x} vs {y}");
    }
    // v stayed as step 3 left it, whatever was handed over.
    assert_eq!(v1, v2);
    let (p1, _) = run(false, &sum, &zero);
    let (p2, _) = run(false, &a, &b);
    let gap = p1
        .iter()
        .zip(&p2)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(gap > 1e-4, "plain Adam should not be linear: {gap}");
}
