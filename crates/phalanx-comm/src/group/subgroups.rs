//! Sub-groups: `new_group` (a list of ranks) and `split` (MPI_Comm_split's
//! colors and keys). On the native transport a sub-group shares its
//! parent's transport under its own channels; on MPI it is a communicator
//! split.

use super::{digest, ProcessGroup};
use crate::error::{invalid, Result};
use std::sync::atomic::Ordering;

impl ProcessGroup {
    /// A group of the given ranks of this group (in ascending order). Every
    /// rank of this group must call it: it counts as a collective of this
    /// group, in order with its other collectives (as on MPI, where it is
    /// an `MPI_Comm_split`); ranks outside `ranks` get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut rs = ranks.to_vec();
        rs.sort_unstable();
        rs.dedup();
        if rs.len() != ranks.len() || rs.iter().any(|&r| r >= self.size()) || rs.is_empty() {
            return Err(invalid!(
                "new_group: ranks {ranks:?} must be distinct ranks below {}",
                self.size()
            ));
        }
        let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
        let gid = digest(&[self.inner.gid as usize, k as usize, 0x5b]) | 2;
        // Members of one requested group share a color; the rest of this
        // group joins none.
        let mine = rs.iter().position(|&r| r == self.rank());
        let color = mine.map(|_| digest(&rs) as u32);
        self.child(&rs, color, mine.unwrap_or(0) as i64, gid)
    }

    /// Split into disjoint groups by `color` (MPI_Comm_split): ranks with the
    /// same color form a group, ordered by (key, rank), keys clamped to 32
    /// bits as MPI clamps them. A negative color joins no group. Collective
    /// over this group.
    pub fn split(&self, color: i64, key: i64) -> Result<Option<ProcessGroup>> {
        let n = self.size();
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&[color, key], &mut all)?;
        let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
        let mut ranks: Vec<usize> = (0..n).filter(|&r| all[2 * r] == color).collect();
        // Keys are clamped to 32 bits as MPI_Comm_split clamps them, so the
        // ranks' order is the same on every backend.
        ranks.sort_by_key(|&r| (all[2 * r + 1].clamp(i32::MIN as i64, i32::MAX as i64), r));
        let gid = digest(&[self.inner.gid as usize, k as usize, color as usize]) | 2;
        let c = (color >= 0).then_some((color as u64 & 0x3fff_ffff) as u32);
        self.child(&ranks, c, key, gid)
    }

    /// The sub-group of `ranks` (this group's ranks, in the child's rank
    /// order) if this rank has a `color`; its carrier from the backend
    /// (collective over this group).
    fn child(
        &self,
        ranks: &[usize],
        color: Option<u32>,
        key: i64,
        gid: u64,
    ) -> Result<Option<ProcessGroup>> {
        self.inner.queue.drain();
        let _g = self.inner.lock_exec();
        let seq = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        let c = self.call("new_group", seq);
        let sub = self.inner.backend.child(&c, color, key, ranks.len())?;
        let (Some(sub), Some(_)) = (sub, color) else {
            return Ok(None);
        };
        let me = ranks
            .iter()
            .position(|&r| r == self.rank())
            .ok_or_else(|| invalid!("a sub-group's backend included a rank that asked for none"))?;
        let members = ranks.iter().map(|&r| self.inner.members[r]).collect();
        Ok(Some(ProcessGroup::make(
            sub,
            members,
            me,
            gid,
            self.inner.cfg.clone(),
            None,
        )))
    }
}
