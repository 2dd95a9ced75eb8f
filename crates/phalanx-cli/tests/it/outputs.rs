//! No output is an input (docs/security.md): the input/output matrix —
//! every output flag of `phalanx train` (and its sidecars) against every
//! kind of input, named by its path, a symbolic link and a hard link — is
//! refused before any rank starts, naming both, and leaves the input as it
//! was. Also `plan --write-config`, and another model's files in
//! `--save-final`'s directory.

use crate::common;
use common::*;

use std::path::{Path, PathBuf};

/// The inputs, each made under `d`: (name, the file an output may hit,
/// the flags that make the run read it).
fn inputs(d: &Path) -> Vec<(&'static str, PathBuf, Vec<String>)> {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let toml = d.join("run.toml");
    std::fs::write(&toml, "[train]\nsteps = 2\n").unwrap();
    let ds = d.join("ds_config.json");
    std::fs::write(&ds, r#"{"train_micro_batch_size_per_gpu": 4}"#).unwrap();
    // Named config.json: `--save-final data/m.safetensors` writes a
    // config.json beside it (issue 27, item 2).
    std::fs::create_dir_all(d.join("data")).unwrap();
    let data = d.join("data/config.json");
    std::fs::write(&data, "a corpus ".repeat(500)).unwrap();
    let init = d.join("init/model.safetensors");
    std::fs::create_dir_all(d.join("init")).unwrap();
    std::fs::write(&init, b"weights").unwrap();
    let meta = d.join("ck/step-00000002/metadata.json");
    std::fs::create_dir_all(meta.parent().unwrap()).unwrap();
    std::fs::write(&meta, b"{}").unwrap();
    vec![
        (
            "--config",
            toml.clone(),
            s(&["--config", toml.to_str().unwrap()]),
        ),
        (
            "--deepspeed-config",
            ds.clone(),
            s(&["--deepspeed-config", ds.to_str().unwrap()]),
        ),
        (
            "data.path",
            data.clone(),
            s(&["--set", &format!("data.path={:?}", data.to_str().unwrap())]),
        ),
        (
            "--init-from",
            init.clone(),
            s(&["--init-from", init.to_str().unwrap()]),
        ),
        (
            "--resume",
            meta.clone(),
            s(&["--resume", d.join("ck").to_str().unwrap()]),
        ),
    ]
}

/// `target` as named by `how`: itself, a symbolic link or a hard link at `at`.
fn name(how: &str, target: &Path, at: &Path) -> PathBuf {
    std::fs::create_dir_all(at.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(at);
    match how {
        "path" => return target.to_path_buf(),
        "symlink" => std::os::unix::fs::symlink(target, at).unwrap(),
        _ => std::fs::hard_link(target, at).unwrap(),
    }
    at.to_path_buf()
}

#[test]
fn no_output_flag_overwrites_any_input_by_any_name() {
    let d = fresh_dir("phalanx-outputs", "matrix");
    let outputs = [
        "--log-json",
        "--trace",
        "log.report",
        "--save-final",
        "sidecar",
    ];
    let mut n = 0;
    for (input, file, in_flags) in inputs(&d) {
        let before = std::fs::read(&file).unwrap();
        for out in outputs {
            for how in ["path", "symlink", "hardlink"] {
                // The sidecar by path is the data file named config.json.
                if out == "sidecar" && how == "path" && input != "data.path" {
                    continue;
                }
                let tag = format!("{input} x {out} x {how}");
                let link_dir = d.join(format!("links-{n}"));
                n += 1;
                let (flag_out, shown) = if out == "sidecar" {
                    let at = name(how, &file, &link_dir.join("config.json"));
                    let dir = at.parent().unwrap().to_path_buf();
                    (
                        vec![
                            "--save-final".to_string(),
                            dir.join("m.safetensors").to_str().unwrap().to_string(),
                        ],
                        "config.json",
                    )
                } else {
                    let at = name(how, &file, &link_dir.join("out.file"));
                    let p = at.to_str().unwrap().to_string();
                    match out {
                        "log.report" => (
                            vec!["--set".into(), format!("log.report={p:?}")],
                            "log.report",
                        ),
                        f => (vec![f.to_string(), p], f),
                    }
                };
                let mut args: Vec<String> =
                    vec!["train".into(), "--nproc-per-node".into(), "1".into()];
                args.extend(SMALL.iter().map(|s| s.to_string()));
                args.extend(in_flags.iter().cloned());
                args.extend(flag_out);
                let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
                let (code, stdout, err) = phalanx(&argv);
                assert_eq!(code, 2, "{tag}: {stdout}{err}");
                assert!(
                    err.contains("refusing to overwrite an input"),
                    "{tag}: {err}"
                );
                assert!(
                    err.contains(shown),
                    "{tag}: the flag should be named: {err}"
                );
                assert!(
                    err.contains(input) || err.contains("--resume"),
                    "{tag}: the input should be named: {err}"
                );
                assert!(!stdout.contains("done:"), "{tag}: trained: {stdout}");
                assert_eq!(
                    std::fs::read(&file).unwrap(),
                    before,
                    "{tag}: the input changed"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn outputs_inside_checkpoint_entries_and_input_directories_are_refused() {
    let d = fresh_dir("phalanx-outputs", "inside");
    std::fs::create_dir_all(d.join("corpus")).unwrap();
    std::fs::write(d.join("corpus/a.txt"), "text ".repeat(400)).unwrap();
    let ck = d.join("ck");
    // (flags, words the error must hold)
    let cases: Vec<(Vec<String>, &str)> = vec![
        // An output in a data directory would join the corpus.
        (
            vec![
                "--set".into(),
                format!("data.path={:?}", d.join("corpus").to_str().unwrap()),
                "--log-json".into(),
                d.join("corpus/log.jsonl").to_str().unwrap().into(),
            ],
            "is inside data file (data.path)",
        ),
        // `latest` and step directories are the checkpoints' own.
        (
            vec![
                "--set".into(),
                format!("checkpoint.dir={:?}", ck.to_str().unwrap()),
                "--set".into(),
                "checkpoint.interval=1".into(),
                "--log-json".into(),
                ck.join("latest").to_str().unwrap().into(),
            ],
            "where checkpoints are written",
        ),
        (
            vec![
                "--set".into(),
                format!("checkpoint.dir={:?}", ck.to_str().unwrap()),
                "--set".into(),
                "checkpoint.interval=1".into(),
                "--trace".into(),
                ck.join("step-00000001/t.json").to_str().unwrap().into(),
            ],
            "where checkpoints are written",
        ),
        // Checkpoints in a data directory would be read as data by the
        // next run (and its data fingerprint would refuse the resume).
        (
            vec![
                "--set".into(),
                format!("data.path={:?}", d.join("corpus").to_str().unwrap()),
                "--set".into(),
                format!("checkpoint.dir={:?}", d.join("corpus/ck").to_str().unwrap()),
                "--set".into(),
                "checkpoint.interval=1".into(),
            ],
            "is inside data file (data.path)",
        ),
        // Checkpoints written into the checkpoint resumed.
        (
            vec![
                "--resume".into(),
                ck.join("step-00000002").to_str().unwrap().into(),
                "--set".into(),
                format!(
                    "checkpoint.dir={:?}",
                    ck.join("step-00000002").to_str().unwrap()
                ),
                "--set".into(),
                "checkpoint.interval=1".into(),
            ],
            "is --resume checkpoint",
        ),
        // ZeRO's NVMe offload writes files in a directory: not a file, not
        // a checkpoint entry.
        (
            vec![
                "--set".into(),
                "zero_optimization.offload_optimizer.device=\"nvme\"".into(),
                "--set".into(),
                format!(
                    "zero_optimization.offload_optimizer.nvme_path={:?}",
                    d.join("corpus/a.txt").to_str().unwrap()
                ),
            ],
            "nvme_path",
        ),
        (
            vec![
                "--set".into(),
                format!("checkpoint.dir={:?}", ck.to_str().unwrap()),
                "--set".into(),
                "checkpoint.interval=1".into(),
                "--set".into(),
                "zero_optimization.stage=3".into(),
                "--set".into(),
                "zero_optimization.offload_param.device=\"nvme\"".into(),
                "--set".into(),
                format!(
                    "zero_optimization.offload_param.nvme_path={:?}",
                    ck.join("step-00000004").to_str().unwrap()
                ),
            ],
            "offload_param.nvme_path",
        ),
    ];
    std::fs::create_dir_all(ck.join("step-00000002")).unwrap();
    std::fs::write(ck.join("step-00000002/metadata.json"), b"{}").unwrap();
    for (flags, want) in cases {
        let mut args: Vec<String> = vec!["train".into(), "--nproc-per-node".into(), "1".into()];
        args.extend(SMALL.iter().map(|s| s.to_string()));
        args.extend(flags.clone());
        let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (code, out, err) = phalanx(&argv);
        assert_eq!(code, 2, "{flags:?}: {out}{err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        if want.contains("nvme_path") {
            assert!(
                err.contains("is a file, not a directory") || err.contains("in checkpoint.dir"),
                "{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn another_models_config_json_is_not_replaced_without_force() {
    let d = fresh_dir("phalanx-outputs", "foreign");
    let llama = repo().join("crates/phalanx-models/tests/fixtures/llama_gqa/config.json");
    // (config.json there, words the error must hold)
    let cases: &[(&[u8], &str)] = &[
        (&std::fs::read(&llama).unwrap(), "describes another model"),
        (
            b"{not json",
            "is not a config.json of a model Phalanx writes",
        ),
        (
            br#"{"model_type": "bert"}"#,
            "is not a config.json of a model Phalanx writes",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let out = d.join(format!("m{i}"));
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("config.json"), text).unwrap();
        let save = out.join("model.safetensors");
        let mut args = vec!["train", "--nproc-per-node", "1"];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(&["--save-final", save.to_str().unwrap()]);
        let (code, o, err) = phalanx(&args);
        assert_eq!(code, 2, "{want}: {o}{err}");
        assert!(err.contains(want) && err.contains("--force"), "{err}");
        assert!(
            err.contains(out.join("config.json").to_str().unwrap()),
            "{err}"
        );
        assert_eq!(&std::fs::read(out.join("config.json")).unwrap(), text);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn plan_write_config_never_overwrites_its_inputs() {
    let d = fresh_dir("phalanx-outputs", "plan");
    let toml = d.join("run.toml");
    std::fs::write(&toml, "[train]\nsteps = 2\n").unwrap();
    let data = d.join("corpus.txt");
    std::fs::write(&data, "text ".repeat(100)).unwrap();
    let link = d.join("link.toml");
    std::os::unix::fs::symlink(&toml, &link).unwrap();
    let set_data = format!("data.path={:?}", data.to_str().unwrap());
    for (target, want) in [
        (&toml, "--config"),
        (&data, "data.path"),
        (&link, "--config"),
    ] {
        let args = [
            "plan",
            "--config",
            toml.to_str().unwrap(),
            "--set",
            &set_data,
            "--nproc",
            "2",
            "--write-config",
            target.to_str().unwrap(),
        ];
        let (code, out, err) = phalanx(&args);
        assert_ne!(code, 0, "{target:?}: {out}{err}");
        assert!(
            err.contains("refusing to overwrite an input") && err.contains(want),
            "{err}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(&toml).unwrap(),
        "[train]\nsteps = 2\n"
    );
    assert_eq!(std::fs::read_to_string(&data).unwrap(), "text ".repeat(100));
    let _ = std::fs::remove_dir_all(&d);
}

/// An output whose directory is missing gets that one directory, never a
/// chain of them (issue 27, item 25): a typo'd path is refused, naming the
/// missing directory, and nothing is created.
#[test]
fn an_output_gets_its_own_directory_and_no_more() {
    let d = fresh_dir("phalanx-outputs", "own-dir");
    let run = |log: &Path| {
        let mut a: Vec<String> = ["train", "--nproc-per-node", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(train_args(log, 1));
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        phalanx(&a)
    };
    let deep = d.join("no/such/dir/log.jsonl");
    let (code, _, err) = run(&deep);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--log-json") && err.contains("no/such"),
        "{err}"
    );
    assert!(!d.join("no").exists(), "a directory was created");
    // A path ending in `/` names a directory: refused before the run, not
    // when the file is written at its end.
    let slash = PathBuf::from(format!("{}/", d.join("out").display()));
    let (code, _, err) = run(&slash);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ends in `/`"), "{err}");
    let one = d.join("new/log.jsonl");
    let (code, _, err) = run(&one);
    assert_eq!(code, 0, "{err}");
    assert!(one.is_file());
    let _ = std::fs::remove_dir_all(&d);
}

/// An output whose path another output's directory, or a checkpoint
/// directory, lies in (or is) would be a directory by the time it is
/// written: refused before any rank starts, naming both, and nothing is
/// created.
#[test]
fn an_output_that_another_outputs_directory_would_take_is_refused() {
    let d = fresh_dir("phalanx-outputs", "taken");
    let out = d.join("out");
    let ck = d.join("ck");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // (flags, the other flag or key the error must name)
    let cases: Vec<(Vec<String>, &str)> = vec![
        // GPT-2 weights to the file `out`, the log into directory `out/`.
        (
            vec![
                "--save-final".into(),
                s(&out),
                "--log-json".into(),
                s(&out.join("log.jsonl")),
            ],
            "--log-json",
        ),
        // The final model at the checkpoint directory itself.
        (
            vec![
                "--save-final".into(),
                s(&ck),
                "--set".into(),
                format!("checkpoint.dir={:?}", s(&ck)),
                "--set".into(),
                "checkpoint.interval=1".into(),
            ],
            "checkpoint.dir",
        ),
        // ... or above it.
        (
            vec![
                "--trace".into(),
                s(&out),
                "--set".into(),
                format!("checkpoint.dir={:?}", s(&out.join("runs/ck"))),
                "--set".into(),
                "checkpoint.interval=1".into(),
            ],
            "checkpoint.dir",
        ),
    ];
    for (flags, other) in cases {
        let mut args: Vec<String> = vec!["train".into(), "--nproc-per-node".into(), "1".into()];
        args.extend(SMALL.iter().map(|s| s.to_string()));
        args.extend(["--set".into(), "train.steps=2".into()]);
        args.extend(flags.clone());
        let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (code, stdout, err) = phalanx(&argv);
        assert_eq!(code, 2, "{flags:?}: {stdout}{err}");
        assert!(!stdout.contains("done:"), "{flags:?}: trained: {stdout}");
        assert!(
            err.contains(&flags[0]) && err.contains(other) && err.contains("directory"),
            "{flags:?}: {err}"
        );
        assert!(!out.exists() && !ck.exists(), "{flags:?}: created");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A graceful stop (SIGUSR1 under an elastic agent) ends the round at a
/// step boundary with the model partly trained: `--save-final` is not
/// written then (the round that finishes writes it), and the run says so.
#[test]
fn a_graceful_stop_writes_no_final_model() {
    use std::time::{Duration, Instant};
    let d = fresh_dir("phalanx-outputs", "stop");
    let log = d.join("log.jsonl");
    let model = d.join("m.safetensors");
    let mut c = std::process::Command::new(BIN);
    c.current_dir(repo())
        .arg("train")
        .args(train_args(&log, 100_000))
        .args(["--save-final", model.to_str().unwrap()]);
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    // One rank of a job of one, as an elastic agent starts it.
    c.envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("PHALANX_ELASTIC", "1")]);
    use std::os::unix::process::CommandExt;
    c.process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = c.spawn().unwrap();
    let pid = child.id() as i32;
    let kill = || {
        // SAFETY: kill(2) on the group this child leads.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    };
    // The handler is installed before the first step is logged.
    let t0 = Instant::now();
    while std::fs::read_to_string(&log).map_or(0, |t| t.lines().count()) < 1 {
        if t0.elapsed() > Duration::from_secs(180) {
            kill();
            panic!("no step logged: {:?}", child.wait_with_output());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the child.
    unsafe { libc::kill(pid, libc::SIGUSR1) };
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() {
        if t0.elapsed() > Duration::from_secs(300) {
            kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = waiter.join().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(75), "{out}\n{err}");
    assert!(out.contains("stopping after step"), "{out}");
    assert!(!model.exists(), "a partial model was saved: {out}");
    assert!(
        !out.lines().any(|l| l.starts_with("saved ")) && out.contains("not saved"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
