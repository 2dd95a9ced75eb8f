//! Ring algorithms: n-1 steps, each rank sends to its right neighbour and
//! receives from its left; every step is cut into chunks, and each chunk is
//! reduced as soon as it arrives, while the next is still in flight.
//!
//! Per rank, reduce-scatter and all-gather each move (n-1)/n of the buffer;
//! all-reduce is the two in sequence, 2(n-1)/n: the bandwidth optimum.

use super::{chunks, Ctx};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use std::ops::Range;

/// In-place ring reduce-scatter over `blocks` of `buf`: afterwards block `me`
/// holds the reduction of that block over all ranks (other blocks hold
/// partial sums). Block k may have any size, including 0.
pub fn reduce_scatter<T: Element>(
    c: &Ctx,
    buf: &mut [T],
    blocks: &[Range<usize>],
    op: ReduceOp,
) -> Result<()> {
    let n = c.n();
    let (r, right, left) = (c.me, (c.me + 1) % n, (c.me + n - 1) % n);
    for s in 0..n - 1 {
        // Step s: send block r-s-1, receive block r-s-2 and reduce into it.
        let send_b = blocks[(r + 2 * n - s - 1) % n].clone();
        let recv_b = blocks[(r + 2 * n - s - 2) % n].clone();
        exchange(c, buf, send_b, right, recv_b, left, Some(op))?;
    }
    Ok(())
}

/// In-place ring all-gather: block `me` of `buf` is ours; afterwards every
/// block holds its owner's data.
pub fn all_gather<T: Element>(c: &Ctx, buf: &mut [T], blocks: &[Range<usize>]) -> Result<()> {
    let n = c.n();
    let (r, right, left) = (c.me, (c.me + 1) % n, (c.me + n - 1) % n);
    for s in 0..n - 1 {
        let send_b = blocks[(r + n - s) % n].clone();
        let recv_b = blocks[(r + 2 * n - s - 1) % n].clone();
        exchange(c, buf, send_b, right, recv_b, left, None)?;
    }
    Ok(())
}

/// All-reduce = reduce-scatter then all-gather, on `n` near-equal blocks.
pub fn all_reduce<T: Element>(c: &Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let blocks = super::ranges(&super::even_split(buf.len(), c.n()));
    reduce_scatter(c, buf, &blocks, op)?;
    all_gather(c, buf, &blocks)
}

/// One ring step: stream `send_b` to the right while receiving `recv_b` from
/// the left, chunk by chunk. The transport's reader threads drain sockets,
/// so sending before receiving cannot deadlock; interleaving per chunk keeps
/// the data hot in cache and lets the next chunk travel while this one is
/// reduced.
fn exchange<T: Element>(
    c: &Ctx,
    buf: &mut [T],
    send_b: Range<usize>,
    right: usize,
    recv_b: Range<usize>,
    left: usize,
    op: Option<ReduceOp>,
) -> Result<()> {
    let sends: Vec<Range<usize>> = chunks(send_b, c.chunk_elems).collect();
    let recvs: Vec<Range<usize>> = chunks(recv_b, c.chunk_elems).collect();
    // Keep one chunk in flight ahead of the one being received.
    const AHEAD: usize = 1;
    for i in 0..sends.len().max(recvs.len() + AHEAD) {
        if let Some(s) = sends.get(i) {
            c.send(right, &buf[s.clone()])?;
        }
        if let Some(rc) = i.checked_sub(AHEAD).and_then(|k| recvs.get(k)) {
            match op {
                Some(op) => c.recv_reduce(left, &mut buf[rc.clone()], op)?,
                None => c.recv_into(left, &mut buf[rc.clone()])?,
            }
        }
    }
    Ok(())
}
