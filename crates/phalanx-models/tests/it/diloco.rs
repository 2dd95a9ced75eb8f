//! LocalSGD, DiLoCo and Streaming DiLoCo in a plain job (every dp rank its
//! own group, ranks as threads): with H = 1, an SGD inner step and the
//! outer SGD at lr 1 without momentum, DiLoCo is DDP step for step; with
//! H = 20 it sends at most 1/H of DDP's bytes plus the per-step loss mean,
//! and learns; Streaming DiLoCo sends each of its F fragments every H steps
//! at staggered offsets (exactly the fragment's all-reduce bytes, and the
//! groups agree on that fragment right after its outer step), also with
//! the all-reduce overlapping an inner step; int8 pseudo-gradients send
//! about a quarter of the bytes; a resumed run is bitwise the run that
//! never stopped (the anchor, the outer momentum, an all-reduce in flight
//! and every group's own parameters and inner optimizer are saved); the
//! config refuses what DiLoCo does not compose with, naming the keys.

use crate::common;
use common::*;
use phalanx::config::TrainConfig;
use phalanx_models::gpt2::train::{self, GptRun};
use std::ops::Range;
use std::path::{Path, PathBuf};

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

/// What one rank did, step by step.
struct Steps {
    losses: Vec<f32>,
    /// Bytes this rank sent during each step.
    bytes: Vec<u64>,
    /// The flat parameters after each step.
    params: Vec<Vec<f32>>,
    /// Bytes sent from the end of the first step (which also gathers the
    /// memory report) to the end of the last, what went between steps
    /// included.
    total_bytes: u64,
    name: String,
}

/// Train `steps` on `world` ranks (threads) by hand, after loading `load`;
/// save a checkpoint after the last step if `save`.
fn drive(
    world: usize,
    cfg: TrainConfig,
    steps: Range<usize>,
    load: Option<PathBuf>,
    save: bool,
) -> Vec<Steps> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        if let Some(d) = &load {
            t.load_checkpoint(d).unwrap();
            assert_eq!(t.start_step(), steps.start);
        }
        let mut out = Steps {
            losses: Vec::new(),
            bytes: Vec::new(),
            params: Vec::new(),
            total_bytes: 0,
            name: t.strategy().name(),
        };
        let mut b0 = 0;
        for k in steps.clone() {
            let s = t.step(k).unwrap();
            if k == steps.start {
                b0 = t.group().bytes_sent();
            }
            out.losses.push(s.loss);
            out.bytes.push(s.comm_bytes);
            out.params.push(t.engine().params_flat().to_vec());
        }
        out.total_bytes = t.group().bytes_sent() - b0;
        if save {
            t.save_checkpoint(steps.end).unwrap();
        }
        out
    })
}

/// A config of `steps` steps on `dp` ranks with `extra` overrides.
fn cfg(dp: usize, steps: usize, extra: &[String]) -> TrainConfig {
    let mut e = extra.to_vec();
    e.push(format!("train.steps={steps}"));
    config(dp, 1, &e)
}

/// The bytes one rank sends for an f32 all-reduce of `n` values and a
/// one-value f64 all-reduce (the step's loss mean), on 2 ranks, on the
/// world group or on a group of its own.
fn reference_bytes(n: usize, own_group: bool) -> (u64, u64) {
    let out = phalanx_comm::threads::run(2, move |world| {
        let pg = if own_group {
            world.new_group(&[0, 1]).unwrap().unwrap()
        } else {
            world.clone()
        };
        let b0 = pg.bytes_sent();
        pg.all_reduce(&mut vec![1f32; n], phalanx_comm::ReduceOp::Avg)
            .unwrap();
        let b1 = pg.bytes_sent();
        world
            .all_reduce(&mut [1f64], phalanx_comm::ReduceOp::Avg)
            .unwrap();
        (b1 - b0, world.bytes_sent() - b1)
    });
    out[0]
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f64) {
    let e = rel(a, b);
    assert!(e < tol, "{what}: differ by {e:e}");
}

