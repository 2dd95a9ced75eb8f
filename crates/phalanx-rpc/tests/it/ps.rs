//! The parameter server: synchronous mode is exactly single-process SGD
//! (bit for bit, both optimizers); bounded staleness never lets a trainer
//! run more than s steps ahead of the slowest; asynchronous mode trains.

use phalanx_rpc::ps::ctr::CtrSpec;
use phalanx_rpc::ps::{Optim, PsClient, PsConfig, Server, ServerStats};
use phalanx_rpc::rpc::{Options, Registry, Rpc};
use std::collections::HashMap;
use std::time::Duration;

const SERVERS: usize = 2;
const TRAINERS: usize = 3;
const BATCH: usize = 16;

fn spec() -> CtrSpec {
    CtrSpec {
        fields: 3,
        vocab: 60,
        rows: 1000,
        dim: 4,
        seed: 7,
    }
}

struct Run {
    /// Per trainer, the loss of every step.
    losses: Vec<Vec<f32>>,
    /// The final rows of `ids` and the final dense vector.
    rows: Vec<f32>,
    dense: Vec<f32>,
    stats: Vec<ServerStats>,
}

/// Train on ranks as threads: servers first, then trainers; trainer `slow`
/// sleeps `delay` before every step.
fn distributed(cfg: PsConfig, steps: u64, ids: Vec<u64>, slow: usize, delay: Duration) -> Run {
    let spec = spec();
    let out = phalanx_comm::threads::run(SERVERS + TRAINERS, move |pg| {
        let r = pg.rank();
        let names: Vec<String> = (0..SERVERS).map(|j| format!("ps{j}")).collect();
        let mut reg = Registry::new();
        let name = if r < SERVERS {
            Server::new(cfg.clone(), r, SERVERS).serve(&mut reg);
            names[r].clone()
        } else {
            format!("t{}", r - SERVERS)
        };
        let opts = Options {
            threads: TRAINERS + 2,
            timeout: Duration::from_secs(60),
            ..Options::default()
        };
        let rpc = Rpc::start(&pg, &name, reg, opts).unwrap();
        let mut res = None;
        if r >= SERVERS {
            let t = r - SERVERS;
            let mut c = PsClient::new(rpc.clone(), &names, cfg.clone(), t).unwrap();
            let mut losses = Vec::new();
            for step in 0..steps {
                if t == slow {
                    std::thread::sleep(delay);
                }
                let b = spec.batch(t as u64, step, BATCH);
                let p = c.pull(&[&b.ids]).unwrap();
                let g = spec.grads(&b, &p.rows[0], &p.dense[0]);
                losses.push(g.loss);
                c.push(&[(&g.ids, &g.rows)], &[g.dense]).unwrap();
            }
            let fin = c.pull_final(&[&ids]).unwrap();
            // Every trainer's final pull reaches the servers before any
            // trainer reads their counters (the barrier on the world group,
            // which the RPC agent does not use).
            pg.barrier().unwrap();
            let stats = c.server_stats().unwrap();
            res = Some((losses, fin.rows[0].clone(), fin.dense[0].clone(), stats));
        } else {
            // The servers join the barrier; their handlers run meanwhile.
            pg.barrier().unwrap();
        }
        rpc.shutdown().unwrap();
        res
    });
    let mut run = Run {
        losses: Vec::new(),
        rows: Vec::new(),
        dense: Vec::new(),
        stats: Vec::new(),
    };
    for (losses, rows, dense, stats) in out.into_iter().flatten() {
        run.losses.push(losses);
        run.rows = rows;
        run.dense = dense;
        run.stats = stats;
    }
    run
}

