//! Starting a process group from the environment, the way torchrun, mpirun
//! and srun start processes.
//!
//! | launcher | rank | world size | local rank | local world size |
//! |---|---|---|---|---|
//! | `phalanx run` / torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | Slurm `srun` | `SLURM_PROCID` | `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`) | `SLURM_LOCALID` | `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_NTASKS_PER_NODE`) |
//!
//! Slurm's variables count only with a step id (`SLURM_STEP_ID`): an sbatch
//! script's own shell has `SLURM_PROCID=0` and the allocation's
//! `SLURM_NTASKS`, but it is one process, not rank 0 of a job.
//! The store lives at `MASTER_ADDR:MASTER_PORT` (defaults 127.0.0.1:29500;
//! under `srun`, the first node of `SLURM_STEP_NODELIST` (else
//! `SLURM_JOB_NODELIST`) and 15000 + `SLURM_JOB_ID` % 10000).
//! `phalanx run` hosts it and sets `PHALANX_STORE_HOSTED=1`; torchrun's agent
//! hosts a PyTorch TCPStore there and sets `TORCHELASTIC_USE_AGENT_STORE=True`
//! (the ranks then speak torch's protocol to it, keys under
//! `phalanx/{TORCHELASTIC_RUN_ID}/attempt_{TORCHELASTIC_RESTART_COUNT}`);
//! otherwise rank 0 hosts it (a process alone, world size 1, serves its
//! own on a free loopback port instead of meeting anyone). The job secret comes from `PHALANX_SECRET`: hex, at least 16
//! bytes. A job that may span hosts (fewer local ranks than ranks, or a
//! `MASTER_ADDR` that is not loopback) refuses to start without it; a
//! single-host job without it binds loopback only, and rank 0 makes a
//! random secret that the other ranks read from a file only this user can
//! read ([`crate::secret_file`]).
//!
//! ```no_run
//! let pg = phalanx_comm::init_process_group().unwrap();
//! println!("rank {} of {}", pg.rank(), pg.size());
//! ```

use crate::config::Config;
use crate::error::{invalid, CommError, Result};
use crate::group::ProcessGroup;
use crate::secret_file;
use crate::store::{StoreClient, StoreServer};
use crate::transport::connect_mesh;
use crate::wire;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The job secret; empty while `secret_file` is still to be read.
    pub secret: Vec<u8>,
    /// A single-host job without `PHALANX_SECRET`: rank 0 writes a random
    /// secret here and the other ranks read it, in `init_with`.
    pub secret_file: Option<std::path::PathBuf>,
    /// True when a launcher already serves the store.
    pub store_hosted: bool,
    /// True under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`): its
    /// agent serves a PyTorch TCPStore at `MASTER_ADDR:MASTER_PORT`, and the
    /// ranks rendezvous through it with torch's protocol.
    pub agent_store: bool,
    /// Which launcher's variables were found.
    pub source: &'static str,
    /// Namespace for store keys (changes on every restart of the job).
    pub run_id: String,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The most ranks a job may have, as `phalanx run --nnodes` is capped: a
/// larger world size is a mistake, and rank 0 sizes its tables by it.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// Where this process sits in its job, from whichever launcher's variables
/// are set (torchrun's, then mpirun's, then srun's); a process started by
/// hand is rank 0 of 1. The config layer reads the sizes from here (a
/// derived batch, HYBRID_SHARD's node group) without the rest of
/// [`DistEnv`] (addresses, the secret).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSizes {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Which launcher's variables were found ("single" for none).
    pub source: &'static str,
    /// Whether the launcher said how many ranks share this node (else
    /// `local_world_size` is the world: Kubeflow's PyTorchJob sets none).
    pub local_known: bool,
}

impl JobSizes {
    pub fn from_env() -> Result<JobSizes> {
        JobSizes::from_vars(var)
    }

