//! A 1 GiB glob of llm.c shards trains with the resident memory of a
//! 64 MiB one (issue 28): token shards are memory-mapped, a step touches
//! only the pages of its samples, and the loader keeps the sample
//! permutations of the few shards in use (8 bytes per sample of a shard),
//! so memory grows with the shard size, not with the number of shards.
//! The shards are sparse files (holes read as token 0), so the test writes
//! almost nothing to disk.
//!
//! One test in its own binary: the peak RSS of the children
//! (`getrusage(RUSAGE_CHILDREN)`) is this process's alone.

mod common;
use common::*;

use std::path::Path;

/// `n` llm.c shards of `tokens` uint16 tokens each, holes but the header.
fn sparse_shards(dir: &Path, n: usize, tokens: u64) {
    std::fs::create_dir_all(dir).unwrap();
    for j in 0..n {
        let mut header = [0u32; 256];
        header[0] = 20240520;
        header[1] = 1;
        header[2] = tokens as u32;
        let bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
        let p = dir.join(format!("train_{j:06}.bin"));
        std::fs::write(&p, bytes).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(1024 + 2 * tokens).unwrap();
    }
}

/// Peak RSS (bytes) of the largest child waited for so far.
fn children_peak_rss() -> u64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) },
        0
    );
    ru.ru_maxrss as u64 * 1024
}

fn train_on(glob: &Path) {
    let set = format!("data.path=\"{}\"", glob.display());
    let mut args = vec!["train", "--nproc-per-node", "1"];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(&["--set", &set, "--set", "train.steps=30"]);
    let (code, out, err) = phalanx(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("done: 30 steps"), "{out}");
}

#[test]
fn a_gigabyte_of_shards_trains_in_the_memory_of_a_few_megabytes() {
    let d = fresh_dir("phalanx-data-memory", "rss");
    // 16 MiB shards (8 Mi tokens): 4 of them, then 64 (1 GiB).
    sparse_shards(&d.join("small"), 4, 1 << 23);
    sparse_shards(&d.join("big"), 64, 1 << 23);
    train_on(&d.join("small/train_*.bin"));
    let small = children_peak_rss();
    train_on(&d.join("big/train_*.bin"));
    let both = children_peak_rss();
    eprintln!(
        "peak RSS: {} MiB (64 MiB of shards), {} MiB over both runs (1 GiB)",
        small >> 20,
        both >> 20
    );
    // The peak over both runs is the small run's, give or take 16 MiB: a
    // loader that read the shards would add a gigabyte, one that kept a
    // permutation of every shard 128 MiB.
    assert!(
        both <= small + (16 << 20),
        "peak RSS {} MiB with 1 GiB of shards, {} MiB with 64 MiB",
        both >> 20,
        small >> 20
    );
    let _ = std::fs::remove_dir_all(&d);
}
