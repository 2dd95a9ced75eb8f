//! `phalanx generate`: sample text from a trained or downloaded model of
//! any family (the `config.json` beside the weights picks it by
//! `model_type` / `architectures`, or `--set model.arch=...`), or from a
//! distributed checkpoint of any layout (tensor parallel, pipeline, ZeRO-3:
//! its pieces are gathered into one model on this process). The family
//! gives the decoder (Llama and Qwen2 keep a KV cache). The tokenizer is
//! `data.tokenizer` (a built-in one, or a `tokenizer.json` it names), by
//! default the one the model's `config.json` records, its family's, or
//! (Llama and Qwen2) the `tokenizer.json` beside the weights; `--set
//! data.tokenizer=...` overrides it. Generation stops at the end-of-text
//! token unless `--ignore-eos`.

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
    /// The text to continue; one that encodes to no tokens (\"\") starts
    /// from the tokenizer's end-of-text token, as a document does.
    #[arg(long, default_value = "\n", allow_hyphen_values = true)]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Go on past the end-of-text token (by default generation stops
    /// there, as transformers' `generate` does).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
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

/// The model directory's tokenizer (as [`tokenizer_sets`]), unless the
/// config file or `--set` names `data.tokenizer` itself: an explicit one
/// wins.
pub(crate) fn default_tokenizer_sets(
    path: &std::path::Path,
    file: Option<&std::path::Path>,
    set: &[String],
) -> phalanx::Result<Vec<String>> {
    if family::explicit_keys(file, set, "data")?.contains_key("tokenizer") {
        return Ok(vec![]);
    }
    tokenizer_sets(path)
}

/// The `data.tokenizer` an HF model's `config.json` implies, as a --set
/// override (none without one; a config.json that does not parse is an
/// error naming it, never silently ignored): for Llama and Qwen2 the
/// `tokenizer.json` beside the weights first (a downloaded model's:
/// `checkpoint from-hf` records it, so the imported checkpoint generates
/// and exports with it, not with the byte tokenizer); then the one Phalanx
/// recorded when saving; then (GPT-2) a `tokenizer.json` beside the
/// weights; else the family's default for a downloaded checkpoint.
pub(crate) fn tokenizer_sets(path: &std::path::Path) -> phalanx::Result<Vec<String>> {
    let Some(cj) = family::hf_config_path(path) else {
        return Ok(vec![]);
    };
    let bad = |e: String| phalanx::Error::Check(format!("{}: {e}", cj.display()));
    let text = std::fs::read_to_string(&cj).map_err(|e| bad(e.to_string()))?;
    let v = serde_json::from_str::<serde_json::Value>(&text).map_err(|e| bad(e.to_string()))?;
    let dir = model_dir(path);
    let recorded = v.get("phalanx_tokenizer").and_then(|t| t.as_str());
    let fam = family::for_hf_config(&v).ok();
    let fallback = fam.as_ref().and_then(|f| f.hf_default_tokenizer(&v));
    let beside = dir
        .join("tokenizer.json")
        .is_file()
        .then(|| "tokenizer.json".to_string());
    // Llama and Qwen2 take the tokenizer.json beside their weights first
    // (a downloaded model's, or one put there for a model trained on
    // pre-tokenized ids); GPT-2 after the one Phalanx recorded, and before
    // its family's default BPE (a GPT-2 of another language has its own
    // vocabulary). The user's --set, after these, wins over all.
    let first = beside
        .clone()
        .filter(|_| fam.as_ref().is_some_and(|f| f.tokenizer_beside()));
    Ok(
        match first
            .or(recorded.map(str::to_string))
            .or(beside)
            .or(fallback)
        {
            Some(t) => vec![tokenizer_set(&dir, &t)],
            None => vec![],
        },
    )
}