/// The same training in one process: each step, every trainer's gradient
/// on the same parameters, summed in trainer order, scaled, applied.
fn single_process(cfg: &PsConfig, steps: u64, ids: &[u64]) -> Run {
    let spec = spec();
    let acc0 = match cfg.optim {
        Optim::Sgd { .. } => 0.0,
        Optim::Adagrad { init_acc, .. } => init_acc,
    };
    let mut rows: HashMap<u64, (Vec<f32>, Vec<f32>)> = HashMap::new();
    let row = |rows: &mut HashMap<u64, (Vec<f32>, Vec<f32>)>, id: u64| {
        rows.entry(id)
            .or_insert_with(|| (cfg.init_row(0, id), vec![acc0; spec.dim]))
            .0
            .clone()
    };
    let mut dense = cfg.dense[0].1.clone();
    let mut dacc = vec![acc0; dense.len()];
    let mut losses = vec![Vec::new(); TRAINERS];
    let scale = 1.0 / TRAINERS as f32;
    for step in 0..steps {
        let mut all = Vec::new();
        for (t, l) in losses.iter_mut().enumerate() {
            let b = spec.batch(t as u64, step, BATCH);
            let r: Vec<f32> = b.ids.iter().flat_map(|&id| row(&mut rows, id)).collect();
            let g = spec.grads(&b, &r, &dense);
            l.push(g.loss);
            all.push(g);
        }
        let mut sums: HashMap<u64, Vec<f32>> = HashMap::new();
        for g in &all {
            for (i, id) in g.ids.iter().enumerate() {
                let gi = &g.rows[i * spec.dim..(i + 1) * spec.dim];
                match sums.get_mut(id) {
                    Some(s) => s.iter_mut().zip(gi).for_each(|(s, g)| *s += g),
                    None => {
                        sums.insert(*id, gi.to_vec());
                    }
                }
            }
        }
        for (id, s) in sums {
            let g: Vec<f32> = s.iter().map(|s| s * scale).collect();
            let (w, a) = rows.get_mut(&id).unwrap();
            cfg.optim.apply(w, a, &g);
        }
        let mut ds = all[0].dense.clone();
        for g in &all[1..] {
            ds.iter_mut().zip(&g.dense).for_each(|(s, g)| *s += g);
        }
        let g: Vec<f32> = ds.iter().map(|s| s * scale).collect();
        cfg.optim.apply(&mut dense, &mut dacc, &g);
    }
    let final_rows = ids.iter().flat_map(|&id| row(&mut rows, id)).collect();
    Run {
        losses,
        rows: final_rows,
        dense,
        stats: Vec::new(),
    }
}

fn touched(steps: u64) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..TRAINERS as u64)
        .flat_map(|t| (0..steps).flat_map(move |s| spec().batch(t, s, BATCH).ids))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// A server whose pool has no thread left for the push its waiting pulls
/// need (threads < trainers: all but the slowest trainer wait in a pull)
/// stalled every step until the pulls' wait limit; it is refused at start,
/// naming the setting, and its peers fail at once with the reason.
#[test]
fn a_pool_too_small_for_the_trainers_is_refused_at_start() {
    let cfg = spec().ps_config(TRAINERS, Optim::Sgd { lr: 0.5 }, Some(0));
    let out = phalanx_comm::threads::run(1 + TRAINERS, move |pg| {
        let mut reg = Registry::new();
        if pg.rank() == 0 {
            Server::new(cfg.clone(), 0, 1).serve(&mut reg);
        }
        let opts = Options {
            threads: TRAINERS - 1,
            timeout: Duration::from_secs(60),
            ..Options::default()
        };
        let t = std::time::Instant::now();
        let name = format!("w{}", pg.rank());
        let e = Rpc::start(&pg, &name, reg, opts)
            .err()
            .map(|e| e.to_string());
        (e, t.elapsed())
    });
    let want = format!("Options::threads = {} is too few", TRAINERS - 1);
    for (r, (e, took)) in out.into_iter().enumerate() {
        let e = e.unwrap_or_else(|| panic!("rank {r} started"));
        assert!(e.contains(&want), "rank {r}: {e}");
        assert!(e.contains(&format!("at least {TRAINERS}")), "rank {r}: {e}");
        assert!(took < Duration::from_secs(20), "rank {r}: {took:?}");
    }
}

