//! A source of token shards (llm.c or nanoGPT `.bin`, memory-mapped), with
//! random access to its `k`-th sample.
//!
//! Each shard keeps the tail `val_fraction` of its tokens for validation
//! (as a single file does) and cuts the rest into samples of `T + 1` tokens
//! at stride `T`; samples never cross shards. A shard whose tail would be
//! shorter than one sample (`T + 1` tokens) keeps none: all its tokens
//! train (a note counts such shards). Epoch `e = k / n` (n: the
//! source's training samples) visits the shards in the order
//! `perm(shards, seed_s, e)`, and each shard's samples in the order
//! `perm(n_i, seed_s ^ mix(i), e)` (with `data.shuffle`; listed order
//! otherwise), so the `k`-th sample is a pure function of `(seed, k)` and
//! both the shard order and the order within shards change every epoch.
//! Memory: the maps (pages the batches touch) and the permutations of the
//! shards in use (8 bytes per sample of a shard), never the whole corpus.

use super::error::{DataError, Result};
use super::loader::val_tokens;
use super::shuffle::{mix64, permutation};
use super::source::TokenData;
use std::sync::{Arc, Mutex};

type EpochIndex = (u64, Arc<(Vec<u64>, Vec<u64>)>);
/// ((epoch, shard), the shard's sample permutation).
type PermEntry = ((u64, usize), Arc<Vec<u64>>);

/// A binary source (see the module docs).
pub struct BinSource {
    shards: Vec<Arc<TokenData>>,
    train_len: Vec<usize>,
    samples: Vec<u64>,
    total: u64,
    seq_len: usize,
    shuffle: bool,
    seed: u64,
    /// (epoch, (shard order, prefix sums of samples in that order)).
    epoch: Mutex<Option<EpochIndex>>,
    /// Within-shard permutations in use, newest last: ((epoch, shard), perm).
    perms: Mutex<Vec<PermEntry>>,
    /// How the config names it (for notes).
    name: String,
    /// Shards too short to hold out a validation sample (see the module docs).
    val_short: usize,
}

impl BinSource {
    /// `shards` opened and checked; `seed` is this source's own.
    pub fn new(
        shards: Vec<TokenData>,
        seq_len: usize,
        val_fraction: f64,
        shuffle: bool,
        seed: u64,
        name: &str,
    ) -> Result<BinSource> {
        let mut train_len = Vec::new();
        let mut samples = Vec::new();
        let mut val_short = 0;
        for s in &shards {
            let mut v = val_tokens(s.len(), val_fraction);
            if v > 0 && v < seq_len + 1 {
                // Too short to validate on; an error here would stop any
                // corpus with a short shard (`phalanx tokenize` writes its
                // last one partial). Training keeps it: still disjoint
                // from validation, and a function of the config alone.
                v = 0;
                val_short += 1;
            }
            let t = s.len() - v;
            train_len.push(t);
            samples.push((t.saturating_sub(1) / seq_len) as u64);
        }
        let total: u64 = samples.iter().sum();
        if total == 0 {
            return Err(DataError::TooSmall(format!(
                "{name}: no shard holds seq_len + 1 = {} training tokens (shards of {:?} tokens)",
                seq_len + 1,
                shards.iter().map(|s| s.len()).collect::<Vec<_>>()
            )));
        }
        Ok(BinSource {
            shards: shards.into_iter().map(Arc::new).collect(),
            train_len,
            samples,
            total,
            seq_len,
            shuffle,
            seed,
            epoch: Mutex::new(None),
            perms: Mutex::new(Vec::new()),
            name: name.to_string(),
            val_short,
        })
    }

    /// A note when more than 1% of the training tokens are never trained
    /// on: samples do not cross shards, so each shard's tail after its last
    /// whole sample, and every shard shorter than seq_len + 1 tokens, is
    /// left out (every epoch). Many small token files lose most of it. It
    /// also counts the shards that hold out no validation tail (too short).
    pub fn unused_note(&self) -> Option<String> {
        let t = self.seq_len as u64;
        let (mut unused, mut total) = (0u64, 0u64);
        for (&len, &n) in self.train_len.iter().zip(&self.samples) {
            let len = len as u64;
            total += len;
            unused += if n == 0 { len } else { len - (n * t + 1) };
        }
        let short = self.samples.iter().filter(|&&n| n == 0).count();
        let mut parts = Vec::new();
        if total > 0 && unused * 100 > total {
            parts.push(format!(
                "{unused} of its {total} training tokens ({:.1}%) are never trained on: samples \
                 do not cross shards, so each shard's tail after its last whole sample of \
                 seq_len + 1 = {} tokens is left out{}",
                unused as f64 * 100.0 / total as f64,
                t + 1,
                if short > 0 {
                    format!(", and {short} shard(s) are shorter than that")
                } else {
                    String::new()
                }
            ));
        }
        if self.val_short > 0 {
            parts.push(format!(
                "{} shard(s) are too short to hold out a validation tail (data.val_fraction) \
                 of seq_len + 1 = {} tokens: they hold out none, and all their tokens are \
                 training tokens",
                self.val_short,
                t + 1
            ));
        }
        (!parts.is_empty()).then(|| format!("{}: {}", self.name, parts.join("; ")))
    }

