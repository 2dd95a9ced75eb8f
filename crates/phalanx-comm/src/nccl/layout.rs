//! The NCCL backend's pure bookkeeping: Phalanx dtypes and reduce ops as
//! NCCL's, and the padded layout that runs uneven (`_v`) collectives on
//! NCCL's equal-count ones.
//!
//! Status: unit-tested on CPU; not yet run on GPU hardware.
//!
//! Uneven reduce-scatter and all-gather are padded: every block is padded
//! to the largest count `m`, NCCL moves `n * m` elements, and the host cuts
//! the padding out while copying back. When all counts are equal (the
//! common case: ZeRO shards, DDP) no padding is made and the host buffers go
//! to the device as they are. Grouped send/receive would move no padding
//! but runs as `n` point-to-point transfers instead of NCCL's ring; padding
//! costs at most `n * (m - min)` extra elements.

use crate::dtype::{DType, ReduceOp};
use std::ffi::c_int;

/// `ncclDataType_t`'s values (nccl.h), kept here rather than taken from
/// cudarc's NCCL bindings: that feature of cudarc, beside candle's
/// dynamic linking, makes the build link `-lnccl` (an unversioned
/// `libnccl.so` that NCCL's wheel and Debian's `libnccl2` do not ship),
/// while the library is opened at run time here (`probe`).
#[allow(non_upper_case_globals)]
mod nccl_dtype_t {
    use std::ffi::c_int;
    pub const ncclInt32: c_int = 2;
    pub const ncclInt64: c_int = 4;
    pub const ncclFloat16: c_int = 6;
    pub const ncclFloat32: c_int = 7;
    pub const ncclFloat64: c_int = 8;
    pub const ncclBfloat16: c_int = 9;
}

/// `ncclRedOp_t`'s values (nccl.h).
#[allow(non_upper_case_globals)]
mod nccl_red_op_t {
    use std::ffi::c_int;
    pub const ncclSum: c_int = 0;
    pub const ncclMax: c_int = 2;
    pub const ncclMin: c_int = 3;
    pub const ncclAvg: c_int = 4;
}

/// NCCL's `ncclUniqueId` (nccl.h: 128 bytes, passed by value to
/// `ncclCommInitRank`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [std::ffi::c_char; 128],
}

/// NCCL's datatype for a Phalanx dtype.
pub fn nccl_dtype(d: DType) -> c_int {
    match d {
        DType::F32 => nccl_dtype_t::ncclFloat32,
        DType::F64 => nccl_dtype_t::ncclFloat64,
        DType::F16 => nccl_dtype_t::ncclFloat16,
        DType::BF16 => nccl_dtype_t::ncclBfloat16,
        DType::I32 => nccl_dtype_t::ncclInt32,
        DType::I64 => nccl_dtype_t::ncclInt64,
    }
}

/// NCCL's reduction for a Phalanx op, and whether the host must divide by
/// the group size afterwards. `Avg` runs as `ncclSum` and a division on the
/// host, the native backend's semantics exactly (integer division for
/// integers; NCCL's `ncclAvg` pre-multiplies floats by 1/n instead).
pub fn nccl_op(op: ReduceOp) -> (c_int, bool) {
    let (r, div) = match op {
        ReduceOp::Sum => (nccl_red_op_t::ncclSum, false),
        ReduceOp::Avg => (nccl_red_op_t::ncclSum, true),
        ReduceOp::Max => (nccl_red_op_t::ncclMax, false),
        ReduceOp::Min => (nccl_red_op_t::ncclMin, false),
    };
    (r, div)
}

/// NCCL's reduction for `op` on device memory, where no host divides
/// afterwards: `Avg` is `ncclAvg` (NCCL 2.10 and later), which only
/// floating-point dtypes have.
pub fn nccl_device_op(op: ReduceOp, d: DType) -> Result<c_int, String> {
    match (op, d) {
        (ReduceOp::Avg, DType::I32 | DType::I64) => Err(format!(
            "an average of {d:?} in device memory (NCCL averages floating-point dtypes only)"
        )),
        (ReduceOp::Avg, _) => Ok(nccl_red_op_t::ncclAvg),
        _ => Ok(nccl_op(op).0),
    }
}

/// Offsets of consecutive blocks of `counts` elements.
pub fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |a, &c| {
            let o = *a;
            *a += c;
            Some(o)
        })
        .collect()
}

/// How blocks of uneven `counts` sit in NCCL's equal blocks of `max`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Padded {
    /// Elements per block as NCCL sees it.
    pub max: usize,
    /// True when every count is `max`: the tight layout is the padded one.
    pub even: bool,
}

impl Padded {
    pub fn of(counts: &[usize]) -> Padded {
        let max = counts.iter().copied().max().unwrap_or(0);
        Padded {
            max,
            even: counts.iter().all(|&c| c == max),
        }
    }

