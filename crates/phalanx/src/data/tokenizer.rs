//! Tokenizers: byte-level (token = byte) and GPT-2 BPE.
//!
//! The GPT-2 tokenizer is tiktoken's `r50k_base` from the `tiktoken-rs` crate,
//! whose merge ranks are compiled into the binary: nothing is downloaded.
//!
//! ```
//! use phalanx::data::Tokenizer;
//! let gpt2 = Tokenizer::from_name("gpt2").unwrap();
//! assert_eq!(gpt2.encode("Hello world"), vec![15496, 995]);
//! let byte = Tokenizer::from_name("byte").unwrap();
//! assert_eq!(byte.decode(&byte.encode("héllo")).unwrap(), "héllo");
//! ```

use super::error::{DataError, Result};
use tiktoken_rs::CoreBPE;

/// A tokenizer, chosen by name ("byte" | "gpt2").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// Vocabulary of 256: each UTF-8 byte is one token.
    Byte,
    /// GPT-2's byte-level BPE (r50k_base), vocabulary of 50257.
    Gpt2,
}

/// The GPT-2 ranks are parsed on first use (about 0.1 s), then shared.
fn gpt2_bpe() -> &'static CoreBPE {
    tiktoken_rs::r50k_base_singleton()
}

impl Tokenizer {
    /// The names accepted by [`Tokenizer::from_name`].
    pub const NAMES: [&'static str; 2] = ["byte", "gpt2"];

    /// Builds a tokenizer from its name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "byte" => Ok(Tokenizer::Byte),
            // r50k_base is the name tiktoken gives GPT-2's encoding.
            "gpt2" | "r50k_base" => Ok(Tokenizer::Gpt2),
            other => Err(DataError::Tokenizer(format!(
                "unknown tokenizer {other:?}, expected one of {:?}",
                Self::NAMES
            ))),
        }
    }

    /// The canonical name ("byte" or "gpt2").
    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Byte => "byte",
            Tokenizer::Gpt2 => "gpt2",
        }
    }

    /// Number of distinct token ids this tokenizer produces.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => 256,
            Tokenizer::Gpt2 => 50257,
        }
    }

    /// The end-of-text token, where the tokenizer has one.
    pub fn eot_token(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Gpt2 => Some(50256),
        }
    }

    /// Encodes text. Special-token strings such as `<|endoftext|>` in the text
    /// are encoded as plain text, as nanoGPT's `encode_ordinary` does.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => encode_gpt2(gpt2_bpe(), text),
        }
    }

    /// Decodes tokens to text. Byte sequences that are not valid UTF-8 (a
    /// sample cut inside a character) become U+FFFD instead of failing.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        let bytes = match self {
            Tokenizer::Byte => tokens
                .iter()
                .map(|&t| u8::try_from(t).map_err(|_| out_of_vocab(t, 256)))
                .collect::<Result<Vec<u8>>>()?,
            Tokenizer::Gpt2 => gpt2_bpe()
                .decode_bytes(tokens)
                .map_err(|e| DataError::Tokenizer(format!("gpt2 decode: {e:?}")))?,
        };
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

fn out_of_vocab(token: u32, vocab: usize) -> DataError {
    DataError::Tokenizer(format!("token {token} is not in a vocabulary of {vocab}"))
}

/// GPT-2's pre-tokenizer regex always splits between a non-space character
/// and a following '\n', and BPE merges never cross its pieces, so the text is
/// cut into chunks at such points and the chunks are encoded on all cores; the
/// result is identical to encoding the whole text at once. (A cut after the
/// '\n' would not be: `\s++$` would then merge trailing newlines.)
fn encode_gpt2(bpe: &CoreBPE, text: &str) -> Vec<u32> {
    const CHUNK: usize = 1 << 18;
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let end = split_point(text, start + CHUNK);
        chunks.push(&text[start..end]);
        start = end;
    }
    if chunks.len() <= 1 {
        return bpe.encode_ordinary(text);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = chunks.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .chunks(per_thread)
            .map(|group| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    for c in group {
                        out.extend(bpe.encode_ordinary(c));
                    }
                    out
                })
            })
            .collect();
        let mut tokens = Vec::new();
        for h in handles {
            tokens.extend(h.join().expect("gpt2 encode thread panicked"));
        }
        tokens
    })
}

/// The first index at or after `from` that holds a '\n' preceded by a
/// non-whitespace character, or the end of the text.
fn split_point(text: &str, from: usize) -> usize {
    let bytes = text.as_bytes();
    let mut i = from.max(1);
    while i < bytes.len() {
        // A '\n' byte is always a char boundary in UTF-8.
        if bytes[i] == b'\n' {
            let prev = text[..i].chars().next_back().unwrap_or(' ');
            if !prev.is_whitespace() {
                return i;
            }
        }
        i += 1;
    }
    bytes.len()
}
