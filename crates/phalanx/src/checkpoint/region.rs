//! Where a saved piece sits in its global tensor, and how to copy between
//! pieces of different layouts (the resharding core).
//!
//! A rank holds a *box* of each global tensor (the whole tensor, or a
//! tensor-parallel slice: rows or columns) laid out row-major, and of that
//! box a contiguous *flat range* (a ZeRO shard may cut a tensor anywhere).
//! Such a region is a list of runs of contiguous global flat positions; two
//! regions of the same tensor intersect run by run, whatever layouts saved
//! and load them.
//!
//! ```
//! use phalanx::checkpoint::region::Region;
//! // A 4x6 tensor; this rank holds columns 2..5 (a column slice), and of
//! // that 4x3 box the flat range 2..7.
//! let r = Region { shape: vec![4, 6], offsets: vec![0, 2], sizes: vec![4, 3], flat: 2..7 };
//! // Box elements 2 | 3 4 5 | 6 are global (0,4) | (1,2) (1,3) (1,4) | (2,2).
//! assert_eq!(r.runs(), vec![(4, 0, 1), (8, 1, 3), (14, 4, 1)]);
//! ```

use std::ops::Range;

/// A region of a global tensor: the box `offsets .. offsets + sizes` (per
/// dimension) of a tensor of `shape`, and the flat range `flat` of that box.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Region {
    pub shape: Vec<usize>,
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
    pub flat: Range<usize>,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Region {
        let n = shape.iter().product();
        Region {
            shape: shape.to_vec(),
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
            flat: 0..n,
        }
    }

    pub fn len(&self) -> usize {
        self.flat.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flat.is_empty()
    }

    /// Check that the box lies in the tensor and the range in the box.
    pub fn check(&self) -> Result<(), String> {
        let ok_dims =
            self.shape.len() == self.offsets.len() && self.shape.len() == self.sizes.len();
        let in_tensor = ok_dims
            && self
                .shape
                .iter()
                .zip(&self.offsets)
                .zip(&self.sizes)
                .all(|((&n, &o), &s)| o.checked_add(s).is_some_and(|e| e <= n));
        let box_len = crate::ledger::checked_numel(&self.sizes);
        if !in_tensor
            || self.flat.start > self.flat.end
            || box_len.is_none_or(|b| self.flat.end > b)
        {
            return Err(format!("region {self:?} is not inside its tensor"));
        }
        Ok(())
    }

    /// The region as runs `(global flat start, position in the region, len)`
    /// of contiguous global positions, in increasing global order.
    pub fn runs(&self) -> Vec<(usize, usize, usize)> {
        let nd = self.shape.len();
        if self.flat.is_empty() {
            return Vec::new();
        }
        if nd == 0 {
            return vec![(0, 0, 1)];
        }
        let row = self.sizes[nd - 1];
        // Global strides of the tensor.
        let mut stride = vec![1usize; nd];
        for d in (0..nd - 1).rev() {
            stride[d] = stride[d + 1] * self.shape[d + 1];
        }
        let mut out = Vec::new();
        let mut at = self.flat.start;
        while at < self.flat.end {
            // Box coordinates of `at`.
            let (r, c) = (at / row, at % row);
            let len = (row - c).min(self.flat.end - at);
            let mut rem = r;
            let mut g = self.offsets[nd - 1] + c;
            for d in (0..nd - 1).rev() {
                let i = rem % self.sizes[d];
                rem /= self.sizes[d];
                g += (self.offsets[d] + i) * stride[d];
            }
            match out.last_mut() {
                // Contiguous with the previous run (whole rows of a row slice).
                Some((gs, _, l)) if *gs + *l == g => *l += len,
                _ => out.push((g, at - self.flat.start, len)),
            }
            at += len;
        }
        out
    }
}

/// Copy from `src` (values of region `from`) into `dst` (values of region
/// `to`) wherever the two regions overlap; returns how many values were
/// copied. Both must be regions of the same tensor.
pub fn copy_overlap(
    from: &[(usize, usize, usize)],
    src: &[f32],
    to: &[(usize, usize, usize)],
    dst: &mut [f32],
) -> usize {
    let (mut i, mut j, mut copied) = (0, 0, 0);
    while i < from.len() && j < to.len() {
        let (fg, fl, fn_) = from[i];
        let (tg, tl, tn) = to[j];
        let lo = fg.max(tg);
        let hi = (fg + fn_).min(tg + tn);
        if lo < hi {
            let n = hi - lo;
            dst[tl + (lo - tg)..tl + (lo - tg) + n]
                .copy_from_slice(&src[fl + (lo - fg)..fl + (lo - fg) + n]);
            copied += n;
        }
        if fg + fn_ <= tg + tn {
            i += 1;
        } else {
            j += 1;
        }
    }
    copied
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout of a 5x7 tensor (rows, columns, shards of both) copies
    /// into every other exactly where they overlap.
    #[test]
    fn any_layout_to_any_other() {
        let shape = vec![5usize, 7];
        let global: Vec<f32> = (0..35).map(|x| x as f32).collect();
        let regions = vec![
            Region::whole(&shape),
            Region {
                shape: shape.clone(),
                offsets: vec![0, 3],
                sizes: vec![5, 4],
                flat: 0..20,
            },
            Region {
                shape: shape.clone(),
                offsets: vec![2, 0],
                sizes: vec![3, 7],
                flat: 4..19,
            },
            Region {
                shape: shape.clone(),
                offsets: vec![0, 0],
                sizes: vec![5, 3],
                flat: 7..8,
            },
            Region {
                shape: shape.clone(),
                offsets: vec![0, 0],
                sizes: vec![5, 7],
                flat: 11..30,
            },
        ];
        let values = |r: &Region| -> Vec<f32> {
            r.runs()
                .iter()
                .flat_map(|&(g, _, n)| global[g..g + n].to_vec())
                .collect()
        };
        for a in &regions {
            a.check().unwrap();
            let va = values(a);
            assert_eq!(va.len(), a.len());
            for b in &regions {
                let mut vb = vec![-1f32; b.len()];
                let n = copy_overlap(&a.runs(), &va, &b.runs(), &mut vb);
                let want = values(b);
                let mut hits = 0;
                for (x, w) in vb.iter().zip(&want) {
                    assert!(*x == -1.0 || x == w, "{a:?} -> {b:?}");
                    hits += (*x != -1.0) as usize;
                }
                assert_eq!(hits, n);
            }
        }
    }

    #[test]
    fn bad_regions_are_refused() {
        let r = Region {
            shape: vec![4],
            offsets: vec![2],
            sizes: vec![3],
            flat: 0..3,
        };
        assert!(r.check().is_err());
        let r = Region {
            shape: vec![4],
            offsets: vec![0],
            sizes: vec![4],
            flat: 0..5,
        };
        assert!(r.check().is_err());
    }
}
