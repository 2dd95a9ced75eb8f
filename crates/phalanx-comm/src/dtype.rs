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

macro_rules! native_element {
    ($t:ty, $dt:expr, $div:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                debug_assert_eq!(acc.len(), other.len());
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (a, b) in acc.iter_mut().zip(other) {
                            *a += *b;
                        }
                    }
                    ReduceOp::Max => {
                        for (a, b) in acc.iter_mut().zip(other) {
                            if *b > *a {
                                *a = *b;
                            }
                        }
                    }
                    ReduceOp::Min => {
                        for (a, b) in acc.iter_mut().zip(other) {
                            if *b < *a {
                                *a = *b;
                            }
                        }
                    }
                }
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
                let f: fn(f32, f32) -> f32 = match op {
                    ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
                    ReduceOp::Max => |a, b| if b > a { b } else { a },
                    ReduceOp::Min => |a, b| if b < a { b } else { a },
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
