//! Model presets: named shapes a user can start from.

use super::{ConfigError, ModelConfig};

/// (name, n_layer, n_head, n_embd, vocab_size, block_size)
pub const PRESETS: &[(&str, usize, usize, usize, usize, usize)] = &[
    // Trains visibly in a couple of minutes on 2 CPU cores (byte-level).
    ("gpt-tiny", 4, 4, 128, 256, 128),
    // About 10M parameters with a byte vocabulary.
    ("gpt-10m", 6, 6, 384, 256, 256),
    // About 57M parameters with a byte vocabulary (for "at least 50M" runs).
    ("gpt-50m", 8, 12, 768, 256, 256),
    // GPT-2 small, as released.
    ("gpt2-124m", 12, 12, 768, 50257, 1024),
];

/// Fill `m` with the named preset.
pub fn model_preset(name: &str, m: &mut ModelConfig) -> Result<(), ConfigError> {
    let p = PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
        ConfigError(format!(
            "unknown model.preset {name:?}; choose one of {names:?}"
        ))
    })?;
    m.preset = name.to_string();
    (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size) = (p.1, p.2, p.3, p.4, p.5);
    Ok(())
}
