//! Hugging Face `config.json` for Llama: reading (transformers 4 and 5
//! spellings), checking against a model config, writing.
//!
//! A different shape is an error naming both keys (`config.json has
//! num_key_value_heads = 2 but model.n_kv_head = 4`); features not built
//! (a rope scaling other than Llama 3's, biases, an activation other than
//! SiLU) are refused, never ignored.

use candle_core::{bail, Result};
use serde_json::{json, Value};

use super::config::{LlamaConfig, RopeScaling};
use crate::family::HfKey;

/// transformers' `LlamaConfig` default, for a `config.json` that omits
/// `rms_norm_eps` (Phalanx's own presets use Llama's 1e-5 and always write it).
const HF_RMS_NORM_EPS: f64 = 1e-6;

/// Check an HF `config.json` against the model; errors name both keys.
pub fn check_config(v: &Value, cfg: &LlamaConfig) -> Result<()> {
    check_model_type(v, "llama")?;
    check_shape(v, cfg, &LlamaConfig::PRESETS)?;
    check_features(v)
}

/// An error unless `config.json`'s `model_type` (when given) is `want`.
pub fn check_model_type(v: &Value, want: &str) -> Result<()> {
    if let Some(t) = v.get("model_type").and_then(|t| t.as_str()) {
        if t != want {
            bail!("config.json: model_type {t:?}, not {want:?}")
        }
    }
    Ok(())
}

/// Check the shape a `config.json` gives (Llama's layer: sizes, rotary,
/// eps, tied head) against the model; errors name both keys and the
/// `presets` of that shape.
pub fn check_shape(v: &Value, cfg: &LlamaConfig, presets: &[&str]) -> Result<()> {
    let int = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
    let heads = int("num_attention_heads");
    let pairs = [
        (
            "num_hidden_layers",
            int("num_hidden_layers"),
            cfg.n_layer,
            "n_layer",
        ),
        ("num_attention_heads", heads, cfg.n_head, "n_head"),
        // HF's default: as many kv heads as heads.
        (
            "num_key_value_heads",
            int("num_key_value_heads").or(heads),
            cfg.n_kv_head,
            "n_kv_head",
        ),
        ("hidden_size", int("hidden_size"), cfg.n_embd, "n_embd"),
        (
            "intermediate_size",
            int("intermediate_size"),
            cfg.intermediate_size,
            "intermediate_size",
        ),
        (
            "vocab_size",
            int("vocab_size"),
            cfg.vocab_size,
            "vocab_size",
        ),
        (
            "head_dim",
            int("head_dim"),
            cfg.head_dim(),
            "head_dim (or n_embd / n_head)",
        ),
    ];
    for (theirs, got, ours, key) in pairs {
        if let Some(g) = got {
            if g != ours {
                bail!(
                    "config.json has {theirs} = {g} but model.{key} = {ours} \
                     (set the model.* keys to the checkpoint's, or a preset of its shape: {presets:?})"
                )
            }
        }
    }
    let float = |k: &str| v.get(k).and_then(|x| x.as_f64());
    let theta = rope_theta(v)?;
    for (theirs, got, ours, key) in [
        ("rope_theta", Some(theta), cfg.rope_theta, "rope_theta"),
        (
            "rms_norm_eps",
            Some(float("rms_norm_eps").unwrap_or(HF_RMS_NORM_EPS)),
            cfg.rms_norm_eps,
            "rms_norm_eps",
        ),
    ] {
        if let Some(g) = got {
            if (g - ours).abs() > 1e-12 * g.abs().max(1.0) {
                bail!(
                    "config.json has {theirs} = {g} but model.{key} = {ours} \
                     (set the model.* keys to the checkpoint's, or a preset of its shape: {presets:?})"
                )
            }
        }
    }
    let scaling = rope_scaling(v)?;
    if scaling != cfg.rope_scaling {
        bail!(
            "config.json has rope scaling {scaling:?} but the model config has {:?} \
             (model.rope_scaling and the model.rope_* keys)",
            cfg.rope_scaling
        )
    }
    // HF's default is false for Llama.
    let tie = v
        .get("tie_word_embeddings")
        .and_then(|x| x.as_bool())
        .unwrap_or(false);
    if tie != cfg.tie_word_embeddings {
        bail!(
            "config.json has tie_word_embeddings = {tie} but model.tie_word_embeddings = {}",
            cfg.tie_word_embeddings
        )
    }
    Ok(())
}

