//! Batch order, splits, shuffling and batch errors of `phalanx::data`.
//!
//! Token `i` of the test streams has value `i`, so a sample's first input
//! token is `j * T` and the expected batches can be written by hand.

use phalanx::data::shuffle::{permutation, SplitMix64};
use phalanx::data::{micro_batch_size, DataError, DataLoader, LoaderConfig, TokenData};
use std::collections::BTreeSet;

fn loader(len: u32, seq_len: usize, shuffle: bool) -> DataLoader {
    let cfg = LoaderConfig {
        seq_len,
        val_fraction: 0.0,
        shuffle,
        seed: 7,
        vocab_size: None,
    };
    DataLoader::new(TokenData::from_tokens((0..len).collect()), cfg).unwrap()
}

/// Sample indices of (step, rank, micro-step) for micro_batch mb, dp, accum.
fn idx(
    l: &DataLoader,
    step: u64,
    rank: usize,
    dp: usize,
    a: usize,
    mb: usize,
    acc: usize,
) -> Vec<u64> {
    l.micro_batch_samples(step, rank, dp, a, mb, acc).unwrap()
}

#[test]
fn explicit_indices_without_shuffle() {
    // 50 tokens, T = 4: n = floor(49 / 4) = 12 samples.
    let l = loader(50, 4, false);
    assert_eq!(l.train_samples(), 12);
    // mb 2, dp 2, accum 1 (G = 4): step k covers 4k..4k+3, rank 1 the second half.
    assert_eq!(idx(&l, 0, 0, 2, 0, 2, 1), vec![0, 1]);
    assert_eq!(idx(&l, 0, 1, 2, 0, 2, 1), vec![2, 3]);
    assert_eq!(idx(&l, 2, 0, 2, 0, 2, 1), vec![8, 9]);
    assert_eq!(idx(&l, 2, 1, 2, 0, 2, 1), vec![10, 11]);
    // mb 1, dp 2, accum 2 (G = 4): step 1 is 4..7; rank 0 gets 4 then 5, rank 1 6 then 7.
    assert_eq!(idx(&l, 1, 0, 2, 0, 1, 2), vec![4]);
    assert_eq!(idx(&l, 1, 0, 2, 1, 1, 2), vec![5]);
    assert_eq!(idx(&l, 1, 1, 2, 0, 1, 2), vec![6]);
    assert_eq!(idx(&l, 1, 1, 2, 1, 1, 2), vec![7]);
    // mb 1, dp 3, accum 1 (G = 3): step 3 is 9, 10, 11.
    assert_eq!(idx(&l, 3, 0, 3, 0, 1, 1), vec![9]);
    assert_eq!(idx(&l, 3, 1, 3, 0, 1, 1), vec![10]);
    assert_eq!(idx(&l, 3, 2, 3, 0, 1, 1), vec![11]);
    // Step indices agree with the concatenation of the micro-batches.
    assert_eq!(l.step_samples(2, 4).unwrap(), vec![8, 9, 10, 11]);
}

#[test]
fn wraps_around_modulo_n() {
    let l = loader(50, 4, false); // n = 12
                                  // G = 4: step 3 is 12..15, i.e. samples 0..3 again; step 5 is 20..23 -> 8..11.
    assert_eq!(l.step_samples(3, 4).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(l.step_samples(5, 4).unwrap(), vec![8, 9, 10, 11]);
    // G = 5: step 2 is 10..14, straddling the end of the epoch.
    assert_eq!(l.step_samples(2, 5).unwrap(), vec![10, 11, 0, 1, 2]);
    // G = 3, dp 3: step 4 is 12..14 -> 0, 1, 2, one per rank.
    assert_eq!(idx(&l, 4, 2, 3, 0, 1, 1), vec![2]);
}

#[test]
fn batch_contents_are_shifted_windows() {
    let l = loader(50, 4, false);
    // Step 2, rank 1 of 2, mb 2: samples 10 and 11.
    let b = l.micro_batch(2, 1, 2, 0, 2, 1).unwrap();
    assert_eq!((b.batch_size, b.seq_len), (2, 4));
    assert_eq!(b.inputs, vec![40, 41, 42, 43, 44, 45, 46, 47]);
    assert_eq!(b.targets, vec![41, 42, 43, 44, 45, 46, 47, 48]);
    // Sample 11, the last, ends at token 48: token 49 would need a 13th sample.
    let b = l.micro_batch(0, 0, 1, 0, 12, 1).unwrap();
    assert_eq!(*b.targets.last().unwrap(), 48);
    // With 49 tokens there are still floor(48 / 4) = 12 samples, and all tokens are used.
    let l = loader(49, 4, false);
    assert_eq!(l.train_samples(), 12);
    assert_eq!(
        *l.micro_batch(0, 0, 1, 0, 12, 1)
            .unwrap()
            .targets
            .last()
            .unwrap(),
        48
    );
}

#[test]
fn union_over_layouts_is_identical() {
    // G = 12 for every (dp, accum): micro_batch = 12 / (dp * accum).
    for shuffle in [false, true] {
        let l = loader(1000, 8, shuffle); // n = 124
        for step in [0u64, 1, 10, 11, 50] {
            let reference = l.step_samples(step, 12).unwrap();
            for (dp, acc) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
                let mb = micro_batch_size(12, dp, acc).unwrap();
                let mut order = Vec::new();
                let mut inputs = Vec::new();
                for rank in 0..dp {
                    for a in 0..acc {
                        order.extend(idx(&l, step, rank, dp, a, mb, acc));
                        inputs.extend(l.micro_batch(step, rank, dp, a, mb, acc).unwrap().inputs);
                    }
                }
                // Ranks in order, micro-steps in order: exactly the step's samples.
                assert_eq!(order, reference, "dp {dp} accum {acc} step {step}");
                let whole = l.micro_batch(step, 0, 1, 0, 12, 1).unwrap();
                assert_eq!(inputs, whole.inputs);
            }
        }
    }
}

