//! What a `data.path` or a source's `path` names, expanded to files: a file,
//! a directory (its files, recursively, hidden ones skipped), or a glob
//! (`*` and `?` within a path component, `[abc]` / `[a-z]` classes, `**`
//! for any number of directories; a trailing `**` is every file below). A
//! path that exists is taken as itself, glob characters and all (a file
//! named `shard[1].bin`). The result is sorted by path, so the
//! shard list (and with it the sample order) does not depend on the order
//! the file system lists entries in. Only regular files are taken (after
//! symbolic links): a FIFO or socket in a data directory is skipped, since
//! opening a FIFO waits for a writer and a device never ends. A name that
//! is not UTF-8 is matched with its bad bytes read as U+FFFD (`*` and `?`
//! match them) and kept as it is on disk.
//!
//! ```
//! use phalanx::data::paths::glob_match;
//! assert!(glob_match("train_*.bin", "train_000001.bin"));
//! assert!(!glob_match("train_?.bin", "train_10.bin"));
//! assert!(glob_match("shard[0-9].jsonl", "shard7.jsonl"));
//! ```

use super::error::{DataError, Result};
use std::path::{Path, PathBuf};

/// Whether a pattern holds glob characters.
pub fn is_glob(p: &str) -> bool {
    p.contains(['*', '?', '['])
}

/// The files `pattern` names (see the module docs), sorted; `key` names the
/// config key in errors. Matching nothing is an error: an empty source
/// would otherwise train on the other sources without a word.
pub fn expand(pattern: &str, key: &str) -> Result<Vec<PathBuf>> {
    Ok(expand_noting(pattern, key)?.0)
}

/// [`expand`], and the files of a directory left out as not data: a
/// directory holding token shards (`.bin`) gives those only (not the
/// state file `phalanx tokenize` writes beside its shards); in another, a
/// downloaded dataset's card and metadata (`README`, `LICENSE`, `COPYING`
/// of any extension, `dataset_info.json`, `dataset_infos.json`,
/// `dataset_dict.json`) are left out beside other files. Nothing else is.
/// A directory that `phalanx tokenize` wrote and did not finish (its
/// `tokenize.json` says so) is refused: its shards are a part of the data.
pub fn expand_noting(pattern: &str, key: &str) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let (files, skipped, _) = expand_kind(pattern, key, true)?;
    Ok((files, skipped))
}

/// [`expand_noting`], and what `phalanx tokenize` recorded where `pattern`
/// is a directory it wrote (read once, for the refusal and the split).
pub fn expand_noting_run(
    pattern: &str,
    key: &str,
) -> Result<(Vec<PathBuf>, Vec<PathBuf>, Option<TokenizeRun>)> {
    expand_kind(pattern, key, true)
}

/// [`expand_noting`] for text to tokenize: a directory's token shards
/// (`.bin`) and `phalanx tokenize`'s state file are left out instead of
/// everything else (a `.bin` is never text).
pub fn expand_text_noting(pattern: &str, key: &str) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let (files, skipped, _) = expand_kind(pattern, key, false)?;
    Ok((files, skipped))
}

type Expanded = (Vec<PathBuf>, Vec<PathBuf>, Option<TokenizeRun>);

