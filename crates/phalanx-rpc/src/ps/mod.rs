//! A parameter server over `phalanx_rpc::rpc`: parameters sharded over k
//! server workers, trainers that pull what they need and push gradients,
//! the optimizer applied on the servers.
//!
//! Parameters are sparse embedding tables (rows made on first touch, so a
//! table of 2^24 hashed ids costs only the rows seen) and dense vectors.
//! Row `id` lives on server `shard_of(id, k)`; a dense vector is cut into
//! k contiguous blocks, block j on server j. Servers apply SGD or Adagrad
//! (the usual choice for sparse embeddings: rare ids keep large steps).
//!
//! Consistency (`staleness`):
//! - `Some(0)`, synchronous: a server applies step t once every trainer
//!   pushed it, summing the trainers' gradients in trainer order, and
//!   serves pulls of step t+1 only after that. This is exactly SGD on the
//!   union of the trainers' batches (tested bit for bit).
//! - `Some(s)`, bounded staleness (stale-synchronous parallel): pushes
//!   apply as they arrive; a pull for step t waits until the slowest
//!   trainer has pushed step t-s-1, so no trainer runs more than s steps
//!   ahead of the slowest.
//! - `None`, asynchronous: pushes apply as they arrive, pulls never wait.
//!
//! Every gradient is scaled by 1/trainers, so a learning rate means the
//! same in every mode (one synchronous step = the mean gradient).
//!
//! ```
//! use phalanx_rpc::ps::{PsConfig, Optim, Server, PsClient};
//! use phalanx_rpc::rpc::{Registry, Rpc, Options};
//! let cfg = PsConfig::new(1, Optim::Sgd { lr: 0.5 }, Some(0))
//!     .table("emb", 2, 0.0)
//!     .dense("w", vec![1.0, 1.0]);
//! let out = phalanx_comm::threads::run(2, move |pg| {
//!     let mut reg = Registry::new();
//!     let servers = vec!["ps0".to_string()];
//!     if pg.rank() == 0 {
//!         Server::new(cfg.clone(), 0, 1).serve(&mut reg);
//!     }
//!     let name = if pg.rank() == 0 { "ps0" } else { "trainer0" };
//!     let rpc = Rpc::start(&pg, name, reg, Options::default()).unwrap();
//!     let mut w = vec![];
//!     if pg.rank() == 1 {
//!         let mut c = PsClient::new(rpc.clone(), &servers, cfg.clone(), 0).unwrap();
//!         let p = c.pull(&[&[7]]).unwrap();
//!         assert_eq!(p.rows[0], vec![0.0, 0.0]);
//!         c.push(&[(&[7], &[1.0, -1.0])], &[vec![2.0, 0.0]]).unwrap();
//!         w = c.pull(&[&[7]]).unwrap().dense[0].clone();
//!     }
//!     rpc.shutdown().unwrap();
//!     w
//! });
//! assert_eq!(out[1], vec![0.0, 1.0]);
//! ```

pub mod client;
pub mod ctr;
pub mod server;

pub use client::{PsClient, Pulled};
pub use server::{Server, ServerStats};

use serde::{Deserialize, Serialize};

/// The optimizer the servers apply.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub enum Optim {
    Sgd {
        lr: f32,
    },
    /// Adagrad: per coordinate, acc += g^2; w -= lr * g / (sqrt(acc) + eps).
    Adagrad {
        lr: f32,
        init_acc: f32,
        eps: f32,
    },
}

impl Optim {
    /// One update of `w` with gradient `g` (already summed and scaled);
    /// `acc` is Adagrad's accumulator (unused by SGD).
    pub fn apply(&self, w: &mut [f32], acc: &mut [f32], g: &[f32]) {
        match *self {
            Optim::Sgd { lr } => {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Optim::Adagrad { lr, eps, .. } => {
                for ((w, a), g) in w.iter_mut().zip(acc.iter_mut()).zip(g) {
                    *a += g * g;
                    *w -= lr * g / (a.sqrt() + eps);
                }
            }
        }
    }

    fn init_acc(&self) -> f32 {
        match *self {
            Optim::Sgd { .. } => 0.0,
            Optim::Adagrad { init_acc, .. } => init_acc,
        }
    }
}

/// A sparse table: rows of `dim` values, initialised on first touch
/// uniformly in ±`init_scale` from the row id (the same on any server).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TableSpec {
    pub name: String,
    pub dim: usize,
    pub init_scale: f32,
}

/// What the servers hold and how they update it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PsConfig {
    pub trainers: usize,
    pub optim: Optim,
    /// `Some(0)` synchronous, `Some(s)` bounded staleness, `None` asynchronous.
    pub staleness: Option<u64>,
    pub tables: Vec<TableSpec>,
    /// Dense vectors with their initial values.
    pub dense: Vec<(String, Vec<f32>)>,
    pub seed: u64,
}

impl PsConfig {
    pub fn new(trainers: usize, optim: Optim, staleness: Option<u64>) -> PsConfig {
        PsConfig {
            trainers,
            optim,
            staleness,
            tables: Vec::new(),
            dense: Vec::new(),
            seed: 0,
        }
    }
    pub fn table(mut self, name: &str, dim: usize, init_scale: f32) -> Self {
        self.tables.push(TableSpec {
            name: name.into(),
            dim,
            init_scale,
        });
        self
    }
    pub fn dense(mut self, name: &str, init: Vec<f32>) -> Self {
        self.dense.push((name.into(), init));
        self
    }
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The initial value of row `id` of table `t`.
    pub fn init_row(&self, t: usize, id: u64) -> Vec<f32> {
        let spec = &self.tables[t];
        let mut s = mix(self.seed ^ mix(t as u64 + 1) ^ mix(id.wrapping_add(0x51)));
        (0..spec.dim)
            .map(|_| {
                s = mix(s);
                (unit(s) * 2.0 - 1.0) * spec.init_scale
            })
            .collect()
    }
}

/// The server (of `k`) that holds row `id`.
pub fn shard_of(id: u64, k: usize) -> usize {
    (mix(id) % k as u64) as usize
}

/// Block j of k of a dense vector of length n: `[start, end)`.
pub fn block(n: usize, k: usize, j: usize) -> (usize, usize) {
    let (q, r) = (n / k, n % k);
    let start = j * q + j.min(r);
    (start, start + q + usize::from(j < r))
}

/// splitmix64: a stable hash, the same in every process.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// A hash as a float in [0, 1).
pub fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 24) as f32
}
