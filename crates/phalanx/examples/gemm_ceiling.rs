//! The fastest a GPT-2 training step could run on one core if everything
//! but its matrix products took no time: every product of one step's
//! forward and backward (the four linears of each layer, the causal
//! attention's products by blocks as `ops::causal_attention` runs them, the
//! tied LM head), timed on one thread through `phalanx::ops::sgemm`, the
//! kernel the layers call. Dividing the step's tokens by that time gives a
//! tokens/s ceiling per core, to set beside a measured run.
//!
//! Usage: gemm_ceiling B T C n_layer n_head vocab [repeats]
//!   e.g. gemm_ceiling 8 256 384 6 6 256    (gpt-10m, micro-batch 8)
use phalanx::ops::{sgemm_strided, Mat, ATTENTION_BLOCK};
use std::time::Instant;

/// A product (m, n, k) with the operands' (row, column) strides.
struct Product {
    m: usize,
    n: usize,
    k: usize,
    a: (usize, usize),
    b: (usize, usize),
}

fn p(m: usize, n: usize, k: usize, a: (usize, usize), b: (usize, usize)) -> Product {
    Product { m, n, k, a, b }
}

/// The products of a linear y (N, o) = x (N, i) W^T, W (o, i): forward,
/// the input gradient dy W and the weight gradient dy^T x.
fn linear(n: usize, i: usize, o: usize) -> [Product; 3] {
    [
        p(n, o, i, (i, 1), (1, i)),
        p(n, i, o, (o, 1), (i, 1)),
        p(o, i, n, (1, o), (i, 1)),
    ]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("B T C n_layer n_head vocab [repeats]"))
        .collect();
    let [b, t, c, l, nh, v] = args[..6] else {
        panic!("usage: gemm_ceiling B T C n_layer n_head vocab [repeats]")
    };
    let repeats = args.get(6).copied().unwrap_or(5);
    let (n, hs) = (b * t, c / nh);
    let mut layer = Vec::new();
    for (i, o) in [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] {
        layer.extend(linear(n, i, o));
    }
    // Attention, per (batch, head), by blocks of query rows (forward: S and
    // P v; backward: dP, dv, dq, dk), as ops::causal_attention runs them.
    let mut head = Vec::new();
    for i0 in (0..t).step_by(ATTENTION_BLOCK) {
        let (m, i1) = (
            (i0 + ATTENTION_BLOCK).min(t) - i0,
            (i0 + ATTENTION_BLOCK).min(t),
        );
        head.push(p(m, i1, hs, (3 * c, 1), (1, 3 * c))); // S = q k^T
        head.push(p(m, hs, i1, (t, 1), (3 * c, 1))); // y = P v
        head.push(p(m, i1, hs, (c, 1), (1, 3 * c))); // dP = dy v^T
        head.push(p(m, hs, t - i0, (1, t), (c, 1))); // dv = P^T dy
        head.push(p(m, hs, i1, (t, 1), (3 * c, 1))); // dq = dS k
        head.push(p(m, hs, t - i0, (1, t), (3 * c, 1))); // dk = dS^T q
    }
    let lm_head = linear(n, c, v);
    // One buffer, big enough for every operand and result, filled with
    // values whose products stay finite.
    let len = (n * 4 * c).max(n * v).max(4 * c * c).max(t * t) + 16 * c;
    let src: Vec<f32> = (0..len).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
    let mut dst = vec![0f32; len];
    let run = |ps: &[Product], dst: &mut [f32]| -> (f64, f64) {
        let mut flops = 0.0;
        let start = Instant::now();
        for q in ps {
            let a = Mat {
                data: &src,
                rs: q.a.0,
                cs: q.a.1,
            };
            let bm = Mat {
                data: &src,
                rs: q.b.0,
                cs: q.b.1,
            };
            sgemm_strided(q.m, q.n, q.k, dst, q.n, false, a, bm, false);
            flops += 2.0 * (q.m * q.n * q.k) as f64;
        }
        (start.elapsed().as_secs_f64(), flops)
    };
    let mut best = f64::MAX;
    let mut flops = 0.0;
    for _ in 0..repeats {
        let (mut secs, mut f) = (0.0, 0.0);
        for _ in 0..l {
            let (s, g) = run(&layer, &mut dst);
            secs += s;
            f += g;
            for _ in 0..b * nh {
                let (s, g) = run(&head, &mut dst);
                secs += s;
                f += g;
            }
        }
        let (s, g) = run(&lm_head, &mut dst);
        best = best.min(secs + s);
        flops = f + g;
    }
    let tokens = n as f64;
    println!(
        "B {b} T {t} C {c} layers {l} heads {nh} vocab {v}: products of one step {:.1} GFLOP \
         in {:.1} ms on one thread ({:.1} GFLOP/s): ceiling {:.0} tokens/s per core",
        flops / 1e9,
        best * 1e3,
        flops / best / 1e9,
        tokens / best
    );
}
