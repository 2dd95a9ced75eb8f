//! Shared by the CLI tests: the binary, the repository, fresh temporary
//! directories, and the flags of a small model that trains in a second.

#![allow(dead_code)]

pub mod ft;

pub use phalanx::fsutil::ScratchDir;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_phalanx");

/// The repository root (the default corpus is at `data/corpus.txt` there).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Run the binary in the repository: (exit code, stdout, stderr).
pub fn phalanx(args: &[&str]) -> (i32, String, String) {
    let o = std::process::Command::new(BIN)
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A fresh, empty directory for one test (`prefix-name-pid`), removed when
/// the test ends.
pub fn fresh_dir(prefix: &str, name: &str) -> ScratchDir {
    ScratchDir::new(prefix, name)
}

/// Variables of every launcher (and of Phalanx's own), removed where a test
/// sets its own.
pub const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PHALANX_STORE_HOSTED",
    "PHALANX_RUN_ID",
    "PHALANX_SECRET_MADE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
];

/// A small model so that the end-to-end runs take a second.
pub const SMALL: &[&str] = &[
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_head=2",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=32",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "train.eval_interval=0",
    "--set",
    "log.plot=\"\"",
    "--set",
    "log.report=\"\"",
];

/// What a finished command printed, and its exit code (-1: killed by a signal).
pub struct Run {
    pub code: i32,
    pub out: String,
    pub err: String,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.out, self.err
        )
    }
}

/// Run `c` (stdin closed, output captured) in a process group of its own;
/// a run past `deadline` is killed, group and all (a launcher's workers
/// too), and fails the test: nothing may hang.
pub fn run_until(mut c: Command, deadline: Duration) -> Run {
    use std::os::unix::process::CommandExt;
    c.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let what = format!("{c:?}");
    let mut child = c
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let read = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > deadline {
            // SAFETY: kill(2) on the group this child leads.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let run = Run {
        code: status.and_then(|s| s.code()).unwrap_or(-1),
        out: out.join().unwrap(),
        err: err.join().unwrap(),
    };
    assert!(status.is_some(), "{what} hung past {deadline:?}:\n{run}");
    run
}

/// `phalanx train` flags: the small model, `steps` steps, the JSON log at `log`.
pub fn train_args(log: &Path, steps: usize) -> Vec<String> {
    let mut a: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    a.extend([
        "--set".into(),
        format!("train.steps={steps}"),
        "--log-json".into(),
        log.display().to_string(),
    ]);
    a
}

/// The JSON log: (step, loss bits) per line.
pub fn losses(p: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("no log at {}: {e}", p.display()))
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// The same training under `phalanx run` (2 local ranks).
pub fn reference_losses(d: &Path, steps: usize, extra: &[String]) -> Vec<(u64, u64)> {
    let log = d.join("ref.jsonl");
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .env_remove("RANK")
        .arg("train")
        .args(["--nproc-per-node", "2"])
        .args(train_args(&log, steps))
        .args(extra);
    let r = run_until(c, Duration::from_secs(240));
    assert_eq!(r.code, 0, "phalanx run: {r}");
    losses(&log)
}
