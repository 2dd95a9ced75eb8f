//! `phalanx bench collectives`: an nccl-tests style sweep over message sizes.
//!
//! Started outside a job it launches `--nproc` local ranks of itself through
//! the launcher; inside a job every rank runs the sweep and rank 0 prints
//! one row per (op, size): bytes, count, time, algbw and busbw, where
//! busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather,
//! reduce_scatter and all_to_all, x 1 for broadcast and sendrecv.
//!
//! With `--check`, every iteration's buffers are filled with a hash of
//! (rank, index, iteration) and every result is verified, so a wrong or
//! misplaced chunk is caught; any error makes the command exit non-zero.

use clap::Args;
use phalanx_comm::{bf16, f16, DType, Element, ProcessGroup, ReduceOp};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct BenchOpts {
    /// Local ranks to start (when not already inside a job).
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, sendrecv, or all.
    #[arg(long, default_value = "all_reduce")]
    pub op: String,
    /// Sizes in bytes: a list "8,1M,64M" or a range "8:256M" (times --factor).
    #[arg(long, default_value = "8:64M")]
    pub sizes: String,
    #[arg(long, default_value_t = 4)]
    pub factor: usize,
    /// Timed iterations per size (fewer are run for sizes above 16 MB).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Transport between the ranks: auto (what a job gets by default:
    /// shared memory on one host), shm, uds (Unix sockets) or tcp (sets
    /// PHALANX_TRANSPORT for the ranks); mpi (a build with `--features mpi`,
    /// run under `mpirun`); nccl (a build with `--features nccl`: NCCL on one
    /// CUDA device per rank).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Verify every iteration's result.
    #[arg(long)]
    pub check: bool,
    /// Print a JSON array instead of the table (one line, after the
    /// launcher's `[rank 0] ` prefix: strip it before parsing).
    #[arg(long)]
    pub json: bool,
}

/// Values of `--backend` on Phalanx's own transports (`PHALANX_TRANSPORT`).
const BACKENDS: [&str; 4] = ["auto", "shm", "uds", "tcp"];

/// Whether this binary was built with the MPI backend.
const MPI_BUILT: bool = cfg!(feature = "mpi");

/// Whether this binary was built with the NCCL backend.
const NCCL_BUILT: bool = cfg!(feature = "nccl");

const OPS: [&str; 6] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "sendrecv",
];

/// Parse one size: a number of bytes with an optional unit (B, K/KB/KiB,
/// M/MB/MiB, G/GB/GiB, all powers of 1024). Overflow is an error.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let mul: usize = match s[i..].to_ascii_uppercase().as_str() {
                "B" => 1,
                "K" | "KB" | "KIB" => 1 << 10,
                "M" | "MB" | "MIB" => 1 << 20,
                "G" | "GB" | "GIB" => 1 << 30,
                u => return Err(format!("unknown size unit {u:?} in {s:?}")),
            };
            (&s[..i], mul)
        }
        None => (s, 1),
    };
    let n = num
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("bad size {s:?}: expected a number of bytes such as 8, 64K or 1M"))?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("size {s:?} is too large (it does not fit in 64 bits)"))
}

/// Expand `--sizes` (a list "8,1M" or a range "8:64M" stepped by
/// `factor`) into byte counts, without checking them against the element
/// type or memory: `plan` does that.
pub fn parse_sizes(spec: &str, factor: usize) -> Result<Vec<usize>, String> {
    if let Some((lo, hi)) = spec.split_once(':') {
        let (lo, hi) = (parse_size(lo)?, parse_size(hi)?);
        if lo == 0 || factor < 2 || lo > hi {
            return Err(format!(
                "bad size range {spec:?} (factor {factor}): want 0 < LOW <= HIGH and --factor >= 2"
            ));
        }
        let mut v = vec![];
        let mut s = Some(lo);
        while let Some(x) = s.filter(|x| *x <= hi) {
            v.push(x);
            s = x.checked_mul(factor);
        }
        Ok(v)
    } else {
        spec.split(',').map(parse_size).collect()
    }
}

/// Buffers of the message size a rank holds at once while timing one op
/// (send, receive and the transport's copy), for the memory check.
const BUFFERS_PER_RANK: usize = 3;

/// What the sweep will run, every input checked.
#[derive(Debug, Clone)]
pub struct Plan {
    pub ops: Vec<&'static str>,
    pub sizes: Vec<usize>,
    pub dtype: DType,
}

/// Bytes of memory available on this host (MemAvailable), if known.
pub(crate) fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn human(bytes: f64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if bytes >= GIB {
        format!("{:.1} GiB", bytes / GIB)
    } else {
        format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
    }
}

