//! `phalanx run`: a torchrun-style launcher.
//!
//! It hosts the rendezvous store (node 0), starts `nproc_per_node` workers
//! with torchrun's environment plus the job secret, prefixes their output
//! with `[rank N]`, forwards Ctrl-C / SIGTERM, and when one worker fails it
//! stops the others, names the failed rank with the tail of its stderr, and
//! exits non-zero (or restarts the whole group, up to `--max-restarts`).

use phalanx_comm::store::StoreServer;
use std::collections::VecDeque;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use crate::launch_opts::{env_flag_note, flag_name, flags_from_env, LaunchOpts};
use crate::workers::{
    blame, end_leftovers, finish_stop, poll, pump, root_cause_first, stop_all_ticking, unreaped,
    Worker,
};

/// The exit code of a worker that stopped at a step boundary because its
/// elastic agent asked it to (SIGUSR1; EX_TEMPFAIL).
pub const STOPPED_EXIT: i32 = 75;
/// How long an elastic group gets to reach a step boundary and stop.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(120);

/// How long workers get between SIGTERM and SIGKILL (`--shutdown-timeout`,
/// torchrun's 30 s by default), set once by [`run`].
static GRACE: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

pub(crate) fn grace() -> Duration {
    *GRACE.get().unwrap_or(&Duration::from_secs(30))
}

static SIGNALLED: AtomicI32 = AtomicI32::new(0);
/// Signals received so far (a second Ctrl-C ends the workers' grace).
static SIGNALS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// How many stop signals this process has received.
pub(crate) fn signals() -> usize {
    SIGNALS.load(Ordering::SeqCst)
}

/// A line on stderr that cannot fail: `eprintln!` panics when stderr is a
/// pipe whose reader is gone (`phalanx run … | tee log`, both told Ctrl-C),
/// and a launcher that panics leaves its workers' children behind.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}
pub(crate) use say;

/// [`say!`] on stdout.
macro_rules! tell {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}
pub(crate) use tell;

/// Whether this process was started as a rank of a job (by `phalanx run`,
/// torchrun, mpirun or srun).
pub fn in_job() -> bool {
    // Kubeflow's PyTorchJob with nprocPerNode gives each pod RANK (its
    // index) and WORLD_SIZE (every process of the job) beside torchrun's
    // PET_* flags: the pod's command is the per-node launcher, as torchrun
    // would be there, not a rank (its workers, ours or torchrun's, have
    // LOCAL_RANK).
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    if set("PET_NPROC_PER_NODE") && !set("LOCAL_RANK") {
        return false;
    }
    // A launcher's whole scheme (a rank and a world size), as
    // `DistEnv::from_env` reads it: a lone `SLURM_PROCID` (an sbatch or
    // salloc shell) is no job of ranks. Malformed values count as a job, so
    // that the rank's start names them.
    phalanx_comm::JobSizes::from_env().map_or(true, |j| j.in_job())
}

/// Under `mpirun` or `srun` (which set no thread counts), give each local
/// rank its share of the cores this process may run on, as `phalanx run`
/// does: otherwise every rank starts a kernel thread per core and they
/// fight (`mpirun` binds each of 2 ranks to one core by default). A
/// `RAYON_NUM_THREADS` set by the user wins. Call before any thread starts.
pub fn share_cores_under_external_launcher() {
    if !in_job() || std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    // (The sizes only: what the store needs, an address or a secret, is
    // not this function's to refuse, and an MPI job needs neither.)
    let Ok(env) = phalanx_comm::JobSizes::from_env() else {
        return;
    };
    if env.source == "torchrun" {
        return;
    }
    // The affinity mask: a rank bound to one core sees one.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bound = cores < num_cpus_online();
    let threads = if bound {
        cores
    } else {
        (cores / env.local_world_size.max(1)).max(1)
    };
    for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, threads.to_string());
        }
    }
}

/// Cores online on this host, whatever this process's affinity.
pub(crate) fn num_cpus_online() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        1
    }
}

