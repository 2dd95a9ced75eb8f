//! Recovery end to end: workers killed during training and during
//! checkpoint saves (the `PHALANX_FAULT` test hook), restarts by the
//! launcher, broken checkpoints, and resuming on a different number of
//! ranks.

use crate::common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// No run of these tests takes more than a few seconds; a hang fails.
const DEADLINE: Duration = Duration::from_secs(180);

fn tmpdir(name: &str) -> ScratchDir {
    fresh_dir("phalanx-recovery", name)
}

/// A small model so that a run takes a second or two.
const MODEL: &[&str] = &[
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_head=2",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=32",
    "--set",
    "train.eval_interval=0",
    "--set",
    "log.plot=\"\"",
];

/// `phalanx train MODEL ARGS` with `fault` in `PHALANX_FAULT`, killed (and
/// failed) past the deadline. The launcher's workers die with it.
fn train(args: &[&str], fault: Option<&str>) -> Run {
    train_env(args, fault, &[])
}

/// [`train`] with `env` set too.
fn train_env(args: &[&str], fault: Option<&str>, env: &[(&str, &str)]) -> Run {
    let mut c = Command::new(BIN);
    c.envs(env.iter().copied());
    c.arg("train")
        .args(MODEL)
        .args(args)
        .current_dir(repo())
        .env_remove("RANK")
        .env_remove("PHALANX_RESTART_COUNT")
        .env_remove("TORCHELASTIC_RESTART_COUNT")
        .env_remove("PHALANX_FAULT");
    if let Some(f) = fault {
        c.env("PHALANX_FAULT", f);
    }
    run_until(c, DEADLINE)
}

