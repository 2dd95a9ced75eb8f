//! The bf16 gemm (`ops::gemm_bf16`) against a float64 reference of the
//! same bf16-rounded operands, on odd shapes and every operand layout the
//! linears use (row-major, transposed, strided), overwriting and
//! accumulating. Skipped (with a note) on a CPU without AVX512-BF16.

use phalanx::ops::{gemm_bf16, Mat};

fn bf(x: f32) -> f64 {
    half::bf16::from_f32(x).to_f64()
}

/// Deterministic values in [-2, 2) with varied exponents.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            (u * 4.0 - 2.0) * if s & 1 == 0 { 1.0 } else { 1e-2 }
        })
        .collect()
}

/// A (rows, cols) matrix stored in a slice with the given layout: 0
/// row-major, 1 column-major, 2 row-major inside a wider row with every
/// other column (cs = 2).
fn stored(rows: usize, cols: usize, layout: u8, seed: u64) -> (Vec<f32>, usize, usize) {
    match layout {
        0 => (values(rows * cols, seed), cols, 1),
        1 => (values(rows * cols, seed), 1, rows),
        _ => (values(rows * (2 * cols + 1), seed), 2 * cols + 1, 2),
    }
}

#[test]
fn bf16_gemm_matches_a_float64_reference_of_the_rounded_operands() {
    if !gemm_bf16::available() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    let mut checked = 0;
    for &(m, n, k) in &[
        (1, 1, 1),
        (5, 17, 3),
        (12, 32, 2),
        (13, 33, 257),
        (37, 70, 255),
        (24, 1030, 64),
        (3, 64, 513),
        (50, 48, 1),
        (3, 4100, 40),
    ] {
        for (la, lb) in [(0u8, 0u8), (0, 1), (1, 0), (1, 1), (2, 2), (0, 2), (2, 1)] {
            for accumulate in [false, true] {
                let (a, ars, acs) = stored(m, k, la, 1 + m as u64);
                let (b, brs, bcs) = stored(k, n, lb, 7 + n as u64);
                let dst_rs = n + 3;
                let init = values(m * dst_rs, 99);
                let mut c = init.clone();
                let am = Mat {
                    data: &a,
                    rs: ars,
                    cs: acs,
                };
                let bm = Mat {
                    data: &b,
                    rs: brs,
                    cs: bcs,
                };
                gemm_bf16::gemm(m, n, k, &mut c, dst_rs, accumulate, am, bm);
                for i in 0..m {
                    for j in 0..dst_rs {
                        let got = c[i * dst_rs + j];
                        if j >= n {
                            assert_eq!(got, init[i * dst_rs + j], "wrote past column {n}");
                            continue;
                        }
                        let (mut want, mut mag) = (0f64, 0f64);
                        for kk in 0..k {
                            let t = bf(a[i * ars + kk * acs]) * bf(b[kk * brs + j * bcs]);
                            want += t;
                            mag += t.abs();
                        }
                        if accumulate {
                            want += init[i * dst_rs + j] as f64;
                            mag += (init[i * dst_rs + j] as f64).abs();
                        }
                        let tol =
                            4.0 * f32::EPSILON as f64 * (k as f64).sqrt().max(1.0) * mag + 1e-30;
                        assert!(
                            (got as f64 - want).abs() <= tol,
                            "({m},{n},{k}) layouts {la}{lb} acc {accumulate}: c[{i},{j}] = {got}, want {want}"
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 9 * 7 * 2);
}

#[test]
fn bf16_gemm_rounds_f32_operands_to_bf16() {
    if !gemm_bf16::available() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    // 1 + 2^-10 is not a bf16 (8 bits of mantissa): it rounds to 1.
    let a = [1.0f32 + 1.0 / 1024.0, 3.0];
    let b = [1.0f32, 1.0];
    let mut c = [0f32];
    let m = |d| Mat {
        data: d,
        rs: 2,
        cs: 1,
    };
    gemm_bf16::gemm(
        1,
        1,
        2,
        &mut c,
        1,
        false,
        m(&a),
        Mat {
            data: &b,
            rs: 1,
            cs: 1,
        },
    );
    assert_eq!(c[0], 4.0);
}
