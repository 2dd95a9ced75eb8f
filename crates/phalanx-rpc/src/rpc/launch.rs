//! Examples and tests that start their own ranks: run this very program
//! again as `world` local processes around a rendezvous store hosted
//! here, as `phalanx run --nproc-per-node world` would. A process already
//! started as a rank (by this, `phalanx run`, torchrun, mpirun or srun)
//! is left alone.
//!
//! The ranks follow `phalanx run`'s rules: each leads its own process
//! group (so that stopping it stops what it started), gets SIGKILL from the
//! kernel if the launcher dies, even of SIGKILL (`PR_SET_PDEATHSIG`), and
//! Ctrl-C / SIGTERM / SIGHUP to the launcher stop every rank (SIGTERM, then
//! SIGKILL after 3 s) before it exits with 128 + the signal.

use phalanx_comm::store::StoreServer;
use std::io::Write;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// How long ranks get between SIGTERM and SIGKILL when the launcher is
/// asked to stop.
const GRACE: Duration = Duration::from_secs(3);

/// The signal that asked the launcher to stop (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Catch the stop signals while ranks run; the previous handlers come back
/// when this is dropped.
struct CatchSignals([libc::sighandler_t; 3]);

impl CatchSignals {
    fn install() -> CatchSignals {
        SIGNALLED.store(0, Ordering::SeqCst);
        let h = on_signal as *const () as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic.
        CatchSignals(STOP_SIGNALS.map(|s| unsafe { libc::signal(s, h) }))
    }
}

impl Drop for CatchSignals {
    fn drop(&mut self) {
        for (s, old) in STOP_SIGNALS.iter().zip(self.0) {
            // SAFETY: restoring what `install` replaced.
            unsafe { libc::signal(*s, old) };
        }
    }
}

/// The value after `--name` on the command line, or `default` when the
/// flag is absent. A missing or unparsable value ends the program with a
/// message naming the flag and exit code 2 (for the examples).
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == name) else {
        return default;
    };
    match args.get(i + 1).map(|v| (v, v.parse::<T>())) {
        Some((_, Ok(v))) => v,
        Some((v, Err(_))) => {
            eprintln!("error: {name} {v}: not a valid value");
            std::process::exit(2)
        }
        None => {
            eprintln!("error: {name} needs a value");
            std::process::exit(2)
        }
    }
}

/// Check the command line against what an example takes: `--help` / `-h`
/// prints `usage` and exits 0; a flag not in `with_value` (flags followed
/// by a value) or `switches`, or a stray argument, ends the program with a
/// message naming it and exit code 2, so a typo never runs the default job.
pub fn check_args(usage: &str, with_value: &[&str], switches: &[&str]) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{usage}");
        std::process::exit(0);
    }
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if with_value.contains(&a) {
            i += 2;
        } else if switches.contains(&a) {
            i += 1;
        } else {
            eprintln!("error: unknown argument {a:?} (--help lists the options)");
            std::process::exit(2);
        }
    }
}

/// [`arg`], then `check(value)`: `Err(why)` ends the program with a message
/// naming the flag, its value and why, and exit code 2.
pub fn arg_checked<T: std::str::FromStr + std::fmt::Display>(
    name: &str,
    default: T,
    check: impl Fn(&T) -> Result<(), String>,
) -> T {
    let v = arg(name, default);
    if let Err(why) = check(&v) {
        eprintln!("error: {name} {v}: {why}");
        std::process::exit(2);
    }
    v
}

/// For [`arg_checked`]: a number in `lo..=hi`.
pub fn within<T: PartialOrd + Copy + std::fmt::Display>(
    lo: T,
    hi: T,
) -> impl Fn(&T) -> Result<(), String> {
    move |v| {
        if (lo..=hi).contains(v) {
            Ok(())
        } else {
            Err(format!("must be between {lo} and {hi}"))
        }
    }
}

/// For [`arg_checked`]: a finite number above zero.
pub fn positive(v: &f32) -> Result<(), String> {
    if v.is_finite() && *v > 0.0 {
        Ok(())
    } else {
        Err("must be a finite number above 0".into())
    }
}

