//! Tensor parallelism's exchanges as they run on a device (`tp::comm`:
//! the result's buffer built where the tensor lies, the collective in
//! place on it) and the vocabulary-parallel loss in candle's ops (the
//! form a GPU takes), on the CPU, ranks as threads:
//! - the sequence exchanges' values and gradients against what they mean,
//!   in f32 and bf16, and a sequence the group does not divide refused;
//! - the loss in both forms (the fused CPU op, and candle's ops with the
//!   CPU kernels off) against one rank's cross-entropy on the whole
//!   logits, with a padded vocabulary that leaves a shard part padding or
//!   all padding.
//!
//! One test switches the CPU kernels (a process-wide setting); the other
//! does not depend on it.

use candle_core::{DType, Device, Tensor, Var};
use phalanx::ops::{kernel_runs, set_host_kernels};
use phalanx::tp::{gather_seq, reduce_scatter_seq, split_seq, vocab_parallel_cross_entropy, Tp};
use phalanx_comm::threads;

mod common;
use common::{flat, randn};

#[test]
fn sequence_exchanges_move_the_sequence_axis_and_their_gradients() {
    for dt in [DType::F32, DType::BF16] {
        let out = threads::run(2, move |pg| {
            let r = pg.rank();
            // (B=2, T=4, C=2): rank r's values are 10 r + their index.
            let x = Tensor::arange(0f32, 16.0, &Device::Cpu)
                .unwrap()
                .affine(1.0, 10.0 * r as f64)
                .unwrap()
                .reshape((2, 4, 2))
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let xv = Var::from_tensor(&x).unwrap();
            // Partial sums over the ranks, this rank's half of T kept.
            let rs = reduce_scatter_seq(xv.as_tensor(), &pg).unwrap();
            // The halves put back together: the summed (1, 4, 2).
            let g = gather_seq(&rs, &pg).unwrap();
            // This rank's half of a replicated tensor.
            let s = split_seq(&g, &pg).unwrap();
            // Weights 1 + index, so every gradient element says where it came from.
            let w = Tensor::arange(1f32, 9.0, &Device::Cpu)
                .unwrap()
                .reshape((2, 2, 2))
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let loss = (s * w).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let dx = grads.get(xv.as_tensor()).unwrap();
            (
                rs.dims().to_vec(),
                flat(&rs),
                flat(&g),
                flat(dx),
                split_seq(&Tensor::zeros((2, 3, 2), dt, &Device::Cpu).unwrap(), &pg)
                    .unwrap_err()
                    .to_string(),
            )
        });
        // The sum over ranks of 10 r + i: 10 + 2 i, at (b, t, c) = 8 b + 2 t + c.
        let sum = |b: usize, t: usize, c: usize| 10.0 + 2.0 * (8 * b + 2 * t + c) as f32;
        let all: Vec<f32> = (0..16).map(|i| sum(i / 8, i / 2 % 4, i % 2)).collect();
        for (r, (dims, rs, g, dx, err)) in out.into_iter().enumerate() {
            assert_eq!(dims, [2, 2, 2], "{dt:?}");
            // Rank r's half of T (rows 2r, 2r + 1) of each batch row.
            let half: Vec<f32> = (0..8)
                .map(|i| sum(i / 4, 2 * r + i / 2 % 2, i % 2))
                .collect();
            assert_eq!(rs, half, "{dt:?} rank {r}");
            assert_eq!(g, all, "{dt:?} rank {r}");
            // Rank r's split takes T rows 2r..2r+2, weights 1..4: the
            // split's backward all-gathers the two ranks' (1, 4, 2); the
            // gather's reduce-scatters that, summing the ranks' copies
            // (it takes them for partial gradients, as a column-parallel
            // layer's are), so twice the weights of rank r's rows; the
            // reduce-scatter's all-gathers both halves: at (b, t, c) twice
            // the weight at (b, t mod 2, c).
            let want: Vec<f32> = (0..16)
                .map(|i| 2.0 * (1 + 4 * (i / 8) + 2 * (i / 2 % 2) + i % 2) as f32)
                .collect();
            assert_eq!(dx, want, "{dt:?} rank {r}");
            assert!(
                err.contains("sequence length 3 is not divisible by the tensor-parallel size 2"),
                "{err}"
            );
        }
    }
}

