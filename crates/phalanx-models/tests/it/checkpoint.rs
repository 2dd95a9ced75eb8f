//! Distributed checkpoints through the trainer: stopping at step k and
//! resuming gives bitwise the losses and parameters of the run that never
//! stopped (DDP, ZeRO-3, TP, PP, 3-D; AdamW and fp16 loss-scaler state);
//! a checkpoint saved in one layout loads in any other (other world sizes
//! included) and continues the same training; broken checkpoints are
//! refused naming the file.

use crate::common;
use common::*;
use phalanx::config::TrainConfig;
use phalanx_models::gpt2::train::{self, GptRun};
use std::path::{Path, PathBuf};

/// A fresh directory, removed when the test ends.
fn tmp(name: &str) -> phalanx::fsutil::ScratchDir {
    phalanx::fsutil::ScratchDir::new("phalanx-ckpt", name)
}

/// 6 heads of 36: tp 2 divides them; 3 layers: pp 2 and 3 split them.
fn layout_cfg(dir: &Path, dp: usize, extra: &[&str]) -> TrainConfig {
    let mut e: Vec<String> = ["model.n_head=6", "model.n_embd=36", "model.n_layer=3"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    e.push(format!("checkpoint.dir=\"{}\"", dir.display()));
    // m = 2 micro-batches (the pipeline's), the same global batch for all.
    config(dp, 2, &e)
}

/// Train steps `steps` on `world` ranks, after loading `load` if given;
/// save a checkpoint after the last step if `save`. Returns every rank's
/// (losses, the whole model by name, concatenated in name order).
fn drive(
    world: usize,
    cfg: TrainConfig,
    steps: std::ops::Range<usize>,
    load: Option<PathBuf>,
    save: bool,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        if let Some(d) = &load {
            t.load_checkpoint(d).unwrap();
            assert_eq!(t.start_step(), steps.start);
        }
        let losses: Vec<f32> = steps.clone().map(|k| t.step(k).unwrap().loss).collect();
        if save {
            t.save_checkpoint(steps.end).unwrap();
        }
        let named = train::full_named_params(&mut t, &cfg).unwrap();
        let mut names: Vec<&String> = named.keys().collect();
        names.sort();
        let flat = names
            .iter()
            .flat_map(|n| named[*n].flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect();
        (losses, flat)
    })
}

const K: usize = 3;

