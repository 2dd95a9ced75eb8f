//! Outputs never cost a run, nor an input: every path a command writes
//! (sidecars included) is checked before any rank starts against every
//! path it reads — by canonical path (a symbolic link resolves to its
//! target) and by inode (a hard link is the same file), and an output
//! inside an input directory (a checkpoint, a data directory, an HF model
//! directory) is refused too. Each output must also be writable (its
//! directory exists or can be made and takes a file) and not a directory,
//! and no two outputs may be the same file, nor one be (or lie above) the
//! directory another output, or a checkpoint directory, is written in
//! (it would be a directory by then); a checkpoint directory must not be,
//! or lie in, an input. Nothing is created before all of
//! that passes. Errors name both paths and the flags or keys that gave
//! them. See `docs/security.md`.

use phalanx::config::TrainConfig;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// At most this many entries of an input directory are looked at for hard
/// links: enough for any checkpoint or model directory, and bounded for a
/// data directory of millions of shards (an output hard-linked to one of
/// those is then caught by path only).
const DIR_ENTRIES_CAP: usize = 20_000;

/// `p` made absolute with symbolic links resolved, also when it does not
/// exist yet (its nearest existing ancestor is resolved).
pub fn resolve(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut tail = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(c) = at.canonicalize() {
            let mut out = c;
            out.extend(tail.iter().rev());
            return out;
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_os_string());
                at = parent;
            }
            _ => return abs,
        }
    }
}

/// A file's identity (device, inode), following symbolic links.
fn inode(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// The files under `dir` (not following links), up to the cap: (inode, path).
fn dir_inodes(dir: &Path) -> Vec<((u64, u64), PathBuf)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    let mut seen = 0usize;
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            seen += 1;
            if seen > DIR_ENTRIES_CAP {
                return out;
            }
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                out.push(((m.dev(), m.ino()), e.path()));
            }
        }
    }
    out
}

/// What a command reads and writes, checked together by [`Io::check`].
#[derive(Default)]
pub struct Io {
    outs: Vec<(String, PathBuf)>,
    ins: Vec<(String, PathBuf)>,
    /// Directories where checkpoints are written and rotated: (key, dir).
    ckpt_dirs: Vec<(String, PathBuf)>,
    /// Directories the command makes files of its own in: (key, dir).
    scratch: Vec<(String, PathBuf)>,
}

impl Io {
    pub fn new() -> Io {
        Io::default()
    }

    /// A file the command writes; `what` names the flag or key.
    pub fn output(&mut self, what: impl Into<String>, p: &Path) -> &mut Io {
        self.outs.push((what.into(), p.to_path_buf()));
        self
    }

    /// A file or directory the command reads (a directory: everything in
    /// it); one that does not exist is skipped (its reader reports it).
    pub fn input(&mut self, what: impl Into<String>, p: &Path) -> &mut Io {
        if !p.as_os_str().is_empty() {
            self.ins.push((what.into(), p.to_path_buf()));
        }
        self
    }