    /// As [`JobSizes::from_env`], with the variables read through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<JobSizes> {
        let get = |name: &str| get(name).filter(|v| !v.is_empty());
        // (launcher, [rank, world, local rank, local world], a variable
        // only that launcher's ranks have). "A|B": A where set, else B.
        let schemes: [(&str, [&str; 4], Option<&str>); 3] = [
            (
                "torchrun",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
                None,
            ),
            (
                "mpirun",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
                None,
            ),
            (
                "srun",
                [
                    "SLURM_PROCID",
                    // The step's sizes first (srun always sets them; a step
                    // may hold fewer tasks than the allocation), then the
                    // job's request.
                    "SLURM_STEP_NUM_TASKS|SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_STEP_TASKS_PER_NODE|SLURM_NTASKS_PER_NODE",
                ],
                // An sbatch script's shell has SLURM_PROCID=0 and the
                // allocation's SLURM_NTASKS too, but it is one process, not
                // rank 0 of a step: only srun's tasks have a step id.
                Some("SLURM_STEP_ID|SLURM_STEPID"),
            ),
        ];
        // The first of "A|B" that is set: its name and value.
        let first = |keys: &'static str| -> Result<Option<(&'static str, usize)>> {
            for k in keys.split('|') {
                if let Some(v) = get(k) {
                    let n = v.trim().parse::<usize>().map_err(|_| {
                        invalid!("environment variable {k}={v} is not a non-negative integer")
                    })?;
                    return Ok(Some((k, n)));
                }
            }
            Ok(None)
        };
        // Half of torchrun's pair (a manifest that forgot one): every
        // process would train alone; torch's env:// refuses it too.
        match (get("RANK"), get("WORLD_SIZE")) {
            (Some(_), None) => {
                return Err(invalid!(
                    "RANK is set but WORLD_SIZE is not: a torchrun-style environment needs both \
                     (unset RANK to run a job of its own)"
                ))
            }
            (None, Some(_)) => {
                return Err(invalid!(
                    "WORLD_SIZE is set but RANK is not: a torchrun-style environment needs both \
                     (unset WORLD_SIZE to run a job of its own)"
                ))
            }
            _ => {}
        }
        // Every scheme whose ranks this process has: (name, rank, size).
        let mut all = Vec::new();
        let mut found = None;
        for (name, keys, needs) in schemes {
            if needs.is_some_and(|n| !n.split('|').any(|k| get(k).is_some())) {
                continue;
            }
            if let (Some(r), Some(w)) = (first(keys[0])?, first(keys[1])?) {
                all.push((name, w));
                if found.is_some() {
                    continue;
                }
                let lr = first(keys[2])?;
                let lw = if name == "srun" {
                    // Slurm's per-node counts may read "4(x2)" or "4,2":
                    // take the leading number (the first node's; others
                    // may have fewer), and only that loosely.
                    keys[3]
                        .split('|')
                        .find_map(|k| Some((k, get(k)?)))
                        .and_then(|(k, v)| {
                            let n = v.split(|c: char| !c.is_ascii_digit()).next()?;
                            Some((k, n.parse::<usize>().ok().filter(|n| *n >= 1)?.min(w.1)))
                        })
                } else {
                    first(keys[3])?
                };
                found = Some((name, r, w, lr, lw));
            }
        }
        // A launcher started by another (torchrun under srun or mpirun, one
        // per node) has at least as many ranks as the outer one has tasks;
        // fewer is a stale pair left in the environment (each task would
        // train alone).
        if let (Some((src, _, (wv, w), _, _)), true) = (&found, all.len() > 1) {
            if let Some((other, (ov, ow))) = all.iter().skip(1).find(|(_, (_, n))| *n > *w) {
                return Err(invalid!(
                    "{src}'s {wv}={w} but {other}'s {ov}={ow}: fewer ranks than the launcher \
                     around it started (a stale {wv} in the environment?); unset {src}'s \
                     variables or make them agree"
                ));
            }
        }
        let Some((source, (rank_var, rank), (world_var, world_size), local_rank, local)) = found
        else {
            return Ok(JobSizes {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                source: "single",
                local_known: true,
            });
        };
        if world_size == 0 || rank >= world_size {
            return Err(invalid!(
                "{source}: {rank_var}={rank} is out of range for {world_var}={world_size}: a \
                 rank is at least 0 and below the world size"
            ));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(invalid!(
                "{source}: {world_var}={world_size} is too large: a job has at most \
                 {MAX_WORLD_SIZE} ranks"
            ));
        }
        if let Some((k, lw)) = local {
            if lw == 0 || lw > world_size {
                return Err(invalid!(
                    "{source}: {k}={lw} is out of range: ranks on this node must be at least 1 \
                     and at most {world_var}={world_size}"
                ));
            }
        }
        let local_world_size = local.map_or(world_size, |(_, n)| n);
        // Under srun the node's count is the first node's (see above): a
        // node with more tasks has local ids beyond it, but none beyond the
        // world.
        if let Some((k, lr)) = local_rank {
            if source == "srun" && lr >= world_size {
                return Err(invalid!(
                    "{source}: {k}={lr} is out of range: it must be below {world_var}={world_size}"
                ));
            }
            if source != "srun" && lr >= local_world_size {
                let bound = local.map_or(world_var, |(k, _)| k);
                return Err(invalid!(
                    "{source}: {k}={lr} is out of range: it must be below \
                     {bound}={local_world_size}"
                ));
            }
        }
        Ok(JobSizes {
            rank,
            world_size,
            // Not given: the rank's place on its node where the node's size
            // is known (ranks fill nodes in order, as every launcher
            // places them), else the rank (one node).
            local_rank: local_rank.map_or(rank % local_world_size.max(1), |(_, n)| n),
            local_world_size,
            source,
            local_known: local.is_some(),
        })
    }

    /// True when a launcher's variables were found.
    pub fn in_job(&self) -> bool {
        self.source != "single"
    }
}