fn exact_resume(what: &str, world: usize, dp: usize, extra: &[&str]) {
    let dir = tmp(what);
    let cfg = layout_cfg(&dir, dp, extra);
    let whole = drive(world, cfg.clone(), 0..STEPS, None, false);
    drive(world, cfg.clone(), 0..K, None, true);
    let ck = dir.join(format!("step-{K:08}"));
    assert!(
        ck.join("metadata.json").is_file(),
        "{what}: checkpoint written"
    );
    let resumed = drive(world, cfg, K..STEPS, Some(ck), false);
    for (r, (w, s)) in whole.iter().zip(&resumed).enumerate() {
        assert_eq!(w.0[K..], s.0[..], "{what}: rank {r} losses after resuming");
        assert!(
            w.1 == s.1,
            "{what}: rank {r} parameters differ after resuming"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_is_bitwise_under_ddp_and_zero3() {
    exact_resume("ddp", 2, 2, &[]);
    exact_resume("zero3", 2, 2, &["zero_optimization.stage=3"]);
    exact_resume("zero2", 3, 3, &["zero_optimization.stage=2"]);
}

#[test]
fn resume_is_bitwise_with_fp16_loss_scaling() {
    // A window of 2 clean steps doubles the scale: the scaler's state
    // changes every other step and must come back exactly.
    exact_resume(
        "fp16",
        2,
        2,
        &[
            "train.precision=fp16",
            "fp16.loss_scale_window=2",
            "fp16.initial_scale_power=8",
        ],
    );
}

#[test]
fn resume_is_bitwise_under_tp_pp_and_3d() {
    exact_resume("tp", 2, 1, &["parallel.tp=2"]);
    exact_resume("pp", 2, 1, &["parallel.pp=2"]);
    exact_resume(
        "3d",
        8,
        2,
        &[
            "parallel.tp=2",
            "parallel.pp=2",
            "zero_optimization.stage=1",
        ],
    );
}

#[test]
fn any_layout_loads_into_any_other() {
    let dir = tmp("reshard");
    let one = layout_cfg(&dir, 1, &[]);
    let base = drive(1, one.clone(), 0..STEPS, None, false).remove(0);
    // (name, world, dp, extra)
    let layouts: Vec<(&str, usize, usize, Vec<&str>)> = vec![
        ("1 rank", 1, 1, vec![]),
        ("ZeRO-3 x3", 3, 3, vec!["zero_optimization.stage=3"]),
        ("tp 2", 2, 1, vec!["parallel.tp=2"]),
        ("pp 3", 3, 1, vec!["parallel.pp=3"]),
        (
            "dp 2 x tp 2",
            4,
            2,
            vec!["parallel.tp=2", "zero_optimization.stage=1"],
        ),
    ];
    for (from, fw, fdp, fe) in &layouts {
        let sub = dir.join(from.replace(' ', "_"));
        let cfg = layout_cfg(&sub, *fdp, fe);
        drive(*fw, cfg, 0..K, None, true);
        let ck = sub.join(format!("step-{K:08}"));
        for (to, tw, tdp, te) in &layouts {
            let cfg = layout_cfg(&sub, *tdp, te);
            let out = drive(*tw, cfg, K..STEPS, Some(ck.clone()), false);
            for (r, (losses, _)) in out.iter().enumerate() {
                for (k, (a, b)) in losses.iter().zip(&base.0[K..]).enumerate() {
                    assert!(
                        ((a - b) / b).abs() < 1e-5,
                        "saved by {from}, loaded by {to}: rank {r} step {} loss {a} vs {b}",
                        K + k
                    );
                }
            }
            let e = rel(&out[0].1, &base.1);
            assert!(
                e < 1e-4,
                "saved by {from}, loaded by {to}: parameters differ by {e:e}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint.dir that is not shared across nodes leaves a rank's file
/// where rank 0 does not see it: the save fails on every rank, naming that
/// rank and the setting (on rank 0; the others point to it), instead of "succeeding" with a checkpoint nobody
/// can load (and rotating the good ones away).
#[test]
fn a_rank_file_rank_0_cannot_see_fails_the_save() {
    let d = tmp("unshared");
    let cfg = layout_cfg(&d, 2, &[]);
    let loader = loader(cfg.seq_len().unwrap());
    let errs = phalanx_comm::threads::run(2, move |pg| {
        phalanx::fault::inject_unshared_checkpoint(1);
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        t.step(0).unwrap();
        let e = t.save_checkpoint(1).unwrap_err().to_string();
        phalanx::fault::clear();
        e
    });
    assert!(
        errs[0].contains("rank 1 wrote rank-00001.safetensors")
            && errs[0].contains("every node shares"),
        "{}",
        errs[0]
    );
    assert!(errs[1].contains("rank 0 has the reason"), "{}", errs[1]);
    // Nothing left behind: no checkpoint, no temporary directory.
    let left: Vec<_> = std::fs::read_dir(&*d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A checkpoint of ours whose metadata no longer reads (a resume skips it)
/// does not block the save of its step: it is kept aside as
/// `.broken-step-N-*` and replaced. A directory that is not ours is still
/// refused.
#[test]
fn a_damaged_checkpoint_of_the_same_step_is_kept_aside_and_replaced() {
    let d = tmp("damaged");
    let cfg = layout_cfg(&d, 2, &[]);
    drive(2, cfg.clone(), 0..1, None, true);
    let step = d.join("step-00000001");
    std::fs::write(step.join("metadata.json"), b"{ not json").unwrap();
    drive(2, cfg.clone(), 0..1, None, true);
    assert!(phalanx::checkpoint::Reader::open(&step).is_ok());
    let aside: Vec<String> = std::fs::read_dir(&*d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".broken-step-00000001-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    // Not ours: a file of someone else's in it.
    std::fs::write(step.join("notes.txt"), b"mine").unwrap();
    std::fs::write(step.join("metadata.json"), b"{ not json").unwrap();
    let loader = loader(cfg.seq_len().unwrap());
    let errs = phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        t.step(0).unwrap();
        t.save_checkpoint(1).unwrap_err().to_string()
    });
    assert!(
        errs[0].contains("is not a checkpoint Phalanx wrote"),
        "{}",
        errs[0]
    );
    assert!(step.join("notes.txt").is_file());
}
