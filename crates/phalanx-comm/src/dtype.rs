//! Element types that collectives carry, and the reduction operators.
//!
//! ```
//! use phalanx_comm::{Element, ReduceOp};
//! let mut acc = vec![1.0f32, 5.0];
//! f32::reduce_into(ReduceOp::Max, &mut acc, &[3.0, 2.0]);
//! assert_eq!(acc, vec![3.0, 5.0]);
//! ```

use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            _ => return None,
        })
    }
    pub(crate) fn code(self) -> u8 {
        self as u8
    }
}

/// Reduction operators. `Avg` sums then divides by the group size (integer
/// division for integer types), like `torch.distributed.ReduceOp.AVG`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
    pub fn parse(s: &str) -> Option<ReduceOp> {
        Some(match s {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            _ => return None,
        })
    }
    pub(crate) fn code(self) -> u8 {
        self as u8
    }
}

/// A type that can travel through a collective.
///
/// `reduce_into` combines `other` into `acc` elementwise; it is written as a
/// plain loop so the compiler vectorises it. Half types reduce in f32 and round
/// once per step, as gloo does.
pub trait Element: bytemuck::Pod + Send + Sync + 'static + std::fmt::Debug + PartialEq {
    const DTYPE: DType;
    fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]);
    /// Divide every element by `n` (the `Avg` epilogue).
    fn div_by(buf: &mut [Self], n: usize);
    /// A value derived from an integer, for tests and benchmark fills.
    fn from_i64(v: i64) -> Self;
    fn to_f64(self) -> f64;
}

/// The elementwise operations of [`ReduceOp`] on one scalar type.
///
/// Every rank must get bitwise the same result whichever order the
/// algorithm hands it the operands (recursive doubling reduces `(a, b)` on
/// one rank and `(b, a)` on its partner), so each operation is symmetric
/// down to the bits: a NaN wins over any number (two NaNs: the larger bit
/// pattern), `max(+0, -0)` is `+0` and `min(+0, -0)` is `-0` in either
/// order. Integer sums wrap (as in NCCL and MPI) rather than panic.
trait Scalar: Copy {
    fn add(self, other: Self) -> Self;
    fn max_of(self, other: Self) -> Self;
    fn min_of(self, other: Self) -> Self;
}

macro_rules! int_scalar {
    ($t:ty) => {
        impl Scalar for $t {
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn max_of(self, other: Self) -> Self {
                Ord::max(self, other)
            }
            fn min_of(self, other: Self) -> Self {
                Ord::min(self, other)
            }
        }
    };
}

int_scalar!(i32);
int_scalar!(i64);

macro_rules! float_scalar {
    ($t:ty) => {
        impl Scalar for $t {
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn max_of(self, other: Self) -> Self {
                if self > other {
                    self
                } else if other > self {
                    other
                } else {
                    // Equal (only ±0 differ in bits) or unordered (NaN).
                    tie(self, other, false)
                }
            }
            fn min_of(self, other: Self) -> Self {
                if self < other {
                    self
                } else if other < self {
                    other
                } else {
                    tie(self, other, true)
                }
            }
        }

        impl Tie for $t {
            fn nan(self) -> bool {
                self.is_nan()
            }
            fn negative(self) -> bool {
                self.is_sign_negative()
            }
            fn bits(self) -> u64 {
                self.to_bits() as u64
            }
        }
    };
}

float_scalar!(f32);
float_scalar!(f64);

/// What [`tie`] needs to know of a float.
trait Tie: Copy {
    fn nan(self) -> bool;
    fn negative(self) -> bool;
    fn bits(self) -> u64;
}

/// Max (or min, `min`) of two floats that compare neither greater nor
/// less, the same whichever comes first: a NaN wins, between two NaNs the
/// larger bit pattern; of two equal values (`+0` and `-0`), max takes the
/// positive and min the negative.
fn tie<F: Tie>(a: F, b: F, min: bool) -> F {
    match (a.nan(), b.nan()) {
        (true, false) => a,
        (false, true) => b,
        (true, true) => {
            if a.bits() >= b.bits() {
                a
            } else {
                b
            }
        }
        (false, false) => {
            if a.negative() == min {
                a
            } else {
                b
            }
        }
    }
}

/// `acc[i] = f(acc[i], other[i])`: a plain loop the compiler vectorises.
fn combine<S: Scalar>(acc: &mut [S], other: &[S], f: impl Fn(S, S) -> S) {
    debug_assert_eq!(acc.len(), other.len());
    for (a, b) in acc.iter_mut().zip(other) {
        *a = f(*a, *b);
    }
}