impl DistEnv {
    /// Read the launcher's variables; a process started by hand is rank 0 of 1.
    pub fn from_env() -> Result<DistEnv> {
        DistEnv::from_vars(var)
    }

    /// As [`DistEnv::from_env`], with the variables read through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let var = |name: &str| get(name).filter(|v| !v.is_empty());
        let JobSizes {
            rank,
            world_size,
            local_rank,
            local_world_size,
            source,
            ..
        } = JobSizes::from_vars(var)?;
        // Under srun, without MASTER_ADDR / MASTER_PORT: the job's first
        // node, and a port from the job id (so that two jobs sharing a node
        // do not meet), as PyTorch Lightning picks them.
        let slurm = source == "srun";
        let named_addr = var("MASTER_ADDR").or_else(|| {
            slurm
                .then(|| {
                    // The step's nodes: its task 0 runs on the first.
                    var("SLURM_STEP_NODELIST")
                        .or_else(|| var("SLURM_JOB_NODELIST"))
                        .or_else(|| var("SLURM_NODELIST"))
                })
                .flatten()
                .and_then(|l| first_host(&l))
        });
        let addr_named = named_addr.is_some();
        let master_addr = named_addr.unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match var("MASTER_PORT") {
            None => match var("SLURM_JOB_ID").and_then(|j| j.trim().parse::<u64>().ok()) {
                Some(job) if slurm => 15000 + (job % 10000) as u16,
                _ => 29500,
            },
            Some(p) => p
                .parse()
                .map_err(|_| invalid!("MASTER_PORT={p} is not a port number"))?,
        };
        let store_hosted = var("PHALANX_STORE_HOSTED").as_deref() == Some("1");
        // torch compares with str(True); accept any case.
        let agent_store = source == "torchrun"
            && var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        // Port 0 means "any free port" to whoever binds it, but the ranks
        // that connect would wait for a store at port 0 until they time
        // out. Only a process alone (serving its own store) ignores it.
        if master_port == 0 && (world_size > 1 || agent_store || store_hosted) {
            return Err(invalid!(
                "MASTER_PORT=0: the {world_size} rank(s) of this {source} job must all reach \
                 the store at one known port; set MASTER_PORT to a port number (e.g. 29500)"
            ));
        }
        let may_span_hosts = local_world_size < world_size || !is_loopback(&master_addr);
        let mut secret_file = None;
        let secret = match var("PHALANX_SECRET") {
            Some(h) => wire::parse_secret(&h).map_err(CommError::Invalid)?,
            None if store_hosted => {
                return Err(invalid!(
                    "PHALANX_STORE_HOSTED is set but PHALANX_SECRET is missing"
                ))
            }
            None if world_size > 1 && may_span_hosts => {
                return Err(invalid!(
                    "{source}: this job may span hosts ({}) but PHALANX_SECRET is not set, so \
                     anyone who can reach {master_addr}:{master_port} could join it. Export the \
                     same secret to every rank, e.g. `export PHALANX_SECRET=$(openssl rand -hex 32)` \
                     (`phalanx run` makes one for single-node jobs)",
                    if local_world_size < world_size {
                        format!("{local_world_size} of its {world_size} ranks are local")
                    } else {
                        format!("MASTER_ADDR={master_addr} is not a loopback address")
                    }
                ))
            }
            None => {
                // One host, loopback only: every connection comes from
                // this machine, but maybe from another user. Rank 0 makes
                // a random secret in a file only this user can read; its
                // name says which job it is for (ids of the launcher's
                // job and attempt, and the store's address).
                let job = [
                    "OMPI_MCA_ess_base_jobid",
                    "SLURM_JOB_ID",
                    "SLURM_STEP_ID",
                    "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT",
                    "PHALANX_RUN_ID",
                ]
                .map(|k| var(k).unwrap_or_default())
                .join("/");
                let key = format!("{source}|{job}|{master_addr}|{master_port}");
                secret_file = Some(crate::secret_file::path_for(&key));
                Vec::new()
            }
        };
        // Loopback by default, as torchrun's single-node jobs have it; a
        // job whose ranks are not all here must say where rank 0 is, or
        // each host's ranks would wait for a store on their own loopback
        // until they time out. (An explicit loopback address is taken as
        // meant: several "nodes" on one host.)
        if !addr_named && local_world_size < world_size {
            return Err(invalid!(
                "MASTER_ADDR is not set, but only {local_world_size} of this {source} job's \
                 {world_size} ranks run on this host: set MASTER_ADDR (and MASTER_PORT) to \
                 rank 0's host, where the job's store is"
            ));
        }
        // Keys of one attempt never meet those of another: torchrun keeps
        // its store across restarts of the workers.
        let run_id = match var("PHALANX_RUN_ID") {
            Some(id) => id,
            None if agent_store => format!(
                "{}/attempt_{}",
                var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
                var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
            ),
            None => "0".into(),
        };
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            secret,
            secret_file,
            store_hosted,
            agent_store,
            source,
            run_id,
        })
    }
}