/// Loss and logits gradient of one rank's shard, with the CPU kernels on
/// (`fused`) or off.
fn vocab_loss(
    fused: bool,
    dt: DType,
    vocab: usize,
    logits: &Tensor,
    targets: &Tensor,
) -> Vec<(f32, Vec<f32>)> {
    set_host_kernels(Some(fused));
    let before = kernel_runs();
    let (logits, targets) = (logits.clone(), targets.clone());
    let out = threads::run(2, move |pg| {
        let tp = Tp::new(pg, false);
        let v = logits.dim(1).unwrap() / 2;
        let mine = logits.narrow(1, tp.rank() * v, v).unwrap();
        let x = Var::from_tensor(&mine.to_dtype(dt).unwrap()).unwrap();
        let loss = vocab_parallel_cross_entropy(x.as_tensor(), &targets, &tp, vocab).unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        let grads = loss.backward().unwrap();
        (
            loss.to_scalar::<f32>().unwrap(),
            flat(grads.get(x.as_tensor()).unwrap()),
        )
    });
    set_host_kernels(None);
    // The fused op is a CPU kernel (it counts its runs); candle's ops are not.
    assert_eq!(
        kernel_runs() > before,
        fused,
        "fused {fused}: the other form ran"
    );
    out
}

#[test]
fn the_vocab_parallel_loss_in_candles_ops_matches_the_fused_op_and_one_rank() {
    // Padded vocabulary 12, 6 columns per rank; 5 rows.
    let (n, vpad) = (5, 12);
    let logits = randn(&[n, vpad], 7);
    let ids = [0u32, 3, 5, 9, 2];
    // (vocabulary, dtype, loss tolerance relative, gradient tolerance
    // relative to the largest gradient element)
    for (vocab, dt, tol, gtol) in [
        (12, DType::F32, 1e-6, 1e-5),
        // Rank 1 holds 4 real columns and 2 of padding.
        (10, DType::F32, 1e-6, 1e-5),
        // Rank 1 holds padding only.
        (6, DType::F32, 1e-6, 1e-5),
        // The reference takes the bf16-rounded logits too, so the loss
        // (f32 arithmetic) agrees as closely; the gradient comes back in
        // bf16 (half an ulp: 2^-9 relative).
        (10, DType::BF16, 1e-6, 5e-3),
    ] {
        let targets: Vec<u32> = ids.iter().map(|&t| t % vocab as u32).collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        // One rank on the real columns, the logits in the dtype under test.
        let x = Var::from_tensor(
            &logits
                .to_dtype(dt)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .narrow(1, 0, vocab)
                .unwrap(),
        )
        .unwrap();
        let want = candle_nn::loss::cross_entropy(x.as_tensor(), &targets).unwrap();
        let dwant = want.backward().unwrap();
        let dwant = dwant.get(x.as_tensor()).unwrap();
        let want = want.to_scalar::<f32>().unwrap();
        // The padding's gradient is zero.
        let dwant = Tensor::cat(
            &[
                dwant,
                &Tensor::zeros((n, vpad - vocab), DType::F32, &Device::Cpu).unwrap(),
            ],
            1,
        )
        .unwrap();
        let fused = vocab_loss(true, dt, vocab, &logits, &targets);
        let composed = vocab_loss(false, dt, vocab, &logits, &targets);
        for (what, out) in [("fused", &fused), ("candle's ops", &composed)] {
            for (r, (loss, dx)) in out.iter().enumerate() {
                let case = format!("{what}, vocab {vocab}, {dt:?}, rank {r}");
                assert!(
                    (loss - want).abs() <= tol * want.abs(),
                    "{case}: loss {loss} vs {want}"
                );
                let d = flat(&dwant.narrow(1, r * vpad / 2, vpad / 2).unwrap());
                let big = flat(&dwant).iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, (a, b)) in dx.iter().zip(&d).enumerate() {
                    assert!(
                        (a - b).abs() <= gtol * big,
                        "{case}: gradient {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