/// `reduce_into` for a type that reduces in itself.
fn reduce_scalars<S: Scalar>(op: ReduceOp, acc: &mut [S], other: &[S]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => combine(acc, other, S::add),
        ReduceOp::Max => combine(acc, other, S::max_of),
        ReduceOp::Min => combine(acc, other, S::min_of),
    }
}

macro_rules! native_element {
    ($t:ty, $dt:expr, $div:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                reduce_scalars(op, acc, other);
            }
            fn div_by(buf: &mut [Self], n: usize) {
                let div: fn(Self, usize) -> Self = $div;
                for a in buf.iter_mut() {
                    *a = div(*a, n);
                }
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

native_element!(f32, DType::F32, |a, n| a / n as f32);
native_element!(f64, DType::F64, |a, n| a / n as f64);
native_element!(i32, DType::I32, |a, n| a / n as i32);
native_element!(i64, DType::I64, |a, n| a / n as i64);

macro_rules! half_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                // In f32, whose max/min are symmetric (see `Scalar`); the
                // rounding back is a function of the f32, so the result is
                // too.
                let f: fn(f32, f32) -> f32 = match op {
                    ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
                    ReduceOp::Max => f32::max_of,
                    ReduceOp::Min => f32::min_of,
                };
                for (a, b) in acc.iter_mut().zip(other) {
                    *a = <$t>::from_f32(f(a.to_f32(), b.to_f32()));
                }
            }
            fn div_by(buf: &mut [Self], n: usize) {
                for a in buf.iter_mut() {
                    *a = <$t>::from_f32(a.to_f32() / n as f32);
                }
            }
            fn from_i64(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
        }
    };
}

half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

#[cfg(test)]
mod tests {
    use super::*;

    /// `op(a, b)` and `op(b, a)`, as bits, for every pair of `vals`. (Not
    /// sums of two NaNs: the hardware keeps the first one's payload.)
    fn assert_symmetric<T: Element>(vals: &[T], bits: fn(T) -> u64) {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            for &a in vals {
                for &b in vals {
                    let (mut ab, mut ba) = ([a], [b]);
                    T::reduce_into(op, &mut ab, &[b]);
                    T::reduce_into(op, &mut ba, &[a]);
                    assert_eq!(
                        bits(ab[0]),
                        bits(ba[0]),
                        "{op:?}({a:?}, {b:?}) differs from {op:?}({b:?}, {a:?})"
                    );
                }
            }
        }
    }

    #[test]
    fn max_and_min_are_symmetric_down_to_the_bits() {
        let other_nan = f32::from_bits(f32::NAN.to_bits() | 1);
        let f = [
            1.0f32,
            -1.0,
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            other_nan,
            f32::INFINITY,
        ];
        assert_symmetric(&f, |v| v.to_bits() as u64);
        let d = f.map(|v| v as f64);
        assert_symmetric(&d, f64::to_bits);
        let h = f.map(f16::from_f32);
        assert_symmetric(&h, |v| v.to_bits() as u64);
        let b = f.map(bf16::from_f32);
        assert_symmetric(&b, |v| v.to_bits() as u64);
    }

    #[test]
    fn nan_wins_and_signed_zeros_order() {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let mut x = [1.0f32, f32::NAN];
            f32::reduce_into(op, &mut x, &[f32::NAN, 1.0]);
            assert!(x.iter().all(|v| v.is_nan()), "{op:?}: {x:?}");
            let mut h = [f16::ONE];
            f16::reduce_into(op, &mut h, &[f16::NAN]);
            assert!(h[0].is_nan(), "{op:?}: {h:?}");
        }
        let mut mx = [0.0f32, -0.0];
        f32::reduce_into(ReduceOp::Max, &mut mx, &[-0.0, 0.0]);
        assert_eq!(mx.map(f32::to_bits), [0.0f32.to_bits(); 2]);
        let mut mn = [0.0f64, -0.0];
        f64::reduce_into(ReduceOp::Min, &mut mn, &[-0.0, 0.0]);
        assert_eq!(mn.map(f64::to_bits), [(-0.0f64).to_bits(); 2]);
    }

    #[test]
    fn integer_sums_wrap_instead_of_panicking() {
        let mut a = [i32::MAX, i32::MIN];
        i32::reduce_into(ReduceOp::Sum, &mut a, &[1, -1]);
        assert_eq!(a, [i32::MIN, i32::MAX]);
        let mut b = [i64::MAX];
        i64::reduce_into(ReduceOp::Avg, &mut b, &[2]);
        assert_eq!(b, [i64::MIN + 1]);
        assert_symmetric(&[i32::MAX, i32::MIN, 0, -1], |v| v as u64);
        let mut c = [i32::MAX, 5];
        i32::reduce_into(ReduceOp::Sum, &mut c, &[i32::MAX, -7]);
        assert_eq!(c, [-2, -2]);
    }
}
