//! Fault injection for tests, in one place: nothing else in the library
//! holds a test hook. It sits at the bottom of the crate (it imports
//! nothing from it), so any layer may call its hooks.
//!
//! Two ways in:
//! - `PHALANX_FAULT` (whole processes, under a launcher): a worker dies on
//!   purpose, abruptly (`exit(137)`, as a SIGKILL reads), or runs slow, so
//!   tests can show what recovery and the monitor do;
//! - `inject_*` (ranks as threads): arms a fault for the calling thread
//!   only, so tests running side by side in one process never see each
//!   other's faults.
//!
//! ```
//! use phalanx::fault;
//! fault::inject_overflow(3, 1);
//! assert!(fault::overflow_at(3, 1) && !fault::overflow_at(3, 0));
//! // Another thread (another rank, another test) is unaffected.
//! assert!(!std::thread::spawn(|| fault::overflow_at(3, 1)).join().unwrap());
//! fault::clear();
//! assert!(!fault::overflow_at(3, 1));
//! ```
//!
//! `PHALANX_FAULT` takes comma-separated specs:
//!
//! - `exit-at-step:RANK:STEP`: global rank RANK exits when it reaches step
//!   STEP (before running it);
//! - `exit-in-save:STEP`: rank 0 exits while committing the checkpoint of
//!   step STEP: every rank file and the metadata are written in the
//!   `.tmp-*` directory, nothing is renamed yet (see
//!   [`crate::checkpoint::write`]).
//! - `exit-after-rename:STEP`: rank 0 exits once the checkpoint of step
//!   STEP is in place, before `latest` names it.
//!
//! - `error-at-step:RANK:STEP`: global rank RANK's step STEP returns an
//!   error (the process stays up: what its peers are told is the test);
//!
//! - `slow:RANK:MS`: global rank RANK sleeps MS milliseconds in every
//!   step (a straggler for `phalanx::monitor` to find; every attempt).
//!
//! - `lose-outer-average:STEP`: under DiLoCo with fault tolerance, this
//!   replica group's outer average after step STEP fails once after it
//!   has completed everywhere (as when a member is lost at its very end:
//!   the others have the mean, this group does not); the group drops the
//!   quorum's links and retries, as it would then.
//!
//! An item that is none of these (a typo) is ignored, and the launcher
//! warns of it ([`unknown_specs`]).
//!
//! The exits fire only in the first attempt of a job (restart count 0), so
//! a group restarted by `phalanx run --max-restarts` completes; `slow:`
//! applies in every attempt.

use std::cell::Cell;
use std::time::Duration;