/// The most ranks [`spawn_ranks`] starts on this host: 8 per core, as
/// `phalanx run` allows by default.
pub fn max_local_ranks() -> usize {
    8 * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// For a rank's program: an error ends it with a message and exit code 1
/// instead of a panic's backtrace and 101 (a peer that died, a missing
/// `PHALANX_SECRET`: what happened, not a bug).
pub trait OrExit<T> {
    /// The value, or `PROGRAM: what: error` on stderr and exit 1.
    fn or_exit(self, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrExit<T> for std::result::Result<T, E> {
    fn or_exit(self, what: &str) -> T {
        self.unwrap_or_else(|e| {
            let prog = std::env::args().next().unwrap_or_default();
            let prog = std::path::Path::new(&prog)
                .file_name()
                .map_or("rank".into(), |n| n.to_string_lossy().into_owned());
            let _ = writeln!(std::io::stderr(), "{prog}: {what}: {e}");
            std::process::exit(1)
        })
    }
}

/// This process's rank and world size, when it was started as a rank.
pub fn rank_of_job() -> Option<(usize, usize)> {
    // The sizes only: what the store needs (an address, a secret) is for
    // `init_rpc` to check and say, not a reason to start ranks here.
    let env = phalanx_comm::JobSizes::from_env().ok()?;
    (env.source != "single").then_some((env.rank, env.world_size))
}

/// Run this program as `world` ranks with the same arguments; returns the
/// job's exit code (the first failure's in time, 128 + the signal for a
/// rank killed by one, named on stderr). If a rank fails, the others get
/// `grace` to notice before they are killed.
pub fn spawn_ranks(world: usize, grace: Duration) -> Result<i32, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    spawn_ranks_with(world, &args, &[], grace)
}

/// `spawn_ranks` with explicit arguments and extra environment variables.
pub fn spawn_ranks_with(
    world: usize,
    args: &[String],
    envs: &[(String, String)],
    grace: Duration,
) -> Result<i32, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let secret_hex = phalanx_comm::wire::new_secret_hex();
    let secret = phalanx_comm::wire::from_hex(&secret_hex).expect("fresh secret is hex");
    let server = StoreServer::bind("127.0.0.1:0", secret).map_err(|e| e.to_string())?;
    let port = server.addr().port().to_string();
    let _signals = CatchSignals::install();
    let mut kids: Vec<Child> = Vec::new();
    for rank in 0..world {
        if SIGNALLED.load(Ordering::SeqCst) != 0 {
            break; // seen below, with the ranks started so far
        }
        let mut c = Command::new(&exe);
        c.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("PHALANX_SECRET", &secret_hex)
            .env("PHALANX_STORE_HOSTED", "1");
        for (k, v) in envs {
            c.env(k, v);
        }
        phalanx_comm::child::die_with_launcher(&mut c);
        match c.spawn() {
            Ok(k) => kids.push(k),
            Err(e) => {
                kill_all(&mut kids);
                return Err(format!("starting rank {rank}: {e}"));
            }
        }
    }
    let mut codes: Vec<Option<i32>> = vec![None; world];
    // The first failure in time (its code is the job's) and when.
    let mut first: Option<(i32, Instant)> = None;
    loop {
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            stop_all(&mut kids);
            return Ok(128 + sig);
        }
        for (r, k) in kids.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Ok(Some(st)) = k.try_wait() {
                    // Killed by a signal: 128 + it, as a shell says.
                    let sig = std::os::unix::process::ExitStatusExt::signal(&st);
                    let code = st.code().unwrap_or(128 + sig.unwrap_or(0));
                    codes[r] = Some(code);
                    if code != 0 && first.is_none() {
                        first = Some((code, Instant::now()));
                        let how = match sig {
                            Some(s) => format!("killed by signal {s}"),
                            None => format!("exit code {code}"),
                        };
                        let _ = writeln!(
                            std::io::stderr(),
                            "rank {r} failed ({how}); the other ranks are stopped"
                        );
                    }
                }
            }
        }
        if codes.iter().all(|c| c.is_some()) {
            break;
        }
        if first.is_some_and(|(_, t)| t.elapsed() > grace) {
            kill_all(&mut kids);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
    Ok(first.map_or(0, |(code, _)| code))
}

/// SIGKILL every rank's process group, and reap the ranks.
fn kill_all(kids: &mut [Child]) {
    for k in kids.iter_mut() {
        // SAFETY: signalling the process group our child leads.
        unsafe { libc::kill(-(k.id() as libc::pid_t), libc::SIGKILL) };
        let _ = k.wait();
    }
}

/// SIGTERM every rank's process group, SIGKILL what is left after GRACE.
fn stop_all(kids: &mut [Child]) {
    for k in kids.iter() {
        // SAFETY: as above.
        unsafe { libc::kill(-(k.id() as libc::pid_t), libc::SIGTERM) };
    }
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline && kids.iter_mut().any(|k| matches!(k.try_wait(), Ok(None))) {
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_all(kids);
}