#[test]
fn synchronous_mode_is_exactly_single_process_sgd() {
    let steps = 12;
    let ids = touched(steps);
    let adagrad = Optim::Adagrad {
        lr: 0.3,
        init_acc: 0.1,
        eps: 1e-8,
    };
    for optim in [Optim::Sgd { lr: 0.5 }, adagrad] {
        let cfg = spec().ps_config(TRAINERS, optim, Some(0));
        let d = distributed(cfg.clone(), steps, ids.clone(), 0, Duration::ZERO);
        let s = single_process(&cfg, steps, &ids);
        assert_eq!(d.losses, s.losses, "{optim:?}");
        assert_eq!(d.dense, s.dense, "{optim:?}");
        assert_eq!(d.rows, s.rows, "{optim:?}");
        assert!(d.stats.iter().all(|st| st.max_lead == 0));
        // Training did something.
        assert_ne!(s.dense, cfg.dense[0].1);
    }
}

#[test]
fn bounded_staleness_keeps_every_trainer_within_s_steps() {
    for s in [1u64, 3] {
        let cfg = spec().ps_config(TRAINERS, Optim::Sgd { lr: 0.5 }, Some(s));
        let steps = 16;
        let d = distributed(cfg, steps, vec![1, 2], 2, Duration::from_millis(3));
        assert_eq!(d.stats.len(), SERVERS);
        for st in &d.stats {
            assert!(
                st.max_lead <= s,
                "staleness {s}: a trainer ran {} ahead",
                st.max_lead
            );
            // One pull and one push per trainer and step, plus final pulls.
            assert_eq!(st.pushes, TRAINERS as u64 * steps);
            assert_eq!(st.pulls, TRAINERS as u64 * (steps + 1));
        }
    }
}

#[test]
fn asynchronous_mode_trains() {
    let cfg = spec().ps_config(TRAINERS, Optim::Sgd { lr: 0.5 }, None);
    let steps = 40;
    let d = distributed(cfg, steps, vec![1], 2, Duration::from_millis(1));
    for l in &d.losses {
        let first: f32 = l[..10].iter().sum();
        let last: f32 = l[l.len() - 10..].iter().sum();
        assert!(last < first, "{l:?}");
    }
}

/// A push of a step the trainer pushed already (a retry after the push
/// failed on another shard, which leaves the trainer's step where it was)
/// is taken once: in every mode the gradient is applied once and the
/// server counts one push. It used to be applied twice (asynchronous,
/// bounded staleness) or left in a step that never fills (synchronous).
#[test]
fn a_repeated_push_of_a_step_is_applied_once() {
    use phalanx_rpc::ps::server::{PullReq, PushReq};
    use phalanx_rpc::rpc::Blob;
    for staleness in [None, Some(2), Some(0)] {
        let cfg = PsConfig::new(2, Optim::Sgd { lr: 1.0 }, staleness)
            .table("emb", 1, 0.0)
            .dense("w", vec![0.0]);
        let s = Server::new(cfg, 0, 1);
        let push = |trainer: u32, step: u64| PushReq {
            trainer,
            step,
            shard: [0, 1],
            ids: vec![Blob::from(vec![5u64])],
            grads: vec![Blob::from(vec![2.0f32])],
            dense: vec![Blob::from(vec![4.0f32])],
        };
        s.push(push(0, 0)).unwrap();
        s.push(push(0, 0)).unwrap(); // before the step is complete
        s.push(push(1, 0)).unwrap();
        s.push(push(0, 0)).unwrap(); // after
        s.push(push(0, 1)).unwrap();
        s.push(push(1, 1)).unwrap();
        let p = s
            .pull(PullReq {
                trainer: 0,
                step: 2,
                shard: [0, 1],
                ids: vec![Blob::from(vec![5u64])],
                wait_all: true,
            })
            .unwrap();
        // Four pushes of (2, 4), each scaled by 1/2, at a learning rate of 1.
        assert_eq!(p.rows[0].to_vec(), vec![-4.0], "staleness {staleness:?}");
        assert_eq!(p.dense[0].to_vec(), vec![-8.0], "staleness {staleness:?}");
        assert_eq!(s.stats().pushes, 4, "staleness {staleness:?}");
    }
}

