//! The fused ops against candle's composed ops: values and gradients.

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use phalanx::ops;

use crate::common;
use common::randn;

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Value and input gradient of `f(x) . w` for a fixed random `w`.
fn value_and_grad(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> (Tensor, Tensor) {
    let v = Var::from_tensor(x).unwrap();
    let y = f(v.as_tensor()).unwrap();
    let w = randn(y.dims(), 99);
    let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    (y, g.get(v.as_tensor()).unwrap().clone())
}

#[test]
fn gelu_matches_candle() {
    // Wide range, including the saturated tails.
    let x = (randn(&[3, 1000, 37], 1) * 3.0).unwrap();
    let (y1, g1) = value_and_grad(&x, ops::gelu);
    let (y2, g2) = value_and_grad(&x, |x| x.gelu());
    assert!(
        max_abs_diff(&y1, &y2) < 2e-6,
        "forward {}",
        max_abs_diff(&y1, &y2)
    );
    assert!(
        max_abs_diff(&g1, &g2) < 2e-5,
        "backward {}",
        max_abs_diff(&g1, &g2)
    );
}

#[test]
fn gelu_against_f64_formula() {
    let xs: Vec<f32> = (-800..800).map(|i| i as f32 / 50.0).collect();
    let mut ys = vec![0f32; xs.len()];
    ops::gelu_forward(&xs, &mut ys);
    for (&x, &y) in xs.iter().zip(&ys) {
        let x = x as f64;
        let want = 0.5
            * x
            * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
        assert!(
            (y as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
            "gelu({x}) = {y}, want {want}"
        );
    }
}

#[test]
fn layer_norm_matches_candle() {
    let x = randn(&[4, 33, 64], 2);
    let w = Var::from_tensor(&randn(&[64], 3)).unwrap();
    let b = Var::from_tensor(&randn(&[64], 4)).unwrap();
    let run = |fused: bool| {
        let xv = Var::from_tensor(&x).unwrap();
        let y = if fused {
            ops::layer_norm(xv.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)
        } else {
            candle_nn::ops::layer_norm_slow(xv.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)
        }
        .unwrap();
        let gy = randn(y.dims(), 5);
        let g = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
        let get = |t: &Tensor| g.get(t).unwrap().clone();
        (
            y,
            get(xv.as_tensor()),
            get(w.as_tensor()),
            get(b.as_tensor()),
        )
    };
    let (a, b2) = (run(true), run(false));
    assert!(max_abs_diff(&a.0, &b2.0) < 1e-5);
    assert!(
        max_abs_diff(&a.1, &b2.1) < 1e-4,
        "dx {}",
        max_abs_diff(&a.1, &b2.1)
    );
    assert!(
        max_abs_diff(&a.2, &b2.2) < 1e-3,
        "dw {}",
        max_abs_diff(&a.2, &b2.2)
    );
    assert!(
        max_abs_diff(&a.3, &b2.3) < 1e-3,
        "db {}",
        max_abs_diff(&a.3, &b2.3)
    );
}

#[test]
fn causal_softmax_matches_masked_softmax() {
    let (t, scale) = (17, 0.37f32);
    let x = randn(&[2, 3, t, t], 6);
    let (y1, g1) = value_and_grad(&x, |x| ops::causal_softmax(x, scale));
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t > k / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
    let (y2, g2) = value_and_grad(&x, |x| {
        let s = (x * scale as f64)?.broadcast_add(&mask)?;
        candle_nn::ops::softmax(&s, D::Minus1)
    });
    assert!(max_abs_diff(&y1, &y2) < 1e-6);
    assert!(max_abs_diff(&g1, &g2) < 1e-5);
    // Masked entries are exactly zero.
    let row0 = y1
        .flatten_to(2)
        .unwrap()
        .get(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(row0[0], 1.0);
    assert!(row0[1..].iter().all(|&v| v == 0.0));
}

#[test]
fn softmax_last_dim_has_backward() {
    let x = randn(&[5, 40], 7);
    let (y1, g1) = value_and_grad(&x, ops::softmax_last_dim);
    let (y2, g2) = value_and_grad(&x, |x| candle_nn::ops::softmax(x, D::Minus1));
    assert!(max_abs_diff(&y1, &y2) < 1e-6);
    assert!(max_abs_diff(&g1, &g2) < 1e-6);
}

#[test]
fn cross_entropy_matches_candle() {
    let (n, v) = (37, 300);
    let logits = (randn(&[n, v], 8) * 3.0).unwrap();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % v as u32).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    let run = |fused: bool| {
        let lv = Var::from_tensor(&logits).unwrap();
        let loss = if fused {
            ops::cross_entropy(lv.as_tensor(), &targets)
        } else {
            candle_nn::loss::cross_entropy(lv.as_tensor(), &targets)
        }
        .unwrap();
        let g = (&loss * 0.5).unwrap().backward().unwrap();
        (
            loss.to_scalar::<f32>().unwrap(),
            g.get(lv.as_tensor()).unwrap().clone(),
        )
    };
    let ((l1, g1), (l2, g2)) = (run(true), run(false));
    assert!((l1 - l2).abs() < 1e-5 * l2.abs(), "{l1} vs {l2}");
    assert!(max_abs_diff(&g1, &g2) < 1e-7, "{}", max_abs_diff(&g1, &g2));
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
    let err = ops::cross_entropy(&logits, &t).unwrap_err().to_string();
    assert!(err.contains("out of range"), "{err}");
}

#[test]
fn add_bias_and_linear_match_candle() {
    let x = randn(&[3, 7, 12], 10);
    let w = Var::from_tensor(&randn(&[5, 12], 11)).unwrap();
    let b = Var::from_tensor(&randn(&[5], 12)).unwrap();
    let run = |fused: bool| {
        let xv = Var::from_tensor(&x).unwrap();
        let y = if fused {
            ops::linear(xv.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap()
        } else {
            candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))
                .forward(xv.as_tensor())
                .unwrap()
        };
        let gy = randn(y.dims(), 13);
        let g = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
        let get = |t: &Tensor| g.get(t).unwrap().clone();
        (
            y,
            get(xv.as_tensor()),
            get(w.as_tensor()),
            get(b.as_tensor()),
        )
    };
    let (a, c) = (run(true), run(false));
    assert_eq!(a.0.dims(), &[3, 7, 5]);
    for (u, v) in [(&a.0, &c.0), (&a.1, &c.1), (&a.2, &c.2), (&a.3, &c.3)] {
        assert!(max_abs_diff(u, v) < 1e-5, "{}", max_abs_diff(u, v));
    }
    // A (T, C) table on (B, T, C), as GPT-2's position embedding.
    let pos = randn(&[7, 12], 14);
    let (y1, g1) = value_and_grad(&pos, |p| ops::add_bias(&x, p));
    let (y2, g2) = value_and_grad(&pos, |p| x.broadcast_add(p));
    assert!(max_abs_diff(&y1, &y2) == 0.0 && max_abs_diff(&g1, &g2) < 1e-5);
    assert!(ops::add_bias(&x, &randn(&[7], 1)).is_err());
}

#[test]
fn causal_attention_matches_composed() {
    // T below one block of query rows, a whole number of blocks plus one,
    // and uneven blocks (the products skip the masked triangle by blocks).
    for t in [9, ops::ATTENTION_BLOCK + 1, 2 * ops::ATTENTION_BLOCK + 22] {
        attention_case(2, t, 3, 4);
    }
}

fn attention_case(b: usize, t: usize, nh: usize, hs: usize) {
    let c = nh * hs;
    let qkv = randn(&[b, t, 3 * c], 20);
    let (y1, g1) = value_and_grad(&qkv, |x| ops::causal_attention(x, nh));
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t > k / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
    let (y2, g2) = value_and_grad(&qkv, |x| {
        let split = |i: usize| {
            x.narrow(2, i * c, c)?
                .reshape((b, t, nh, hs))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?)? / (hs as f64).sqrt())?.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))
    });
    assert_eq!(y1.dims(), &[b, t, c]);
    assert!(max_abs_diff(&y1, &y2) < 1e-5, "{}", max_abs_diff(&y1, &y2));
    assert!(max_abs_diff(&g1, &g2) < 1e-4, "{}", max_abs_diff(&g1, &g2));
    // A second backward through the same graph recomputes the probabilities.
    let v = Var::from_tensor(&qkv).unwrap();
    let y = ops::causal_attention(v.as_tensor(), nh)
        .unwrap()
        .sum_all()
        .unwrap();
    let a = y.backward().unwrap().get(v.as_tensor()).unwrap().clone();
    let b2 = y.backward().unwrap().get(v.as_tensor()).unwrap().clone();
    assert!(max_abs_diff(&a, &b2) < 1e-6);
}

