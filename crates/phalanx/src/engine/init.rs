//! Deterministic parameter initialisation from candle-nn `Init` hints.
//!
//! Candle's own `Init::var` draws from an unseeded generator. Here every
//! parameter gets its own stream seeded by `(seed, name)`, so every rank (and
//! every run) computes the same initial weights without a broadcast, and a
//! parameter's values do not depend on which other parameters exist.
//!
//! ```
//! use phalanx::engine::init::fill;
//! let mut a = vec![0.0f32; 1000];
//! fill(&mut a, &[1000], &candle_nn::Init::Randn { mean: 0.0, stdev: 0.02 }, 7, "w");
//! let std = (a.iter().map(|x| x * x).sum::<f32>() / 1000.0).sqrt();
//! assert!((std - 0.02).abs() < 0.003);
//! ```

use candle_core::Shape;
use candle_nn::init::NormalOrUniform;
use candle_nn::Init;

/// SplitMix64: small, fast, good enough for weight init.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// FNV-1a of the parameter name, mixed into the seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Fill `out` (a parameter of `shape`) following `init`.
pub fn fill(out: &mut [f32], shape: &[usize], init: &Init, seed: u64, name: &str) {
    let mut rng = Rng(seed ^ name_hash(name));
    let normal = |rng: &mut Rng, out: &mut [f32], mean: f64, std: f64| {
        for x in out.iter_mut() {
            *x = (mean + std * rng.normal()) as f32;
        }
    };
    let uniform = |rng: &mut Rng, out: &mut [f32], lo: f64, up: f64| {
        for x in out.iter_mut() {
            *x = (lo + (up - lo) * rng.unit()) as f32;
        }
    };
    match *init {
        Init::Const(c) => out.fill(c as f32),
        Init::Randn { mean, stdev } => normal(&mut rng, out, mean, stdev),
        Init::Uniform { lo, up } => uniform(&mut rng, out, lo, up),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            // Same formula as candle-nn / PyTorch: std = gain / sqrt(fan).
            let fan = fan.for_shape(&Shape::from_dims(shape));
            let std = non_linearity.gain() / (fan as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => normal(&mut rng, out, 0.0, std),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, out, -bound, bound)
                }
            }
        }
    }
}