#[test]
fn h1_localsgd_with_sgd_inner_equals_ddp_step_for_step() {
    for world in [2, 3] {
        let ddp = drive(world, cfg(world, 6, &plain_sgd()), 0..6, None, false);
        let mut e = plain_sgd();
        e.extend(sets(&[
            "diloco.inner_steps=1",
            "diloco.outer_lr=1.0",
            "diloco.outer_momentum=0.0",
            "parallel.check_params_every=1",
        ]));
        let dl = drive(world, cfg(world, 6, &e), 0..6, None, false);
        assert!(dl[0].name.contains("LocalSGD"), "{}", dl[0].name);
        for (r, (a, b)) in dl.iter().zip(&ddp).enumerate() {
            for k in 0..6 {
                let (x, y) = (a.losses[k], b.losses[k]);
                assert!(
                    ((x - y) / y).abs() < 1e-5,
                    "world {world} rank {r} step {k}: loss {x} vs DDP's {y}"
                );
                assert_close(
                    &format!("world {world} rank {r} step {k}: parameters vs DDP"),
                    &a.params[k],
                    &b.params[k],
                    1e-5,
                );
            }
            // Every step is an outer step: the groups agree bit for bit.
            assert_eq!(a.params[5], dl[0].params[5], "rank {r}");
        }
        assert!(ddp[0].losses[5] < ddp[0].losses[0]);
    }
}

#[test]
fn h20_sends_at_most_1_over_h_of_ddp_bytes_and_learns() {
    const H: usize = 20;
    const N: usize = 2 * H;
    let ddp = drive(2, cfg(2, N, &[]), 0..N, None, false);
    let e = sets(&["diloco.inner_steps=20"]);
    let dl = drive(2, cfg(2, N, &e), 0..N, None, false);
    assert!(dl[0].name.starts_with("DiLoCo (H = 20"), "{}", dl[0].name);
    let n = dl[0].params[0].len();
    let (outer, loss_mean) = reference_bytes(n, false);
    for (r, (d, p)) in dl.iter().zip(&ddp).enumerate() {
        let total: u64 = d.bytes.iter().sum();
        let ddp_total: u64 = p.bytes.iter().sum();
        // Between outer steps a group sends only the step's loss mean;
        // an outer step adds the pseudo-gradient's all-reduce.
        for (k, b) in d.bytes.iter().enumerate() {
            let want = loss_mean + if (k + 1) % H == 0 { outer } else { 0 };
            assert_eq!(*b, want, "rank {r} step {k}");
        }
        assert!(
            total <= ddp_total / H as u64 + N as u64 * loss_mean,
            "rank {r}: DiLoCo sent {total} bytes, DDP {ddp_total}"
        );
        assert!(
            total > 0 && ddp_total > 10 * total,
            "{total} vs {ddp_total}"
        );
        // It learns: the last steps' loss is well below the first's, and
        // not far above DDP's.
        let last = |l: &[f32]| l[N - 5..].iter().sum::<f32>() / 5.0;
        assert!(
            last(&d.losses) < d.losses[0] - 1.0,
            "rank {r}: DiLoCo losses {:?}",
            d.losses
        );
        assert!(
            last(&d.losses) < last(&p.losses) + 0.5,
            "rank {r}: DiLoCo {} vs DDP {}",
            last(&d.losses),
            last(&p.losses)
        );
        // After the outer step the groups hold the same model.
        assert_eq!(d.params[N - 1], dl[0].params[N - 1]);
        assert_ne!(d.params[N - 2], dl[1 - r].params[N - 2]);
    }
}

/// Which fragments hold the same values on both ranks after each step.
fn agreeing(out: &[Steps], frags: &[Range<usize>], k: usize) -> Vec<bool> {
    frags
        .iter()
        .map(|f| out[0].params[k][f.clone()] == out[1].params[k][f.clone()])
        .collect()
}