/// Features of a `config.json` not built for Llama: another activation,
/// biases.
fn check_features(v: &Value) -> Result<()> {
    if let Some(a) = v.get("hidden_act").and_then(|x| x.as_str()) {
        if a != "silu" {
            bail!("config.json: hidden_act {a:?} is not built (only \"silu\")")
        }
    }
    for k in ["attention_bias", "mlp_bias"] {
        if v.get(k).and_then(|x| x.as_bool()) == Some(true) {
            bail!("config.json: {k} = true is not built for Llama-family models yet")
        }
    }
    Ok(())
}

/// HF's `rope_theta` when a `config.json` leaves it out (LlamaConfig's and
/// Qwen2Config's default; Llama 2's files have none).
const HF_ROPE_THETA: f64 = 10000.0;

/// rope_theta from a `config.json`: top-level (transformers 4) or in
/// `rope_parameters` (transformers 5), else HF's default; refuses a
/// scaling not built (see [`rope_scaling`]).
pub fn rope_theta(v: &Value) -> Result<f64> {
    rope_scaling(v)?;
    fn some(x: Option<&Value>) -> Option<&Value> {
        x.filter(|x| !x.is_null())
    }
    let rp = some(v.get("rope_parameters"));
    match some(v.get("rope_theta")).or_else(|| some(rp.and_then(|r| r.get("rope_theta")))) {
        None => Ok(HF_ROPE_THETA),
        Some(x) => match x.as_f64() {
            Some(t) => Ok(t),
            None => bail!("config.json: rope_theta {x} is not a number"),
        },
    }
}

/// The rotary scaling of a `config.json`: transformers 4's `rope_scaling`
/// or transformers 5's `rope_parameters`; `"default"` (or none) and
/// `"llama3"` are built, any other `rope_type` is refused.
pub fn rope_scaling(v: &Value) -> Result<RopeScaling> {
    let p = v
        .get("rope_scaling")
        .filter(|x| !x.is_null())
        .or_else(|| v.get("rope_parameters").filter(|x| !x.is_null()));
    let Some(p) = p else {
        return Ok(RopeScaling::None);
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(RopeScaling::None),
        "llama3" => {
            let f = |k: &str| {
                p.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "config.json: rope_scaling llama3 without `{k}`"
                    ))
                })
            };
            Ok(RopeScaling::Llama3 {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position: f("original_max_position_embeddings")? as usize,
            })
        }
        t => bail!(
            "config.json: rope_scaling of rope_type {t:?} is not built for Llama-family models yet \
             (\"default\" and \"llama3\" are)"
        ),
    }
}

/// The `model.*` values an HF `config.json` gives (`arch` first; the
/// context, `max_position_embeddings`, is not fixed by the weights);
/// features not built are refused as in [`check_config`].
pub fn hf_keys(v: &Value) -> Result<Vec<HfKey>> {
    let mut out = vec![HfKey::strict("arch", "model_type", "llama")];
    out.extend(shape_keys(v)?);
    check_features(v)?;
    Ok(out)
}

