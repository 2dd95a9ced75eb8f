//! Batches in an order that does not depend on the parallel layout.
//!
//! With sequence length `T`, sample `j` of the training split is
//! `tokens[j*T .. j*T + T + 1]`: inputs are its first `T` tokens, targets its
//! last `T`. The split holds `n = floor((len - 1) / T)` samples.
//!
//! Step `k` with global batch `G = micro_batch * dp * grad_accum` uses the
//! global indices `k*G .. k*G + G - 1`. Global index `g` is sample
//! `g mod n` (the data wraps), or with shuffling `perm(seed, g / n)[g mod n]`,
//! a fresh permutation per epoch (see [`super::shuffle`]). Data-parallel rank
//! `r` takes the contiguous slice `[r*G/dp, (r+1)*G/dp)` of the step's
//! samples, and micro-step `a` the `a`-th run of `micro_batch` samples of that
//! slice. So the union of a step's micro-batches is the same for every
//! `(dp, grad_accum)` with the same `G`, which is what makes a run with N
//! ranks equivalent to a run with one.
//!
//! The validation split (the tail of the stream) is read in order, never shuffled.
//!
//! ```
//! use phalanx::data::{DataLoader, LoaderConfig, TokenData};
//! let data = TokenData::from_tokens((0..100).collect());
//! let cfg = LoaderConfig { seq_len: 4, val_fraction: 0.2, shuffle: false, ..Default::default() };
//! let loader = DataLoader::new(data, cfg).unwrap();
//! // 80 training tokens hold floor(79 / 4) = 19 samples.
//! assert_eq!(loader.train_samples(), 19);
//! // Step 1, rank 1 of 2, micro-step 0, micro-batch 2, no accumulation: G = 4,
//! // samples 4..8 of which rank 1 takes 6 and 7.
//! let b = loader.micro_batch(1, 1, 2, 0, 2, 1).unwrap();
//! assert_eq!(b.inputs, vec![24, 25, 26, 27, 28, 29, 30, 31]);
//! assert_eq!(b.targets, vec![25, 26, 27, 28, 29, 30, 31, 32]);
//! ```

use super::corpus::Corpus;
use super::error::{DataError, Result};
use super::shuffle::permutation;
use super::source::TokenData;
use super::tokenizer::Tokenizer;
use candle_core::{Device, Tensor};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// How to cut the stream into samples and splits.
#[derive(Clone, Debug, PartialEq)]
pub struct LoaderConfig {
    /// Tokens per sample (the model's block size `T`).
    pub seq_len: usize,
    /// Fraction of the stream, at its tail, kept for validation (0 for none).
    pub val_fraction: f64,
    /// Shuffle the training samples, with a new permutation each epoch.
    pub shuffle: bool,
    /// Seed of the shuffle.
    pub seed: u64,
    /// The model's vocabulary size: if set, every token is checked against it.
    pub vocab_size: Option<usize>,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            seq_len: 128,
            val_fraction: 0.1,
            shuffle: true,
            seed: 0,
            vocab_size: None,
        }
    }
}

/// One batch: `batch_size` rows of `seq_len` tokens each, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch_size: usize,
    pub seq_len: usize,
}

impl Batch {
    /// Inputs and targets as `(batch_size, seq_len)` u32 tensors.
    pub fn to_tensors(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let shape = (self.batch_size, self.seq_len);
        let inputs = Tensor::from_slice(&self.inputs, shape, device)?;
        let targets = Tensor::from_slice(&self.targets, shape, device)?;
        Ok((inputs, targets))
    }
}