#[test]
fn streaming_diloco_sends_each_fragment_every_h_steps() {
    const H: usize = 8;
    const F: usize = 4;
    let e = sets(&[
        "diloco.inner_steps=8",
        "diloco.fragments=4",
        "diloco.overlap_steps=0",
    ]);
    let n = 3 * H;
    let out = drive(2, cfg(2, n, &e), 0..n, None, false);
    assert!(
        out[0].name.starts_with("Streaming DiLoCo"),
        "{}",
        out[0].name
    );
    let frags = phalanx::strategy::diloco::fragments(out[0].params[0].len(), F);
    let (_, loss_mean) = reference_bytes(1, false);
    let frag_bytes: Vec<u64> = frags
        .iter()
        .map(|f| reference_bytes(f.len(), false).0)
        .collect();
    for k in 0..n {
        let done = k + 1;
        // Fragment f syncs after (f + 1) H / F steps, then every H.
        let due: Vec<usize> = (0..F)
            .filter(|f| done >= (f + 1) * H / F && (done - (f + 1) * H / F).is_multiple_of(H))
            .collect();
        assert!(due.len() <= 1);
        for (r, o) in out.iter().enumerate() {
            let want = loss_mean + due.iter().map(|&f| frag_bytes[f]).sum::<u64>();
            assert_eq!(o.bytes[k], want, "rank {r} step {k} (fragments {due:?})");
        }
        // The fragment just synced is the groups' common model; the
        // fragments that trained on since their sync differ.
        let agree = agreeing(&out, &frags, k);
        for (f, &a) in agree.iter().enumerate().take(F) {
            if due.contains(&f) {
                assert!(a, "step {k}: fragment {f} synced");
            } else if done > (f + 1) * H / F {
                assert!(!a, "step {k}: fragment {f} trained on");
            }
        }
    }
}

#[test]
fn streaming_all_reduce_overlaps_an_inner_step() {
    const H: usize = 8;
    const F: usize = 2;
    let e = sets(&["diloco.inner_steps=8", "diloco.fragments=2"]);
    // 2 H + 1 steps: every all-reduce started has been applied.
    let n = 2 * H + 1;
    let out = drive(2, cfg(2, n, &e), 0..n, None, false);
    assert!(out[0].name.contains("τ = 1"), "{}", out[0].name);
    let frags = phalanx::strategy::diloco::fragments(out[0].params[0].len(), F);
    let (_, loss_mean) = reference_bytes(1, false);
    let frag_bytes: u64 = frags.iter().map(|f| reference_bytes(f.len(), true).0).sum();
    // (An all-reduce started at the end of a step may send between
    // steps: the total counts those bytes too.)
    for o in &out {
        assert_eq!(o.total_bytes, (n as u64 - 1) * loss_mean + 2 * frag_bytes);
    }
    for k in 0..n {
        let done = k + 1;
        let agree = agreeing(&out, &frags, k);
        for (f, a) in agree.iter().enumerate() {
            // Fragment f's outer step lands one step after its sync.
            let o = (f + 1) * H / F;
            let applied = done > o && (done - 1 - o).is_multiple_of(H);
            assert_eq!(*a, applied, "step {k} fragment {f}");
        }
    }
}

#[test]
fn int8_pseudo_gradients_send_a_quarter_of_the_bytes() {
    const H: usize = 4;
    let n = 3 * H;
    let f32_run = drive(
        2,
        cfg(2, n, &sets(&["diloco.inner_steps=4"])),
        0..n,
        None,
        false,
    );
    let e = sets(&["diloco.inner_steps=4", "diloco.quantize=true"]);
    let q = drive(2, cfg(2, n, &e), 0..n, None, false);
    assert!(q[0].name.contains("int8"), "{}", q[0].name);
    let (_, loss_mean) = reference_bytes(1, false);
    let outer = |o: &Steps| o.bytes[H - 1] - loss_mean;
    for r in 0..2 {
        let ratio = outer(&q[r]) as f64 / outer(&f32_run[r]) as f64;
        assert!(
            (0.2..0.27).contains(&ratio),
            "rank {r}: int8 outer step sends {ratio:.3} of f32's"
        );
        assert!(
            q[r].losses[n - 1] < q[r].losses[0] - 0.5,
            "{:?}",
            q[r].losses
        );
        // The quantised average is the same on every rank, bit for bit.
        assert_eq!(q[r].params[n - 1], q[0].params[n - 1]);
    }
    // The int8 average is close to the f32 one.
    assert_close(
        "int8 vs f32",
        &q[0].params[H - 1],
        &f32_run[0].params[H - 1],
        1e-2,
    );
}