#[test]
fn large_linear_split_over_threads_matches_candle() {
    // Big enough for sgemm to split rows over the thread pool, with an odd
    // row count so the last chunk is short.
    let x = randn(&[3, 117, 64], 30);
    let w = randn(&[96, 64], 31);
    let b = randn(&[96], 32);
    let (y1, g1) = value_and_grad(&x, |x| ops::linear(x, &w, Some(&b)));
    let (y2, g2) = value_and_grad(&x, |x| x.broadcast_matmul(&w.t()?)?.broadcast_add(&b));
    assert!(max_abs_diff(&y1, &y2) < 1e-4, "{}", max_abs_diff(&y1, &y2));
    assert!(max_abs_diff(&g1, &g2) < 1e-4, "{}", max_abs_diff(&g1, &g2));
    // dw = dy^T x: m = 96 output rows, k = 351 reduction rows.
    let wv = Var::from_tensor(&w).unwrap();
    let gy = randn(&[3, 117, 96], 33);
    let g = (ops::linear(&x, wv.as_tensor(), None).unwrap() * &gy)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want = gy
        .reshape((351, 96))
        .unwrap()
        .t()
        .unwrap()
        .matmul(&x.reshape((351, 64)).unwrap())
        .unwrap();
    assert!(max_abs_diff(g.get(wv.as_tensor()).unwrap(), &want) < 1e-3);
}

