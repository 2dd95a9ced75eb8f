//! Gradient compression hooks (`parallel.comm_hook`) under DDP: every rank
//! ends each step with identical parameters; the bytes per step follow the
//! theory; fp16 / bf16 / int8 track uncompressed training; top-k and
//! PowerSGD with error feedback get closer to uncompressed training than
//! without it; top-k sends its promised bytes after its DGC warm-up and a
//! falling fraction during it, to the byte; DGC (the warm-up with AdamW,
//! momentum correction with momentum SGD) gets top-k closer to
//! uncompressed training; DGC's keys are refused where they do not fit.
//! Resuming with a hook: `compression_resume.rs`.

use crate::common;
use common::*;
use phalanx_models::gpt2::train::{self, GptRun};

/// One rank's losses and final parameters.
type RankRun = (Vec<f32>, Vec<f32>);

/// Train `steps` steps on `world` ranks; every rank's (losses, parameters)
/// and the bytes rank 0 sent in its second step.
fn train_run(world: usize, steps: usize, extra: &[&str]) -> (Vec<RankRun>, u64) {
    train_run_with(phalanx_comm::Config::from_env(), world, steps, extra)
}

/// `train_run` with the process group configured by `comm`.
fn train_run_with(
    comm: phalanx_comm::Config,
    world: usize,
    steps: usize,
    extra: &[&str],
) -> (Vec<RankRun>, u64) {
    let mut e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    e.push(format!("train.steps={steps}"));
    let cfg = config(world, 1, &e);
    let loader = loader(cfg.seq_len().unwrap());
    let out: Vec<_> =
        phalanx_comm::threads::run_with(world, comm, phalanx_comm::threads::DEADLINE, move |pg| {
            let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
            let mut losses = Vec::new();
            let mut bytes = 0;
            for k in 0..steps {
                let s = t.step(k).unwrap();
                if k == 1 {
                    bytes = s.comm_bytes;
                }
                losses.push(s.loss);
            }
            Ok((losses, t.full_params().unwrap(), bytes))
        })
        .into_iter()
        .map(|r| r.expect("rank failed"))
        .collect();
    let bytes = out[0].2;
    (out.into_iter().map(|(l, p, _)| (l, p)).collect(), bytes)
}

/// PowerSGD's bytes relative to the uncompressed all-reduce, for the test
/// model: each matrix [n, m] (worth it: (n + m) r at most half of n m)
/// travels as (n + m) x r values (P, then Q, both all-reduced); the rest
/// travels whole.
fn powersgd_fraction(r: usize) -> f64 {
    let cfg = config(1, 1, &[]);
    let loader = loader(cfg.seq_len().unwrap());
    let layout = phalanx_comm::threads::run(1, move |pg| {
        let t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        t.engine().layout().clone()
    })
    .remove(0);
    let (mut sent, mut all) = (0usize, 0usize);
    for p in layout.params() {
        all += p.numel;
        let (n, m) = (p.shape[0], p.numel / p.shape[0]);
        let r = r.min(n).min(m);
        sent += if p.shape.len() >= 2 && (n + m) * r * 2 < n * m {
            (n + m) * r
        } else {
            p.numel
        };
    }
    sent as f64 / all as f64
}

fn last_loss(r: &[RankRun]) -> f32 {
    *r[0].0.last().unwrap()
}