    /// A checkpoint (`step-N/` with `metadata.json`) or a directory of
    /// checkpoints read to resume: the checkpoint, or each `step-*` in the
    /// directory and its `latest`.
    pub fn checkpoint_input(&mut self, what: &str, p: &Path) -> &mut Io {
        if !p.exists() {
            // Nothing there to protect: `--resume auto` before the first
            // checkpoint (checkpoint.dir is made when one is written), or
            // a path its reader refuses.
            return self;
        }
        if p.join("metadata.json").is_file() || !p.is_dir() {
            return self.input(what, p);
        }
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("step-") {
                    self.input(what, &e.path());
                }
            }
        }
        self.input(what, &p.join("latest"))
    }

    /// A directory checkpoints are written to and rotated in: no output may
    /// be a `step-*`, `.tmp-*`, `.old-*`, `latest` or lock entry of it.
    pub fn checkpoint_output(&mut self, what: &str, dir: &Path) -> &mut Io {
        self.ckpt_dirs.push((what.into(), dir.to_path_buf()));
        self
    }

    /// A directory the command makes (if missing) and writes files of its
    /// own in, such as ZeRO's NVMe offload: not a file, and not an entry
    /// of a checkpoint directory (rotation would delete it).
    pub fn scratch_dir(&mut self, what: &str, dir: &Path) -> &mut Io {
        self.scratch.push((what.into(), dir.to_path_buf()));
        self
    }

    /// Every check (see the module docs); the first failure, in words.
    pub fn check(&self) -> Result<(), String> {
        // The checkpoint directories, resolved once: (key, resolved).
        let ckpt: Vec<(&str, PathBuf)> = self
            .ckpt_dirs
            .iter()
            .map(|(w, d)| (w.as_str(), resolve(d)))
            .collect();
        for (what, d) in &self.scratch {
            if d.exists() && !d.is_dir() {
                return Err(format!(
                    "{what} {} is a file, not a directory (files are written in it)",
                    d.display()
                ));
            }
            let r = resolve(d);
            for (key, dir) in &ckpt {
                if let Some(name) = reserved_in(dir, &r) {
                    return Err(format!(
                        "{what} {} is {name} in {key} {}, where checkpoints are written and \
                         rotated: give a directory elsewhere",
                        d.display(),
                        dir.display()
                    ));
                }
            }
        }
        let inputs: Vec<Input> = self.ins.iter().map(Input::new).collect();
        // A checkpoint directory inside an input directory (a data
        // directory, the checkpoint resumed) would be read as that input by
        // the next run, and rotation there could delete what is not ours.
        for (key, dir) in &ckpt {
            let holds = |i: &&Input| *dir == i.canon || (i.is_dir && dir.starts_with(&i.canon));
            if let Some(i) = inputs.iter().find(holds) {
                let how = if *dir == i.canon { "is" } else { "is inside" };
                return Err(format!(
                    "{key} {} {how} {} {}: checkpoints written there would be read as that \
                     input: write them elsewhere",
                    dir.display(),
                    i.what,
                    i.shown.display()
                ));
            }
        }
        // Outputs checked so far: (flag, resolved path, inode).
        type Seen<'a> = (&'a str, PathBuf, Option<(u64, u64)>);
        let mut seen: Vec<Seen> = Vec::new();
        for (what, p) in &self.outs {
            let r = resolve(p);
            let id = inode(p);
            for i in &inputs {
                if let Some(why) = i.holds(&r, id) {
                    return Err(format!(
                        "{what} {} {why} {} {}: refusing to overwrite an input",
                        p.display(),
                        i.what,
                        i.shown.display()
                    ));
                }
            }
            for (key, dir) in &ckpt {
                if let Some(name) = reserved_in(dir, &r) {
                    return Err(format!(
                        "{what} {} is {name} in {key} {}, where checkpoints are written and \
                         rotated: write it elsewhere",
                        p.display(),
                        dir.display()
                    ));
                }
            }
            if let Some((other, _, _)) = seen
                .iter()
                .find(|(_, q, qid)| *q == r || (id.is_some() && *qid == id))
            {
                return Err(format!(
                    "{what} and {other} are the same file {}",
                    p.display()
                ));
            }
            if p.is_dir() {
                return Err(format!("{what} {} is a directory, not a file", p.display()));
            }
            seen.push((what, r, id));
        }
        // An output that another output's directory, or a checkpoint
        // directory, is or lies in would be a directory by the time it is
        // written (those are created as the run starts): refused now, not
        // when the run ends.
        for (i, (what, r, _)) in seen.iter().enumerate() {
            let p = self.outs[i].1.display();
            let inside = |q: &PathBuf| q != r && q.starts_with(r);
            if let Some(j) = seen.iter().position(|(_, q, _)| inside(q)) {
                return Err(format!(
                    "{what} {p}: {} {} is written inside it, so it becomes a directory before \
                     {what} is written: give them paths apart",
                    seen[j].0,
                    self.outs[j].1.display()
                ));
            }
            if let Some(j) = ckpt.iter().position(|(_, d)| d.starts_with(r)) {
                return Err(format!(
                    "{what} {p}: {} {} is or lies inside it, where checkpoints are written, so \
                     it becomes a directory before {what} is written: give them paths apart",
                    ckpt[j].0,
                    self.ckpt_dirs[j].1.display()
                ));
            }
        }
        // Only then is anything made (an output's own directory, a probe).
        for (what, p) in &self.outs {
            writable(what, p)?;
        }
        Ok(())
    }
}

/// The checkpoint entry of `dir` that `out` is or lies in, if any.
fn reserved_in(dir: &Path, out: &Path) -> Option<String> {
    let rest = out.strip_prefix(dir).ok()?;
    let Some(Component::Normal(first)) = rest.components().next() else {
        return None;
    };
    let n = first.to_string_lossy();
    let reserved = n.starts_with("step-")
        || n.starts_with(".tmp-step-")
        || n.starts_with(".old-step-")
        || n == "latest"
        || n.starts_with(".latest")
        || n == phalanx::checkpoint::lock::LOCK_FILE;
    reserved.then(|| format!("the entry {n:?}"))
}

