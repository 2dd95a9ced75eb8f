//! Declared placements (DTensor's `Replicate` / `Shard(dim)` over the
//! tensor-parallel axis): a block says, where it declares a parameter, how
//! the whole tensor is cut over the tp ranks ([`declare`]); the engine's
//! layout carries it ([`crate::engine::ParamInfo::placement`]), and slicing a whole
//! tensor, gathering it back, the ranges every rank holds whole, the
//! checkpoint regions and the planner's per-rank sizes follow from it
//! ([`Placement::rule`], [`Placement::full_shape`],
//! [`Placement::local_shape`]).
//!
//! A block declares its own (local) shape; the placement says how it sits
//! in the whole tensor:
//!
//! ```
//! use phalanx::placement::{Placement, Rule};
//! // GPT-2's c_attn weight on rank 1 of 2, C = 4: (3C/2, C) = (6, 4), its q, k and v rows.
//! let qkv = Placement::Shard { dim: 0, groups: 3, full: None };
//! assert_eq!(qkv.full_shape(&[6, 4], 2), vec![12, 4]);
//! assert_eq!(qkv.rule(&[6, 4], 1, 2), Rule::Rows(vec![2..4, 6..8, 10..12]));
//! assert_eq!(qkv.local_shape(&[12, 4], 2), vec![6, 4]);
//! // A vocabulary of 5 padded to 6 over 2 ranks: 3 rows each, the last one padding.
//! let vocab = Placement::Shard { dim: 0, groups: 1, full: Some(5) };
//! assert_eq!(vocab.full_shape(&[3, 4], 2), vec![5, 4]);
//! assert_eq!(vocab.rule(&[3, 4], 1, 2), Rule::Rows(vec![3..6]));
//! assert_eq!(vocab.local_shape(&[5, 4], 2), vec![3, 4]);
//! assert_eq!(Placement::cols().rule(&[4, 2], 1, 2), Rule::Cols(2..4));
//! assert_eq!(Placement::Replicate.rule(&[4], 1, 2), Rule::Full);
//! ```
//!
//! Declaring: candle's `Init` hint cannot carry a placement, so [`declare`]
//! hands it to the engine's recorder beside the `vb.get_with_hints` call (on
//! the calling thread, consumed by that one request); any other backend
//! (candle's own `VarMap`, safetensors) just ignores it.
//!
//! ```
//! use candle_core::{DType, Device};
//! use candle_nn::Init;
//! use phalanx::engine::backend::Recorder;
//! use phalanx::placement::{declare, Placement};
//! let rec = Recorder::new();
//! let vb = candle_nn::VarBuilder::from_backend(Box::new(rec.clone()), DType::F32, Device::Cpu);
//! declare(&vb.pp("fc"), (2, 3), "weight", Init::Const(0.0), Placement::rows()).unwrap();
//! vb.get_with_hints(2, "fc.bias", Init::Const(0.0)).unwrap();
//! let d = rec.take();
//! assert_eq!((d[0].name.as_str(), d[0].placement), ("fc.weight", Placement::rows()));
//! assert_eq!(d[1].placement, Placement::Replicate);
//! ```

use std::cell::Cell;
use std::ops::Range;

use candle_core::{bail, Result, Shape, Tensor};
use candle_nn::{Init, VarBuilder};

/// How a parameter's whole tensor is laid over the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Every rank holds the whole tensor.
    #[default]
    Replicate,
    /// Dimension `dim` is made of `groups` equal consecutive groups (GPT-2's
    /// c_attn packs q, k and v: 3), each split evenly over the ranks: rank
    /// t holds the t-th part of every group, concatenated. `full` is the
    /// whole length of `dim` when the parts overshoot it (a vocabulary
    /// padded to a multiple of tp: the rows past `full` are zero padding).
    /// `dim` is 0 (rows) or 1 (columns, one group, no padding).
    Shard {
        dim: usize,
        groups: usize,
        full: Option<usize>,
    },
}

/// How rank t's shard is cut from the whole parameter (engine orientation).
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    Full,
    /// Rows (dim 0), possibly several ranges concatenated; rows past the
    /// full tensor's end are zero padding.
    Rows(Vec<Range<usize>>),
    /// Columns (dim 1).
    Cols(Range<usize>),
}