#[test]
fn hooks_keep_ranks_identical_and_send_what_the_theory_says() {
    // The theory below is the ring's: pin the all-reduce algorithm (small
    // buckets would otherwise take recursive doubling, which moves other
    // byte counts). The process groups of these runs (and their subgroups)
    // take it from the Config they are given, as PHALANX_ALGO=ring would
    // set it, without changing the environment of the other tests.
    let ring = || phalanx_comm::Config {
        algo: phalanx_comm::Algo::Ring,
        ..phalanx_comm::Config::from_env()
    };
    for world in [2usize, 3] {
        let (none, b_none) = train_run_with(ring(), world, 6, &[]);
        // (hook, bytes per step relative to fp32 all-reduce, tolerance of the
        // last loss relative to uncompressed training)
        // Ring all-reduce sends 2(N-1)/N x 4n bytes per rank; the hooks that
        // all-gather send (N-1) x payload: int8 1n + n/64 scales, top-k 8kn.
        let n = world as f64;
        let cases: Vec<(&str, f64, f64)> = vec![
            ("fp16", 0.5, 0.01),
            ("bf16", 0.5, 0.02),
            ("int8", n * (1.0 + 1.0 / 64.0) / 8.0, 0.02),
            ("topk", n * 0.1, 0.25),
            ("powersgd", powersgd_fraction(1), 0.03),
            ("powersgd", powersgd_fraction(2), 0.03),
        ];
        for (k, (hook, ratio, tol)) in cases.into_iter().enumerate() {
            let set = format!("parallel.comm_hook={hook}");
            // The two PowerSGD cases: rank 1, then rank 2.
            let rank = format!("parallel.powersgd_rank={}", 1 + (k == 5) as usize);
            let (out, bytes) = train_run_with(
                ring(),
                world,
                6,
                &[
                    &set,
                    "parallel.topk_ratio=0.1",
                    // The promised fraction from the first step (the
                    // warm-up's bytes are checked on their own below).
                    "parallel.topk_warmup_steps=0",
                    "parallel.topk_freeze_variance=false",
                    &rank,
                    "parallel.powersgd_start_iter=0",
                    // DDP checks after every step that all ranks hold
                    // bitwise identical parameters (an error names the rank).
                    "parallel.check_params_every=1",
                ],
            );
            for (r, o) in out.iter().enumerate() {
                assert!(
                    o.1 == out[0].1,
                    "{hook} on {world}: rank {r}'s parameters differ"
                );
            }
            let got = bytes as f64 / b_none as f64;
            assert!(
                (got - ratio).abs() < 0.1 * ratio + 0.02,
                "{hook} on {world} ranks: {bytes} bytes / step vs {b_none} uncompressed = {got:.3}, theory {ratio:.3}"
            );
            let (a, b) = (last_loss(&out), last_loss(&none));
            assert!(
                ((a - b) / b).abs() < tol as f32,
                "{hook} on {world}: loss {a} vs {b}"
            );
        }
    }
}

#[test]
fn error_feedback_brings_top_k_closer_to_uncompressed() {
    let steps = 30;
    let (none, _) = train_run(2, steps, &[]);
    let l0 = last_loss(&none);
    // PowerSGD's error feedback is shown on the hook itself
    // (crates/phalanx/tests/it/comm_hooks.rs): on this small model its rank-1
    // updates train about as well with it as without, within noise.
    let cases: [&[&str]; 1] = [&[
        "parallel.comm_hook=topk",
        "parallel.topk_ratio=0.01",
        "parallel.topk_warmup_steps=0",
        "parallel.topk_freeze_variance=false",
    ]];
    for hook in cases {
        let (ef, _) = train_run(2, steps, hook);
        let mut off = hook.to_vec();
        off.push("parallel.error_feedback=false");
        let (no_ef, _) = train_run(2, steps, &off);
        let (l1, l2) = (last_loss(&ef), last_loss(&no_ef));
        eprintln!("{hook:?}: loss after {steps} steps: uncompressed {l0}, with error feedback {l1}, without {l2}");
        assert!(
            l1 < l2,
            "{hook:?}: error feedback should help: {l1} vs {l2}"
        );
        assert!(
            l1 - l0 < l2 - l0,
            "{hook:?}: closer to uncompressed with error feedback"
        );
    }
}

