//! GFLOP/s of the matrix products of a GPT-2 layer's training step, on one
//! thread: `phalanx::ops::sgemm` (the gemm crate, as the engine calls it),
//! the weight-gradient product in its transposed form, and the bf16 gemm
//! (`ops::gemm_bf16`, bf16 products on AVX512-BF16) where the CPU has it.
//! Usage: gemm_shapes ROWS C   (e.g. 2048 384 for gpt-10m at B 8, T 256)
use phalanx::ops::{gemm_bf16, sgemm, Mat};
use std::time::Instant;

fn best_of(mut f: impl FnMut()) -> f64 {
    (0..8)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS C"))
        .collect();
    let (rows, c) = (args[0], args[1]);
    // (name, m, n, k, a (rs, cs), b (rs, cs))
    let shapes = [
        ("fwd x.W^T qkv", rows, 3 * c, c, (c, 1), (1, c)),
        ("fwd x.W^T fc", rows, 4 * c, c, (c, 1), (1, c)),
        ("fwd g.W^T proj", rows, c, 4 * c, (4 * c, 1), (1, 4 * c)),
        ("bwd dy.W fc", rows, c, 4 * c, (4 * c, 1), (c, 1)),
        ("bwd dW=dy^T x fc", 4 * c, c, rows, (1, 4 * c), (c, 1)),
        ("bwd dW=dy^T g proj", c, 4 * c, rows, (1, c), (4 * c, 1)),
    ];
    let big = vec![0.5f32; 16 * c * rows.max(4 * c)];
    for (name, m, n, k, (ars, acs), (brs, bcs)) in shapes {
        let mut d = vec![0f32; m * n];
        let a = Mat {
            data: &big,
            rs: ars,
            cs: acs,
        };
        let b = Mat {
            data: &big,
            rs: brs,
            cs: bcs,
        };
        let t = best_of(|| sgemm(m, n, k, &mut d, false, a, b));
        let flops = 2.0 * (m * n * k) as f64;
        print!("{name:20} {m}x{n}x{k}: {:6.1} GFLOP/s", flops / t / 1e9);
        if gemm_bf16::available() {
            let t3 = best_of(|| gemm_bf16::gemm(m, n, k, &mut d, n, false, a, b));
            print!("   bf16: {:6.1} GFLOP/s ({:.2}x)", flops / t3 / 1e9, t / t3);
        }
        if ars == 1 {
            // The same product as d^T = b^T a^T, d written column-major.
            let t2 = best_of(|| unsafe {
                gemm::gemm(
                    n,
                    m,
                    k,
                    d.as_mut_ptr(),
                    n as isize,
                    1,
                    false,
                    big.as_ptr(),
                    brs as isize,
                    bcs as isize,
                    big.as_ptr(),
                    ars as isize,
                    acs as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            });
            print!("   transposed: {:6.1} GFLOP/s", flops / t2 / 1e9);
        }
        println!();
    }
}
