//! Token files, tokenizers and the shipped corpus of `phalanx::data`.

use phalanx::data::source::{LLMC_MAGIC_GPT2, LLMC_MAGIC_LLAMA3};
use phalanx::data::{DataError, DataLoader, Format, LoaderConfig, TokenData, Tokenizer};
use std::path::{Path, PathBuf};

/// A fresh directory per test (tests run in parallel threads).
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("phalanx-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes an llm.c token file: 256 int32 header, then the tokens.
fn write_llmc(path: &Path, magic: u32, version: u32, count: u32, tokens: &[u32], width: usize) {
    let mut header = [0u32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    let mut bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
    for &t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes()[..width]);
    }
    std::fs::write(path, bytes).unwrap();
}

fn tokens_of(d: &TokenData) -> Vec<u32> {
    let mut out = Vec::new();
    d.copy_range(0, d.len(), &mut out);
    out
}

#[test]
fn llmc_uint16_file() {
    let dir = temp_dir("llmc16");
    let path = dir.join("train.bin");
    let tokens: Vec<u32> = vec![50256, 15496, 995, 0, 65535];
    write_llmc(&path, LLMC_MAGIC_GPT2, 1, 5, &tokens, 2);
    let d = TokenData::open(&path, Tokenizer::Byte).unwrap();
    assert_eq!(d.format(), Format::LlmcU16);
    assert_eq!(tokens_of(&d), tokens);
    assert_eq!(d.get(1), 15496);
    assert!(d.as_u32_slice().is_none()); // uint16 on disk: read through accessors
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn llmc_uint32_file() {
    let dir = temp_dir("llmc32");
    let path = dir.join("train.bin");
    let tokens: Vec<u32> = vec![128000, 70000, 1, 2];
    write_llmc(&path, LLMC_MAGIC_LLAMA3, 7, 4, &tokens, 4);
    let d = TokenData::open(&path, Tokenizer::Byte).unwrap();
    assert_eq!(d.format(), Format::LlmcU32);
    assert_eq!(tokens_of(&d), tokens);
    if cfg!(target_endian = "little") {
        assert_eq!(d.as_u32_slice().unwrap(), &tokens[..]); // zero-copy view of the map
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn llmc_bad_headers_are_errors() {
    let dir = temp_dir("llmcbad");
    let path = dir.join("bad.bin");
    write_llmc(&path, LLMC_MAGIC_GPT2, 2, 3, &[1, 2, 3], 2);
    let m = TokenData::open(&path, Tokenizer::Byte)
        .unwrap_err()
        .to_string();
    assert!(m.contains("version 1") && m.contains("found 2"), "{m}");
    write_llmc(&path, LLMC_MAGIC_GPT2, 1, 4, &[1, 2, 3], 2); // header says 4, file holds 3
    let m = TokenData::open(&path, Tokenizer::Byte)
        .unwrap_err()
        .to_string();
    assert!(m.contains("4 tokens") && m.contains("1030 bytes"), "{m}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn nanogpt_raw_uint16_file() {
    let dir = temp_dir("nanogpt");
    let path = dir.join("val.BIN");
    let tokens: Vec<u32> = (0..600).map(|i| i * 100 % 50257).collect();
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| (t as u16).to_le_bytes())
        .collect();
    std::fs::write(&path, &bytes).unwrap();
    let d = TokenData::open(&path, Tokenizer::Byte).unwrap();
    assert_eq!(d.format(), Format::NanoGpt);
    assert_eq!(tokens_of(&d), tokens);
    let mut part = Vec::new();
    d.copy_range(10, 13, &mut part);
    assert_eq!(part, tokens[10..13]);
    // The vocabulary check names the file.
    let e = DataLoader::new(
        d,
        phalanx::data::LoaderConfig {
            seq_len: 4,
            val_fraction: 0.0,
            vocab_size: Some(256),
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("val.BIN") && e.contains("vocab_size 256"), "{e}");
    // Beside a Megatron-LM index it is refused, not read as uint16.
    std::fs::write(dir.join("val.idx"), b"MMIDIDX").unwrap();
    let e = TokenData::open(&path, Tokenizer::Byte)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Megatron-LM"), "{e}");
    std::fs::remove_file(dir.join("val.idx")).unwrap();
    // An odd number of bytes cannot be uint16 tokens.
    std::fs::write(&path, &bytes[..5]).unwrap();
    let e = TokenData::open(&path, Tokenizer::Byte).unwrap_err();
    assert!(matches!(e, DataError::Format { .. }), "{e}");
    // An empty file has no tokens, and a loader says it is too short.
    std::fs::write(&path, []).unwrap();
    let e = DataLoader::open(&path, Tokenizer::Byte, LoaderConfig::default()).unwrap_err();
    assert!(e.to_string().contains("0 tokens"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn text_files_use_the_tokenizer() {
    let dir = temp_dir("text");
    let path = dir.join("tiny.txt");
    std::fs::write(&path, "Hello world").unwrap();
    let gpt2 = Tokenizer::from_name("gpt2").unwrap();
    let d = TokenData::open(&path, gpt2).unwrap();
    assert_eq!(d.format(), Format::Text);
    assert_eq!(d.as_u32_slice().unwrap(), &[15496, 995]);
    let d = TokenData::open(&path, Tokenizer::Byte).unwrap();
    assert_eq!(d.len(), 11);
    // Invalid UTF-8 is an error for gpt2 but fine for bytes.
    std::fs::write(&path, [b'a', 0xFF, b'b']).unwrap();
    let m = TokenData::open(&path, gpt2).unwrap_err().to_string();
    assert!(m.contains("UTF-8 at byte 1"), "{m}");
    assert_eq!(TokenData::open(&path, Tokenizer::Byte).unwrap().get(1), 255);
    // A missing file names its path.
    let m = TokenData::open(dir.join("missing.txt"), gpt2)
        .unwrap_err()
        .to_string();
    assert!(m.contains("missing.txt"), "{m}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn byte_tokenizer_round_trip() {
    let t = Tokenizer::from_name("byte").unwrap();
    let text = "Hello, wörld! ✓ \n\t end";
    let ids = t.encode(text);
    assert_eq!(ids.len(), text.len());
    assert_eq!(ids[0], b'H' as u32);
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!(t.vocab_size(), 256);
    assert!(t.decode(&[300]).is_err());
}

#[test]
fn gpt2_known_ids() {
    let t = Tokenizer::from_name("gpt2").unwrap();
    assert_eq!(t.name(), "gpt2");
    assert_eq!(t.vocab_size(), 50257);
    assert_eq!(t.eot_token(), Some(50256));
    assert_eq!(t.encode("Hello world"), vec![15496, 995]);
    assert_eq!(t.encode("\n\n"), vec![628]);
    assert_eq!(t.decode(&[15496, 995]).unwrap(), "Hello world");
    // The special token's text is plain text here (encode_ordinary).
    assert_ne!(t.encode("<|endoftext|>"), vec![50256]);
    assert_eq!(t.decode(&[50256]).unwrap(), "<|endoftext|>");
    let m = Tokenizer::from_name("bpe").unwrap_err().to_string();
    assert!(m.contains("\"bpe\"") && m.contains("gpt2"), "{m}");
}

#[test]
fn gpt2_chunked_encoding_equals_whole_encoding() {
    // Texts long enough to be cut into chunks, with the cases that could
    // break at a cut: blank lines, trailing and leading spaces, tabs,
    // non-ASCII whitespace and letters.
    let bpe = tiktoken_rs::r50k_base_singleton();
    let t = Tokenizer::from_name("gpt2").unwrap();
    let unit = "Word, 'tis  \n\n  indented line\t\n\u{3000}ideographic space\nÉcole 123\n\n\n";
    let text = unit.repeat(20_000);
    assert_eq!(t.encode(&text), bpe.encode_ordinary(&text));
    let corpus = std::fs::read_to_string(corpus_path()).unwrap();
    let ids = t.encode(&corpus);
    assert_eq!(ids, bpe.encode_ordinary(&corpus));
    assert_eq!(t.decode(&ids).unwrap(), corpus);
}

fn corpus_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")
}

#[test]
fn shipped_corpus_loads() {
    let path = corpus_path();
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(
        (1_000_000..=5_000_000).contains(&size),
        "corpus is {size} bytes"
    );
    let readme = std::fs::read_to_string(path.with_file_name("README.md")).unwrap();
    assert!(readme.contains("corpus.txt") && readme.to_lowercase().contains("public domain"));
    let cfg = LoaderConfig {
        seq_len: 64,
        vocab_size: Some(256),
        ..Default::default()
    };
    let l = DataLoader::open(&path, Tokenizer::Byte, cfg).unwrap();
    assert_eq!(l.train_tokens() + l.val_tokens(), size as usize);
    let b = l.micro_batch(3, 1, 2, 1, 4, 2).unwrap();
    assert_eq!(b.inputs.len(), 4 * 64);
    assert!(l.val_batches(2, 8).count() == 2);
}

/// A memory-mapped token file truncated during training is reported naming
/// the file (reading it would end the process with SIGBUS).
#[test]
fn a_truncated_mapped_file_is_named_not_a_sigbus() {
    use phalanx::data::{DataLoader, LoaderConfig, Tokenizer};
    let p = std::env::temp_dir().join(format!("phalanx-trunc-{}.bin", std::process::id()));
    // nanoGPT format: raw uint16 tokens.
    let tokens: Vec<u8> = (0..20_000u32)
        .flat_map(|t| ((t % 200) as u16).to_le_bytes())
        .collect();
    std::fs::write(&p, &tokens).unwrap();
    let lc = LoaderConfig {
        seq_len: 16,
        val_fraction: 0.0,
        shuffle: false,
        seed: 0,
        vocab_size: Some(256),
    };
    let l = DataLoader::open(&p, Tokenizer::Byte, lc).unwrap();
    l.micro_batch(0, 0, 1, 0, 4, 1).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(100)
        .unwrap();
    let err = match l.micro_batch(500, 0, 1, 0, 4, 1) {
        Ok(_) => panic!("a truncated file must be an error"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(p.to_str().unwrap()) && err.contains("truncated"),
        "{err}"
    );
    let _ = std::fs::remove_file(&p);
}

/// A file that starts with an llm.c magic but is shorter than the llm.c
/// header is a cut llm.c file, refused naming it; it used to be read as
/// raw nanoGPT tokens (the header as data).
#[test]
fn a_truncated_llmc_file_is_not_read_as_raw_tokens() {
    let dir = temp_dir("llmc-short");
    for (magic, version) in [(LLMC_MAGIC_GPT2, 1), (LLMC_MAGIC_LLAMA3, 7)] {
        let path = dir.join(format!("cut_{magic}.bin"));
        write_llmc(&path, magic, version, 3, &[1, 2, 3], 2);
        let mut bytes = std::fs::read(&path).unwrap();
        for keep in [1022, 500, 12, 4] {
            bytes.truncate(keep);
            std::fs::write(&path, &bytes).unwrap();
            let m = TokenData::open(&path, Tokenizer::Byte)
                .unwrap_err()
                .to_string();
            assert!(
                m.contains(path.to_str().unwrap())
                    && m.contains(&format!("llm.c magic {magic}"))
                    && m.contains(&format!("has {keep} bytes"))
                    && m.contains("truncated"),
                "{m}"
            );
        }
    }
    // A short nanoGPT file without the magic still reads.
    let path = dir.join("raw.bin");
    std::fs::write(&path, [7u8, 0, 8, 0]).unwrap();
    assert_eq!(
        tokens_of(&TokenData::open(&path, Tokenizer::Byte).unwrap()),
        vec![7, 8]
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A mapped token file holds no descriptor, so whether it changed is
/// checked by its path: replaced by another file (a rename over it) or
/// written in place (same size, new modification time) is an error naming
/// the file, as truncation is.
#[test]
fn a_mapped_file_replaced_or_written_is_named() {
    let dir = temp_dir("changed");
    let p = dir.join("t.bin");
    let tokens: Vec<u8> = (0..4_000u16)
        .flat_map(|t| (t % 200).to_le_bytes())
        .collect();
    std::fs::write(&p, &tokens).unwrap();
    let lc = LoaderConfig {
        seq_len: 16,
        val_fraction: 0.0,
        shuffle: false,
        seed: 0,
        vocab_size: Some(256),
    };
    let batch_err = |l: &DataLoader| match l.micro_batch(3, 0, 1, 0, 4, 1) {
        Ok(_) => panic!("a changed file must be an error"),
        Err(e) => e.to_string(),
    };
    // Replaced: a new file renamed over it.
    let l = DataLoader::open(&p, Tokenizer::Byte, lc.clone()).unwrap();
    l.micro_batch(0, 0, 1, 0, 4, 1).unwrap();
    let tmp = dir.join("t.bin.new");
    std::fs::write(&tmp, &tokens).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    let e = batch_err(&l);
    assert!(
        e.contains(p.to_str().unwrap()) && e.contains("replaced"),
        "{e}"
    );
    // Touched only (a scratch purge policy's `touch`): not an error.
    let l = DataLoader::open(&p, Tokenizer::Byte, lc.clone()).unwrap();
    l.micro_batch(0, 0, 1, 0, 4, 1).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(86_400))
        .unwrap();
    drop(f);
    l.micro_batch(3, 0, 1, 0, 4, 1).unwrap();
    // Truncated in place: an error before a read past its end (SIGBUS).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let e = batch_err(&l);
    assert!(
        e.contains(p.to_str().unwrap()) && e.contains("truncated"),
        "{e}"
    );
    std::fs::write(&p, &tokens).unwrap();
    // Removed.
    let l = DataLoader::open(&p, Tokenizer::Byte, lc).unwrap();
    std::fs::remove_file(&p).unwrap();
    let e = batch_err(&l);
    assert!(
        e.contains(p.to_str().unwrap()) && e.contains("no longer"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
