//! `phalanx generate`: sample text from a trained or downloaded GPT-2 or
//! Llama (a `config.json` with `model_type = "llama"` beside the weights,
//! or `--set model.arch=llama`). Llama generates with a KV cache and reads
//! an HF `tokenizer.json` beside the weights when there is one.

use candle_core::{Device, IndexOp, Tensor};
use clap::Args;
use phalanx_models::arch::{self, Arch};
use phalanx_models::gpt2::{hf, train};
use phalanx_models::llama;
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
            out.push(format!("data.tokenizer=\"{t}\""));
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
    out.push(format!("data.tokenizer=\"{tok}\""));
    Ok(out)
}

fn run(o: &GenerateOpts) -> phalanx::Result<()> {
    if !(o.temperature.is_finite() && o.temperature >= 0.0) {
        return Err(phalanx::Error::Check(format!(
            "--temperature must be a number >= 0 (0 = greedy), not {}",
            o.temperature
        )));
    }
    let mut sets = hf_overrides(&o.model)?;
    sets.extend(o.set.iter().cloned());
    let cfg = arch::build(o.config.as_deref(), &sets)?;
    if Arch::of(&cfg)? == Arch::Llama {
        return run_llama(o, &cfg);
    }
    let mut engine = train::build_engine(&cfg)?;
    hf::load_safetensors(&mut engine, &o.model).map_err(|e| {
        phalanx::Error::Check(format!(
            "{}: {}",
            o.model.display(),
            phalanx::Error::from(e)
        ))
    })?;
    let tok = cfg.data.tokenizer;
    let mut ids = tok.encode(&o.prompt);
    if ids.is_empty() {
        return Err(phalanx::Error::Check(
            "the prompt encodes to no tokens".into(),
        ));
    }
    let vocab = train::model_config(&cfg)?.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(phalanx::Error::Check(format!(
            "the prompt's token {bad} is outside the model's vocabulary of {vocab}: \
             data.tokenizer = {} does not match this model (set --set data.tokenizer=...)",
            tok
        )));
    }
    let mut rng = phalanx::data::shuffle::SplitMix64::new(o.seed);
    let t = train::model_config(&cfg)?.block_size;
    print!("{}", o.prompt);
    let mut printed = ids.len();
    for _ in 0..o.tokens {
        let ctx = &ids[ids.len().saturating_sub(t)..];
        let x = Tensor::from_slice(ctx, (1, ctx.len()), &Device::Cpu)?;
        let logits = engine.forward(&x)?; // (1, T, V)
        let last: Vec<f32> = logits.i((0, ctx.len() - 1))?.to_vec1()?;
        ids.push(sample(&last, o.temperature, o.top_k, &mut rng));
        // Print whole UTF-8 characters as they complete.
        if let Ok(s) = tok.decode(&ids[printed..]) {
            if !s.ends_with('\u{FFFD}') {
                print!("{s}");
                printed = ids.len();
                use std::io::Write;
                let _ = std::io::stdout().flush();
            }
        }
    }
    println!();
    Ok(())
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

/// Text <-> ids: the data tokenizer, or an HF `tokenizer.json`.
enum Codec {
    Data(phalanx::data::Tokenizer),
    Hf(Box<tokenizers::Tokenizer>),
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
}

/// Llama: weights in any HF layout, a KV cache, `tokenizer.json` if present.
fn run_llama(o: &GenerateOpts, cfg: &phalanx::config::TrainConfig) -> phalanx::Result<()> {
    let m = llama::train::model_config(cfg)?;
    let mut engine = llama::train::build_engine(cfg)?;
    llama::hf::load(&mut engine, &m, &o.model).map_err(|e| {
        phalanx::Error::Check(format!(
            "{}: {}",
            o.model.display(),
            phalanx::Error::from(e)
        ))
    })?;
    let tj = model_dir(&o.model).map(|d| d.join("tokenizer.json"));
    let codec = match tj.filter(|p| p.is_file()) {
        Some(p) => Codec::Hf(Box::new(
            tokenizers::Tokenizer::from_file(&p)
                .map_err(|e| phalanx::Error::Check(format!("{}: {e}", p.display())))?,
        )),
        None => Codec::Data(cfg.data.tokenizer),
    };
    let mut ids = codec.encode(&o.prompt)?;
    if ids.is_empty() {
        return Err(phalanx::Error::Check(
            "the prompt encodes to no tokens".into(),
        ));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= m.vocab_size) {
        return Err(phalanx::Error::Check(format!(
            "the prompt's token {bad} is outside the model's vocabulary of {}: \
             the tokenizer does not match this model",
            m.vocab_size
        )));
    }
    let mut g = llama::generate::Generator::new(&engine, &m)?;
    let mut rng = phalanx::data::shuffle::SplitMix64::new(o.seed);
    let t = m.block_size;
    // The prompt's tail that fits, fed at once; then one token per step.
    let mut logits = g.step(&ids[ids.len().saturating_sub(t)..])?;
    print!("{}", o.prompt);
    // Decoding is not per token (word-level and SentencePiece decoders put
    // the spaces between tokens): print what the whole text gained over
    // what is already shown.
    let mut shown = codec.decode(&ids).unwrap_or_default();
    for _ in 0..o.tokens {
        let n = logits.dim(0)?;
        let last: Vec<f32> = logits.i(n - 1)?.to_vec1()?;
        let next = sample(&last, o.temperature, o.top_k, &mut rng);
        ids.push(next);
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
        if g.len() == t {
            // Context full: restart the cache on the latest half (rotary
            // positions restart too, as a fresh forward of that window would).
            g.reset();
            logits = g.step(&ids[ids.len() - (t / 2).max(1)..])?;
        } else {
            logits = g.step(&[next])?;
        }
    }
    println!();
    Ok(())
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
