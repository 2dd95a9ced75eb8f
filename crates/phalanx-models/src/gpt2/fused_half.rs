//! The fused GPT-2 layer's dtype boundary (see [`super::fused`]): f16 and
//! bf16 data widened to f32 for its kernels, f32 results narrowed back,
//! and the activations it keeps, in f32 or half precision.
//!
//! Activations are kept in the layer's dtype. Measured on gpt-10m's six
//! layers (forward and backward, B 8, T 256, 2 threads, median ms): fp32
//! 922; bf16 952 kept in half vs 902 kept in f32; f16 954 vs 946 (whole
//! training steps: bf16 3-4% slower kept in half, f16 ~1%). Half storage
//! costs a few percent and takes 2 bytes per value instead of 4 (a
//! training step's peak RSS: 550 MiB, against 683 MiB kept in f32 and
//! 658 MiB for fp32), so half it is; the backward then reads the rounded
//! values, as the composed layer's does.
//!
//! That price depends on where the conversions run: each batch part
//! converts the activations and the layer's input and output on its own
//! thread, next to the kernel that produces or reads them ([`Src::get`],
//! [`Dst::store`]), while the rows are still in cache. Converting whole
//! buffers between the passes cost a trip to memory each way: 7% (bf16
//! 1022 vs 953 ms). The W pass's inputs and the parameters are widened
//! whole, in parallel, where they are used ([`Src::wide`]). Every buffer
//! comes from the thread's pool (`phalanx::ops::buffers`), so a steady
//! step takes no fresh pages for them. For f32 nothing is copied.

use crate::common::direct::{convert, pieces, Wide};
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};
use phalanx::ops::buffers::{self, Buf, HalfBuf};
use phalanx::ops::cpu;

/// Float data of the layer's dtype, borrowed.
#[derive(Clone, Copy)]
pub(super) enum Src<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Src<'a> {
    /// The elements of a contiguous CPU storage under `l`.
    pub(super) fn of(s: &'a CpuStorage, l: &Layout) -> Result<Self> {
        let Some((lo, hi)) = l.contiguous_offsets() else {
            bail!("fused GPT-2 layer: expected a contiguous tensor")
        };
        Ok(match s {
            CpuStorage::F32(v) => Src::F32(&v[lo..hi]),
            CpuStorage::BF16(v) => Src::BF16(&v[lo..hi]),
            CpuStorage::F16(v) => Src::F16(&v[lo..hi]),
            _ => bail!("fused GPT-2 layer: f32, bf16 or f16 tensors only"),
        })
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Src::F32(v) => v.len(),
            Src::BF16(v) => v.len(),
            Src::F16(v) => v.len(),
        }
    }

    /// An f32 scratch buffer for [`Src::get`]: empty for f32 data.
    pub(super) fn scratch(&self) -> Buf {
        match self {
            Src::F32(_) => Buf::default(),
            _ => buffers::take(self.len()),
        }
    }

    /// `parts` equal pieces.
    pub(super) fn pieces(self, parts: usize) -> Vec<Src<'a>> {
        let len = self.len() / parts;
        match self {
            Src::F32(v) => v.chunks(len).map(Src::F32).collect(),
            Src::BF16(v) => v.chunks(len).map(Src::BF16).collect(),
            Src::F16(v) => v.chunks(len).map(Src::F16).collect(),
        }
    }

    /// As f32: borrowed, or widened into `scratch` (of the same length).
    pub(super) fn get<'b>(&self, scratch: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            Src::F32(v) => v,
            Src::BF16(v) => {
                cpu::bf16_to_f32(v, scratch);
                scratch
            }
            Src::F16(v) => {
                cpu::f16_to_f32(v, scratch);
                scratch
            }
        }
    }

    /// As f32, whole: borrowed, or widened into a pooled buffer in parallel.
    pub(super) fn wide(&self) -> Wide<'a> {
        let mut out = self.scratch();
        match *self {
            Src::F32(v) => return Wide::Borrowed(v),
            Src::BF16(v) => convert(v, &mut out, cpu::bf16_to_f32),
            Src::F16(v) => convert(v, &mut out, cpu::f16_to_f32),
        }
        Wide::Pooled(out)
    }
}

/// A half-precision destination: a part's rows of a kept activation or of
/// the layer's output.
pub(super) enum Dst<'a> {
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl Dst<'_> {
    /// Stores `v` rounded to nearest even.
    pub(super) fn store(&mut self, v: &[f32]) {
        match self {
            Dst::BF16(d) => cpu::f32_to_bf16(v, d),
            Dst::F16(d) => cpu::f32_to_f16(v, d),
        }
    }
}