/// The micro-batch size for a global batch: `global / (dp_size * grad_accum)`,
/// or an error if it does not divide.
pub fn micro_batch_size(global_batch: usize, dp_size: usize, grad_accum: usize) -> Result<usize> {
    if dp_size == 0 || grad_accum == 0 || global_batch == 0 {
        return Err(DataError::Config(format!(
            "global batch {global_batch}, dp {dp_size} and grad_accum {grad_accum} must all be > 0"
        )));
    }
    if !global_batch.is_multiple_of(dp_size) {
        return Err(DataError::Config(format!(
            "global batch {global_batch} does not divide by dp {dp_size}"
        )));
    }
    let per_rank = global_batch / dp_size;
    if !per_rank.is_multiple_of(grad_accum) {
        return Err(DataError::Config(format!(
            "global batch {global_batch} / dp {dp_size} = {per_rank} samples per rank do not \
             divide by grad_accum {grad_accum}"
        )));
    }
    Ok(per_rank / grad_accum)
}

/// A contiguous part of a token stream.
#[derive(Clone, Debug)]
pub(super) struct Split {
    pub(super) data: Arc<TokenData>,
    start: usize,
    pub(super) len: usize,
}

impl Split {
    fn samples(&self, seq_len: usize) -> u64 {
        (self.len.saturating_sub(1) / seq_len) as u64
    }

    /// Appends sample `j`'s inputs and targets.
    fn push_sample(&self, j: u64, seq_len: usize, inputs: &mut Vec<u32>, targets: &mut Vec<u32>) {
        let at = self.start + j as usize * seq_len;
        self.data.copy_range(at, at + seq_len, inputs);
        self.data.copy_range(at + 1, at + seq_len + 1, targets);
    }
}

/// Serves training micro-batches and validation batches (see the module docs).
pub struct DataLoader {
    /// One stream (`new`, `with_val`, `open`); empty when `corpus` is set.
    pub(super) train: Split,
    pub(super) val: Split,
    pub(super) seq_len: usize,
    pub(super) shuffle: bool,
    pub(super) seed: u64,
    /// The permutations of the last epochs used: a step can straddle two.
    perms: Mutex<Vec<(u64, Arc<Vec<u64>>)>>,
    /// Many shards and sources ([`DataLoader::from_corpus`]).
    pub(super) corpus: Option<Corpus>,
    /// `(step, global index)`: step `base.0` starts at global index
    /// `base.1` (0, 0 unless resumed: see [`DataLoader::resume_at`]).
    pub(super) base: Mutex<(u64, u64)>,
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("seq_len", &self.seq_len)
            .field("train_tokens", &self.train.len)
            .field("val_tokens", &self.val.len)
            .field("shuffle", &self.shuffle)
            .field("seed", &self.seed)
            .finish()
    }
}

impl DataLoader {
    /// Splits one stream: validation is the last `ceil(len * val_fraction)`
    /// tokens, training the rest.
    pub fn new(data: TokenData, cfg: LoaderConfig) -> Result<Self> {
        check_config(&cfg)?;
        let total = data.len();
        let name = describe(&data);
        if total < cfg.seq_len + 1 {
            return Err(DataError::TooSmall(format!(
                "{name} has {total} tokens, fewer than seq_len + 1 = {} for one sample",
                cfg.seq_len + 1
            )));
        }
        let val_len = val_tokens(total, cfg.val_fraction);
        let data = Arc::new(data);
        let train = Split {
            data: data.clone(),
            start: 0,
            len: total - val_len,
        };
        let val = Split {
            data,
            start: total - val_len,
            len: val_len,
        };
        Self::from_splits(train, val, cfg, &name)
    }

    /// Uses a separate validation stream (nanoGPT's train.bin / val.bin);
    /// `cfg.val_fraction` is ignored.
    pub fn with_val(train: TokenData, val: TokenData, cfg: LoaderConfig) -> Result<Self> {
        let cfg = LoaderConfig {
            val_fraction: 0.0,
            ..cfg
        };
        check_config(&cfg)?;
        let name = describe(&train);
        let whole = |d: TokenData| Split {
            len: d.len(),
            data: Arc::new(d),
            start: 0,
        };
        Self::from_splits(whole(train), whole(val), cfg, &name)
    }

