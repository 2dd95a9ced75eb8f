//! Hugging Face `config.json` for Qwen2 (`model_type = "qwen2"`,
//! `Qwen2ForCausalLM`): read with Qwen2's defaults (ε 1e-6, θ 10000, untied,
//! as `Qwen2Config` has them), checked against a model config, written;
//! and weights loaded with that check. Names and layout are Llama's plus
//! `model.layers.N.self_attn.{q,k,v}_proj.bias` ([`crate::llama::hf`]).
//!
//! Sliding-window attention (`use_sliding_window` with layers past
//! `max_window_layers`, or `layer_types` naming `sliding_attention`) and
//! activations other than SiLU are refused, never ignored.

use candle_core::{bail, Result};
use phalanx::engine::Engine;
use serde_json::{json, Value};
use std::path::Path;

use super::config::PRESETS;
use crate::family::HfKey;
use crate::llama::{hf_config, LlamaConfig};

/// The `config.json` with Qwen2's defaults for what it omits.
fn with_defaults(v: &Value) -> Result<Value> {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.entry("rms_norm_eps").or_insert(json!(1e-6));
    }
    // (rope_theta's default, 10000, is Llama's too: `hf_config::rope_theta`.)
    hf_config::rope_theta(&v)?;
    Ok(v)
}

/// Features of a `config.json` not built for Qwen2.
fn check_features(v: &Value) -> Result<()> {
    if let Some(a) = v.get("hidden_act").and_then(|x| x.as_str()) {
        if a != "silu" {
            bail!("config.json: hidden_act {a:?} is not built (only \"silu\")")
        }
    }
    let on = v.get("use_sliding_window").and_then(|x| x.as_bool()) == Some(true)
        && v.get("sliding_window").is_some_and(|w| !w.is_null());
    let int = |k: &str| v.get(k).and_then(|x| x.as_u64());
    let sliding = on
        && match v.get("layer_types").and_then(|x| x.as_array()) {
            Some(t) => t.iter().any(|t| t.as_str() == Some("sliding_attention")),
            None => int("max_window_layers") < int("num_hidden_layers"),
        };
    if sliding {
        bail!(
            "config.json: sliding-window attention (use_sliding_window with layers past \
             max_window_layers) is not built for model.arch = qwen2"
        )
    }
    Ok(())
}

/// Check an HF `config.json` against the model; errors name both keys.
pub fn check_config(v: &Value, cfg: &LlamaConfig) -> Result<()> {
    hf_config::check_model_type(v, "qwen2")?;
    hf_config::check_shape(&with_defaults(v)?, cfg, &PRESETS)?;
    check_features(v)
}

/// The `model.*` values a `config.json` gives (`arch` first).
pub fn hf_keys(v: &Value) -> Result<Vec<HfKey>> {
    let mut out = vec![HfKey::strict("arch", "model_type", "qwen2")];
    out.extend(hf_config::shape_keys(&with_defaults(v)?)?);
    check_features(v)?;
    Ok(out)
}

/// The model a `config.json` describes (`block_size` =
/// `max_position_embeddings`), checked.
pub fn config_from_json(v: &Value) -> Result<LlamaConfig> {
    let mut cfg = hf_config::shape_from_json(&with_defaults(v)?)?;
    cfg.qkv_bias = true;
    cfg.validate()?;
    check_config(v, &cfg)?;
    Ok(cfg)
}

/// HF's `config.json` for this model (what `Qwen2ForCausalLM.from_pretrained` opens).
pub fn config_json(cfg: &LlamaConfig, tokenizer: &str) -> Value {
    let mut v = hf_config::config_json(cfg, tokenizer);
    let o = v.as_object_mut().expect("an object");
    for k in ["attention_bias", "mlp_bias"] {
        o.remove(k);
    }
    o.insert("architectures".into(), json!(["Qwen2ForCausalLM"]));
    o.insert("model_type".into(), json!("qwen2"));
    o.insert("use_sliding_window".into(), json!(false));
    o.insert("sliding_window".into(), Value::Null);
    o.insert("max_window_layers".into(), json!(cfg.n_layer));
    v
}

/// Load HF Qwen2 weights (file, index or directory) into the engine; a
/// `config.json` beside them is checked against `cfg` first.
pub fn load(engine: &mut Engine, cfg: &LlamaConfig, path: impl AsRef<Path>) -> Result<()> {
    crate::llama::hf::load_with(engine, cfg, path.as_ref(), &check_config)
}