fn expand_kind(pattern: &str, key: &str, tokens: bool) -> Result<Expanded> {
    let mut files = expand_all_kinds(pattern, key)?;
    let mut skipped = Vec::new();
    let mut tokenized = None;
    let dir = Path::new(pattern);
    if !is_glob(pattern) && dir.is_dir() {
        tokenized = TokenizeRun::of(dir);
        if let Some(run) = &tokenized {
            if !run.complete {
                return Err(DataError::Config(format!(
                    "{key} = {pattern:?}: its {TOKENIZE_STATE} says the `phalanx tokenize` run \
                     that writes it has not finished ({} shard(s) so far): run the same command \
                     again to finish it (it goes on where it stopped), or name the shards to \
                     read with a glob",
                    run.shards
                )));
            }
        }
        let token = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        let doc = |p: &Path| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().to_ascii_lowercase())
                .unwrap_or_default();
            let stem = name.split('.').next().unwrap_or_default();
            ["readme", "license", "licence", "copying"].contains(&stem)
                || [
                    "dataset_info.json",
                    "dataset_infos.json",
                    "dataset_dict.json",
                ]
                .contains(&name.as_str())
        };
        let not_doc = |p: &Path| !doc(p);
        let state = |p: &Path| p.file_name().is_some_and(|n| n == TOKENIZE_STATE);
        let text = |p: &Path| !token(p) && !state(p);
        let text_not_doc = |p: &Path| text(p) && !doc(p);
        let keep: Option<&dyn Fn(&Path) -> bool> = if !tokens && files.iter().any(|f| !text(f)) {
            if files.iter().any(|f| text(f) && doc(f)) && files.iter().any(|f| text_not_doc(f)) {
                Some(&text_not_doc)
            } else {
                Some(&text)
            }
        } else if tokens && files.iter().any(|f| token(f)) {
            Some(&token)
        } else if files.iter().any(|f| doc(f)) && !files.iter().all(|f| doc(f)) {
            Some(&not_doc)
        } else {
            None
        };
        if let Some(keep) = keep {
            (files, skipped) = files.into_iter().partition(|f| keep(f));
        }
        if !tokens && files.is_empty() {
            return Err(DataError::Config(format!(
                "{key} = {pattern:?} is a directory of token shards, not text: train on them \
                 (data.path), no need to tokenize them"
            )));
        }
    }
    Ok((files, skipped, tokenized))
}

/// The prefix of a `phalanx tokenize` validation shard's file name
/// (`{prefix}_val_NNNNNN.bin`), if `name` is one.
pub fn val_shard_prefix(name: &str) -> Option<&str> {
    let (prefix, n) = name.strip_suffix(".bin")?.rsplit_once("_val_")?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(prefix)
}

/// The state file `phalanx tokenize` keeps beside its shards.
pub const TOKENIZE_STATE: &str = "tokenize.json";

/// What `phalanx tokenize` recorded in a directory of its shards
/// ([`TOKENIZE_STATE`]); `None` where there is no such record (a file of
/// that name that is not one is left alone).
pub struct TokenizeRun {
    /// Whether the run finished (a killed one is resumed by running it again).
    pub complete: bool,
    /// Its shard names' prefix: `{prefix}_val_000000.bin`, `{prefix}_train_…`.
    pub prefix: String,
    /// Shards written so far.
    pub shards: usize,
}

impl TokenizeRun {
    pub fn of(dir: &Path) -> Option<TokenizeRun> {
        let text = std::fs::read_to_string(dir.join(TOKENIZE_STATE)).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        Some(TokenizeRun {
            complete: v.get("complete")?.as_bool()?,
            prefix: v.get("settings")?.get("prefix")?.as_str()?.to_string(),
            shards: v.get("shards")?.as_array()?.len(),
        })
    }

    /// Whether `f` is this run's validation shard (held out of training).
    pub fn is_val_shard(&self, f: &Path) -> bool {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        val_shard_prefix(&name) == Some(self.prefix.as_str())
    }
}

/// The note for the files [`expand_noting`] left out of `pattern` (given
/// as `key`).
pub fn skipped_note(key: &str, pattern: &str, left: &[PathBuf]) -> String {
    let names: Vec<String> = left
        .iter()
        .take(5)
        .map(|f| f.display().to_string())
        .collect();
    format!(
        "{key} {pattern:?}: {} file(s) beside its data files are not data and are not read \
         ({}{})",
        left.len(),
        names.join(", "),
        if left.len() > 5 { ", …" } else { "" }
    )
}

