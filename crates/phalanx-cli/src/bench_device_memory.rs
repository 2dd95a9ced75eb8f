//! `phalanx bench collectives --check`'s last check: the all-reduce of a
//! tensor where it lies (`phalanx::collective`, what DDP's
//! device-held gradients take), on the memory the group's backend reduces
//! in place: a CUDA device's under NCCL (no staging through the host),
//! host memory under the others. Each rank fills f32 and bf16 tensors of
//! 1, 7 and 2^20 + 1 elements with the sweep's hashed values; every
//! element must be the exact sum; and an f32 average, within 1e-6 of the
//! sum divided by the group size (NCCL's `ncclAvg` multiplies by 1/n
//! first, so it may differ in the last bit). Then the all-gather in place
//! (ZeRO-1's gather of shards) with even blocks and uneven ones (the last
//! one short, one empty where the group has 3+ ranks): every block its
//! owner's values. Last the reduce-scatter in place (tensor parallelism's
//! sequence exchange) of n blocks of 1, 7 and 2^18 + 1 elements, even and
//! uneven as the all-gather's (ZeRO-3's pieces of a block): this rank's
//! block the exact sum.

use crate::bench_collectives::fill_value;
use candle_core::{DType, Device, DeviceLocation, Tensor};
use phalanx::collective::{
    all_gather_in_place, all_reduce_in_place, reduce_scatter_in_place, reduce_scatter_v_in_place,
};
use phalanx_comm::{ProcessGroup, ReduceOp};

/// Where the check ran and how many elements were wrong (`None`: not
/// run, for a backend of device memory in a build without CUDA tensors:
/// `--features nccl` alone); an error where it failed to run.
pub fn check(pg: &ProcessGroup) -> Result<Option<(String, usize)>, String> {
    let dev = match pg.device_ordinal() {
        None => Device::Cpu,
        Some(_) if phalanx::device::cuda_built().is_err() => return Ok(None),
        Some(_) => phalanx::device::open_cuda()?,
    };
    let (me, n) = (pg.rank(), pg.size());
    let mut wrong = 0;
    for count in [1usize, 7, (1 << 20) + 1] {
        let mine: Vec<f32> = (0..count).map(|i| fill_value(me, i, 0) as f32).collect();
        // Every rank's values added up, element by element (exact in f32).
        let sums: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|r| fill_value(r, i, 0)).sum::<i64>() as f32)
            .collect();
        for dt in [DType::F32, DType::BF16] {
            let t = Tensor::from_vec(mine.clone(), count, &dev)
                .and_then(|t| t.to_dtype(dt))
                .map_err(|e| e.to_string())?;
            all_reduce_in_place(pg, &t, ReduceOp::Sum).map_err(|e| e.to_string())?;
            let got = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| e.to_string())?;
            wrong += got.iter().zip(&sums).filter(|(g, s)| g != s).count();
        }
        let t = Tensor::from_vec(mine, count, &dev).map_err(|e| e.to_string())?;
        all_reduce_in_place(pg, &t, ReduceOp::Avg).map_err(|e| e.to_string())?;
        let got = t.to_vec1::<f32>().map_err(|e| e.to_string())?;
        wrong += got
            .iter()
            .zip(&sums)
            .filter(|&(&g, &s)| {
                let want = s / n as f32;
                (g - want).abs() > 1e-6 * want.abs().max(1.0)
            })
            .count();
    }
    for each in [1usize, 7, (1 << 18) + 1] {
        for counts in block_counts(each, n) {
            let total: usize = counts.iter().sum();
            let at: usize = counts[..me].iter().sum();
            // Everyone's block -1 but this rank's own.
            let mut v = vec![-1.0f32; total];
            for (i, x) in v[at..at + counts[me]].iter_mut().enumerate() {
                *x = fill_value(me, i, 1) as f32;
            }
            let t = Tensor::from_vec(v, total, &dev).map_err(|e| e.to_string())?;
            all_gather_in_place(pg, &t, &counts).map_err(|e| e.to_string())?;
            let got = t.to_vec1::<f32>().map_err(|e| e.to_string())?;
            let want = counts
                .iter()
                .enumerate()
                .flat_map(|(k, &c)| (0..c).map(move |i| fill_value(k, i, 1) as f32));
            wrong += got.iter().zip(want).filter(|(g, w)| *g != w).count();
        }
    }
    for k in [1usize, 7, (1 << 18) + 1] {
        // The reduce-scatter in place (tensor parallelism's sequence
        // exchange): this rank's block of the n blocks, summed. Then
        // uneven blocks (ZeRO-3's pieces of a model block), as the
        // all-gather's above.
        for counts in block_counts(k, n) {
            let uneven = counts.windows(2).any(|w| w[0] != w[1]);
            let total: usize = counts.iter().sum();
            let at: usize = counts[..me].iter().sum();
            let v: Vec<f32> = (0..total).map(|i| fill_value(me, i, 2) as f32).collect();
            let t = Tensor::from_vec(v, total, &dev).map_err(|e| e.to_string())?;
            let r = match uneven {
                false => reduce_scatter_in_place(pg, &t, ReduceOp::Sum),
                true => reduce_scatter_v_in_place(pg, &t, &counts, ReduceOp::Sum),
            };
            r.map_err(|e| e.to_string())?;
            if counts[me] == 0 {
                continue;
            }
            let got = t
                .narrow(0, at, counts[me])
                .and_then(|b| b.to_vec1::<f32>())
                .map_err(|e| e.to_string())?;
            let want = (at..at + counts[me])
                .map(|i| (0..n).map(|r| fill_value(r, i, 2)).sum::<i64>() as f32);
            wrong += got.iter().zip(want).filter(|(g, w)| **g != *w).count();
        }
    }
    let mut w = [wrong as i64];
    pg.all_reduce(&mut w, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let place = match dev.location() {
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        _ => "cpu".to_string(),
    };
    Ok(Some((place, w[0] as usize)))
}

/// The per-rank counts the in-place gather and reduce-scatter are checked
/// with: `n` blocks of `each`, then (with 2+ ranks) uneven ones, the last
/// short and, with 3+, one empty. One rank has no uneven blocks (and a
/// block of 0 elements would be a 0-byte device allocation, which CUDA
/// refuses).
fn block_counts(each: usize, n: usize) -> Vec<Vec<usize>> {
    let mut out = vec![vec![each; n]];
    if n > 1 {
        let mut counts = vec![each; n];
        counts[n - 1] = each / 2;
        if n >= 3 {
            counts[1] = 0;
        }
        out.push(counts);
    }
    out
}
