//! The data position across a checkpoint: where step k starts (a global
//! sample index, so a resume with another global batch continues at the
//! same sample), what a checkpoint stores of the data, and the check that
//! refuses a resume on data that would give other samples.

use super::error::{DataError, Result};
use super::loader::DataLoader;
use super::text::Cursor;
use std::sync::atomic::Ordering::Relaxed;

/// What a checkpoint holds of the data: a fingerprint of everything that
/// decides the samples (checked on resume) and, for text sources, where
/// the stream stood (so a resume does not re-tokenize what came before).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataState {
    pub fingerprint: serde_json::Value,
    #[serde(default)]
    pub cursors: Vec<Option<Cursor>>,
}

/// The text loader's figures for the JSON log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoaderStats {
    /// Records skipped under `data.on_bad_record = "skip"`.
    pub skipped: u64,
    /// Tokens produced by the text readers, and the time they spent.
    pub tokens: u64,
    pub busy_s: f64,
    /// Tokenized shards waiting in the queues.
    pub queued: i64,
}

/// Fingerprint keys recorded since some version, each with the value (as
/// JSON) that a checkpoint of an earlier version had in effect: an old
/// checkpoint is compared as holding it. Any other key an old checkpoint
/// lacks cannot be compared, and is not.
const LATER_KEYS: &[(&str, &str)] = &[
    // Before `.json` files were JSON Lines they were read as plain text:
    // another token stream.
    ("json_lines", "false"),
];

impl DataLoader {
    /// Everything that decides the samples, as checked on resume.
    pub fn fingerprint(&self) -> serde_json::Value {
        match &self.corpus {
            Some(c) => c.fingerprint.clone(),
            None => {
                let mut f = serde_json::json!({
                "seq_len": self.seq_len,
                "seed": self.seed,
                "shuffle": self.shuffle,
                // The name, not the path: a resume from another directory
                // reads the same file.
                "file": self.train.data.path().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()),
                "train_tokens": self.train.len,
                "val_tokens": self.val.len,
                // Another file of the same name and length (see `digest`).
                "content": self.train.data.path().and_then(|p| super::digest::of_files(&[p.to_path_buf()]).ok()),
                });
                if let Some(t) = self.train.data.tokenizer_content() {
                    f["tokenizer_content"] = serde_json::json!(t);
                }
                f
            }
        }
    }

    /// The global index step `step` starts at, for a global batch of `g`.
    pub fn position(&self, step: u64, global_batch: usize) -> u64 {
        let (s0, g0) = *self.base.lock().unwrap_or_else(|e| e.into_inner());
        // Steps before the resumed one (a pipeline's timing sample of step
        // 0) count back from it.
        (g0 as i128 + (step as i128 - s0 as i128) * global_batch as i128).max(0) as u64
    }

    /// The data state after `step` steps of `global_batch` (what a
    /// checkpoint of that step stores).
    pub fn state_at(&self, step: u64, global_batch: usize) -> Result<DataState> {
        let g = self.position(step, global_batch);
        Ok(DataState {
            fingerprint: self.fingerprint(),
            cursors: match &self.corpus {
                Some(c) => c.cursors_at(g)?,
                None => Vec::new(),
            },
        })
    }

    /// Continue at step `step` from global index `consumed` (a checkpoint's
    /// `samples_consumed`): step `step + i` then starts at `consumed + i*G`
    /// whatever the global batch G, so a resume with another batch neither
    /// repeats nor skips a sample. A `state` whose fingerprint differs from
    /// this loader's is refused, naming the key and both values.
    pub fn resume_at(&self, step: u64, consumed: u64, state: Option<&DataState>) -> Result<()> {
        self.resume_at_or_warn(step, consumed, state, false)
            .map(|_| ())
    }

    /// [`DataLoader::resume_at`]; with `warn`, data that differs from the
    /// checkpoint's is not an error: the difference comes back as a
    /// warning, and the run continues at the checkpoint's sample position
    /// in the data as it is now (the checkpoint's text cursors, which
    /// describe the old data, are not used).
    pub fn resume_at_or_warn(
        &self,
        step: u64,
        consumed: u64,
        state: Option<&DataState>,
        warn: bool,
    ) -> Result<Option<String>> {
        let mut warning = None;
        if let Some(st) = state {
            let mut now = self.fingerprint();
            let mut saved = st.fingerprint.clone();
            if let (Some(saved), Some(n)) = (saved.as_object_mut(), now.as_object_mut()) {
                // What a checkpoint of an earlier version did not record
                // (the content digest) cannot be compared; nor the
                // tokenizer it recorded for token files, which are read
                // as ids whatever it is; nor what is done with a bad
                // record, which changes no sample before the position (a
                // run under `error` stops at the first, before any sample
                // needs it).
                // A text file encoded with a tokenizer.json was held in
                // memory without its path before its tokenizer's digest was
                // recorded: such a checkpoint has null for the file and its
                // content, which are not known, not another file.
                if n.contains_key("tokenizer_content")
                    && !saved.contains_key("tokenizer_content")
                    && saved.get("file").is_some_and(|f| f.is_null())
                {
                    for k in ["file", "content"] {
                        saved.remove(k);
                        n.remove(k);
                    }
                }
                // Except the keys in `LATER_KEYS`, whose old value is known.
                for (key, old) in LATER_KEYS {
                    if n.contains_key(*key) && !saved.contains_key(*key) {
                        let old = serde_json::from_str(old).expect("LATER_KEYS holds JSON");
                        saved.insert(key.to_string(), old);
                    }
                }
                n.retain(|k, _| saved.contains_key(k));
                if !n.contains_key("tokenizer") {
                    saved.remove("tokenizer");
                }
                saved.remove("on_bad_record");
                n.remove("on_bad_record");
            }
            if let Some(d) = first_difference("data", &saved, &now) {
                if !warn {
                    return Err(DataError::Config(format!(
                        "the checkpoint was trained on other data, which would silently change \
                         the samples of the resumed run: {d}; resume with the checkpoint's data \
                         config, start a new run, or set data.on_resume_mismatch = \"warn\" to \
                         continue at its position in this data{}",
                        val_shards_left_out(&saved, &now)
                    )));
                }
                warning = Some(format!(
                    "the checkpoint was trained on other data ({d}); data.on_resume_mismatch = \
                     \"warn\": continuing at its sample position {consumed} in this data"
                ));
            }
        }
        if let (Some(st), None) = (state, &warning) {
            // A cursor lies at or before the position it resumes (the
            // start of the shard holding the next sample).
            let at = consumed.checked_mul(self.seq_len as u64);
            if let Some(c) = st
                .cursors
                .iter()
                .flatten()
                .find(|c| at.is_none_or(|a| c.offset > a))
            {
                return Err(DataError::Config(format!(
                    "the checkpoint's data cursor at token {} lies beyond its position \
                     (sample {consumed} of {} tokens)",
                    c.offset, self.seq_len
                )));
            }
            if let Some(c) = &self.corpus {
                c.add_cursors(&st.cursors)?;
            }
        }
        *self.base.lock().unwrap_or_else(|e| e.into_inner()) = (step, consumed);
        Ok(warning)
    }

    /// The text loader's figures, when a text source is read.
    pub fn stats(&self) -> Option<LoaderStats> {
        let c = self.corpus.as_ref()?;
        if !c
            .sources
            .iter()
            .any(|s| matches!(s, super::corpus::Source::Text(_)))
        {
            return None;
        }
        let s = &c.stats;
        Some(LoaderStats {
            skipped: s.skipped.load(Relaxed),
            tokens: s.tokens.load(Relaxed),
            busy_s: s.busy_ns.load(Relaxed) as f64 * 1e-9,
            queued: s.queued.load(Relaxed),
        })
    }
}

