//! Starting a process group from the environment, the way torchrun, mpirun
//! and srun start processes.
//!
//! | launcher | rank | world size | local rank | local world size |
//! |---|---|---|---|---|
//! | `phalanx run` / torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | Slurm `srun` | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_NTASKS_PER_NODE` |
//!
//! The store lives at `MASTER_ADDR:MASTER_PORT` (defaults 127.0.0.1:29500).
//! `phalanx run` hosts it and sets `PHALANX_STORE_HOSTED=1`; otherwise rank 0
//! hosts it. The job secret comes from `PHALANX_SECRET` (hex).
//!
//! ```no_run
//! let pg = phalanx_comm::init_process_group().unwrap();
//! println!("rank {} of {}", pg.rank(), pg.size());
//! ```

use crate::config::Config;
use crate::error::{invalid, CommError, Result};
use crate::group::ProcessGroup;
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
    pub secret: Vec<u8>,
    /// True when a launcher already serves the store.
    pub store_hosted: bool,
    /// Which launcher's variables were found.
    pub source: &'static str,
    /// Namespace for store keys (changes on every restart of the job).
    pub run_id: String,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn num(name: &str) -> Result<Option<usize>> {
    match var(name) {
        None => Ok(None),
        Some(v) => {
            v.trim().parse::<usize>().map(Some).map_err(|_| {
                invalid!("environment variable {name}={v} is not a non-negative integer")
            })
        }
    }
}

impl DistEnv {
    /// Read the launcher's variables; a process started by hand is rank 0 of 1.
    pub fn from_env() -> Result<DistEnv> {
        let schemes: [(&str, [&str; 4]); 3] = [
            (
                "torchrun",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            ),
            (
                "mpirun",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
            (
                "srun",
                [
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                ],
            ),
        ];
        let mut found = None;
        for (name, keys) in schemes {
            if let (Some(r), Some(w)) = (num(keys[0])?, num(keys[1])?) {
                let lr = num(keys[2])?.unwrap_or(r);
                // SLURM_NTASKS_PER_NODE may read "4(x2)": take the leading number.
                let lw = var(keys[3])
                    .and_then(|v| {
                        v.split(|c: char| !c.is_ascii_digit())
                            .next()
                            .and_then(|s| s.parse().ok())
                    })
                    .unwrap_or(w);
                found = Some((name, r, w, lr, lw));
                break;
            }
        }
        let (source, rank, world_size, local_rank, local_world_size) =
            found.unwrap_or(("single", 0, 1, 0, 1));
        if world_size == 0 || rank >= world_size {
            return Err(invalid!(
                "{source}: rank {rank} is out of range for world size {world_size}"
            ));
        }
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match var("MASTER_PORT") {
            None => 29500,
            Some(p) => p
                .parse()
                .map_err(|_| invalid!("MASTER_PORT={p} is not a port number"))?,
        };
        let store_hosted = var("PHALANX_STORE_HOSTED").as_deref() == Some("1");
        let secret = match var("PHALANX_SECRET") {
            Some(h) => wire::from_hex(&h).ok_or_else(|| invalid!("PHALANX_SECRET is not hex"))?,
            None if store_hosted => {
                return Err(invalid!(
                    "PHALANX_STORE_HOSTED is set but PHALANX_SECRET is missing"
                ))
            }
            None => {
                // mpirun/srun without a secret: derive one from the job id, so
                // stray processes of other jobs cannot join by accident.
                let job = var("OMPI_MCA_ess_base_jobid")
                    .or_else(|| var("SLURM_JOB_ID"))
                    .unwrap_or_default();
                if world_size > 1 {
                    eprintln!(
                        "[phalanx] PHALANX_SECRET is not set; using a key derived from the job id. \
                         Export PHALANX_SECRET (e.g. `openssl rand -hex 32`) for real authentication."
                    );
                }
                format!("phalanx-job-{job}-{master_addr}-{master_port}").into_bytes()
            }
        };
        let run_id = var("PHALANX_RUN_ID").unwrap_or_else(|| "0".into());
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            secret,
            store_hosted,
            source,
            run_id,
        })
    }
}

/// Initialise the world group from the environment (see the module docs).
pub fn init_process_group() -> Result<ProcessGroup> {
    let env = DistEnv::from_env()?;
    init_with(&env, Config::from_env())
}

/// Initialise the world group from an explicit environment.
pub fn init_with(env: &DistEnv, cfg: Config) -> Result<ProcessGroup> {
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let mut keep: Option<Arc<dyn std::any::Any + Send + Sync>> = None;
    if !env.store_hosted && env.rank == 0 && env.world_size > 1 {
        let loopback = matches!(env.master_addr.as_str(), "127.0.0.1" | "localhost" | "::1");
        let bind = if loopback {
            addr.clone()
        } else {
            format!("0.0.0.0:{}", env.master_port)
        };
        keep = Some(Arc::new(StoreServer::bind(&bind, env.secret.clone())?));
    }
    let store = StoreClient::connect(&addr, &env.secret, cfg.timeout).map_err(|e| match e {
        CommError::Timeout(m) => CommError::Timeout(format!("rank {}: {m}", env.rank)),
        e => e,
    })?;
    let prefix = format!("phalanx/{}", env.run_id);
    from_store(
        &store,
        &prefix,
        env.rank,
        env.world_size,
        &env.secret,
        cfg,
        keep,
    )
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
    let t = connect_mesh(store, prefix, rank, world, secret, &cfg)?;
    Ok(ProcessGroup::from_transport(t, cfg, keep))
}