/// The JSON log: (step, loss) per line.
fn log_lines(p: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

fn set(kv: String) -> [String; 2] {
    ["--set".to_string(), kv]
}

/// Training settings: `steps` steps, checkpoints every `interval` under `d/ckpt`.
fn settings(d: &Path, steps: usize, interval: usize) -> Vec<String> {
    [
        set(format!("train.steps={steps}")),
        set(format!("checkpoint.interval={interval}")),
        set(format!("checkpoint.dir=\"{}\"", d.join("ckpt").display())),
    ]
    .concat()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

fn latest(d: &Path) -> String {
    std::fs::read_to_string(d.join("ckpt/latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// Kill rank 1 at step 5 of 8 (checkpoints every 2 steps): the launcher
/// restarts the group, which resumes from step 4 and ends exactly where an
/// uninterrupted run ends; the JSON log holds every step once.
#[test]
fn killed_worker_restarts_from_the_last_checkpoint_bitwise() {
    restart_matches_uninterrupted("kill", &[], &[]);
}

/// The same under ZeRO-3 with its shard, gathers and gradients on the
/// device (the CPU's device-generic path): the restarted group uploads
/// its shards afresh from the checkpoint, and no step reads a gradient
/// back.
#[test]
fn zero3_on_the_device_restarts_bitwise() {
    let d = restart_matches_uninterrupted(
        "zero3-device",
        &["--set", "zero_optimization.stage=3"],
        &[("PHALANX_HOST_KERNELS", "0")],
    );
    let log = std::fs::read_to_string(d.join("b/log.jsonl")).unwrap();
    let reads: Vec<u64> = log
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["grad_reads"].as_u64().expect("grad_reads logged")
        })
        .collect();
    assert_eq!(reads, vec![0; 8], "gradients read back");
}

/// Kill rank 1 at step 5 of 8 (checkpoints every 2 steps) of a run with
/// `extra` and `env`, and compare with an uninterrupted one (the scratch
/// directory: `a` uninterrupted, `b` restarted).
fn restart_matches_uninterrupted(name: &str, extra: &[&str], env: &[(&str, &str)]) -> ScratchDir {
    let d = tmpdir(name);
    let mut base = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    base.extend(extra);
    base.push("--log-json");
    let (a, b) = (d.join("a"), d.join("b"));
    let (log_a, log_b) = (a.join("log.jsonl"), b.join("log.jsonl"));

    let sa = settings(&a, 8, 2);
    let mut args = base.clone();
    args.push(log_a.to_str().unwrap());
    args.extend(strs(&sa));
    let ref_run = train_env(&args, None, env);
    assert_eq!(ref_run.code, 0, "{ref_run}");

    let sb = settings(&b, 8, 2);
    let mut args = base.clone();
    args.push(log_b.to_str().unwrap());
    args.extend(strs(&sb));
    args.extend(["--max-restarts", "1"]);
    let r = train_env(&args, Some("exit-at-step:1:5"), env);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.err.contains(
            "restarting the group (restart 1 of 1) because rank 1 failed (exit code 137)"
        ),
        "{r}"
    );
    assert!(
        r.out
            .contains("restart 1 of this job: resuming from the latest checkpoint"),
        "{r}"
    );
    assert!(
        r.out.contains("step-00000004 (step 4, saved by"),
        "the restart must resume from step 4:\n{r}"
    );
    let (la, lb) = (log_lines(&log_a), log_lines(&log_b));
    let steps: Vec<u64> = lb.iter().map(|l| l.0).collect();
    assert_eq!(steps, (0..8).collect::<Vec<_>>(), "{r}");
    // Bitwise: the log holds the f32 losses exactly.
    assert_eq!(la, lb);
    assert_eq!(lb.last().unwrap().1.to_bits(), la[7].1.to_bits());
    assert_eq!(latest(&b), "step-00000008");
    d
}

/// A killed save (rank 0 dies after every file is written, before the
/// rename) leaves `latest` on the previous checkpoint and no `step-N` of
/// the killed one; `--resume auto` continues from the previous one.
fn killed_save(name: &str, extra: &[&str]) {
    let d = tmpdir(name);
    let s = settings(&d, 8, 2);
    let mut args = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    args.extend(strs(&s));
    args.extend(extra);
    let r = train(&args, Some("exit-in-save:4"));
    assert_eq!(
        r.code, 137,
        "the job fails with the killed rank's code:\n{r}"
    );
    assert!(r.err.contains("rank 0 failed (exit code 137)"), "{r}");
    assert_eq!(latest(&d), "step-00000002", "{r}");
    let ck = d.join("ckpt");
    assert!(!ck.join("step-00000004").exists(), "{r}");
    assert!(ck.join("step-00000002/metadata.json").is_file());
    // The save got as far as its metadata: only the rename was missing.
    let tmp: Vec<PathBuf> = std::fs::read_dir(&ck)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".tmp-step-00000004-")
        })
        .collect();
    assert_eq!(tmp.len(), 1, "{tmp:?}");
    assert!(
        tmp[0].join("metadata.json").is_file() && tmp[0].join("rank-00001.safetensors").is_file()
    );

    args.extend(["--resume", "auto"]);
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("step-00000002 (step 2, saved by"), "{r}");
    assert!(r.out.contains("done: 6 steps"), "{r}");
    assert_eq!(latest(&d), "step-00000008");
    // The next save cleared the leftover.
    assert!(!tmp[0].exists());
}

#[test]
fn killed_sync_save_leaves_the_previous_checkpoint() {
    killed_save("sync-save", &[]);
}

#[test]
fn killed_async_save_leaves_the_previous_checkpoint() {
    killed_save("async-save", &["--set", "checkpoint.async=true"]);
}

/// With `--max-restarts`, a killed (async) save costs the steps since the
/// previous checkpoint and the job completes.
#[test]
fn killed_async_save_is_recovered_by_a_restart() {
    let d = tmpdir("async-restart");
    let s = settings(&d, 8, 2);
    let mut args = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    args.extend(strs(&s));
    args.extend(["--set", "checkpoint.async=true", "--max-restarts", "1"]);
    let r = train(&args, Some("exit-in-save:4"));
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.err.contains("PHALANX_FAULT: in the save of step 4"),
        "{r}"
    );
    assert!(r.out.contains("step-00000002 (step 2, saved by"), "{r}");
    assert_eq!(latest(&d), "step-00000008");
}

