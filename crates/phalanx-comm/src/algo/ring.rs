//! Ring algorithms: each rank sends to its right neighbour and receives from
//! its left. Per rank, reduce-scatter and all-gather each move (n-1)/n of
//! the buffer; all-reduce is the two in sequence, 2(n-1)/n: the bandwidth
//! optimum.
//!
//! All three are one chain of steps. At step j a rank sends block
//! `r-j-1` and receives block `r-j-2` (mod n): reduce-scatter is steps
//! 0..n-1 (received chunks are reduced in), all-gather steps n-1..2n-2
//! (received chunks are stored), all-reduce both. The block received at step
//! j is the one sent at step j+1, so the chain is pipelined chunk by chunk
//! across steps: a chunk is forwarded as soon as it is reduced, while it is
//! still in cache, and a few chunks stay in flight to keep the links busy.
//! The next step never waits for the whole previous block.
//!
//! All-gather chunks are received in place: the transport reads them from
//! the socket straight into the buffer (posted receives, on the collective's
//! second channel) instead of into a pooled buffer and then copying.

use super::{chunks, Ctx};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use crate::transport::Posts;
use std::ops::Range;

/// Chunks sent but not yet matched by a receive: enough to keep a chunk on
/// the wire while the previous one is reduced.
const WINDOW: usize = 2;

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
    chain(c, buf, blocks, 0..n - 1, op)
}

/// In-place ring all-gather: block `me` of `buf` is ours; afterwards every
/// block holds its owner's data.
pub fn all_gather<T: Element>(c: &Ctx, buf: &mut [T], blocks: &[Range<usize>]) -> Result<()> {
    let n = c.n();
    // The op is unused: all-gather steps store.
    chain(c, buf, blocks, n - 1..2 * n - 2, ReduceOp::Sum)
}

/// All-reduce = reduce-scatter then all-gather, on `n` near-equal blocks,
/// as one pipelined chain.
pub fn all_reduce<T: Element>(c: &Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let blocks = super::ranges(&super::even_split(buf.len(), c.n()));
    let n = c.n();
    chain(c, buf, &blocks, 0..2 * n - 2, op)
}

/// One chunk of the chain: elements `range` of `buf`, at step `step`.
struct Item {
    range: Range<usize>,
    step: usize,
}

/// Run steps `steps` of the ring chain (see the module docs); steps below
/// n-1 reduce with `op`, the others store.
fn chain<T: Element>(
    c: &Ctx,
    buf: &mut [T],
    blocks: &[Range<usize>],
    steps: Range<usize>,
    op: ReduceOp,
) -> Result<()> {
    let n = c.n();
    if n == 1 || steps.is_empty() {
        return Ok(());
    }
    let (r, right, left) = (c.me, (c.me + 1) % n, (c.me + n - 1) % n);
    let gather_from = n - 1;
    let sent_at = |j: usize| blocks[(r + 2 * n - j % n - 1) % n].clone();
    let received_at = |j: usize| blocks[(r + 2 * n - j % n - 2) % n].clone();

    // Sends: the first step's block, then every received block but the
    // last step's, in order; sends[k0 + m] forwards recvs[m].
    let mut sends: Vec<Item> = chunks(sent_at(steps.start), c.chunk_elems)
        .map(|range| Item {
            range,
            step: steps.start,
        })
        .collect();
    let k0 = sends.len();
    let mut recvs: Vec<Item> = Vec::new();
    for j in steps.clone() {
        for range in chunks(received_at(j), c.chunk_elems) {
            if j + 1 < steps.end {
                sends.push(Item {
                    range: range.clone(),
                    step: j + 1,
                });
            }
            recvs.push(Item { range, step: j });
        }
    }

    let base = buf.as_mut_ptr();
    // SAFETY (for every use of `base` below): all items lie inside `buf`,
    // which this function holds mutably and touches only through `base`.
    // A posted region is written by the transport's reader thread until it
    // has been waited for; it is touched by nothing else meanwhile: it is
    // posted after its last send of the reduce-scatter phase (or at the
    // start when this chain has no such send), and sent again only after it
    // has been waited for. `posts` is dropped (waiting for any region still
    // being written) before `buf`'s borrow ends.
    let mut posts = c.posts(c.chan2, left);
    // SAFETY: see above; callers post a region only once it is free.
    let post = |posts: &mut Posts, range: &Range<usize>| unsafe {
        posts.post(
            base.add(range.start) as *mut u8,
            std::mem::size_of::<T>() * range.len(),
        )
    };
    // Gather-phase receives whose region is not sent in this chain's
    // reduce phase can be posted now, in order.
    for it in recvs.iter().filter(|it| it.step >= gather_from) {
        if it.step - (n - 1) < steps.start {
            post(&mut posts, &it.range);
        }
    }

    let (mut sent, mut got) = (0, 0);
    while got < recvs.len() || sent < sends.len() {
        while sent < sends.len()
            && (sent < got + WINDOW || got == recvs.len())
            && (sent < k0 || sent - k0 < got)
        {
            let it = &sends[sent];
            // SAFETY: a chunk of our own block or one already received.
            let data =
                unsafe { std::slice::from_raw_parts(base.add(it.range.start), it.range.len()) };
            if it.step < gather_from {
                c.send(right, data)?;
                // The region's next use is its gather-phase receive, n-1
                // steps on: post it (in order: sends go step by step).
                if it.step + n - 1 < steps.end {
                    post(&mut posts, &it.range);
                }
            } else {
                c.send_on(c.chan2, right, data)?;
            }
            sent += 1;
        }
        if let Some(it) = recvs.get(got) {
            if it.step < gather_from {
                // SAFETY: a reduce-phase chunk: never posted while in use.
                let acc = unsafe {
                    std::slice::from_raw_parts_mut(base.add(it.range.start), it.range.len())
                };
                c.recv_reduce(left, acc, op)?;
            } else {
                // SAFETY: gather-phase chunks are posted and waited for in
                // the same order.
                unsafe { c.wait_posted(&mut posts, left, base, it.range.clone())? };
            }
            got += 1;
        }
    }
    Ok(())
}