/// The `eos_token_id`s (a number or a list) of the `config.json` and
/// `generation_config.json` beside a model's weights; none for a
/// checkpoint or files that do not say.
fn config_eos_ids(path: &std::path::Path) -> Vec<u32> {
    let dir = model_dir(path);
    let mut out = Vec::new();
    for name in ["config.json", "generation_config.json"] {
        let v = std::fs::read_to_string(dir.join(name))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        let ids = match v.as_ref().and_then(|v| v.get("eos_token_id")) {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
            Some(x) => x.as_u64().into_iter().collect(),
            None => Vec::new(),
        };
        out.extend(ids.into_iter().filter_map(|i| u32::try_from(i).ok()));
    }
    out.sort_unstable();
    out.dedup();
    out
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
    let (cfg, engine, named, trained_with) = load(o)?;
    let family = family::of(&cfg)?;
    if !named && family.tokenizer_beside() {
        // The byte tokenizer (data.tokenizer's default) on a downloaded
        // model of 32000+ ids would sample ids 0-255 and print bytes.
        return Err(phalanx::Error::Check(format!(
            "{}: no tokenizer: no tokenizer.json beside the weights and none recorded in {}; \
             give --set data.tokenizer=PATH/tokenizer.json (or =byte for a model trained on \
             bytes)",
            o.model.display(),
            if phalanx_models::common::hf::model_dir(&o.model)
                .join("config.json")
                .is_file()
            {
                "its config.json"
            } else {
                "a config.json (there is none beside it)"
            }
        )));
    }
    // What data.tokenizer names (the file beside the weights arrives as
    // a --set before the user's own), else the built-in one.
    let tj = cfg.data.tokenizer.json_path().map(hf_tokenizer::json_path);
    if let Some(p) = tj.as_deref().filter(|p| p.is_relative() && !p.is_file()) {
        return Err(phalanx::Error::Check(format!(
            "data.tokenizer {}: no such tokenizer.json (a relative path is read from the \
             current directory: run from where training ran, or give --set \
             data.tokenizer=PATH)",
            p.display()
        )));
    }
    if let (Some(p), Some(want)) = (&tj, &trained_with) {
        if hf_tokenizer::content_of(p).as_ref() != Some(want) {
            let e = format!(
                "{} is not the tokenizer.json {} was trained with (its content changed since): \
                 the ids would be read as other words",
                p.display(),
                o.model.display()
            );
            if family::explicit_keys(o.config.as_deref(), &o.set, "data")?.contains_key("tokenizer")
            {
                eprintln!("warning: {e}; used as data.tokenizer names it");
            } else {
                return Err(phalanx::Error::Check(format!(
                    "{e}; restore it, or name a tokenizer with --set data.tokenizer=PATH"
                )));
            }
        }
    }
    let codec = match tj {
        Some(p) => Codec::Hf(Box::new(hf_tokenizer::open(&p)?)),
        None => Codec::Data(cfg.data.tokenizer.builtin().unwrap_or(Tokenizer::Byte)),
    };
    let mut ids = codec.encode(&o.prompt)?;
    if ids.is_empty() {
        // Documents are trained after an end-of-text token: start there,
        // as GPT-2's unconditional samples do.
        ids.extend(codec.eos());
    }
    if ids.is_empty() {
        return Err(phalanx::Error::Check(format!(
            "--prompt {:?} encodes to no tokens with {}, which has no end-of-text token to \
             start from instead: give a --prompt it encodes",
            o.prompt,
            codec.name(&cfg)
        )));
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
    // The tokenizer's end-of-text token, and those the model's own
    // config.json and generation_config.json name (an instruct model's
    // end of turn: Llama 3's <|eot_id|>, Qwen2's <|im_end|>).
    let eos: Vec<u32> = if o.ignore_eos {
        Vec::new()
    } else {
        let mut e: Vec<u32> = codec.eos().into_iter().collect();
        e.extend(
            config_eos_ids(&o.model)
                .into_iter()
                .filter(|&i| (i as usize) < vocab),
        );
        e
    };
    // Output to a pipe closed early (`| head`) ends generation quietly.
    let mut out = Out(std::io::stdout().lock());
    if !out.show(&o.prompt)? {
        return Ok(());
    }
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
        if let Some(i) = logits[..n].iter().position(|v| !v.is_finite()) {
            // (NaN or inf would pick an arbitrary token, silently.)
            return Err(phalanx::Error::Check(format!(
                "the model's logits are not finite ({} for token {i} after {} tokens): the \
                 weights hold NaN or inf, or overflow",
                logits[i],
                ids.len()
            )));
        }
        last = sample(&logits[..n], o.temperature, o.top_k, &mut rng);
        if eos.contains(&last) {
            break;
        }
        ids.push(last);
        if let Some(s) = codec.decode(&ids) {
            // (A decoder that rewrites earlier text shows from where the
            // two texts part; what was printed before that stays.)
            let common = s
                .char_indices()
                .zip(shown.chars())
                .find(|((_, a), b)| a != b)
                .map_or(shown.len().min(s.len()), |((i, _), _)| i);
            if !out.show(&s[common..])? {
                return Ok(());
            }
            shown = s;
        }
    }
    out.show("\n")?;
    Ok(())
}

/// Standard output, shown as it comes.
struct Out<W: std::io::Write>(W);

impl<W: std::io::Write> Out<W> {
    /// Write and flush `s`: false once the reader has gone (a closed pipe).
    fn show(&mut self, s: &str) -> phalanx::Result<bool> {
        match self.0.write_all(s.as_bytes()).and_then(|_| self.0.flush()) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            Err(e) => Err(phalanx::Error::Io(format!("writing the output: {e}"))),
        }
    }
}

