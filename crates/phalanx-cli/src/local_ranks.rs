//! How many ranks one host may start (`--nproc-per-node`), checked before
//! any process starts: an unchecked `--nproc-per-node 100000` forked
//! hundreds of children a second until the host ran out of something.
//!
//! The cap is the smallest of three bounds:
//! - **cores**: `PER_CORE` ranks per online core. More is pure
//!   oversubscription (each rank's kernels already get cores / ranks
//!   threads); 8 per core still leaves room for tests and toy jobs that
//!   run many small ranks on a small host;
//! - **memory**: one rank per `MIB_PER_RANK` MiB of available memory (a
//!   rank's runtime, buffers and threads alone take tens of MiB before any
//!   model);
//! - **processes**: a quarter of `RLIMIT_NPROC` (which counts the user's
//!   threads too, and each rank and its output pumps have several).
//!
//! `PHALANX_MAX_LOCAL_RANKS=N` replaces the cap with `N`, for whoever knows
//! better.

/// Ranks per online core.
pub const PER_CORE: usize = 8;
/// Available memory per rank, in MiB.
pub const MIB_PER_RANK: u64 = 64;
/// The variable that overrides the cap.
pub const OVERRIDE: &str = "PHALANX_MAX_LOCAL_RANKS";

/// The cap, and how it was reached (for the error).
pub fn max_local_ranks() -> Result<(usize, String), String> {
    if let Some(v) = std::env::var(OVERRIDE).ok().filter(|v| !v.is_empty()) {
        let n: usize = v.trim().parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
            format!("{OVERRIDE}={v}: expected a whole number of ranks, at least 1")
        })?;
        return Ok((n, format!("{OVERRIDE}={n}")));
    }
    let cores = crate::launch::num_cpus_online();
    let mut cap = PER_CORE * cores;
    let mut why = format!("{PER_CORE} per core on {cores} cores: {cap}");
    if let Some(avail) = mem_available() {
        let n = ((avail >> 20) / MIB_PER_RANK).max(1) as usize;
        why += &format!(
            "; {} MiB of available memory at {MIB_PER_RANK} MiB a rank: {n}",
            avail >> 20
        );
        cap = cap.min(n);
    }
    if let Some(limit) = nproc_limit() {
        let n = (limit / 4).max(1) as usize;
        why += &format!("; a quarter of the process limit (ulimit -u {limit}): {n}");
        cap = cap.min(n);
    }
    Ok((cap, why))
}

/// Refuse `--nproc-per-node n` beyond what this host can hold, naming the
/// flag, the cap and its bounds.
pub fn check(n: usize) -> Result<(), String> {
    if n == 0 {
        return Err("--nproc-per-node must be at least 1".into());
    }
    let (cap, why) = max_local_ranks()?;
    if n > cap {
        return Err(format!(
            "--nproc-per-node {n}: this host can run at most {cap} local ranks ({why}); \
             use fewer, or more nodes, or set {OVERRIDE} if you know better"
        ));
    }
    Ok(())
}

fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb << 10)
}

fn nproc_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}