#[test]
fn comm_hook_and_reduce_dtype_together_are_refused() {
    let err = phalanx_models::gpt2::config::build(
        None,
        &[
            "parallel.comm_hook=int8".into(),
            "train.reduce_dtype=bf16".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("parallel.comm_hook") && err.contains("train.reduce_dtype"),
        "{err}"
    );
}

#[test]
fn combinations_that_are_not_built_are_refused_naming_both_keys() {
    let refused = |sets: &[&str], keys: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let err = phalanx_models::gpt2::config::build(None, &sets)
            .unwrap_err()
            .to_string();
        for k in keys {
            assert!(err.contains(k), "{sets:?}: {err}");
        }
    };
    refused(
        &["parallel.comm_hook=powersgd", "parallel.pp=2"],
        &["parallel.comm_hook", "parallel.pp"],
    );
    refused(
        &[
            "zero_optimization.zero_quantized_weights=true",
            "zero_optimization.stage=2",
        ],
        &["zero_quantized_weights", "zero_optimization.stage"],
    );
    refused(
        &[
            "zero_optimization.zero_quantized_gradients=true",
            "zero_optimization.stage=3",
            "parallel.comm_hook=topk",
        ],
        &["zero_quantized_gradients", "parallel.comm_hook"],
    );
    refused(
        &[
            "zero_optimization.zero_hpz_partition_size=2",
            "parallel.sharding_strategy=HYBRID_SHARD",
        ],
        &["zero_hpz_partition_size", "HYBRID_SHARD"],
    );
    // DGC's momentum correction: a factor below 1, not applied twice, and
    // one velocity update per step.
    refused(&["parallel.topk_momentum=1.0"], &["parallel.topk_momentum"]);
    refused(
        &[
            "parallel.comm_hook=topk",
            "parallel.topk_momentum=0.9",
            "optim.name=\"sgd\"",
            "optim.momentum=0.9",
        ],
        &["parallel.topk_momentum", "optim.momentum"],
    );
    refused(
        &[
            "parallel.comm_hook=topk",
            "parallel.topk_momentum=0.9",
            "parallel.topk_freeze_variance=false",
            "zero_optimization.stage=2",
            "train.grad_accum_steps=2",
        ],
        &["parallel.topk_momentum", "train.grad_accum_steps"],
    );
    refused(
        &[
            "parallel.comm_hook=powersgd",
            "zero_optimization.stage=3",
            "train.grad_accum_steps=4",
        ],
        &["parallel.comm_hook = powersgd", "train.grad_accum_steps"],
    );
    // Top-k for AdamW (the frozen variance): its hook carries the
    // momentum, needs a warm-up to measure the variance, and updates once
    // per reduction.
    refused(
        &["parallel.comm_hook=topk", "parallel.topk_momentum=0.9"],
        &["parallel.topk_momentum", "parallel.topk_freeze_variance"],
    );
    refused(
        &["parallel.comm_hook=topk", "parallel.topk_warmup_steps=0"],
        &[
            "parallel.topk_warmup_steps",
            "parallel.topk_freeze_variance",
        ],
    );
    refused(
        &[
            "parallel.comm_hook=topk",
            "zero_optimization.stage=2",
            "train.grad_accum_steps=2",
        ],
        &["parallel.topk_freeze_variance", "train.grad_accum_steps"],
    );
    // What DGC runs with is accepted.
    let ok: Vec<String> = [
        "parallel.comm_hook=topk",
        "parallel.topk_momentum=0.9",
        "parallel.topk_warmup_steps=100",
        "optim.name=\"sgd\"",
        "optim.momentum=0.0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    phalanx_models::gpt2::config::build(None, &ok).unwrap();
}

#[test]
fn hooks_compose_with_zero_pipeline_and_tensor_parallel() {
    // (layout, ranks, the hooks it takes): each hook trains as the
    // uncompressed run does, within quantisation noise, and every rank
    // ends with the same whole model.
    let hooks = ["fp16", "bf16", "int8", "topk", "powersgd"];
    // (name, ranks, dp ranks, settings, hooks)
    type Layout<'a> = (&'a str, usize, usize, &'a [&'a str], &'a [&'a str]);
    let layouts: [Layout; 6] = [
        ("ZeRO-1", 2, 2, &["zero_optimization.stage=1"], &hooks),
        ("ZeRO-2", 2, 2, &["zero_optimization.stage=2"], &hooks),
        ("ZeRO-3", 3, 3, &["zero_optimization.stage=3"], &hooks),
        (
            "HYBRID_SHARD 2 x 2",
            4,
            4,
            &[
                "parallel.sharding_strategy=HYBRID_SHARD",
                "parallel.hybrid_shard_size=2",
            ],
            &hooks,
        ),
        ("pp 2 x dp 2", 4, 2, &["parallel.pp=2"], &hooks[..4]),
        (
            "tp 2 x dp 2",
            4,
            2,
            &["parallel.tp=2", "model.n_head=4", "model.n_embd=24"],
            &hooks,
        ),
    ];
    for (what, world, dp, sets, hooks) in layouts {
        let mk = |extra: &[&str]| {
            let mut e: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            e.extend(extra.iter().map(|s| s.to_string()));
            e.push("parallel.topk_ratio=0.3".into());
            e.push("parallel.powersgd_start_iter=0".into());
            e.push("parallel.powersgd_rank=4".into());
            run(world, config(dp, 1, &e))
        };
        let base = mk(&[]);
        for hook in hooks.iter() {
            let out = mk(&[&format!("parallel.comm_hook={hook}")]);
            for (r, o) in out.iter().enumerate() {
                assert!(
                    o.named == out[0].named,
                    "{what} + {hook}: rank {r}'s model differs"
                );
            }
            // Top-k per ZeRO-3 block (its buckets) keeps 30% of every
            // block, not of the whole model, and lags more in 6 steps.
            let tol = if *hook == "topk" { 0.1 } else { 0.05 };
            let (a, b) = (out[0].losses[STEPS - 1], base[0].losses[STEPS - 1]);
            assert!(
                ((a - b) / b).abs() < tol,
                "{what} + {hook}: loss {a} vs {b}"
            );
        }
    }
}

