//! Flat f32 buffers (llm.c style): one contiguous `Vec<f32>` for all
//! parameters, one for all gradients, with per-block ranges from the layout.
//!
//! The single buffer is what makes the distributed strategies simple: a DDP
//! bucket is a range of it, a ZeRO shard is a range of it, the optimizer is
//! one fused loop over a range of it. The ledger is charged for the buffer's
//! bytes for as long as it lives.
//!
//! ```
//! use phalanx::engine::{FlatBuffer, GradSink, Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[2, 2])]]).unwrap();
//! let ledger = Ledger::new();
//! let mut g = FlatBuffer::zeros(&layout, &ledger, Mem::Grads);
//! g.accumulate(&layout.params()[0], &[1.0; 4]).unwrap();
//! g.accumulate(&layout.params()[0], &[1.0; 4]).unwrap();
//! assert_eq!(g.as_slice(), &[2.0; 4]);
//! assert_eq!(ledger.current(Mem::Grads), 16);
//! ```

use std::ops::Range;

use candle_core::{bail, Result};

use super::backend::ParamSource;
use super::layout::{Layout, ParamInfo};
use crate::ledger::{Charge, Ledger, Mem};

/// Where a block's parameter gradients go during backward. The engine's own
/// flat gradient buffer is one; a ZeRO-2/3 strategy can use a per-bucket
/// buffer and reduce-scatter it.
pub trait GradSink {
    /// Add `grad` (flat, `p.numel` values) into the gradient of parameter `p`.
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> Result<()>;
}

/// A flat f32 buffer laid out by a [`Layout`], charged to a [`Ledger`].
pub struct FlatBuffer {
    data: Vec<f32>,
    blocks: Vec<Range<usize>>,
    _charge: Charge,
}

impl FlatBuffer {
    /// A zeroed buffer for all of `layout`'s parameters.
    pub fn zeros(layout: &Layout, ledger: &Ledger, kind: Mem) -> Self {
        let n = layout.num_params();
        Self {
            data: vec![0.0; n],
            blocks: layout.blocks().iter().map(|b| b.range.clone()).collect(),
            _charge: ledger.charge(kind, n * 4),
        }
    }

    /// A buffer holding `data` for all of `layout`'s parameters.
    pub fn from_vec(layout: &Layout, ledger: &Ledger, kind: Mem, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), layout.num_params(), "flat buffer size");
        let n = data.len();
        Self {
            data,
            blocks: layout.blocks().iter().map(|b| b.range.clone()).collect(),
            _charge: ledger.charge(kind, n * 4),
        }
    }

    /// An empty stand-in for a buffer a sharding strategy released.
    pub fn released(ledger: &Ledger, kind: Mem) -> Self {
        Self {
            data: Vec::new(),
            blocks: Vec::new(),
            _charge: ledger.charge(kind, 0),
        }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Block `b`'s part of the buffer.
    pub fn block(&self, b: usize) -> &[f32] {
        &self.data[self.blocks[b].clone()]
    }

    pub fn block_mut(&mut self, b: usize) -> &mut [f32] {
        &mut self.data[self.blocks[b].clone()]
    }

    pub fn fill(&mut self, v: f32) {
        self.data.fill(v);
    }
}

impl ParamSource for FlatBuffer {
    fn block_params(&self, b: usize) -> Result<&[f32]> {
        match self.blocks.get(b) {
            Some(r) => Ok(&self.data[r.clone()]),
            None => bail!("no block {b} (model has {})", self.blocks.len()),
        }
    }
}

impl GradSink for FlatBuffer {
    fn accumulate(&mut self, p: &ParamInfo, grad: &[f32]) -> Result<()> {
        if grad.len() != p.numel {
            bail!(
                "gradient of `{}` has {} values, expected {}",
                p.name,
                grad.len(),
                p.numel
            )
        }
        let dst = &mut self.data[p.range()];
        for (d, g) in dst.iter_mut().zip(grad) {
            *d += g;
        }
        Ok(())
    }
}
