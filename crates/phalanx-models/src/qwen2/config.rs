//! Qwen2's presets (Llama-layer shapes with q / k / v biases):
//!
//! - `qwen2-tiny`: 4 layers, 4 query heads over 2 key/value heads, 128
//!   wide, MLP 352, byte vocabulary (256), context 128, tied head: 772,224
//!   parameters;
//! - `qwen2-0.5b`: Qwen2-0.5B's shapes (24 layers, 14 heads over 2 kv
//!   heads, 896 wide, MLP 4864, vocabulary 151936, tied): 494,032,768
//!   parameters, the count HF reports;
//! - `qwen2.5-1.5b`: Qwen2.5-1.5B's (28 layers, 12 heads over 2 kv heads,
//!   1536 wide, MLP 8960, vocabulary 151936, tied): 1,543,714,304.
//!
//! All with rotary θ 1e6, RMSNorm ε 1e-6, context 32768 for the real
//! shapes (`model.block_size` bounds a training sample; set it lower).
//!
//! ```
//! use phalanx_models::qwen2::config::preset;
//! assert_eq!(preset("qwen2-0.5b").unwrap().num_params(), 494_032_768);
//! assert_eq!(preset("qwen2.5-1.5b").unwrap().num_params(), 1_543_714_304);
//! assert_eq!(preset("qwen2-tiny").unwrap().num_params(), 772_224);
//! ```

use crate::llama::LlamaConfig;

/// The presets' names.
pub const PRESETS: [&str; 3] = ["qwen2-tiny", "qwen2-0.5b", "qwen2.5-1.5b"];

/// The default preset of `model.arch = "qwen2"`.
pub const DEFAULT_PRESET: &str = "qwen2-tiny";

/// The model of preset `name`: Llama's layer with q / k / v biases, θ 1e6,
/// ε 1e-6, tied head.
pub fn preset(name: &str) -> Option<LlamaConfig> {
    // Layers, heads, kv heads, width, MLP width, vocabulary, context.
    let (l, h, kv, c, m, v, t) = match name {
        "qwen2-tiny" => (4, 4, 2, 128, 352, 256, 128),
        "qwen2-0.5b" => (24, 14, 2, 896, 4864, 151936, 32768),
        "qwen2.5-1.5b" => (28, 12, 2, 1536, 8960, 151936, 32768),
        _ => return None,
    };
    Some(LlamaConfig {
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        qkv_bias: true,
        ..LlamaConfig::new(l, h, kv, c, m, v, t)
    })
}