/// The first host of a Slurm node list (`gpu[003-005,9],cpu1` → `gpu003`).
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..];
        let first = inner.split([',', '-', ']']).next()?;
        (!first.is_empty()).then(|| format!("{prefix}{first}"))
    } else {
        (!prefix.is_empty()).then(|| prefix.to_string())
    }
}

/// `host:port` as a socket address string: a bare IPv6 literal
/// (`MASTER_ADDR=fd00::1`) gets its brackets.
///
/// ```
/// use phalanx_comm::init::host_port;
/// assert_eq!(host_port("fd00::1", 29500), "[fd00::1]:29500");
/// assert_eq!(host_port("[fd00::1]", 29500), "[fd00::1]:29500");
/// assert_eq!(host_port("node7", 29500), "node7:29500");
/// ```
pub fn host_port(host: &str, port: u16) -> String {
    let h = host.trim();
    if h.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{h}]:{port}")
    } else {
        format!("{h}:{port}")
    }
}

/// The address that serves `port` on every interface of the family
/// `host` is reached by: `[::]` for an IPv6 host (a literal, or a name
/// with IPv6 addresses only), else `0.0.0.0` (an IPv4 wildcard takes no
/// IPv6 connection, and `[::]` takes IPv4 ones only where the system
/// allows dual-stack sockets).
///
/// ```
/// use phalanx_comm::init::any_interface;
/// assert_eq!(any_interface("[fd00::1]", 29500), "[::]:29500");
/// assert_eq!(any_interface("10.0.0.1", 29500), "0.0.0.0:29500");
/// ```
pub fn any_interface(host: &str, port: u16) -> String {
    use std::net::ToSocketAddrs;
    let h = host.trim().trim_start_matches('[').trim_end_matches(']');
    let v6 = match h.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_ipv6(),
        Err(_) => (h, port).to_socket_addrs().is_ok_and(|a| {
            let a: Vec<_> = a.collect();
            !a.is_empty() && a.iter().all(|x| x.is_ipv6())
        }),
    };
    if v6 {
        format!("[::]:{port}")
    } else {
        format!("0.0.0.0:{port}")
    }
}

/// Whether `addr` (a host name or IP address, as in MASTER_ADDR) names this
/// host's loopback interface.
pub fn is_loopback(addr: &str) -> bool {
    let a = addr.trim().trim_start_matches('[').trim_end_matches(']');
    a.eq_ignore_ascii_case("localhost")
        || a.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Which library carries a job's collectives (`PHALANX_BACKEND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Phalanx's own transports (shared memory, Unix sockets, TCP).
    Native,
    /// The system MPI library (`--features mpi`).
    Mpi,
    /// NVIDIA's NCCL on one CUDA device per rank (`--features nccl`).
    Nccl,
}

