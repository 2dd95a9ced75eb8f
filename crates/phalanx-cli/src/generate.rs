//! `phalanx generate`: sample text from a trained or downloaded model of
//! any family (the `config.json` beside the weights picks it by
//! `model_type` / `architectures`, or `--set model.arch=...`), or from a
//! distributed checkpoint of any layout (tensor parallel, pipeline, ZeRO-3:
//! its pieces are gathered into one model on this process). The family
//! gives the decoder (Llama and Qwen2 keep a KV cache); Llama and Qwen2
//! read an HF `tokenizer.json` beside the weights when there is one;
//! otherwise `data.tokenizer` (a built-in one, or a `tokenizer.json` it
//! names).

use clap::Args;
use phalanx::checkpoint;
use phalanx::data::Tokenizer;
use phalanx::engine::Engine;
use phalanx_models::common::hf::model_dir;
use phalanx_models::{dcp, family, hf_tokenizer, train};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct GenerateOpts {
    /// Model weights (Hugging Face safetensors, a sharded index or a
    /// directory) or a distributed checkpoint. `config.json` beside the
    /// weights, if present, gives the family and the shape; otherwise
    /// --config / --set do.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn main(o: &GenerateOpts) -> i32 {
    match run(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx generate: error: {e}");
            1
        }
    }
}

/// The `data.tokenizer` an HF model's `config.json` implies, as a --set
/// override (none without one; a config.json that does not parse is an
/// error naming it, never silently ignored): the one Phalanx recorded when
/// saving, else the family's default for a downloaded checkpoint, else the
/// `tokenizer.json` beside the weights (a downloaded Llama's or Qwen2's:
/// `checkpoint from-hf` records it, so the imported checkpoint generates
/// and exports with it, not with the byte tokenizer).
pub(crate) fn tokenizer_sets(path: &std::path::Path) -> phalanx::Result<Vec<String>> {
    let Some(cj) = family::hf_config_path(path) else {
        return Ok(vec![]);
    };
    let bad = |e: String| phalanx::Error::Check(format!("{}: {e}", cj.display()));
    let text = std::fs::read_to_string(&cj).map_err(|e| bad(e.to_string()))?;
    let v = serde_json::from_str::<serde_json::Value>(&text).map_err(|e| bad(e.to_string()))?;
    let dir = model_dir(path);
    let recorded = v.get("phalanx_tokenizer").and_then(|t| t.as_str());
    let fallback = family::for_hf_config(&v)
        .ok()
        .and_then(|f| f.hf_default_tokenizer(&v));
    let beside = dir
        .join("tokenizer.json")
        .is_file()
        .then(|| "tokenizer.json".to_string());
    Ok(match recorded.map(str::to_string).or(fallback).or(beside) {
        Some(t) => vec![tokenizer_set(&dir, &t)],
        None => vec![],
    })
}

/// `data.tokenizer` as a saved model's config.json records it: a
/// `tokenizer.json` path stands for the copy saved beside the weights
/// (absolute: a checkpoint imported from the directory records it, and is
/// used from other working directories).
fn tokenizer_set(dir: &std::path::Path, t: &str) -> String {
    let beside = dir.join("tokenizer.json");
    let t = if t.to_ascii_lowercase().ends_with(".json") && beside.is_file() {
        beside
            .canonicalize()
            .unwrap_or(beside)
            .display()
            .to_string()
    } else {
        t.to_string()
    };
    format!("data.tokenizer={}", serde_json::Value::from(t))
}