    /// Opens a file (see [`TokenData::open`]) and splits it.
    pub fn open(path: impl AsRef<Path>, tokenizer: Tokenizer, cfg: LoaderConfig) -> Result<Self> {
        Self::new(TokenData::open(path, tokenizer)?, cfg)
    }

    fn from_splits(train: Split, val: Split, cfg: LoaderConfig, name: &str) -> Result<Self> {
        let need = cfg.seq_len + 1;
        if train.len < need {
            return Err(DataError::TooSmall(format!(
                "the training split of {name} has {} tokens, fewer than seq_len + 1 = {need}",
                train.len
            )));
        }
        // An empty validation split is fine (no validation); a non-empty one
        // too short for a single sample is almost surely a mistake.
        if val.len > 0 && val.len < need {
            return Err(DataError::TooSmall(format!(
                "the validation split of {name} has {} tokens, fewer than seq_len + 1 = {need}; \
                 raise val_fraction or set it to 0",
                val.len
            )));
        }
        if let Some(vocab) = cfg.vocab_size {
            train.data.check_vocab(vocab)?;
            if !Arc::ptr_eq(&train.data, &val.data) {
                val.data.check_vocab(vocab)?;
            }
        }
        Ok(DataLoader {
            train,
            val,
            seq_len: cfg.seq_len,
            shuffle: cfg.shuffle,
            seed: cfg.seed,
            perms: Mutex::new(Vec::new()),
            corpus: None,
            base: Mutex::new((0, 0)),
        })
    }

    /// Serves a corpus of many shards and sources (see [`super::corpus`]).
    pub fn from_corpus(corpus: Corpus) -> DataLoader {
        let empty = Split {
            data: Arc::new(TokenData::from_tokens(Vec::new())),
            start: 0,
            len: 0,
        };
        DataLoader {
            train: empty.clone(),
            val: empty,
            seq_len: corpus.seq_len,
            shuffle: false,
            seed: 0,
            perms: Mutex::new(Vec::new()),
            corpus: Some(corpus),
            base: Mutex::new((0, 0)),
        }
    }