/// A staleness bound of `u64::MAX` (any lead) lets every pull through; the
/// bound plus the slowest trainer's step used to wrap, and the pull waited
/// for a trainer it need not wait for.
#[test]
fn an_unbounded_staleness_does_not_wrap() {
    use phalanx_rpc::ps::server::PullReq;
    use phalanx_rpc::rpc::Blob;
    let cfg = PsConfig::new(2, Optim::Sgd { lr: 1.0 }, Some(u64::MAX))
        .table("emb", 1, 0.0)
        .dense("w", vec![0.0]);
    let mut s = Server::new(cfg, 0, 1);
    s.wait_limit = Duration::from_millis(100);
    let p = s.pull(PullReq {
        trainer: 0,
        step: 5,
        shard: [0, 1],
        ids: vec![Blob::from(vec![1u64])],
        wait_all: false,
    });
    assert!(p.is_ok(), "{:?}", p.err());
}

/// A request meant for another shard (a server list out of shard order, or
/// of another count) is refused by name: its dense block would be another.
#[test]
fn a_request_for_another_shard_is_refused() {
    use phalanx_rpc::ps::server::PullReq;
    use phalanx_rpc::rpc::Blob;
    let cfg = PsConfig::new(1, Optim::Sgd { lr: 1.0 }, None)
        .table("emb", 1, 0.0)
        .dense("w", vec![0.0; 4]);
    let s = Server::new(cfg, 1, 2);
    let pull = |shard| {
        s.pull(PullReq {
            trainer: 0,
            step: 0,
            shard,
            ids: vec![Blob::from(vec![1u64])],
            wait_all: false,
        })
    };
    for wrong in [[0, 2], [1, 3]] {
        let e = pull(wrong).err().expect("refused");
        assert!(e.contains("in shard order"), "{e}");
    }
    assert_eq!(pull([1, 2]).unwrap().dense[0].len(), 2);
}

/// After a push that failed on one server (and was taken by the other),
/// only the same push may follow: another would be applied on one shard
/// and dropped as a repeat on the other.
#[test]
fn after_a_failed_push_only_the_same_push_is_taken() {
    use phalanx_rpc::ps::server::{PullReq, PushReq};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let cfg = PsConfig::new(1, Optim::Sgd { lr: 1.0 }, None)
        .table("emb", 1, 0.0)
        .dense("w", vec![0.0; 2]);
    phalanx_comm::threads::run(3, move |pg| {
        let mut reg = Registry::new();
        let names = ["ps0".to_string(), "ps1".to_string()];
        let name = match pg.rank() {
            0 => {
                Server::new(cfg.clone(), 0, 2).serve(&mut reg);
                "ps0"
            }
            1 => {
                // Shard 1 fails its first push.
                let s = Arc::new(Server::new(cfg.clone(), 1, 2));
                let (a, b) = (s.clone(), s);
                let first = AtomicBool::new(true);
                reg.register_fallible("ps.pull", move |_c, r: PullReq| a.pull(r));
                reg.register_fallible("ps.push", move |_c, r: PushReq| {
                    if first.swap(false, Ordering::SeqCst) {
                        return Err("lost".to_string());
                    }
                    b.push(r)
                });
                "ps1"
            }
            _ => "t0",
        };
        let rpc = Rpc::start(&pg, name, reg, Options::default()).unwrap();
        if pg.rank() == 2 {
            let mut c = PsClient::new(rpc.clone(), &names, cfg.clone(), 0).unwrap();
            let (a, b) = (vec![1.0f32, 1.0], vec![5.0f32, 5.0]);
            assert!(c.push(&[(&[], &[])], std::slice::from_ref(&a)).is_err());
            let e = c.push(&[(&[], &[])], &[b]).unwrap_err();
            assert!(e.to_string().contains("push the same gradients"), "{e}");
            assert_eq!(c.step(), 0);
            c.push(&[(&[], &[])], &[a]).unwrap();
            assert_eq!(c.step(), 1);
            // Applied once on each shard.
            let p = c.pull_final(&[&[]]).unwrap();
            assert_eq!(p.dense[0], vec![-1.0, -1.0]);
        }
        pg.barrier().unwrap();
        rpc.shutdown().unwrap();
    });
}
