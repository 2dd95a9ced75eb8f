//! The data a training config describes, for any family: samples of the
//! model's context, every token checked against its vocabulary.

use crate::hf_tokenizer;
use phalanx::config::{TokenizerSpec, TrainConfig};
use phalanx::data::{DataLoader, LoaderConfig, TokenData, Tokenizer};
use phalanx::{Error, Result};
use std::path::Path;

/// `data.path`'s default.
pub const DEFAULT_CORPUS_PATH: &str = "data/corpus.txt";

/// The shipped corpus (World English Bible, public domain; 4.7 MiB).
pub static BUILTIN_CORPUS: &[u8] = include_bytes!("../../../../data/corpus.txt");

/// The data loader `cfg.data` describes, for any model: samples of
/// `seq_len` tokens, every token checked to be below `vocab_size`.
///
/// `data.tokenizer` naming a `tokenizer.json` encodes a text file with it
/// (its vocabulary checked against `vocab_size` first); token files
/// (`.bin`) are read as they are, whatever the tokenizer.
pub fn open_data_for(cfg: &TrainConfig, seq_len: usize, vocab_size: usize) -> Result<DataLoader> {
    let lc = LoaderConfig {
        seq_len,
        val_fraction: cfg.data.val_fraction,
        shuffle: cfg.data.shuffle,
        seed: cfg.data.seed,
        vocab_size: Some(vocab_size),
    };
    if cfg.data.uses_corpus() {
        let encoder: std::sync::Arc<dyn phalanx::data::TextEncoder> = match &cfg.data.tokenizer {
            TokenizerSpec::Builtin(t) => std::sync::Arc::new(*t),
            TokenizerSpec::HfJson(j) => std::sync::Arc::new(
                hf_tokenizer::HfEncoder::new(
                    hf_tokenizer::open_for_model(Path::new(j), vocab_size)?,
                    j,
                )
                .map_err(|e| phalanx::Error::Data(phalanx::data::DataError::Tokenizer(e)))?,
            ),
        };
        let cc = cfg.data.corpus_config(seq_len, Some(vocab_size), encoder);
        return Ok(DataLoader::from_corpus(phalanx::data::Corpus::open(&cc)?));
    }
    let data_path = cfg.data.path.to_string();
    let path = Path::new(&data_path);
    let is_bin = path.extension().is_some_and(|e| e == "bin");
    let tok = match (&cfg.data.tokenizer, is_bin) {
        (TokenizerSpec::Builtin(t), _) => *t,
        // A token file: the loader reads its ids (the tokenizer only
        // matters for text), but a tokenizer too big for the model is
        // still a mistake worth naming.
        (TokenizerSpec::HfJson(j), true) => {
            hf_tokenizer::open_for_model(Path::new(j), vocab_size)?;
            Tokenizer::Byte
        }
        (TokenizerSpec::HfJson(j), false) => {
            let hf = hf_tokenizer::open_for_model(Path::new(j), vocab_size)?;
            let text = if cfg.data.path == DEFAULT_CORPUS_PATH && !path.exists() {
                String::from_utf8_lossy(BUILTIN_CORPUS).into_owned()
            } else {
                // A FIFO would hang the read, /dev/zero fill the memory.
                phalanx::fsutil::regular_file("data.path", path).map_err(Error::Check)?;
                phalanx::data::paths::refuse_compressed(path, "data.path")?;
                std::fs::read_to_string(path).map_err(|e| {
                    Error::Check(format!(
                        "data.path {}: {e} (a text file to encode with data.tokenizer {j})",
                        path.display()
                    ))
                })?
            };
            let ids = hf_tokenizer::encode_corpus(&hf, &text, Path::new(j))?;
            // The file, its content and the tokenizer's go into the resume
            // fingerprint, as for a file the loader encodes itself.
            let content = hf_tokenizer::content_of(Path::new(j));
            let data = if path.exists() {
                TokenData::encoded_from(ids, path, content)
            } else {
                TokenData::from_tokens(ids)
            };
            return Ok(DataLoader::new(data, lc)?);
        }
    };
    // The default corpus is built in, so `phalanx train` works from any
    // directory; a file at the path (the repository's copy) is used first.
    if cfg.data.path == DEFAULT_CORPUS_PATH && !path.exists() {
        let data = TokenData::from_text(BUILTIN_CORPUS.to_vec(), tok, path)?;
        return Ok(DataLoader::new(data, lc)?);
    }
    if !is_bin {
        phalanx::data::text::check_fits(&tok, vocab_size)?;
    }
    Ok(DataLoader::open(path, tok, lc)?)
}
