//! Restart bookkeeping, and a fault-injection hook for tests.
//!
//! `PHALANX_FAULT` (a test hook, not a feature) makes a worker die on
//! purpose, abruptly (`exit(137)`, as a SIGKILL reads), so tests can show
//! what recovery does. Comma-separated specs:
//!
//! - `exit-at-step:RANK:STEP`: global rank RANK exits when it reaches step
//!   STEP (before running it);
//! - `exit-in-save:STEP`: rank 0 exits while committing the checkpoint of
//!   step STEP: every rank file and the metadata are written in the
//!   `.tmp-*` directory, nothing is renamed yet (see
//!   [`crate::checkpoint::write`]).
//!
//! - `slow:RANK:MS`: global rank RANK sleeps MS milliseconds in every
//!   step (a straggler for `phalanx::monitor` to find; every attempt).
//!
//! Faults fire only in the first attempt of a job (restart count 0), so a
//! group restarted by `phalanx run --max-restarts` completes.

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

/// `exit-in-save:STEP`: called by rank 0 between writing a checkpoint and
/// renaming it into place.
pub fn in_save(step: usize) {
    if armed(&format!("exit-in-save:{step}")) {
        die(&format!("in the save of step {step}, before the rename"));
    }
}

/// `slow:RANK:MS`: the rank to slow down and by how much per step.
pub fn slow() -> Option<(usize, std::time::Duration)> {
    let v = std::env::var("PHALANX_FAULT").ok()?;
    v.split(',').find_map(|s| {
        let mut it = s.trim().strip_prefix("slow:")?.split(':');
        let rank = it.next()?.parse().ok()?;
        let ms = it.next()?.parse().ok()?;
        Some((rank, std::time::Duration::from_millis(ms)))
    })
}