/// Every step's bytes (rank 0) of `steps` steps of `cfg` on 2 ranks, and
/// the last loss.
fn bytes_per_step(comm: phalanx_comm::Config, cfg: phalanx::config::TrainConfig) -> Vec<u64> {
    let steps = cfg.train.steps;
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run_with(2, comm, phalanx_comm::threads::DEADLINE, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        Ok((0..steps)
            .map(|k| t.step(k).unwrap().comm_bytes)
            .collect::<Vec<u64>>())
    })
    .remove(0)
    .expect("rank failed")
}

#[test]
fn top_k_sends_its_promised_bytes_after_the_warm_up() {
    // The whole test model is one bucket of n values; top-k sends k of
    // them as (i32 index, f32 value), all-gathered: on 2 ranks each rank
    // sends its own 8 k bytes, where the ring all-reduce sends 4 n. The
    // rest of a step (the loss mean, the norm) is the same for both.
    let ring = || phalanx_comm::Config {
        algo: phalanx_comm::Algo::Ring,
        ..phalanx_comm::Config::from_env()
    };
    let steps = 9;
    let sets = |extra: &[&str]| {
        let mut e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        e.push(format!("train.steps={steps}"));
        config(2, 1, &e)
    };
    let n = {
        let c = sets(&[]);
        let loader = loader(c.seq_len().unwrap());
        phalanx_comm::threads::run(1, move |pg| {
            train::trainer(&c, pg, loader.clone(), &GptRun::default())
                .unwrap()
                .engine()
                .num_params()
        })[0]
    };
    let none = bytes_per_step(ring(), sets(&[]));
    // Warm-up of 6 reductions: 25%, 25%, 6.25%, 6.25%, 1.5625%, 1.5625%,
    // then 1%.
    let topk = bytes_per_step(
        ring(),
        sets(&[
            "parallel.comm_hook=topk",
            "parallel.topk_ratio=0.01",
            "parallel.topk_warmup_steps=6",
            "parallel.topk_freeze_variance=false",
        ]),
    );
    // With AdamW's frozen variance (the default): 6 dense steps, then 1%.
    let adam = bytes_per_step(
        ring(),
        sets(&[
            "parallel.comm_hook=topk",
            "parallel.topk_ratio=0.01",
            "parallel.topk_warmup_steps=6",
        ]),
    );
    let k = |ratio: f64| (n as f64 * ratio).ceil() as u64;
    let fractions = [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01, 0.01,
    ];
    // Step 0 also gathers the memory report: compare from step 1.
    for t in 1..steps {
        let want = none[t] - 4 * n as u64 + 8 * k(fractions[t]);
        assert_eq!(
            topk[t], want,
            "step {t}: top-k at {} sent {} bytes, the promise is {want} (n = {n})",
            fractions[t], topk[t]
        );
        let want = if t < 6 {
            none[t]
        } else {
            none[t] - 4 * n as u64 + 8 * k(0.01)
        };
        assert_eq!(adam[t], want, "step {t}: top-k for Adam");
    }
}