/// An input, resolved once.
struct Input {
    what: String,
    shown: PathBuf,
    canon: PathBuf,
    is_dir: bool,
    /// Its inode, or those of the files under it (a directory).
    inodes: Vec<((u64, u64), PathBuf)>,
}

impl Input {
    fn new((what, p): &(String, PathBuf)) -> Input {
        let is_dir = p.is_dir();
        let inodes = if is_dir {
            dir_inodes(p)
        } else {
            inode(p).map(|i| (i, p.clone())).into_iter().collect()
        };
        Input {
            what: what.clone(),
            shown: p.clone(),
            canon: resolve(p),
            is_dir,
            inodes,
        }
    }

    /// How output `out` (resolved, with its inode) is this input, if it is.
    fn holds(&self, out: &Path, id: Option<(u64, u64)>) -> Option<String> {
        if out == self.canon {
            return Some("is".into());
        }
        if self.is_dir && out.starts_with(&self.canon) {
            return Some("is inside".into());
        }
        let id = id?;
        let (_, f) = self.inodes.iter().find(|(i, _)| *i == id)?;
        Some(if self.is_dir {
            format!("is {} (a hard link) inside", f.display())
        } else {
            "is (a hard link to)".into()
        })
    }
}

/// `p` can be written: not a directory, its directory exists or can be
/// made, and takes a file.
/// Create the directory of output `p` if it is missing, but only that one
/// (as `mkdir` would, not `mkdir -p`): a path whose parent directory is
/// missing too is more likely a typo than a wish, so it is refused naming
/// the missing directory rather than created anywhere.
pub fn create_own_dir(what: &str, p: &Path) -> Result<(), String> {
    let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.is_dir() {
        return Ok(());
    }
    let above = dir
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !above.is_dir() {
        return Err(format!(
            "{what} {}: neither its directory {} nor {} exists; Phalanx creates at most the \
             output's own directory: create {} first",
            p.display(),
            dir.display(),
            above.display(),
            above.display()
        ));
    }
    match std::fs::create_dir(dir) {
        // Made meanwhile by another process (replica groups started
        // together in one directory): as good as made here.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        r => r.map_err(|e| format!("{what} {}: cannot create its directory: {e}", p.display())),
    }
}

fn writable(what: &str, p: &Path) -> Result<(), String> {
    if p.is_dir() {
        return Err(format!("{what} {} is a directory, not a file", p.display()));
    }
    // `out/` that does not exist yet: its parent would be `out`'s, and the
    // write would fail only once the run has ended.
    if p.as_os_str().as_encoded_bytes().last() == Some(&b'/') {
        return Err(format!(
            "{what} {} ends in `/`, so it names a directory, not a file: give a file's path",
            p.display()
        ));
    }
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_own_dir(what, p)?;
    let probe = dir.join(format!(".phalanx-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .map_err(|e| format!("{what} {}: its directory is not writable: {e}", p.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// What a training config reads: the config file (`flag` names how it was
/// given), every data file or directory (`data.path`, `data.sources`,
/// `data.val_path`: globs expanded), and a `tokenizer.json`.
pub fn config_inputs(io: &mut Io, cfg: &TrainConfig, file: Option<(&str, &Path)>) {
    if let Some((flag, p)) = file {
        io.input(format!("config file ({flag})"), p);
    }
    let d = &cfg.data;
    let mut lists: Vec<(String, Vec<String>)> = vec![
        ("data file (data.path)".into(), d.path.list()),
        ("data file (data.val_path)".into(), d.val_path.list()),
    ];
    for (i, s) in d.sources.iter().enumerate() {
        lists.push((format!("data file (data.sources[{i}].path)"), s.path.list()));
    }
    for (what, list) in lists {
        for p in list {
            if phalanx::data::paths::is_glob(&p) {
                for f in phalanx::data::paths::expand(&p, &what).unwrap_or_default() {
                    io.input(what.clone(), &f);
                }
            } else {
                io.input(what.clone(), Path::new(&p));
            }
        }
    }
    if let Some(t) = d.tokenizer.json_path() {
        io.input("tokenizer (data.tokenizer)", t);
    }
}

/// `phalanx plan --write-config FILE`: FILE against the config file and
/// what the config reads.
pub fn check_plan_output(
    cfg: &TrainConfig,
    args: &crate::config_args::ConfigArgs,
    path: &Path,
) -> Result<(), String> {
    let mut io = Io::new();
    io.output("--write-config", path);
    let flag = if args.config.is_some() {
        "--config"
    } else {
        "--deepspeed-config"
    };
    config_inputs(&mut io, cfg, args.file().map(|f| (flag, f)));
    io.check()
}