/// A fresh directory, removed when the test ends.
fn tmp(name: &str) -> phalanx::fsutil::ScratchDir {
    phalanx::fsutil::ScratchDir::new("phalanx-diloco", name)
}

/// The checkpoint of step `k`, in a directory removed when the caller drops
/// the first half.
fn exact_resume(
    what: &str,
    extra: &[&str],
    k: usize,
    n: usize,
) -> (phalanx::fsutil::ScratchDir, PathBuf) {
    let dir = tmp(what);
    let mut e = sets(extra);
    e.push(format!("checkpoint.dir=\"{}\"", dir.display()));
    let c = cfg(2, n, &e);
    let whole = drive(2, c.clone(), 0..n, None, false);
    drive(2, c.clone(), 0..k, None, true);
    let ck = dir.join(format!("step-{k:08}"));
    let resumed = drive(2, c, k..n, Some(ck.clone()), false);
    for (r, (w, s)) in whole.iter().zip(&resumed).enumerate() {
        assert_eq!(w.losses[k..], s.losses[..], "{what}: rank {r} losses");
        for j in k..n {
            assert!(
                w.params[j] == s.params[j - k],
                "{what}: rank {r} parameters after step {j}"
            );
        }
    }
    // The groups trained apart since the last outer step.
    assert_ne!(whole[0].params[k - 1], whole[1].params[k - 1], "{what}");
    (dir, ck)
}

fn kinds(ck: &Path) -> Vec<String> {
    let r = phalanx::checkpoint::Reader::open(ck).unwrap();
    let mut k: Vec<String> = r.meta.entries.iter().map(|e| e.kind.clone()).collect();
    k.sort();
    k.dedup();
    k
}

#[test]
fn resume_is_bitwise_under_diloco() {
    // AdamW inner, Nesterov outer momentum, saved between outer steps.
    let (_dir, ck) = exact_resume("diloco", &["diloco.inner_steps=4"], 6, 10);
    let k = kinds(&ck);
    for want in [
        "param",
        "outer_momentum_buffer",
        "group0/param",
        "group1/param",
        "group1/exp_avg",
        "group1/exp_avg_sq",
    ] {
        assert!(k.iter().any(|x| x == want), "{want} not in {k:?}");
    }
    assert!(!k.iter().any(|x| x == "outer_pending"), "{k:?}");
    // Streaming, int8, with fragment 0's all-reduce in flight at the save.
    let (_dir, ck) = exact_resume(
        "streaming",
        &[
            "diloco.inner_steps=4",
            "diloco.fragments=2",
            "diloco.quantize=true",
        ],
        6,
        11,
    );
    assert!(kinds(&ck).iter().any(|x| x == "outer_pending"));
    // Under another schedule that average would land on another fragment.
    let other = cfg(
        2,
        11,
        &sets(&[
            "diloco.inner_steps=4",
            "diloco.fragments=4",
            "diloco.quantize=true",
        ]),
    );
    let l = loader(other.seq_len().unwrap());
    let errs = phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&other, pg, l.clone(), &GptRun::default()).unwrap();
        t.load_checkpoint(&ck).unwrap_err().to_string()
    });
    assert!(
        errs[0].contains("diloco.fragments = 2 in the checkpoint, 4 here"),
        "{}",
        errs[0]
    );
    // LocalSGD with plain SGD inside: no momentum anywhere.
    let mut e = plain_sgd();
    e.extend(sets(&[
        "diloco.inner_steps=3",
        "diloco.outer_lr=1.0",
        "diloco.outer_momentum=0.0",
    ]));
    let e: Vec<&str> = e.iter().map(|s| s.as_str()).collect();
    exact_resume("localsgd", &e, 4, 8);
}

