//! The data loader alone: tokens per second it serves from a JSONL corpus
//! (tokenized while serving) and from llm.c token shards (memory-mapped),
//! to set beside what training consumes (`bench/loader_throughput.sh`).
//!
//! ```sh
//! cargo run --release -p phalanx --example loader_throughput -- DIR MB TOKENIZER SEQ_LEN
//! ```
//! writes about `MB` MB of JSONL from `data/corpus.txt` under `DIR`, the
//! same text as llm.c shards, then serves global batches of 32 samples of
//! `SEQ_LEN` tokens from each for 10 s (or one pass) and prints one JSON
//! line per format.

use phalanx::data::{Corpus, CorpusConfig, DataLoader, Tokenizer};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// JSONL shards of about `mb` MB in total: corpus lines, 50 per record.
fn write_jsonl(dir: &Path, mb: usize) -> Vec<String> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/corpus.txt"
    ))
    .expect("data/corpus.txt");
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let (mut written, mut shard, mut files) = (0usize, 0usize, Vec::new());
    while written < mb << 20 {
        let mut s = String::new();
        for (i, chunk) in lines.chunks(50).enumerate() {
            let doc = format!("[{shard}.{i}] {}", chunk.join("\n"));
            s += &serde_json::json!({ "text": doc }).to_string();
            s.push('\n');
        }
        let p = dir.join(format!("part-{shard:04}.jsonl"));
        std::fs::write(&p, &s).unwrap();
        written += s.len();
        files.push(p.display().to_string());
        shard += 1;
    }
    files
}

/// The same documents as llm.c shards (uint16 or uint32 tokens).
fn write_bin(dir: &Path, jsonl: &[String], tok: &Tokenizer) -> Vec<String> {
    let eot = tok.eot_token().unwrap_or(u32::from(b'\n'));
    let wide = tok.vocab_size() > 65536;
    jsonl
        .iter()
        .enumerate()
        .map(|(j, f)| {
            let docs = phalanx::data::records::documents(Path::new(f), "text", "-", 2).unwrap();
            let mut toks = Vec::new();
            for d in docs {
                toks.extend(tok.encode(&d.unwrap()));
                toks.push(eot);
            }
            let mut header = [0u32; 256];
            header[0] = if wide { 20240801 } else { 20240520 };
            header[1] = if wide { 7 } else { 1 };
            header[2] = toks.len() as u32;
            let mut bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
            for t in toks {
                if wide {
                    bytes.extend(t.to_le_bytes());
                } else {
                    bytes.extend((t as u16).to_le_bytes());
                }
            }
            let p = dir.join(format!("train_{j:06}.bin"));
            std::fs::write(&p, bytes).unwrap();
            p.display().to_string()
        })
        .collect()
}

/// Serve global batches of 32 for up to 10 s: (tokens/s, steps).
fn serve(files: &[String], tok: &Tokenizer, seq_len: usize, max_steps: u64) -> (f64, u64) {
    let refs: Vec<&str> = files.iter().map(|s| s.as_str()).collect();
    let mut cfg = CorpusConfig::new(&refs, seq_len);
    cfg.encoder = Arc::new(*tok);
    cfg.vocab_size = Some(tok.vocab_size());
    let l = DataLoader::from_corpus(Corpus::open(&cfg).unwrap());
    let t0 = Instant::now();
    let mut steps = 0;
    while steps < max_steps && t0.elapsed().as_secs_f64() < 10.0 {
        let b = l.micro_batch(steps, 0, 1, 0, 32, 1).unwrap();
        std::hint::black_box(&b.inputs);
        steps += 1;
    }
    let tokens = steps as f64 * 32.0 * seq_len as f64;
    (tokens / t0.elapsed().as_secs_f64(), steps)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: loader_throughput DIR MB TOKENIZER SEQ_LEN");
        std::process::exit(2);
    }
    let dir = Path::new(&a[1]);
    let mb: usize = a[2].parse().expect("MB");
    let tok = Tokenizer::from_name(&a[3]).expect("tokenizer: byte or gpt2");
    let seq_len: usize = a[4].parse().expect("SEQ_LEN");
    std::fs::create_dir_all(dir.join("jsonl")).unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    let jsonl = write_jsonl(&dir.join("jsonl"), mb);
    let bin = write_bin(&dir.join("bin"), &jsonl, &tok);
    // One pass over the text at most (a second epoch would re-tokenize).
    let bytes: u64 = jsonl
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .sum();
    let pass = bytes / (32 * seq_len as u64 * 4).max(1);
    for (format, files) in [("jsonl", &jsonl), ("bin", &bin)] {
        let (tps, steps) = serve(files, &tok, seq_len, pass.max(1));
        println!(
            "{}",
            serde_json::json!({
                "format": format, "tokenizer": a[3], "seq_len": seq_len, "mb": mb,
                "steps": steps, "tokens_per_s": tps.round(),
            })
        );
    }
}
