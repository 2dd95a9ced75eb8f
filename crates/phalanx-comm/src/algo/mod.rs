//! Collective algorithms, written against `Ctx` (send/recv to group ranks),
//! independent of the transport underneath.
//!
//! - `ring`: bandwidth-optimal reduce-scatter / all-gather / all-reduce,
//!   each step pipelined in chunks so receiving and reducing overlap.
//! - `rd`: recursive doubling all-reduce for small messages (log2 n rounds),
//!   with the standard fold for world sizes that are not powers of two.
//! - `tree`: binomial-tree broadcast and reduce for small messages, and a
//!   pipelined chain broadcast for large ones.
//!
//! Every algorithm gives all ranks bitwise identical results: each reduced
//! element is computed once and copied (ring), or by every rank in the same
//! order up to operand swap, which IEEE addition does not notice and max/min
//! are written not to (NaN and ±0 included, see `crate::dtype`) (rd).

pub mod rd;
pub mod ring;
pub mod tree;

use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::transport::{Msg, Posts, Transport};
use std::ops::Range;
use std::time::Instant;

/// What one collective call needs: who is in the group, which messages are
/// its own (channel, sequence), and when to give up.
pub struct Ctx<'a> {
    pub t: &'a Transport,
    /// Group rank -> global rank.
    pub members: &'a [usize],
    /// This process's rank in the group.
    pub me: usize,
    pub chan: u64,
    /// A second channel for the all-gather phase of ring collectives: its
    /// frames are received in place (posted ahead), which is only safe if
    /// no frame of the other phase can be taken for one of them.
    pub chan2: u64,
    pub seq: u64,
    pub deadline: Instant,
    pub op: &'static str,
    /// Pipeline chunk size in elements for ring steps.
    pub chunk_elems: usize,
}

impl<'a> Ctx<'a> {
    pub fn n(&self) -> usize {
        self.members.len()
    }

    pub fn send<T: Element>(&self, to: usize, data: &[T]) -> Result<()> {
        self.t.send(
            self.members[to],
            self.chan,
            self.seq,
            bytemuck::cast_slice(data),
            self.deadline,
        )
    }

    pub fn recv(&self, from: usize) -> Result<Msg> {
        let what = || format!("{} (collective #{})", self.op, self.seq);
        self.t.recv(
            self.members[from],
            self.chan,
            self.seq,
            self.deadline,
            &what,
        )
    }

    fn check_len<T>(&self, from: usize, m: &Msg, want: usize) -> Result<()> {
        let got = m.len / std::mem::size_of::<T>();
        if !m.len.is_multiple_of(std::mem::size_of::<T>()) || got != want {
            return Err(CommError::Desync(format!(
                "{} #{}: rank {} sent {} bytes where {} elements were expected; \
                 ranks called it with different sizes (set PHALANX_DEBUG=detail to see each call)",
                self.op, self.seq, self.members[from], m.len, want
            )));
        }
        Ok(())
    }

    /// Receive exactly `out.len()` elements from `from` into `out`.
    pub fn recv_into<T: Element>(&self, from: usize, out: &mut [T]) -> Result<()> {
        let m = self.recv(from)?;
        self.check_len::<T>(from, &m, out.len())?;
        out.copy_from_slice(m.as_slice());
        self.t.recycle(m);
        Ok(())
    }

    /// Send on another channel of this collective (see `chan2`).
    pub fn send_on<T: Element>(&self, chan: u64, to: usize, data: &[T]) -> Result<()> {
        self.t.send(
            self.members[to],
            chan,
            self.seq,
            bytemuck::cast_slice(data),
            self.deadline,
        )
    }

    /// Receive on another channel of this collective (see `chan2`).
    pub fn recv_on(&self, chan: u64, from: usize) -> Result<Msg> {
        let what = || format!("{} (collective #{})", self.op, self.seq);
        self.t
            .recv(self.members[from], chan, self.seq, self.deadline, &what)
    }

    /// Receives from `from` on `chan` that the reader thread places straight
    /// into the caller's buffer (see `Posts`).
    pub(crate) fn posts(&self, chan: u64, from: usize) -> Posts<'a> {
        self.t.posts(self.members[from], chan, self.seq)
    }

    /// Wait for the next receive posted in `posts` (from `from`), which
    /// covers `base[r]`; a frame that arrived before it was posted is copied.
    ///
    /// # Safety
    /// `base[r]` must be the region posted next in `posts`.
    pub(crate) unsafe fn wait_posted<T: Element>(
        &self,
        posts: &mut Posts,
        from: usize,
        base: *mut T,
        r: Range<usize>,
    ) -> Result<()> {
        let what = || format!("{} (collective #{})", self.op, self.seq);
        if let Some(m) = posts.wait(self.deadline, &what)? {
            self.check_len::<T>(from, &m, r.len())?;
            std::slice::from_raw_parts_mut(base.add(r.start), r.len())
                .copy_from_slice(m.as_slice());
            self.t.recycle(m);
        }
        Ok(())
    }

    /// Receive `acc.len()` elements from `from` and reduce them into `acc`.
    pub fn recv_reduce<T: Element>(&self, from: usize, acc: &mut [T], op: ReduceOp) -> Result<()> {
        let m = self.recv(from)?;
        self.check_len::<T>(from, &m, acc.len())?;
        T::reduce_into(op, acc, m.as_slice());
        self.t.recycle(m);
        Ok(())
    }
}

/// Split `len` elements into `n` contiguous parts, the first `len % n`
/// one larger: any length works, including 0 and lengths below `n`.
pub fn even_split(len: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| len / n + usize::from(i < len % n)).collect()
}

/// Offsets of consecutive blocks of the given sizes.
pub fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let r = off..off + c;
            off += c;
            r
        })
        .collect()
}

/// Sub-ranges of at most `chunk` elements covering `r` (none if empty).
pub fn chunks(r: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (r.start..r.end)
        .step_by(chunk)
        .map(move |s| s..(s + chunk).min(r.end))
}
