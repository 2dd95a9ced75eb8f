//! `C (m, n) [+]= A (m, k) . B (k, n)` with the products taken in bf16 and
//! summed in f32, on CPUs with AVX512-BF16 (detected at run time).
//!
//! Why: `vdpbf16ps` multiplies 32 bf16 pairs per instruction into 16 f32
//! sums, twice the products of an f32 FMA, so a bf16 layer can run its
//! matrix products up to twice as fast as f32 — what `autocast(bfloat16)`
//! gets from oneDNN. A and B arrive as f32 views (a bf16 weight widened
//! is exact; an f32 activation is rounded to nearest-even when packed, as
//! autocast rounds it), and C stays f32.
//!
//! The structure is the usual one for a register-blocked gemm:
//! - k is taken in pairs (the instruction's unit): both operands are packed
//!   as u32 words, each word two bf16 of consecutive k (odd k padded with 0);
//! - B is packed per block of [`KC`] k and [`NC`] columns into panels of
//!   [`NR`] = 32 columns (two registers per pair of k);
//! - A is packed per [`MR`] rows (each row's words in a run when A has k
//!   contiguous, so packing is a plain conversion); the micro-kernel keeps
//!   an MR x 32 tile of C in 24 registers, and per pair of k loads two B
//!   registers and broadcasts one A word per row.
//!
//! Packing reads either layout of each operand (k contiguous, or the other
//! dimension contiguous), so `x . w^T`, `dy . w` and `dy^T . x` all pack
//! without a transposed copy.
//!
//! ```
//! use phalanx::ops::Mat;
//! if phalanx::ops::gemm_bf16::available() {
//!     let (a, b) = (vec![1f32, 2., 3., 4.], vec![1f32, 0., 0., 1.]); // (2, 2) each
//!     let mut c = vec![0f32; 4];
//!     let m = |d| Mat { data: d, rs: 2, cs: 1 };
//!     phalanx::ops::gemm_bf16::gemm(2, 2, 2, &mut c, 2, false, m(&a), m(&b));
//!     assert_eq!(c, a);
//! }
//! ```

use super::linear::Mat;
use std::cell::RefCell;

/// Rows of C per micro-kernel tile.
pub const MR: usize = 12;
/// Columns of C per micro-kernel tile (two registers of 16 f32).
pub const NR: usize = 32;
/// k per packed block (a B panel of 32 x KC bf16 is 16 KiB: L1).
pub const KC: usize = 256;
/// Columns per packed B block (KC x NC bf16 is 2 MiB: its panels stream from
/// L3 while a row tile's A stays in L1; wider blocks pack A fewer times).
pub const NC: usize = 4096;

/// Whether this CPU has AVX512-BF16 (and `PHALANX_BF16_GEMM` is not `0`).
pub fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PHALANX_BF16_GEMM").map_or(true, |v| v != "0") && detected())
}

#[cfg(target_arch = "x86_64")]
fn detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn detected() -> bool {
    false
}

