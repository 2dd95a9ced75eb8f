//! Sub-groups: `new_group` (a list of ranks) and `split` (MPI_Comm_split's
//! colors and keys). On the native transport a sub-group shares its
//! parent's transport under its own channels; on MPI it is a communicator
//! split.

use super::{digest, Net, ProcessGroup};
use crate::error::{invalid, Result};
use std::sync::atomic::Ordering;

impl ProcessGroup {
    /// A group of the given ranks of this group (in ascending order). Every
    /// rank of this group must call it, in the same order as other
    /// `new_group` calls; ranks outside `ranks` get `None`.
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
        on_mpi!(self, m => {
            // Members of one requested group share a color; the rest of
            // this group joins none.
            let mine = rs.iter().position(|&r| r == self.rank());
            let color = mine.map(|_| digest(&rs) as u32);
            self.mpi_child(m, color, mine.unwrap_or(0) as i64, gid, rs.len())
        });
        Ok(self.child(&rs, gid))
    }

    /// A sub-group by `MPI_Comm_split`, checked to have `want` members (two
    /// requested groups whose colors collide would merge).
    #[cfg(feature = "mpi")]
    fn mpi_child(
        &self,
        m: &crate::mpi::Comm,
        color: Option<u32>,
        key: i64,
        gid: u64,
        want: usize,
    ) -> Result<Option<ProcessGroup>> {
        self.inner.queue.drain();
        let sub = self.serial(|| m.split(color, key))?;
        let Some(sub) = sub else { return Ok(None) };
        if sub.size() != want {
            return Err(invalid!(
                "MPI_Comm_split gave a group of {} ranks where {want} were asked for \
                 (two groups' colors collided); create the groups in another order",
                sub.size()
            ));
        }
        let members = sub.members().to_vec();
        let me = sub.rank();
        Ok(Some(ProcessGroup::make(
            Net::Mpi(sub),
            members,
            me,
            gid,
            self.inner.cfg.clone(),
            None,
        )))
    }

    fn child(&self, ranks: &[usize], gid: u64) -> Option<ProcessGroup> {
        let me = ranks.iter().position(|&r| r == self.rank())?;
        let members = ranks.iter().map(|&r| self.inner.members[r]).collect();
        Some(ProcessGroup::make(
            Net::Native(self.t().clone()),
            members,
            me,
            gid,
            self.inner.cfg.clone(),
            None,
        ))
    }

    /// Split into disjoint groups by `color` (MPI_Comm_split): ranks with the
    /// same color form a group, ordered by (key, rank). A negative color
    /// joins no group. Collective over this group.
    pub fn split(&self, color: i64, key: i64) -> Result<Option<ProcessGroup>> {
        on_mpi!(self, m => {
            let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
            let gid = digest(&[self.inner.gid as usize, k as usize, color as usize]) | 2;
            // The group's size is not known here: count the color's members.
            let mut all = vec![0i64; self.size()];
            self.all_gather(&[color], &mut all)?;
            let want = all.iter().filter(|&&c| c == color).count();
            let c = (color >= 0).then_some((color as u64 & 0x3fff_ffff) as u32);
            self.mpi_child(m, c, key, gid, want)
        });
        let n = self.size();
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&[color, key], &mut all)?;
        let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
        if color < 0 {
            return Ok(None);
        }
        let mut ranks: Vec<usize> = (0..n).filter(|&r| all[2 * r] == color).collect();
        ranks.sort_by_key(|&r| (all[2 * r + 1], r));
        let gid = digest(&[self.inner.gid as usize, k as usize, color as usize]) | 2;
        // Ordered by key: the child's rank is the position in `ranks`.
        Ok(self.child(&ranks, gid))
    }
}
