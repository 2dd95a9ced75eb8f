//! Sub-groups: `new_group` (a list of ranks) and `split` (MPI_Comm_split's
//! colors and keys). On the native transport a sub-group shares its
//! parent's transport under its own channels; on MPI it is a communicator
//! split.

use super::{digest, ProcessGroup, Signature};
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
        // Members of one requested group share a color; the rest of this
        // group joins none.
        let mine = rs.iter().position(|&r| r == self.rank());
        let color = mine.map(|_| digest(&rs) as u32);
        self.child(
            &rs,
            color,
            mine.unwrap_or(0) as i64,
            0x5b,
            Some(digest(&rs)),
        )
    }

    /// Split into disjoint groups by `color` (MPI_Comm_split): ranks with the
    /// same color form a group, ordered by (key, rank), keys clamped to 32
    /// bits as MPI clamps them. A negative color joins no group. Collective
    /// over this group.
    pub fn split(&self, color: i64, key: i64) -> Result<Option<ProcessGroup>> {
        let n = self.size();
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&[color, key], &mut all)?;
        let mut ranks: Vec<usize> = (0..n).filter(|&r| all[2 * r] == color).collect();
        // Keys are clamped to 32 bits as MPI_Comm_split clamps them, so the
        // ranks' order is the same on every backend.
        ranks.sort_by_key(|&r| (all[2 * r + 1].clamp(i32::MIN as i64, i32::MAX as i64), r));
        let c = (color >= 0).then_some((color as u64 & 0x3fff_ffff) as u32);
        self.child(&ranks, c, key, color as usize, None)
    }

    /// The sub-group of `ranks` (this group's ranks, in the child's rank
    /// order) if this rank has a `color`; its carrier from the backend
    /// (collective over this group). Its id comes from this group's id, a
    /// count of the sub-groups made so far and `salt`. `members`: a digest
    /// of the ranks asked for, the same on every rank (`new_group`), which
    /// `PHALANX_DEBUG=detail` compares.
    fn child(
        &self,
        ranks: &[usize],
        color: Option<u32>,
        key: i64,
        salt: usize,
        members: Option<u64>,
    ) -> Result<Option<ProcessGroup>> {
        self.inner.queue.drain();
        if let Some(e) = self.broken() {
            return Err(e);
        }
        #[cfg(test)]
        tests::pause_point();
        let _g = self.inner.lock_exec();
        let seq = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        // The count is taken under the exec lock, with the sequence number:
        // sub-groups made from two threads at once are numbered in the
        // order the backend matches them (by sequence) on every rank, not
        // in the order the calls came in, which differs between ranks.
        let k = self.inner.children.fetch_add(1, Ordering::SeqCst);
        let gid = digest(&[self.inner.gid as usize, k as usize, salt]) | 2;
        let c = self.call("new_group", seq);
        if let (Some(layout), true) = (members, self.inner.cfg.detail && c.n() > 1) {
            let sig = Signature {
                layout,
                ..self.sig::<i64>("new_group", ranks.len())
            };
            self.down_on_timeout(self.check_signatures(&c, &sig))?;
        }
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

#[cfg(test)]
mod tests {
    use crate::{threads, Config, ProcessGroup};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::Mutex;
    use std::time::Duration;

    /// A thread named `PAUSED` stops in `child` just before it takes the
    /// exec lock: it says so on the first channel and waits (up to a
    /// minute) for a word on the second.
    const PAUSED: &str = "phalanx-test-paused-new-group";
    type Pause = (Sender<()>, Receiver<()>);
    static PAUSE: Mutex<Option<Pause>> = Mutex::new(None);

    pub(super) fn pause_point() {
        if std::thread::current().name() != Some(PAUSED) {
            return;
        }
        if let Some((paused, go)) = PAUSE.lock().unwrap().take() {
            let _ = paused.send(());
            let _ = go.recv_timeout(Duration::from_secs(60));
        }
    }

    fn gid(g: &ProcessGroup) -> u64 {
        g.inner.gid
    }

    /// Two threads of rank 0 create sub-groups at once: the one that
    /// called first (A) reaches the exec lock last. Rank 1 creates its two
    /// one after the other. The groups pair up by the parent's sequence
    /// (the order the backend matches them in), so the first on rank 1 is
    /// B on rank 0, and each pair must have one id. The id's counter used
    /// to be taken on the way in: A's on rank 0, the first's on rank 1.
    #[test]
    fn sub_groups_made_from_two_threads_at_once_agree_on_their_ids() {
        let cfg = Config {
            timeout: Duration::from_secs(20),
            ..Config::default()
        };
        let out = threads::run_with(2, cfg, Duration::from_secs(60), |pg| {
            pg.barrier()?;
            let ids = if pg.rank() == 0 {
                let (paused_tx, paused) = channel();
                let (go, go_rx) = channel();
                *PAUSE.lock().unwrap() = Some((paused_tx, go_rx));
                let pa = pg.clone();
                let a = std::thread::Builder::new()
                    .name(PAUSED.into())
                    .spawn(move || pa.new_group(&[0, 1]))
                    .unwrap();
                paused
                    .recv_timeout(Duration::from_secs(60))
                    .expect("A never reached the exec lock");
                let b = pg.new_group(&[0, 1])?.unwrap();
                go.send(()).unwrap();
                let a = a.join().unwrap()?.unwrap();
                vec![gid(&b), gid(&a)]
            } else {
                let first = pg.new_group(&[0, 1])?.unwrap();
                let second = pg.new_group(&[0, 1])?.unwrap();
                vec![gid(&first), gid(&second)]
            };
            pg.barrier()?;
            Ok(ids)
        });
        let ids: Vec<Vec<u64>> = out.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(ids[0], ids[1], "by parent sequence: rank 0, rank 1");
        assert_ne!(ids[0][0], ids[0][1]);
    }
}
