//! The documents of one text file, whatever its format: a plain text file
//! is one document, a JSONL file one per line (the `field` key of each
//! record), a Parquet file one per row (its `field` column, a string).
//! Both the training loader ([`super::text`]) and `phalanx tokenize` read
//! files through [`documents`], so they agree on what a document is and on
//! what is wrong with a bad one.
//!
//! Parquet is read with the `parquet` crate alone, without Arrow: a
//! document is a row of one string column, which its record reader gives
//! directly, and the Arrow crates would double the build for nothing used
//! here. Snappy, zstd, lz4 and gzip pages are read (what pyarrow, polars
//! and Hugging Face `datasets` write).
//!
//! ```
//! let dir = std::env::temp_dir().join(format!("phalanx-records-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let p = dir.join("a.jsonl");
//! std::fs::write(&p, "{\"text\": \"one\"}\nnot json\n\n{\"text\": \"two\"}\n").unwrap();
//! let docs = phalanx::data::records::documents(&p, "text", "data.field", 2).unwrap();
//! assert_eq!(docs.len(), 3);
//! assert_eq!(docs[0].as_deref(), Ok("one"));
//! assert_eq!(docs[1].as_ref().unwrap_err().0, 2); // line 2
//! assert_eq!(docs[2].as_deref(), Ok("two"));
//! ```

use super::error::{DataError, Result};
use std::path::Path;

/// A document's text, or where it is (the 1-based line of a text or JSONL
/// file; 0 for Parquet, whose message names the row group and row) and
/// what is wrong.
pub type Doc = std::result::Result<String, (usize, String)>;

/// Whether a file is read as Parquet (by its extension).
pub fn is_parquet(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// Whether a file is read as JSONL (by its extension): `.jsonl`,
/// `.ndjson`, and `.json`, which Hugging Face's `json` loader reads as JSON
/// Lines too (a `.json` holding one JSON array is refused, saying so).
pub fn is_jsonl(p: &Path) -> bool {
    p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        ["jsonl", "ndjson", "json"]
            .iter()
            .any(|x| e.eq_ignore_ascii_case(x))
    })
}

/// Every document of `path` in file order (blank JSONL lines are not
/// documents, and an empty text file holds none, as an empty JSONL file
/// holds none); JSONL records are parsed on `threads` threads. `field_key`
/// names where `field` came from, for messages.
pub fn documents(path: &Path, field: &str, field_key: &str, threads: usize) -> Result<Vec<Doc>> {
    if is_parquet(path) {
        return parquet_documents(path, field, field_key);
    }
    super::paths::check_regular(path)?;
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(documents_of(
        &bytes,
        is_jsonl(path),
        field,
        field_key,
        threads,
    ))
}

/// [`documents`] of a file's bytes.
pub fn documents_of(
    bytes: &[u8],
    jsonl: bool,
    field: &str,
    field_key: &str,
    threads: usize,
) -> Vec<Doc> {
    if !jsonl {
        if bytes.is_empty() {
            return Vec::new();
        }
        return vec![match std::str::from_utf8(bytes) {
            Ok(t) => Ok(t.to_string()),
            Err(e) => Err((
                1 + bytes[..e.valid_up_to()]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count(),
                format!("not valid UTF-8 at byte {}", e.valid_up_to()),
            )),
        }];
    }
    let lines: Vec<(usize, &[u8])> = bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix(b"\r").unwrap_or(l)))
        .filter(|(_, l)| !l.iter().all(|b| b.is_ascii_whitespace()))
        .collect();
    par_map(&lines, threads, |&(n, l)| {
        record_text(l, field, field_key).map_err(|m| (n, m))
    })
}

/// `f` over `items` on up to `threads` scoped threads, each a contiguous
/// share, the results in the items' order (so they do not depend on the
/// thread count).
pub fn par_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let per = items.len().div_ceil(threads.max(1)).max(1);
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = items
            .chunks(per)
            .map(|share| s.spawn(move || share.iter().map(f).collect::<Vec<R>>()))
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().expect("a data worker thread panicked"))
            .collect()
    })
}

