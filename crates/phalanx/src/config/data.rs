//! The `data` section's paths and sources: `data.path` as one path or a
//! list (each a file, a directory or a glob), `[[data.sources]]` tables
//! with `path`, `weight` and `field`, and what they become for the loader
//! ([`crate::data::CorpusConfig`]).
//!
//! ```
//! use phalanx::config::TrainConfig;
//! let cfg = TrainConfig::build(None, &["data.path=[\"a/*.bin\", \"b.jsonl\"]".into()]).unwrap();
//! assert_eq!(cfg.data.path.to_string(), "a/*.bin, b.jsonl");
//! assert!(cfg.data.uses_corpus());
//! ```

use super::{ConfigError, DataConfig, Result};
use crate::data::{paths, CorpusConfig, SourceSpec, TextEncoder};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// One path (a file, a directory, a glob) or a list of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum DataPath {
    One(String),
    Many(Vec<String>),
}

impl DataPath {
    pub fn list(&self) -> Vec<String> {
        match self {
            DataPath::One(p) => vec![p.clone()],
            DataPath::Many(v) => v.clone(),
        }
    }

    /// The one plain file this names (no glob, no list, not a directory),
    /// as the single-file loader reads it.
    pub fn single_file(&self) -> Option<&str> {
        match self {
            DataPath::One(p) if !paths::is_glob(p) && !std::path::Path::new(p).is_dir() => Some(p),
            _ => None,
        }
    }
}

impl Default for DataPath {
    fn default() -> Self {
        DataPath::One("data/corpus.txt".into())
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.list().join(", "))
    }
}

impl PartialEq<&str> for DataPath {
    fn eq(&self, other: &&str) -> bool {
        matches!(self, DataPath::One(p) if p == other)
    }
}

/// The path checks against outputs use (the first entry of a list).
impl From<&DataPath> for PathBuf {
    fn from(p: &DataPath) -> PathBuf {
        PathBuf::from(p.list().into_iter().next().unwrap_or_default())
    }
}

/// A `[[data.sources]]` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSource {
    pub path: DataPath,
    /// Relative share of the samples (any positive scale).
    #[serde(default = "one")]
    pub weight: f64,
    /// JSONL key holding a document's text.
    #[serde(default = "text")]
    pub field: String,
}

fn one() -> f64 {
    1.0
}

fn text() -> String {
    "text".into()
}

impl DataConfig {
    /// Whether the data is read as a corpus (sources, lists, globs,
    /// directories, JSONL, `data.val_path`) rather than one file.
    pub fn uses_corpus(&self) -> bool {
        let records = |p: &str| {
            let p = std::path::Path::new(p);
            crate::data::records::is_jsonl(p) || crate::data::records::is_parquet(p)
        };
        !self.sources.is_empty()
            || !self.val_path.list().is_empty()
            || self.path.single_file().is_none_or(records)
    }

    /// The sources' weights, in order.
    fn weights(&self) -> Vec<f64> {
        self.sources.iter().map(|s| s.weight).collect()
    }

    /// What the data is, in a line: `data.path`, or every source with its
    /// weight (and the validation files, when given).
    pub fn describe(&self) -> String {
        let mut s = if self.sources.is_empty() {
            self.path.to_string()
        } else {
            let shares = crate::data::mix::shares(&self.weights());
            let total: f64 = shares.iter().sum();
            let each: Vec<String> = self
                .sources
                .iter()
                .zip(&shares)
                .map(|(s, w)| format!("{} ({:.0}%)", s.path, 100.0 * w / total))
                .collect();
            format!("{} sources: {}", self.sources.len(), each.join("; "))
        };
        if !self.val_path.list().is_empty() {
            s += &format!("; validation {}", self.val_path);
        }
        s
    }

    /// The refusal of `data.path` beside `[[data.sources]]`.
    pub(super) fn path_and_sources(&self) -> ConfigError {
        ConfigError(format!(
            "data.path = {:?} and [[data.sources]] both name the training data; set one",
            self.path.to_string()
        ))
    }

    /// Checks of the section that need no file. (`data.path` given as its
    /// default beside sources is refused where the keys are read, by
    /// `TrainConfig::build`.)
    pub fn validate(&self) -> Result<()> {
        if !self.sources.is_empty() && self.path != super::DEFAULT_DATA_PATH {
            return Err(self.path_and_sources());
        }
        for (i, s) in self.sources.iter().enumerate() {
            if !(s.weight.is_finite() && s.weight > 0.0) {
                return Err(ConfigError(format!(
                    "data.sources[{i}].weight must be finite and > 0, not {}",
                    s.weight
                )));
            }
            if s.path.list().is_empty() {
                return Err(ConfigError(format!("data.sources[{i}].path is empty")));
            }
        }
        // The mixer counts shares in 2^-32 units: a source whose share
        // rounds to none would never be read.
        if let Some(i) = crate::data::mix::never_read(&self.weights()) {
            return Err(ConfigError(format!(
                "data.sources[{i}].weight = {} is too small beside the others' (below 2^-32 of \
                 their sum): the source would never be read; raise it or drop the source",
                self.sources[i].weight
            )));
        }
        if self.path.list().is_empty() {
            return Err(ConfigError("data.path is an empty list".into()));
        }
        Ok(())
    }

    /// The loader's corpus config for samples of `seq_len` tokens below
    /// `vocab_size`, text encoded by `encoder`.
    pub fn corpus_config(
        &self,
        seq_len: usize,
        vocab_size: Option<usize>,
        encoder: Arc<dyn TextEncoder>,
    ) -> CorpusConfig {
        let sources = if self.sources.is_empty() {
            vec![SourceSpec {
                paths: self.path.list(),
                weight: 1.0,
                field: self.field.clone(),
                key: "data.path".into(),
            }]
        } else {
            self.sources
                .iter()
                .enumerate()
                .map(|(i, s)| SourceSpec {
                    paths: s.path.list(),
                    weight: s.weight,
                    field: s.field.clone(),
                    key: format!("data.sources[{i}]"),
                })
                .collect()
        };
        CorpusConfig {
            sources,
            val_paths: self.val_path.list(),
            seq_len,
            val_fraction: self.val_fraction,
            shuffle: self.shuffle,
            seed: self.seed,
            vocab_size,
            on_bad_record: self.on_bad_record,
            threads: self.loader_threads,
            prefetch: self.prefetch.max(1),
            encoder,
        }
    }
}