/// `--resume auto` skips a latest checkpoint with a corrupted file (the
/// same size: its checksum, checked by rank 1, the rank whose share of the
/// files it is), with a warning naming the file, and continues from the one
/// before.
#[test]
fn corrupted_checkpoint_falls_back_to_the_previous_one() {
    let d = tmpdir("truncated");
    let mut args = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    let s = settings(&d, 4, 2);
    args.extend(strs(&s));
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert_eq!(latest(&d), "step-00000004");
    let f = d.join("ckpt/step-00000004/rank-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();

    let mut args = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    let s = settings(&d, 6, 2);
    args.extend(strs(&s));
    args.extend(["--resume", "auto"]);
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.err.contains("warning: skipping checkpoint")
            && r.err.contains("(rank 1)")
            && r.err
                .contains("step-00000004/rank-00001.safetensors is corrupt"),
        "{r}"
    );
    assert!(r.out.contains("step-00000002 (step 2, saved by"), "{r}");
    assert!(r.out.contains("done: 4 steps"), "{r}");
    assert_eq!(latest(&d), "step-00000006");

    // A newest step directory without its metadata.json is skipped with a
    // warning, not in silence.
    std::fs::remove_file(d.join("ckpt/step-00000006/metadata.json")).unwrap();
    let mut args = vec!["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    let s = settings(&d, 6, 2);
    args.extend(strs(&s));
    args.extend(["--resume", "auto"]);
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.err.contains("step-00000006: it has no metadata.json"),
        "{r}"
    );
}

/// A job saved on 2 ranks continues on 3 (dp 3, the same global batch of
/// 12): the resharded state gives the loss the 2-rank run had at the step
/// it continues from (up to the order of the reductions).
#[test]
fn resumes_on_a_different_number_of_ranks() {
    let d = tmpdir("elastic");
    let log = d.join("log.jsonl");
    let s = settings(&d, 8, 2);
    let mut args = vec!["--set", "train.global_batch_size=12", "--log-json"];
    args.push(log.to_str().unwrap());
    args.extend(strs(&s));
    let mut first = args.clone();
    first.extend(["--nproc-per-node", "2"]);
    // Rank 0 dies at step 5: step 4 is logged, the checkpoint of step 4 saved.
    let r = train(&first, Some("exit-at-step:0:5"));
    assert_eq!(r.code, 137, "{r}");
    assert!(r.out.contains("micro-batch 6 x grad_accum 1"), "{r}");
    let two = log_lines(&log);
    let at4 = two.iter().find(|l| l.0 == 4).expect("step 4 logged").1;

    args.extend(["--nproc-per-node", "3", "--resume", "auto"]);
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("micro-batch 4 x grad_accum 1"), "{r}");
    assert!(
        r.out.contains("step-00000004 (step 4, saved by") && r.out.contains("on 2 rank(s))"),
        "{r}"
    );
    assert!(r.out.contains("done: 4 steps"), "{r}");
    assert!(!r.err.contains("starts fresh"), "{r}");
    let three = log_lines(&log);
    assert_eq!(
        three.iter().map(|l| l.0).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(&three[..4], &two[..4]);
    let rel = (three[4].1 - at4).abs() / at4;
    assert!(
        rel < 1e-4,
        "step 4: {} on 3 ranks vs {at4} on 2",
        three[4].1
    );
    assert_eq!(latest(&d), "step-00000008");
}

/// Without checkpoints a restarted group starts over, and says so.
#[test]
fn restart_without_checkpoints_starts_over_with_a_note() {
    let d = tmpdir("nockpt");
    let log = d.join("log.jsonl");
    let r = train(
        &[
            "--nproc-per-node",
            "2",
            "--set",
            "train.micro_batch_size=4",
            "--set",
            "train.steps=3",
            "--max-restarts",
            "1",
            "--log-json",
            log.to_str().unwrap(),
        ],
        Some("exit-at-step:1:2"),
    );
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.out
            .contains("note: restart 1 of this job: checkpoints are off (checkpoint.interval = 0), so the restarted group starts from step 0"),
        "{r}"
    );
    let steps: Vec<u64> = log_lines(&log).iter().map(|l| l.0).collect();
    assert_eq!(steps, vec![0, 1, 2]);
}

/// Every worker of a restarted group gets the attempt number, ours and
/// torchrun's, and the launcher says why it restarts.
#[test]
fn restarted_workers_get_the_restart_count() {
    let out = Command::new(BIN)
        .args(["run", "--nproc-per-node", "2", "--max-restarts", "2", "--"])
        .args([
            "sh",
            "-c",
            "echo attempt $PHALANX_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS; \
             [ $PHALANX_RESTART_COUNT = 2 ] || [ $RANK = 1 ] || exit 5",
        ])
        .env_remove("RANK")
        .env_remove("PHALANX_SECRET")
        .output()
        .unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{o}{e}");
    for (k, r) in [(0, 0), (1, 0), (2, 0), (2, 1)] {
        let want = format!("[rank {r}] attempt {k} {k} 2");
        assert!(o.lines().any(|l| l == want), "missing {want:?}:\n{o}");
    }
    assert!(
        e.contains("restarting the group (restart 1 of 2) because rank 0 failed (exit code 5)")
            && e.contains("restart 2 of 2"),
        "{e}"
    );
}