/// The mean loss of the last 10 of `steps` steps of gpt-tiny on 2 ranks.
fn tiny_loss(steps: usize, extra: &[&str]) -> f32 {
    let mut sets: Vec<String> = vec![
        "model.preset=gpt-tiny".into(),
        format!("train.steps={steps}"),
        "train.eval_interval=0".into(),
        "log.plot=\"\"".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = phalanx_models::gpt2::config::build(None, &sets).unwrap();
    let loader = loader(cfg.seq_len().unwrap());
    let out = phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        (0..steps)
            .map(|k| t.step(k).unwrap().loss)
            .collect::<Vec<f32>>()
    });
    out[0][steps - 10..].iter().sum::<f32>() / 10.0
}

#[test]
fn deep_gradient_compression_gets_top_k_closer_to_uncompressed() {
    let steps = 80;
    let topk = ["parallel.comm_hook=topk", "parallel.topk_ratio=0.01"];
    let plain = [
        &topk[..],
        &[
            "parallel.topk_warmup_steps=0",
            "parallel.topk_freeze_variance=false",
        ],
    ]
    .concat();
    // AdamW (the default): the sparsity warm-up brings top-k closer.
    let none = tiny_loss(steps, &[]);
    let old = tiny_loss(steps, &plain);
    let warm = tiny_loss(steps, &topk);
    eprintln!("AdamW, gpt-tiny, mean loss of steps {}-{steps}: uncompressed {none}, top-1% {old}, with the defaults (60 dense steps, then the frozen variance) {warm}", steps - 9);
    assert!(
        (warm - none).abs() < 0.6 * (old - none).abs(),
        "the warm-up should bring top-k closer: {warm} vs {old} (uncompressed {none})"
    );
    // DGC's own setting, momentum SGD with the momentum in the hook: plain
    // top-1% stalls on the plateau near 3.1 that the uncompressed run
    // leaves later (whose clip acts on each gradient, DGC's on the
    // delivered velocity, so the two are not compared here); DGC leaves it.
    let sgd = [
        "optim.name=\"sgd\"",
        "optim.lr=0.3",
        "optim.min_lr=0.03",
        "optim.weight_decay=0.0",
    ];
    let old = tiny_loss(steps, &[&sgd[..], &plain, &["optim.momentum=0.9"]].concat());
    let dgc = tiny_loss(
        steps,
        &[
            &sgd[..],
            &topk,
            &["optim.momentum=0.0", "parallel.topk_momentum=0.9"],
        ]
        .concat(),
    );
    eprintln!(
        "momentum SGD, gpt-tiny, mean loss of steps {}-{steps}: top-1% {old}, DGC {dgc}",
        steps - 9
    );
    assert!(
        dgc < old - 0.3,
        "DGC should train where plain top-k stalls: {dgc} vs {old}"
    );
}

#[test]
fn top_k_with_adamw_on_one_data_parallel_rank_is_plain_adamw() {
    // One rank reduces nothing, so the hook never runs and carries no
    // momentum: AdamW must not freeze its variance after the warm-up and
    // take the raw gradient for the hook's momentum (updates ~10x smaller).
    let w = 2;
    let (none, _) = train_run(1, 2 * w + 1, &["optim.name=adamw"]);
    let warm = format!("parallel.topk_warmup_steps={w}");
    let (topk, _) = train_run(
        1,
        2 * w + 1,
        &["optim.name=adamw", "parallel.comm_hook=topk", &warm],
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&topk[0].0), bits(&none[0].0), "losses");
    assert!(
        bits(&topk[0].1) == bits(&none[0].1),
        "top-k on one rank moved the parameters differently from plain AdamW"
    );
}
