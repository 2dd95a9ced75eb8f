//! GPT-2 as a [`ModelFamily`] (`model.arch = "gpt2"`, the default).

use super::config::{Gpt2Schema, Gpt2Section, DEFAULT_PRESET};
use super::{hf, tp, Gpt2Config};
use crate::family::{FamilyNames, HfKey, ModelFamily, ModelSummary};
use candle_core::Tensor;
use phalanx::config::{ConfigError, ModelFacts, ModelSchema, TrainConfig};
use phalanx::engine::{Block, Engine, EngineConfig};
use phalanx::plan::ModelShape;
use phalanx::tp::Tp;
use phalanx::{Error, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The GPT-2 family: `GPT2LMHeadModel`.
pub struct Gpt2Family;

/// The model of a GPT-2 config.
pub fn model_config(cfg: &TrainConfig) -> Result<Gpt2Config> {
    Ok(Gpt2Section::of(cfg)?.model())
}

/// The one safetensors file HF GPT-2 weights at `path` are (a file, or a
/// directory holding `model.safetensors`).
fn weights_file(path: &Path) -> Result<PathBuf> {
    let (files, _) = crate::common::hf::resolve(path)?;
    match <[PathBuf; 1]>::try_from(files) {
        Ok([f]) => Ok(f),
        Err(_) => Err(Error::Check(format!(
            "{}: a sharded checkpoint; GPT-2 weights are read from one safetensors file",
            path.display()
        ))),
    }
}

static NAMES: FamilyNames = FamilyNames {
    arch: "gpt2",
    title: "GPT-2",
    hf_model_types: &["gpt2"],
    hf_architectures: &["GPT2LMHeadModel"],
    presets: &Gpt2Config::PRESETS,
    default_preset: DEFAULT_PRESET,
};

impl ModelFamily for Gpt2Family {
    fn names(&self) -> &'static FamilyNames {
        &NAMES
    }

    /// The presets, and `gpt2` for `gpt2-124m`.
    fn has_preset(&self, preset: &str) -> bool {
        Gpt2Config::preset(preset).is_ok()
    }

    fn section(&self, preset: &str) -> std::result::Result<toml::Table, ConfigError> {
        let mut t = Gpt2Schema.section(Some(preset))?;
        t.insert("arch".into(), self.name().into());
        Ok(t)
    }

    fn check(&self, t: &toml::Table) -> std::result::Result<ModelFacts, ConfigError> {
        let mut t = t.clone();
        t.remove("arch");
        Gpt2Schema.check(&t)
    }

    fn summary(&self, cfg: &TrainConfig) -> Result<ModelSummary> {
        let m = model_config(cfg)?;
        Ok(ModelSummary {
            title: self.title(),
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: None,
            n_embd: m.n_embd,
            mlp: None,
            vocab_size: m.vocab_size,
            block_size: m.block_size,
            num_params: m.num_params(),
        })
    }

    fn blocks(&self, cfg: &TrainConfig) -> Result<Vec<Box<dyn Block>>> {
        let g = model_config(cfg)?;
        g.validate()?;
        Ok(super::blocks(&g)?)
    }

    fn tp_blocks(&self, cfg: &TrainConfig, t: &Tp) -> Result<Vec<Box<dyn Block>>> {
        Ok(super::blocks_tp(&model_config(cfg)?, Some(t.clone()))?)
    }

    fn tp_load(
        &self,
        cfg: &TrainConfig,
        t: &Tp,
        ecfg: EngineConfig,
        path: &Path,
    ) -> Result<Engine> {
        Ok(tp::load_engine(
            &model_config(cfg)?,
            t,
            ecfg,
            &cfg.device()?,
            &weights_file(path)?,
        )?)
    }

    fn hf_keys(&self, v: &Value) -> Result<Vec<HfKey>> {
        let mut out = vec![HfKey::strict("arch", "model_type", self.name())];
        let int = |k: &str| v.get(k).and_then(|x| x.as_u64());
        // What a config.json leaves out is transformers' GPT2Config
        // default (the weights' shapes check all but n_head, which a
        // preset's default would change silently).
        for (ours, theirs, hf_default) in [
            ("n_layer", "n_layer", 12),
            ("n_head", "n_head", 12),
            ("n_embd", "n_embd", 768),
            ("vocab_size", "vocab_size", 50257),
            // The position table's rows: the weights fix the context.
            ("block_size", "n_positions", 1024),
        ] {
            let n = int(theirs).unwrap_or(hf_default);
            out.push(HfKey::strict(ours, theirs, n as i64));
        }
        // What is not built is refused, not ignored.
        if let Some(a) = v.get("activation_function").and_then(|x| x.as_str()) {
            if !["gelu_new", "gelu_pytorch_tanh"].contains(&a) {
                return Err(Error::Check(format!(
                    "activation_function {a:?} is not built for GPT-2 (only the tanh GELU, \"gelu_new\")"
                )));
            }
        }
        if let (Some(inner), Some(c)) = (int("n_inner"), int("n_embd")) {
            if inner != 4 * c {
                return Err(Error::Check(format!(
                    "n_inner = {inner} is not built for GPT-2 (the MLP is 4 n_embd = {} wide)",
                    4 * c
                )));
            }
        }
        if let Some(e) = v.get("layer_norm_epsilon").and_then(|x| x.as_f64()) {
            if (e - 1e-5).abs() > 1e-12 {
                return Err(Error::Check(format!(
                    "layer_norm_epsilon = {e} is not built for GPT-2 (only 1e-5)"
                )));
            }
        }
        // Attention variants transformers' GPT2 supports (Stanford CRFM's
        // checkpoints scale by the layer index): other logits, so refused
        // where they differ from GPT-2's own values. (`reorder_and_upcast_
        // attn` only computes the scores in f32, as the f32 path does.)
        for (key, gpt2) in [
            ("scale_attn_weights", true),
            ("scale_attn_by_inverse_layer_idx", false),
            ("add_cross_attention", false),
            // GPT-2's head is its token table; an untied lm_head.weight
            // would be dropped for wte's values.
            ("tie_word_embeddings", true),
        ] {
            if let Some(b) = v.get(key).and_then(|x| x.as_bool()) {
                if b != gpt2 {
                    return Err(Error::Check(format!(
                        "{key} = {b} is not built for GPT-2 (only GPT-2's {gpt2})"
                    )));
                }
            }
        }
        Ok(out)
    }

    fn load_hf(&self, engine: &mut Engine, _cfg: &TrainConfig, path: &Path) -> Result<()> {
        Ok(hf::load_safetensors(engine, weights_file(path)?)?)
    }

    /// One safetensors file at `path` (Conv1D weights transposed, as HF
    /// stores them), atomically, with `config.json` beside it, so the
    /// directory opens with `GPT2LMHeadModel.from_pretrained`.
    fn save_hf(
        &self,
        tensors: &HashMap<String, Tensor>,
        cfg: &TrainConfig,
        path: &Path,
    ) -> Result<PathBuf> {
        let tensors = hf::to_hf(tensors.clone())?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        // Written whole, with the umask's permissions; no temporary is left
        // on an error.
        let mut sorted: Vec<(&String, &Tensor)> = tensors.iter().collect();
        sorted.sort_by_key(|(n, _)| *n);
        let bytes = safetensors::serialize(sorted, crate::common::hf::pt_metadata())
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        phalanx::fsutil::write_atomic(path, &bytes)?;
        let m = model_config(cfg)?;
        let mut hf_cfg = json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd,
            "vocab_size": m.vocab_size, "n_positions": m.block_size, "n_ctx": m.block_size,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "tie_word_embeddings": true,
            "phalanx_tokenizer": cfg.data.tokenizer.to_string(),
        });
        crate::hf_tokenizer::set_special_ids(&mut hf_cfg, &cfg.data.tokenizer)?;
        phalanx::fsutil::write_atomic(
            &dir.join("config.json"),
            serde_json::to_string_pretty(&hf_cfg).unwrap().as_bytes(),
        )?;
        Ok(dir.to_path_buf())
    }

    /// `--save-final` names the file itself.
    fn hf_weights_file(&self, path: &Path) -> PathBuf {
        path.to_path_buf()
    }

    /// GPT-2 generates with `data.tokenizer` (its BPE is built in).
    fn tokenizer_beside(&self) -> bool {
        false
    }

    /// A byte vocabulary is Phalanx's byte tokenizer, any other GPT-2's BPE.
    fn hf_default_tokenizer(&self, v: &Value) -> Option<String> {
        let bytes = v.get("vocab_size").and_then(|x| x.as_u64()) == Some(256);
        Some(if bytes { "byte" } else { "gpt2" }.into())
    }

    fn plan_shape(&self, cfg: &TrainConfig, seq_len: usize) -> Result<ModelShape> {
        Ok(model_config(cfg)?.plan_shape(seq_len)?)
    }
}