/// Set for the workers of `relaunch_self`: their launcher checked the
/// command's outputs before starting them (see `train`).
pub const OUTPUTS_CHECKED: &str = "PHALANX_OUTPUTS_CHECKED";

/// Run this very command again as `nproc` local ranks of a job (commands
/// such as `phalanx train` launch themselves when started by hand).
pub fn relaunch_self(launch: &LaunchOpts, nproc: usize) -> i32 {
    let exe = std::env::current_exe()
        .expect("own path")
        .to_string_lossy()
        .to_string();
    let mut cmd = vec![exe];
    cmd.extend(std::env::args().skip(1));
    let lo = LaunchOpts {
        nproc_per_node: Some(nproc),
        ..launch.clone()
    };
    // The workers inherit it: this process checked the outputs already,
    // and said what the config gave it to say.
    std::env::set_var(OUTPUTS_CHECKED, "1");
    std::env::set_var(
        phalanx::config::CONFIG_SAID,
        phalanx::config::TrainConfig::said().join("\n"),
    );
    run(&lo, &cmd)
}

/// Run `cmd` as a distributed job; returns the process exit code.
pub fn run(opts: &LaunchOpts, cmd: &[String]) -> i32 {
    match run_inner(opts, cmd) {
        Ok(code) => code,
        Err(e) => {
            say!("phalanx run: error: {e}");
            if let Some(note) = env_flag_note(&e) {
                say!("{note}");
            }
            2
        }
    }
}