/// The first place two fingerprints differ, as `key: checkpoint A, this run B`.
fn first_difference(
    key: &str,
    saved: &serde_json::Value,
    now: &serde_json::Value,
) -> Option<String> {
    first_difference_as(key, saved, now, ("checkpoint", "this run"))
}

/// The first place two JSON values differ, as `key: A' A, B' B` with the
/// names `(A', B')` of what holds each.
pub(crate) fn first_difference_as(
    key: &str,
    a: &serde_json::Value,
    b: &serde_json::Value,
    names: (&str, &str),
) -> Option<String> {
    use serde_json::Value;
    let (na, nb) = names;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let null = Value::Null;
                first_difference_as(
                    &format!("{key}.{k}"),
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    names,
                )
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference_as(&format!("{key}[{i}]"), p, q, names)),
        // Lists of other lengths (a file added or removed): their lengths
        // and the first entry that differs, not both lists whole (10,000
        // shards would print megabytes).
        (Value::Array(x), Value::Array(y)) => {
            let i = x.iter().zip(y).take_while(|(p, q)| p == q).count();
            let at = |v: &Vec<Value>| v.get(i).map_or("nothing".into(), |e| e.to_string());
            Some(format!(
                "{key}: {na} {} entries, {nb} {}; the first difference is at [{i}]: {na} {}, \
                 {nb} {}",
                x.len(),
                y.len(),
                at(x),
                at(y)
            ))
        }
        (x, y) if x == y => None,
        (x, y) => Some(format!("{key}: {na} {x}, {nb} {y}")),
    }
}

/// A hint where the saved files hold a `phalanx tokenize` validation shard
/// (`*_val_NNNNNN.bin`) that the data now leaves out: a tokenize output
/// directory trained on its validation shard before it was left out.
fn val_shards_left_out(saved: &serde_json::Value, now: &serde_json::Value) -> String {
    let names = |v: &serde_json::Value| -> Vec<String> {
        v.to_string()
            .split('"')
            .filter(|s| super::paths::val_shard_prefix(s).is_some())
            .map(str::to_string)
            .collect()
    };
    let now = names(now);
    match names(saved).into_iter().find(|n| !now.contains(n)) {
        Some(n) => format!(
            " (the checkpoint trained on {n}, a phalanx tokenize validation shard that a \
             tokenize output directory as data.path now leaves out: give data.path = \
             \"DIR/*.bin\" to read it as the checkpoint did)"
        ),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::val_shards_left_out;
    use serde_json::json;

    #[test]
    fn a_validation_shard_left_out_is_named() {
        let saved = json!({"sources": [{"files": [["data_val_000000.bin", 10], ["data_train_000001.bin", 20]]}]});
        let now = json!({"sources": [{"files": [["data_train_000001.bin", 20]]}]});
        let hint = val_shards_left_out(&saved, &now);
        assert!(hint.contains("trained on data_val_000000.bin"), "{hint}");
        assert_eq!(val_shards_left_out(&saved, &saved), "");
        let other = json!({"sources": [{"files": [["my_val_set.bin", 10]]}]});
        assert_eq!(val_shards_left_out(&other, &now), "");
    }
}
