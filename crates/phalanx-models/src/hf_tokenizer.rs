//! Hugging Face `tokenizer.json` files (the `tokenizers` crate): opening
//! one with errors that name it, its vocabulary size, and encoding a text
//! corpus the way `phalanx tokenize` and `data.tokenizer = "x/tokenizer.json"`
//! do (in chunks of whole lines, without special tokens).
//!
//! ```no_run
//! use phalanx_models::hf_tokenizer;
//! let tok = hf_tokenizer::open("TinyLlama/tokenizer.json".as_ref()).unwrap();
//! let ids = hf_tokenizer::encode_corpus(&tok, "And God said\n", "TinyLlama/tokenizer.json".as_ref()).unwrap();
//! assert!(ids.iter().all(|&i| (i as usize) < hf_tokenizer::vocab_size(&tok)));
//! ```

use phalanx::config::TokenizerSpec;
use phalanx::{Error, Result};
use std::path::{Path, PathBuf};

pub use tokenizers::Tokenizer;

/// The `tokenizer.json` a path names: the file, or the one in a directory.
pub fn json_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

/// Open a `tokenizer.json` (or a directory holding one).
pub fn open(path: &Path) -> Result<Tokenizer> {
    let p = json_path(path);
    if !p.is_file() {
        return Err(Error::Check(format!(
            "{}: no such tokenizer.json",
            p.display()
        )));
    }
    let mut tok = Tokenizer::from_file(&p).map_err(|e| {
        Error::Check(format!(
            "{}: not a Hugging Face tokenizer.json ({e})",
            p.display()
        ))
    })?;
    // A file saved with truncation or padding on (a fine-tuning set-up)
    // would apply them inside every encode: a corpus chunk cut to
    // `max_length` or filled with pad ids. Corpora and prompts are whole.
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| Error::Check(format!("{}: {e}", p.display())))?;
    Ok(tok)
}

/// Ids the tokenizer can produce: its vocabulary with the added tokens,
/// as the highest id + 1 (a vocabulary may skip ids: its count would leave
/// the highest out).
pub fn vocab_size(tok: &Tokenizer) -> usize {
    tok.get_vocab(true)
        .values()
        .max()
        .map_or(0, |&m| m as usize + 1)
}

/// The end-of-text token a tokenizer.json holds, if any (most specific
/// first: see [`special_ids`]).
pub fn eos_id(tok: &Tokenizer) -> Option<u32> {
    EOS_TOKENS.iter().find_map(|t| tok.token_to_id(t))
}

/// `text` encoded without special tokens, in chunks of whole lines of
/// about 1 MB (only chunk starts can tokenize differently from one long
/// encode); `name` goes into errors.
pub fn encode_corpus(tok: &Tokenizer, text: &str, name: &Path) -> Result<Vec<u32>> {
    encode_text(tok, text).map_err(|e| Error::Check(format!("{}: {e}", name.display())))
}

/// What every path encodes a document with (the trainer's text sources,
/// its single text file, `phalanx tokenize`), so that they give the same
/// ids: without special tokens, a document over 1 MB in pieces cut after a
/// newline (one long encode holds ~100 bytes per token). A piece's start
/// can tokenize differently from one long encode: a Metaspace tokenizer
/// (Llama 2's) puts its `▁` there.
fn encode_text(tok: &Tokenizer, text: &str) -> std::result::Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for chunk in chunks(text, 1 << 20) {
        let enc = tok.encode(chunk, false).map_err(|e| e.to_string())?;
        ids.extend_from_slice(enc.get_ids());
    }
    Ok(ids)
}

