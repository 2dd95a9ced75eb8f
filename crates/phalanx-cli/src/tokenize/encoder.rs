//! The tokenizer `phalanx tokenize` encodes with: a built-in one
//! (`--encoding gpt2 | byte`, as `data.tokenizer` names them) or a Hugging
//! Face `tokenizer.json` (`--tokenizer`), and the separator put before
//! every document of a sharded run.
//!
//! The separator follows llm.c's `fineweb.py`, which writes the end-of-text
//! token *before* each document (so every shard starts at a document
//! boundary of the stream, and the first token of the stream is one):
//! - `gpt2`: `<|endoftext|>` (50256);
//! - `byte`: a newline byte, the token the trainer's byte tokenizer
//!   separates documents with (it has no special tokens);
//! - a `tokenizer.json`: `--bos TOKEN` when given (e.g. `<s>`,
//!   `<|begin_of_text|>` for Llama-style data), else the first of
//!   `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` it holds (the list
//!   the trainer's `HfEncoder` uses), else an error asking for `--bos`.

use phalanx::data::Tokenizer;
use phalanx_models::hf_tokenizer;
use std::path::{Path, PathBuf};

/// End-of-text names looked for in a `tokenizer.json`, in order.
const EOT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

enum Kind {
    Builtin(Tokenizer),
    Hf {
        // Boxed: a tokenizer is large, and the enum is built once.
        tok: Box<hf_tokenizer::Tokenizer>,
        path: PathBuf,
    },
}

pub struct Encoder {
    kind: Kind,
    sep: Vec<u32>,
    /// How the separator was chosen, for the summary line.
    sep_name: String,
    vocab: usize,
}

impl Encoder {
    /// The tokenizer `--tokenizer` or `--encoding` names (exactly one is
    /// given: clap checks it), without a separator yet.
    pub fn open(tokenizer: Option<&Path>, encoding: Option<&str>) -> Result<Encoder, String> {
        let kind = match (tokenizer, encoding) {
            (Some(p), None) => {
                let path = hf_tokenizer::json_path(p);
                let tok = hf_tokenizer::open(&path).map_err(|e| e.to_string())?;
                Kind::Hf {
                    tok: Box::new(tok),
                    path,
                }
            }
            (None, Some(name)) => Kind::Builtin(Tokenizer::from_name(name).map_err(|_| {
                format!("--encoding {name:?}: unknown, expected one of gpt2, byte")
            })?),
            _ => return Err("give exactly one of --tokenizer and --encoding".into()),
        };
        let vocab = match &kind {
            Kind::Builtin(t) => t.vocab_size(),
            Kind::Hf { tok, .. } => hf_tokenizer::vocab_size(tok),
        };
        Ok(Encoder {
            kind,
            sep: Vec::new(),
            sep_name: String::new(),
            vocab,
        })
    }

    /// Choose the document separator (see the module docs).
    pub fn choose_separator(&mut self, bos: Option<&str>) -> Result<(), String> {
        let (id, name) = match (&self.kind, bos) {
            (Kind::Builtin(t), Some(b)) => {
                return Err(format!(
                    "--bos {b:?} is for --tokenizer; --encoding {} separates documents with \
                     its own token",
                    t.name()
                ))
            }
            (Kind::Builtin(t), None) => match t.eot_token() {
                Some(id) => (id, "<|endoftext|>".to_string()),
                None => (u32::from(b'\n'), "a newline byte".to_string()),
            },
            (Kind::Hf { tok, path }, Some(b)) => (
                tok.token_to_id(b)
                    .ok_or_else(|| format!("--bos {b:?} is not a token of {}", path.display()))?,
                b.to_string(),
            ),
            (Kind::Hf { tok, path }, None) => EOT_NAMES
                .iter()
                .find_map(|n| tok.token_to_id(n).map(|id| (id, n.to_string())))
                .ok_or_else(|| {
                    format!(
                        "{} has none of the end-of-text tokens {EOT_NAMES:?}: give --bos TOKEN \
                         to put before every document",
                        path.display()
                    )
                })?,
        };
        self.sep = vec![id];
        self.sep_name = format!("{name} ({id})");
        Ok(())
    }

    /// `text` as token ids, without special tokens (a `tokenizer.json`
    /// encodes in chunks of whole lines, as the single-file form does).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.kind {
            Kind::Builtin(t) => Ok(t.encode(text)),
            Kind::Hf { tok, path } => {
                hf_tokenizer::encode_corpus(tok, text, path).map_err(|e| e.to_string())
            }
        }
    }

    /// The id of a named token (`--bos` of the single-file form).
    pub fn token_id(&self, name: &str) -> Option<u32> {
        match &self.kind {
            Kind::Builtin(t) => t.eot_token().filter(|_| name == "<|endoftext|>"),
            Kind::Hf { tok, .. } => tok.token_to_id(name),
        }
    }

    /// Tokens put before every document.
    pub fn separator(&self) -> &[u32] {
        &self.sep
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether the files need uint32 tokens (an id past 65535 exists).
    pub fn wide(&self) -> bool {
        let max = (self.vocab.saturating_sub(1) as u64)
            .max(self.sep.iter().copied().max().unwrap_or(0) as u64);
        max > u16::MAX as u64
    }

    /// What it is, in words: `gpt2` or the `tokenizer.json` path.
    pub fn name(&self) -> String {
        match &self.kind {
            Kind::Builtin(t) => t.name().to_string(),
            Kind::Hf { path, .. } => path.display().to_string(),
        }
    }

    pub fn separator_name(&self) -> &str {
        &self.sep_name
    }

    /// What identifies it in a resumable run's state: the built-in name,
    /// or the file's resolved path, size and content hash (an edited
    /// vocabulary with the same name is another tokenizer).
    pub fn identity(&self) -> Result<serde_json::Value, String> {
        Ok(match &self.kind {
            Kind::Builtin(t) => serde_json::json!({ "encoding": t.name() }),
            Kind::Hf { path, .. } => {
                let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
                serde_json::json!({
                    "tokenizer": crate::outputs::resolve(path).display().to_string(),
                    "bytes": bytes.len(),
                    "fnv1a64": format!("{:016x}", fnv1a64(&bytes)),
                })
            }
        })
    }
}

/// FNV-1a, 64 bits: a stable content hash (std's hasher may change
/// between Rust releases, and the state outlives the binary).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
