//! A seeded permutation that any language can reproduce in a few lines.
//!
//! The generator is splitmix64 (Steele, Lea & Flood 2014; the seeding
//! generator of xoshiro): `state += 0x9E3779B97F4A7C15`, then the output is
//! `mix64(state)` with
//! `z = (z ^ z>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB; z ^ z>>31`
//! (all arithmetic wrapping mod 2^64).
//!
//! The permutation of `0..n` for `(seed, epoch)`:
//! 1. initial state = `mix64(seed + mix64(epoch + 0x9E3779B97F4A7C15))`, so
//!    neighbouring seeds and epochs give unrelated streams;
//! 2. `p = [0, 1, ..., n-1]`; for `i = n-1` down to `1`: `j = below(i + 1)`,
//!    swap `p[i]` and `p[j]` (Fisher-Yates);
//! 3. `below(m)`: draw `x` until `x >= (2^64 - m) % m`, return `x % m`
//!    (rejection makes it exactly uniform).
//!
//! ```
//! use phalanx::data::shuffle::{permutation, SplitMix64};
//! assert_eq!(SplitMix64::new(0).next_u64(), 0xE220A8397B1DCDAF);
//! let mut p = permutation(10, 42, 0);
//! p.sort();
//! assert_eq!(p, (0..10).collect::<Vec<u64>>());
//! ```

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 output function (a bijective 64-bit mixer).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The splitmix64 generator.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(state: u64) -> Self {
        SplitMix64 { state }
    }

    /// The stream for one epoch of one seed.
    pub fn for_epoch(seed: u64, epoch: u64) -> Self {
        Self::new(mix64(seed.wrapping_add(mix64(epoch.wrapping_add(GOLDEN)))))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// A uniform integer in `0..m` (m > 0), without modulo bias.
    pub fn below(&mut self, m: u64) -> u64 {
        assert!(m > 0, "below(0) has no values");
        let threshold = m.wrapping_neg() % m; // (2^64 - m) % m == 2^64 % m
        loop {
            let x = self.next_u64();
            if x >= threshold {
                return x % m;
            }
        }
    }
}

/// The permutation of `0..n` for `(seed, epoch)`, as described in the module docs.
pub fn permutation(n: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut rng = SplitMix64::for_epoch(seed, epoch);
    let mut p: Vec<u64> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i + 1);
        p.swap(i as usize, j as usize);
    }
    p
}