    /// Training samples in one epoch.
    pub fn samples(&self) -> u64 {
        self.total
    }

    pub fn train_tokens(&self) -> usize {
        self.train_len.iter().sum()
    }

    pub fn shards(&self) -> &[Arc<TokenData>] {
        &self.shards
    }

    /// The validation part of each shard: (shard, first token, tokens).
    pub fn val_parts(&self) -> Vec<(Arc<TokenData>, usize, usize)> {
        self.shards
            .iter()
            .zip(&self.train_len)
            .filter(|(s, &t)| s.len() > t)
            .map(|(s, &t)| (s.clone(), t, s.len() - t))
            .collect()
    }

    fn epoch_index(&self, e: u64) -> Arc<(Vec<u64>, Vec<u64>)> {
        let mut c = self.epoch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((ce, v)) = c.as_ref() {
            if *ce == e {
                return v.clone();
            }
        }
        let n = self.shards.len() as u64;
        let order = if self.shuffle {
            permutation(n, self.seed, e)
        } else {
            (0..n).collect()
        };
        let mut prefix = Vec::with_capacity(order.len() + 1);
        let mut acc = 0;
        prefix.push(0);
        for &s in &order {
            acc += self.samples[s as usize];
            prefix.push(acc);
        }
        let v = Arc::new((order, prefix));
        *c = Some((e, v.clone()));
        v
    }

    fn shard_perm(&self, e: u64, shard: usize) -> Arc<Vec<u64>> {
        let mut c = self.perms.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = c.iter().position(|(key, _)| *key == (e, shard)) {
            let hit = c.remove(i);
            let p = hit.1.clone();
            c.push(hit);
            return p;
        }
        let seed = self.seed ^ mix64(shard as u64 + 1);
        let p = Arc::new(permutation(self.samples[shard], seed, e));
        // A few shards are in use at once (a step can straddle two; ranks
        // sharing a loader may lag each other): keep the last eight.
        if c.len() >= 8 {
            c.remove(0);
        }
        c.push(((e, shard), p.clone()));
        p
    }

    /// Shard and sample within it of this source's `k`-th sample.
    pub fn locate(&self, k: u64) -> (usize, u64) {
        let (e, pos) = (k / self.total, k % self.total);
        let idx = self.epoch_index(e);
        let (order, prefix) = (&idx.0, &idx.1);
        // The last slot whose prefix is <= pos (and that holds samples).
        let slot = prefix.partition_point(|&p| p <= pos) - 1;
        let shard = order[slot] as usize;
        let within = pos - prefix[slot];
        let j = if self.shuffle {
            self.shard_perm(e, shard)[within as usize]
        } else {
            within
        };
        (shard, j)
    }

    /// Appends the `k`-th sample's inputs and targets; checks the shard
    /// did not shrink and the tokens fit `vocab`.
    pub fn push_sample(
        &self,
        k: u64,
        vocab: Option<usize>,
        inputs: &mut Vec<u32>,
        targets: &mut Vec<u32>,
    ) -> Result<()> {
        let (shard, j) = self.locate(k);
        let d = &self.shards[shard];
        d.check_unchanged()?;
        let t = self.seq_len;
        let at = j as usize * t;
        let from = inputs.len();
        d.copy_range(at, at + t, inputs);
        d.copy_range(at + 1, at + t + 1, targets);
        if let Some(v) = vocab {
            check_tokens(&inputs[from..], targets.last(), v, d, at)?;
        }
        Ok(())
    }
}

/// A token id outside the model's vocabulary, named with its file and
/// position (checked per sample: a whole-corpus pass before training
/// would cost as much as reading the corpus).
pub fn check_tokens(
    tokens: &[u32],
    last: Option<&u32>,
    vocab: usize,
    d: &TokenData,
    at: usize,
) -> Result<()> {
    let bad = tokens
        .iter()
        .chain(last)
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab);
    match bad {
        None => Ok(()),
        Some((i, &t)) => Err(DataError::Format {
            path: d.path().map(|p| p.to_path_buf()).unwrap_or_default(),
            msg: format!(
                "token id {t} at token {} is out of range for the model's vocab_size {vocab} \
                 (was the data tokenized with another tokenizer?)",
                at + i.min(tokens.len())
            ),
        }),
    }
}
