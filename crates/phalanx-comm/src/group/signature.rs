//! `PHALANX_DEBUG=detail`: before each collective every rank sends the
//! others what it called (op, dtype, count, reduce op, root, layout), so a
//! mismatch is reported on every rank, naming each rank's call, instead of
//! hanging or corrupting data.

use super::ProcessGroup;
use crate::backend::Call;
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
    /// All-to-all-v: this rank's send and receive counts, one per rank.
    /// They differ between ranks by design; what must agree is what rank i
    /// sends rank j and what rank j expects from rank i.
    pub pairs: Option<(Vec<u64>, Vec<u64>)>,
}

/// Bytes of the part of an encoded signature every rank must share.
const FIXED: usize = 16 + 2 + 3 * 8;

impl Signature {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v[..self.op.len().min(16)].copy_from_slice(&self.op.as_bytes()[..self.op.len().min(16)]);
        v.push(self.dtype.code());
        v.push(self.reduce.map(|r| r.code()).unwrap_or(255));
        v.extend_from_slice(&self.count.to_le_bytes());
        v.extend_from_slice(&self.root.unwrap_or(u64::MAX).to_le_bytes());
        v.extend_from_slice(&self.layout.to_le_bytes());
        debug_assert_eq!(v.len(), FIXED);
        if let Some((send, recv)) = &self.pairs {
            for x in send.iter().chain(recv) {
                v.extend_from_slice(&x.to_le_bytes());
            }
        }
        v
    }
}

/// The send and receive counts (n each) after the fixed part, if there.
fn decode_pairs(b: &[u8], n: usize) -> Option<(Vec<u64>, Vec<u64>)> {
    let rest = b.get(FIXED..)?;
    if rest.len() != 16 * n {
        return None;
    }
    let words: Vec<u64> = rest
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        .collect();
    let (send, recv) = words.split_at(n);
    Some((send.to_vec(), recv.to_vec()))
}

/// Where rank i's count for rank j (send) and rank j's for rank i
/// (receive) differ, in words; `None` where a signature has no counts.
fn pair_mismatches(c: &Call, all: &[Vec<u8>]) -> Option<Vec<String>> {
    let n = c.n();
    let pairs = all
        .iter()
        .map(|s| decode_pairs(s, n))
        .collect::<Option<Vec<_>>>()?;
    let mut out = Vec::new();
    for (i, (send, _)) in pairs.iter().enumerate() {
        for (j, (_, recv)) in pairs.iter().enumerate() {
            if send[j] != recv[i] {
                out.push(format!(
                    "rank {} sends {} elements to rank {}, which expects {} from it",
                    c.members[i], send[j], c.members[j], recv[i]
                ));
            }
        }
    }
    Some(out)
}

impl ProcessGroup {
    /// Exchange this collective's signature with every rank (through the
    /// backend) and fail on every rank, naming each rank's call, when they
    /// differ.
    pub(super) fn check_signatures(&self, c: &Call, sig: &Signature) -> Result<()> {
        let mine = sig.encode();
        let all = self.down_on_missing_rank(self.inner.backend.exchange_signatures(c, &mine))?;
        if all.iter().all(|s| *s == mine) {
            return Ok(());
        }
        let fixed = |s: &[u8]| s.get(..FIXED).map(<[u8]>::to_vec);
        if sig.pairs.is_some() && all.iter().all(|s| fixed(s) == fixed(&mine)) {
            if let Some(bad) = pair_mismatches(c, &all) {
                if bad.is_empty() {
                    return Ok(());
                }
                const SHOWN: usize = 8;
                let more = bad.len().saturating_sub(SHOWN);
                return Err(CommError::Desync(format!(
                    "{} #{}: the ranks' send and receive counts disagree: {}{}",
                    decode_sig(&mine),
                    c.seq,
                    bad[..bad.len().min(SHOWN)].join("; "),
                    if more > 0 {
                        format!("; and {more} more pairs")
                    } else {
                        String::new()
                    }
                )));
            }
        }
        let lines: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(j, s)| {
                format!(
                    "rank {} called {} as collective #{}",
                    c.members[j],
                    decode_sig(s),
                    c.seq
                )
            })
            .collect();
        Err(CommError::Desync(lines.join("; ")))
    }
}

impl ProcessGroup {
    /// `r`, once the transport is torn down if the signature exchange ran
    /// past its deadline: a rank that never called (the native backend
    /// names it, as a `Desync`) leaves the ranks as far apart as any
    /// timeout does, so, as in `down_on_timeout`, the peers are told and
    /// what is queued behind fails at once instead of each call waiting
    /// out a deadline of its own.
    fn down_on_missing_rank<R>(&self, r: Result<R>) -> Result<R> {
        if let Err(e @ (CommError::Timeout(_) | CommError::Desync(_))) = &r {
            self.fail_peers(&e.to_string());
        }
        r
    }
}

#[cfg(feature = "mpi")]
/// An encoded signature in words: backends that exchange typed buffers
/// only (MPI) send it as `i64`s.
pub(crate) fn to_words(b: &[u8]) -> Vec<i64> {
    b.chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            i64::from_le_bytes(w)
        })
        .collect()
}

#[cfg(feature = "mpi")]
/// [`to_words`] back to the encoded signature of `len` bytes.
pub(crate) fn from_words(w: &[i64], len: usize) -> Vec<u8> {
    let mut b: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.truncate(len);
    b
}

pub(crate) fn decode_sig(b: &[u8]) -> String {
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
    // The digest of per-rank counts, or of a new group's members.
    let layout = u64::from_le_bytes(b[34..42].try_into().unwrap());
    if layout != 0 {
        s += &format!(", digest={layout:016x}");
    }
    s + ")"
}