/// Check every option of the benchmark in one place: ops, dtype, sizes
/// (each positive, a whole number of elements, and small enough that
/// `local_ranks` ranks fit in `available` bytes of memory), iterations.
/// Errors name the option and the bad value.
pub fn plan(
    opts: &BenchOpts,
    local_ranks: usize,
    available: Option<usize>,
) -> Result<Plan, String> {
    match opts.backend.as_str() {
        "mpi" if MPI_BUILT => {}
        "mpi" => {
            return Err(format!(
                "--backend mpi: not built into this phalanx; rebuild with `cargo build --release \
                 --features mpi` (needs the system MPI) and run under `mpirun`; available: {}",
                BACKENDS.join(", ")
            ))
        }
        "nccl" if NCCL_BUILT => {}
        "nccl" => {
            return Err(format!(
                "--backend nccl: not built into this phalanx; rebuild with `cargo build --release \
                 --features nccl` (no CUDA toolkit needed to build; the NVIDIA driver and libnccl \
                 to run); available: {}",
                BACKENDS.join(", ")
            ))
        }
        b if BACKENDS.contains(&b) => {}
        b => {
            return Err(format!(
                "--backend {b:?}: unknown; choose from {}",
                BACKENDS.join(", ")
            ))
        }
    }
    let ops: Vec<&'static str> = if opts.op == "all" {
        OPS.to_vec()
    } else {
        match OPS.iter().find(|o| **o == opts.op) {
            Some(o) => vec![*o],
            None => {
                return Err(format!(
                    "unknown op {:?}; choose from {OPS:?} or all",
                    opts.op
                ))
            }
        }
    };
    let dtype = DType::parse(&opts.dtype).ok_or_else(|| {
        format!(
            "unknown --dtype {:?}; choose from f32, f64, f16, bf16, i32, i64",
            opts.dtype
        )
    })?;
    if opts.iters == 0 {
        return Err("--iters must be at least 1 (got 0)".into());
    }
    // A million iterations of the smallest message already take minutes;
    // more is a typo, and `warmup + iters` must not wrap.
    const MAX_ITERS: usize = 1_000_000;
    for (key, v) in [("--iters", opts.iters), ("--warmup", opts.warmup)] {
        if v > MAX_ITERS {
            return Err(format!("{key} {v} is more than {MAX_ITERS}"));
        }
    }
    let sizes = parse_sizes(&opts.sizes, opts.factor).map_err(|e| format!("--sizes: {e}"))?;
    let esz = dtype.size();
    // Where the host does not say (no /proc/meminfo), assume 1 TiB.
    let available = available.unwrap_or(1 << 40);
    let per_rank_limit = available / BUFFERS_PER_RANK / local_ranks.max(1);
    let fits = |b: usize| -> Result<(), String> {
        match per_rank_limit {
            limit if b > limit => Err(format!(
                "--sizes: size {b} B ({}) needs about {} on this host ({local_ranks} local rank(s) \
                 x {BUFFERS_PER_RANK} buffers of the message size), but only {} of memory is available",
                human(b as f64),
                human(b as f64 * (BUFFERS_PER_RANK * local_ranks.max(1)) as f64),
                human(available as f64)
            )),
            _ => Ok(()),
        }
    };
    // A range's upper bound is named as given, before the sizes under it.
    if let Some(hi) = opts
        .sizes
        .split_once(':')
        .and_then(|(_, h)| parse_size(h).ok())
    {
        fits(hi)?;
    }
    for &b in &sizes {
        if b == 0 {
            return Err(format!(
                "--sizes: size 0 is empty; sizes must be at least one {} element ({esz} B)",
                dtype.name()
            ));
        }
        if b % esz != 0 {
            return Err(format!(
                "--sizes: size {b} B is not a multiple of the {} element size ({esz} B)",
                dtype.name()
            ));
        }
        fits(b)?;
    }
    Ok(Plan { ops, sizes, dtype })
}

