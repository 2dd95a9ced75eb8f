//! Each op's device-generic branch (candle's composed ops: what a CUDA
//! device runs) against its CPU kernel, in f32, bf16 and f16: the same values and
//! input gradients. With the CPU kernels off (`ops::set_host_kernels`),
//! the branch runs on the CPU. One test: the switch is process-wide.

use candle_core::{DType, Result, Tensor, Var};
use phalanx::ops;

mod common;
use common::randn;

type Op = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

/// Value and input gradient of `f(x) . w` for a fixed random `w`, as f32.
fn value_and_grad(x: &Tensor, f: &Op) -> (Vec<f32>, Vec<f32>) {
    let v = Var::from_tensor(x).unwrap();
    let y = f(v.as_tensor()).unwrap();
    let w = randn(y.dims(), 99).to_dtype(y.dtype()).unwrap();
    let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let f32s = |t: &Tensor| -> Vec<f32> {
        let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1().unwrap()
    };
    (f32s(&y), f32s(g.get(v.as_tensor()).unwrap()))
}

/// The largest difference over the largest magnitude.
fn rel_max(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    d / scale
}

#[test]
fn every_op_s_generic_branch_matches_its_cpu_kernel() {
    let (b, t, c, nh) = (2, 13, 20, 4);
    let w = randn(&[c], 3);
    let bias = randn(&[c], 4);
    let lin_w = (randn(&[7, c], 5) * 0.3).unwrap();
    let lin_b = randn(&[7], 6);
    let targets = Tensor::from_vec(
        (0..(b * t) as u32).map(|i| (i * 7) % c as u32).collect(),
        b * t,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let cases: Vec<(&str, Vec<usize>, Op)> = vec![
        (
            "causal_attention",
            vec![b, t, 3 * c],
            Box::new(move |x| ops::causal_attention(x, nh)),
        ),
        (
            "causal_softmax",
            vec![b, 3, t, t],
            Box::new(|x| ops::causal_softmax(x, 0.3)),
        ),
        (
            "softmax_last_dim",
            vec![b, t, c],
            Box::new(ops::softmax_last_dim),
        ),
        ("gelu", vec![b, t, c], Box::new(ops::gelu)),
        (
            "layer_norm",
            vec![b, t, c],
            Box::new(move |x| {
                let d = x.dtype();
                ops::layer_norm(x, &w.to_dtype(d)?, &bias.to_dtype(d)?, 1e-5)
            }),
        ),
        (
            "linear",
            vec![b, t, c],
            Box::new(move |x| {
                let d = x.dtype();
                ops::linear(x, &lin_w.to_dtype(d)?, Some(&lin_b.to_dtype(d)?))
            }),
        ),
        (
            "add_bias",
            vec![b, t, 7],
            Box::new(|x| ops::add_bias(x, &randn(&[7], 8).to_dtype(x.dtype())?)),
        ),
        (
            "cross_entropy",
            vec![b * t, c],
            Box::new(move |x| ops::cross_entropy(x, &targets)),
        ),
    ];
    for (dtype, tol) in [
        (DType::F32, 2e-5f32),
        (DType::BF16, 3e-2),
        (DType::F16, 1e-2),
    ] {
        for (name, shape, f) in &cases {
            let x = randn(shape, 1).to_dtype(dtype).unwrap();
            ops::set_host_kernels(Some(true));
            let before = ops::kernel_runs();
            let (y0, g0) = value_and_grad(&x, f);
            assert!(ops::kernel_runs() > before, "{name}: no CPU kernel ran");
            ops::set_host_kernels(Some(false));
            let before = ops::kernel_runs();
            let (y1, g1) = value_and_grad(&x, f);
            assert_eq!(ops::kernel_runs(), before, "{name}: a CPU kernel ran");
            let (ey, eg) = (rel_max(&y1, &y0), rel_max(&g1, &g0));
            assert!(
                ey <= tol,
                "{name} {dtype:?}: values differ by {ey:e} of the largest"
            );
            assert!(
                eg <= tol,
                "{name} {dtype:?}: gradients differ by {eg:e} of the largest"
            );
        }
    }
    ops::set_host_kernels(None);
}