fn run(o: &GenerateOpts) -> phalanx::Result<()> {
    if !(o.temperature.is_finite() && o.temperature >= 0.0) {
        return Err(phalanx::Error::Check(format!(
            "--temperature must be a number >= 0 (0 = greedy), not {}",
            o.temperature
        )));
    }
    let (cfg, engine, beside) = load(o)?;
    let family = family::of(&cfg)?;
    // A tokenizer.json beside the weights (a downloaded model's) where the
    // family reads it, else the one data.tokenizer names, else the
    // built-in one.
    let tj = beside
        .filter(|_| family.tokenizer_beside())
        .map(|d| d.join("tokenizer.json"))
        .filter(|p| p.is_file())
        .or_else(|| cfg.data.tokenizer.json_path().map(hf_tokenizer::json_path));
    let codec = match tj {
        Some(p) => Codec::Hf(Box::new(hf_tokenizer::open(&p)?)),
        None => Codec::Data(cfg.data.tokenizer.builtin().unwrap_or(Tokenizer::Byte)),
    };
    let mut ids = codec.encode(&o.prompt)?;
    if ids.is_empty() {
        return Err(phalanx::Error::Check(
            "the prompt encodes to no tokens".into(),
        ));
    }
    let vocab = family.summary(&cfg)?.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(phalanx::Error::Check(format!(
            "the prompt's token {bad} is outside the model's vocabulary of {vocab}: \
             the tokenizer ({}) does not match this model (set --set data.tokenizer=...)",
            codec.name(&cfg)
        )));
    }
    let mut rng = phalanx::data::shuffle::SplitMix64::new(o.seed);
    // The logits of the next token, given all ids so far and the last one.
    let mut decoder = family.decoder(&engine, &cfg)?;
    print!("{}", o.prompt);
    // Decoding is not per token (word-level and SentencePiece decoders put
    // the spaces between tokens; a byte may end inside a character): print
    // what the whole text gained over what is already shown.
    let mut shown = codec.decode(&ids).unwrap_or_default();
    let mut last = 0;
    // A model's vocabulary may be padded past the tokenizer's (GPT-2's
    // 50304 for 50257 tokens, a byte tokenizer on a larger model): an id
    // the tokenizer cannot decode would end the text there, so only the
    // tokenizer's ids are sampled.
    let known = codec.vocab_size().min(vocab);
    for _ in 0..o.tokens {
        let logits = decoder.next_logits(&ids, last)?;
        let n = known.min(logits.len());
        last = sample(&logits[..n], o.temperature, o.top_k, &mut rng);
        ids.push(last);
        if let Some(s) = codec.decode(&ids) {
            // (A decoder that rewrites earlier text shows from where the
            // two texts part; what was printed before that stays.)
            let common = s
                .char_indices()
                .zip(shown.chars())
                .find(|((_, a), b)| a != b)
                .map_or(shown.len().min(s.len()), |((i, _), _)| i);
            print!("{}", &s[common..]);
            shown = s;
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
    println!();
    Ok(())
}

/// The config, the whole model on this one process, and the directory of
/// an HF model (where a `tokenizer.json` may sit). `--model` is either
/// Hugging Face weights (`config.json` beside them gives the shape), or a
/// distributed checkpoint of any layout (`step-N/`, or a checkpoint
/// directory: its latest), whose pieces are gathered into one model: a run
/// trained with tensor or pipeline parallelism or ZeRO-3 generates from its
/// checkpoint directly.
fn load(
    o: &GenerateOpts,
) -> phalanx::Result<(phalanx::config::TrainConfig, Engine, Option<PathBuf>)> {
    let named = |e: phalanx::Error| phalanx::Error::Check(format!("{}: {e}", o.model.display()));
    if o.model.is_dir() {
        if let Ok(dir) = checkpoint::find(&o.model) {
            let reader = checkpoint::Reader::open(&dir).map_err(named)?;
            reader.verify_all().map_err(named)?;
            let mut sets = dcp::model_overrides(&reader.meta)?;
            sets.extend(o.set.iter().cloned());
            let cfg = family::build(o.config.as_deref(), &sets)?;
            let engine = dcp::gather(&reader, &cfg).map_err(named)?;
            return Ok((cfg, engine, None));
        }
    }
    let mut sets = tokenizer_sets(&o.model)?;
    sets.extend(o.set.iter().cloned());
    let (cfg, _) = family::build_for_hf(o.config.as_deref(), &sets, &o.model)?;
    phalanx_models::common::backed::check_hf(&cfg, &o.model)?;
    let mut engine = train::build_engine(&cfg)?;
    family::of(&cfg)?
        .load_hf(&mut engine, &cfg, &o.model)
        .map_err(named)?;
    Ok((cfg, engine, Some(model_dir(&o.model))))
}

/// Text <-> ids: the built-in tokenizer, or an HF `tokenizer.json`.
enum Codec {
    Data(Tokenizer),
    Hf(Box<hf_tokenizer::Tokenizer>),
}

impl Codec {
    fn encode(&self, s: &str) -> phalanx::Result<Vec<u32>> {
        match self {
            Codec::Data(t) => Ok(t.encode(s)),
            Codec::Hf(t) => Ok(t
                .encode(s, true)
                .map_err(|e| phalanx::Error::Check(format!("tokenizer.json: {e}")))?
                .get_ids()
                .to_vec()),
        }
    }

    /// Ids it can decode.
    fn vocab_size(&self) -> usize {
        match self {
            Codec::Data(t) => t.vocab_size(),
            Codec::Hf(t) => hf_tokenizer::vocab_size(t),
        }
    }

    /// None while the ids end inside a character.
    fn decode(&self, ids: &[u32]) -> Option<String> {
        let s = match self {
            Codec::Data(t) => t.decode(ids).ok()?,
            Codec::Hf(t) => t.decode(ids, true).ok()?,
        };
        (!s.ends_with('\u{FFFD}')).then_some(s)
    }

    fn name(&self, cfg: &phalanx::config::TrainConfig) -> String {
        match self {
            Codec::Data(t) => format!("data.tokenizer = {t}"),
            Codec::Hf(_) => match cfg.data.tokenizer.json_path() {
                Some(p) => format!("data.tokenizer = {}", p.display()),
                None => "the tokenizer.json beside the weights".into(),
            },
        }
    }
}

fn sample(
    logits: &[f32],
    temperature: f64,
    top_k: usize,
    rng: &mut phalanx::data::shuffle::SplitMix64,
) -> u32 {
    if temperature <= 0.0 {
        return logits
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0 as u32;
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        idx.truncate(top_k);
    }
    let max = logits[idx[0]] as f64;
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (k, wk) in w.iter().enumerate() {
        if u < *wk {
            return idx[k] as u32;
        }
        u -= wk;
    }
    idx[idx.len() - 1] as u32
}
