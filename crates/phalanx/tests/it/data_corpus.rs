//! Corpora of many shards and sources (`phalanx::data::corpus`): formats,
//! weights, an order independent of the layout and of the loader threads,
//! exact resume (same and other world size, other global batch), bad data.

use phalanx::data::source::LLMC_MAGIC_GPT2;
use phalanx::data::{Corpus, CorpusConfig, DataLoader, DataState, OnBadRecord, SourceSpec};
use std::path::{Path, PathBuf};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("phalanx-corpus-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_llmc(path: &Path, tokens: &[u32]) {
    let mut header = [0u32; 256];
    header[0] = LLMC_MAGIC_GPT2;
    header[1] = 1;
    header[2] = tokens.len() as u32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
    for &t in tokens {
        bytes.extend_from_slice(&(t as u16).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

/// JSONL shard `j`: `docs` records of varying length.
fn write_jsonl(path: &Path, j: usize, docs: usize) {
    let mut s = String::new();
    for i in 0..docs {
        let body = format!("shard {j} doc {i} ").repeat(1 + (i * 7 + j) % 5);
        s.push_str(&serde_json::json!({"id": i, "text": body}).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

/// Three sources: llm.c shards (a glob), JSONL shards (a directory) and
/// plain text files (a list), weighted 2 : 1 : 1.
fn three_formats(dir: &Path) -> CorpusConfig {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("jsonl")).unwrap();
    for j in 0..3 {
        let toks: Vec<u32> = (0..400 + 50 * j).map(|i| (i * 7 + j * 31) % 256).collect();
        write_llmc(&dir.join(format!("bin/train_{j:06}.bin")), &toks);
    }
    for j in 0..4 {
        write_jsonl(&dir.join(format!("jsonl/part-{j}.jsonl")), j, 12);
    }
    let texts: Vec<String> = (0..2)
        .map(|j| {
            let p = dir.join(format!("book{j}.txt"));
            std::fs::write(&p, format!("book {j}: the quick brown fox. ").repeat(20)).unwrap();
            p.display().to_string()
        })
        .collect();
    let spec = |paths: Vec<String>, weight: f64, i: usize| SourceSpec {
        paths,
        weight,
        field: "text".into(),
        key: format!("data.sources[{i}]"),
    };
    let mut cfg = CorpusConfig::new(&[], 8);
    cfg.sources = vec![
        spec(vec![format!("{}/bin/train_*.bin", dir.display())], 2.0, 0),
        spec(vec![dir.join("jsonl").display().to_string()], 1.0, 1),
        spec(texts, 1.0, 2),
    ];
    cfg.val_fraction = 0.1;
    cfg.seed = 5;
    cfg.vocab_size = Some(256);
    cfg
}

fn open(cfg: &CorpusConfig) -> DataLoader {
    DataLoader::from_corpus(Corpus::open(cfg).unwrap())
}

/// Step `step`'s inputs, gathered over `dp` ranks and `accum` micro-steps.
fn step_inputs(l: &DataLoader, step: u64, g: usize, dp: usize, accum: usize) -> Vec<u32> {
    let micro = g / dp / accum;
    let mut out = Vec::new();
    for r in 0..dp {
        for a in 0..accum {
            out.extend(l.micro_batch(step, r, dp, a, micro, accum).unwrap().inputs);
        }
    }
    out
}

#[test]
fn three_formats_mix_and_serve_batches() {
    let dir = temp_dir("mix");
    let cfg = three_formats(&dir);
    let l = open(&cfg);
    let c = l.corpus().unwrap();
    assert!(c.train_samples().is_none(), "text sources stream");
    // Every source appears in the first steps, in the weights' proportion.
    let counts = c.mixer().counts_before(400);
    assert_eq!(counts, vec![200, 100, 100]);
    for step in 0..20 {
        let b = l.micro_batch(step, 0, 1, 0, 20, 1).unwrap();
        assert_eq!(b.inputs.len(), 20 * 8);
        assert!(b.inputs.iter().all(|&t| t < 256));
        // Targets are inputs shifted by one within each row.
        for row in 0..20 {
            let (x, y) = (
                &b.inputs[row * 8..row * 8 + 8],
                &b.targets[row * 8..row * 8 + 8],
            );
            assert_eq!(&x[1..], &y[..7]);
        }
    }
    // Validation: the tails of the token shards.
    assert!(l.val_batch_count(2) > 0);
    assert_eq!(l.val_batch(0, 2).unwrap().inputs.len(), 16);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn same_samples_on_1_2_3_ranks_any_threads_and_shared_loaders() {
    let dir = temp_dir("layout");
    let mut cfg = three_formats(&dir);
    let g = 12;
    let reference: Vec<Vec<u32>> = {
        let l = open(&cfg);
        (0..30).map(|k| step_inputs(&l, k, g, 1, 1)).collect()
    };
    for (dp, accum, threads) in [(2, 1, 1), (3, 2, 3), (2, 3, 2), (1, 4, 1)] {
        cfg.threads = threads;
        // Separate loaders per rank, as separate processes have.
        let loaders: Vec<DataLoader> = (0..dp).map(|_| open(&cfg)).collect();
        let micro = g / dp / accum;
        for (k, want) in reference.iter().enumerate() {
            let mut got = Vec::new();
            for (r, l) in loaders.iter().enumerate() {
                for a in 0..accum {
                    got.extend(
                        l.micro_batch(k as u64, r, dp, a, micro, accum)
                            .unwrap()
                            .inputs,
                    );
                }
            }
            assert_eq!(
                &got, want,
                "step {k} on dp {dp} x accum {accum}, {threads} threads"
            );
        }
    }
    // One loader shared by rank threads that run at their own pace (tp /
    // pp ranks share theirs): the same samples.
    let shared = std::sync::Arc::new(open(&cfg));
    let per_rank: Vec<Vec<Vec<u32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let l = shared.clone();
                s.spawn(move || {
                    (0..30u64)
                        .map(|k| {
                            if (k as usize + r).is_multiple_of(4) {
                                std::thread::yield_now();
                            }
                            l.micro_batch(k, r, 3, 0, g / 3, 1).unwrap().inputs
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (k, want) in reference.iter().enumerate() {
        let got: Vec<u32> = (0..3).flat_map(|r| per_rank[r][k].clone()).collect();
        assert_eq!(&got, want, "step {k} with a shared loader");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resume_mid_shard_is_exact_on_other_world_sizes_and_batches() {
    let dir = temp_dir("resume");
    let mut cfg = three_formats(&dir);
    // Many small JSONL shards: the resume point lies deep in the stream.
    for j in 4..12 {
        write_jsonl(&dir.join(format!("jsonl/part-{j}.jsonl")), j, 12);
    }
    cfg.prefetch = 1;
    let g = 12;
    let full = open(&cfg);
    let want: Vec<Vec<u32>> = (0..40).map(|k| step_inputs(&full, k, g, 1, 1)).collect();
    // A checkpoint after 25 steps, through its JSON form.
    let saved = full.state_at(25, g).unwrap();
    let consumed = full.position(25, g);
    assert_eq!(consumed, 25 * g as u64);
    let text = serde_json::to_string(&saved).unwrap();
    let state: DataState = serde_json::from_str(&text).unwrap();
    assert!(state.cursors[1].is_some() && state.cursors[0].is_none());
    for dp in [1, 2, 3] {
        let l = open(&cfg);
        l.resume_at(25, consumed, Some(&state)).unwrap();
        for (k, w) in want.iter().enumerate().skip(25) {
            assert_eq!(
                &step_inputs(&l, k as u64, g, dp, 1),
                w,
                "step {k} resumed on dp {dp}"
            );
        }
        // The text stream continued from the saved shard: it did not
        // tokenize everything before it again.
        let (resumed, whole) = (l.stats().unwrap().tokens, full.stats().unwrap().tokens);
        assert!(
            resumed < whole,
            "resumed run tokenized {resumed} tokens, the full run {whole}"
        );
    }
    // Another global batch (6 instead of 12): the same sample sequence
    // continues, nothing repeated or skipped.
    let l = open(&cfg);
    l.resume_at(25, consumed, Some(&state)).unwrap();
    let flat_want: Vec<u32> = want[25..].concat();
    let flat_got: Vec<u32> = (25..55).flat_map(|k| step_inputs(&l, k, 6, 2, 1)).collect();
    assert_eq!(flat_got, flat_want);
    // A changed data config is refused, naming the key and both values.
    let mut other = cfg.clone();
    other.seed = 6;
    let e = open(&other)
        .resume_at(25, consumed, Some(&state))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.seed: checkpoint 5, this run 6"), "{e}");
    let mut other = cfg.clone();
    other.sources[0].weight = 3.0;
    let e = open(&other)
        .resume_at(25, consumed, Some(&state))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.sources[0].weight: checkpoint 2.0, this run 3.0"),
        "{e}"
    );
    // A shard regenerated from other text keeps its name and size: the
    // content digest tells it apart.
    let shard = dir.join("bin/train_000001.bin");
    let toks: Vec<u32> = (0..450).map(|i| (i * 11 + 3) % 256).collect();
    write_llmc(&shard, &toks);
    let e = open(&cfg)
        .resume_at(25, consumed, Some(&state))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.content: checkpoint"), "{e}");
    // A checkpoint of an earlier version, without the digest, still resumes.
    let mut old = state.clone();
    old.fingerprint.as_object_mut().unwrap().remove("content");
    open(&cfg).resume_at(25, consumed, Some(&old)).unwrap();
    // A shard more: the lengths and the first difference, not both lists
    // (the checkpoint without the digest, which would differ first).
    write_llmc(&dir.join("bin/train_000003.bin"), &toks);
    let e = open(&cfg)
        .resume_at(25, consumed, Some(&old))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.sources[0].files: checkpoint 3 entries, this run 4; the first difference is at [3]"),
        "{e}"
    );
    assert!(e.contains("data.on_resume_mismatch"), "{e}");
    // Asked to, the resume goes on at the checkpoint's sample position in
    // the data as it is now, saying what differs; its samples are those of
    // a fresh loader over this data at that position.
    let l = open(&cfg);
    let w = l.resume_at_or_warn(25, consumed, Some(&old), true).unwrap();
    assert!(w.is_some_and(|w| w.contains("data.sources[0].files")));
    let fresh = open(&cfg);
    for k in 25..30 {
        assert_eq!(
            step_inputs(&l, k, g, 1, 1),
            step_inputs(&fresh, k, g, 1, 1),
            "step {k}"
        );
    }
    // What is done with a bad record changes no sample before the position
    // (a run under `error` stops at the first): not compared.
    let mut skip = cfg.clone();
    skip.on_bad_record = phalanx::data::OnBadRecord::Skip;
    let now = open(&cfg).state_at(25, g).unwrap();
    open(&skip).resume_at(25, consumed, Some(&now)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// Validation data is held out: a validation file the training patterns
/// also match (`data_*.bin` matches `data_val_*.bin`) is refused, and so
/// is an empty one (it would turn validation off without a word).
#[test]
fn validation_files_must_be_held_out_and_not_empty() {
    let dir = temp_dir("val-held-out");
    let toks: Vec<u32> = (0..400).map(|i| (i * 7) % 256).collect();
    write_llmc(&dir.join("data_train_000000.bin"), &toks);
    write_llmc(&dir.join("data_val_000000.bin"), &toks);
    let mut cfg = CorpusConfig::new(&[&format!("{}/data_*.bin", dir.display())], 8);
    cfg.val_paths = vec![dir.join("data_val_000000.bin").display().to_string()];
    let e = Corpus::open(&cfg).err().unwrap().to_string();
    assert!(
        e.contains("data_val_000000.bin is also training data (data.path)"),
        "{e}"
    );
    cfg.sources[0].paths = vec![dir.join("data_train_000000.bin").display().to_string()];
    Corpus::open(&cfg).unwrap();
    // A hard link to a training file is that file.
    let link = dir.join("held_out.bin");
    std::fs::hard_link(dir.join("data_train_000000.bin"), &link).unwrap();
    let mut linked = cfg.clone();
    linked.val_paths = vec![link.display().to_string()];
    let e = Corpus::open(&linked).err().unwrap().to_string();
    assert!(e.contains("held_out.bin is also training data"), "{e}");
    write_llmc(&dir.join("data_val_000000.bin"), &[]);
    let e = Corpus::open(&cfg).err().unwrap().to_string();
    assert!(e.contains("holds no tokens"), "{e}");
    // A validation text file is read with the first text source's field,
    // not the token source's default.
    let rec = |n: usize| {
        format!(
            "{{\"content\": \"{}\"}}\n",
            "words and more words ".repeat(n)
        )
    };
    std::fs::write(dir.join("train.jsonl"), rec(30).repeat(20)).unwrap();
    std::fs::write(dir.join("val.jsonl"), rec(30).repeat(4)).unwrap();
    let mut text = cfg.sources[0].clone();
    text.paths = vec![dir.join("train.jsonl").display().to_string()];
    text.field = "content".into();
    text.key = "data.sources[1]".into();
    cfg.sources.push(text);
    cfg.val_paths = vec![dir.join("val.jsonl").display().to_string()];
    Corpus::open(&cfg).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn weights_are_followed_exactly_and_deterministically() {
    let m = phalanx::data::mix::Mixer::new(&[0.5, 0.3, 0.2], 11).unwrap();
    let n = 12 * phalanx::data::mix::BLOCK;
    let mut counts = [0u64; 3];
    let mut next = [0u64; 3];
    for g in 0..n {
        let (s, k) = m.locate(g);
        // Each source's samples come in order 0, 1, 2, … (no gap, no repeat).
        assert_eq!(k, next[s], "global index {g}");
        next[s] += 1;
        counts[s] += 1;
        // At every point the counts so far are what `consumed` says (a
        // resume's position); at every block boundary they are within one
        // sample of the weights (the cumulative fractions are floor'd).
        if (g + 1) % 1000 == 0 {
            assert_eq!(m.consumed(g + 1), counts.to_vec(), "at {g}");
        }
        if (g + 1) % phalanx::data::mix::BLOCK == 0 {
            for (i, w) in [0.5, 0.3, 0.2].iter().enumerate() {
                let c = counts[i] as f64;
                assert!(
                    (c - w * (g + 1) as f64).abs() <= 1.0,
                    "source {i} at {g}: {c}"
                );
            }
        }
    }
    assert_eq!(counts.to_vec(), m.counts_before(n));
    assert_eq!(counts, [24_576, 14_745, 9_831]);
    // The same seed gives the same order; another seed another one.
    let again = phalanx::data::mix::Mixer::new(&[0.5, 0.3, 0.2], 11).unwrap();
    let other = phalanx::data::mix::Mixer::new(&[0.5, 0.3, 0.2], 12).unwrap();
    let seq = |m: &phalanx::data::mix::Mixer| (0..5000).map(|g| m.locate(g)).collect::<Vec<_>>();
    assert_eq!(seq(&m), seq(&again));
    assert_ne!(seq(&m), seq(&other));
    // Weights whose sum overflows f64 mix as their ratio (equal: half and
    // half), not all from the last source.
    let huge = phalanx::data::mix::Mixer::new(&[1e308, 1e308], 11).unwrap();
    assert_eq!(
        huge.counts_before(phalanx::data::mix::BLOCK),
        vec![2048, 2048]
    );
    // A share too small to ever be read is refused naming the source.
    let e = phalanx::config::TrainConfig::build(
        None,
        &[
            "data.sources=[{path = \"a.bin\", weight = 1e-10}, {path = \"b.bin\", weight = 1.0}]"
                .into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("data.sources[0].weight = 0.0000000001") && e.contains("never be read"),
        "{e}"
    );
    // The refusal is the mixer's own arithmetic: a share of exactly half a
    // unit that the running total rounds away is refused, a third source
    // beside one that rounds away likewise, and ordinary weights are not.
    use phalanx::data::mix::never_read;
    assert_eq!(never_read(&[(1u64 << 33) as f64 - 1.0, 1.0]), Some(1));
    assert_eq!(
        never_read(&[6.0, 5.0, 10.0 * (1u64 << 32) as f64 - 11.0]),
        Some(1)
    );
    assert_eq!(never_read(&[3.0, 1.0]), None);
}

#[test]
fn binary_shards_reshuffle_every_epoch_and_cover_each() {
    let dir = temp_dir("epochs");
    for j in 0..3 {
        let toks: Vec<u32> = (0..(8 * 10 + 1)).map(|i| (j * 1000 + i) as u32).collect();
        write_llmc(&dir.join(format!("s{j}.bin")), &toks);
    }
    let mut cfg = CorpusConfig::new(&[&format!("{}/s*.bin", dir.display())], 8);
    cfg.seed = 3;
    let l = open(&cfg);
    assert_eq!(l.train_samples(), 30);
    let firsts = |e: u64| -> Vec<u32> {
        (0..30)
            .map(|i| l.micro_batch(e * 30 + i, 0, 1, 0, 1, 1).unwrap().inputs[0])
            .collect()
    };
    let (e0, e1) = (firsts(0), firsts(1));
    let sorted = |mut v: Vec<u32>| {
        v.sort();
        v
    };
    assert_eq!(
        sorted(e0.clone()),
        sorted(e1.clone()),
        "each epoch covers every sample"
    );
    assert_eq!(sorted(e0.clone()).len(), 30);
    assert_ne!(e0, e1, "a new order each epoch");
    std::fs::remove_dir_all(dir).unwrap();
}

fn err_of(cfg: &CorpusConfig) -> String {
    match Corpus::open(cfg) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// The error of the first batches that meet a bad record.
fn batch_err(cfg: &CorpusConfig) -> String {
    let l = open(cfg);
    for k in 0..200 {
        if let Err(e) = l.micro_batch(k, 0, 1, 0, 4, 1) {
            return e.to_string();
        }
    }
    panic!("no batch failed")
}

#[test]
fn bad_data_is_named_with_file_and_line() {
    let dir = temp_dir("bad");
    let d = |n: &str| dir.join(n).display().to_string();
    // A glob that matches nothing, a missing file: the key and the pattern.
    let e = err_of(&CorpusConfig::new(&[&d("none_*.bin")], 8));
    assert!(
        e.contains("data.path") && e.contains("none_*.bin") && e.contains("matches no file"),
        "{e}"
    );
    let e = err_of(&CorpusConfig::new(&[&d("missing.jsonl")], 8));
    assert!(
        e.contains("missing.jsonl") && e.contains("no such file"),
        "{e}"
    );
    // A corrupted llm.c shard (header count disagrees with the size).
    write_llmc(&dir.join("ok.bin"), &(0..100).collect::<Vec<_>>());
    let mut bytes = std::fs::read(dir.join("ok.bin")).unwrap();
    bytes.truncate(bytes.len() - 10);
    std::fs::write(dir.join("cut.bin"), bytes).unwrap();
    let e = err_of(&CorpusConfig::new(&[&d("*.bin")], 8));
    assert!(
        e.contains("cut.bin") && e.contains("llm.c header says 100 tokens"),
        "{e}"
    );
    // An empty file and an empty source.
    std::fs::write(dir.join("empty.jsonl"), "").unwrap();
    let e = err_of(&CorpusConfig::new(&[&d("empty.jsonl")], 8));
    assert!(e.contains("empty.jsonl") && e.contains("empty"), "{e}");
    std::fs::create_dir_all(dir.join("nothing")).unwrap();
    let e = err_of(&CorpusConfig::new(&[&d("nothing")], 8));
    assert!(
        e.contains("nothing") && e.contains("a directory holding no data files"),
        "{e}"
    );
    // The first record is checked before training.
    std::fs::write(dir.join("first.jsonl"), "{\"txt\": \"a\"}\n").unwrap();
    let e = err_of(&CorpusConfig::new(&[&d("first.jsonl")], 8));
    assert!(
        e.contains("first.jsonl: line 1: no field \"text\" (data.field)"),
        "{e}"
    );
    // Later records fail at the batch that meets them, naming file and line.
    let good = "{\"text\": \"a good document of some length\"}\n";
    let cases = [
        (
            "notjson.jsonl",
            format!("{good}{good}{{not json\n"),
            "line 3: not a JSON record",
        ),
        (
            "nofield.jsonl",
            format!("{good}\n{{\"body\": 1}}\n"),
            "line 3: no field \"text\"",
        ),
        (
            "number.jsonl",
            format!("{good}{{\"text\": 5}}\n"),
            "line 2: field \"text\" (data.field) is a number",
        ),
    ];
    for (name, body, want) in &cases {
        std::fs::write(dir.join(name), body).unwrap();
        let e = batch_err(&CorpusConfig::new(&[&d(name)], 8));
        assert!(e.contains(name) && e.contains(want), "{name}: {e}");
    }
    let mut bytes = good.repeat(2).into_bytes();
    bytes.extend_from_slice(b"{\"text\": \"caf\xe9\"}\n");
    std::fs::write(dir.join("latin1.jsonl"), &bytes).unwrap();
    let e = batch_err(&CorpusConfig::new(&[&d("latin1.jsonl")], 8));
    assert!(
        e.contains("latin1.jsonl") && e.contains("line 3: not valid UTF-8"),
        "{e}"
    );
    // A truncated Parquet file (more in data_parquet.rs).
    std::fs::write(dir.join("x.parquet"), b"PAR1").unwrap();
    let e = err_of(&CorpusConfig::new(&[&d("x.parquet")], 8));
    assert!(
        e.contains("x.parquet") && e.contains("not a readable Parquet file"),
        "{e}"
    );
    // `skip`: the bad records are counted, the rest trains.
    let mut cfg = CorpusConfig::new(
        &[&d("notjson.jsonl"), &d("nofield.jsonl"), &d("latin1.jsonl")],
        8,
    );
    cfg.on_bad_record = OnBadRecord::Skip;
    let l = open(&cfg);
    for k in 0..10 {
        l.micro_batch(k, 0, 1, 0, 4, 1).unwrap();
    }
    // One bad record in each file, each counted once however many
    // passes the reader made over them.
    let skipped = l.stats().unwrap().skipped;
    assert_eq!(skipped, 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn config_paths_lists_and_sources() {
    use phalanx::config::TrainConfig;
    let cfg = TrainConfig::build(None, &["data.path=\"shards/*.bin\"".into()]).unwrap();
    assert!(cfg.data.uses_corpus());
    let cfg = TrainConfig::build(None, &[]).unwrap();
    assert!(
        !cfg.data.uses_corpus(),
        "one text file keeps the single-stream loader"
    );
    let cfg = TrainConfig::build(None, &["data.val_path=[\"v.bin\"]".into()]).unwrap();
    assert_eq!(cfg.data.val_path.list(), vec!["v.bin".to_string()]);
    assert!(cfg.data.uses_corpus());
    let cfg = TrainConfig::build(None, &["data.path=[\"a.bin\", \"b.bin\"]".into()]).unwrap();
    assert_eq!(cfg.data.path.to_string(), "a.bin, b.bin");
    assert!(TrainConfig::build(None, &["data.path=5".into()]).is_err());
    let dir = temp_dir("config");
    let toml = dir.join("c.toml");
    std::fs::write(
        &toml,
        "[[data.sources]]\npath = \"a/*.bin\"\nweight = 3\n[[data.sources]]\npath = [\"b.jsonl\", \"c\"]\nfield = \"content\"\n",
    )
    .unwrap();
    let cfg = TrainConfig::build(Some(&toml), &[]).unwrap();
    let cc = cfg
        .data
        .corpus_config(8, None, std::sync::Arc::new(phalanx::data::Tokenizer::Byte));
    assert_eq!(cc.sources.len(), 2);
    assert_eq!(
        (cc.sources[0].weight, cc.sources[1].field.as_str()),
        (3.0, "content")
    );
    assert_eq!(
        cc.sources[1].paths,
        vec!["b.jsonl".to_string(), "c".to_string()]
    );
    // Both `data.path` and sources: refused, naming both.
    let e = TrainConfig::build(Some(&toml), &["data.path=\"x.bin\"".into()]).unwrap_err();
    assert!(e.to_string().contains("[[data.sources]]"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tokenizer that refuses one word (as a word-level vocabulary without
/// an unknown token does).
struct Picky;

impl phalanx::data::TextEncoder for Picky {
    fn encode(&self, t: &str) -> Result<Vec<u32>, String> {
        match t.contains("xyzzy") {
            true => Err("no id for the word \"xyzzy\"".into()),
            false => Ok(t.bytes().map(u32::from).collect()),
        }
    }
    fn separator(&self) -> Vec<u32> {
        vec![10]
    }
    fn name(&self) -> String {
        "picky".into()
    }
}

/// A document the tokenizer fails on is a bad record (`data.on_bad_record`),
/// named with its file and the tokenizer's reason; it used to become an
/// empty document, silently.
#[test]
fn a_document_the_tokenizer_refuses_is_a_bad_record() {
    let dir = temp_dir("picky");
    let good = "{\"text\": \"a document the tokenizer takes, in plain bytes\"}\n".repeat(40);
    let p = dir.join("p.jsonl");
    std::fs::write(&p, format!("{good}{{\"text\": \"say xyzzy\"}}\n")).unwrap();
    let mut cfg = CorpusConfig::new(&[p.to_str().unwrap()], 8);
    cfg.encoder = std::sync::Arc::new(Picky);
    let e = batch_err(&cfg);
    assert!(
        e.contains("p.jsonl")
            && e.contains("record 41 (9 characters) could not be tokenized: no id for the word"),
        "{e}"
    );
    cfg.on_bad_record = OnBadRecord::Skip;
    let l = open(&cfg);
    for k in 0..10 {
        l.micro_batch(k, 0, 1, 0, 4, 1).unwrap();
    }
    // Once, though the reader passes over the one file again each epoch,
    // ahead of the batches asked for.
    let skipped = l.stats().unwrap().skipped;
    assert_eq!(skipped, 1);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Token files shorter than one sample, and shard tails, are never trained
/// on (samples do not cross shards): the run is told how much, above 1%.
#[test]
fn tokens_no_sample_reaches_are_noted() {
    let dir = temp_dir("unused");
    let toks = |n: u32| (0..n).map(|i| i % 256).collect::<Vec<u32>>();
    write_llmc(&dir.join("a.bin"), &toks(100)); // 12 samples of 8: 97 used
    write_llmc(&dir.join("b.bin"), &toks(5)); // shorter than 9
    let mut cfg = CorpusConfig::new(&[&format!("{}/*.bin", dir.display())], 8);
    cfg.val_fraction = 0.0;
    let notes = Corpus::open(&cfg).unwrap().notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains("8 of its 105 training tokens")
            && notes[0].contains("1 shard(s) are shorter"),
        "{notes:?}"
    );
    // A file whose samples use all but 1% of it: nothing to say.
    std::fs::remove_file(dir.join("b.bin")).unwrap();
    write_llmc(&dir.join("a.bin"), &toks(801));
    assert!(Corpus::open(&cfg).unwrap().notes().is_empty());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A shard too short to hold out a validation sample (`phalanx tokenize`'s
/// last, partial one) keeps no validation tail and trains on all its
/// tokens, with a note; it used to stop the run. Only when no shard at all
/// gives validation data is that an error.
#[test]
fn a_short_shard_trains_and_the_long_ones_validate() {
    let dir = temp_dir("short-shard");
    let toks = |n: u32| (0..n).map(|i| (i * 7) % 256).collect::<Vec<u32>>();
    write_llmc(&dir.join("data_000000.bin"), &toks(2000)); // tail: 40 tokens
    write_llmc(&dir.join("data_000001.bin"), &toks(100)); // tail: 2 < 9 tokens
    let mut cfg = CorpusConfig::new(&[&format!("{}/data_*.bin", dir.display())], 8);
    cfg.val_fraction = 0.02;
    cfg.vocab_size = Some(256);
    let l = open(&cfg);
    assert_eq!((l.train_tokens(), l.val_tokens()), (1960 + 100, 40));
    // (1959 / 8) + (99 / 8) training samples, 39 / 8 validation ones.
    assert_eq!(l.train_samples(), 244 + 12);
    assert_eq!(l.val_samples(), 4);
    for step in 0..10 {
        l.micro_batch(step, 0, 1, 0, 8, 1).unwrap();
    }
    assert_eq!(l.val_batch(1, 2).unwrap().inputs.len(), 16);
    let notes = l.notes();
    assert!(
        notes.len() == 1 && notes[0].contains("1 shard(s) are too short to hold out a validation"),
        "{notes:?}"
    );
    // No shard long enough: validation was asked for, none can be given.
    cfg.sources[0].paths = vec![dir.join("data_000001.bin").display().to_string()];
    let e = err_of(&cfg);
    assert!(
        e.contains("no token shard is long enough") && e.contains("data.val_fraction"),
        "{e}"
    );
    cfg.val_fraction = 0.0;
    assert_eq!(open(&cfg).train_tokens(), 100);
    std::fs::remove_dir_all(dir).unwrap();
}

/// One file named several ways (a directory and a glob of it, `..`, a
/// link) is one shard, read once per epoch, not once per spelling.
#[test]
fn a_file_named_two_ways_is_read_once() {
    let dir = temp_dir("two-ways");
    let toks: Vec<u32> = (0..400).map(|i| (i * 7) % 256).collect();
    write_llmc(&dir.join("x.bin"), &toks);
    let once = open(&CorpusConfig::new(
        &[dir.join("x.bin").to_str().unwrap()],
        8,
    ));
    let n = once.train_samples();
    assert_eq!(n, 399 / 8);
    std::os::unix::fs::symlink(dir.join("x.bin"), dir.join("link.bin")).unwrap();
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let d = dir.display();
    let ways = [
        format!("{d}"),
        format!("{d}/*.bin"),
        format!("{d}/sub/../x.bin"),
        format!("{d}/link.bin"),
    ];
    let ways: Vec<&str> = ways.iter().map(|s| s.as_str()).collect();
    let l = open(&CorpusConfig::new(&ways, 8));
    assert_eq!(l.train_samples(), n);
    assert_eq!(l.train_tokens(), 400);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Token files are read as ids whatever `data.tokenizer` is: a resume that
/// names another tokenizer (`--init-from` a model with its own) over token
/// shards is the same data, while over text it is refused.
#[test]
fn the_tokenizer_decides_text_only() {
    let dir = temp_dir("tok-fp");
    std::fs::create_dir_all(&dir).unwrap();
    let toks: Vec<u32> = (0..400).map(|i| (i * 7) % 256).collect();
    write_llmc(&dir.join("train_000000.bin"), &toks);
    let mut cfg = CorpusConfig::new(&[dir.join("train_*.bin").to_str().unwrap()], 8);
    cfg.val_fraction = 0.1;
    let l = open(&cfg);
    let state = l.state_at(3, 4).unwrap();
    let consumed = l.position(3, 4);
    let mut other = cfg.clone();
    other.encoder = std::sync::Arc::new(Picky);
    open(&other).resume_at(3, consumed, Some(&state)).unwrap();
    // Text: the tokenizer makes the samples.
    let p = dir.join("t.jsonl");
    std::fs::write(
        &p,
        "{\"text\": \"some words to read as bytes\"}\n".repeat(40),
    )
    .unwrap();
    let mut cfg = CorpusConfig::new(&[p.to_str().unwrap()], 8);
    cfg.val_fraction = 0.1;
    let l = open(&cfg);
    let state = l.state_at(3, 4).unwrap();
    let mut other = cfg.clone();
    other.encoder = std::sync::Arc::new(Picky);
    let e = open(&other)
        .resume_at(3, l.position(3, 4), Some(&state))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.tokenizer"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A tokenizer whose ids a model cannot hold is refused before training
/// (gpt2's 50257 into a byte-sized model), naming both and the fix; the
/// byte tokenizer is left to the text (ASCII fits 128 ids).
#[test]
fn a_tokenizer_too_big_for_the_model_is_refused_before_training() {
    let dir = temp_dir("vocab");
    let p = dir.join("a.txt");
    std::fs::write(&p, "plain ascii text for a small model. ".repeat(50)).unwrap();
    let mut cfg = CorpusConfig::new(&[p.to_str().unwrap()], 8);
    cfg.vocab_size = Some(256);
    cfg.encoder = std::sync::Arc::new(phalanx::data::Tokenizer::Gpt2);
    let e = err_of(&cfg);
    assert!(
        e.contains("data.tokenizer gpt2 has a vocabulary of 50257 tokens")
            && e.contains("at least 50257"),
        "{e}"
    );
    cfg.encoder = std::sync::Arc::new(phalanx::data::Tokenizer::Byte);
    cfg.vocab_size = Some(128);
    open(&cfg).micro_batch(0, 0, 1, 0, 2, 1).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A checkpoint from before `.json` files were JSON Lines (its fingerprint
/// without `json_lines`) read them as plain text: another token stream
/// with the same files, refused by name.
#[test]
fn a_checkpoint_that_read_json_as_plain_text_is_not_resumed_silently() {
    let dir = temp_dir("json-lines");
    let p = dir.join("train.json");
    let body: String = (0..200)
        .map(|i| format!("{{\"text\": \"document number {i} of the corpus\"}}\n"))
        .collect();
    std::fs::write(&p, body).unwrap();
    let cfg = CorpusConfig::new(&[p.to_str().unwrap()], 8);
    let l = open(&cfg);
    let mut state = l.state_at(3, 4).unwrap();
    assert_eq!(state.fingerprint["json_lines"], true);
    open(&cfg)
        .resume_at(3, l.position(3, 4), Some(&state))
        .unwrap();
    state
        .fingerprint
        .as_object_mut()
        .unwrap()
        .remove("json_lines");
    let e = open(&cfg)
        .resume_at(3, l.position(3, 4), Some(&state))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.json_lines: checkpoint false, this run true"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// One text file encoded with a `tokenizer.json` (held in memory) records
/// the file, its content and the tokenizer's digest; a checkpoint from
/// before (null for the file and content, no tokenizer digest) still
/// resumes, and another tokenizer is refused by name.
#[test]
fn an_encoded_text_file_is_fingerprinted_and_old_checkpoints_resume() {
    use phalanx::data::{LoaderConfig, TokenData};
    let dir = temp_dir("encoded");
    let p = dir.join("text.txt");
    std::fs::write(&p, "some text ".repeat(100)).unwrap();
    let load = |tok: &str| {
        let data = TokenData::encoded_from((0..200).collect(), &p, Some(tok.to_string()));
        let cfg = LoaderConfig {
            seq_len: 4,
            ..Default::default()
        };
        DataLoader::new(data, cfg).unwrap()
    };
    let l = load("aaaa");
    let state = l.state_at(3, 4).unwrap();
    let f = &state.fingerprint;
    assert_eq!(f["file"], "text.txt");
    assert!(
        f["content"].is_string() && f["tokenizer_content"] == "aaaa",
        "{f}"
    );
    load("aaaa").resume_at(3, 12, Some(&state)).unwrap();
    let e = load("bbbb")
        .resume_at(3, 12, Some(&state))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.tokenizer_content"), "{e}");
    // As a checkpoint of an earlier version wrote it.
    let mut old = state.clone();
    let o = old.fingerprint.as_object_mut().unwrap();
    o.remove("tokenizer_content");
    o.insert("file".into(), serde_json::Value::Null);
    o.insert("content".into(), serde_json::Value::Null);
    load("aaaa").resume_at(3, 12, Some(&old)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