fn run_inner(opts: &LaunchOpts, cmd: &[String]) -> Result<i32, String> {
    for bad in phalanx::fault::unknown_specs() {
        say!("phalanx run: warning: PHALANX_FAULT item {bad} is no fault spec: ignored");
    }
    if cmd.is_empty() {
        return Err(
            "no command given; usage: phalanx run --nproc-per-node N -- PROGRAM [ARGS...]".into(),
        );
    }
    if cmd[0].starts_with('-') && cmd[0] != "--" {
        // (Everything from the first word it does not know is the program.)
        return Err(format!(
            "unknown flag {}: phalanx run takes the torchrun flags its --help lists; the \
             program and its arguments come after them",
            cmd[0]
        ));
    }
    let runnable = |p: &str| {
        use std::os::unix::fs::PermissionsExt;
        let exe = |p: &std::path::Path| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        };
        // A name without a slash is looked up on PATH, as it will be run.
        match p.contains('/') {
            true => exe(p.as_ref()),
            false => std::env::var_os("PATH")
                .is_some_and(|path| std::env::split_paths(&path).any(|d| exe(&d.join(p)))),
        }
    };
    if cmd[0].ends_with(".py") && !runnable(&cmd[0]) {
        return Err(format!(
            "{}: phalanx run executes PROGRAM itself (as torchrun --no-python does); give \
             `-- python -u {}` (note: a torch.distributed program needs torchrun's store, \
             see docs/launching.md)",
            cmd[0], cmd[0]
        ));
    }
    let t = opts.shutdown_timeout;
    if !(t.is_finite() && (0.0..=86400.0).contains(&t)) {
        return Err(format!(
            "--shutdown-timeout {t}: expected seconds between 0 and 86400"
        ));
    }
    let _ = GRACE.set(Duration::from_secs_f64(t));
    let nproc = opts.nproc_per_node.unwrap_or(1);
    crate::local_ranks::check(nproc)?;
    if opts.elastic()? {
        if opts.node_rank != 0 {
            // (torchrun warns the same way.)
            say!(
                "phalanx run: note: --node-rank {} has no effect in an elastic job: each \
                 round numbers its nodes",
                opts.node_rank
            );
        }
        return crate::rdzv::run_elastic(opts, cmd);
    }
    if opts.rdzv_conf.is_some() {
        say!(
            "phalanx run: note: --rdzv-conf has no effect with a static rendezvous (it sets \
             an elastic job's timeouts: --nnodes MIN:MAX with MIN < MAX, or --rdzv-backend \
             c10d)"
        );
    }
    let nnodes = opts.nnodes_range()?.0;
    if opts.node_rank >= nnodes {
        return Err(format!(
            "--node-rank {} must be below --nnodes {nnodes}",
            opts.node_rank
        ));
    }
    let multi = nnodes > 1;
    // torchrun's static rendezvous takes --rdzv-endpoint, where given, as
    // node 0's address and port.
    let (master_host, master_port) = match &opts.rdzv_endpoint {
        Some(ep) => {
            let (h, p) = crate::launch_opts::split_endpoint("--rdzv-endpoint", ep)?;
            (h, Some(p))
        }
        None => (opts.master_addr.clone(), opts.master_port),
    };
    if multi && phalanx_comm::init::is_loopback(&master_host) {
        say!(
            "phalanx run: note: node 0's address {master_host} is a loopback address: only nodes \
             on this host can reach it (give --master-addr or --rdzv-endpoint naming node 0's host)"
        );
    }
    let secret = match std::env::var("PHALANX_SECRET") {
        Ok(s) if !s.is_empty() => job_secret(&s)?,
        _ if multi => {
            return Err(
                "multi-node jobs need the same PHALANX_SECRET (hex) exported on every node, \
                        e.g. `export PHALANX_SECRET=$(openssl rand -hex 32)`"
                    .into(),
            )
        }
        _ => {
            // The workers inherit this: a secret of the job's own, which a
            // service outside it (a fault-tolerance lighthouse) cannot hold.
            let made = phalanx_comm::wire::new_secret_hex();
            std::env::set_var(
                phalanx_comm::wire::SECRET_MADE,
                phalanx_comm::secret_file::made_mark(&made),
            );
            made
        }
    };
    // Node 0 hosts the store: on loopback unless the job spans hosts.
    let mut port = master_port.unwrap_or(if multi { 29500 } else { 0 });
    let what = match &opts.rdzv_endpoint {
        Some(ep) => format!("--rdzv-endpoint {ep}"),
        None => format!("--master-port {port}"),
    };
    check_port(&what, port, multi)?;
    let _server = if opts.node_rank == 0 {
        let bind = if multi {
            phalanx_comm::init::any_interface(&master_host, port)
        } else {
            format!("127.0.0.1:{port}")
        };
        let s = StoreServer::bind(&bind, phalanx_comm::wire::from_hex(&secret).unwrap())
            .map_err(|e| e.to_string())?;
        port = s.addr().port();
        Some(s)
    } else {
        None
    };
    let master_addr = if multi {
        master_host
    } else {
        "127.0.0.1".to_string()
    };

    catch_signals();
    let threads = threads_per_worker(nproc);
    let job_id = agreed_job_id(opts, !multi);

    let mut attempt = 0;
    loop {
        let env = JobEnv {
            opts,
            secret: &secret,
            master_addr: &master_addr,
            port,
            threads,
            nproc,
            node_rank: opts.node_rank,
            nnodes,
            run_id: attempt.to_string(),
            restart: attempt,
            failure_restarts: attempt,
            elastic: false,
            job_id: job_id.clone(),
        };
        let outcome = run_group(&env, cmd, &mut |_| None)?;
        match outcome {
            Outcome::Success => return Ok(0),
            Outcome::Signalled(sig) => return Ok(128 + sig),
            // Only an elastic agent asks its workers to stop (see
            // `run_group`); a static job's exit 75 is a failure.
            Outcome::Interrupted(why) => return Err(format!("the workers stopped: {why}")),
            Outcome::Failed(_, why) if attempt < opts.max_restarts => {
                attempt += 1;
                say!(
                    "phalanx run: restarting the group (restart {attempt} of {}) because {why}; \
                     its workers get PHALANX_RESTART_COUNT={attempt}",
                    opts.max_restarts
                );
            }
            Outcome::Failed(code, _) => return Ok(if code == 0 { 1 } else { code }),
        }
    }
}

