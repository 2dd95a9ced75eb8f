//! Resume with a compression hook is bitwise exact: the hooks' state
//! (error-feedback residuals, PowerSGD's Q and step count, top-k's DGC
//! velocity and warm-up count) is saved per rank in the checkpoint, so a
//! run stopped at step k and resumed in a fresh trainer ends with the same
//! losses and parameters, to the bit, as the run that never stopped; the
//! same checkpoint without that state resumes differently (the state is
//! what makes it exact). On another layout the state is refused with an
//! error naming why; another hook starts fresh.

use crate::common;
use common::*;
use phalanx::config::TrainConfig;
use phalanx_models::gpt2::train::{self, GptRun};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Steps of every run, and the step the checkpoint is taken after.
const N: usize = 8;
const K: usize = 4;

/// What one rank did: each step's loss and the parameters after it.
struct Steps {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
}

/// Train `steps` on `world` ranks (threads), after loading `load`; save a
/// checkpoint after the last step if `save`.
fn drive(
    world: usize,
    cfg: TrainConfig,
    steps: Range<usize>,
    load: Option<PathBuf>,
    save: bool,
) -> Vec<phalanx::Result<Steps>> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| -> phalanx::Result<Steps> {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default())?;
        if let Some(d) = &load {
            t.load_checkpoint(d)?;
            assert_eq!(t.start_step(), steps.start);
        }
        let mut out = Steps {
            losses: Vec::new(),
            params: Vec::new(),
        };
        for k in steps.clone() {
            out.losses.push(t.step(k)?.loss);
            out.params.push(t.engine().params_flat().to_vec());
        }
        if save {
            t.save_checkpoint(steps.end)?;
        }
        Ok(out)
    })
}

fn ok(v: Vec<phalanx::Result<Steps>>) -> Vec<Steps> {
    v.into_iter().map(|r| r.expect("rank failed")).collect()
}

/// A fresh directory, removed when the test ends.
fn tmp(name: &str) -> phalanx::fsutil::ScratchDir {
    phalanx::fsutil::ScratchDir::new("phalanx-compression", name)
}

/// A config of `N` steps on `dp` ranks saving under `dir`, with small
/// buckets (several per step, so state is kept per bucket id).
fn cfg(dp: usize, dir: &Path, extra: &[&str]) -> TrainConfig {
    let mut e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    e.push(format!("train.steps={N}"));
    e.push("parallel.bucket_mb=0.05".into());
    e.push(format!("checkpoint.dir=\"{}\"", dir.display()));
    config(dp, 1, &e)
}

/// Whether two runs' steps agree to the bit, rank by rank.
fn same(a: &[Steps], b: &[Steps]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| x.losses == y.losses && x.params == y.params)
}

/// The names of the hook state the checkpoint holds for rank 0.
fn state_names(ck: &Path) -> Vec<String> {
    let r = phalanx::checkpoint::Reader::open(ck).unwrap();
    r.rank_state(0)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect()
}