/// The launcher's restart count (ours and torchrun's): > 0 in a restarted
/// worker group.
pub fn restart_count() -> usize {
    ["PHALANX_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .filter_map(|v| v.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// The launcher's id of this job, the same in every attempt and on every
/// node, where one is known: `PHALANX_JOB_ID` (`phalanx run` sets it for
/// a single-node job, or from `--rdzv-id`), torchrun's
/// `TORCHELASTIC_RUN_ID` (its `--rdzv-id`; a random one under
/// `--standalone`; "none" when not given), or Slurm's `SLURM_JOB_ID`.
pub fn job_id() -> Option<String> {
    let get = |k: &str| {
        std::env::var(k)
            .ok()
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty() && v != "none")
    };
    get("PHALANX_JOB_ID")
        .map(|v| format!("phalanx:{v}"))
        .or_else(|| get("TORCHELASTIC_RUN_ID").map(|v| format!("torchrun:{v}")))
        .or_else(|| get("SLURM_JOB_ID").map(|v| format!("slurm:{v}")))
}

/// The items of `PHALANX_FAULT` that are no fault spec (a name this
/// module does not know, or numbers missing or not numbers), each with the
/// shape its name takes: a typo in a test would otherwise disable its
/// fault silently. The launcher warns of them.
pub fn unknown_specs() -> Vec<String> {
    const SHAPES: [(&str, usize); 6] = [
        ("exit-at-step", 2),
        ("error-at-step", 2),
        ("slow", 2),
        ("exit-in-save", 1),
        ("exit-after-rename", 1),
        ("lose-outer-average", 1),
    ];
    let v = std::env::var("PHALANX_FAULT").unwrap_or_default();
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .filter(|s| {
            let mut it = s.split(':');
            let name = it.next().unwrap_or_default();
            let nums: Vec<&str> = it.collect();
            !SHAPES.iter().any(|(n, k)| {
                *n == name && nums.len() == *k && nums.iter().all(|x| x.parse::<u64>().is_ok())
            })
        })
        .map(|s| {
            let name = s.split(':').next().unwrap_or_default();
            match SHAPES.iter().find(|(n, _)| *n == name) {
                Some((n, 2)) if *n == "slow" => format!("{s} (slow:RANK:MS)"),
                Some((n, 2)) => format!("{s} ({n}:RANK:STEP)"),
                Some((n, _)) => format!("{s} ({n}:STEP)"),
                None => format!(
                    "{s} (known: {})",
                    SHAPES
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        })
        .collect()
}

/// Whether `PHALANX_FAULT` holds `spec` (the whole item, e.g.
/// `exit-in-save:4`) and this is the first attempt.
fn armed(spec: &str) -> bool {
    restart_count() == 0
        && std::env::var("PHALANX_FAULT").is_ok_and(|v| v.split(',').any(|s| s.trim() == spec))
}

/// Die abruptly, as a killed process would (no unwinding, no cleanup).
fn die(what: &str) -> ! {
    eprintln!("PHALANX_FAULT: {what}: exiting with code 137 (test hook)");
    std::process::exit(137)
}

/// `exit-at-step:RANK:STEP`: called at the top of every training step.
pub fn at_step(rank: usize, step: usize) {
    if armed(&format!("exit-at-step:{rank}:{step}")) {
        die(&format!("rank {rank} at step {step}"));
    }
}

/// `error-at-step:RANK:STEP` (or [`inject_error`] on this thread): the
/// error global rank `rank`'s step `step` returns instead of running.
pub fn error_at(rank: usize, step: usize) -> Option<String> {
    let injected = ARMED.with(|a| a.get().error) == Some((step, rank));
    (injected || armed(&format!("error-at-step:{rank}:{step}")))
        .then(|| format!("injected error at step {step} on rank {rank} (test hook)"))
}

/// `exit-in-save:STEP`: called by rank 0 between writing a checkpoint and
/// renaming it into place.
pub fn in_save(step: usize) {
    if armed(&format!("exit-in-save:{step}")) {
        die(&format!("in the save of step {step}, before the rename"));
    }
}

/// `exit-after-rename:STEP`: called by rank 0 between renaming the
/// checkpoint of step STEP into place and pointing `latest` at it.
pub fn after_rename(step: usize) {
    if armed(&format!("exit-after-rename:{step}")) {
        die(&format!(
            "in the save of step {step}, after the rename, before `latest`"
        ));
    }
}

/// `lose-outer-average:STEP`: whether this group's outer average after
/// step `step` is to fail (once per process). It fails two seconds after
/// completing, so the other members have read its last bytes.
pub fn outer_average_lost(step: usize) -> bool {
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let fire = armed(&format!("lose-outer-average:{step}"))
        && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst);
    if fire {
        eprintln!("PHALANX_FAULT: the outer average after step {step} fails here (test hook)");
        std::thread::sleep(Duration::from_secs(2));
    }
    fire
}

/// `slow:RANK:MS`: the rank to slow down and by how much per step.
fn slow_env() -> Option<(usize, Duration)> {
    let v = std::env::var("PHALANX_FAULT").ok()?;
    v.split(',').find_map(|s| {
        let mut it = s.trim().strip_prefix("slow:")?.split(':');
        let rank = it.next()?.parse().ok()?;
        let ms = it.next()?.parse().ok()?;
        Some((rank, Duration::from_millis(ms)))
    })
}

/// Faults armed on this thread by `inject_*`.
#[derive(Default, Clone, Copy)]
struct Armed {
    overflow: Option<(usize, usize)>,
    delay: Option<(usize, Duration)>,
    error: Option<(usize, usize)>,
    unshared: Option<usize>,
}

thread_local! {
    static ARMED: Cell<Armed> = Cell::new(Armed::default());
}

fn arm(f: impl FnOnce(&mut Armed)) {
    ARMED.with(|a| {
        let mut v = a.get();
        f(&mut v);
        a.set(v);
    });
}

/// At `step`, data-parallel rank `rank`'s backward runs with an infinite
/// loss scale, so its gradients overflow exactly as an fp16 overflow does
/// (this thread only).
pub fn inject_overflow(step: usize, rank: usize) {
    arm(|a| a.overflow = Some((step, rank)));
}

/// At `step`, global rank `rank`'s step returns an error instead of
/// running (this thread only).
pub fn inject_error(step: usize, rank: usize) {
    arm(|a| a.error = Some((step, rank)));
}

/// Global rank `rank` spends `delay` more on every step (computing, as far
/// as the monitor can tell: a straggler; this thread only).
pub fn inject_delay(rank: usize, delay: Duration) {
    arm(|a| a.delay = Some((rank, delay)));
}

/// Rank `rank`'s checkpoint files land where rank 0 does not see them (a
/// checkpoint.dir that nodes do not share): its file is removed once
/// written (this thread only).
pub fn inject_unshared_checkpoint(rank: usize) {
    arm(|a| a.unshared = Some(rank));
}

/// Whether rank `rank`'s checkpoint file is to vanish from rank 0's view.
pub fn unshared_checkpoint(rank: usize) -> bool {
    ARMED.with(|a| a.get().unshared == Some(rank))
}

/// Disarm everything `inject_*` armed on this thread.
pub fn clear() {
    arm(|a| *a = Armed::default());
}

/// Whether data-parallel rank `rank` overflows at `step`.
pub fn overflow_at(step: usize, rank: usize) -> bool {
    ARMED.with(|a| a.get().overflow == Some((step, rank)))
}

/// How long global rank `rank` sleeps in every step: `inject_delay` on this
/// thread, else `PHALANX_FAULT=slow:RANK:MS`.
pub fn step_delay(rank: usize) -> Option<Duration> {
    ARMED
        .with(|a| a.get().delay)
        .or_else(slow_env)
        .and_then(|(r, d)| (r == rank).then_some(d))
}
