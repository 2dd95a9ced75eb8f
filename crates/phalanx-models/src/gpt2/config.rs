//! GPT-2 hyper-parameters and presets.
//!
//! - `gpt-tiny`: 4 layers, 4 heads, 128 wide, byte vocabulary (256), context
//!   128: ~0.84M parameters, trains visibly in a couple of minutes on 2 cores.
//! - `gpt2-124m`: the original GPT-2 small (12/12/768, 50257, 1024).
//!
//! ```
//! use phalanx_models::gpt2::Gpt2Config;
//! let c = Gpt2Config::preset("gpt2-124m").unwrap();
//! assert_eq!(c.num_params(), 124_439_808); // HF's count, wte tied with lm_head
//! ```

use candle_core::{bail, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt2Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    /// Context length (number of learned positions).
    pub block_size: usize,
}

impl Gpt2Config {
    pub const PRESETS: [&'static str; 2] = ["gpt-tiny", "gpt2-124m"];

    pub fn gpt_tiny() -> Self {
        Self::new(4, 4, 128, 256, 128)
    }

    pub fn gpt2_124m() -> Self {
        Self::new(12, 12, 768, 50257, 1024)
    }

    pub fn new(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        vocab_size: usize,
        block_size: usize,
    ) -> Self {
        Self {
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            block_size,
        }
    }

    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "gpt-tiny" => Ok(Self::gpt_tiny()),
            "gpt2-124m" | "gpt2" => Ok(Self::gpt2_124m()),
            _ => bail!("unknown GPT-2 preset `{name}` (known: {:?})", Self::PRESETS),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    pub fn validate(&self) -> Result<()> {
        if self.n_layer == 0 || self.n_head == 0 || self.vocab_size == 0 || self.block_size == 0 {
            bail!("GPT-2 config has a zero size: {self:?}")
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            bail!(
                "n_embd {} is not divisible by n_head {}",
                self.n_embd,
                self.n_head
            )
        }
        Ok(())
    }

    /// Parameters, counting the tied wte/lm_head once.
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        let per_layer = 2 * 2 * c        // ln_1, ln_2
            + 3 * c * c + 3 * c          // attn.c_attn
            + c * c + c                  // attn.c_proj
            + 4 * c * c + 4 * c          // mlp.c_fc
            + 4 * c * c + c; // mlp.c_proj
        self.vocab_size * c + self.block_size * c + l * per_layer + 2 * c
    }
}
