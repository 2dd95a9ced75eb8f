//! The fastest a GPT-2 or Llama training step could run on one core if
//! everything but its matrix products took no time: every product of one
//! step's forward and backward (each layer's linears, the causal
//! attention's products by blocks as `ops::causal_attention` runs them,
//! the LM head), timed on one thread through `phalanx::ops::sgemm`, the
//! kernel the layers call. Dividing the step's tokens by that time gives a
//! tokens/s ceiling per core, to set beside a measured run.
//!
//! Usage:
//!   gemm_ceiling B T C n_layer n_head vocab [repeats]
//!     e.g. gemm_ceiling 8 256 384 6 6 256          (gpt-10m, micro-batch 8)
//!   gemm_ceiling llama B T C n_layer n_head n_kv_head mlp vocab [repeats]
//!     e.g. gemm_ceiling llama 8 256 768 8 12 4 2560 256   (llama-60m)
//!
//! A Llama layer's linears are q (C -> H d), k and v (C -> K d), o
//! (H d -> C), gate and up (C -> M) and down (M -> C); attention runs per
//! query head (grouped-query heads share k and v, not products); the head
//! is its own (C -> V).
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

/// The model's shapes: (B, T, C, layers, query heads, head size, the
/// layer's linears as (in, out), the q/k/v row strides of attention, vocab).
struct Shapes {
    b: usize,
    t: usize,
    c: usize,
    l: usize,
    nh: usize,
    hs: usize,
    linears: Vec<(usize, usize)>,
    /// Row strides of q, k (and v), and of the attention output.
    q_rs: usize,
    kv_rs: usize,
    v: usize,
    repeats: usize,
}

fn shapes() -> Shapes {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let llama = args.first().is_some_and(|a| a == "llama");
    if llama {
        args.remove(0);
    }
    let n: Vec<usize> = args
        .iter()
        .map(|a| {
            a.parse()
                .expect("numbers: see the usage in the file's header")
        })
        .collect();
    if llama {
        let [b, t, c, l, nh, kv, m, v] = n[..8] else {
            panic!("usage: gemm_ceiling llama B T C n_layer n_head n_kv_head mlp vocab [repeats]")
        };
        let hs = c / nh;
        Shapes {
            b,
            t,
            c,
            l,
            nh,
            hs,
            linears: vec![
                (c, nh * hs),
                (c, kv * hs),
                (c, kv * hs),
                (nh * hs, c),
                (c, m),
                (c, m),
                (m, c),
            ],
            q_rs: nh * hs,
            kv_rs: kv * hs,
            v,
            repeats: n.get(8).copied().unwrap_or(5),
        }
    } else {
        let [b, t, c, l, nh, v] = n[..6] else {
            panic!("usage: gemm_ceiling B T C n_layer n_head vocab [repeats]")
        };
        Shapes {
            b,
            t,
            c,
            l,
            nh,
            hs: c / nh,
            linears: vec![(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)],
            // q, k and v are column blocks of one (N, 3C) buffer.
            q_rs: 3 * c,
            kv_rs: 3 * c,
            v,
            repeats: n.get(6).copied().unwrap_or(5),
        }
    }
}

fn main() {
    let Shapes {
        b,
        t,
        c,
        l,
        nh,
        hs,
        linears,
        q_rs,
        kv_rs,
        v,
        repeats,
    } = shapes();
    let n = b * t;
    let mut layer = Vec::new();
    for (i, o) in linears.iter().copied() {
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
        head.push(p(m, i1, hs, (q_rs, 1), (1, kv_rs))); // S = q k^T
        head.push(p(m, hs, i1, (t, 1), (kv_rs, 1))); // y = P v
        head.push(p(m, i1, hs, (c, 1), (1, kv_rs))); // dP = dy v^T
        head.push(p(m, hs, t - i0, (1, t), (c, 1))); // dv = P^T dy
        head.push(p(m, hs, i1, (t, 1), (kv_rs, 1))); // dq = dS k
        head.push(p(m, hs, t - i0, (1, t), (q_rs, 1))); // dk = dS^T q
    }
    let lm_head = linear(n, c, v);
    // One buffer, big enough for every operand and result, filled with
    // values whose products stay finite.
    let widest = linears.iter().map(|&(i, o)| i.max(o)).max().unwrap_or(c);
    let len = (n * widest).max(n * v).max(widest * c).max(t * t) + 16 * widest.max(q_rs);
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
        "B {b} T {t} C {c} layers {l} heads {nh} (linears {linears:?}) vocab {v}: products of one step {:.1} GFLOP \
         in {:.1} ms on one thread ({:.1} GFLOP/s): ceiling {:.0} tokens/s per core",
        flops / 1e9,
        best * 1e3,
        flops / best / 1e9,
        tokens / best
    );
}