/// `text` cut after a newline every `size` bytes or so.
fn chunks(text: &str, size: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > size {
        let mut at = size;
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        let cut = rest[at..].find('\n').map_or(rest.len(), |i| at + i + 1);
        out.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

/// The digest of the `tokenizer.json` that `path` names (a file, or a
/// directory holding one), for the data fingerprint; `None` where there is
/// none to read.
pub fn content_of(path: &Path) -> Option<String> {
    phalanx::data::digest::of_whole_file(&json_path(path)).ok()
}

/// A `tokenizer.json` as the loader's text encoder (JSONL and text
/// sources): documents without special tokens, each followed by the
/// tokenizer's end-of-text token (the first of `<|endoftext|>`,
/// `<|end_of_text|>`, `</s>`, `<eos>` it knows; else a newline).
pub struct HfEncoder {
    tok: Tokenizer,
    sep: Vec<u32>,
    name: String,
    /// The digest of the tokenizer.json at `name` (where it is a file).
    content: Option<String>,
}

impl HfEncoder {
    /// An error where the tokenizer has no end-of-text token and cannot
    /// encode a newline either: documents would run together unseparated.
    pub fn new(tok: Tokenizer, name: &str) -> std::result::Result<HfEncoder, String> {
        let eot = EOS_TOKENS
            .iter()
            .find_map(|t| tok.token_to_id(t))
            .map(|id| vec![id]);
        let sep = match eot {
            Some(s) => s,
            None => tok
                .encode("\n", false)
                .map(|e| e.get_ids().to_vec())
                .ok()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    format!(
                        "{name}: the tokenizer has no end-of-text token (<|endoftext|>, \
                         <|end_of_text|>, </s>, <eos>) and cannot encode a newline to put \
                         between documents"
                    )
                })?,
        };
        Ok(HfEncoder {
            tok,
            sep,
            name: name.to_string(),
            content: content_of(Path::new(name)),
        })
    }
}

impl phalanx::data::TextEncoder for HfEncoder {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        // A text this tokenizer fails on (a word-level vocabulary without
        // an unknown token, say) is a bad record, not an empty document.
        encode_text(&self.tok, text).map_err(|e| format!("tokenizer {}: {e}", self.name))
    }
    fn separator(&self) -> Vec<u32> {
        self.sep.clone()
    }
    fn content(&self) -> Option<String> {
        self.content.clone()
    }
    fn name(&self) -> String {
        self.name.clone()
    }
}

/// The tokenizer `data.tokenizer` names, checked to fit a model of
/// `vocab_size` ids (an error names the file, its vocabulary and the key).
pub fn open_for_model(path: &Path, model_vocab: usize) -> Result<Tokenizer> {
    let tok = open(path)?;
    let name = json_path(path).display().to_string();
    phalanx::data::text::vocab_fits(&name, vocab_size(&tok), model_vocab).map_err(Error::Check)?;
    Ok(tok)
}

/// The end-of-text tokens a tokenizer.json may hold, most specific first.
const EOS_TOKENS: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];
/// Its beginning-of-text tokens (GPT-2 and Qwen2 use the end-of-text one).
const BOS_TOKENS: [&str; 4] = ["<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"];

/// `bos_token_id` and `eos_token_id` of a model trained with `spec`, for
/// its exported `config.json` (transformers' `generate` stops at the eos;
/// without the keys Llama's config class assumes 1 and 2, ids of ordinary
/// tokens in other vocabularies): GPT-2's BPE has `<|endoftext|>`, the
/// byte tokenizer none (null), a `tokenizer.json` what it holds.
pub fn special_ids(spec: &TokenizerSpec) -> Result<(Option<u32>, Option<u32>)> {
    Ok(match (spec.builtin(), spec.json_path()) {
        (Some(t), _) => (t.eot_token(), t.eot_token()),
        (None, Some(p)) => {
            let tok = open(p)?;
            let bos = BOS_TOKENS.iter().find_map(|t| tok.token_to_id(t));
            (bos, eos_id(&tok))
        }
        (None, None) => (None, None),
    })
}

/// Put [`special_ids`] into an exported `config.json` object.
pub fn set_special_ids(config: &mut serde_json::Value, spec: &TokenizerSpec) -> Result<()> {
    let (bos, eos) = special_ids(spec)?;
    if let Some(o) = config.as_object_mut() {
        o.insert("bos_token_id".into(), bos.into());
        o.insert("eos_token_id".into(), eos.into());
    }
    Ok(())
}