/// `PHALANX_SECRET` read as the workers read it (`wire::parse_secret`:
/// hex, at least 16 bytes, surrounding whitespace ignored), as the hex the
/// workers are given.
pub(crate) fn job_secret(s: &str) -> Result<String, String> {
    phalanx_comm::wire::parse_secret(s).map(|b| phalanx_comm::wire::to_hex(&b))
}

/// Refuse store port 0 (`what` names the flag and its value) where other
/// nodes must find the store: 0 means "any free port" to the node that
/// binds it, and the others would wait for a store at port 0. A single-node
/// job's store is bound first and its real port passed on.
pub(crate) fn check_port(what: &str, port: u16, other_nodes: bool) -> Result<(), String> {
    if port == 0 && other_nodes {
        return Err(format!(
            "{what}: port 0 (any free port) cannot be told to the other nodes, which must all \
             reach the store at one known port; give a port number"
        ));
    }
    Ok(())
}

/// The signal that asked this process to stop (0: none yet).
pub(crate) fn signalled() -> i32 {
    SIGNALLED.load(Ordering::SeqCst)
}

/// Ctrl-C, SIGTERM, SIGHUP (a closed terminal) and SIGQUIT (Ctrl-\\) stop
/// the job; the workers are sent the signal received, as torchrun does.
pub(crate) fn catch_signals() {
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGHUP, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGQUIT, on_signal as *const () as libc::sighandler_t);
    }
}

/// Kernel threads per worker: this host's cores shared by `nproc` workers.
pub(crate) fn threads_per_worker(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    (cores / nproc).max(1)
}

/// What one group of workers on this node is started with.
pub(crate) struct JobEnv<'a> {
    pub opts: &'a LaunchOpts,
    pub secret: &'a str,
    pub master_addr: &'a str,
    pub port: u16,
    pub threads: usize,
    pub nproc: usize,
    pub node_rank: usize,
    pub nnodes: usize,
    /// Namespace of the workers' store keys (`PHALANX_RUN_ID`).
    pub run_id: String,
    /// Which attempt of the job this is (0 first): > 0 resumes. An elastic
    /// job's round (membership changes count).
    pub restart: usize,
    /// Restarts after failures so far, torchrun's
    /// `TORCHELASTIC_RESTART_COUNT` (max_restarts − remaining_restarts):
    /// never above `--max-restarts`.
    pub failure_restarts: usize,
    /// An elastic job: the workers keep a resumed checkpoint's global batch.
    pub elastic: bool,
    /// `PHALANX_JOB_ID` for the workers (see [`agreed_job_id`]).
    pub job_id: Option<String>,
}

/// The id every attempt of this job, on every node, gives its workers as
/// `PHALANX_JOB_ID` (a checkpoint records it; a restart resumes only its
/// own job's): `--rdzv-id` where given (every node passes the same), else
/// for a job of one node a random one made once, for all its attempts.
/// None for several nodes without `--rdzv-id`: their launchers could not
/// agree on one (the workers then take any checkpoint, as before). A
/// `PHALANX_JOB_ID` in the launcher's environment is passed on instead.
pub(crate) fn agreed_job_id(opts: &LaunchOpts, one_node: bool) -> Option<String> {
    if std::env::var_os("PHALANX_JOB_ID").is_some() {
        return None;
    }
    match opts.rdzv_id.trim() {
        "" | "none" if one_node => Some(phalanx_comm::wire::new_secret_hex()[..16].to_string()),
        "" | "none" => None,
        id => Some(id.to_string()),
    }
}

pub(crate) enum Outcome {
    Success,
    /// Exit code, and which rank failed how.
    Failed(i32, String),
    Signalled(i32),
    /// `watch` asked the group to stop, for this reason.
    Interrupted(String),
}

/// Why an elastic agent stops its group, and whether the workers may first
/// reach a step boundary (all are healthy) or are ended at once.
pub(crate) struct Stop {
    pub why: String,
    pub graceful: bool,
}

