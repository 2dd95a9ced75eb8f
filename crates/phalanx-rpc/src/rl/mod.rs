//! Distributed reinforcement learning over `phalanx_rpc::rpc`, the way
//! PyTorch's RPC tutorial splits it: observers own copies of the
//! environment and step them; one learner owns the policy and improves it.
//!
//! The learner sends the current policy to every observer (`rpc_async`);
//! each observer plays one episode of its own cart-pole with it, sampling
//! actions, and sends the trajectory back. The learner takes a REINFORCE
//! step with a learned state-value baseline (advantage = return - V(s),
//! normalised over the episodes of the step):
//! - asynchronously (the default): on each trajectory as it arrives, then
//!   sends that observer the newest policy at once, so observers play
//!   while the learner learns and more observers give more environment
//!   steps per second (an episode's policy may lag by up to observers - 1
//!   updates);
//! - or in synchronous rounds: one episode per observer with the same
//!   policy, one step on all of them, handled in observer order with
//!   episodes seeded by number, so a run is reproducible for a seed and an
//!   observer count.
//!
//! ```
//! use phalanx_rpc::rl::{self, LearnerConfig};
//! use phalanx_rpc::rpc::{Options, Registry, Rpc};
//! let out = phalanx_comm::threads::run(2, |pg| {
//!     let mut reg = Registry::new();
//!     rl::serve_observer(&mut reg);
//!     let name = if pg.rank() == 0 { "learner".to_string() } else { format!("observer{}", pg.rank()) };
//!     let rpc = Rpc::start(&pg, &name, reg, Options::default()).unwrap();
//!     let mut n = 0;
//!     if pg.rank() == 0 {
//!         let cfg = LearnerConfig { max_episodes: 5, ..LearnerConfig::default() };
//!         n = rl::learn(&rpc, &["observer1".to_string()], &cfg).unwrap().returns.len();
//!     }
//!     rpc.shutdown().unwrap();
//!     n
//! });
//! assert_eq!(out[0], 5);
//! ```

pub mod cartpole;
pub mod mlp;

