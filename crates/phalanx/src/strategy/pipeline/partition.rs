//! Splitting the model's blocks into contiguous pipeline chunks.
//!
//! - `Balanced`: minimise the largest chunk's parameter count, counting for
//!   each block the parameters it *reads* (its own and tied ones, e.g. the
//!   GPT-2 head reads the embedding matrix), a proxy for its compute.
//! - `Sizes`: blocks per chunk, by hand (`[3, 2, 2, 3]`).
//! - `Costs`: one cost per block, e.g. measured with [`measure_block_costs`];
//!   balanced like `Balanced`. Measured costs differ between ranks, so the
//!   pipeline takes the split of world rank 0 (see `Pipeline::new`).
//!
//! The balanced split is the classic linear-partition dynamic programme:
//! exact (min over contiguous splits of the max chunk cost), O(k n^2).
//!
//! ```
//! use phalanx::strategy::pipeline::partition::balanced;
//! assert_eq!(balanced(&[1.0, 1.0, 1.0, 3.0], 2).unwrap(), vec![0..3, 3..4]);
//! assert_eq!(balanced(&[2.0, 1.0, 1.0, 2.0], 3).unwrap(), vec![0..1, 1..3, 3..4]);
//! ```

use std::ops::Range;
use std::time::Instant;

use candle_core::Tensor;

use crate::engine::{Engine, Layout};
use crate::error::{Error, Result};

/// How blocks are assigned to chunks.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Partition {
    /// Balance the parameters each chunk reads.
    #[default]
    Balanced,
    /// Number of blocks of each chunk, in order (sums to the block count).
    Sizes(Vec<usize>),
    /// Balance these per-block costs.
    Costs(Vec<f64>),
}

impl Partition {
    /// The block range of each of `chunks` chunks.
    pub fn split(&self, layout: &Layout, chunks: usize) -> Result<Vec<Range<usize>>> {
        let n = layout.num_blocks();
        match self {
            Partition::Balanced => balanced(&param_costs(layout), chunks),
            Partition::Costs(c) if c.len() != n => Err(Error::Check(format!(
                "pipeline partition: {} block costs for {n} blocks",
                c.len()
            ))),
            Partition::Costs(c) => balanced(c, chunks),
            Partition::Sizes(s) => {
                check_sizes(s, chunks, n)?;
                let mut lo = 0;
                Ok(s.iter()
                    .map(|k| {
                        lo += k;
                        lo - k..lo
                    })
                    .collect())
            }
        }
    }
}

/// Whether `n` blocks can be split into `chunks` chunks as `p` says, before
/// any layout exists (the launcher checks it before starting a rank).
pub fn check_split(n: usize, chunks: usize, p: &Partition) -> Result<()> {
    match p {
        Partition::Sizes(s) => check_sizes(s, chunks, n),
        _ => check_count(n, chunks),
    }
}

fn check_sizes(s: &[usize], chunks: usize, n: usize) -> Result<()> {
    // (Summed without wrapping: a size near usize::MAX must not add up
    // to `n` and pass.)
    let sum = s.iter().try_fold(0usize, |a, &k| a.checked_add(k));
    if s.len() != chunks || s.contains(&0) || sum != Some(n) {
        return Err(Error::Check(format!(
            "pipeline partition {s:?}: need {chunks} non-zero sizes summing to the model's {n} \
             blocks (a block is a pipeline unit: for GPT-2 the embedding, each of the n_layer \
             transformer layers, and the head)"
        )));
    }
    Ok(())
}

fn check_count(n: usize, k: usize) -> Result<()> {
    if k == 0 || k > n {
        return Err(Error::Check(format!(
            "cannot split {n} blocks into {k} pipeline chunks (each needs at least one block; \
             a block is a pipeline unit: for GPT-2 the embedding, each of the n_layer layers, \
             and the head, so n_layer + 2 blocks)"
        )));
    }
    Ok(())
}

/// Per block: the number of parameters it reads (owned + tied).
pub fn param_costs(layout: &Layout) -> Vec<f64> {
    (0..layout.num_blocks())
        .map(|b| {
            layout
                .block_param_indices(b)
                .map(|k| layout.params()[k].numel as f64)
                .sum()
        })
        .collect()
}

/// Contiguous split of `costs` into `k` non-empty chunks minimising the
/// largest chunk sum (the first optimal split found, deterministic).
pub fn balanced(costs: &[f64], k: usize) -> Result<Vec<Range<usize>>> {
    let n = costs.len();
    check_count(n, k)?;
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c.max(0.0);
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[j][i]: min max-cost of the first i blocks in j chunks; cut[j][i]
    // the start of the j-th chunk in that split.
    let mut best = vec![vec![f64::INFINITY; n + 1]; k + 1];
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    best[0][0] = 0.0;
    for j in 1..=k {
        for i in j..=n {
            for s in (j - 1)..i {
                let c = best[j - 1][s].max(sum(s, i));
                // Strictly better only: ties keep the earliest cut.
                if c < best[j][i] - 1e-9 * c.abs().max(1.0) {
                    best[j][i] = c;
                    cut[j][i] = s;
                }
            }
        }
    }
    let mut out = vec![0..0; k];
    let mut i = n;
    for j in (1..=k).rev() {
        let s = cut[j][i];
        out[j - 1] = s..i;
        i = s;
    }
    Ok(out)
}

/// Time each block's forward and backward on one micro-batch (`reps`
/// repetitions after one warm-up), for `Partition::Costs`. Leaves the
/// gradient buffer zeroed.
pub fn measure_block_costs(
    engine: &mut Engine,
    inputs: &Tensor,
    targets: &Tensor,
    reps: usize,
) -> Result<Vec<f64>> {
    let n = engine.num_blocks();
    let mut costs = vec![0.0; n];
    for rep in 0..=reps {
        let mut x = inputs.clone();
        let mut stashes = Vec::with_capacity(n);
        for (b, cost) in costs.iter_mut().enumerate() {
            let t = Instant::now();
            let tg = (b + 1 == n).then_some(targets);
            let (y, st) = engine.forward_range(b..b + 1, &x, tg)?;
            if rep > 0 {
                *cost += t.elapsed().as_secs_f64();
            }
            stashes.push(st);
            x = y;
        }
        let mut gy = Tensor::new(1f32, engine.device())?;
        for (b, st) in stashes.into_iter().enumerate().rev() {
            let t = Instant::now();
            let dx = engine.backward_range(st, &gy, &mut |_, _| Ok(()))?;
            if rep > 0 {
                costs[b] += t.elapsed().as_secs_f64();
            }
            match dx {
                Some(g) => gy = g,
                None => break,
            }
        }
    }
    engine.zero_grad();
    Ok(costs)
}