impl BackendKind {
    /// `PHALANX_BACKEND`: `native`, `mpi`, `nccl`, or `auto` (the default):
    /// MPI when this build has the `mpi` feature and an MPI launcher
    /// (`mpirun`, `srun --mpi=pmix`) started the process, native otherwise.
    /// NCCL is only ever chosen explicitly.
    pub fn from_env() -> Result<BackendKind> {
        let built = cfg!(feature = "mpi");
        match var("PHALANX_BACKEND")
            .map(|v| v.trim().to_ascii_lowercase())
            .as_deref()
        {
            None | Some("auto") => Ok(if built && launched_by_mpi() {
                BackendKind::Mpi
            } else {
                BackendKind::Native
            }),
            Some("native") | Some("phalanx") => Ok(BackendKind::Native),
            Some("mpi") if built => Ok(BackendKind::Mpi),
            Some("mpi") => Err(invalid!(
                "PHALANX_BACKEND=mpi, but this build has no MPI backend: rebuild with \
                 `cargo build --release --features mpi` (needs the system MPI, e.g. Debian's \
                 libopenmpi-dev, and libclang-dev)"
            )),
            Some("nccl") if cfg!(feature = "nccl") => Ok(BackendKind::Nccl),
            Some("nccl") => Err(invalid!(
                "PHALANX_BACKEND=nccl, but this build has no NCCL backend: rebuild with \
                 `cargo build --release --features nccl` (cargo feature `nccl`; building needs \
                 no CUDA toolkit, running needs the NVIDIA driver and libnccl)"
            )),
            Some(v) => Err(invalid!(
                "PHALANX_BACKEND={v}: expected auto, native, mpi or nccl"
            )),
        }
    }
}

/// Whether an MPI launcher started this process (Open MPI's `mpirun`, or a
/// PMI/PMIx launcher such as `srun --mpi=pmix`).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// Initialise the world group from the environment (see the module docs).
pub fn init_process_group() -> Result<ProcessGroup> {
    let cfg = Config::from_env();
    let kind = BackendKind::from_env()?;
    if kind == BackendKind::Mpi {
        return init_mpi(cfg);
    }
    let env = DistEnv::from_env()?;
    if kind == BackendKind::Nccl {
        // Refuse at once on a machine without the driver, a device or
        // libnccl, before waiting for the other ranks.
        nccl_preflight()?;
    }
    init_kind(&env, cfg, kind)
}

#[cfg(feature = "nccl")]
fn nccl_preflight() -> Result<()> {
    crate::nccl::probe::require().map(|_| ())
}

#[cfg(not(feature = "nccl"))]
fn nccl_preflight() -> Result<()> {
    unreachable!("BackendKind::from_env never picks NCCL without the feature")
}