fn expand_all_kinds(pattern: &str, key: &str) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if is_glob(pattern) && !Path::new(pattern).exists() {
        let (root, rest) = split_root(pattern);
        let mut comps: Vec<&str> = rest.split('/').filter(|c| !c.is_empty()).collect();
        // `**/**` is `**` (the walk enters each directory once).
        comps.dedup_by(|a, b| *a == "**" && *b == "**");
        // `dir/**` is every file below dir, as `dir/**/*`.
        if comps.last() == Some(&"**") {
            comps.push("*");
        }
        walk_glob(&root, &comps, &mut Vec::new(), &mut out);
    } else {
        let p = Path::new(pattern);
        if p.is_dir() {
            walk_dir(p, &mut Vec::new(), &mut out).map_err(|source| DataError::Io {
                path: p.to_path_buf(),
                source,
            })?;
        } else if p.exists() {
            // A device (/dev/zero) would be read without end, a FIFO hang.
            crate::fsutil::regular_file(key, p).map_err(DataError::Config)?;
            out.push(p.to_path_buf());
        } else {
            return Err(DataError::Config(format!(
                "{key} = {pattern:?}: no such file or directory"
            )));
        }
    }
    out.sort();
    out.dedup();
    if out.is_empty() && Path::new(pattern).is_dir() {
        return Err(DataError::Config(format!(
            "{key} = {pattern:?} is a directory holding no data files (an empty source)"
        )));
    }
    if out.is_empty() {
        return Err(DataError::Config(format!(
            "{key} = {pattern:?} matches no file (an empty source)"
        )));
    }
    Ok(out)
}

/// The directory before the first component with a glob character, and
/// the rest of the pattern.
fn split_root(pattern: &str) -> (PathBuf, &str) {
    let absolute = pattern.starts_with('/');
    let mut root = if absolute {
        PathBuf::from("/")
    } else {
        PathBuf::from(".")
    };
    let mut rest = pattern.trim_start_matches('/');
    while let Some((head, tail)) = rest.split_once('/') {
        if is_glob(head) {
            break;
        }
        root.push(head);
        rest = tail;
    }
    // Keep relative paths relative ("./x" prints as "x").
    if !absolute {
        if let Ok(r) = root.strip_prefix(".") {
            root = if r.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                r.to_path_buf()
            };
        }
    }
    (root, rest)
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    v.sort();
    v
}

/// A path's last component for matching (see the module docs on names
/// that are not UTF-8).
fn name_of(p: &Path) -> std::borrow::Cow<'_, str> {
    p.file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default()
}

fn hidden(p: &Path) -> bool {
    p.file_name()
        .is_some_and(|n| n.as_encoded_bytes().starts_with(b"."))
}

fn join(dir: &Path, name: &str) -> PathBuf {
    if dir == Path::new(".") {
        PathBuf::from(name)
    } else {
        dir.join(name)
    }
}

/// Entry `e` of `dir` (from [`entries`]), relative paths kept without
/// "./". Built from the entry itself, never from its name as matched: a
/// name that is not UTF-8 rebuilt from that would be another path (an
/// empty name made `dir/` again, and `**` recursed on it until the stack
/// overflowed).
fn child(dir: &Path, e: &Path) -> PathBuf {
    match e.file_name() {
        Some(n) if dir == Path::new(".") => PathBuf::from(n),
        _ => e.to_path_buf(),
    }
}

/// Whether `p` is a regular file, following symbolic links.
fn is_regular(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file())
}