    /// Copy blocks of `counts` elements (of `esz` bytes each) laid out
    /// tightly in `tight` into blocks of `max` in `padded` (`n * max *
    /// esz` bytes); the padding is zero.
    pub fn pad(&self, counts: &[usize], esz: usize, tight: &[u8], padded: &mut [u8]) {
        padded.fill(0);
        let mut at = 0;
        for (k, &c) in counts.iter().enumerate() {
            let dst = k * self.max * esz;
            padded[dst..dst + c * esz].copy_from_slice(&tight[at..at + c * esz]);
            at += c * esz;
        }
    }

    /// The inverse of [`Self::pad`]: cut the padding out.
    pub fn cut(&self, counts: &[usize], esz: usize, padded: &[u8], tight: &mut [u8]) {
        let mut at = 0;
        for (k, &c) in counts.iter().enumerate() {
            let src = k * self.max * esz;
            tight[at..at + c * esz].copy_from_slice(&padded[src..src + c * esz]);
            at += c * esz;
        }
    }
}

/// The color `ncclCommSplit` takes (a non-negative `int`, or
/// `NCCL_SPLIT_NOCOLOR` = -1 for a rank that joins no group).
pub fn split_color(color: Option<u32>) -> c_int {
    match color {
        Some(c) => (c & 0x7fff_ffff) as c_int,
        None => -1,
    }
}

/// `ncclCommSplit`'s key: clamped to 32 bits, as `ProcessGroup::split`
/// orders ranks.
pub fn split_key(key: i64) -> c_int {
    key.clamp(c_int::MIN as i64, c_int::MAX as i64) as c_int
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_and_ops_map_to_ncclh_values() {
        // The values of nccl.h (stable across NCCL 2.x).
        assert_eq!(nccl_dtype(DType::I32), 2);
        assert_eq!(nccl_dtype(DType::I64), 4);
        assert_eq!(nccl_dtype(DType::F16), 6);
        assert_eq!(nccl_dtype(DType::F32), 7);
        assert_eq!(nccl_dtype(DType::F64), 8);
        assert_eq!(nccl_dtype(DType::BF16), 9);
        assert_eq!(nccl_op(ReduceOp::Sum), (0, false));
        assert_eq!(nccl_op(ReduceOp::Avg), (0, true));
        assert_eq!(nccl_op(ReduceOp::Max), (2, false));
        assert_eq!(nccl_op(ReduceOp::Min), (3, false));
        // On device memory nobody divides afterwards: Avg is ncclAvg (4).
        assert_eq!(nccl_device_op(ReduceOp::Avg, DType::F32), Ok(4));
        assert_eq!(nccl_device_op(ReduceOp::Avg, DType::BF16), Ok(4));
        assert_eq!(nccl_device_op(ReduceOp::Sum, DType::I64), Ok(0));
        assert_eq!(nccl_device_op(ReduceOp::Max, DType::F32), Ok(2));
        let e = nccl_device_op(ReduceOp::Avg, DType::I32).unwrap_err();
        assert!(e.contains("I32") && e.contains("floating-point"), "{e}");
    }

    #[test]
    fn uneven_blocks_pad_to_the_largest_and_cut_back() {
        let counts = [2usize, 0, 3, 1];
        let p = Padded::of(&counts);
        assert_eq!(
            p,
            Padded {
                max: 3,
                even: false
            }
        );
        let tight: Vec<u8> = (1..=6).collect();
        let mut padded = vec![0xffu8; 4 * 3];
        p.pad(&counts, 1, &tight, &mut padded);
        assert_eq!(padded, [1, 2, 0, 0, 0, 0, 3, 4, 5, 6, 0, 0]);
        let mut back = vec![0u8; 6];
        p.cut(&counts, 1, &padded, &mut back);
        assert_eq!(back, tight);
        // Multi-byte elements.
        let t32: Vec<u8> = (0..24).collect();
        let mut p32 = vec![0u8; 4 * 3 * 4];
        p.pad(&counts, 4, &t32, &mut p32);
        assert_eq!(&p32[24..36], &t32[8..20]);
        let mut b32 = vec![0u8; 24];
        p.cut(&counts, 4, &p32, &mut b32);
        assert_eq!(b32, t32);
    }

    #[test]
    fn even_counts_need_no_padding() {
        assert_eq!(Padded::of(&[4, 4, 4]), Padded { max: 4, even: true });
        assert_eq!(Padded::of(&[]), Padded { max: 0, even: true });
        assert_eq!(offsets(&[2, 0, 3]), vec![0, 2, 2]);
    }

    #[test]
    fn split_colors_and_keys_fit_ncclcommsplit() {
        assert_eq!(split_color(None), -1);
        assert_eq!(split_color(Some(u32::MAX)), 0x7fff_ffff);
        assert_eq!(split_color(Some(5)), 5);
        assert_eq!(split_key(i64::MAX), i32::MAX);
        assert_eq!(split_key(-3), -3);
    }
}
