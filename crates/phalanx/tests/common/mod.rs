//! Shared by the op tests (`ops.rs`, `ops_half.rs`, `tp.rs`, `tp_exchange.rs`).

use candle_core::{DType, Device, Tensor};

/// A deterministic pseudo-random f32 tensor of `shape`, values in about
/// [-2, 2], different per `seed`.
pub fn randn(shape: &[usize], seed: u64) -> Tensor {
    // Deterministic pseudo-random values in about [-2, 2].
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `t`'s elements as f32, flat (row-major).
#[allow(dead_code)] // not every test that shares this module reads tensors back
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