/// A directory's identity (device, inode), following links.
fn dir_id(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// `dir` entered on the way down unless it is one of the directories
/// being walked already (`above`): a symbolic link to an ancestor would
/// otherwise be walked until paths grow too long.
fn enter(dir: &Path, above: &mut Vec<(u64, u64)>) -> bool {
    match dir_id(dir) {
        Some(id) if above.contains(&id) => false,
        Some(id) => {
            above.push(id);
            true
        }
        None => false,
    }
}

fn walk_glob(dir: &Path, comps: &[&str], above: &mut Vec<(u64, u64)>, out: &mut Vec<PathBuf>) {
    let Some((first, rest)) = comps.split_first() else {
        if is_regular(dir) {
            out.push(dir.to_path_buf());
        }
        return;
    };
    if *first == "**" {
        if !enter(dir, above) {
            return;
        }
        // Zero directories, then one more level and `**` again.
        walk_glob(dir, rest, above, out);
        for e in entries(dir) {
            if e.is_dir() && !hidden(&e) {
                walk_glob(&child(dir, &e), comps, above, out);
            }
        }
        above.pop();
        return;
    }
    if !is_glob(first) {
        walk_glob(&join(dir, first), rest, above, out);
        return;
    }
    for e in entries(dir) {
        // As in shells, a wildcard does not match a leading dot.
        if hidden(&e) && !first.starts_with('.') {
            continue;
        }
        if glob_match(first, &name_of(&e)) {
            walk_glob(&child(dir, &e), rest, above, out);
        }
    }
}

/// A directory's regular files, recursively (hidden ones skipped; see the
/// module docs for what else is).
fn walk_dir(
    dir: &Path,
    above: &mut Vec<(u64, u64)>,
    out: &mut Vec<PathBuf>,
) -> std::io::Result<()> {
    if !enter(dir, above) {
        return Ok(()); // a link back to a directory being walked
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if hidden(&p) {
            continue;
        }
        if p.is_dir() {
            walk_dir(&p, above, out)?;
        } else if is_regular(&p) {
            out.push(p);
        }
    }
    above.pop();
    Ok(())
}

/// An error naming `path` unless it is a regular file (after symbolic
/// links), checked before a data file is opened: the file may have been
/// replaced since the paths were expanded, or come from elsewhere.
pub fn check_regular(path: &Path) -> Result<()> {
    crate::fsutil::regular_file("data file", path)
        .map(|_| ())
        .map_err(DataError::Config)
}

/// Whether `name` (one path component) matches `pat` (`*`, `?`, `[...]`).
pub fn glob_match(pat: &str, name: &str) -> bool {
    let p: Vec<char> = pat.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative matcher with backtracking to the last `*`.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
            continue;
        }
        if i < p.len() {
            if let Some((ok, len)) = match_one(&p[i..], n[j]) {
                if ok {
                    i += len;
                    j += 1;
                    continue;
                }
            }
        }
        match star {
            Some((si, sj)) => {
                i = si + 1;
                j = sj + 1;
                star = Some((si, sj + 1));
            }
            None => return false,
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Whether the pattern's first item matches `c`, and the item's length.
fn match_one(p: &[char], c: char) -> Option<(bool, usize)> {
    match p[0] {
        '?' => Some((true, 1)),
        '[' => {
            let end = p.iter().skip(1).position(|&x| x == ']')? + 1;
            let class = &p[1..end];
            let (neg, class) = match class.first() {
                Some('!') | Some('^') => (true, &class[1..]),
                _ => (false, class),
            };
            let mut hit = false;
            let mut k = 0;
            while k < class.len() {
                if k + 2 < class.len() && class[k + 1] == '-' {
                    hit |= class[k] <= c && c <= class[k + 2];
                    k += 3;
                } else {
                    hit |= class[k] == c;
                    k += 1;
                }
            }
            Some((hit != neg, end + 1))
        }
        x => Some((x == c, 1)),
    }
}

/// A compressed file (`.gz`, `.zst`, `.xz`, `.bz2`, `.zip`) is refused,
/// naming it and `key`: read as text it would train on the compressed
/// bytes.
pub fn refuse_compressed(p: &Path, key: &str) -> std::result::Result<(), DataError> {
    let ext = p
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "gz" | "zst" | "xz" | "bz2" | "zip" => Err(DataError::Format {
            path: p.to_path_buf(),
            msg: format!("compressed files are not read ({key}); decompress it first"),
        }),
        _ => Ok(()),
    }
}
