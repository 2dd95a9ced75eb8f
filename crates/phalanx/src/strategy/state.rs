//! Training state for checkpoints, as the strategies hold it: each rank
//! copies out the flat ranges it writes ([`StateRange`]: parameters and the
//! optimizer buffers of that range) and fills the ranges it owns from any
//! saved layout through a callback, so the checkpoint format never needs to
//! know how a strategy shards.

use crate::error::{Error, Result};
use crate::optim::Optimizer;
use std::ops::Range;

/// A flat range of this rank's training state, copied out (a staging copy:
/// training may go on while it is written).
#[derive(Debug, Clone, PartialEq)]
pub struct StateRange {
    pub range: Range<usize>,
    pub params: Vec<f32>,
    /// Optimizer buffers by name, `range.len()` values each.
    pub optim: Vec<(&'static str, Vec<f32>)>,
    pub optim_kind: &'static str,
    pub optim_step: u64,
    /// `Some(g)`: the state of group `g` of several that hold different
    /// values for the same range (DiLoCo's groups between outer steps),
    /// saved under [`group_kind`]s (`group{g}/param`, `group{g}/exp_avg`,
    /// …) beside the state every group shares; `None`: the range's state.
    pub group: Option<usize>,
}

/// The checkpoint kind of `kind` (`"param"` or an optimizer buffer) as
/// group `g` saves its own ([`StateRange::group`]).
pub fn group_kind(g: usize, kind: &str) -> String {
    format!("group{g}/{kind}")
}

/// The inverse of [`group_kind`]: `(Some(g), kind)` for `group{g}/kind`,
/// `(None, kind)` for a kind no group owns.
///
/// ```
/// use phalanx::strategy::state::{group_kind, split_group_kind};
/// assert_eq!(split_group_kind(&group_kind(3, "exp_avg")), (Some(3), "exp_avg"));
/// assert_eq!(split_group_kind("param"), (None, "param"));
/// assert_eq!(split_group_kind("groupx/param"), (None, "groupx/param"));
/// ```
pub fn split_group_kind(kind: &str) -> (Option<usize>, &str) {
    match kind.strip_prefix("group").and_then(|r| r.split_once('/')) {
        Some((g, n)) => match g.parse::<usize>() {
            Ok(g) => (Some(g), n),
            Err(_) => (None, kind),
        },
        None => (None, kind),
    }
}

/// Gives the values of a flat range for `"param"` or an optimizer buffer
/// name; `None` when the checkpoint holds no such state (e.g. weights only).
pub type StateFill<'a> = dyn FnMut(Range<usize>, &str) -> Result<Option<Vec<f32>>> + 'a;

impl StateRange {
    /// The part of this range inside `sub`.
    pub fn slice(&self, sub: &Range<usize>) -> StateRange {
        let lo = sub.start.max(self.range.start);
        let hi = sub.end.min(self.range.end).max(lo);
        let local = lo - self.range.start..hi - self.range.start;
        StateRange {
            range: lo..hi,
            params: self.params[local.clone()].to_vec(),
            optim: self
                .optim
                .iter()
                .map(|(n, v)| (*n, v[local.clone()].to_vec()))
                .collect(),
            optim_kind: self.optim_kind,
            optim_step: self.optim_step,
            group: self.group,
        }
    }

    /// The parts of this range inside `keep` (sorted, disjoint ranges).
    pub fn keep_only(&self, keep: &[Range<usize>]) -> Vec<StateRange> {
        keep.iter()
            .filter(|k| k.start < self.range.end && self.range.start < k.end)
            .map(|k| self.slice(k))
            .collect()
    }

    /// The parts of this range outside `drop` (sorted, disjoint ranges).
    pub fn without(&self, drop: &[Range<usize>]) -> Vec<StateRange> {
        let mut keep = Vec::new();
        let mut at = self.range.start;
        let mut sorted: Vec<&Range<usize>> = drop.iter().collect();
        sorted.sort_by_key(|r| r.start);
        for d in sorted {
            if d.start > at {
                keep.push(at..d.start.min(self.range.end));
            }
            at = at.max(d.end);
        }
        if at < self.range.end {
            keep.push(at..self.range.end);
        }
        keep.retain(|r| !r.is_empty());
        self.keep_only(&keep)
    }
}

/// Copy out an optimizer's range: its parameters (`params`, exactly
/// `opt.range()`) and state.
pub fn snapshot(opt: &(dyn Optimizer + Send), params: &[f32]) -> Result<StateRange> {
    let (optim, optim_step) = opt
        .state()
        .map_err(|e| Error::Io(format!("optimizer state: {e}")))?;
    Ok(StateRange {
        range: opt.range(),
        params: params.to_vec(),
        optim,
        optim_kind: opt.kind(),
        optim_step,
        group: None,
    })
}

/// Fill an optimizer's state from a checkpoint: every buffer it has (left
/// as it is when the checkpoint holds none, said in a warning: a DiLoCo
/// checkpoint keeps its groups' state under their own names, which a run
/// without DiLoCo, or a group it did not have, does not find) and its step
/// count.
pub fn restore_optimizer(
    opt: &mut (dyn Optimizer + Send),
    fill: &mut StateFill,
    step: u64,
) -> Result<()> {
    let names = opt.state_names();
    let mut any = false;
    for &name in &names {
        if let Some(v) = fill(opt.range(), name)? {
            opt.load_state(name, &v)
                .map_err(|e| Error::Io(format!("optimizer state: {e}")))?;
            any = true;
        }
    }
    if any {
        opt.set_step_count(step);
    } else if step > 0 && !names.is_empty() {
        // Once per process: every rank (and pipeline chunk) is in the same
        // case.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "warning: the checkpoint holds no {} {} for this run's optimizer (saved without \
                 it, e.g. by SGD without momentum, or under other names, e.g. DiLoCo's \
                 per-group state): the optimizer starts fresh",
                opt.kind(),
                names.join(" / ")
            );
        });
    }
    Ok(())
}

/// The parameters of a flat range from a checkpoint (which must hold them).
pub fn fill_params(fill: &mut StateFill, range: Range<usize>) -> Result<Vec<f32>> {
    fill(range.clone(), "param")?.ok_or_else(|| {
        Error::Check(format!(
            "the checkpoint holds no parameters for flat range {range:?}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slicing_keeps_params_and_state_aligned() {
        let s = StateRange {
            range: 10..20,
            params: (10..20).map(|x| x as f32).collect(),
            optim: vec![("exp_avg", (110..120).map(|x| x as f32).collect())],
            optim_kind: "adamw",
            optim_step: 3,
            group: None,
        };
        let parts = s.without(&[12..14, 18..30]);
        let ranges: Vec<_> = parts.iter().map(|p| p.range.clone()).collect();
        assert_eq!(ranges, vec![10..12, 14..18]);
        assert_eq!(parts[1].params, vec![14., 15., 16., 17.]);
        assert_eq!(parts[1].optim[0].1, vec![114., 115., 116., 117.]);
    }
}
