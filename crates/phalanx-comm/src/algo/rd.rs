//! Recursive doubling all-reduce: log2(p) rounds of pairwise exchange, the
//! latency optimum for small messages.
//!
//! For a world size n that is not a power of two, let p be the largest power
//! of two below n and rem = n - p. Among the first 2*rem ranks, each even
//! rank hands its data to the odd rank above it and sits out; the p
//! remaining ranks run the exchange; finally the odd ranks hand the result
//! back. Any n >= 1 works.

use super::Ctx;
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;

pub fn all_reduce<T: Element>(c: &Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let n = c.n();
    let r = c.me;
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    // Fold: even ranks below 2*rem pass their data up and wait.
    let vrank = if r < 2 * rem {
        if r.is_multiple_of(2) {
            c.send(r + 1, buf)?;
            None
        } else {
            c.recv_reduce(r - 1, buf, op)?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = vrank {
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        let mut mask = 1;
        while mask < p {
            let partner = real(v ^ mask);
            c.send(partner, buf)?;
            c.recv_reduce(partner, buf, op)?;
            mask <<= 1;
        }
    }
    // Unfold: hand the result back to the ranks that sat out.
    if r < 2 * rem {
        if r % 2 == 1 {
            c.send(r - 1, buf)?;
        } else {
            c.recv_into(r + 1, buf)?;
        }
    }
    Ok(())
}