use crate::ps::mix;
use crate::rpc::{Blob, Registry, Rpc, RpcFuture, RpcResult};
use cartpole::CartPole;
use mlp::{softmax, Adam, Mlp};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A small reproducible generator (splitmix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        mix(self.0)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Play one episode with this policy (a 4-`hidden`-2 `Mlp`'s parameters).
/// With `value` (a 4-`hidden`-1 baseline's parameters) the observer also
/// computes the episode's gradients itself (actor-critic style, as A3C's
/// actors do), so that the learner only applies them.
#[derive(Serialize, Deserialize)]
pub struct EpisodeReq {
    pub policy: Blob<f32>,
    pub value: Option<Blob<f32>>,
    pub hidden: u32,
    pub gamma: f32,
    pub seed: u64,
}

/// What an observer saw and did.
#[derive(Serialize, Deserialize)]
pub struct Trajectory {
    /// Four values per step: the state the action was chosen in.
    pub states: Blob<f32>,
    pub actions: Vec<u8>,
    /// The policy's and the baseline's gradients, when asked for.
    pub grads: Option<(Blob<f32>, Blob<f32>)>,
}

impl Trajectory {
    /// The return: one per step survived.
    pub fn ret(&self) -> f32 {
        self.actions.len() as f32
    }
}

fn mlp_of(params: &[f32], hidden: usize, outputs: usize) -> Result<Mlp, String> {
    let want = hidden * 4 + hidden + outputs * hidden + outputs;
    if params.len() != want {
        return Err(format!(
            "a 4-{hidden}-{outputs} network has {want} parameters, not {}",
            params.len()
        ));
    }
    Ok(Mlp {
        inputs: 4,
        hidden,
        outputs,
        params: params.to_vec(),
    })
}

/// Play an episode: reset from `seed`, sample actions from the policy.
pub fn play(req: &EpisodeReq) -> Result<Trajectory, String> {
    let nh = req.hidden as usize;
    let policy = mlp_of(&req.policy, nh, 2)?;
    let mut rng = Rng::new(req.seed);
    let mut env = CartPole::reset(&mut rng);
    let (mut h, mut z, mut p) = (Vec::new(), Vec::new(), Vec::new());
    let mut states = Vec::with_capacity(4 * cartpole::MAX_STEPS);
    let mut actions = Vec::with_capacity(cartpole::MAX_STEPS);
    loop {
        policy.forward(&env.state, &mut h, &mut z);
        softmax(&z, &mut p);
        let a = usize::from(rng.uniform() >= p[0]);
        states.extend_from_slice(&env.state);
        actions.push(a as u8);
        if env.step(a).1 {
            break;
        }
    }
    let mut t = Trajectory {
        states: Blob::from(states),
        actions,
        grads: None,
    };
    if let Some(v) = &req.value {
        let value = mlp_of(v, nh, 1)?;
        let (gp, gv) = gradients(&policy, &value, std::slice::from_ref(&t), req.gamma);
        t.grads = Some((Blob::from(gp), Blob::from(gv)));
    }
    Ok(t)
}

/// Make this worker an observer: it serves `rl.run_episode`.
pub fn serve_observer(reg: &mut Registry) {
    reg.register_fallible("rl.run_episode", |_c, req: EpisodeReq| play(&req));
}

#[derive(Clone, Debug)]
pub struct LearnerConfig {
    pub hidden: usize,
    /// Adam's learning rate, for the policy and the baseline.
    pub lr: f32,
    pub gamma: f32,
    pub max_episodes: usize,
    pub seed: u64,
    /// Stop as soon as the last 100 episodes average 195 or more.
    pub stop_when_solved: bool,
    /// Learn from each trajectory as it arrives (observers never wait for
    /// the learner; the policy an episode was played with may be up to
    /// `observers - 1` updates old), instead of in synchronous rounds.
    pub asynchronous: bool,
    /// Observers compute the gradients of their episodes (the learner only
    /// applies them), instead of sending trajectories for the learner to
    /// differentiate: the learner's work then no longer grows with the
    /// steps played, so more observers play more steps per second.
    pub observer_grads: bool,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            hidden: 32,
            lr: 0.005,
            gamma: 0.99,
            max_episodes: 2000,
            seed: 1,
            stop_when_solved: true,
            asynchronous: true,
            observer_grads: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Report {
    /// Every episode's return, in order.
    pub returns: Vec<f32>,
    pub env_steps: u64,
    pub seconds: f64,
    /// Episodes played when the last 100 first averaged 195 or more.
    pub solved_at: Option<usize>,
}

impl Report {
    /// Mean return of the last `n` episodes (fewer if fewer were played).
    pub fn mean_last(&self, n: usize) -> f32 {
        let tail = &self.returns[self.returns.len().saturating_sub(n)..];
        tail.iter().sum::<f32>() / tail.len().max(1) as f32
    }
}

/// Train a cart-pole policy with these observers (see the module docs).
pub fn learn(rpc: &Rpc, observers: &[String], cfg: &LearnerConfig) -> RpcResult<Report> {
    if observers.is_empty() {
        // No episode would ever come back to end the loop.
        return Err(crate::rpc::RpcError::Invalid(
            "rl::learn needs at least one observer".into(),
        ));
    }
    let mut rng = Rng::new(cfg.seed);
    let mut policy = Mlp::new(4, cfg.hidden, 2, &mut rng);
    let mut value = Mlp::new(4, cfg.hidden, 1, &mut rng);
    let mut popt = Adam::new(policy.params.len(), cfg.lr);
    let mut vopt = Adam::new(value.params.len(), cfg.lr);
    let mut report = Report {
        returns: Vec::new(),
        env_steps: 0,
        seconds: 0.0,
        solved_at: None,
    };
    let t0 = Instant::now();
    let mut sent = 0u64;
    let mut send = |policy: &Mlp, value: &Mlp, o: &str| {
        let req = EpisodeReq {
            policy: Blob::from(policy.params.clone()),
            value: cfg.observer_grads.then(|| Blob::from(value.params.clone())),
            hidden: cfg.hidden as u32,
            gamma: cfg.gamma,
            seed: mix(cfg.seed ^ mix(sent)),
        };
        sent += 1;
        rpc.rpc_async::<_, Trajectory>(o, "rl.run_episode", &req)
    };
    let record = |report: &mut Report, t: &Trajectory| {
        report.returns.push(t.ret());
        report.env_steps += t.actions.len() as u64;
        let n = report.returns.len();
        if report.solved_at.is_none() && n >= 100 && report.mean_last(100) >= cartpole::SOLVED {
            report.solved_at = Some(n);
        }
        let stop = cfg.stop_when_solved && report.solved_at.is_some();
        stop || n >= cfg.max_episodes
    };
    if cfg.asynchronous {
        // Every observer always has an episode to play; each trajectory is
        // learned from as it arrives, and its observer gets the newest
        // policy at once, so observers play while the learner learns.
        let mut futs: Vec<Option<RpcFuture<Trajectory>>> = observers
            .iter()
            .map(|o| Some(send(&policy, &value, o)))
            .collect();
        while let Some((i, t)) = crate::rpc::wait_any(&mut futs) {
            let t = t?;
            let (gp, gv) = match &t.grads {
                Some((gp, gv)) => (gp.to_vec(), gv.to_vec()),
                None => gradients(&policy, &value, std::slice::from_ref(&t), cfg.gamma),
            };
            popt.step(&mut policy.params, &gp);
            vopt.step(&mut value.params, &gv);
            if record(&mut report, &t) {
                break;
            }
            futs[i] = Some(send(&policy, &value, &observers[i]));
        }
    } else {
        // Rounds: every observer plays one episode with the same policy,
        // then one update on all of them (reproducible for a seed).
        'rounds: loop {
            let futs: Vec<RpcFuture<Trajectory>> =
                observers.iter().map(|o| send(&policy, &value, o)).collect();
            let trajs = futs
                .into_iter()
                .map(|f| f.wait())
                .collect::<RpcResult<Vec<_>>>()?;
            let (gp, gv) = if cfg.observer_grads {
                mean_of_observer_grads(&trajs)
            } else {
                gradients(&policy, &value, &trajs, cfg.gamma)
            };
            popt.step(&mut policy.params, &gp);
            vopt.step(&mut value.params, &gv);
            for t in &trajs {
                if record(&mut report, t) {
                    break 'rounds;
                }
            }
        }
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// The value net predicts returns divided by this (keeps its scale near 1).
const VALUE_SCALE: f32 = 100.0;

/// The mean of the observers' gradients, in observer order.
fn mean_of_observer_grads(trajs: &[Trajectory]) -> (Vec<f32>, Vec<f32>) {
    let mut it = trajs.iter().filter_map(|t| t.grads.as_ref());
    let (gp, gv) = it.next().expect("observers sent gradients");
    let (mut gp, mut gv) = (gp.to_vec(), gv.to_vec());
    for (p, v) in it {
        gp.iter_mut().zip(p.iter()).for_each(|(a, b)| *a += b);
        gv.iter_mut().zip(v.iter()).for_each(|(a, b)| *a += b);
    }
    let k = trajs.len() as f32;
    gp.iter_mut().chain(gv.iter_mut()).for_each(|g| *g /= k);
    (gp, gv)
}

/// REINFORCE with a learned baseline on some episodes: the gradients of
/// the policy loss -sum adv * log pi(a|s) (advantages normalised over the
/// episodes) and of the baseline's squared error, both averaged per step.
pub fn gradients(
    policy: &Mlp,
    value: &Mlp,
    trajs: &[Trajectory],
    gamma: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (mut h, mut z, mut p) = (Vec::new(), Vec::new(), Vec::new());
    // Discounted returns and advantages of every step of every episode.
    let mut steps: Vec<(&[f32], usize, f32, f32)> = Vec::new();
    for t in trajs {
        let n = t.actions.len();
        let mut g = vec![0.0f32; n];
        let mut acc = 0.0;
        for i in (0..n).rev() {
            acc = 1.0 + gamma * acc;
            g[i] = acc;
        }
        for (i, (&a, &ret)) in t.actions.iter().zip(&g).enumerate() {
            let s = &t.states[4 * i..4 * i + 4];
            value.forward(s, &mut h, &mut z);
            steps.push((s, a as usize, ret, ret - z[0] * VALUE_SCALE));
        }
    }
    let n = steps.len() as f32;
    let mean = steps.iter().map(|s| s.3).sum::<f32>() / n;
    let var = steps.iter().map(|s| (s.3 - mean).powi(2)).sum::<f32>() / n;
    let std = var.sqrt() + 1e-6;
    let mut gp = vec![0.0f32; policy.params.len()];
    let mut gv = vec![0.0f32; value.params.len()];
    for &(s, a, ret, adv) in &steps {
        let adv = (adv - mean) / std;
        policy.forward(s, &mut h, &mut z);
        softmax(&z, &mut p);
        // d(-adv * log p[a]) / dz = adv * (p - onehot(a)).
        let dz: Vec<f32> = (0..2)
            .map(|k| adv * (p[k] - f32::from(k == a)) / n)
            .collect();
        policy.backward(s, &h, &dz, &mut gp);
        value.forward(s, &mut h, &mut z);
        let dv = [(z[0] - ret / VALUE_SCALE) / n];
        value.backward(s, &h, &dv, &mut gv);
    }
    (gp, gv)
}