/// Rewrite the checkpoint's metadata without the hook state.
fn strip_hook_state(ck: &Path) {
    let p = ck.join("metadata.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    m.as_object_mut().unwrap().remove("rank_state");
    std::fs::write(&p, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

#[test]
fn resume_with_a_compression_hook_is_bitwise_exact() {
    // (name, settings, hook state rank 0 must hold in the checkpoint)
    let cases: [(&str, &[&str], &[&str]); 9] = [
        ("fp16", &["parallel.comm_hook=fp16"], &[]),
        ("bf16", &["parallel.comm_hook=bf16"], &[]),
        ("int8", &["parallel.comm_hook=int8"], &["bucket0/residual"]),
        (
            "int8-zero2",
            &["parallel.comm_hook=int8", "zero_optimization.stage=2"],
            &["bucket0/residual"],
        ),
        // The warm-up (6 reductions) straddles the checkpoint.
        (
            "topk",
            &[
                "parallel.comm_hook=topk",
                "parallel.topk_warmup_steps=6",
                "parallel.topk_freeze_variance=false",
            ],
            &["bucket0/iter", "bucket0/residual"],
        ),
        // AdamW's frozen variance (the default), frozen before the
        // checkpoint: the hook's velocity and the optimizer's frozen v.
        (
            "topk-adam",
            &["parallel.comm_hook=topk", "parallel.topk_warmup_steps=2"],
            &["bucket0/iter", "bucket0/residual", "bucket0/velocity"],
        ),
        // DGC as its paper runs it: momentum SGD with the momentum in
        // the hook.
        (
            "topk-dgc",
            &[
                "parallel.comm_hook=topk",
                "parallel.topk_warmup_steps=6",
                "parallel.topk_momentum=0.9",
                "optim.name=\"sgd\"",
                "optim.momentum=0.0",
            ],
            &["bucket0/iter", "bucket0/residual", "bucket0/velocity"],
        ),
        (
            "powersgd",
            &[
                "parallel.comm_hook=powersgd",
                "parallel.powersgd_rank=2",
                "parallel.powersgd_start_iter=2",
            ],
            &["bucket0/iter", "bucket0/residual", "bucket0/q0"],
        ),
        // Plain all-reduces until reduction 6: only the count says when
        // compression starts after the resume.
        (
            "powersgd-start",
            &[
                "parallel.comm_hook=powersgd",
                "parallel.powersgd_start_iter=6",
            ],
            &["bucket0/iter"],
        ),
    ];
    for (what, sets, want) in cases {
        let dir = tmp(what);
        let c = cfg(2, &dir, sets);
        let whole = ok(drive(2, c.clone(), 0..N, None, false));
        ok(drive(2, c.clone(), 0..K, None, true));
        let ck = dir.join(format!("step-{K:08}"));
        let resumed = ok(drive(2, c.clone(), K..N, Some(ck.clone()), false));
        for (r, (w, s)) in whole.iter().zip(&resumed).enumerate() {
            assert_eq!(w.losses[K..], s.losses[..], "{what}: rank {r} losses");
            for j in K..N {
                assert!(
                    w.params[j] == s.params[j - K],
                    "{what}: rank {r} parameters after step {j}"
                );
            }
        }
        let names = state_names(&ck);
        for n in want {
            assert!(names.iter().any(|x| x == n), "{what}: {n} not in {names:?}");
        }
        if want.is_empty() {
            assert!(names.is_empty(), "{what} keeps no state: {names:?}");
            continue;
        }
        // Without the hook's state the same checkpoint resumes elsewhere.
        strip_hook_state(&ck);
        let fresh = ok(drive(2, c, K..N, Some(ck), false));
        let tail: Vec<Steps> = whole
            .into_iter()
            .map(|w| Steps {
                losses: w.losses[K..].to_vec(),
                params: w.params[K..].to_vec(),
            })
            .collect();
        assert!(
            !same(&tail, &fresh),
            "{what}: resuming without the hook state should differ"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn hook_state_is_refused_on_another_layout_and_dropped_for_another_hook() {
    let dir = tmp("layout");
    let topk = ["parallel.comm_hook=topk", "parallel.topk_ratio=0.1"];
    ok(drive(2, cfg(2, &dir, &topk), 0..K, None, true));
    let ck = dir.join(format!("step-{K:08}"));
    // One rank cannot take two ranks' residuals.
    let err = drive(1, cfg(1, &dir, &topk), K..N, Some(ck.clone()), false)
        .remove(0)
        .err()
        .expect("another layout with the same hook is refused")
        .to_string();
    for want in [
        "parallel.comm_hook = topk",
        "cannot be split or merged",
        "dp 2",
    ] {
        assert!(err.contains(want), "{err}");
    }
    // Another hook: the model and optimizer carry over, the hook starts
    // fresh.
    let none = ok(drive(1, cfg(1, &dir, &[]), K..N, Some(ck), false));
    assert!(none[0].losses.iter().all(|l| l.is_finite()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hook_state_is_refused_under_another_pipeline_schedule() {
    // The same ranks and axes, but interleaved:2 gives each stage other
    // layers (0, 1, 4, 5 instead of 0-3) in a buffer of the same length:
    // the residuals would land on other parameters.
    let dir = tmp("schedule");
    let run = |schedule: &str| {
        [
            "parallel.comm_hook=topk",
            "parallel.topk_ratio=0.1",
            "parallel.pp=2",
            "model.n_layer=8",
            schedule,
        ]
        .map(String::from)
    };
    let (a, b) = (
        run("parallel.pp_schedule=1f1b"),
        run("parallel.pp_schedule=interleaved:2"),
    );
    let (a, b) = (
        a.each_ref().map(|s| s.as_str()),
        b.each_ref().map(|s| s.as_str()),
    );
    ok(drive(4, cfg(2, &dir, &a), 0..K, None, true));
    let ck = dir.join(format!("step-{K:08}"));
    let err = drive(4, cfg(2, &dir, &b), K..N, Some(ck), false)
        .remove(0)
        .err()
        .expect("another schedule with the same hook is refused")
        .to_string();
    for want in ["cannot be split or merged", "1f1b", "interleaved"] {
        assert!(err.contains(want), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