/// The zero-bubble input pass holds the weights constant and the weight
/// pass the input: the linear's backward computes only what takes part in
/// autograd, and what it computes is still exact.
#[test]
fn linear_backward_only_for_tracked_inputs() {
    use candle_core::{Device, Tensor, Var};
    let dev = Device::Cpu;
    let xv: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    let wv: Vec<f32> = (0..8).map(|i| (i as f32 * 0.61).cos()).collect();
    let full = {
        let (x, w) = (
            Var::from_vec(xv.clone(), (3, 4), &dev).unwrap(),
            Var::from_vec(wv.clone(), (2, 4), &dev).unwrap(),
        );
        let g = phalanx::ops::linear(x.as_tensor(), w.as_tensor(), None)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        (
            g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap(),
            g.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap(),
        )
    };
    // Input pass: weights constant.
    let x = Var::from_vec(xv.clone(), (3, 4), &dev).unwrap();
    let w = Tensor::from_vec(wv.clone(), (2, 4), &dev).unwrap();
    let g = phalanx::ops::linear(x.as_tensor(), &w, None)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap(),
        full.0
    );
    assert!(g.get(&w).is_none());
    // Weight pass: input constant.
    let x = Tensor::from_vec(xv, (3, 4), &dev).unwrap();
    let w = Var::from_vec(wv, (2, 4), &dev).unwrap();
    let g = phalanx::ops::linear(&x, w.as_tensor(), None)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        g.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap(),
        full.1
    );
    assert!(g.get(&x).is_none());
}
