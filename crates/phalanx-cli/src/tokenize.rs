//! `phalanx tokenize`: text -> an llm.c token file with a Hugging Face
//! `tokenizer.json`, so models with an HF vocabulary (TinyLlama's 32000,
//! Llama 3's 128256) train on it with `data.path` (the loader reads llm.c
//! files whatever `data.tokenizer` says).
//!
//! The file is llm.c's `dev/data/data_common.py` format: a 256 x int32
//! header (magic, version, token count), then the tokens little-endian:
//! uint16 (magic 20240520, version 1) when every id of the vocabulary fits,
//! else uint32 (magic 20240801, version 7). The text is encoded in chunks
//! of whole lines (about 1 MB each) without special tokens; `--bos` puts
//! the tokenizer's beginning-of-sequence token first.

use clap::Args;
use phalanx::data::source::{LLMC_HEADER_BYTES, LLMC_MAGIC_GPT2, LLMC_MAGIC_LLAMA3};
use phalanx_models::hf_tokenizer;
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
pub struct TokenizeOpts {
    /// A `tokenizer.json`, or a model directory holding one.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// UTF-8 text to encode.
    pub input: PathBuf,
    /// The token file to write (llm.c `.bin`).
    pub output: PathBuf,
    /// Start with this token (e.g. `<s>`, `<|begin_of_text|>`).
    #[arg(long)]
    pub bos: Option<String>,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    pub force: bool,
}

pub fn main(o: &TokenizeOpts) -> i32 {
    match run(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx tokenize: {e}");
            1
        }
    }
}

/// The llm.c file bytes for `tokens` (uint16 when `max_id` < 65536).
pub fn llmc_bytes(tokens: &[u32], max_id: u32) -> Vec<u8> {
    let wide = max_id > u16::MAX as u32;
    let (magic, version, width) = if wide {
        (LLMC_MAGIC_LLAMA3, 7u32, 4)
    } else {
        (LLMC_MAGIC_GPT2, 1u32, 2)
    };
    let mut out = Vec::with_capacity(LLMC_HEADER_BYTES + tokens.len() * width);
    let mut header = [0u32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = tokens.len() as u32;
    header.iter().for_each(|h| out.extend(h.to_le_bytes()));
    for &t in tokens {
        if wide {
            out.extend(t.to_le_bytes());
        } else {
            out.extend((t as u16).to_le_bytes());
        }
    }
    out
}

fn run(o: &TokenizeOpts) -> Result<(), String> {
    if o.output.exists() && !o.force {
        return Err(format!(
            "{} exists (--force replaces it)",
            o.output.display()
        ));
    }
    let tj = hf_tokenizer::json_path(&o.tokenizer);
    let tok = hf_tokenizer::open(&tj).map_err(|e| e.to_string())?;
    phalanx::fsutil::regular_file("input", &o.input)?;
    let text = std::fs::read_to_string(&o.input)
        .map_err(|e| format!("{}: {e} (the input must be UTF-8 text)", o.input.display()))?;
    let mut ids: Vec<u32> = Vec::new();
    if let Some(b) = &o.bos {
        ids.push(
            tok.token_to_id(b)
                .ok_or_else(|| format!("--bos {b:?} is not a token of {}", tj.display()))?,
        );
    }
    ids.extend(hf_tokenizer::encode_corpus(&tok, &text, &tj).map_err(|e| e.to_string())?);
    if ids.len() > u32::MAX as usize {
        return Err(format!("{} tokens do not fit an llm.c header", ids.len()));
    }
    let vocab = hf_tokenizer::vocab_size(&tok) as u32;
    let max_id = ids
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(vocab.saturating_sub(1));
    write(&o.output, &llmc_bytes(&ids, max_id))?;
    println!(
        "wrote {} ({} tokens, vocabulary {vocab}, {} bits per token) from {}",
        o.output.display(),
        ids.len(),
        if max_id > u16::MAX as u32 { 32 } else { 16 },
        o.input.display()
    );
    Ok(())
}

fn write(p: &Path, bytes: &[u8]) -> Result<(), String> {
    crate::outputs::create_own_dir("output", p)?;
    phalanx::fsutil::write_atomic(p, bytes).map_err(|e| format!("{}: {e}", p.display()))
}
