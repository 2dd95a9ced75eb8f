//! `phalanx run`'s flags (torchrun's), shared by the static launcher
//! (`launch`) and the elastic agent (`rdzv`).

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct LaunchOpts {
    /// Worker processes on this node (default 1; `phalanx train` defaults to 2).
    /// torchrun's `auto` and `cpu` are this host's cores.
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_parser = parse_nproc
    )]
    pub nproc_per_node: Option<usize>,
    /// Number of nodes in the job: `N`, or `MIN:MAX` with MIN < MAX for an
    /// elastic job (nodes may leave and join; see `--rdzv-endpoint`);
    /// `N:N` is `N`, as in torchrun, unless `--rdzv-backend c10d`.
    #[arg(long, default_value = "1")]
    pub nnodes: String,
    /// This node's index, 0..nnodes.
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0 (hosts the rendezvous store).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Store port on node 0. Default: 29500 for multi-node jobs, a free port
    /// for single-node jobs.
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<u16>,
    /// Restart the whole group up to K times after a failure; workers of a
    /// restarted group get PHALANX_RESTART_COUNT = the attempt number (an
    /// elastic job's round) and torchrun's TORCHELASTIC_RESTART_COUNT = the
    /// failure restarts so far, and `phalanx train` resumes from its latest
    /// checkpoint.
    #[arg(long = "max-restarts", alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: usize,
    /// Rendezvous backend: `static` (fixed nodes, node 0 serves the store)
    /// or `c10d` (elastic rounds through the store at `--rdzv-endpoint`);
    /// `--nnodes MIN:MAX` with MIN < MAX implies `c10d`.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend")]
    pub rdzv_backend: Option<String>,
    /// HOST:PORT of the elastic rendezvous store: the agent on that host
    /// serves it, the others connect (default: --master-addr:--master-port).
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// The job's id: agents with the same id and endpoint form one job.
    #[arg(long = "rdzv-id", alias = "rdzv_id", default_value = "none")]
    pub rdzv_id: String,
    /// Seconds a rendezvous waits for `MIN` nodes before it fails.
    #[arg(long = "rdzv-timeout", alias = "rdzv_timeout", default_value_t = 900)]
    pub rdzv_timeout: u64,
    /// More rendezvous settings, `key=value,...`: `join_timeout` (as
    /// --rdzv-timeout), `last_call_timeout` (seconds to wait for more nodes
    /// once MIN have joined, default 5), `heartbeat_timeout` (seconds of
    /// silence after which a node is lost, default 15).
    #[arg(long = "rdzv-conf", alias = "rdzv_conf")]
    pub rdzv_conf: Option<String>,
    /// Seconds workers get between SIGTERM and SIGKILL when the job stops
    /// (torchrun's, default 30; TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
    #[arg(
        long = "shutdown-timeout",
        alias = "shutdown_timeout",
        default_value_t = 30.0
    )]
    pub shutdown_timeout: f64,
    /// torchrun's single-node shorthand: accepted, and what a one-node job
    /// does anyway (a free loopback port, a job secret of its own).
    #[arg(long)]
    pub standalone: bool,
    /// torchrun's: accepted, and what `phalanx run` always does (PROGRAM is
    /// run as given, no Python interpreter is put before it).
    #[arg(long = "no-python", alias = "no_python")]
    pub no_python: bool,
}

/// The long flag a command-line word gives, spelled with hyphens
/// (`--nproc_per_node=4` is `--nproc-per-node`); `None` for other words.
pub fn flag_name(word: &str) -> Option<String> {
    let f = word.strip_prefix("--")?.split('=').next()?;
    Some(format!("--{}", f.replace('_', "-")))
}

/// `--nproc-per-node`: a count, or torchrun's `auto` / `cpu` (this host's
/// cores); `gpu` is refused (one process per GPU: give the count).
fn parse_nproc(v: &str) -> Result<usize, String> {
    match v.trim() {
        "auto" | "cpu" => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
        "gpu" => Err(
            "torchrun's \"gpu\" (one process per GPU) is not read here: give the \
                      number of processes"
                .into(),
        ),
        n => n
            .parse()
            .map_err(|_| format!("{n:?} is not a number of processes (nor auto or cpu)")),
    }
}

/// The most nodes a job may have: far beyond any cluster, and small enough
/// that world sizes (nodes x ranks per node, itself capped) cannot wrap.
pub const MAX_NODES: usize = 1 << 20;