    /// The corpus, when this loader serves one.
    pub fn corpus(&self) -> Option<&Corpus> {
        self.corpus.as_ref()
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Notes about the data for the run's log (see [`Corpus::notes`]).
    pub fn notes(&self) -> Vec<String> {
        self.corpus.as_ref().map_or_else(Vec::new, |c| c.notes())
    }

    /// Whether text is streamed and tokenized while training (a corpus's
    /// text sources): `train_tokens` does not count it.
    pub fn streams_text(&self) -> bool {
        self.corpus.as_ref().is_some_and(|c| c.has_text())
    }

    /// Training tokens (of a corpus: its token files'; text is streamed
    /// and not counted in advance).
    pub fn train_tokens(&self) -> usize {
        match &self.corpus {
            Some(c) => c.train_tokens(),
            None => self.train.len,
        }
    }

    pub fn val_tokens(&self) -> usize {
        match &self.corpus {
            Some(c) => c.val_tokens(),
            None => self.val.len,
        }
    }

    /// Number of training samples `n` (one epoch); a corpus with a text
    /// source, whose epoch is not known before it is read, says `u64::MAX`.
    pub fn train_samples(&self) -> u64 {
        match &self.corpus {
            Some(c) => c.train_samples().unwrap_or(u64::MAX),
            None => self.train.samples(self.seq_len),
        }
    }

    /// Number of validation samples.
    pub fn val_samples(&self) -> u64 {
        match &self.corpus {
            Some(c) => c.val_samples(),
            None => self.val.samples(self.seq_len),
        }
    }

    /// The training sample that global index `g` maps to (a corpus: `g`
    /// itself; its sources place it, see [`super::corpus`]).
    pub fn sample_index(&self, g: u64) -> u64 {
        if self.corpus.is_some() {
            return g;
        }
        let n = self.train_samples();
        let (epoch, pos) = (g / n, g % n);
        if !self.shuffle {
            return pos;
        }
        self.epoch_permutation(epoch)[pos as usize]
    }

    fn epoch_permutation(&self, epoch: u64) -> Arc<Vec<u64>> {
        let mut cache = self.perms.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = cache.iter().find(|(e, _)| *e == epoch) {
            return p.clone();
        }
        let p = Arc::new(permutation(self.train_samples(), self.seed, epoch));
        if cache.len() >= 2 {
            cache.remove(0);
        }
        cache.push((epoch, p.clone()));
        p
    }

    /// The `global_batch` sample indices of step `step`, in order.
    pub fn step_samples(&self, step: u64, global_batch: usize) -> Result<Vec<u64>> {
        self.check_global_batch(global_batch)?;
        Ok(self.samples_from(self.position(step, global_batch), global_batch))
    }

    /// The sample indices of `n` consecutive global positions from `first`.
    fn samples_from(&self, first: u64, n: usize) -> Vec<u64> {
        (first..first + n as u64)
            .map(|g| self.sample_index(g))
            .collect()
    }

    /// The sample indices of one micro-batch (see the module docs for the rule).
    pub fn micro_batch_samples(
        &self,
        step: u64,
        dp_rank: usize,
        dp_size: usize,
        micro_step: usize,
        micro_batch_size: usize,
        grad_accum: usize,
    ) -> Result<Vec<u64>> {
        if dp_rank >= dp_size || micro_step >= grad_accum || micro_batch_size == 0 {
            return Err(DataError::Config(format!(
                "need dp_rank {dp_rank} < dp_size {dp_size}, micro_step {micro_step} < \
                 grad_accum {grad_accum} and micro_batch_size {micro_batch_size} > 0"
            )));
        }
        let global_batch = micro_batch_size * dp_size * grad_accum;
        self.check_global_batch(global_batch)?;
        let rank_first = dp_rank * (global_batch / dp_size);
        let first =
            self.position(step, global_batch) + (rank_first + micro_step * micro_batch_size) as u64;
        Ok(self.samples_from(first, micro_batch_size))
    }

    /// The micro-batch that rank `dp_rank` runs at `micro_step` of `step`.
    pub fn micro_batch(
        &self,
        step: u64,
        dp_rank: usize,
        dp_size: usize,
        micro_step: usize,
        micro_batch_size: usize,
        grad_accum: usize,
    ) -> Result<Batch> {
        let samples = self.micro_batch_samples(
            step,
            dp_rank,
            dp_size,
            micro_step,
            micro_batch_size,
            grad_accum,
        )?;
        if let Some(c) = &self.corpus {
            let t = self.seq_len;
            let mut b = Batch {
                inputs: Vec::with_capacity(samples.len() * t),
                targets: Vec::with_capacity(samples.len() * t),
                batch_size: samples.len(),
                seq_len: t,
            };
            for &g in &samples {
                c.push_sample(g, &mut b.inputs, &mut b.targets)?;
            }
            return Ok(b);
        }
        self.train.data.check_unchanged()?;
        Ok(self.gather(&self.train, &samples))
    }

    /// Number of full validation batches of `batch_size` samples.
    pub fn val_batch_count(&self, batch_size: usize) -> usize {
        (self.val_samples() / batch_size.max(1) as u64) as usize
    }

    /// Which `n` of the validation split's batches of `batch_size` an
    /// evaluation of `n` batches reads: spread evenly over the split (of a
    /// corpus of many sources and shards, the first `n` would all come from
    /// one shard of the first source); all of them when there are no more.
    ///
    /// ```
    /// # use phalanx::data::{DataLoader, LoaderConfig, TokenData};
    /// let cfg = LoaderConfig { seq_len: 4, val_fraction: 0.5, ..Default::default() };
    /// let l = DataLoader::new(TokenData::from_tokens((0..202).map(|i| i % 256).collect()), cfg).unwrap();
    /// assert_eq!(l.val_batch_count(2), 12);
    /// assert_eq!(l.val_spread(4, 2), vec![0, 3, 6, 9]);
    /// assert_eq!(l.val_spread(20, 2), (0..12).collect::<Vec<_>>());
    /// ```
    pub fn val_spread(&self, n: usize, batch_size: usize) -> Vec<usize> {
        let count = self.val_batch_count(batch_size);
        let n = n.min(count);
        (0..n).map(|i| i * count / n).collect()
    }

    /// Validation batch `index`: samples `index*B .. index*B + B` of the
    /// validation split, in order.
    pub fn val_batch(&self, index: usize, batch_size: usize) -> Result<Batch> {
        let count = self.val_batch_count(batch_size);
        if batch_size == 0 || index >= count {
            return Err(DataError::TooSmall(format!(
                "validation batch {index} of {batch_size} samples: the validation split \
                 ({} tokens, {} samples of {} tokens) holds {count} such batches",
                self.val_tokens(),
                self.val_samples(),
                self.seq_len + 1
            )));
        }
        let first = (index * batch_size) as u64;
        let samples: Vec<u64> = (first..first + batch_size as u64).collect();
        if let Some(c) = &self.corpus {
            let t = self.seq_len;
            let (mut inputs, mut targets) = (Vec::new(), Vec::new());
            for &i in &samples {
                c.push_val(i, &mut inputs, &mut targets)?;
            }
            return Ok(Batch {
                inputs,
                targets,
                batch_size,
                seq_len: t,
            });
        }
        self.val.data.check_unchanged()?;
        Ok(self.gather(&self.val, &samples))
    }

    /// The first `min(max_batches, val_batch_count(batch_size))` validation batches.
    pub fn val_batches(
        &self,
        max_batches: usize,
        batch_size: usize,
    ) -> impl Iterator<Item = Batch> + '_ {
        let count = max_batches.min(self.val_batch_count(batch_size));
        (0..count).map(move |i| {
            self.val_batch(i, batch_size)
                .expect("index below val_batch_count")
        })
    }