/// The first start of a job that always passes `--resume auto` (the Slurm
/// and Kubernetes examples): no checkpoint.dir yet, so it starts fresh
/// and makes it (it used to be refused as an input the checkpoints would
/// be written into).
#[test]
fn resume_auto_without_a_checkpoint_dir_starts_fresh() {
    let d = tmpdir("firststart");
    let mut args = vec!["--nproc-per-node", "1", "--set", "train.micro_batch_size=4"];
    let s = settings(&d, 2, 1);
    args.extend(strs(&s));
    args.extend(["--resume", "auto"]);
    assert!(!d.join("ckpt").exists());
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("starting fresh"), "{r}");
    assert!(d.join("ckpt/step-00000002/metadata.json").is_file(), "{r}");
}

/// A resume with no step left to run leaves the JSON log as it is (it
/// used to cut the steps after the checkpoint, another run's), and
/// `latest` too (it used to point it back at the checkpoint resumed).
#[test]
fn a_resume_with_nothing_to_do_leaves_the_json_log() {
    let d = tmpdir("nothing-log");
    let base = ["--nproc-per-node", "1", "--set", "train.micro_batch_size=4"];
    let mut args = base.to_vec();
    let s = [settings(&d, 2, 1), set("checkpoint.keep=2".into()).to_vec()].concat();
    args.extend(strs(&s));
    let log = d.join("log.jsonl");
    let logged = [args.clone(), vec!["--log-json", log.to_str().unwrap()]].concat();
    let r = train(&logged, None);
    assert_eq!(r.code, 0, "{r}");
    // Resumed from step 1 with train.steps = 1: nothing to run, and the
    // JSON log's later steps (step 1) are left as they are, not cut.
    let before = std::fs::read_to_string(&log).unwrap();
    let latest = std::fs::read_to_string(d.join("ckpt/latest")).unwrap();
    let first = d.join("ckpt/step-00000001");
    let r = train(
        &[
            logged.clone(),
            vec![
                "--set",
                "train.steps=1",
                "--resume",
                first.to_str().unwrap(),
            ],
        ]
        .concat(),
        None,
    );
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("nothing to do"), "{r}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), before);
    assert_eq!(
        std::fs::read_to_string(d.join("ckpt/latest")).unwrap(),
        latest
    );
}