/// Calls of [`gemm`] so far in this process (what a test checks a bf16
/// layer's products ran here).
static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products [`gemm`] has taken so far in this process.
pub fn calls() -> u64 {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    /// This thread's packed A and B (reused: no allocation per call).
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `dst (m, n) = [dst +] a (m, k) . b (k, n)` over bf16 products with f32
/// sums, on one thread; `dst` row-major with row stride `dst_rs`. Panics
/// when [`available`] is false or a view is too small.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
) {
    assert!(available(), "gemm_bf16: this CPU has no AVX512-BF16");
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !super::linear::checked("gemm_bf16", (m, n, k), dst, dst_rs, accumulate, a, b) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    PACKS.with(|p| {
        let (ap, bp) = &mut *p.borrow_mut();
        // SAFETY: the CPU has the features (asserted), every view's span
        // was checked above, and the packs are sized inside.
        unsafe { x86::gemm(m, n, k, dst, dst_rs, accumulate, a, b, ap, bp) }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Mat, KC, MR, NC, NR};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn gemm(
        m: usize,
        n: usize,
        k: usize,
        dst: &mut [f32],
        dst_rs: usize,
        accumulate: bool,
        a: Mat,
        b: Mat,
        ap: &mut Vec<u32>,
        bp: &mut Vec<u32>,
    ) {
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            let panels = nc.div_ceil(NR);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let kp = kc.div_ceil(2);
                // B block: `panels` panels of kp x NR words.
                bp.resize(panels * kp * NR, 0);
                for (j, panel) in bp.chunks_exact_mut(kp * NR).enumerate() {
                    let c0 = jc + j * NR;
                    let lanes = NR.min(jc + nc - c0);
                    // B (kk, c) = data[kk * rs + c * cs]: lanes are columns.
                    pack(
                        b.data,
                        c0 * b.cs + pc * b.rs,
                        b.cs,
                        b.rs,
                        lanes,
                        NR,
                        kc,
                        panel,
                    );
                }
                ap.resize(kp * MR, 0);
                let first = pc == 0 && !accumulate;
                // A with k contiguous (x . w^T, dy . w) packs row by row
                // (each row's words in a run); otherwise pair by pair.
                let by_rows = a.cs == 1 && a.rs != 1;
                for ic in (0..m).step_by(MR) {
                    let rows = MR.min(m - ic);
                    // A (r, kk) = data[r * rs + kk * cs]: lanes are rows.
                    let base = ic * a.rs + pc * a.cs;
                    if by_rows {
                        pack_runs(a.data, base, a.rs, rows, MR, kc, ap);
                    } else {
                        pack(a.data, base, a.rs, a.cs, rows, MR, kc, ap);
                    }
                    for (j, panel) in bp.chunks_exact(kp * NR).enumerate() {
                        let c0 = jc + j * NR;
                        let cols = NR.min(jc + nc - c0);
                        let c = dst.as_mut_ptr().add(ic * dst_rs + c0);
                        let t = (rows, cols, first);
                        if by_rows {
                            tile::<true>(kp, ap.as_ptr(), panel.as_ptr(), c, dst_rs, t);
                        } else {
                            tile::<false>(kp, ap.as_ptr(), panel.as_ptr(), c, dst_rs, t);
                        }
                    }
                }
            }
        }
    }

    /// `out[p * width + l]` = the bf16 pair (x(l, 2p), x(l, 2p + 1)) for
    /// lanes `l < lanes` and pairs `p < kc / 2` (rounded up), where
    /// x(l, kk) = src[base + l * ls + kk * ks]; lanes up to `width` and an
    /// odd k's last half are 0.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack(
        src: &[f32],
        base: usize,
        ls: usize,
        ks: usize,
        lanes: usize,
        width: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        let kp = kc.div_ceil(2);
        let out = &mut out[..kp * width];
        let s = src.as_ptr().add(base);
        if ls == 1 {
            // Lanes contiguous: two rows of k per pair, interleaved.
            let idx = interleave_index();
            for p in 0..kp {
                let row = s.add(2 * p * ks);
                let o = out.as_mut_ptr().add(p * width);
                for l0 in (0..width).step_by(16) {
                    let valid = lanes.saturating_sub(l0).min(16);
                    let mask: __mmask16 = if valid >= 16 { !0 } else { (1u16 << valid) - 1 };
                    let lo = _mm512_maskz_loadu_ps(mask, row.add(l0));
                    let hi = if 2 * p + 1 < kc {
                        _mm512_maskz_loadu_ps(mask, row.add(ks + l0))
                    } else {
                        _mm512_setzero_ps()
                    };
                    // (hi | lo) as 32 bf16, then lo0 hi0 lo1 hi1 ...
                    let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                    let w = _mm512_permutexvar_epi16(idx, h);
                    let n = (width - l0).min(16);
                    let m: __mmask16 = if n >= 16 { !0 } else { (1u16 << n) - 1 };
                    _mm512_mask_storeu_epi32(o.add(l0) as *mut _, m, w);
                }
            }
        } else if ks == 1 && width.is_multiple_of(16) {
            // k contiguous (B of x . w^T): 16 lanes x 16 pairs at a time,
            // converted in registers and transposed there.
            for l0 in (0..width).step_by(16) {
                let mut p0 = 0;
                while p0 + 16 <= kc / 2 {
                    let mut r = [_mm512_setzero_si512(); 16];
                    for (i, r) in r.iter_mut().enumerate() {
                        if l0 + i < lanes {
                            let run = s.add((l0 + i) * ls + 2 * p0);
                            let (lo, hi) = (_mm512_loadu_ps(run), _mm512_loadu_ps(run.add(16)));
                            *r = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(
                                hi, lo,
                            ));
                        }
                    }
                    for (j, t) in transpose16(r).iter().enumerate() {
                        let o = out.as_mut_ptr().add((p0 + j) * width + l0);
                        _mm512_storeu_si512(o as *mut _, *t);
                    }
                    p0 += 16;
                }
                for p in p0..kp {
                    for l in l0..l0 + 16 {
                        let w = if l < lanes {
                            pair(s.add(l * ls + 2 * p), 1, 2 * p + 1 < kc)
                        } else {
                            0
                        };
                        *out.get_unchecked_mut(p * width + l) = w;
                    }
                }
            }
        } else {
            for p in 0..kp {
                for l in 0..width {
                    let w = if l < lanes {
                        pair(s.add(l * ls + 2 * p * ks), ks, 2 * p + 1 < kc)
                    } else {
                        0
                    };
                    *out.get_unchecked_mut(p * width + l) = w;
                }
            }
        }
    }

    /// `out[l * kp + p]` = the bf16 pair (x(l, 2p), x(l, 2p + 1)) where
    /// x(l, kk) = src[base + l * ls + kk] (k contiguous): each lane's words
    /// in one run, converted 32 values at a time; lanes up to `width` and
    /// an odd k's last half are 0.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_runs(
        src: &[f32],
        base: usize,
        ls: usize,
        lanes: usize,
        width: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        let kp = kc.div_ceil(2);
        let out = &mut out[..kp * width];
        for (l, o) in out.chunks_exact_mut(kp).enumerate() {
            if l >= lanes {
                o.fill(0);
                continue;
            }
            let run = src.as_ptr().add(base + l * ls);
            let mut kk = 0;
            while kk + 32 <= kc {
                let lo = _mm512_loadu_ps(run.add(kk));
                let hi = _mm512_loadu_ps(run.add(kk + 16));
                let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(o.as_mut_ptr().add(kk / 2) as *mut _, h);
                kk += 32;
            }
            for (p, o) in o.iter_mut().enumerate().skip(kk / 2) {
                *o = pair(run.add(2 * p), 1, 2 * p + 1 < kc);
            }
        }
    }

    /// The 16 x 16 transpose of 32-bit words: `out[j]` word `i` = `r[i]`
    /// word `j` (interleave words, then pairs, then 128-bit lanes twice).
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut a = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // b[4g + c], 128-bit lane L: word 4L + c of rows 4g .. 4g + 4.
        let mut b = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
            b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
            b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
            b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let even01 = _mm512_shuffle_i32x4::<0x88>(b[c], b[4 + c]);
            let odd01 = _mm512_shuffle_i32x4::<0xDD>(b[c], b[4 + c]);
            let even23 = _mm512_shuffle_i32x4::<0x88>(b[8 + c], b[12 + c]);
            let odd23 = _mm512_shuffle_i32x4::<0xDD>(b[8 + c], b[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(even01, even23);
            out[8 + c] = _mm512_shuffle_i32x4::<0xDD>(even01, even23);
            out[4 + c] = _mm512_shuffle_i32x4::<0x88>(odd01, odd23);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(odd01, odd23);
        }
        out
    }

    /// The word of the bf16 pair (x[0], x[step]), rounded to nearest-even
    /// (as `vcvtne2ps2bf16`); the high half 0 without `hi` (an odd k's last
    /// pair).
    #[inline(always)]
    unsafe fn pair(x: *const f32, step: usize, hi: bool) -> u32 {
        let h = if hi { bf16_bits(*x.add(step)) } else { 0 };
        bf16_bits(*x) | (h << 16)
    }

    /// f32 to bf16 bits, rounded to nearest-even (as `vcvtne2ps2bf16`).
    fn bf16_bits(x: f32) -> u32 {
        half::bf16::from_f32(x).to_bits() as u32
    }

    /// `vpermw` index taking (hi | lo) to lo0 hi0 lo1 hi1 ... lo15 hi15.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn interleave_index() -> __m512i {
        let mut i = [0i16; 32];
        for q in 0..16 {
            i[2 * q] = q as i16;
            i[2 * q + 1] = 16 + q as i16;
        }
        _mm512_loadu_si512(i.as_ptr() as *const _)
    }

    /// One MR x NR tile of C over kp pairs: `c = [c +] a . b` for the first
    /// `rows` rows and `cols` columns (row stride `rs`); `(rows, cols,
    /// first)` in `t`, `first` overwriting C. A's word (r, p) is at
    /// `a[r * kp + p]` when `BY_ROWS` ([`pack_runs`]), else `a[p * MR + r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const BY_ROWS: bool>(
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        rs: usize,
        (rows, cols, first): (usize, usize, bool),
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        let (lane, step) = if BY_ROWS { (kp, 1) } else { (1, MR) };
        for p in 0..kp {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR) as *const _));
            let b1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16) as *const _));
            let ar = a.add(p * step);
            for (r, acc) in acc.iter_mut().enumerate() {
                let w: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ar.add(r * lane) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], w, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], w, b1);
            }
        }
        let m0: __mmask16 = if cols >= 16 { !0 } else { (1u16 << cols) - 1 };
        let m1: __mmask16 = if cols >= 32 {
            !0
        } else if cols > 16 {
            (1u16 << (cols - 16)) - 1
        } else {
            0
        };
        for (r, acc) in acc.iter().enumerate().take(rows) {
            let row = c.add(r * rs);
            for (h, (v, mask)) in [(acc[0], m0), (acc[1], m1)].into_iter().enumerate() {
                let p = row.add(16 * h);
                let v = if first {
                    v
                } else {
                    _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p))
                };
                _mm512_mask_storeu_ps(p, mask, v);
            }
        }
    }
}
