//! The single-file form, `phalanx tokenize (--tokenizer T | --encoding E)
//! INPUT OUTPUT [--bos TOK] [--force]`: one UTF-8 text file encoded whole
//! (no document separators) into one llm.c file; `--bos` puts that token
//! first. A `tokenizer.json` encodes in chunks of whole lines (about 1 MB
//! each), as `data.tokenizer` does.

use super::encoder::Encoder;
use super::shard::{llmc_bytes, MAX_SHARD_TOKENS};
use super::TokenizeOpts;
use std::path::Path;

pub fn run(o: &TokenizeOpts, input: &Path, output: &Path) -> Result<(), String> {
    let mut io = crate::outputs::Io::new();
    io.input("input", input).output("OUTPUT", output);
    // The tokenizer.json is an input too (`--tokenizer tok.json text
    // tok.json --force` would replace it).
    let tok = o
        .tokenizer
        .as_deref()
        .map(phalanx_models::hf_tokenizer::json_path);
    if let Some(t) = &tok {
        io.input("--tokenizer", t);
    }
    // (After the checks that `--force` does not lift: an output that is
    // an input, or a directory.)
    io.check()?;
    if output.exists() && !o.force {
        return Err(format!("{} exists (--force replaces it)", output.display()));
    }
    let records =
        phalanx::data::records::is_jsonl(input) || phalanx::data::records::is_parquet(input);
    if records {
        return Err(format!(
            "{} holds records (one document each), and this form encodes one text file whole: \
             use `phalanx tokenize --output-dir DIR {}` for its documents",
            input.display(),
            input.display()
        ));
    }
    phalanx::data::paths::refuse_compressed(input, "input").map_err(|e| e.to_string())?;
    let enc = Encoder::open(o.tokenizer.as_deref(), o.encoding.as_deref())?;
    phalanx::fsutil::regular_file("input", input)?;
    let text = std::fs::read_to_string(input)
        .map_err(|e| format!("{}: {e} (the input must be UTF-8 text)", input.display()))?;
    let mut ids: Vec<u32> = Vec::new();
    if let Some(b) = &o.bos {
        ids.push(
            enc.token_id(b)
                .ok_or_else(|| format!("--bos {b:?} is not a token of {}", enc.name()))?,
        );
    }
    let encoded = enc.encode(&text)?;
    if encoded.is_empty() {
        // The trainer refuses a file of no tokens: say so here.
        return Err(format!(
            "{} holds no text to encode ({} bytes): nothing written",
            input.display(),
            text.len()
        ));
    }
    ids.extend(encoded);
    if ids.len() as u64 > MAX_SHARD_TOKENS {
        return Err(format!(
            "{} tokens do not fit an llm.c header: use --output-dir for shards",
            ids.len()
        ));
    }
    let vocab = enc.vocab() as u32;
    let max_id = ids
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(vocab.saturating_sub(1));
    crate::outputs::create_own_dir("output", output)?;
    phalanx::fsutil::write_atomic(output, &llmc_bytes(&ids, max_id)).map_err(|e| e.to_string())?;
    println!(
        "wrote {} ({} tokens, vocabulary {vocab}, {} bits per token) from {}",
        output.display(),
        ids.len(),
        if max_id > u16::MAX as u32 { 32 } else { 16 },
        input.display()
    );
    Ok(())
}
