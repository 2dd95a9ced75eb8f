//! Mixing sources by weight, as a pure function of `(seed, g)`.
//!
//! The weights become cumulative fractions `F_s = (w_0 + … + w_s) / W`,
//! fixed to 2^-32 (so every machine computes the same integers). Of the
//! first `N` global indices, sources `0..=s` get `floor(N * F_s)`, so source
//! `s` gets `C_s(N) = floor(N F_s) - floor(N F_{s-1})`: within one sample of
//! `N w_s / W` for every `N`, which is "the weights exactly in expectation"
//! and better (no drift). Global indices are cut into blocks of
//! [`BLOCK`]; block `b` holds `C_s((b+1)B) - C_s(bB)` samples of source `s`
//! (so the counts are exact at every block boundary, and within a block
//! deviate from the weights only by the shuffle),
//! in an order shuffled by `(seed, b)`. So the source of global index `g`,
//! and its index `k` within that source (`C_s(bB)` plus the source's earlier
//! slots in the block), need only block `g / B`: any rank, any layout, any
//! resume point computes the same `(s, k)`.
//!
//! ```
//! use phalanx::data::mix::Mixer;
//! let m = Mixer::new(&[3.0, 1.0], 7).unwrap();
//! let counts = m.counts_before(4096);
//! assert_eq!(counts, vec![3072, 1024]);
//! let (s, k) = m.locate(10);
//! assert!(s < 2 && k < 11);
//! ```

use super::error::{DataError, Result};
use super::shuffle::{mix64, SplitMix64};
use std::sync::{Arc, Mutex};

/// A block's slots: (source, index within the source).
type Block = Arc<Vec<(u32, u64)>>;

/// Global indices per mixing block.
pub const BLOCK: u64 = 4096;
const ONE: u128 = 1 << 32;

/// The mixer of a list of weighted sources.
#[derive(Debug)]
pub struct Mixer {
    /// Cumulative fractions in 2^-32 units; the last is exactly 2^32.
    cum: Vec<u128>,
    seed: u64,
    /// The last block built: (block, source per slot, index within source).
    cache: Mutex<Option<(u64, Block)>>,
}

/// The weights as they are summed: as given, or, where their sum would
/// overflow (weights near f64's largest), relative to the largest. (As
/// given otherwise, so that a mix is the same as before to the bit.)
pub fn shares(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    let top = weights.iter().cloned().fold(0.0, f64::max);
    if sum.is_finite() || top <= 0.0 {
        weights.to_vec()
    } else {
        weights.iter().map(|w| w / top).collect()
    }
}

/// The cumulative fractions of (finite, positive) `weights` in 2^-32
/// units, the last exactly 2^32: source `i` gets `cum[i] - cum[i - 1]`
/// of them (`cum[0]` the first), 0 for a weight too small beside the
/// others (see [`never_read`]).
pub fn cum(weights: &[f64]) -> Vec<u128> {
    let shares = shares(weights);
    let total: f64 = shares.iter().sum();
    let mut acc = 0.0;
    let mut cum = Vec::with_capacity(weights.len());
    for (i, w) in shares.iter().enumerate() {
        acc += w;
        let f = if i + 1 == weights.len() {
            ONE
        } else {
            ((acc / total) * ONE as f64).round() as u128
        };
        cum.push(f.min(ONE));
    }
    cum
}

/// The first source the mixer would never read (no unit of [`cum`]).
pub fn never_read(weights: &[f64]) -> Option<usize> {
    let c = cum(weights);
    (0..c.len()).find(|&i| c[i] == if i == 0 { 0 } else { c[i - 1] })
}

impl Mixer {
    /// `weights` must be finite and positive (a zero weight would be a
    /// source never read: drop it instead).
    pub fn new(weights: &[f64], seed: u64) -> Result<Mixer> {
        if weights.is_empty() {
            return Err(DataError::Config("no data sources".into()));
        }
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            return Err(DataError::Config(format!(
                "data.sources[{i}].weight = {w}: weights must be finite and > 0"
            )));
        }
        Ok(Mixer {
            cum: cum(weights),
            seed: mix64(seed ^ 0x6d69_7865_7200_0000),
            cache: Mutex::new(None),
        })
    }

    pub fn sources(&self) -> usize {
        self.cum.len()
    }

    /// `floor(n * F_s)`: samples of sources `0..=s` among the first `n`.
    fn upto(&self, s: usize, n: u64) -> u64 {
        ((n as u128 * self.cum[s]) / ONE) as u64
    }

    /// `C_s(n)`: samples of source `s` among global indices `0..n`.
    pub fn count_before(&self, s: usize, n: u64) -> u64 {
        let lo = if s == 0 { 0 } else { self.upto(s - 1, n) };
        self.upto(s, n) - lo
    }

    /// `C_s(n)` for every source.
    pub fn counts_before(&self, n: u64) -> Vec<u64> {
        (0..self.sources())
            .map(|s| self.count_before(s, n))
            .collect()
    }

    /// Samples of each source among global indices `0..g` (any `g`: the
    /// block's shuffled slots before `g` are counted).
    pub fn consumed(&self, g: u64) -> Vec<u64> {
        let b = g / BLOCK;
        let mut c = self.counts_before(b * BLOCK);
        if self.sources() == 1 {
            return vec![g];
        }
        for &(s, _) in &self.block(b)[..(g % BLOCK) as usize] {
            c[s as usize] += 1;
        }
        c
    }

    /// Source and index within it of global index `g`.
    pub fn locate(&self, g: u64) -> (usize, u64) {
        if self.sources() == 1 {
            return (0, g);
        }
        let b = g / BLOCK;
        let block = self.block(b);
        let (s, k) = block[(g % BLOCK) as usize];
        (s as usize, k)
    }

    fn block(&self, b: u64) -> Arc<Vec<(u32, u64)>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((cb, v)) = cache.as_ref() {
            if *cb == b {
                return v.clone();
            }
        }
        let (lo, hi) = (b * BLOCK, (b + 1) * BLOCK);
        let mut slots: Vec<u32> = Vec::with_capacity(BLOCK as usize);
        for s in 0..self.sources() {
            let c = self.count_before(s, hi) - self.count_before(s, lo);
            slots.extend(std::iter::repeat_n(s as u32, c as usize));
        }
        debug_assert_eq!(slots.len() as u64, BLOCK);
        let mut rng = SplitMix64::for_epoch(self.seed, b);
        for i in (1..slots.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            slots.swap(i, j);
        }
        let mut next: Vec<u64> = (0..self.sources())
            .map(|s| self.count_before(s, lo))
            .collect();
        let v: Vec<(u32, u64)> = slots
            .into_iter()
            .map(|s| {
                let k = next[s as usize];
                next[s as usize] += 1;
                (s, k)
            })
            .collect();
        let v = Arc::new(v);
        *cache = Some((b, v.clone()));
        v
    }
}