/// The `model.*` values of the shape a `config.json` gives (Llama's
/// layer); refuses a rope scaling not built.
pub fn shape_keys(v: &Value) -> Result<Vec<HfKey>> {
    let mut out = Vec::new();
    if let Some(d) = explicit_head_dim(v) {
        out.push(HfKey::strict("head_dim", "head_dim", d as i64));
    }
    let int = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as i64);
    let heads = int("num_attention_heads");
    for (ours, theirs) in [
        ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"),
        ("n_kv_head", "num_key_value_heads"),
        ("n_embd", "hidden_size"),
        ("intermediate_size", "intermediate_size"),
        ("vocab_size", "vocab_size"),
    ] {
        // HF's default: as many kv heads as heads.
        let got = match theirs {
            "num_key_value_heads" => int(theirs).or(heads),
            _ => int(theirs),
        };
        if let Some(n) = got {
            out.push(HfKey::strict(ours, theirs, n));
        }
    }
    if let Some(n) = int("max_position_embeddings") {
        out.push(HfKey::soft("block_size", "max_position_embeddings", n));
        // Kept for the export when training at a shorter block_size.
        out.push(HfKey::soft(
            "max_position_embeddings",
            "max_position_embeddings",
            n,
        ));
    }
    out.push(HfKey::strict("rope_theta", "rope_theta", rope_theta(v)?));
    let eps = v.get("rms_norm_eps").and_then(|x| x.as_f64());
    out.push(HfKey::strict(
        "rms_norm_eps",
        "rms_norm_eps",
        eps.unwrap_or(HF_RMS_NORM_EPS),
    ));
    match rope_scaling(v)? {
        RopeScaling::None => out.push(HfKey::strict("rope_scaling", "rope_scaling", "none")),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => out.extend([
            HfKey::strict("rope_scaling", "rope_scaling", "llama3"),
            HfKey::strict("rope_factor", "rope_scaling.factor", factor),
            HfKey::strict(
                "rope_low_freq_factor",
                "rope_scaling.low_freq_factor",
                low_freq_factor,
            ),
            HfKey::strict(
                "rope_high_freq_factor",
                "rope_scaling.high_freq_factor",
                high_freq_factor,
            ),
            HfKey::strict(
                "rope_original_max_position",
                "rope_scaling.original_max_position_embeddings",
                original_max_position as i64,
            ),
        ]),
    }
    // HF's default is false for Llama.
    let tie = v
        .get("tie_word_embeddings")
        .and_then(|x| x.as_bool())
        .unwrap_or(false);
    out.push(HfKey::strict(
        "tie_word_embeddings",
        "tie_word_embeddings",
        tie,
    ));
    Ok(out)
}

/// HF's `config.json` for this model.
pub fn config_json(cfg: &LlamaConfig, tokenizer: &str) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim(),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": match cfg.rope_scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position,
            }),
        },
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "phalanx_tokenizer": tokenizer,
    })
}

/// `head_dim` when it is not hidden_size / num_attention_heads (the only
/// case `model.head_dim` needs to be set).
fn explicit_head_dim(v: &Value) -> Option<usize> {
    let int = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
    let d = int("head_dim")?;
    match (int("hidden_size"), int("num_attention_heads")) {
        (Some(c), Some(h)) if h > 0 && c.is_multiple_of(h) && c / h == d => None,
        _ => Some(d),
    }
}

/// The model an HF `config.json` describes (`block_size` =
/// `max_position_embeddings`); unknown features are refused as in
/// [`check_config`].
pub fn config_from_json(v: &Value) -> Result<LlamaConfig> {
    let cfg = shape_from_json(v)?;
    cfg.validate()?;
    check_config(v, &cfg)?;
    Ok(cfg)
}

/// The Llama-layer shape an HF `config.json` gives, HF's defaults for what
/// it omits (unchecked: see [`config_from_json`]).
pub fn shape_from_json(v: &Value) -> Result<LlamaConfig> {
    let int = |k: &str| -> Result<usize> {
        v.get(k)
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .ok_or_else(|| candle_core::Error::Msg(format!("config.json: no integer `{k}`")))
    };
    let heads = int("num_attention_heads")?;
    let mut cfg = LlamaConfig::new(
        int("num_hidden_layers")?,
        heads,
        int("num_key_value_heads").unwrap_or(heads),
        int("hidden_size")?,
        int("intermediate_size")?,
        int("vocab_size")?,
        int("max_position_embeddings")?,
    );
    cfg.head_size = explicit_head_dim(v).unwrap_or(0);
    cfg.rope_theta = rope_theta(v)?;
    cfg.rope_scaling = rope_scaling(v)?;
    cfg.rms_norm_eps = v
        .get("rms_norm_eps")
        .and_then(|x| x.as_f64())
        .unwrap_or(HF_RMS_NORM_EPS);
    cfg.tie_word_embeddings = v
        .get("tie_word_embeddings")
        .and_then(|x| x.as_bool())
        .unwrap_or(false);
    Ok(cfg)
}