/// Start this node's workers and wait for them; every 20 ms `watch` may
/// return a reason to stop them all (an elastic job re-forming).
pub(crate) fn run_group(
    env: &JobEnv,
    cmd: &[String],
    watch: &mut dyn FnMut(bool) -> Option<Stop>,
) -> Result<Outcome, String> {
    let o = env.opts;
    let nproc = env.nproc;
    let world = nproc.checked_mul(env.nnodes).ok_or_else(|| {
        format!(
            "--nproc-per-node {nproc} x --nnodes {} ranks overflows",
            env.nnodes
        )
    })?;
    let mut workers = Vec::new();
    for local in 0..nproc {
        // Stay interruptible while starting many workers: stop and reap the
        // ones already started instead of starting the rest first.
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            say!(
                "phalanx run: received signal {sig} while starting the workers ({} of {nproc} \
                 started); stopping them",
                workers.len()
            );
            stop_all_ticking(&mut workers, &mut || {
                let _ = watch(true);
            });
            return Ok(Outcome::Signalled(sig));
        }
        let rank = env.node_rank * nproc + local;
        let mut c = Command::new(&cmd[0]);
        c.args(&cmd[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("GROUP_RANK", env.node_rank.to_string())
            .env("GROUP_WORLD_SIZE", env.nnodes.to_string())
            .env("MASTER_ADDR", env.master_addr)
            .env("MASTER_PORT", env.port.to_string())
            .env("PHALANX_SECRET", env.secret)
            .env("PHALANX_STORE_HOSTED", "1")
            // This launcher's store is Phalanx's, whatever an outer
            // torchrun said of its own (its agent store is not ours).
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env("PHALANX_RUN_ID", &env.run_id)
            // Which attempt this is (0 first): a restarted trainer resumes
            // from its latest checkpoint. torchrun's names too.
            .env("PHALANX_RESTART_COUNT", env.restart.to_string())
            .env(
                "TORCHELASTIC_RESTART_COUNT",
                env.failure_restarts.to_string(),
            )
            .env("TORCHELASTIC_MAX_RESTARTS", o.max_restarts.to_string())
            // torchrun's role names (one role, "default").
            .env("ROLE_NAME", "default")
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", world.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                c.env(var, env.threads.to_string());
            }
        }
        // Output goes through a pipe: Python would buffer it, and lose it
        // when the worker is killed (torchrun runs `python -u`).
        if std::env::var_os("PYTHONUNBUFFERED").is_none() {
            c.env("PYTHONUNBUFFERED", "1");
        }
        if let Some(id) = &env.job_id {
            c.env("PHALANX_JOB_ID", id);
        }
        if env.elastic {
            c.env("PHALANX_ELASTIC", "1");
        }
        // Each worker leads its own process group, so stopping it also stops
        // whatever it started; and workers die with the launcher even if it
        // is SIGKILLed.
        phalanx_comm::child::die_with_launcher(&mut c);
        let mut child = match c.spawn() {
            Ok(ch) => ch,
            Err(e) => {
                stop_all_ticking(&mut workers, &mut || {
                    let _ = watch(true);
                });
                return Err(format!("cannot start {:?}: {e}", cmd[0]));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let pumps = vec![
            pump(out, rank, false, None),
            pump(err, rank, true, Some(tail.clone())),
        ];
        workers.push(Worker {
            rank,
            child,
            exited: None,
            tail,
            pumps,
        });
    }

    loop {
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            say!("phalanx run: received signal {sig}; stopping the workers");
            stop_all_ticking(&mut workers, &mut || {
                let _ = watch(true);
            });
            return Ok(Outcome::Signalled(sig));
        }

        let (running, mut failures) = poll(&mut workers)?;
        // Exit 75 is a stop at a step boundary only where an elastic agent
        // (this one or, through the group, another) may have asked for it;
        // in a static job it is a rank's failure like any other code.
        if env.elastic
            && !failures.is_empty()
            && failures.iter().all(|(_, (c, _))| *c == STOPPED_EXIT)
        {
            // Asked to stop (by this agent or, through the group, another's).
            finish_stop(&mut workers, watch)?;
            return Ok(Outcome::Interrupted(
                "the workers stopped at a step boundary".into(),
            ));
        }
        // A rank that exited 1 may have done so because its peer died (it
        // reports that as an error): give the peer a moment to be seen, so
        // the root cause is named.
        let grace = Instant::now() + Duration::from_millis(300);
        while !failures.is_empty()
            && failures
                .iter()
                .all(|(_, (code, _))| *code == 1 || (env.elastic && *code == STOPPED_EXIT))
            && Instant::now() < grace
        {
            std::thread::sleep(Duration::from_millis(10));
            failures = poll(&mut workers)?.1;
        }
        root_cause_first(&mut failures, env.elastic);
        let failed = failures.into_iter().next();
        if let Some((rank, (code, how))) = failed {
            let summary = blame(&mut workers, rank, code, &how);
            stop_all_ticking(&mut workers, &mut || {
                let _ = watch(true);
            });
            let mut e = std::io::stderr().lock();
            let _ = writeln!(
                e,
                "phalanx run: {}; the other ranks were stopped.",
                summary.text
            );
            for r in summary.tails {
                let Some(w) = workers.iter().find(|w| w.rank == r) else {
                    continue;
                };
                let tail: Vec<String> = w.tail.lock().unwrap().iter().cloned().collect();
                if tail.is_empty() {
                    continue;
                }
                let _ = writeln!(
                    e,
                    "phalanx run: last {} lines of rank {r}'s stderr:",
                    tail.len()
                );
                for l in tail {
                    let _ = writeln!(e, "  | {l}");
                }
            }
            return Ok(Outcome::Failed(code, summary.text));
        }
        if running == 0 {
            // The job is done when its workers are: what they left behind
            // in their process groups is ended, and what escaped them
            // (e.g. `setsid`) is not waited for.
            end_leftovers(&mut workers);
            return Ok(Outcome::Success);
        }
        if let Some(Stop { why, graceful }) = watch(false) {
            if graceful {
                // Stop at the next step boundary, all ranks together (with
                // a checkpoint of it), rather than mid-step or mid-save.
                for pid in unreaped(&workers) {
                    // SAFETY: signalling our own child, not yet reaped.
                    unsafe { libc::kill(pid, libc::SIGUSR1) };
                }
                finish_stop(&mut workers, watch)?;
            } else {
                stop_all_ticking(&mut workers, &mut || {
                    let _ = watch(true);
                });
            }
            return Ok(Outcome::Interrupted(why));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launcher_reads_the_secret_as_the_workers_do() {
        let e = job_secret("00ff").unwrap_err();
        assert!(e.contains("PHALANX_SECRET is too short"), "{e}");
        assert!(job_secret("zz").unwrap_err().contains("not hex"));
        let hex = "00112233445566778899AABBCCDDEEFF";
        // A trailing newline (`$(cat secret)` keeps none, a file read may)
        // is accepted, and the workers get the hex without it.
        assert_eq!(
            job_secret(&format!("{hex}\n")).unwrap(),
            hex.to_ascii_lowercase()
        );
    }

    #[test]
    fn port_0_is_refused_where_other_nodes_must_find_the_store() {
        let e = check_port("--master-port 0", 0, true).unwrap_err();
        assert!(e.starts_with("--master-port 0: port 0"), "{e}");
        let e = check_port("--rdzv-endpoint node0:0", 0, true).unwrap_err();
        assert!(e.starts_with("--rdzv-endpoint node0:0"), "{e}");
        // One node binds its store first and passes the real port on.
        check_port("--master-port 0", 0, false).unwrap();
        check_port("--master-port 29500", 29500, true).unwrap();
    }
}