#[test]
fn splitmix64_reference_values() {
    // Published splitmix64 outputs for state 0.
    let mut r = SplitMix64::new(0);
    assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
    assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    assert_eq!(r.next_u64(), 0x06C4_5D18_8009_454F);
}

#[test]
fn permutation_matches_reference_and_is_a_permutation() {
    // From an independent Python implementation of the documented algorithm.
    assert_eq!(permutation(10, 42, 0), vec![9, 0, 6, 2, 1, 5, 8, 7, 4, 3]);
    assert_eq!(permutation(10, 42, 1), vec![9, 7, 1, 4, 8, 3, 0, 6, 5, 2]);
    assert_eq!(permutation(10, 43, 0), vec![0, 2, 3, 7, 5, 6, 4, 1, 9, 8]);
    assert_eq!(
        permutation(16, 0, 0),
        vec![2, 1, 9, 13, 11, 0, 14, 3, 8, 6, 4, 10, 15, 7, 5, 12]
    );
    for n in [0u64, 1, 2, 3, 17, 1000] {
        let mut p = permutation(n, 5, 3);
        p.sort_unstable();
        assert_eq!(p, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn shuffle_is_deterministic_and_covers_each_epoch() {
    let a = loader(1000, 8, true); // n = 124
    let b = loader(1000, 8, true);
    let n = a.train_samples();
    assert_eq!(n, 124);
    // G = 4 divides n: 31 steps are one epoch, each sample exactly once.
    for epoch in 0..2u64 {
        let mut seen = Vec::new();
        for step in epoch * 31..(epoch + 1) * 31 {
            let s = a.step_samples(step, 4).unwrap();
            assert_eq!(s, b.step_samples(step, 4).unwrap());
            seen.extend(s);
        }
        let set: BTreeSet<u64> = seen.iter().copied().collect();
        assert_eq!(set.len(), 124, "epoch {epoch} is a permutation");
        assert_eq!(seen, permutation(n, 7, epoch));
    }
    // Epochs differ from each other and from the unshuffled order.
    assert_ne!(permutation(n, 7, 0), permutation(n, 7, 1));
    assert_ne!(
        a.step_samples(0, 124).unwrap(),
        (0..124).collect::<Vec<_>>()
    );
    // Another seed gives another order.
    let cfg = LoaderConfig {
        seq_len: 8,
        val_fraction: 0.0,
        seed: 8,
        ..Default::default()
    };
    let c = DataLoader::new(TokenData::from_tokens((0..1000).collect()), cfg).unwrap();
    assert_ne!(
        c.step_samples(0, 124).unwrap(),
        a.step_samples(0, 124).unwrap()
    );
}

#[test]
fn validation_split_is_the_tail() {
    let cfg = LoaderConfig {
        seq_len: 4,
        val_fraction: 0.1,
        shuffle: true,
        ..Default::default()
    };
    let l = DataLoader::new(TokenData::from_tokens((0..100).collect()), cfg).unwrap();
    assert_eq!((l.train_tokens(), l.val_tokens()), (90, 10));
    assert_eq!((l.train_samples(), l.val_samples()), (22, 2));
    // Validation is in order: tokens 90..99.
    let v = l.val_batch(0, 2).unwrap();
    assert_eq!(v.inputs, vec![90, 91, 92, 93, 94, 95, 96, 97]);
    assert_eq!(v.targets, vec![91, 92, 93, 94, 95, 96, 97, 98]);
    let batches: Vec<_> = l.val_batches(10, 1).collect();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[1].inputs, vec![94, 95, 96, 97]);
    assert_eq!(l.val_batches(1, 1).count(), 1);
    assert!(l.val_batch(1, 2).is_err());
    // Training never reads validation tokens.
    let all = l.micro_batch(0, 0, 1, 0, 22, 1).unwrap();
    assert!(all.targets.iter().all(|&t| t < 90));
    // ceil(len * fraction), without float noise: 100 * 0.07 = 7, 101 * 0.07 -> 8.
    assert_eq!(phalanx::data::loader::val_tokens(100, 0.07), 7);
    assert_eq!(phalanx::data::loader::val_tokens(101, 0.07), 8);
    assert_eq!(phalanx::data::loader::val_tokens(100, 0.0), 0);
}

#[test]
fn separate_validation_stream() {
    let cfg = LoaderConfig {
        seq_len: 4,
        shuffle: false,
        ..Default::default()
    };
    let train = TokenData::from_tokens((0..20).collect());
    let val = TokenData::from_tokens((100..109).collect());
    let l = DataLoader::with_val(train, val, cfg).unwrap();
    assert_eq!((l.train_tokens(), l.val_tokens()), (20, 9));
    assert_eq!(l.val_batch(1, 1).unwrap().inputs, vec![104, 105, 106, 107]);
}

#[test]
fn tensors_have_batch_by_time_shape() {
    let l = loader(50, 4, false);
    let b = l.micro_batch(0, 0, 1, 0, 3, 1).unwrap();
    let (x, y) = b.to_tensors(&candle_core::Device::Cpu).unwrap();
    assert_eq!(x.dims(), &[3, 4]);
    assert_eq!(y.dtype(), candle_core::DType::U32);
    assert_eq!(y.to_vec2::<u32>().unwrap()[2], vec![9, 10, 11, 12]);
}

fn message(e: DataError) -> String {
    e.to_string()
}

#[test]
fn errors_name_the_sizes() {
    let cfg = LoaderConfig {
        seq_len: 4,
        val_fraction: 0.0,
        ..Default::default()
    };
    // Too short for one sample: 4 tokens, need 5.
    let e = DataLoader::new(TokenData::from_tokens(vec![1, 2, 3, 4]), cfg.clone()).unwrap_err();
    let m = message(e);
    assert!(m.contains("4 tokens") && m.contains("5"), "{m}");
    // The training split is too short once validation takes its share.
    let cfg_val = LoaderConfig {
        val_fraction: 0.5,
        ..cfg.clone()
    };
    let m =
        message(DataLoader::new(TokenData::from_tokens((0..8).collect()), cfg_val).unwrap_err());
    assert!(
        m.contains("training split") && m.contains("4 tokens"),
        "{m}"
    );
    // A global batch larger than the training split: 12 samples, G = 16.
    let l = loader(50, 4, false);
    let m = message(l.micro_batch(0, 0, 2, 0, 4, 2).unwrap_err());
    assert!(m.contains("12 samples") && m.contains("16"), "{m}");
    // A global batch that does not divide by dp or accum.
    let m = message(micro_batch_size(6, 4, 1).unwrap_err());
    assert!(m.contains("global batch 6 does not divide by dp 4"), "{m}");
    let m = message(micro_batch_size(8, 2, 3).unwrap_err());
    assert!(m.contains("grad_accum 3"), "{m}");
    assert_eq!(micro_batch_size(12, 2, 3).unwrap(), 2);
    // Rank and micro-step out of range.
    assert!(l.micro_batch(0, 2, 2, 0, 1, 1).is_err());
    assert!(l.micro_batch(0, 0, 2, 1, 1, 1).is_err());
    // Bad fractions and sequence lengths.
    for bad in [
        LoaderConfig {
            val_fraction: 1.0,
            ..cfg.clone()
        },
        LoaderConfig { seq_len: 0, ..cfg },
    ] {
        assert!(DataLoader::new(TokenData::from_tokens((0..50).collect()), bad).is_err());
    }
}

#[test]
fn vocab_check() {
    let cfg = LoaderConfig {
        seq_len: 2,
        val_fraction: 0.0,
        vocab_size: Some(256),
        ..Default::default()
    };
    let mut tokens: Vec<u32> = (0..10).collect();
    tokens[7] = 300;
    let m =
        message(DataLoader::new(TokenData::from_tokens(tokens.clone()), cfg.clone()).unwrap_err());
    assert!(
        m.contains("300") && m.contains("position 7") && m.contains("vocab_size 256"),
        "{m}"
    );
    let ok = LoaderConfig {
        vocab_size: Some(301),
        ..cfg
    };
    assert!(DataLoader::new(TokenData::from_tokens(tokens), ok).is_ok());
}