/// With `data.tokenizer` naming a `tokenizer.json`, copy it into `dir`
/// (as `save_pretrained` saves a tokenizer with its model), so `phalanx
/// generate` and transformers find it beside the weights.
pub fn save_beside(spec: &TokenizerSpec, dir: &Path) -> Result<()> {
    let Some(p) = spec.json_path() else {
        return Ok(());
    };
    let src = json_path(p);
    let dst = dir.join("tokenizer.json");
    if let (Ok(a), Ok(b)) = (src.canonicalize(), dst.canonicalize()) {
        if a == b {
            return Ok(());
        }
    }
    let bytes = std::fs::read(&src)
        .map_err(|e| Error::Io(format!("data.tokenizer {}: {e}", src.display())))?;
    phalanx::fsutil::write_atomic(&dst, &bytes)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{chunks, HfEncoder};
    use phalanx::data::TextEncoder;

    /// A word-level vocabulary with `</s>` and no unknown token.
    const WORDS: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
      "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "",
                "vocab": {"in": 1, "the": 2, "beginning": 3, "</s>": 4}}
    }"#;

    #[test]
    fn a_word_the_vocabulary_lacks_is_an_error_not_an_empty_document() {
        let tok: tokenizers::Tokenizer = WORDS.parse().unwrap();
        let enc = HfEncoder::new(tok, "words.json").unwrap();
        assert_eq!(enc.separator(), [4]);
        assert_eq!(enc.encode("in the beginning").unwrap(), [1, 2, 3]);
        // Ids 1-4 (none is 0): the highest id + 1, not the count of 4.
        let tok: tokenizers::Tokenizer = WORDS.parse().unwrap();
        assert_eq!(super::vocab_size(&tok), 5);
        assert_eq!(super::eos_id(&tok), Some(4));
        let e = enc.encode("in the end").unwrap_err();
        assert!(e.contains("words.json"), "{e}");
    }

    /// The trainer's text sources and `phalanx tokenize` (and the single
    /// text file) encode a document alike, past the 1 MB pieces too.
    #[test]
    fn every_path_encodes_a_long_document_alike() {
        let tok: tokenizers::Tokenizer = WORDS.parse().unwrap();
        let enc = HfEncoder::new(tok, "words.json").unwrap();
        let doc = "in the beginning\n".repeat(200_000); // 3.4 MB
        let tok: tokenizers::Tokenizer = WORDS.parse().unwrap();
        let ids = super::encode_corpus(&tok, &doc, std::path::Path::new("w")).unwrap();
        assert_eq!(ids.len(), 600_000);
        assert_eq!(enc.encode(&doc).unwrap(), ids);
    }

    #[test]
    fn truncation_and_padding_in_the_file_are_turned_off() {
        let json = WORDS
            .replace(
                r#""truncation": null"#,
                r#""truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}"#,
            )
            .replace(
                r#""padding": null"#,
                r#""padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 4, "pad_type_id": 0, "pad_token": "</s>"}"#,
            );
        let dir = std::env::temp_dir().join(format!("phalanx-tok-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, json).unwrap();
        // As the file says: cut to 2, padded to 8.
        let raw = tokenizers::Tokenizer::from_file(&p).unwrap();
        assert_eq!(
            raw.encode("in the beginning", false).unwrap().get_ids(),
            [1, 2, 4, 4, 4, 4, 4, 4]
        );
        let tok = super::open(&p).unwrap();
        let ids = super::encode_corpus(&tok, "in the beginning in the", &p).unwrap();
        assert_eq!(ids, [1, 2, 3, 1, 2]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn exported_configs_get_the_tokenizers_special_ids() {
        use phalanx::config::TokenizerSpec;
        use phalanx::data::Tokenizer;
        let ids = |spec: &TokenizerSpec| super::special_ids(spec).unwrap();
        assert_eq!(
            ids(&TokenizerSpec::Builtin(Tokenizer::Gpt2)),
            (Some(50256), Some(50256))
        );
        assert_eq!(ids(&TokenizerSpec::Builtin(Tokenizer::Byte)), (None, None));
        let dir = std::env::temp_dir().join(format!("phalanx-tok-special-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, WORDS).unwrap();
        let spec = TokenizerSpec::HfJson(p.display().to_string());
        assert_eq!(ids(&spec), (None, Some(4)));
        let mut v = serde_json::json!({"model_type": "llama"});
        super::set_special_ids(&mut v, &spec).unwrap();
        assert_eq!(v["eos_token_id"], 4);
        assert!(v["bos_token_id"].is_null());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chunks_are_whole_lines_and_cover_the_text() {
        let text = "ab\ncd\nef\ngh";
        let c = chunks(text, 2);
        assert_eq!(c, ["ab\n", "cd\n", "ef\n", "gh"]);
        assert_eq!(c.concat(), text);
        assert_eq!(chunks("", 4), Vec::<&str>::new());
        // A cut inside a character moves to its end.
        assert_eq!(chunks("é\nb", 1), ["é\n", "b"]);
    }
}
