//! Parquet sources (`phalanx::data::records`): a Parquet file serves the
//! very samples the same documents as JSONL do, in every compression
//! pyarrow, polars and `datasets` write; it mixes with the other formats;
//! a missing or non-string column, a null row, a file that is not Parquet
//! and an empty one are named (file, column, row group and row).

use parquet::basic::{Compression, GzipLevel, ZstdLevel};
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use phalanx::data::records::documents;
use phalanx::data::{Corpus, CorpusConfig, DataLoader, OnBadRecord, SourceSpec};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("phalanx-parquet-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A Parquet file of an optional string column `text` (None: null) and an
/// int column `id`, in `groups` row groups.
fn write_parquet(path: &Path, docs: &[Option<String>], groups: usize, c: Compression) {
    let schema = parse_message_type(
        "message schema { OPTIONAL BYTE_ARRAY text (UTF8); REQUIRED INT64 id; }",
    )
    .unwrap();
    let props = WriterProperties::builder().set_compression(c).build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    for (g, chunk) in docs.chunks(docs.len().div_ceil(groups).max(1)).enumerate() {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let vals: Vec<ByteArray> = chunk
            .iter()
            .flatten()
            .map(|s| ByteArray::from(s.as_str()))
            .collect();
        let defs: Vec<i16> = chunk.iter().map(|d| d.is_some() as i16).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&vals, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = (0..chunk.len()).map(|i| (g * 1000 + i) as i64).collect();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn docs(n: usize, tag: &str) -> Vec<String> {
    (0..n)
        .map(|i| format!("{tag} document {i}: ").repeat(1 + (i * 5) % 4))
        .collect()
}

fn write_jsonl(path: &Path, docs: &[String]) {
    let s: String = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string() + "\n")
        .collect();
    std::fs::write(path, s).unwrap();
}

fn open(paths: &[&Path]) -> DataLoader {
    let ps: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let refs: Vec<&str> = ps.iter().map(|s| s.as_str()).collect();
    let mut cfg = CorpusConfig::new(&refs, 8);
    cfg.vocab_size = Some(256);
    cfg.seed = 3;
    DataLoader::from_corpus(Corpus::open(&cfg).unwrap())
}

#[test]
fn parquet_serves_the_samples_jsonl_does_in_every_compression() {
    let dir = temp_dir("same");
    let d = docs(40, "parquet");
    let jsonl = dir.join("a.jsonl");
    write_jsonl(&jsonl, &d);
    let some: Vec<Option<String>> = d.iter().cloned().map(Some).collect();
    let codecs = [
        ("snappy", Compression::SNAPPY),
        ("zstd", Compression::ZSTD(ZstdLevel::default())),
        ("lz4", Compression::LZ4_RAW),
        ("gzip", Compression::GZIP(GzipLevel::default())),
        ("none", Compression::UNCOMPRESSED),
    ];
    let want = open(&[&jsonl]);
    for (name, c) in codecs {
        let p = dir.join(format!("a-{name}.parquet"));
        write_parquet(&p, &some, 3, c);
        let got: Vec<String> = documents(&p, "text", "data.field", 2)
            .unwrap()
            .into_iter()
            .map(|d| d.unwrap())
            .collect();
        assert_eq!(got, d, "{name}: the documents");
        let l = open(&[&p]);
        for step in 0..6 {
            assert_eq!(
                l.micro_batch(step, 0, 1, 0, 4, 1).unwrap().inputs,
                want.micro_batch(step, 0, 1, 0, 4, 1).unwrap().inputs,
                "{name}: step {step}"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn parquet_mixes_with_token_jsonl_and_text_sources() {
    let dir = temp_dir("mix");
    let p = dir.join("p.parquet");
    write_parquet(
        &p,
        &docs(30, "pq").into_iter().map(Some).collect::<Vec<_>>(),
        2,
        Compression::SNAPPY,
    );
    let j = dir.join("j.jsonl");
    write_jsonl(&j, &docs(30, "js"));
    let t = dir.join("t.txt");
    std::fs::write(&t, "plain text source. ".repeat(40)).unwrap();
    let spec = |p: &Path, weight: f64, i: usize| SourceSpec {
        paths: vec![p.display().to_string()],
        weight,
        field: "text".into(),
        key: format!("data.sources[{i}]"),
    };
    let mut cfg = CorpusConfig::new(&[], 8);
    cfg.sources = vec![spec(&p, 2.0, 0), spec(&j, 1.0, 1), spec(&t, 1.0, 2)];
    cfg.vocab_size = Some(256);
    let l = DataLoader::from_corpus(Corpus::open(&cfg).unwrap());
    assert_eq!(
        l.corpus().unwrap().mixer().counts_before(400),
        vec![200, 100, 100]
    );
    let mut seen = String::new();
    for step in 0..30 {
        let b = l.micro_batch(step, 0, 1, 0, 8, 1).unwrap();
        seen.extend(b.inputs.iter().map(|&t| t as u8 as char));
    }
    for tag in ["pq document", "js document", "plain text"] {
        assert!(seen.contains(tag), "{tag} never served: {seen}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_parquet_is_named_with_file_column_and_row() {
    let dir = temp_dir("bad");
    let err = |cfg: &CorpusConfig| match Corpus::open(cfg) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    };
    let one = |p: &Path| {
        let mut c = CorpusConfig::new(&[&p.display().to_string()], 8);
        c.vocab_size = Some(256);
        c
    };
    // The column is missing: refused before training, naming the columns.
    let p = dir.join("cols.parquet");
    write_parquet(&p, &[Some("x".repeat(50))], 1, Compression::SNAPPY);
    let mut c = one(&p);
    c.sources[0].field = "content".into();
    let e = err(&c);
    assert!(
        e.contains("cols.parquet") && e.contains("no column \"content\"") && e.contains("\"id\""),
        "{e}"
    );
    // Not a string column.
    c.sources[0].field = "id".into();
    let e = err(&c);
    assert!(
        e.contains("cols.parquet") && e.contains("not a string column"),
        "{e}"
    );
    // Not Parquet at all; no rows.
    let junk = dir.join("junk.parquet");
    std::fs::write(&junk, "this is not parquet".repeat(10)).unwrap();
    let e = err(&one(&junk));
    assert!(
        e.contains("junk.parquet") && e.contains("not a readable Parquet"),
        "{e}"
    );
    let empty = dir.join("empty.parquet");
    write_parquet(&empty, &[], 1, Compression::SNAPPY);
    let e = err(&one(&empty));
    assert!(e.contains("empty.parquet") && e.contains("no rows"), "{e}");

    // A null row: named at the batch that meets it, or skipped and counted.
    let mut d: Vec<Option<String>> = docs(12, "n").into_iter().map(Some).collect();
    d[9] = None;
    let nulls = dir.join("nulls.parquet");
    write_parquet(&nulls, &d, 2, Compression::SNAPPY);
    let l = DataLoader::from_corpus(Corpus::open(&one(&nulls)).unwrap());
    let e = (0..50)
        .find_map(|k| l.micro_batch(k, 0, 1, 0, 4, 1).err())
        .expect("a batch meets the null row")
        .to_string();
    assert!(
        e.contains("nulls.parquet") && e.contains("row group 1, row 3") && e.contains("null"),
        "{e}"
    );
    let mut c = one(&nulls);
    c.on_bad_record = OnBadRecord::Skip;
    let l = DataLoader::from_corpus(Corpus::open(&c).unwrap());
    for k in 0..20 {
        l.micro_batch(k, 0, 1, 0, 4, 1).unwrap();
    }
    // (Once per epoch read: the stream loops over the file.)
    assert!(l.stats().unwrap().skipped >= 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn one_parquet_file_as_data_path_is_read_as_records() {
    let cfg =
        phalanx::config::TrainConfig::build(None, &["data.path=\"shard.parquet\"".into()]).unwrap();
    assert!(cfg.data.uses_corpus(), "read as one plain-text file");
    assert_eq!(cfg.data.describe(), "shard.parquet");
}
