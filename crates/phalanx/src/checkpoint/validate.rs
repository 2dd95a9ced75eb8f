//! Every field of `metadata.json` checked on read (issue 27, item 11): a
//! tampered or damaged file is refused with an error naming the field
//! (`metadata.json: entries[3].region.flat: …`), never a panic, a wrapped
//! number or an allocation the checkpoint's files could not back.
//!
//! What is checked, beyond the JSON types (which serde checks, and
//! [`super::Metadata::parse`] names by path):
//! - numbers: steps, samples and sizes lie within [`MAX_COUNT`], products
//!   of shapes do not overflow, the layout multiplies out to the world;
//! - names: plain file names, one file per rank, sha256 as 64 hex digits,
//!   known precision and optimizer kinds;
//! - the optimizer's step count does not exceed the checkpoint's step, and
//!   the optimizer's buffers are saved when it is;
//! - entries: regions inside their tensors, keys unique per file, what a
//!   file's entries hold fits in the file's bytes, and no two entries of
//!   the same tensor and kind overlap (which would make a load depend on
//!   the order the entries are read; checked once the files' sizes on
//!   disk agree with the metadata, since the check's memory grows with
//!   the rows the entries span, which only real bytes bound);
//! - the loss scaler's state and the data position.
//!
//! ```
//! let e = phalanx::checkpoint::Metadata::parse("{\"format\": 1}").unwrap_err();
//! assert!(e.contains("format"), "{e}");
//! ```

use super::{Entry, Metadata};
use std::collections::{BTreeMap, HashSet};

/// The largest step, sample count or tensor size a checkpoint may record:
/// 2^40 (about 10^12), far beyond any run, and small enough that products
/// with a sequence length or a byte width cannot overflow.
pub const MAX_COUNT: u64 = 1 << 40;

/// The buffers each optimizer always saves (a DiLoCo group's carry a
/// `group{g}/` prefix; SGD without momentum has none).
fn buffers(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "adamw" => Some(&["exp_avg", "exp_avg_sq"]),
        "sgd" => Some(&[]),
        _ => None,
    }
}

fn count(field: &str, v: u64) -> Result<(), String> {
    if v > MAX_COUNT {
        return Err(format!(
            "metadata.json: {field} is {v}, beyond any run (at most 2^40)"
        ));
    }
    Ok(())
}

/// The number of elements of `shape`, or an error naming `field` when the
/// product overflows or passes [`MAX_COUNT`].
pub(super) fn elements(field: &str, shape: &[usize]) -> Result<usize, String> {
    crate::ledger::checked_numel(shape)
        .filter(|&n| n as u64 <= MAX_COUNT)
        .ok_or_else(|| {
            format!("metadata.json: {field} {shape:?} has more elements than any tensor (2^40)")
        })
}

/// Check every field of `m` (see the module docs).
pub(super) fn check(m: &Metadata) -> Result<(), String> {
    count("step", m.step as u64)?;
    count("samples_consumed", m.samples_consumed)?;
    count("global_batch", m.global_batch as u64)?;
    if m.global_batch == 0 {
        return Err("metadata.json: global_batch is 0".into());
    }
    layout(m)?;
    if !matches!(m.precision.as_str(), "fp32" | "bf16" | "fp16") {
        return Err(format!(
            "metadata.json: precision {:?} is not fp32, bf16 or fp16",
            m.precision
        ));
    }
    m.loss_scaler
        .check()
        .map_err(|e| format!("metadata.json: loss_scaler.{e}"))?;
    if let Some(d) = &m.data {
        for (i, c) in d.cursors.iter().enumerate() {
            if let Some(c) = c {
                count(&format!("data.cursors[{i}].epoch"), c.epoch)?;
                count(&format!("data.cursors[{i}].slot"), c.slot)?;
                // A token offset, not a count of samples: a long run
                // streams past 2^40 tokens of one source. The resume checks
                // it against the checkpoint's position (samples x seq_len).
                if c.offset > 1 << 62 {
                    return Err(format!(
                        "metadata.json: data.cursors[{i}].offset is {}, beyond any run (at most 2^62)",
                        c.offset
                    ));
                }
            }
        }
    }
    if let Err(e) = m.config.parse::<toml::Table>() {
        return Err(format!(
            "metadata.json: config is not a TOML config: {}",
            e.message()
        ));
    }
    for (name, shape) in &m.tensors {
        if name.is_empty() {
            return Err("metadata.json: tensors has an empty name".into());
        }
        elements(&format!("tensors.{name}"), shape)?;
    }
    files(m)?;
    entries(m)?;
    optimizer(m)?;
    rank_state(m)
}

fn layout(m: &Metadata) -> Result<(), String> {
    let l = &m.layout;
    for (k, v) in [("world", l.world), ("dp", l.dp), ("pp", l.pp), ("tp", l.tp)] {
        if v == 0 {
            return Err(format!("metadata.json: layout.{k} is 0"));
        }
        count(&format!("layout.{k}"), v as u64)?;
    }
    let product = l.dp.checked_mul(l.pp).and_then(|x| x.checked_mul(l.tp));
    if product != Some(l.world) {
        return Err(format!(
            "metadata.json: layout.world is {}, but dp {} x pp {} x tp {} is not",
            l.world, l.dp, l.pp, l.tp
        ));
    }
    if l.zero_stage > 3 {
        return Err(format!(
            "metadata.json: layout.zero_stage is {}, not 0..=3",
            l.zero_stage
        ));
    }
    if m.files.len() != l.world {
        return Err(format!(
            "metadata.json: files lists {} file(s), layout.world says {} rank(s) (one file each)",
            m.files.len(),
            l.world
        ));
    }
    Ok(())
}