impl LaunchOpts {
    /// `--nnodes` as (min, max); equal for a fixed job.
    pub fn nnodes_range(&self) -> Result<(usize, usize), String> {
        let bad = || {
            format!(
                "--nnodes {}: expected N or MIN:MAX with 1 <= MIN <= MAX",
                self.nnodes
            )
        };
        let num = |v: &str| v.trim().parse::<usize>().map_err(|_| bad());
        let (min, max) = match self.nnodes.split_once(':') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(&self.nnodes)?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(bad());
        }
        // The same bound as the world size a job may have (2^20 ranks).
        if max > MAX_NODES {
            return Err(format!(
                "--nnodes {}: at most {MAX_NODES} nodes",
                self.nnodes
            ));
        }
        Ok((min, max))
    }

    /// Whether this launch rendezvouses in elastic rounds.
    pub fn elastic(&self) -> Result<bool, String> {
        let (min, max) = self.nnodes_range()?;
        match self.rdzv_backend.as_deref() {
            None | Some("static") if min == max => Ok(false),
            None | Some("c10d") => Ok(true),
            Some("static") => Err(format!(
                "--nnodes {} needs --rdzv-backend c10d (a static rendezvous has a fixed number of nodes)",
                self.nnodes
            )),
            Some(b) => Err(format!(
                "--rdzv-backend {b}: expected static or c10d"
            )),
        }
    }
}

/// The launch flags this process took from torchrun's `PET_*` variables:
/// (flag, variable, value).
static FROM_ENV: std::sync::OnceLock<Vec<(&str, &str, String)>> = std::sync::OnceLock::new();

/// Record the flags taken from the environment (once, at start-up).
pub fn flags_from_env(flags: Vec<(&'static str, &'static str, String)>) {
    let _ = FROM_ENV.set(flags);
}

/// A note for an error `message` that names a flag taken from a variable:
/// the user looks for the flag on a command line that does not have it.
pub fn env_flag_note(message: &str) -> Option<String> {
    // Every such flag the message names (`--node-rank 3 must be below
    // --nnodes 1` names two), each on its own line.
    let notes: Vec<String> = FROM_ENV
        .get()?
        .iter()
        .filter(|(flag, ..)| {
            message.match_indices(flag).any(|(i, _)| {
                !message[i + flag.len()..].starts_with(|c: char| c == '-' || c.is_alphanumeric())
            })
        })
        .map(|(flag, var, value)| {
            let whose = if var.starts_with("PET_") || var.starts_with("TORCH") {
                "torchrun's variable for it, as Kubeflow's PyTorchJob sets them"
            } else {
                "taken in a Kubeflow pod where the PET_ spelling is not set"
            };
            format!(
                "note: {flag} was not on the command line: it came from {var}={value:?} in the \
                 environment ({whose})"
            )
        })
        .collect();
    (!notes.is_empty()).then(|| notes.join("\n"))
}

/// `HOST:PORT` as `what` (a flag) gives it: the host as written (an IPv6
/// address in brackets, `[::1]`) and the port. A bare IPv6 address, an
/// unclosed bracket or an empty host is refused rather than split at its
/// last `:` into another host and port.
pub fn split_endpoint(what: &str, ep: &str) -> Result<(String, u16), String> {
    let bad = |why: &str| format!("{what} {ep}: expected HOST:PORT ({why})");
    let (h, p) = ep.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port = p
        .parse::<u16>()
        .map_err(|_| bad(&format!("port {p:?} is not a number from 0 to 65535")))?;
    if h.is_empty() {
        return Err(bad("no host"));
    }
    if h.starts_with('[') {
        if !h.ends_with(']') || h.len() < 3 || h[1..h.len() - 1].contains(['[', ']']) {
            return Err(bad("a bracketed address reads [ADDR]"));
        }
    } else if h.contains([':', '[', ']']) {
        return Err(bad("an IPv6 address goes in brackets: [ADDR]:PORT"));
    }
    Ok((h.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::split_endpoint;

    #[test]
    fn endpoints_split_only_where_they_are_host_and_port() {
        let ok = |ep: &str| split_endpoint("--rdzv-endpoint", ep).unwrap();
        assert_eq!(ok("node0:29400"), ("node0".to_string(), 29400));
        assert_eq!(ok("10.0.0.1:0"), ("10.0.0.1".to_string(), 0));
        assert_eq!(ok("[fd00::1]:29400"), ("[fd00::1]".to_string(), 29400));
        for (ep, why) in [
            ("fd00::1", "brackets"),
            ("[::1", "[ADDR]"),
            ("[]:5", "[ADDR]"),
            (":29400", "no host"),
            ("node0", "no port"),
            ("node0:70000", "65535"),
        ] {
            let e = split_endpoint("--rdzv-endpoint", ep).unwrap_err();
            assert!(
                e.starts_with(&format!("--rdzv-endpoint {ep}: expected HOST:PORT"))
                    && e.contains(why),
                "{ep}: {e}"
            );
        }
    }
}
