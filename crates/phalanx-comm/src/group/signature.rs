//! `PHALANX_DEBUG=detail`: before each collective every rank sends the
//! others what it called (op, dtype, count, reduce op, root, layout), so a
//! mismatch is reported on every rank, naming each rank's call, instead of
//! hanging or corrupting data.

use super::ProcessGroup;
use crate::algo::Ctx;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result};

/// What a rank called, compared across ranks under PHALANX_DEBUG=detail.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Signature {
    pub op: &'static str,
    pub dtype: DType,
    pub count: u64,
    pub reduce: Option<ReduceOp>,
    pub root: Option<u64>,
    /// A digest of per-rank counts for the uneven variants.
    pub layout: u64,
}

impl Signature {
    pub fn describe(&self) -> String {
        let mut s = format!("{}({}, count={}", self.op, self.dtype.name(), self.count);
        if let Some(r) = self.reduce {
            s += &format!(", op={}", r.name());
        }
        if let Some(r) = self.root {
            s += &format!(", root={r}");
        }
        s + ")"
    }
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v[..self.op.len().min(16)].copy_from_slice(&self.op.as_bytes()[..self.op.len().min(16)]);
        v.push(self.dtype.code());
        v.push(self.reduce.map(|r| r.code()).unwrap_or(255));
        v.extend_from_slice(&self.count.to_le_bytes());
        v.extend_from_slice(&self.root.unwrap_or(u64::MAX).to_le_bytes());
        v.extend_from_slice(&self.layout.to_le_bytes());
        v
    }
}

impl ProcessGroup {
    pub(super) fn check_signatures(&self, c: &Ctx, sig: &Signature) -> Result<()> {
        let dc = Ctx {
            chan: self.chan(2),
            ..*c
        };
        let mine = sig.encode();
        for j in (0..c.n()).filter(|&j| j != c.me) {
            dc.t.send(c.members[j], dc.chan, dc.seq, &mine, dc.deadline)?;
        }
        let mut mismatch = false;
        let mut lines = Vec::new();
        for j in 0..c.n() {
            if j == c.me {
                lines.push(format!(
                    "rank {} called {} as collective #{}",
                    c.members[j],
                    sig.describe(),
                    c.seq
                ));
                continue;
            }
            let what = || {
                format!(
                    "{} #{} (waiting for rank {} to join)",
                    sig.op, c.seq, c.members[j]
                )
            };
            let m =
                dc.t.recv(c.members[j], dc.chan, dc.seq, dc.deadline, &what)
                    .map_err(|e| match e {
                        CommError::Timeout(_) => CommError::Desync(format!(
                            "rank {} never called collective #{} ({} on this rank {})",
                            c.members[j],
                            c.seq,
                            sig.describe(),
                            c.members[c.me]
                        )),
                        e => e,
                    })?;
            let theirs = m.bytes().to_vec();
            if theirs != mine {
                mismatch = true;
            }
            lines.push(format!(
                "rank {} called {} as collective #{}",
                c.members[j],
                decode_sig(&theirs),
                c.seq
            ));
        }
        if mismatch {
            return Err(CommError::Desync(lines.join("; ")));
        }
        Ok(())
    }
}

fn decode_sig(b: &[u8]) -> String {
    if b.len() < 16 + 2 + 24 {
        return "<malformed signature>".into();
    }
    let name = String::from_utf8_lossy(&b[..16])
        .trim_end_matches('\0')
        .to_string();
    let dtype = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
    ]
    .into_iter()
    .find(|d| d.code() == b[16])
    .map(|d| d.name())
    .unwrap_or("?");
    let red = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
        .into_iter()
        .find(|r| r.code() == b[17]);
    let count = u64::from_le_bytes(b[18..26].try_into().unwrap());
    let root = u64::from_le_bytes(b[26..34].try_into().unwrap());
    let mut s = format!("{name}({dtype}, count={count}");
    if let Some(r) = red {
        s += &format!(", op={}", r.name());
    }
    if root != u64::MAX {
        s += &format!(", root={root}");
    }
    s + ")"
}