fn files(m: &Metadata) -> Result<(), String> {
    let mut seen = HashSet::new();
    for (i, f) in m.files.iter().enumerate() {
        // A checkpoint's files are plain names inside it: `../x` or
        // `/etc/passwd` would read (and a repair write) outside it.
        if !super::plain_file_name(&f.name) {
            return Err(format!(
                "metadata.json: files[{i}].name: file name {:?} is not a plain file name inside \
                 the checkpoint",
                f.name
            ));
        }
        if !seen.insert(f.name.as_str()) {
            return Err(format!(
                "metadata.json: files[{i}].name {:?} is listed twice",
                f.name
            ));
        }
        if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "metadata.json: files[{i}].sha256 {:?} is not 64 hex digits",
                f.sha256
            ));
        }
    }
    Ok(())
}

fn entries(m: &Metadata) -> Result<(), String> {
    // Bytes each file's entries hold, and the keys seen per file.
    let mut held = vec![0u64; m.files.len()];
    let mut keys = HashSet::new();
    for (i, e) in m.entries.iter().enumerate() {
        let at = |what: &str| format!("metadata.json: entries[{i}].{what}");
        if e.file >= m.files.len() {
            return Err(format!(
                "{} is {}, but there are {} files",
                at("file"),
                e.file,
                m.files.len()
            ));
        }
        if e.key.is_empty() || e.kind.is_empty() {
            return Err(format!("{} or kind is empty", at("key")));
        }
        if !keys.insert((e.file, e.key.as_str())) {
            return Err(format!(
                "{} {:?} is used twice in file {}",
                at("key"),
                e.key,
                m.files[e.file].name
            ));
        }
        match m.tensors.get(&e.tensor) {
            None => {
                return Err(format!(
                    "{} {:?} is not one of the tensors",
                    at("tensor"),
                    e.tensor
                ))
            }
            Some(s) if *s != e.region.shape => {
                return Err(format!(
                    "{}: shape {:?} disagrees with tensor {}'s {s:?}",
                    at("region.shape"),
                    e.region.shape,
                    e.tensor
                ))
            }
            _ => {}
        }
        elements(&at("region.sizes"), &e.region.sizes)?;
        e.region
            .check()
            .map_err(|err| format!("{}: {err}", at("region")))?;
        held[e.file] += 4 * e.region.len() as u64;
        if held[e.file] > m.files[e.file].bytes {
            return Err(format!(
                "{}: file {} holds {} bytes, less than its entries' values need",
                at("region.flat"),
                m.files[e.file].name,
                m.files[e.file].bytes
            ));
        }
    }
    Ok(())
}

/// No two entries of one tensor and kind cover the same value. Holds one
/// run per row a region spans, which the files' bytes on disk bound (see
/// [`super::Metadata::verify_files`]): a metadata.json alone could claim
/// far more.
pub(super) fn overlaps(entries: &[Entry]) -> Result<(), String> {
    // (tensor, kind) -> (global start, end, entry index) of each run.
    type Runs<'a> = BTreeMap<(&'a str, &'a str), Vec<(usize, usize, usize)>>;
    let mut runs: Runs = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        let v = runs.entry((&e.tensor, &e.kind)).or_default();
        v.extend(e.region.runs().into_iter().map(|(g, _, n)| (g, g + n, i)));
    }
    for ((tensor, kind), mut v) in runs {
        v.sort_unstable();
        for w in v.windows(2) {
            let ((_, end, a), (start, _, b)) = (w[0], w[1]);
            if start < end {
                return Err(format!(
                    "metadata.json: entries[{a}] and entries[{b}] overlap: both hold {kind} \
                     values of {tensor} (from global position {start})"
                ));
            }
        }
    }
    Ok(())
}

fn optimizer(m: &Metadata) -> Result<(), String> {
    let Some((kind, steps)) = &m.optimizer else {
        return Ok(());
    };
    let Some(bufs) = buffers(kind) else {
        return Err(format!(
            "metadata.json: optimizer {kind:?} is not adamw or sgd"
        ));
    };
    if *steps > m.step as u64 {
        return Err(format!(
            "metadata.json: optimizer step count {steps} exceeds the checkpoint's step {} \
             (steps applied cannot outnumber steps taken)",
            m.step
        ));
    }
    let kinds: HashSet<&str> = m.entries.iter().map(|e| e.kind.as_str()).collect();
    for b in bufs {
        let saved = kinds
            .iter()
            .any(|k| *k == *b || k.strip_suffix(b).is_some_and(|p| p.ends_with('/')));
        if !saved {
            return Err(format!(
                "metadata.json: optimizer {kind:?} is recorded, but no entries hold its {b}"
            ));
        }
    }
    Ok(())
}

fn rank_state(m: &Metadata) -> Result<(), String> {
    let mut held = vec![0u64; m.files.len()];
    let mut names = HashSet::new();
    for (i, e) in m.rank_state.iter().enumerate() {
        if e.rank >= m.files.len() {
            return Err(format!(
                "metadata.json: rank_state[{i}].rank is {}, but there are {} files",
                e.rank,
                m.files.len()
            ));
        }
        if e.name.is_empty() || !names.insert((e.rank, e.name.as_str())) {
            return Err(format!(
                "metadata.json: rank_state[{i}].name {:?} is empty or repeated",
                e.name
            ));
        }
        count(&format!("rank_state[{i}].len"), e.len as u64)?;
        held[e.rank] += 4 * e.len as u64;
        if held[e.rank] > m.files[e.rank].bytes {
            return Err(format!(
                "metadata.json: rank_state[{i}].len {}: file {} holds {} bytes, less than the \
                 state needs",
                e.len, m.files[e.rank].name, m.files[e.rank].bytes
            ));
        }
    }
    Ok(())
}
