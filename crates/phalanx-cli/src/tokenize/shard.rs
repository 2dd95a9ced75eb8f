//! llm.c token files (`dev/data/data_common.py`): a 256 x int32 header
//! (magic, version, token count), then the tokens little-endian: uint16
//! (magic 20240520, version 1) when every id of the vocabulary fits, else
//! uint32 (magic 20240801, version 7). A shard is built in memory as the
//! bytes it will be on disk, so holding one costs its file size, not four
//! bytes a token plus a copy.

use phalanx::data::source::{LLMC_HEADER_BYTES, LLMC_MAGIC_GPT2, LLMC_MAGIC_LLAMA3};

/// The most tokens one file can hold: the header's count is 32 bits.
pub const MAX_SHARD_TOKENS: u64 = u32::MAX as u64;

/// The bytes of one llm.c file, filled a token at a time.
pub struct ShardBuf {
    bytes: Vec<u8>,
    wide: bool,
    count: u64,
}

impl ShardBuf {
    /// An empty file; `wide`: uint32 tokens. `expect` tokens are reserved
    /// (capped, so a huge `--shard-size` is not one huge allocation up front).
    pub fn new(wide: bool, expect: u64) -> ShardBuf {
        let width = if wide { 4 } else { 2 };
        let reserve = expect.min(1 << 26) as usize * width;
        let mut bytes = Vec::with_capacity(LLMC_HEADER_BYTES + reserve);
        bytes.resize(LLMC_HEADER_BYTES, 0);
        ShardBuf {
            bytes,
            wide,
            count: 0,
        }
    }

    /// Tokens held so far.
    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Append tokens; `Err(id)`: an id that does not fit uint16 in a
    /// narrow file (the vocabulary was misjudged: never truncated).
    pub fn extend(&mut self, tokens: &[u32]) -> Result<(), u32> {
        if self.wide {
            for &t in tokens {
                self.bytes.extend_from_slice(&t.to_le_bytes());
            }
        } else {
            for &t in tokens {
                let t16 = u16::try_from(t).map_err(|_| t)?;
                self.bytes.extend_from_slice(&t16.to_le_bytes());
            }
        }
        self.count += tokens.len() as u64;
        Ok(())
    }

    /// The file's bytes, header filled in.
    pub fn finish(mut self) -> Vec<u8> {
        assert!(self.count <= MAX_SHARD_TOKENS, "checked by the caller");
        let (magic, version) = if self.wide {
            (LLMC_MAGIC_LLAMA3, 7u32)
        } else {
            (LLMC_MAGIC_GPT2, 1u32)
        };
        for (i, v) in [magic, version, self.count as u32].iter().enumerate() {
            self.bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.bytes
    }
}

/// The llm.c file bytes for `tokens` (uint16 when `max_id` < 65536).
pub fn llmc_bytes(tokens: &[u32], max_id: u32) -> Vec<u8> {
    let mut b = ShardBuf::new(max_id > u16::MAX as u32, tokens.len() as u64);
    b.extend(tokens).expect("max_id bounds every token");
    b.finish()
}

/// The size on disk of a shard of `tokens` tokens.
pub fn file_len(tokens: u64, wide: bool) -> u64 {
    LLMC_HEADER_BYTES as u64 + tokens * if wide { 4 } else { 2 }
}

/// llm.c fineweb's names: shard 0 is the validation split, the rest train.
pub fn shard_name(prefix: &str, index: u64) -> String {
    let split = if index == 0 { "val" } else { "train" };
    format!("{prefix}_{split}_{index:06}.bin")
}

/// Whether `name` is a shard name of `prefix` (any index).
pub fn is_shard_name(prefix: &str, name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('_'))
        .and_then(|r| r.strip_suffix(".bin"))
    else {
        return false;
    };
    let digits = match rest.split_once('_') {
        Some(("val" | "train", d)) => d,
        _ => return false,
    };
    digits.len() >= 6 && digits.bytes().all(|b| b.is_ascii_digit())
}

/// A token count: digits (`_` allowed) with an optional decimal suffix
/// `K`, `M`, `G` (`100M` = 100,000,000, llm.c's shard size).
pub fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim().replace('_', "");
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1_000u64),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        Some('G') => (&t[..t.len() - 1], 1_000_000_000),
        _ => (&t[..], 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a count of tokens (e.g. 100M, 5000000)"))?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_counts_and_headers() {
        assert_eq!(shard_name("data", 0), "data_val_000000.bin");
        assert_eq!(shard_name("fw", 12), "fw_train_000012.bin");
        assert!(is_shard_name("fw", "fw_train_000012.bin"));
        assert!(!is_shard_name("fw", "fw_train_12.bin"));
        assert!(!is_shard_name("fw", "data_val_000000.bin"));
        assert_eq!(parse_count("100M"), Ok(100_000_000));
        assert_eq!(parse_count("1_000"), Ok(1000));
        assert!(parse_count("1.5M").is_err() && parse_count("").is_err());
        let b = llmc_bytes(&[1, 2, 65535], 65535);
        assert_eq!(b.len() as u64, file_len(3, false));
        assert_eq!(&b[8..12], &3u32.to_le_bytes());
        let mut s = ShardBuf::new(false, 2);
        assert_eq!(s.extend(&[70000]), Err(70000));
    }
}
