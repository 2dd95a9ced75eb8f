//! Mixed precision and activation memory: the `train.precision`,
//! `train.reduce_dtype` and `train.activation_checkpointing` keys, and
//! DeepSpeed's `fp16`, `bf16` and `activation_checkpointing` sections.
//!
//! ```
//! use phalanx::config::{Precision, Recompute};
//! assert_eq!("bfloat16".parse::<Precision>().unwrap(), Precision::Bf16);
//! assert_eq!(Precision::Fp16.dtype(), candle_core::DType::F16);
//! let r: Recompute = "3".parse().unwrap();
//! assert!(r.recomputes(0) && !r.recomputes(1) && r.recomputes(3));
//! assert_eq!("1".parse::<Recompute>().unwrap(), Recompute::Full);
//! assert!("0".parse::<Recompute>().is_err());
//! ```

use serde::{Deserialize, Serialize};

/// The dtype a run computes in (`train.precision`) or reduces gradients in
/// (`train.reduce_dtype`). Master weights and optimizer state stay fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    #[serde(alias = "float32")]
    Fp32,
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "float16", alias = "half")]
    Fp16,
}

impl Precision {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Precision::Fp32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::Fp16 => candle_core::DType::F16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "float16" | "half" => Ok(Precision::Fp16),
            other => Err(format!("{other:?} is not a precision (fp32, bf16 or fp16)")),
        }
    }
}

/// Activation checkpointing policy: which blocks keep only their input in
/// forward and recompute their activations in backward.
///
/// `Every(k)` recomputes every k-th block counting from block 0, i.e. the
/// blocks with `block % k == 0` (0, k, 2k, ...): `ceil(n_layer / k)` blocks.
/// `Every(1)` is `Full` (and parses as `Full`); `Every(0)` is invalid.
///
/// In TOML and `--set` it is `"none"`, `"full"` or an integer k (also as a
/// string, `"2"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    #[default]
    None,
    Full,
    Every(usize),
}

impl Recompute {
    /// Whether block `block` (0-based) is recomputed in backward.
    pub fn recomputes(&self, block: usize) -> bool {
        match *self {
            Recompute::None => false,
            Recompute::Full => true,
            Recompute::Every(k) => k > 0 && block.is_multiple_of(k),
        }
    }

    /// `Every(1)` is `Full`; everything else is already normal.
    fn normal(self) -> Recompute {
        match self {
            Recompute::Every(1) => Recompute::Full,
            r => r,
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().trim_matches('"').to_ascii_lowercase();
        match t.as_str() {
            "none" | "false" | "off" => Ok(Recompute::None),
            "full" | "true" | "all" => Ok(Recompute::Full),
            n => match n.parse::<usize>() {
                Ok(0) => Err("0 is not a block interval (use \"none\" to turn it off)".into()),
                Ok(k) => Ok(Recompute::Every(k).normal()),
                Err(_) => Err(format!(
                    "{s:?} is not \"none\", \"full\" or a block interval k >= 1"
                )),
            },
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Full => f.write_str("full"),
            Recompute::Every(k) => write!(f, "{k}"),
        }
    }
}

impl Serialize for Recompute {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Recompute::Every(k) => s.serialize_u64(k as u64),
            r => s.serialize_str(&r.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Recompute;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"none\", \"full\" or a block interval k >= 1")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Recompute, E> {
                v.parse()
                    .map_err(|e| E::custom(format!("train.activation_checkpointing: {e}")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Recompute, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Recompute, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Recompute, E> {
                Ok(if v { Recompute::Full } else { Recompute::None })
            }
        }
        d.deserialize_any(V)
    }
}

/// DeepSpeed's `fp16` section: fp16 compute with a loss scale.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Fp16Section {
    pub enabled: bool,
    /// A static loss scale; 0 means dynamic loss scaling.
    pub loss_scale: f64,
    /// The dynamic scale starts at 2^initial_scale_power.
    pub initial_scale_power: u32,
    /// Steps without overflow before the dynamic scale doubles.
    pub loss_scale_window: usize,
    /// Overflows tolerated before the scale is halved.
    pub hysteresis: usize,
    /// The dynamic scale never goes below this.
    pub min_loss_scale: f64,
}

impl Default for Fp16Section {
    fn default() -> Self {
        Fp16Section {
            enabled: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}

impl Fp16Section {
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.hysteresis < 1 {
            return Err("fp16.hysteresis must be at least 1".into());
        }
        if self.loss_scale_window < 1 {
            return Err("fp16.loss_scale_window must be at least 1".into());
        }
        // The same bounds a checkpoint's loss scaler is held to (a run
        // must be able to resume what it saves); a scale is an f32 factor.
        const MAX_COUNT: usize = 1 << 40;
        if self.hysteresis > MAX_COUNT || self.loss_scale_window > MAX_COUNT {
            return Err(format!(
                "fp16.hysteresis ({}) and fp16.loss_scale_window ({}) must be at most 2^40",
                self.hysteresis, self.loss_scale_window
            ));
        }
        let max = f32::MAX as f64;
        if !(self.min_loss_scale > 0.0 && self.min_loss_scale <= max) {
            return Err(format!(
                "fp16.min_loss_scale must be a positive f32 number, not {}",
                self.min_loss_scale
            ));
        }
        if !(self.loss_scale >= 0.0 && self.loss_scale <= max) {
            return Err(format!(
                "fp16.loss_scale must be 0 (dynamic) or a positive f32 number, not {}",
                self.loss_scale
            ));
        }
        if self.initial_scale_power > 127 {
            return Err(format!(
                "fp16.initial_scale_power {} overflows f32",
                self.initial_scale_power
            ));
        }
        Ok(())
    }
}

/// DeepSpeed's `bf16` section.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Bf16Section {
    pub enabled: bool,
}

/// DeepSpeed's `activation_checkpointing` section. Which blocks are
/// recomputed is `train.activation_checkpointing`; these say where the saved
/// block inputs live.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointingSection {
    /// Shard the saved block inputs across the tensor-parallel ranks.
    pub partition_activations: bool,
    /// Keep the saved block inputs in host memory.
    pub cpu_checkpointing: bool,
}