/// Stores `v` into `d` when there is one (half precision).
pub(super) fn store(d: &mut Option<Dst>, v: &[f32]) {
    if let Some(d) = d {
        d.store(v)
    }
}

/// A CPU tensor's data (contiguous; f32, f16 or bf16), for `f`.
pub(super) fn with_src<R>(t: &Tensor, f: impl FnOnce(Src) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(s) => f(Src::of(s, l)?),
        _ => bail!("fused GPT-2 layer: tensors must be on the CPU"),
    }
}

/// A tensor of `dtype` from f32 values (narrowed in parallel for half).
pub(super) fn tensor(dtype: DType, v: Vec<f32>, shape: &Shape, dev: &Device) -> Result<Tensor> {
    let s = match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => {
            let mut out = vec![bf16::ZERO; v.len()];
            convert(&v, &mut out, cpu::f32_to_bf16);
            CpuStorage::BF16(out)
        }
        DType::F16 => {
            let mut out = vec![f16::ZERO; v.len()];
            convert(&v, &mut out, cpu::f32_to_f16);
            CpuStorage::F16(out)
        }
        d => bail!("fused GPT-2 layer: cannot narrow f32 results to {d:?}"),
    };
    cpu::tensor_of(s, shape, dev)
}

/// The layer's output (y, or dx) in its dtype: f32 written in place, or
/// computed into a pooled f32 buffer and narrowed part by part.
pub(super) enum Output {
    F32(Vec<f32>),
    BF16(Vec<bf16>, Buf),
    F16(Vec<f16>, Buf),
}

impl Output {
    pub(super) fn new(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Output::F32(vec![0f32; len]),
            DType::BF16 => Output::BF16(vec![bf16::ZERO; len], buffers::take(len)),
            DType::F16 => Output::F16(vec![f16::ZERO; len], buffers::take(len)),
            d => bail!("fused GPT-2 layer: {d:?} is not supported"),
        })
    }

    /// Each part's f32 rows, and where they are narrowed to (half).
    pub(super) fn pieces(&mut self, parts: usize) -> Vec<(&mut [f32], Option<Dst<'_>>)> {
        match self {
            Output::F32(v) => pieces(v, parts).into_iter().map(|v| (v, None)).collect(),
            Output::BF16(h, f) => pieces(f, parts)
                .into_iter()
                .zip(pieces(h, parts))
                .map(|(f, h)| (f, Some(Dst::BF16(h))))
                .collect(),
            Output::F16(h, f) => pieces(f, parts)
                .into_iter()
                .zip(pieces(h, parts))
                .map(|(f, h)| (f, Some(Dst::F16(h))))
                .collect(),
        }
    }

    /// The values (every part stored).
    pub(super) fn storage(self) -> CpuStorage {
        match self {
            Output::F32(v) => CpuStorage::F32(v),
            Output::BF16(h, _) => CpuStorage::BF16(h),
            Output::F16(h, _) => CpuStorage::F16(h),
        }
    }
}

/// An activation kept for the backward: f32, or half precision.
pub(super) enum Kept {
    F32(Buf),
    BF16(HalfBuf<bf16>),
    F16(HalfBuf<f16>),
}

impl Kept {
    /// A half buffer of `len` for `dtype`, f16 or else bf16 (for f32 the
    /// forward's own f32 buffer is kept).
    pub(super) fn half(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F16 => Kept::F16(buffers::take_half(len)),
            _ => Kept::BF16(buffers::take_half(len)),
        }
    }

    /// `parts` destinations, a part's rows each (half buffers only).
    pub(super) fn dsts(&mut self, parts: usize) -> Vec<Dst<'_>> {
        match self {
            Kept::F32(_) => unreachable!("f32 activations are written in place"),
            Kept::BF16(h) => pieces(h, parts).into_iter().map(Dst::BF16).collect(),
            Kept::F16(h) => pieces(h, parts).into_iter().map(Dst::F16).collect(),
        }
    }

    pub(super) fn src(&self) -> Src<'_> {
        match self {
            Kept::F32(b) => Src::F32(b),
            Kept::BF16(h) => Src::BF16(h),
            Kept::F16(h) => Src::F16(h),
        }
    }

    /// The bytes it holds.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Kept::F32(b) => 4 * b.len(),
            Kept::BF16(h) => h.bytes(),
            Kept::F16(h) => h.bytes(),
        }
    }
}
