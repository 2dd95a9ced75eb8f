//! Shard geometry shared by ZeRO-1/2/3: every rank of the shard group owns
//! one contiguous range of the flat parameter buffer (`layout.shard`), and
//! any other range (a block, a bucket) splits into per-rank pieces where it
//! overlaps those shards. A v-collective (`all_gather_v`,
//! `reduce_scatter_v`) over those piece sizes moves exactly that range, so
//! shards of any size work and no padding travels.
//!
//! ```
//! use phalanx::strategy::shard::Shards;
//! // 10 parameters over 3 ranks: ceil(10/3) = 4 each, the last one short
//! // (as if padded to 12).
//! let s = Shards::new(10, 3, 1);
//! assert_eq!(s.mine(), 4..8);
//! assert_eq!(s.ranges()[2], 8..10);
//! assert_eq!(s.counts(&(2..6)), vec![2, 2, 0]);
//! assert_eq!(s.local(&(2..6)), 0..2); // rank 1's piece of 2..6, in its shard
//! assert_eq!(s.local(&(8..10)), 0..0); // none of it
//! ```

use std::ops::Range;

#[derive(Debug, Clone)]
pub struct Shards {
    ranges: Vec<Range<usize>>,
    me: usize,
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let lo = a.start.max(b.start);
    lo..a.end.min(b.end).max(lo)
}

impl Shards {
    /// `n` parameters split over `world` ranks in shards of ceil(n/world).
    pub fn new(n: usize, world: usize, me: usize) -> Shards {
        let ranges = (0..world)
            .map(|r| crate::engine::shard_range(n, r, world))
            .collect();
        Shards { ranges, me }
    }

    /// This rank's shard of the flat buffer.
    pub fn mine(&self) -> Range<usize> {
        self.ranges[self.me].clone()
    }

    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// How many elements of `r` each rank owns.
    pub fn counts(&self, r: &Range<usize>) -> Vec<usize> {
        self.ranges.iter().map(|s| overlap(s, r).len()).collect()
    }

    /// This rank's piece of `r`, relative to the start of its shard.
    pub fn local(&self, r: &Range<usize>) -> Range<usize> {
        let m = self.mine();
        let o = overlap(&m, r);
        if o.is_empty() {
            return 0..0;
        }
        o.start - m.start..o.end - m.start
    }
}
