//! Rooted collectives: binomial trees for small messages (log2 n hops), a
//! pipelined chain for large broadcasts (each link carries the message once,
//! chunk k+1 travels while chunk k is forwarded).

use super::{chunks, Ctx};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;

/// Binomial-tree broadcast from `root`.
pub fn broadcast_tree<T: Element>(c: &Ctx, buf: &mut [T], root: usize) -> Result<()> {
    let n = c.n();
    let vr = (c.me + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            c.recv_into(real(vr - mask), buf)?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            c.send(real(vr + mask), buf)?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Chain broadcast: root -> root+1 -> ... in chunks, each rank forwarding a
/// chunk as soon as it has it.
pub fn broadcast_chain<T: Element>(c: &Ctx, buf: &mut [T], root: usize) -> Result<()> {
    let n = c.n();
    let vr = (c.me + n - root) % n;
    let prev = (c.me + n - 1) % n;
    let next = (c.me + 1) % n;
    for ch in chunks(0..buf.len(), c.chunk_elems) {
        if vr != 0 {
            c.recv_into(prev, &mut buf[ch.clone()])?;
        }
        if vr != n - 1 {
            c.send(next, &buf[ch])?;
        }
    }
    Ok(())
}

/// Binomial-tree reduce into `acc` on `root` (`acc` on other ranks is used
/// as scratch and holds partial results afterwards).
pub fn reduce_tree<T: Element>(c: &Ctx, acc: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
    let n = c.n();
    let vr = (c.me + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask == 0 {
            let src = vr | mask;
            if src < n {
                c.recv_reduce(real(src), acc, op)?;
            }
        } else {
            c.send(real(vr & !mask), acc)?;
            break;
        }
        mask <<= 1;
    }
    Ok(())
}
