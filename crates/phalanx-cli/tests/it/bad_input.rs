//! Bad input through the CLI, one table per command: each case exits
//! non-zero at once with a message naming what is wrong. And two things
//! that must simply work: `phalanx train` from any directory (the default
//! corpus is built in), and a tokens/s figure for a 2-step run.

use crate::common;
use common::*;

use std::path::Path;
use std::process::Command;

fn phalanx(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("RANK")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn bad_training_numbers_name_the_key() {
    // (override, words the message must hold)
    let cases: &[(&str, &str)] = &[
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.grad_clip=nan", "optim.grad_clip"),
        ("parallel.bucket_mb=nan", "parallel.bucket_mb"),
        ("optim.betas=[0.9,1.0]", "optim.betas[1]"),
        ("optim.betas=[-0.1,0.9]", "optim.betas[0]"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.min_lr=1.0", "optim.min_lr"),
        ("train.steps=0", "train.steps"),
        ("train.micro_batch_size=-5", "train.micro_batch_size"),
        ("model.n_layer=-2", "model.n_layer"),
        (
            "monitor.straggler_factor=0.9",
            "monitor.straggler_factor must be a number above 1",
        ),
        // A device this build has no backend for, before any rank starts.
        ("train.device=\"cuda\"", "no CUDA backend"),
        ("train.device=\"tpu\"", "train.device"),
    ];
    for (set, want) in cases {
        let mut args = vec!["train", "--nproc-per-node", "1"];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(&["--set", set]);
        let (code, out, err) = phalanx(&repo(), &args);
        assert_eq!(code, 2, "{set}: {out}{err}");
        assert!(
            err.contains(want),
            "{set}: the message should name {want}: {err}"
        );
        // At once: refused before any training step.
        assert!(
            !out.contains("step ") && !out.contains("done:"),
            "{set}: trained before the check: {out}"
        );
    }
}

/// A model configured far beyond the machine (a 2^19-wide layer: 3.3e12
/// parameters in one block) is an error naming the block and the memory,
/// not the allocator's abort.
#[test]
fn a_model_too_big_for_the_machine_is_an_error() {
    let mut args = vec!["train", "--nproc-per-node", "1"];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(&[
        "--set",
        "model.n_embd=524288",
        "--set",
        "model.n_head=1",
        "--set",
        "model.n_layer=1",
    ]);
    let (code, out, err) = phalanx(&repo(), &args);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("block 1 declares") && err.contains("of memory and swap"),
        "{err}"
    );
    assert!(!err.contains("memory allocation of"), "{err}");
}

#[test]
fn bad_generate_input_names_it() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "badgen");
    let model = d.join("model.safetensors");
    std::fs::write(&model, b"not a model").unwrap();
    let m = model.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["generate", "--model", m, "--temperature", "nan"],
            "--temperature",
        ),
        (
            vec!["generate", "--model", m, "--temperature=-1"],
            "--temperature",
        ),
    ];
    for (args, want) in &cases {
        let (code, out, err) = phalanx(&repo(), args);
        assert_ne!(code, 0, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // A config.json beside the model that does not parse is named.
    std::fs::write(d.join("config.json"), b"{ broken").unwrap();
    let (code, _, err) = phalanx(&repo(), &["generate", "--model", m]);
    assert_ne!(code, 0);
    assert!(err.contains("config.json"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn train_runs_from_any_directory_and_reports_tokens_per_second() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "anydir");
    let mut args = vec!["train", "--nproc-per-node", "1", "--set", "train.steps=2"];
    args.extend_from_slice(SMALL);
    let (code, out, err) = phalanx(&d, &args);
    assert_eq!(code, 0, "{out}\n{err}");
    let line = out
        .lines()
        .find(|l| l.contains("done:"))
        .expect("a summary");
    let tok: f64 = line
        .split(',')
        .find(|p| p.contains("tokens/s"))
        .and_then(|p| p.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("a tokens/s figure");
    assert!(tok > 0.0, "{line}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Saved models take the process umask's permissions (not 0600), and no
/// temporary file is left beside them.
#[test]
fn saved_models_use_the_umask_and_leave_no_temporary() {
    use std::os::unix::fs::PermissionsExt;
    let d = std::env::temp_dir().join(format!("phalanx-perm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let out = d.join("model.safetensors");
    let mut args = vec![
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        "train.steps=1",
        "--save-final",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(SMALL);
    // Under umask 022, whatever the test runner's: 0644.
    let out_ = Command::new("sh")
        .arg("-c")
        .arg("umask 022; exec \"$0\" \"$@\"")
        .arg(BIN)
        .args(&args)
        .current_dir(repo())
        .env_remove("RANK")
        .output()
        .unwrap();
    let (code, o, e) = (
        out_.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out_.stdout),
        String::from_utf8_lossy(&out_.stderr),
    );
    assert_eq!(code, 0, "{o}{e}");
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "model file mode {mode:o}");
    let names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(names.iter().all(|n| !n.contains("tmp")), "{names:?}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Outputs are checked before training starts, and an output that is an
/// input is refused (table: arguments, words the message must hold).
#[test]
fn outputs_are_checked_before_training() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "outs");
    std::fs::create_dir_all(d.join("adir")).unwrap();
    let data = d.join("data.txt");
    std::fs::write(&data, "x".repeat(20_000)).unwrap();
    let data_set = format!("data.path=\"{}\"", data.display());
    let s = |p: &str| d.join(p).to_str().unwrap().to_string();
    let (adir, data_s) = (s("adir"), s("data.txt"));
    let under_file = format!("{}/sub/m.safetensors", data_s);
    let log_same = s("same.json");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--save-final", &adir], "is a directory"),
        (
            vec!["--log-json", &data_s],
            "refusing to overwrite an input",
        ),
        (vec!["--save-final", &under_file], "--save-final"),
        (
            vec!["--log-json", &log_same, "--trace", &log_same],
            "same file",
        ),
    ];
    for (extra, want) in &cases {
        let mut args = vec!["train", "--nproc-per-node", "1", "--set", &data_set];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(extra);
        let (code, out, err) = phalanx(&repo(), &args);
        assert_eq!(code, 2, "{extra:?}: {out}{err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(
            !out.contains("step ") && !out.contains("done:"),
            "{extra:?}: no training before the check"
        );
    }
    assert_eq!(
        std::fs::read(&data).unwrap().len(),
        20_000,
        "the input is intact"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A JSON log on a full device: the run stops with an error naming the
/// file and the step (lines are written whole or not at all).
#[cfg(target_os = "linux")]
#[test]
fn a_full_disk_under_the_json_log_is_named() {
    assert!(Path::new("/dev/full").exists(), "Linux has /dev/full");
    let mut args = vec![
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        "train.steps=3",
        "--log-json",
        "/dev/full",
    ];
    args.extend_from_slice(SMALL);
    let (code, out, err) = phalanx(&repo(), &args);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("/dev/full") && err.contains("JSON log line of step 0"),
        "{err}"
    );
    // It stopped there: no step's progress line ("step 1/3 | loss ..."),
    // nor the end of the run.
    assert!(
        !out.contains("| loss ") && !out.contains("done:"),
        "went on after the failed write: {out}"
    );
}

/// Messages name what is wrong: a directory given as the data file, and a
/// pipeline too deep for the model says what a block is.
#[test]
fn messages_name_the_file_and_explain_blocks() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "msgs");
    std::fs::create_dir_all(d.join("x.bin")).unwrap();
    let data = format!("data.path=\"{}\"", d.join("x.bin").display());
    let mut args = vec!["train", "--nproc-per-node", "1", "--set", &data];
    args.extend_from_slice(SMALL);
    let (code, _, err) = phalanx(&repo(), &args);
    assert_ne!(code, 0);
    assert!(
        err.contains("x.bin") && err.contains("is a directory"),
        "{err}"
    );
    let mut args = vec![
        "train",
        "--nproc-per-node",
        "4",
        "--set",
        "parallel.pp=4",
        "--set",
        "train.grad_accum_steps=4",
    ];
    args.extend_from_slice(SMALL);
    let (code, _, err) = phalanx(&repo(), &args);
    // Said once, by the launcher, before any rank starts (each rank used to
    // say it, exiting 1).
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("n_layer + 2 blocks"), "{err}");
    assert_eq!(err.matches("n_layer + 2 blocks").count(), 1, "{err}");
    for (nproc, layout, want) in [
        (
            "3",
            "parallel.tp=3",
            "is not divisible by the tensor-parallel size 3",
        ),
        (
            "2",
            "parallel.pp_partition=\"2,3\"",
            "need 2 non-zero sizes",
        ),
        // Sizes whose sum wraps round to the model's 3 blocks.
        (
            "2",
            "parallel.pp_partition=\"18446744073709551615,4\"",
            "need 2 non-zero sizes",
        ),
    ] {
        let mut args = vec!["train", "--nproc-per-node", nproc, "--set", layout];
        if layout.contains("partition") {
            args.extend_from_slice(&["--set", "parallel.pp=2"]);
        }
        args.extend_from_slice(SMALL);
        let (code, _, err) = phalanx(&repo(), &args);
        assert_eq!(code, 2, "{layout}: {err}");
        assert_eq!(err.matches(want).count(), 1, "{layout}: {err}");
    }
    // A compressed file as the one data.path is refused, not trained on as
    // bytes (as it is among many files), with a tokenizer.json too.
    let gz = d.join("small.txt.gz");
    std::fs::write(&gz, b"\x1f\x8b\x08\x00 compressed bytes".repeat(400)).unwrap();
    let data = format!("data.path=\"{}\"", gz.display());
    std::fs::write(
        d.join("tokenizer.json"),
        r#"{"version": "1.0", "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "unk_token": "u", "vocab": {"u": 0, "a": 1}}}"#,
    )
    .unwrap();
    let tok = format!("data.tokenizer=\"{}\"", d.join("tokenizer.json").display());
    for extra in [vec![], vec!["--set", tok.as_str()]] {
        let mut args = vec!["train", "--nproc-per-node", "1", "--set", &data];
        args.extend_from_slice(SMALL);
        args.extend(extra.iter().copied());
        let (code, _, err) = phalanx(&repo(), &args);
        assert_ne!(code, 0, "{extra:?}");
        assert!(
            err.contains("small.txt.gz") && err.contains("decompress it first"),
            "{extra:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Under torchrun a failing rank writes its error to
/// `TORCHELASTIC_ERROR_FILE` in torchelastic's JSON shape, whole (no
/// temporary left beside it), so torchrun's summary names the root cause:
/// a config error before training, and an error inside a job's rank.
#[test]
fn a_failing_rank_writes_torchruns_error_file() {
    let dir = fresh_dir("phalanx-errfile", "cases");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    // Case 1: a rank of a job whose rendezvous store is not there (what a
    // rank reports when its job cannot form), within PHALANX_TIMEOUT.
    // (flags, environment, exit code, what the message must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], i32, &'a str);
    let cases: &[Case] = &[
        (&["--set", "optim.lr=nan"], &[("RANK", "1")], 2, "optim.lr"),
        (
            &[],
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
                ("PHALANX_SECRET", "00112233445566778899aabbccddeeff"),
                ("PHALANX_TIMEOUT", "2"),
            ],
            1,
            "rendezvous store",
        ),
    ];
    for (k, (sets, env, want_code, want)) in cases.iter().enumerate() {
        let file = dir.join(format!("error-{k}.json"));
        let mut args = vec!["train", "--set", "train.steps=2"];
        args.extend_from_slice(sets);
        let out = Command::new(BIN)
            .args(&args)
            .current_dir(repo())
            .env_remove("RANK")
            .envs(env.iter().copied())
            .env("TORCHELASTIC_ERROR_FILE", &file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(*want_code), "case {k}: {err}");
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("case {k}: no error file ({e}): {err}"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let msg = v["message"]["message"].as_str().unwrap();
        let rank = env.iter().find(|(k, _)| *k == "RANK").unwrap().1;
        assert!(
            msg.starts_with(&format!("rank {rank} (")) && msg.contains(want),
            "case {k}: {msg}"
        );
        let ts = v["message"]["extraInfo"]["timestamp"].as_str().unwrap();
        assert!(ts.parse::<u64>().unwrap() > 1_600_000_000, "case {k}: {ts}");
        assert!(v["message"]["extraInfo"]["py_callstack"]
            .as_str()
            .unwrap()
            .contains(want));
    }
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where a file is expected, a device, a FIFO or an oversized file is
/// refused naming it (issue 27, item 9): never an endless read of
/// `/dev/zero`, never a hang on a FIFO with no writer. A `latest` that
/// points at `/dev/zero` is not read either; the run goes on.
#[test]
fn devices_fifos_and_oversized_files_are_refused_not_read() {
    let d = fresh_dir("phalanx-nonregular", "cases");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a fresh path of the test's own directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let big = d.join("big.toml");
    std::fs::write(&big, vec![b'#'; (16 << 20) + 1]).unwrap();
    let log = d.join("log.jsonl");
    std::fs::write(&log, "{\"step\": 0, \"loss\": 1.0}\n").unwrap();
    let (fifo_s, big_s, log_s) = (
        fifo.to_str().unwrap(),
        big.to_str().unwrap(),
        log.to_str().unwrap(),
    );
    let data = |p: &str| format!("data.path=\"{p}\"");
    let (zero, ff) = (data("/dev/zero"), data(fifo_s));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["train", "--config", "/dev/zero"], "not a regular file"),
        (vec!["train", "--config", fifo_s], "not a regular file"),
        (vec!["train", "--config", big_s], "larger than 16 MiB"),
        (
            vec!["train", "--nproc-per-node", "1", "--set", &zero],
            "not a regular file",
        ),
        (
            vec!["train", "--nproc-per-node", "1", "--set", &ff],
            "not a regular file",
        ),
        (
            vec!["report", log_s, "--trace", "/dev/zero"],
            "not a regular file",
        ),
        (
            vec!["report", log_s, "--trace", fifo_s],
            "not a regular file",
        ),
        (vec!["report", "/dev/zero"], "not a regular file"),
    ];
    for (args, want) in &cases {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).args(args);
        let r = run_until(c, std::time::Duration::from_secs(60));
        assert_ne!(r.code, 0, "{args:?}: {r}");
        assert!(r.err.contains(want), "{args:?}: {r}");
        let named = args
            .last()
            .unwrap()
            .trim_start_matches("data.path=")
            .trim_matches('"');
        assert!(r.err.contains(named), "{args:?} does not name {named}: {r}");
    }
    // `latest` linked to /dev/zero: read within a cap, ignored, and the
    // run starts fresh.
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    std::os::unix::fs::symlink("/dev/zero", ck.join("latest")).unwrap();
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", "1", "--resume", "auto"])
        .args(SMALL)
        .args(["--set", "train.steps=1"])
        .args(["--set", &format!("checkpoint.dir=\"{}\"", ck.display())]);
    let r = run_until(c, std::time::Duration::from_secs(60));
    assert_eq!(r.code, 0, "{r}");
    let _ = std::fs::remove_dir_all(&d);
}

/// The arithmetic table (issue 27, item 20): numbers whose products or
/// sums used to wrap, saturate or run for minutes are refused at once,
/// naming the key or flag.
#[test]
fn numbers_that_would_wrap_are_refused_naming_the_key() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx", "arith");
    let ds = |body: &str| {
        let p = d.join(format!("ds-{}.json", body.len()));
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let max = u64::MAX.to_string();
    let (ds_big, ds_zero, ds_warm) = (
        ds(r#"{"train_batch_size": 18446744073709551616}"#),
        ds(r#"{"train_batch_size": 0}"#),
        ds(
            r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e30}}}"#,
        ),
    );
    let train = |set: &str| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--nproc-per-node", "1"]
            .iter()
            .chain(SMALL)
            .map(|s| s.to_string())
            .collect();
        a.extend(["--set".into(), set.to_string()]);
        a
    };
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // (arguments, words the message must hold)
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            {
                let mut a = train("train.micro_batch_size=4611686018427387908");
                a.extend(["--set".into(), "train.grad_accum_steps=4".into()]);
                a
            },
            "train.micro_batch_size",
        ),
        (
            {
                let mut a = train("train.micro_batch_size=1048576");
                a.extend(["--set".into(), "train.grad_accum_steps=2097152".into()]);
                a
            },
            "train.grad_accum_steps",
        ),
        (train("train.steps=2199023255552"), "train.steps"),
        (
            train("optim.warmup_steps=9223372036854775807"),
            "optim.warmup_steps",
        ),
        (
            train("monitor.prometheus_port=65536"),
            "monitor.prometheus_port",
        ),
        (args(&["train", "--config", &ds_big]), "train_batch_size"),
        (args(&["train", "--config", &ds_zero]), "train_batch_size"),
        (args(&["train", "--config", &ds_warm]), "warmup_num_steps"),
        (args(&["bench", "collectives", "--iters", &max]), "--iters"),
        (
            args(&["bench", "collectives", "--warmup", &max]),
            "--warmup",
        ),
        (args(&["plan", "--nproc", &max]), "--nproc"),
        (args(&["plan", "--nnodes", "4294967296"]), "--nnodes"),
        (args(&["plan", "--flops", "0"]), "--flops"),
        (args(&["plan", "--flops", "nan"]), "--flops"),
        (args(&["plan", "--bandwidth", "0"]), "--bandwidth"),
        (args(&["plan", "--inter-bandwidth=-1"]), "--inter-bandwidth"),
        (
            args(&["run", "--nnodes", "4294967296", "--", "true"]),
            "--nnodes",
        ),
    ];
    for (a, want) in &cases {
        let refs: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        let (code, out, err) = phalanx(&repo(), &refs);
        assert!(code != 0, "{a:?}: rc 0: {out}{err}");
        assert!(
            err.contains(want),
            "{a:?}: the message should name {want}: {err}"
        );
        assert!(
            !out.contains("done:") && !out.contains("us "),
            "{a:?}: ran before the check: {out}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}