impl Placement {
    /// `Shard(0)`: rows split evenly (a column-parallel linear's weight and bias).
    pub const fn rows() -> Self {
        Placement::Shard {
            dim: 0,
            groups: 1,
            full: None,
        }
    }

    /// `Shard(1)`: columns split evenly (a row-parallel linear's weight).
    pub const fn cols() -> Self {
        Placement::Shard {
            dim: 1,
            groups: 1,
            full: None,
        }
    }

    /// `Shard(0)` of a vocabulary of `vocab` rows padded to a multiple of tp.
    pub const fn vocab(vocab: usize) -> Self {
        Placement::Shard {
            dim: 0,
            groups: 1,
            full: Some(vocab),
        }
    }

    /// Is it a placement this build can cut (see [`Placement::Shard`])?
    pub fn check(&self, shape: &[usize]) -> Result<()> {
        if let Placement::Shard { dim, groups, full } = *self {
            let ok = match dim {
                0 => groups >= 1 && (groups == 1 || full.is_none()),
                1 => groups == 1 && full.is_none(),
                _ => false,
            };
            if !ok || dim >= shape.len() || !shape[dim].is_multiple_of(groups) {
                bail!("placement {self:?} cannot cut a tensor of shape {shape:?}")
            }
        }
        Ok(())
    }

    /// The whole (one-rank) shape of a parameter whose shape on one of `tp`
    /// ranks is `local`.
    pub fn full_shape(&self, local: &[usize], tp: usize) -> Vec<usize> {
        let mut f = local.to_vec();
        if let (Placement::Shard { dim, full, .. }, true) = (*self, tp > 1) {
            f[dim] = full.unwrap_or(local[dim] * tp);
        }
        f
    }

    /// The shape one of `tp` ranks holds of a whole tensor of shape
    /// `whole` (the inverse of [`Placement::full_shape`]): `Shard(dim)`
    /// splits `whole[dim]` evenly over the ranks (each of its groups; the
    /// block declaring it checks that they divide), rounded up where
    /// `full` pads it (every rank holds ⌈full / tp⌉ rows, the last rank's
    /// last ones padding); `Replicate` is the whole shape.
    pub fn local_shape(&self, whole: &[usize], tp: usize) -> Vec<usize> {
        let mut l = whole.to_vec();
        if let (Placement::Shard { dim, full, .. }, true) = (*self, tp > 1) {
            l[dim] = match full {
                Some(_) => whole[dim].div_ceil(tp),
                None => whole[dim] / tp,
            };
        }
        l
    }

    /// The slice of the whole tensor rank `rank` of `tp` holds, for a
    /// parameter whose shape on one rank is `local`.
    pub fn rule(&self, local: &[usize], rank: usize, tp: usize) -> Rule {
        match *self {
            _ if tp == 1 => Rule::Full,
            Placement::Replicate => Rule::Full,
            Placement::Shard { dim: 1, .. } => {
                let n = local[1];
                Rule::Cols(rank * n..(rank + 1) * n)
            }
            Placement::Shard { groups, .. } => {
                let n = local[0] / groups; // this rank's part of one group
                let whole = n * tp; // one group's whole length
                Rule::Rows(
                    (0..groups)
                        .map(|k| k * whole + rank * n..k * whole + (rank + 1) * n)
                        .collect(),
                )
            }
        }
    }
}

thread_local! {
    /// The placement of the next parameter the recorder sees on this thread.
    static PENDING: Cell<Option<Placement>> = const { Cell::new(None) };
}

/// The placement [`declare`] set for the request being answered (taken: it
/// serves one request); [`Placement::Replicate`] if none.
pub fn take_pending() -> Placement {
    PENDING.with(|p| p.take()).unwrap_or_default()
}

/// `vb.get_with_hints(shape, name, init)`, declaring the parameter's
/// placement `p` to the engine (its recorder writes it into the layout);
/// `shape` is this rank's.
pub fn declare<S: Into<Shape>>(
    vb: &VarBuilder,
    shape: S,
    name: &str,
    init: Init,
    p: Placement,
) -> Result<Tensor> {
    let shape: Shape = shape.into();
    p.check(shape.dims())?;
    /// Clears the pending placement however the request ends (an error,
    /// or a panic caught further up), so no later request takes it.
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            PENDING.with(|c| c.take());
        }
    }
    let _clear = Clear;
    PENDING.with(|c| c.set(Some(p)));
    vb.get_with_hints(shape, name, init)
}