/// The text of one JSONL record, or what is wrong with it.
pub fn record_text(
    line: &[u8],
    field: &str,
    field_key: &str,
) -> std::result::Result<String, String> {
    let s = std::str::from_utf8(line)
        .map_err(|e| format!("not valid UTF-8 at byte {} of the line", e.valid_up_to()))?;
    // A byte-order mark (Windows tools write one at the start of a file)
    // is never JSON: read past it, as Python's `utf-8-sig` does.
    let s = s.strip_prefix('\u{feff}').unwrap_or(s);
    // A whole JSON array (on one line or spread over many) is a file of
    // another shape, not a bad record: say which.
    let array = || {
        "a JSON array, not a record: JSON Lines hold one JSON object per line (write the \
         array's objects one per line)"
            .to_string()
    };
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| {
        if s.trim_start().starts_with('[') {
            array()
        } else if s.trim() == "{" {
            "the start of one JSON document spread over many lines, not a record: JSON Lines \
             hold one whole JSON object per line"
                .to_string()
        } else {
            format!("not a JSON record ({e})")
        }
    })?;
    if v.is_array() {
        return Err(array());
    }
    match v.get(field) {
        Some(serde_json::Value::String(t)) => Ok(t.clone()),
        Some(other) => Err(format!(
            "field {field:?} ({field_key}) is {}, not a string",
            json_kind(other)
        )),
        None => Err(format!("no field {field:?} ({field_key})")),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn parquet_err(path: &Path, msg: String) -> DataError {
    DataError::Format {
        path: path.to_path_buf(),
        msg,
    }
}

type ParquetReader = parquet::file::reader::SerializedFileReader<std::fs::File>;

/// A Parquet file opened, and its column `field` (a string or bytes
/// column: anything else is refused naming the file and the columns).
fn open_parquet(
    path: &Path,
    field: &str,
    field_key: &str,
) -> Result<(ParquetReader, parquet::schema::types::TypePtr)> {
    use parquet::basic::Type as Physical;
    use parquet::file::reader::FileReader;
    super::paths::check_regular(path)?;
    let f = std::fs::File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = ParquetReader::new(f)
        .map_err(|e| parquet_err(path, format!("not a readable Parquet file: {e}")))?;
    let root = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    let Some(col) = root
        .get_fields()
        .iter()
        .find(|t| t.name() == field)
        .cloned()
    else {
        let names: Vec<&str> = root.get_fields().iter().map(|t| t.name()).collect();
        return Err(parquet_err(
            path,
            format!("no column {field:?} ({field_key}); its columns are {names:?}"),
        ));
    };
    if !col.is_primitive() || col.get_physical_type() != Physical::BYTE_ARRAY {
        return Err(parquet_err(
            path,
            format!("column {field:?} ({field_key}) is not a string column"),
        ));
    }
    Ok((reader, col))
}

/// The checks made before training on a Parquet file: it opens, has the
/// string column `field`, and has rows.
pub fn check_parquet(path: &Path, field: &str, field_key: &str) -> Result<()> {
    use parquet::file::reader::FileReader;
    let (reader, _) = open_parquet(path, field, field_key)?;
    if reader.metadata().file_metadata().num_rows() == 0 {
        return Err(parquet_err(path, "no rows".into()));
    }
    Ok(())
}

/// The string column `field` of a Parquet file, one document per row.
fn parquet_documents(path: &Path, field: &str, field_key: &str) -> Result<Vec<Doc>> {
    use parquet::file::reader::FileReader;
    use parquet::record::Field;
    let (reader, col) = open_parquet(path, field, field_key)?;
    let root = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    let projection = parquet::schema::types::Type::group_type_builder(root.name())
        .with_fields(vec![col])
        .build()
        .map_err(|e| parquet_err(path, e.to_string()))?;
    let mut out = Vec::new();
    for g in 0..reader.num_row_groups() {
        let at = |r: usize| format!("row group {g}, row {r}");
        let group = reader
            .get_row_group(g)
            .map_err(|e| parquet_err(path, format!("row group {g}: {e}")))?;
        let rows = group
            .get_row_iter(Some(projection.clone()))
            .map_err(|e| parquet_err(path, format!("row group {g}: {e}")))?;
        for (r, row) in rows.enumerate() {
            let row = row.map_err(|e| parquet_err(path, format!("{}: {e}", at(r))))?;
            let doc =
                match row.get_column_iter().next().map(|(_, v)| v) {
                    Some(Field::Str(s)) => Ok(s.clone()),
                    Some(Field::Bytes(b)) => std::str::from_utf8(b.data())
                        .map(str::to_string)
                        .map_err(|e| {
                            format!(
                                "{}: column {field:?} is not valid UTF-8 at byte {}",
                                at(r),
                                e.valid_up_to()
                            )
                        }),
                    Some(Field::Null) | None => {
                        Err(format!("{}: column {field:?} ({field_key}) is null", at(r)))
                    }
                    Some(other) => Err(format!(
                        "{}: column {field:?} ({field_key}) is {other}, not a string",
                        at(r)
                    )),
                };
            out.push(doc.map_err(|m| (0, m)));
        }
    }
    Ok(out)
}