/// The world group on the system MPI library: no store, no secret (the MPI
/// launcher already connected the ranks).
#[cfg(feature = "mpi")]
pub fn init_mpi(cfg: Config) -> Result<ProcessGroup> {
    cfg.validate()?;
    let comm = crate::mpi::Comm::world(cfg.timeout)?;
    Ok(ProcessGroup::from_mpi(comm, cfg))
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(_cfg: Config) -> Result<ProcessGroup> {
    unreachable!("BackendKind::from_env never picks MPI without the feature")
}

/// Initialise the world group from an explicit environment.
pub fn init_with(env: &DistEnv, cfg: Config) -> Result<ProcessGroup> {
    init_kind(env, cfg, BackendKind::Native)
}

/// [`init_with`] on the native transports or NCCL (which also connects
/// the native mesh, for point-to-point messages).
fn init_kind(env: &DistEnv, mut cfg: Config, kind: BackendKind) -> Result<ProcessGroup> {
    cfg.validate()?;
    cfg.spans_hosts |= env.local_world_size < env.world_size;
    let mut addr = host_port(&env.master_addr, env.master_port);
    let deadline = std::time::Instant::now() + cfg.timeout;
    // A single-host job without PHALANX_SECRET: rank 0 makes the secret,
    // the others read it (see `secret_file`); alone, nobody needs one.
    let file = env.secret_file.as_deref().filter(|_| env.world_size > 1);
    let mut secret = match file {
        None if env.secret.is_empty() => wire::random_bytes(32),
        None => env.secret.clone(),
        Some(f) if env.rank == 0 => secret_file::create(f)?,
        Some(f) => secret_file::wait_read(f, env.rank, deadline)?,
    };
    let mut keep: Vec<Box<dyn std::any::Any + Send + Sync>> = Vec::new();
    if let (Some(f), 0) = (file, env.rank) {
        keep.push(Box::new(secret_file::RemoveOnDrop(f.to_path_buf())));
    }
    if !env.agent_store && !env.store_hosted && env.rank == 0 && env.world_size > 1 {
        // A single-host job's store is reachable from this host only.
        let bind = if is_loopback(&env.master_addr) {
            addr.clone()
        } else {
            any_interface(&env.master_addr, env.master_port)
        };
        keep.push(Box::new(StoreServer::bind(&bind, secret.clone())?));
    } else if !env.agent_store && !env.store_hosted && env.world_size == 1 {
        // Alone (a process started by hand, `mpirun -np 1` on the native
        // backend): a store of its own on a free loopback port, rather
        // than waiting PHALANX_TIMEOUT for one at MASTER_ADDR:MASTER_PORT
        // that nobody serves.
        let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
        addr = server.addr().to_string();
        keep.push(Box::new(server));
    }
    let left = || deadline.saturating_duration_since(std::time::Instant::now());
    let store = loop {
        let r = if env.agent_store {
            StoreClient::connect_torch(&addr, cfg.timeout)
        } else {
            StoreClient::connect(&addr, &secret, left())
        };
        match (r, file) {
            // Read before rank 0 replaced a stale file: read it again.
            (Err(CommError::Auth(_)), Some(f)) if env.rank != 0 && !left().is_zero() => {
                std::thread::sleep(std::time::Duration::from_millis(100));
                secret = secret_file::wait_read(f, env.rank, deadline)?;
            }
            (r, _) => break r,
        }
    }
    .map_err(|e| match e {
        CommError::Timeout(m) => CommError::Timeout(format!("rank {}: {m}", env.rank)),
        e => e,
    })?;
    let prefix = format!("phalanx/{}", env.run_id);
    if let (Some(f), true) = (file, env.agent_store) {
        secret = agree_on_secret(&store, &prefix, env.rank, f, secret, deadline)?;
    }
    let keep: Option<Arc<dyn std::any::Any + Send + Sync>> =
        (!keep.is_empty()).then(|| Arc::new(keep) as Arc<dyn std::any::Any + Send + Sync>);
    #[cfg(feature = "nccl")]
    if kind == BackendKind::Nccl {
        let b = crate::nccl::world(
            &store,
            &prefix,
            env.rank,
            env.world_size,
            env.local_rank,
            &secret,
            &cfg,
        )?;
        return Ok(ProcessGroup::from_backend(
            b,
            env.world_size,
            env.rank,
            cfg,
            keep,
        ));
    }
    debug_assert_eq!(kind, BackendKind::Native);
    from_store(
        &store,
        &prefix,
        env.rank,
        env.world_size,
        &secret,
        cfg,
        keep,
    )
}

/// Under torchrun's (unauthenticated) agent store: rank 0 publishes its
/// secret's fingerprint, and the others read the file until theirs matches
/// (a file of an earlier attempt may still have been there).
fn agree_on_secret(
    store: &StoreClient,
    prefix: &str,
    rank: usize,
    file: &std::path::Path,
    mut secret: Vec<u8>,
    deadline: std::time::Instant,
) -> Result<Vec<u8>> {
    let key = format!("{prefix}/secret_fingerprint");
    if rank == 0 {
        store.set(&key, secret_file::fingerprint(&secret).as_bytes())?;
        return Ok(secret);
    }
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    store.wait(&[&key], left)?;
    let want = store.get(&key)?;
    while secret_file::fingerprint(&secret).as_bytes() != want.as_slice() {
        if std::time::Instant::now() >= deadline {
            return Err(CommError::Timeout(format!(
                "rank {rank}: the job secret in {} is not rank 0's",
                file.display()
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        secret = secret_file::wait_read(file, rank, deadline)?;
    }
    Ok(secret)
}

/// Build the world group through an existing store connection.
pub fn from_store(
    store: &StoreClient,
    prefix: &str,
    rank: usize,
    world: usize,
    secret: &[u8],
    cfg: Config,
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
) -> Result<ProcessGroup> {
    cfg.validate()?;
    let t = connect_mesh(store, prefix, rank, world, secret, &cfg)?;
    Ok(ProcessGroup::from_transport(t, cfg, keep))
}

#[cfg(test)]
mod tests {
    use super::first_host;

    /// A process alone needs no store at MASTER_ADDR:MASTER_PORT: nobody
    /// serves one there (here: a port with nothing behind it).
    #[test]
    fn a_world_of_one_starts_without_a_store_to_meet_at() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = super::DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            secret: Vec::new(),
            secret_file: None,
            store_hosted: false,
            agent_store: false,
            source: "single",
            run_id: "0".into(),
        };
        let cfg = crate::Config {
            timeout: std::time::Duration::from_secs(2),
            ..crate::Config::default()
        };
        let pg = super::init_with(&env, cfg).unwrap();
        let mut x = [3.0f32];
        pg.all_reduce(&mut x, crate::ReduceOp::Sum).unwrap();
        assert_eq!((pg.size(), x[0]), (1, 3.0));
    }

    /// A job whose ranks are not all on this host must name rank 0's host:
    /// the loopback default would leave every other host's ranks waiting
    /// for a store on their own loopback.
    #[test]
    fn a_job_across_hosts_without_master_addr_is_refused() {
        let env = |vars: &[(&str, &str)]| {
            super::DistEnv::from_vars(|k| {
                vars.iter()
                    .chain(&[("PHALANX_SECRET", "00112233445566778899aabbccddeeff")])
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let across = [
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
        ];
        let e = env(&across).unwrap_err().to_string();
        assert!(
            e.contains("MASTER_ADDR is not set, but only 2 of this torchrun job's 4 ranks"),
            "{e}"
        );
        let named = env(&[across.as_slice(), &[("MASTER_ADDR", "node0")]].concat()).unwrap();
        assert_eq!(named.master_addr, "node0");
        // All ranks here: loopback, as torchrun's single-node jobs have it.
        let here = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(here.master_addr, "127.0.0.1");
    }

    /// `JobSizes::from_vars` over these variables (the rest unset).
    fn sizes(vars: &[(&str, &str)]) -> crate::Result<super::JobSizes> {
        super::JobSizes::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    fn err(vars: &[(&str, &str)]) -> String {
        match sizes(vars) {
            Ok(s) => panic!("{vars:?} accepted: {s:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// Half of torchrun's pair, or a torchrun pair with fewer ranks than
    /// the launcher around it started (a stale pair: each task would train
    /// alone, exit 0), is refused naming the variables; torchrun nested
    /// under mpirun or srun (more ranks than outer tasks) is read as
    /// torchrun's.
    #[test]
    fn half_or_stale_launcher_variables_are_refused() {
        assert!(err(&[("WORLD_SIZE", "4")]).contains("WORLD_SIZE is set but RANK is not"));
        assert!(err(&[("RANK", "0")]).contains("RANK is set but WORLD_SIZE is not"));
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert!(
            e.contains("torchrun's WORLD_SIZE=1 but mpirun's OMPI_COMM_WORLD_SIZE=2"),
            "{e}"
        );
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert!(e.contains("srun's SLURM_NTASKS=2"), "{e}");
        // torchrun under srun, 4 workers on each of 2 nodes.
        let nested = sizes(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        assert_eq!(
            (nested.rank, nested.world_size, nested.source),
            (5, 8, "torchrun")
        );
        // An sbatch shell's allocation (no step) is no launcher.
        let shell = sizes(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("SLURM_NTASKS", "8")]).unwrap();
        assert_eq!(shell.world_size, 1);
    }

    /// A launcher's per-node counts are read strictly (only Slurm's
    /// "4(x2)" loosely): a malformed or impossible one is refused, naming
    /// the variable, instead of being taken as unset or as given.
    #[test]
    fn local_sizes_out_of_range_are_refused_naming_the_variable() {
        let torch = |lws: &'static str| {
            [
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", lws),
            ]
        };
        for bad in ["abc", "-1"] {
            let e = err(&torch(bad));
            assert!(e.contains(&format!("LOCAL_WORLD_SIZE={bad}")), "{e}");
        }
        for bad in ["0", "3"] {
            let e = err(&torch(bad));
            assert!(
                e.contains(&format!("LOCAL_WORLD_SIZE={bad} is out of range")),
                "{e}"
            );
            assert!(e.contains("WORLD_SIZE=2"), "{e}");
        }
        let ok = sizes(&torch("2")).unwrap();
        assert_eq!((ok.local_world_size, ok.local_known), (2, true));
        // No LOCAL_RANK: the rank's place on its node (one process per
        // pod: 0, not the global rank, which would pick a GPU it lacks).
        let pod = sizes(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "1"),
        ])
        .unwrap();
        assert_eq!(pod.local_rank, 0);
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(
            e.contains("LOCAL_RANK=2 is out of range") && e.contains("LOCAL_WORLD_SIZE=2"),
            "{e}"
        );
        // Without a local world size, the local rank is bounded by the world.
        let e = err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "5")]);
        assert!(
            e.contains("LOCAL_RANK=5") && e.contains("WORLD_SIZE=2"),
            "{e}"
        );
        let e = err(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "0"),
        ]);
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_SIZE=0"), "{e}");
        // Slurm's counts, loosely: the leading number; none, unknown.
        let slurm = |per_node: &'static str| {
            sizes(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_NTASKS_PER_NODE", per_node),
                ("SLURM_STEP_ID", "0"),
            ])
            .unwrap()
        };
        assert_eq!(slurm("4(x2)").local_world_size, 4);
        assert_eq!(slurm("4,2").local_world_size, 4);
        let unknown = slurm("(x2)");
        assert_eq!((unknown.local_world_size, unknown.local_known), (8, false));
        // A local id past the whole step is refused, naming both.
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert!(
            e.contains("SLURM_LOCALID=5 is out of range") && e.contains("SLURM_NTASKS=1"),
            "{e}"
        );
    }

    /// A rank past its world names both variables.
    #[test]
    fn a_rank_out_of_range_names_its_variables() {
        let e = err(&[("RANK", "1"), ("WORLD_SIZE", "1")]);
        assert!(
            e.contains("torchrun: RANK=1 is out of range for WORLD_SIZE=1"),
            "{e}"
        );
        let e = err(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert!(
            e.contains("OMPI_COMM_WORLD_RANK=3 is out of range for OMPI_COMM_WORLD_SIZE=2"),
            "{e}"
        );
    }

    /// A world size beyond any job (a typo) is refused before rank 0 sizes
    /// its tables by it.
    #[test]
    fn a_world_size_beyond_the_cap_is_refused() {
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "1099511627776")]);
        assert!(e.contains("WORLD_SIZE=1099511627776 is too large"), "{e}");
        assert!(e.contains(&super::MAX_WORLD_SIZE.to_string()), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2000000"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert!(e.contains("SLURM_NTASKS=2000000"), "{e}");
        let cap = super::MAX_WORLD_SIZE.to_string();
        let ok = sizes(&[
            ("RANK", "0"),
            ("WORLD_SIZE", &cap),
            ("LOCAL_WORLD_SIZE", "8"),
        ])
        .unwrap();
        assert_eq!(ok.world_size, super::MAX_WORLD_SIZE);
    }

    /// MASTER_PORT=0 would have the ranks that connect wait for a store at
    /// port 0: refused, except for a process alone (its own store).
    #[test]
    fn master_port_zero_is_refused_for_a_job_of_several_ranks() {
        let env = |vars: &[(&str, &str)]| {
            super::DistEnv::from_vars(|k| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let secret = ("PHALANX_SECRET", "00112233445566778899aabbccddeeff");
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "0"),
            secret,
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT=0"), "{e}");
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "0"),
            ("PHALANX_STORE_HOSTED", "1"),
            secret,
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT=0"), "{e}");
        let alone = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")]).unwrap();
        assert_eq!(alone.master_port, 0);
        let two = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "29511"),
            secret,
        ])
        .unwrap();
        assert_eq!((two.master_port, two.world_size), (29511, 2));
    }

    #[test]
    fn first_host_of_slurm_node_lists() {
        assert_eq!(first_host("gpu[003-005,9],cpu1").as_deref(), Some("gpu003"));
        assert_eq!(first_host("node7").as_deref(), Some("node7"));
        assert_eq!(first_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(first_host("n[12,14]").as_deref(), Some("n12"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("n[]"), None);
    }
}