pub fn main(opts: &BenchOpts, launch: &crate::launch::LaunchOpts) -> i32 {
    let in_job = crate::launch::in_job();
    if !in_job && launch.nproc_per_node.is_none() && opts.nproc == 0 {
        eprintln!("phalanx bench: --nproc must be at least 1");
        return 2;
    }
    // Ranks that share this host's memory.
    let local_ranks = if in_job {
        std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    } else {
        launch.nproc_per_node.unwrap_or(opts.nproc)
    };
    let plan = match plan(opts, local_ranks, available_memory()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("phalanx bench: {e}");
            return 2;
        }
    };
    let (ops, sizes, dtype) = (&plan.ops, &plan.sizes, plan.dtype);
    // The ranks read these in `init_process_group` (inherited when
    // relaunched). Set while this process has no other thread.
    if opts.backend == "mpi" {
        if !phalanx_comm::init::launched_by_mpi() {
            eprintln!(
                "phalanx bench: --backend mpi runs under an MPI launcher, e.g. \
                 `mpirun -np 2 phalanx bench collectives --backend mpi`"
            );
            return 2;
        }
        std::env::set_var("PHALANX_BACKEND", "mpi");
    } else if opts.backend == "nccl" {
        std::env::set_var("PHALANX_BACKEND", "nccl");
    } else {
        std::env::set_var("PHALANX_BACKEND", "native");
        std::env::set_var("PHALANX_TRANSPORT", &opts.backend);
    }
    // Outside a job: start the ranks through the launcher.
    if !in_job {
        return crate::launch::relaunch_self(launch, launch.nproc_per_node.unwrap_or(opts.nproc));
    }
    let pg = match phalanx_comm::init_process_group() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("phalanx bench: {e}");
            return 1;
        }
    };
    let mut r = match dtype {
        DType::F32 => sweep::<f32>(&pg, opts, ops, sizes),
        DType::F64 => sweep::<f64>(&pg, opts, ops, sizes),
        DType::F16 => sweep::<f16>(&pg, opts, ops, sizes),
        DType::BF16 => sweep::<bf16>(&pg, opts, ops, sizes),
        DType::I32 => sweep::<i32>(&pg, opts, ops, sizes),
        DType::I64 => sweep::<i64>(&pg, opts, ops, sizes),
    };
    if opts.check && ops.contains(&"all_reduce") {
        if let Ok(wrong) = r {
            r = match crate::bench_device_memory::check(&pg) {
                Ok(done) => {
                    let w = done.as_ref().map_or(0, |d| d.1);
                    if pg.rank() == 0 {
                        let line = match done {
                            Some((dev, w)) => format!(
                                "# all_reduce, all_gather and reduce_scatter of tensors in place \
                                 on {dev} (phalanx::collective): sums in f32 and bf16, averages \
                                 in f32, even and uneven gathers, scatters, {w} wrong"
                            ),
                            None => "# all_reduce, all_gather and reduce_scatter of tensors in place: not checked (this build \
                                     has no CUDA tensors: --features cuda)"
                                .to_string(),
                        };
                        // The JSON output is one array on stdout.
                        match opts.json {
                            true => eprintln!("{line}"),
                            false => println!("{line}"),
                        }
                    }
                    Ok(wrong + w)
                }
                Err(e) => {
                    eprintln!("phalanx bench: rank {}: tensors in place: {e}", pg.rank());
                    return 1;
                }
            };
        }
    }
    if r.is_ok() {
        // Leave cleanly (MPI wants every rank to finalise).
        pg.shutdown();
    }
    match r {
        Ok(0) => 0,
        Ok(wrong) => {
            eprintln!("phalanx bench: {wrong} wrong results");
            1
        }
        Err(e) => {
            eprintln!("phalanx bench: rank {}: {e}", pg.rank());
            1
        }
    }
}

/// A value that depends on (rank, index, iteration) through a hash, small
/// enough that sums over up to 16 ranks are exact even in bf16.
pub(crate) fn fill_value(rank: usize, i: usize, iter: usize) -> i64 {
    let mut h = (rank as u64).wrapping_mul(0x9E3779B97F4A7C15)
        ^ (i as u64).wrapping_mul(0xBF58476D1CE4E5B9)
        ^ (iter as u64);
    h ^= h >> 31;
    h = h.wrapping_mul(0x94D049BB133111EB);
    ((h >> 33) % 16) as i64
}

fn fill<T: Element>(buf: &mut [T], rank: usize, offset: usize, iter: usize) {
    for (k, x) in buf.iter_mut().enumerate() {
        *x = T::from_i64(fill_value(rank, offset + k, iter));
    }
}

struct Row {
    op: &'static str,
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: usize,
}

