//! `phalanx generate`: sample text from a trained or downloaded GPT-2 or
//! Llama (a `config.json` with `model_type = "llama"` beside the weights,
//! or `--set model.arch=llama`), or from a distributed checkpoint of any
//! layout (tensor parallel, pipeline, ZeRO-3: its pieces are gathered into
//! one model on this process). Llama generates with a KV cache and reads an
//! HF `tokenizer.json` beside the weights when there is one; otherwise
//! `data.tokenizer` (a built-in one, or a `tokenizer.json` it names).

use candle_core::{Device, IndexOp, Tensor};
use clap::Args;
use phalanx::checkpoint;
use phalanx::data::Tokenizer;
use phalanx::engine::Engine;
use phalanx_models::arch::{self, Arch};
use phalanx_models::gpt2::{dcp, hf, train};
use phalanx_models::{hf_tokenizer, llama};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct GenerateOpts {
    /// Model weights (Hugging Face safetensors; for Llama also a sharded
    /// index or a directory). `config.json` beside it, if present, gives
    /// the shape; otherwise --config / --set do.
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

/// Model keys read from an HF config.json beside the model, as --set
/// overrides (none without one; a config.json that does not parse is an
/// error naming it, never silently ignored).
pub(crate) fn hf_overrides(path: &std::path::Path) -> phalanx::Result<Vec<String>> {
    let Some(dir) = model_dir(path) else {
        return Ok(vec![]);
    };
    let cj = dir.join("config.json");
    if !cj.exists() {
        return Ok(vec![]);
    }
    let bad = |e: String| phalanx::Error::Check(format!("{}: {e}", cj.display()));
    let text = std::fs::read_to_string(&cj).map_err(|e| bad(e.to_string()))?;
    let v = serde_json::from_str::<serde_json::Value>(&text).map_err(|e| bad(e.to_string()))?;
    if v.get("model_type").and_then(|t| t.as_str()) == Some("llama") {
        let mut out = llama::hf::overrides_from_config(&v);
        if let Some(t) = v.get("phalanx_tokenizer").and_then(|t| t.as_str()) {
            out.push(tokenizer_set(&dir, t));
        }
        return Ok(out);
    }
    let mut out = vec![];
    for (ours, theirs) in [
        ("n_layer", "n_layer"),
        ("n_head", "n_head"),
        ("n_embd", "n_embd"),
        ("vocab_size", "vocab_size"),
        ("block_size", "n_positions"),
    ] {
        if let Some(n) = v.get(theirs).and_then(|x| x.as_u64()) {
            out.push(format!("model.{ours}={n}"));
        }
    }
    let tok = v
        .get("phalanx_tokenizer")
        .and_then(|t| t.as_str())
        .unwrap_or(
            if v.get("vocab_size").and_then(|x| x.as_u64()) == Some(256) {
                "byte"
            } else {
                "gpt2"
            },
        );
    out.push(tokenizer_set(&dir, tok));
    Ok(out)
}

/// `data.tokenizer` as a saved model's config.json records it: a
/// `tokenizer.json` path stands for the copy saved beside the weights.
fn tokenizer_set(dir: &std::path::Path, t: &str) -> String {
    let beside = dir.join("tokenizer.json");
    let t = if t.to_ascii_lowercase().ends_with(".json") && beside.is_file() {
        beside.display().to_string()
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
    let arch = Arch::of(&cfg)?;
    // A tokenizer.json beside Llama weights (a downloaded model's), else
    // the one data.tokenizer names, else the built-in one.
    let tj = beside
        .filter(|_| arch == Arch::Llama)
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
    let (vocab, t) = match arch {
        Arch::Gpt2 => {
            let m = train::model_config(&cfg)?;
            (m.vocab_size, m.block_size)
        }
        Arch::Llama => {
            let m = llama::train::model_config(&cfg)?;
            (m.vocab_size, m.block_size)
        }
    };
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(phalanx::Error::Check(format!(
            "the prompt's token {bad} is outside the model's vocabulary of {vocab}: \
             the tokenizer ({}) does not match this model (set --set data.tokenizer=...)",
            codec.name(&cfg)
        )));
    }
    let mut rng = phalanx::data::shuffle::SplitMix64::new(o.seed);
    // The logits of the next token, given all ids so far and the last one.
    type Next<'a> = Box<dyn FnMut(&[u32], u32) -> phalanx::Result<Vec<f32>> + 'a>;
    let mut next_logits: Next = match arch {
        // GPT-2: a full forward of the latest block_size tokens.
        Arch::Gpt2 => Box::new(|ids: &[u32], _next: u32| {
            let ctx = &ids[ids.len().saturating_sub(t)..];
            let x = Tensor::from_slice(ctx, (1, ctx.len()), &Device::Cpu)?;
            let logits = engine.forward(&x)?; // (1, T, V)
            Ok(logits.i((0, ctx.len() - 1))?.to_vec1()?)
        }),
        Arch::Llama => {
            let m = llama::train::model_config(&cfg)?;
            let mut g = llama::generate::Generator::new(&engine, &m)?;
            let mut started = false;
            Box::new(move |ids: &[u32], next: u32| {
                let logits = if !started {
                    // The prompt's tail that fits, fed at once.
                    started = true;
                    g.step(&ids[ids.len().saturating_sub(t)..])?
                } else if g.len() == t {
                    // Context full: restart the cache on the latest half
                    // (rotary positions restart too, as a fresh forward of
                    // that window would).
                    g.reset();
                    g.step(&ids[ids.len() - (t / 2).max(1)..])?
                } else {
                    g.step(&[next])?
                };
                let n = logits.dim(0)?;
                Ok(logits.i(n - 1)?.to_vec1()?)
            })
        }
    };
    print!("{}", o.prompt);
    // Decoding is not per token (word-level and SentencePiece decoders put
    // the spaces between tokens; a byte may end inside a character): print
    // what the whole text gained over what is already shown.
    let mut shown = codec.decode(&ids).unwrap_or_default();
    let mut last = 0;
    for _ in 0..o.tokens {
        let logits = next_logits(&ids, last)?;
        last = sample(&logits, o.temperature, o.top_k, &mut rng);
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
            let cfg = arch::build(o.config.as_deref(), &sets)?;
            let engine = dcp::gather(&reader, &cfg).map_err(named)?;
            return Ok((cfg, engine, None));
        }
    }
    let mut sets = hf_overrides(&o.model)?;
    sets.extend(o.set.iter().cloned());
    let cfg = arch::build(o.config.as_deref(), &sets)?;
    let mut engine;
    let loaded = match Arch::of(&cfg)? {
        Arch::Gpt2 => {
            engine = train::build_engine(&cfg)?;
            hf::load_safetensors(&mut engine, &o.model)
        }
        Arch::Llama => {
            let m = llama::train::model_config(&cfg)?;
            engine = llama::train::build_engine(&cfg)?;
            llama::hf::load(&mut engine, &m, &o.model)
        }
    };
    loaded.map_err(|e| named(phalanx::Error::from(e)))?;
    Ok((cfg, engine, model_dir(&o.model)))
}

/// The directory a model path's `config.json` (and `tokenizer.json`) sit in.
fn model_dir(path: &std::path::Path) -> Option<std::path::PathBuf> {
    if path.is_dir() {
        return Some(path.to_path_buf());
    }
    path.parent().map(|d| {
        if d.as_os_str().is_empty() {
            std::path::PathBuf::from(".")
        } else {
            d.to_path_buf()
        }
    })
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