#[cfg(test)]
mod tests {
    use super::Gpt2Family;
    use crate::family::ModelFamily;
    use serde_json::json;

    #[test]
    fn attention_variants_not_built_are_refused_not_ignored() {
        let base = json!({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8});
        assert!(Gpt2Family.hf_keys(&base).is_ok());
        let mut same = base.clone();
        same["scale_attn_weights"] = json!(true);
        same["reorder_and_upcast_attn"] = json!(true);
        assert!(Gpt2Family.hf_keys(&same).is_ok());
        for (k, v) in [
            ("scale_attn_by_inverse_layer_idx", true),
            ("scale_attn_weights", false),
            ("add_cross_attention", true),
            ("tie_word_embeddings", false),
        ] {
            let mut c = base.clone();
            c[k] = json!(v);
            let e = Gpt2Family.hf_keys(&c).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains("not built"), "{e}");
        }
    }

    #[test]
    fn sizes_a_config_json_leaves_out_are_transformers_defaults() {
        let keys = Gpt2Family
            .hf_keys(&json!({"model_type": "gpt2", "n_layer": 2, "n_embd": 8}))
            .unwrap();
        let get = |k: &str| {
            let h = keys.iter().find(|h| h.key == k).unwrap();
            h.value.as_integer().unwrap()
        };
        // n_head is not fixed by any weight's shape: 12, as GPT2Config's.
        assert_eq!(get("n_head"), 12);
        assert_eq!((get("n_layer"), get("n_embd")), (2, 8));
        assert_eq!((get("vocab_size"), get("block_size")), (50257, 1024));
    }
}