fn sweep<T: Element>(
    pg: &ProcessGroup,
    opts: &BenchOpts,
    ops: &[&'static str],
    sizes: &[usize],
) -> phalanx_comm::Result<usize> {
    let n = pg.size();
    let mut rows = Vec::new();
    for &op in ops {
        for &bytes in sizes {
            let esz = std::mem::size_of::<T>();
            let mut count = (bytes / esz).max(1);
            if matches!(op, "all_gather" | "reduce_scatter" | "all_to_all") {
                count = (count / n).max(1) * n;
            }
            let iters = if count * esz > 16 << 20 {
                opts.iters.div_ceil(4).max(2)
            } else {
                opts.iters
            };
            let (secs, wrong) = run_op::<T>(pg, op, count, opts.warmup, iters, opts.check)?;
            // Report the slowest rank's mean, as nccl-tests does.
            let mut t = [secs / iters as f64];
            pg.all_reduce(&mut t, ReduceOp::Max)?;
            let mut w = [wrong as i64];
            pg.all_reduce(&mut w, ReduceOp::Sum)?;
            let b = count * esz;
            let algbw = b as f64 / t[0] / 1e9;
            let f = match op {
                "all_reduce" => 2.0 * (n - 1) as f64 / n as f64,
                "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1) as f64 / n as f64,
                _ => 1.0,
            };
            rows.push(Row {
                op,
                bytes: b,
                count,
                time_us: t[0] * 1e6,
                algbw,
                busbw: algbw * f,
                wrong: w[0] as usize,
            });
        }
    }
    if pg.rank() == 0 {
        print_rows::<T>(&rows, n, opts, &links(pg));
    }
    Ok(rows.iter().map(|r| r.wrong).sum())
}

/// The kinds of link from this rank to the others, e.g. "shm" or
/// "shm+tcp": what was really measured.
fn links(pg: &ProcessGroup) -> String {
    let mut kinds: Vec<&str> = (0..pg.size())
        .filter_map(|j| pg.link(j).map(|l| l.name()))
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    if kinds.is_empty() {
        "none".into()
    } else {
        kinds.join("+")
    }
}

fn print_rows<T: Element>(rows: &[Row], n: usize, opts: &BenchOpts, links: &str) {
    let dt = T::DTYPE.name();
    if opts.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"op": r.op, "bytes": r.bytes, "count": r.count, "dtype": dt, "nproc": n,
                    "backend": opts.backend, "links": links,
                    "time_us": r.time_us, "algbw_gbps": r.algbw, "busbw_gbps": r.busbw, "wrong": r.wrong})
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
    } else {
        println!(
            "# phalanx bench collectives: {n} ranks, backend {} (links: {links}), check {}",
            opts.backend,
            if opts.check { "on" } else { "off" }
        );
        println!("# op              size(B)      count  type   time(us)  algbw(GB/s)  busbw(GB/s)  #wrong");
        for r in rows {
            println!(
                "  {:<14} {:>10} {:>10}  {:>4} {:>10.1} {:>12.3} {:>12.3} {:>7}",
                r.op, r.bytes, r.count, dt, r.time_us, r.algbw, r.busbw, r.wrong
            );
        }
    }
}

/// Run one op `warmup + iters` times; returns (timed seconds, wrong elements).
fn run_op<T: Element>(
    pg: &ProcessGroup,
    op: &str,
    count: usize,
    warmup: usize,
    iters: usize,
    check: bool,
) -> phalanx_comm::Result<(f64, usize)> {
    let (r, n) = (pg.rank(), pg.size());
    let per = count / n;
    let mut a = vec![T::zeroed(); count];
    let mut b = vec![T::zeroed(); count];
    let mut small = vec![T::zeroed(); per];
    let mut total = 0.0;
    let mut wrong = 0;
    let sum_at =
        |i: usize, it: usize| -> T { T::from_i64((0..n).map(|k| fill_value(k, i, it)).sum()) };
    for it in 0..warmup + iters {
        if check || it == 0 {
            match op {
                "all_gather" => fill(&mut small, r, r * per, it),
                "broadcast" => fill(&mut a, 0, 0, it),
                _ => fill(&mut a, r, 0, it),
            }
        }
        let t0 = Instant::now();
        match op {
            "all_reduce" => pg.all_reduce(&mut a, ReduceOp::Sum)?,
            "all_gather" => pg.all_gather(&small, &mut b)?,
            "reduce_scatter" => pg.reduce_scatter(&a, &mut small, ReduceOp::Sum)?,
            "broadcast" => pg.broadcast(&mut a, 0)?,
            "all_to_all" => pg.all_to_all(&a, &mut b)?,
            "sendrecv" if n > 1 => {
                pg.send(&a, (r + 1) % n, it as u64)?;
                pg.recv(&mut b, (r + n - 1) % n, it as u64)?;
            }
            _ => b.copy_from_slice(&a),
        }
        if it >= warmup {
            total += t0.elapsed().as_secs_f64();
        }
        if !check {
            continue;
        }
        wrong += match op {
            "all_reduce" => (0..count).filter(|&i| a[i] != sum_at(i, it)).count(),
            "all_gather" => (0..count)
                .filter(|&i| b[i] != T::from_i64(fill_value(i / per, i, it)))
                .count(),
            "reduce_scatter" => (0..per)
                .filter(|&k| small[k] != sum_at(r * per + k, it))
                .count(),
            "broadcast" => (0..count)
                .filter(|&i| a[i] != T::from_i64(fill_value(0, i, it)))
                .count(),
            // Block j of rank i's input is value(i, j*per + t).
            "all_to_all" => (0..count)
                .filter(|&i| b[i] != T::from_i64(fill_value(i / per, r * per + i % per, it)))
                .count(),
            _ => {
                let src = if n > 1 { (r + n - 1) % n } else { r };
                (0..count)
                    .filter(|&i| b[i] != T::from_i64(fill_value(src, i, it)))
                    .count()
            }
        };
    }
    Ok((total, wrong))
}