/// The config, the whole model on this one process, and the directory of
/// an HF model (where a `tokenizer.json` may sit). `--model` is either
/// Hugging Face weights (`config.json` beside them gives the shape), or a
/// distributed checkpoint of any layout (`step-N/`, or a checkpoint
/// directory: its latest), whose pieces are gathered into one model: a run
/// trained with tensor or pipeline parallelism or ZeRO-3 generates from its
/// checkpoint directly.
/// The third: whether a tokenizer was named (by the user, the config, the
/// checkpoint or the model's directory), not data.tokenizer's default.
/// The model's config and weights, whether a tokenizer was named, and the
/// digest of the `tokenizer.json` a checkpoint was trained with (its data
/// fingerprint's `tokenizer_content`), where it recorded one.
type Loaded = (phalanx::config::TrainConfig, Engine, bool, Option<String>);

fn load(o: &GenerateOpts) -> phalanx::Result<Loaded> {
    let named = |e: phalanx::Error| phalanx::Error::Check(format!("{}: {e}", o.model.display()));
    if o.model.is_dir() {
        if let Ok(dir) = checkpoint::find(&o.model) {
            let reader = checkpoint::Reader::open(&dir).map_err(named)?;
            reader.verify_all().map_err(named)?;
            let mut sets = dcp::model_overrides(&reader.meta)?;
            sets.extend(o.set.iter().cloned());
            let cfg = family::build(o.config.as_deref(), &sets)?;
            let engine = dcp::gather(&reader, &cfg).map_err(named)?;
            let trained_with = reader
                .meta
                .data
                .as_ref()
                .and_then(|d| d.fingerprint.get("tokenizer_content"))
                .and_then(|c| c.as_str())
                .map(str::to_string);
            return Ok((cfg, engine, true, trained_with));
        }
    }
    let mut sets = default_tokenizer_sets(&o.model, o.config.as_deref(), &o.set)?;
    sets.extend(o.set.iter().cloned());
    let tokenizer_named = o.config.is_some()
        || sets
            .iter()
            .any(|s| s.trim_start().starts_with("data.tokenizer"));
    let (cfg, _) = family::build_for_hf(o.config.as_deref(), &sets, &o.model)?;
    phalanx_models::common::backed::check_hf(&cfg, &o.model)?;
    let mut engine = train::build_engine(&cfg)?;
    family::of(&cfg)?
        .load_hf(&mut engine, &cfg, &o.model)
        .map_err(named)?;
    Ok((cfg, engine, tokenizer_named, None))
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

    /// The end-of-text token, where the tokenizer has one.
    fn eos(&self) -> Option<u32> {
        match self {
            Codec::Data(t) => t.eot_token(),
            Codec::Hf(t) => hf_tokenizer::eos_id(t),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A downloaded model directory: `config.json` of `model_type`, and a
    /// `tokenizer.json` beside it when `beside`.
    fn model_dir(name: &str, model_type: &str, vocab: usize, beside: bool) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("phalanx-gen-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let cj = serde_json::json!({"model_type": model_type, "vocab_size": vocab});
        std::fs::write(d.join("config.json"), cj.to_string()).unwrap();
        if beside {
            std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
        }
        d
    }

    #[test]
    fn a_models_own_tokenizer_json_comes_before_its_familys_default() {
        // GPT-2 of another vocabulary: the file beside it, not GPT-2's BPE.
        let d = model_dir("gpt2", "gpt2", 6, true);
        let beside = d.join("tokenizer.json").canonicalize().unwrap();
        let want = format!(
            "data.tokenizer={}",
            serde_json::Value::from(beside.display().to_string())
        );
        assert_eq!(tokenizer_sets(&d).unwrap(), vec![want.clone()]);
        // Without one, the family's default.
        std::fs::remove_file(d.join("tokenizer.json")).unwrap();
        assert_eq!(
            tokenizer_sets(&d).unwrap(),
            vec!["data.tokenizer=\"gpt2\"".to_string()]
        );
        // Named with --set or in a config file, nothing is put before it.
        std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
        let set = ["data.tokenizer=\"byte\"".to_string()];
        assert!(default_tokenizer_sets(&d, None, &set).unwrap().is_empty());
        let file = d.join("run.toml");
        std::fs::write(&file, "[data]\ntokenizer = \"byte\"\n").unwrap();
        assert!(default_tokenizer_sets(&d, Some(&file), &[])
            .unwrap()
            .is_empty());
        assert_eq!(default_tokenizer_sets(&d, None, &[]).unwrap(), vec![want]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn end_of_text_ids_come_from_both_configs_beside_the_weights() {
        let d = model_dir("eos", "llama", 10, false);
        assert!(config_eos_ids(&d).is_empty());
        let cj = serde_json::json!({"model_type": "llama", "eos_token_id": [7, 9]});
        std::fs::write(d.join("config.json"), cj.to_string()).unwrap();
        let gen = serde_json::json!({"eos_token_id": 8, "bos_token_id": 1});
        std::fs::write(d.join("generation_config.json"), gen.to_string()).unwrap();
        assert_eq!(config_eos_ids(&d), vec![7, 8, 9]);
        // A weights file names its directory's.
        assert_eq!(config_eos_ids(&d.join("model.safetensors")), vec![7, 8, 9]);
        let _ = std::fs::remove_dir_all(&d);
    }
}
