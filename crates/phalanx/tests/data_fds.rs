//! A corpus of many token shards holds no file descriptor per shard (one
//! each met the open-files limit, 1024 by default, at ~1000 shards). One
//! test in its own binary, so that no other test opens files while the
//! descriptors are counted.

use phalanx::data::{Corpus, CorpusConfig, DataLoader};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn token_shards_hold_no_descriptor_once_mapped() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx-fds", "shards");
    let n = 64;
    for i in 0..n {
        let bytes: Vec<u8> = (0..100u16).flat_map(|t| (t + i).to_le_bytes()).collect();
        std::fs::write(d.join(format!("s_{i:03}.bin")), bytes).unwrap();
    }
    let glob = format!("{}/*.bin", d.display());
    let before = open_fds();
    let c = Corpus::open(&CorpusConfig::new(&[&glob], 8)).unwrap();
    let after = open_fds();
    assert!(
        after < before + n as usize / 2,
        "{n} shards opened: {before} descriptors before, {after} after"
    );
    // The shards still serve samples (and are checked unchanged by path).
    let l = DataLoader::from_corpus(c);
    for step in 0..8 {
        l.micro_batch(step, 0, 1, 0, 16, 1).unwrap();
    }
    assert!(open_fds() < before + n as usize / 2);
}