    fn check_global_batch(&self, global_batch: usize) -> Result<()> {
        if self.corpus.is_some() {
            // Sources wrap or stream: any batch is served (the trainer
            // checks a token corpus holds one global batch).
            return Ok(());
        }
        let n = self.train_samples();
        if global_batch == 0 || (global_batch as u64) > n {
            return Err(DataError::TooSmall(format!(
                "the training split has {} tokens = {n} samples of seq_len {} (+1), but one \
                 global batch needs {global_batch} samples",
                self.train.len, self.seq_len
            )));
        }
        Ok(())
    }

    fn gather(&self, split: &Split, samples: &[u64]) -> Batch {
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(samples.len() * t);
        let mut targets = Vec::with_capacity(samples.len() * t);
        for &j in samples {
            split.push_sample(j, t, &mut inputs, &mut targets);
        }
        Batch {
            inputs,
            targets,
            batch_size: samples.len(),
            seq_len: t,
        }
    }
}

fn check_config(cfg: &LoaderConfig) -> Result<()> {
    if cfg.seq_len == 0 {
        return Err(DataError::Config("seq_len must be > 0".into()));
    }
    if !(0.0..1.0).contains(&cfg.val_fraction) {
        return Err(DataError::Config(format!(
            "val_fraction {} must be in [0, 1)",
            cfg.val_fraction
        )));
    }
    Ok(())
}

/// `ceil(total * val_fraction)`, ignoring float noise: 100 * 0.07 is
/// 7.000000000000001 in f64, which must give 7, not 8.
pub fn val_tokens(total: usize, val_fraction: f64) -> usize {
    let x = total as f64 * val_fraction;
    let r = x.round();
    if (x - r).abs() <= 1e-9 * r.max(1.0) {
        r as usize
    } else {
        x.ceil() as usize
    }
}

fn describe(data: &TokenData) -> String {
    match data.path() {
        Some(p) => format!("{}", p.display()),
        None => "the token stream".to_string(),
    }
}