#[test]
fn a_ddp_checkpoint_starts_every_group_from_its_model() {
    let dir = tmp("from-ddp");
    let at = vec![format!("checkpoint.dir=\"{}\"", dir.display())];
    drive(2, cfg(2, 6, &at), 0..3, None, true);
    let ck = dir.join("step-00000003");
    let ddp = drive(2, cfg(2, 6, &at), 3..4, Some(ck.clone()), false);
    let mut e = at.clone();
    e.push("diloco.inner_steps=2".into());
    let dl = drive(2, cfg(2, 6, &e), 3..6, Some(ck), false);
    // The first step's loss is taken before its update: the same model on
    // the same batch gives DDP's loss.
    for r in 0..2 {
        assert_eq!(dl[r].losses[0], ddp[r].losses[0], "rank {r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_config_refuses_what_diloco_does_not_compose_with() {
    let build = |s: &[&str]| phalanx_models::gpt2::config::build(None, &sets(s));
    let refused = [
        (vec!["diloco.enabled=true"], "diloco.inner_steps"),
        (
            vec![
                "diloco.inner_steps=4",
                "diloco.fragments=2",
                "fault_tolerance.lighthouse=\"127.0.0.1:29510\"",
            ],
            "diloco.fragments = 2",
        ),
        (
            vec![
                "diloco.inner_steps=4",
                "diloco.quantize=true",
                "fault_tolerance.lighthouse=\"127.0.0.1:29510\"",
            ],
            "diloco.quantize = true",
        ),
        (
            vec!["diloco.inner_steps=4", "zero_optimization.stage=3"],
            "zero_optimization.stage",
        ),
        (
            vec![
                "diloco.inner_steps=4",
                "parallel.sharding_strategy=SHARD_GRAD_OP",
            ],
            "parallel.sharding_strategy",
        ),
        (vec!["diloco.inner_steps=4", "parallel.tp=2"], "parallel.tp"),
        (vec!["diloco.inner_steps=4", "parallel.pp=2"], "parallel.pp"),
        (
            vec!["diloco.inner_steps=4", "parallel.comm_hook=int8"],
            "parallel.comm_hook",
        ),
        (
            vec!["diloco.inner_steps=4", "diloco.fragments=5"],
            "diloco.fragments",
        ),
        (
            vec![
                "diloco.inner_steps=4",
                "diloco.fragments=2",
                "diloco.overlap_steps=4",
            ],
            "diloco.overlap_steps",
        ),
        (
            vec!["diloco.inner_steps=4", "diloco.overlap_steps=2"],
            "diloco.overlap_steps",
        ),
        (
            vec!["diloco.inner_steps=4", "diloco.outer_momentum=1.0"],
            "diloco.outer_momentum",
        ),
        (
            vec!["diloco.inner_steps=4", "diloco.outer_lr=0.0"],
            "diloco.outer_lr",
        ),
        (
            vec![
                "diloco.inner_steps=4",
                "diloco.fragments=2",
                "parallel.check_params_every=1",
            ],
            "parallel.check_params_every",
        ),
    ];
    for (s, key) in refused {
        let e = build(&s).expect_err(&format!("{s:?} should be refused"));
        assert!(e.to_string().contains(key), "{s:?}: {e}");
    }
    // The hook alone is named alone (not a reduce_dtype left at its default).
    let e = build(&["diloco.inner_steps=4", "parallel.comm_hook=int8"]).expect_err("hook");
    assert!(!e.to_string().contains("reduce_dtype"), "{e}");
    let e = build(&["diloco.inner_steps=4", "train.reduce_dtype=\"bf16\""]).expect_err("dtype");
    assert!(
        e.to_string().contains("train.reduce_dtype = bf16 chooses")
            && !e.to_string().contains("comm_hook"),
        "{e}"
    );
    let on = build(&["diloco.enabled=true", "diloco.inner_steps=4"]).unwrap();
    assert!(on.diloco.on());
    assert!(build(&["diloco.inner_steps=4"]).unwrap().diloco.on());
    let off = build(&[]).unwrap();
    assert!(!off.diloco.on());
    let d = &off.diloco;
    assert_eq!(
        (
            d.outer_lr,
            d.outer_momentum,
            d.nesterov,
            d.fragments,
            d.overlap_steps
        ),
        (0.7, 0.9, true, 1, 1)
    );
}

/// Validation and the final model are the global model (the anchor), the
/// same on every rank, also when the run ends between outer steps: 6 steps
/// with H = 4 leave each group 2 inner steps of its own.
#[test]
fn validation_and_the_final_model_are_the_anchor() {
    use phalanx::data::{DataLoader, LoaderConfig, TokenData};
    let c = cfg(2, 6, &sets(&["diloco.inner_steps=4"]));
    let lc = LoaderConfig {
        seq_len: c.seq_len().unwrap(),
        val_fraction: 0.2,
        shuffle: true,
        seed: 7,
        vocab_size: Some(256),
    };
    let loader =
        std::sync::Arc::new(DataLoader::new(TokenData::from_tokens(corpus()), lc).unwrap());
    let out = phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&c, pg, loader.clone(), &GptRun::default()).unwrap();
        for k in 0..6 {
            t.step(k).unwrap();
        }
        let local = t.engine().params_flat().to_vec();
        let global = t.full_params().unwrap();
        let val = t.evaluate().unwrap().expect("a validation split");
        // Training goes on from the group's own parameters.
        assert_eq!(t.engine().params_flat(), &local[..]);
        // The anchor in the engine: the same loss, to the bit.
        t.materialize_params().unwrap();
        assert_eq!(t.engine().params_flat(), &global[..]);
        let at_anchor = t.evaluate().unwrap().unwrap();
        (local, global, val, at_anchor)
    });
    let (l0, g0, v0, a0) = &out[0];
    let (l1, g1, _, _) = &out[1];
    assert_ne!(
        l0, l1,
        "the groups drifted apart after their last outer step"
    );
    assert_eq!(g0, g1, "every rank exports the same model");
    assert_ne!(l0, g0);
    assert_eq!(
        v0.to_bits(),
        a0.to_bits(),
        "validation measured the anchor: {v0} vs {a0}"
    );
}