/// Resuming at or past `train.steps` says there is nothing to do (no NaN
/// losses, exit 0); `--resume auto` over checkpoints that all fail
/// verification refuses, listing each, and deletes none of them (it used
/// to say "starting fresh" and rotate them away).
#[test]
fn nothing_to_do_and_all_broken_checkpoints_are_refused_not_rotated() {
    let d = tmpdir("allbroken");
    let base = ["--nproc-per-node", "1", "--set", "train.micro_batch_size=4"];
    let mut args = base.to_vec();
    let s = [settings(&d, 2, 1), set("checkpoint.keep=2".into()).to_vec()].concat();
    args.extend(strs(&s));
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");

    let mut again = args.clone();
    again.extend(["--resume", "auto"]);
    let r = train(&again, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.out
            .contains("nothing to do: resumed at step 2, and train.steps = 2"),
        "{r}"
    );
    assert!(!r.out.contains("NaN") && !r.out.contains("done:"), "{r}");
    // A resume that runs longer (saving nothing): the schedule spans
    // train.steps, so it changes shape, and the run says so.
    let mut longer = base.to_vec();
    let s = settings(&d, 3, 0);
    longer.extend(strs(&s));
    longer.extend(["--resume", "auto"]);
    let r = train(&longer, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(
        r.out.contains("train.steps = 2, this one 3")
            && r.out.contains("set optim.decay_steps = 2"),
        "{r}"
    );

    // Break every checkpoint (repairably: a truncated rank file).
    let steps = ["step-00000001", "step-00000002"];
    for s in steps {
        let f = d.join("ckpt").join(s).join("rank-00000.safetensors");
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }
    let mut args = base.to_vec();
    let s = [settings(&d, 6, 1), set("checkpoint.keep=2".into()).to_vec()].concat();
    args.extend(strs(&s));
    args.extend(["--resume", "auto"]);
    let r = train(&args, None);
    assert_ne!(r.code, 0, "{r}");
    assert!(r.err.contains("every checkpoint under"), "{r}");
    assert!(!r.out.contains("starting fresh"), "{r}");
    for s in steps {
        assert!(r.err.contains(s), "{s} not listed: {r}");
        assert!(
            d.join("ckpt").join(s).join("metadata.json").exists(),
            "{s} deleted"
        );
    }
    assert!(
        !d.join("ckpt/step-00000003").exists(),
        "trained anyway: {r}"
    );
}

/// Saves killed after their rename but before `latest` (twice in a row):
/// each resume takes the checkpoint the killed save left, and the run
/// ends where an uninterrupted one does.
#[test]
fn saves_killed_before_latest_are_resumed() {
    let d = tmpdir("before-latest");
    let base = ["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    let run = |steps: usize, resume: bool, fault: Option<&str>| {
        let mut args = base.to_vec();
        let s = settings(&d, steps, 2);
        args.extend(strs(&s));
        if resume {
            args.extend(["--resume", "auto"]);
        }
        train(&args, fault)
    };
    let r = run(8, false, Some("exit-after-rename:4"));
    assert_eq!(r.code, 137, "{r}");
    assert_eq!(latest(&d), "step-00000002", "{r}");
    let r = run(8, true, Some("exit-after-rename:6"));
    assert_eq!(r.code, 137, "{r}");
    assert!(
        r.out.contains("resumed from") && r.out.contains("step-00000004"),
        "{r}"
    );
    assert_eq!(
        latest(&d),
        "step-00000004",
        "the resume points latest at it: {r}"
    );
    let r = run(8, true, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("step-00000006 (step 6"), "{r}");
    assert_eq!(latest(&d), "step-00000008");
    let done = |out: &str| {
        out.lines()
            .find(|l| l.contains("done:"))
            .map(str::to_string)
    };
    let end = done(&r.out).expect("a final line");
    // The same run uninterrupted, in a directory of its own.
    let d2 = tmpdir("before-latest-ref");
    let mut args = base.to_vec();
    let s = settings(&d2, 8, 2);
    args.extend(strs(&s));
    let r2 = train(&args, None);
    assert_eq!(r2.code, 0, "{r2}");
    let last = |s: &str| {
        s.split("-> ")
            .nth(1)
            .map(|x| x.split(',').next().unwrap_or("").to_string())
    };
    assert_eq!(last(&end), last(&done(&r2.out).unwrap()), "{end}");
}

/// Every checkpoint broken in a file another rank verifies: rank 0's
/// refusal, which the launcher shows, still names that file.
#[test]
fn all_broken_checkpoints_name_another_ranks_file() {
    let d = tmpdir("allbroken2");
    let base = ["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    let mut args = base.to_vec();
    let s = settings(&d, 1, 1);
    args.extend(strs(&s));
    let r = train(&args, None);
    assert_eq!(r.code, 0, "{r}");
    let f = d.join("ckpt/step-00000001/rank-00001.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x10;
    std::fs::write(&f, b).unwrap();
    let mut args = base.to_vec();
    let s = settings(&d, 2, 1);
    args.extend(strs(&s));
    args.extend(["--resume", "auto"]);
    let r = train(&args, None);
    assert_ne!(r.code, 0, "{r}");
    let refusal = r
        .err
        .lines()
        // The launcher's summary of rank 0's error (not rank 1's warnings).
        .skip_while(|l| !l.contains("of rank 0's stderr"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        refusal.contains("rank-00001.safetensors failed verification on rank 1"),
        "{refusal}\n{r}"
    );
}

/// A rank whose step returns an error (not a crash) tells its peers why:
/// the launcher names it, with its error, as the rank that failed; a peer
/// that reports before it is stopped gives the same reason.
#[test]
fn a_ranks_error_is_named_with_its_reason() {
    let r = train(
        &["--nproc-per-node", "3", "--set", "train.steps=6"],
        Some("error-at-step:1:3"),
    );
    assert_eq!(r.code, 1, "{r}");
    let why = "injected error at step 3 on rank 1 (test hook)";
    assert!(r.err.contains("rank 1 failed (exit code 1)"), "{r}");
    assert!(
        r.err
            .contains(&format!("[rank 1] phalanx train: error: {why}")),
        "{r}"
    );
    for peer in [
        "[rank 0] phalanx train: error:",
        "[rank 2] phalanx train: error:",
    ] {
        if let Some(l) = r.err.lines().find(|l| l.starts_with(peer)) {
            assert!(l.contains("rank 1 (") && l.contains(why), "{r}");
        }
    }
}

/// A restarted group resumes only its own job's checkpoints: an earlier
/// job's step 4 in the same `checkpoint.dir` is not where this job got
/// to (it crashed before its first save), so the restart starts as its
/// first attempt did, from step 0. The ids: each run's own
/// `PHALANX_JOB_ID`, or (None) the ones the launcher makes for a job of one
/// node.
fn restart_skips_another_jobs_checkpoint(name: &str, ids: Option<(&str, &str)>) {
    let d = tmpdir(name);
    let base = ["--nproc-per-node", "2", "--set", "train.micro_batch_size=4"];
    fn env(id: Option<&str>) -> Vec<(&str, &str)> {
        id.map(|v| vec![("PHALANX_JOB_ID", v)]).unwrap_or_default()
    }
    let s = settings(&d, 4, 2);
    let first = train_env(
        &[&base[..], &strs(&s)].concat(),
        None,
        &env(ids.map(|i| i.0)),
    );
    assert_eq!(first.code, 0, "{first}");
    assert_eq!(latest(&d), "step-00000004");
    let s = settings(&d, 6, 100);
    let args = [&base[..], &["--max-restarts", "1"], &strs(&s)].concat();
    let r = train_env(&args, Some("exit-at-step:1:1"), &env(ids.map(|i| i.1)));
    assert_eq!(r.code, 0, "{r}");
    let note = match ids {
        Some(_) => "was saved by phalanx:first, not this job (phalanx:second)",
        None => ", not this job (phalanx:",
    };
    assert!(r.out.contains(note), "{r}");
    assert!(r.out.contains("no checkpoint of this job under"), "{r}");
    assert_eq!(latest(&d), "step-00000006");
    let meta = std::fs::read_to_string(d.join("ckpt/step-00000006/metadata.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let job = v["job"].as_str().unwrap_or_default().to_string();
    match ids {
        Some(_) => assert_eq!(job, "phalanx:second"),
        None => assert!(job.starts_with("phalanx:") && job.len() > 10, "{job}"),
    }
    // From step 0: the first job's model was not taken over.
    assert!(!r.out.contains("step-00000004 (step 4, saved by"), "{r}");
}

#[test]
fn a_restart_does_not_resume_another_jobs_checkpoint() {
    restart_skips_another_jobs_checkpoint("other-job", Some(("first", "second")));
}

#[test]
fn a_restart_does_not_resume_another_jobs_checkpoint_by_the_launchers_ids() {
    restart_skips_another_jobs_checkpoint("other-job-ids", None);
}

/// A DiLoCo checkpoint resumed without DiLoCo: the run starts from the
/// last outer step's model and a fresh optimizer (the groups keep theirs
/// under their own names), and says both instead of nothing.
#[test]
fn a_diloco_checkpoint_resumed_without_diloco_says_what_it_drops() {
    let d = tmpdir("diloco-to-ddp");
    let s = settings(&d, 4, 4);
    let mut args = vec!["--nproc-per-node", "2"];
    args.extend(strs(&s));
    let mut first = args.clone();
    first.extend([
        "--set",
        "diloco.enabled=true",
        "--set",
        "diloco.inner_steps=2",
    ]);
    let r = train(&first, None);
    assert_eq!(r.code, 0, "{r}");
    let s = settings(&d, 6, 4);
    let mut second = vec!["--nproc-per-node", "2", "--resume", "auto"];
    second.extend(strs(&s));
    let r = train(&second, None);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.err.contains("was saved by DiLoCo"), "{r}");
    assert!(r.err.contains("optimizer starts fresh"), "{r}");
}