/// Streaming DiLoCo's last fragment syncs at the last step and its outer
/// step would land τ steps later, past the run: the run's end applies it,
/// so the final model holds it and every group agrees on that fragment.
#[test]
fn the_runs_end_applies_the_outer_steps_still_in_flight() {
    const H: usize = 8;
    let c = cfg(
        2,
        2 * H,
        &sets(&["diloco.inner_steps=8", "diloco.fragments=2"]),
    );
    let loader = loader(c.seq_len().unwrap());
    let out = phalanx_comm::threads::run(2, move |pg| {
        let (_, t) = train::train(&c, pg, loader.clone(), &GptRun::default()).unwrap();
        (t.engine().params_flat().to_vec(), t.full_params().unwrap())
    });
    let frags = phalanx::strategy::diloco::fragments(out[0].0.len(), 2);
    let last = frags[1].clone();
    assert_eq!(
        out[0].0[last.clone()],
        out[1].0[last.clone()],
        "the groups agree on it"
    );
    for (local, global) in &out {
        assert_eq!(
            local[last.clone()],
            global[last.clone()],
            "the anchor took the step"
        );
    }
    // Fragment 0 trained on after its sync (at 3H/2): each group's own.
    assert_ne!(out[0].0[frags[0].clone()], out[1].0[frags[0].clone()]);
}

#[test]
fn a_non_finite_mean_pseudo_gradient_stops_every_group_before_the_anchor() {
    // Group 1's parameters turn NaN after step 0 (its inner step at step 1
    // is skipped: train.on_nonfinite = "skip"); the outer step after step
    // 1 would average the NaN into every group's anchor. Both groups stop
    // there instead, naming the outer step.
    let e = sets(&["diloco.inner_steps=2", "train.on_nonfinite=\"skip\""]);
    let cfg = cfg(2, 4, &e);
    let loader = loader(cfg.seq_len().unwrap());
    let out = phalanx_comm::threads::run(2, move |pg| {
        let rank = pg.rank();
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        t.step(0).unwrap();
        if rank == 1 {
            t.engine_mut().params_flat_mut()[0] = f32::NAN;
        }
        t.step(1).map(|_| ()).map_err(|e| e.to_string())
    });
    for (r, o) in out.iter().enumerate() {
        let m = o.as_ref().expect_err("the outer step should be refused");
        assert!(
            m.contains("outer step 0 of fragment 0") && m.contains("not finite"),
            "rank {r}: {m}"
        );
    }
}
