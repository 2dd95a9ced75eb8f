//! `phalanx checkpoint inspect | convert | from-hf` end to end, as a user
//! runs them: checkpoints written by `phalanx train` (DDP and ZeRO-3 on 2
//! ranks) inspect clean, convert to the very tensors `--save-final` wrote,
//! and import back bitwise; broken checkpoints and checkpoints of another
//! model are refused naming the file or the tensor.

use crate::common;
use common::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tmpdir(name: &str) -> ScratchDir {
    fresh_dir("phalanx-ckcmd", name)
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

fn phalanx<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Out {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(repo())
        .env_remove("RANK")
        .output()
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `phalanx train` of the small model with `extra` arguments.
fn train(extra: &[String]) -> Out {
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(SMALL.iter().map(|a| a.to_string()));
    args.extend(extra.iter().cloned());
    phalanx(&args)
}

/// Train 4 steps on 2 ranks with checkpoints every 2 under `dir/ck`, and
/// the final model saved to `dir/final.safetensors`.
fn train_with_checkpoints(dir: &Path, extra: &[&str]) -> PathBuf {
    let mut args: Vec<String> = [
        "--nproc-per-node",
        "2",
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.interval=2",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.push("--set".into());
    args.push(format!("checkpoint.dir=\"{}\"", dir.join("ck").display()));
    args.push("--save-final".into());
    args.push(s(&dir.join("final.safetensors")));
    for e in extra {
        args.push("--set".into());
        args.push(e.to_string());
    }
    let o = train(&args);
    assert_eq!(o.code, 0, "{}", o.all());
    dir.join("ck")
}

/// A safetensors file's tensors as raw bytes (f32 little endian), by name.
fn tensors(p: &Path) -> HashMap<String, (Vec<usize>, Vec<u32>)> {
    candle_core::safetensors::load(p, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let bits = t
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (k, (t.dims().to_vec(), bits))
        })
        .collect()
}

fn assert_same_tensors(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    let mut names: Vec<&String> = ta.keys().collect();
    names.sort();
    let mut other: Vec<&String> = tb.keys().collect();
    other.sort();
    assert_eq!(names, other, "{} vs {}", a.display(), b.display());
    for n in names {
        assert!(
            ta[n] == tb[n],
            "tensor {n} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

fn inspect_json(path: &Path) -> (i32, serde_json::Value) {
    let o = phalanx(&["checkpoint", "inspect", "--json", &s(path)]);
    let v = serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", o.all()));
    (o.code, v)
}

/// Inspect, convert (bitwise the `--save-final` file), import back, convert
/// again (bitwise), for checkpoints of one layout; returns the import.
fn round_trip(what: &str, extra: &[&str], zero_stage: u64) -> (ScratchDir, PathBuf) {
    let d = tmpdir(what);
    let ck = train_with_checkpoints(&d, extra);
    let fin = d.join("final.safetensors");

    // inspect: the latest checkpoint, whole and verified.
    let (code, v) = inspect_json(&ck);
    assert_eq!(code, 0, "{what}: {v}");
    assert_eq!(v["ok"], true, "{what}: {v}");
    assert_eq!(v["step"], 4, "{what}: {v}");
    assert_eq!(v["layout"]["world"], 2, "{what}: {v}");
    assert_eq!(v["layout"]["zero_stage"], zero_stage, "{what}: {v}");
    assert_eq!(v["optimizer"]["kind"], "adamw", "{what}: {v}");
    assert_eq!(v["files"].as_array().unwrap().len(), 2, "{what}: {v}");
    assert_eq!(v["num_tensors"], 16, "{what}: {v}");
    let o = phalanx(&["checkpoint", "inspect", "--tensors", &s(&ck)]);
    assert_eq!(o.code, 0, "{what}: {}", o.all());
    for want in [
        "step-00000004",
        "step             4",
        "transformer.wte.weight",
        "[256, 32]",
        "rank-00001.safetensors",
        "complete",
    ] {
        assert!(o.stdout.contains(want), "{what}: `{want}` in {}", o.stdout);
    }

    // convert: the model, gathered, is what --save-final wrote.
    let conv = d.join("out/converted.safetensors");
    let o = phalanx(&["checkpoint", "convert", &s(&ck), &s(&conv)]);
    assert_eq!(o.code, 0, "{what}: {}", o.all());
    assert!(d.join("out/config.json").is_file());
    assert_same_tensors(&conv, &fin);
    // An existing OUT needs --force; an OUT inside the checkpoints never.
    let o = phalanx(&["checkpoint", "convert", &s(&ck), &s(&conv)]);
    assert!(o.code != 0 && o.stderr.contains("--force"), "{}", o.all());
    let o = phalanx(&["checkpoint", "convert", "--force", &s(&ck), &s(&conv)]);
    assert_eq!(o.code, 0, "{what}: {}", o.all());
    let inside = ck.join("model.safetensors");
    let o = phalanx(&["checkpoint", "convert", &s(&ck), &s(&inside)]);
    assert!(
        o.code != 0 && o.stderr.contains("inside the checkpoint directory") && !inside.exists(),
        "{}",
        o.all()
    );

    // GPT-2 is written as one file: an existing directory as OUT is named
    // as such at once (not "exists (--force replaces it)", then refused
    // with --force).
    std::fs::create_dir_all(d.join("a-dir")).unwrap();
    for force in [false, true] {
        let (src, out) = (s(&ck), s(&d.join("a-dir")));
        let mut args = vec!["checkpoint", "convert", &src, &out];
        if force {
            args.push("--force");
        }
        let o = phalanx(&args);
        assert!(
            o.code == 2 && o.stderr.contains("is a directory"),
            "{}",
            o.all()
        );
    }

    // from-hf and back: bitwise again.
    let imp = d.join("imported");
    let o = phalanx(&["checkpoint", "from-hf", &s(&fin), &s(&imp)]);
    assert_eq!(o.code, 0, "{what}: {}", o.all());
    assert!(imp.join("step-00000000/metadata.json").is_file());
    assert_eq!(
        std::fs::read_to_string(imp.join("latest")).unwrap().trim(),
        "step-00000000"
    );
    let (code, v) = inspect_json(&imp);
    assert_eq!(code, 0, "{what}: {v}");
    assert_eq!(v["step"], 0);
    assert!(v["optimizer"].is_null(), "{v}");
    assert_eq!(v["state"], serde_json::json!(["param"]), "{v}");
    let back = d.join("back.safetensors");
    let o = phalanx(&["checkpoint", "convert", &s(&imp), &s(&back)]);
    assert_eq!(o.code, 0, "{what}: {}", o.all());
    assert_same_tensors(&back, &fin);
    // A directory that already holds checkpoints is not written into.
    let o = phalanx(&["checkpoint", "from-hf", &s(&fin), &s(&imp)]);
    assert!(
        o.code != 0 && o.stderr.contains("already holds checkpoints"),
        "{}",
        o.all()
    );
    // Nor into the weights' own directory (`generate --model` there would
    // load the checkpoint), nor inside a checkpoint.
    for (out, want) in [
        (fin.parent().unwrap().to_path_buf(), "is INPUT's directory"),
        (imp.join("step-00000000/x"), "is inside the checkpoint"),
    ] {
        let o = phalanx(&["checkpoint", "from-hf", &s(&fin), &s(&out)]);
        assert!(
            o.code == 2 && o.stderr.contains(want) && !out.join("latest").exists(),
            "{}",
            o.all()
        );
    }
    // A failed import leaves no directory behind: a config the weights
    // refuse, and weights that do not read.
    let none = d.join("not-made");
    let o = phalanx(&[
        "checkpoint",
        "from-hf",
        &s(&fin),
        &s(&none),
        "--set",
        "model.n_layer=7",
    ]);
    assert!(o.code != 0 && !none.exists(), "{}", o.all());
    std::fs::create_dir_all(d.join("bad")).unwrap();
    std::fs::write(d.join("bad/model.safetensors"), b"not safetensors").unwrap();
    let o = phalanx(&["checkpoint", "from-hf", &s(&d.join("bad")), &s(&none)]);
    assert!(o.code != 0 && !none.exists(), "{}", o.all());
    (d, imp)
}

#[test]
fn ddp_checkpoint_converts_and_imports_bitwise_and_the_import_trains() {
    let (d, imp) = round_trip("ddp", &[], 0);
    // The imported checkpoint resumes: parameters loaded, optimizer fresh.
    let o = train(&[
        "--nproc-per-node".into(),
        "2".into(),
        "--set".into(),
        "train.steps=2".into(),
        "--resume".into(),
        s(&imp),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.contains("resumed from") && o.stdout.contains("step-00000000"),
        "{}",
        o.all()
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn zero3_checkpoint_converts_and_imports_bitwise() {
    let (d, _) = round_trip("zero3", &["zero_optimization.stage=3"], 3);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn tensor_and_pipeline_parallel_checkpoints_convert_bitwise() {
    for (what, layout) in [("tp", "parallel.tp=2"), ("pp", "parallel.pp=2")] {
        let d = tmpdir(what);
        // Two layers, so that two pipeline stages each hold one.
        let ck = train_with_checkpoints(&d, &["model.n_layer=2", layout]);
        let (code, v) = inspect_json(&ck);
        assert_eq!(code, 0, "{what}: {v}");
        let conv = d.join("converted.safetensors");
        let o = phalanx(&["checkpoint", "convert", &s(&ck), &s(&conv)]);
        assert_eq!(o.code, 0, "{what}: {}", o.all());
        assert_same_tensors(&conv, &d.join("final.safetensors"));
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Flip one bit in the middle of a file.
fn flip_bit(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x10;
    std::fs::write(p, b).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn broken_checkpoints_are_refused_naming_the_file() {
    let d = tmpdir("broken");
    let ck = train_with_checkpoints(&d, &[]);
    let step = "step-00000004";
    // (what, file, how it is broken, the words of the error)
    type Break = fn(&Path);
    let cases: [(&str, &str, Break, &str); 3] = [
        (
            "truncated",
            "rank-00001.safetensors",
            |p| {
                let n = std::fs::metadata(p).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(n / 2)
                    .unwrap();
            },
            "truncated",
        ),
        ("bit-flipped", "rank-00000.safetensors", flip_bit, "corrupt"),
        (
            "missing",
            "rank-00001.safetensors",
            |p| std::fs::remove_file(p).unwrap(),
            "missing",
        ),
    ];
    for (what, file, breaks, words) in cases {
        let bad = d.join(what);
        copy_dir(&ck, &bad);
        breaks(&bad.join(step).join(file));
        let named = format!("{step}/{file}");

        let o = phalanx(&["checkpoint", "inspect", &s(&bad)]);
        assert!(
            o.code != 0 && o.stderr.contains(&named) && o.stderr.contains(words),
            "inspect of a {what} file: {}",
            o.all()
        );
        let (code, v) = inspect_json(&bad);
        assert!(code != 0 && v["ok"] == false, "{what}: {v}");
        assert!(v["problems"][0].as_str().unwrap().contains(&named), "{v}");

        let o = phalanx(&[
            "checkpoint",
            "convert",
            &s(&bad),
            &s(&d.join("x.safetensors")),
        ]);
        assert!(
            o.code != 0 && o.stderr.contains(&named),
            "convert of a {what} file: {}",
            o.all()
        );
        assert!(!d.join("x.safetensors").exists());

        let o = train(&[
            "--nproc-per-node".into(),
            "2".into(),
            "--set".into(),
            "train.steps=6".into(),
            "--resume".into(),
            s(&bad),
        ]);
        assert!(
            o.code != 0 && o.all().contains(&named) && o.all().contains(words),
            "--resume of a {what} file: {}",
            o.all()
        );
    }
    // One file truncated and the other bit-flipped: inspect names both
    // (the checkpoint does not open, and the other file is hashed anyway).
    let bad = d.join("both");
    copy_dir(&ck, &bad);
    let f0 = bad.join(step).join("rank-00000.safetensors");
    let f1 = bad.join(step).join("rank-00001.safetensors");
    flip_bit(&f0);
    let n = std::fs::metadata(&f1).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f1)
        .unwrap()
        .set_len(n / 2)
        .unwrap();
    let (code, v) = inspect_json(&bad);
    assert!(code != 0, "{v}");
    let problems = v["problems"].to_string();
    assert!(
        problems.contains("rank-00000.safetensors is corrupt")
            && problems.contains("rank-00001.safetensors"),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn resume_into_another_model_names_the_tensor() {
    let d = tmpdir("shape");
    let ck = train_with_checkpoints(&d, &[]);
    // (override, what the error must name)
    for (set, words) in [
        ("model.n_embd=48", "tensor `transformer."),
        ("model.n_layer=2", "no tensor `transformer.h.1."),
    ] {
        let o = train(&[
            "--nproc-per-node".into(),
            "1".into(),
            "--set".into(),
            set.into(),
            "--set".into(),
            "train.steps=6".into(),
            "--resume".into(),
            s(&ck),
        ]);
        assert!(o.code != 0 && o.all().contains(words), "{set}: {}", o.all());
    }
    // A shallower model than the checkpoint's is refused too (the
    // checkpoint's extra layer would be silently dropped otherwise).
    let deep = d.join("deep");
    let mut args: Vec<String> = vec![
        "--nproc-per-node".into(),
        "1".into(),
        "--set".into(),
        "model.n_layer=2".into(),
        "--set".into(),
        "train.steps=1".into(),
        "--set".into(),
        "checkpoint.interval=1".into(),
        "--set".into(),
    ];
    args.push(format!("checkpoint.dir=\"{}\"", deep.display()));
    let o = train(&args);
    assert_eq!(o.code, 0, "{}", o.all());
    let o = train(&[
        "--nproc-per-node".into(),
        "1".into(),
        "--set".into(),
        "train.steps=2".into(),
        "--resume".into(),
        s(&deep),
    ]);
    assert!(
        o.code != 0 && o.all().contains("tensor `transformer.h.1."),
        "{}",
        o.all()
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `checkpoint inspect` checks what a resume needs (issue 27, item 11):
/// an entry whose key is not in its file, two entries that overlap, and an
/// optimizer step count beyond the step are refused naming the field, by
/// inspect and by `train --resume` alike (which used to panic on the last).
#[test]
fn inspect_checks_what_resume_needs() {
    let d = tmpdir("needs");
    let ck = train_with_checkpoints(&d, &[]);
    let step = "step-00000004";
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 3] = [
        (
            "missing-key",
            |m| m["entries"][0]["key"] = "param/999".into(),
            "entries[0].key",
        ),
        (
            "overlap",
            |m| {
                let mut e = m["entries"][0].clone();
                e["key"] = "param/999".into();
                m["entries"].as_array_mut().unwrap().push(e);
            },
            "overlap",
        ),
        (
            "optimizer-steps",
            |m| m["optimizer"][1] = u64::MAX.into(),
            "optimizer step count",
        ),
    ];
    for (what, edit, words) in cases {
        let bad = d.join(what);
        copy_dir(&ck, &bad);
        let mp = bad.join(step).join("metadata.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
        edit(&mut m);
        std::fs::write(&mp, m.to_string()).unwrap();
        let o = phalanx(&["checkpoint", "inspect", &s(&bad.join(step))]);
        assert!(o.code == 1 || o.code == 2, "inspect of {what}: {}", o.all());
        assert!(o.all().contains(words), "inspect of {what}: {}", o.all());
        let o = train(&[
            "--set".into(),
            "train.steps=6".into(),
            "--resume".into(),
            s(&bad.join(step)),
        ]);
        assert!(
            o.code == 1 && o.all().contains(words) && !o.all().contains("panicked"),
            "--resume of {what}: {}",
            o.all()
        );
    }
    // A model config that contradicts the tensors (no sha256 covers it):
    // not "verified complete".
    let bad = d.join("config");
    copy_dir(&ck, &bad);
    let mp = bad.join(step).join("metadata.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    let config: String = m["config"]
        .as_str()
        .unwrap()
        .lines()
        .map(|l| match l.starts_with("n_layer = ") {
            true => "n_layer = 7\n".to_string(),
            false => format!("{l}\n"),
        })
        .collect();
    assert!(config.contains("n_layer = 7"), "{config}");
    m["config"] = config.into();
    std::fs::write(&mp, m.to_string()).unwrap();
    let o = phalanx(&["checkpoint", "inspect", &s(&bad.join(step))]);
    assert!(
        o.code == 1 && o.all().contains("the config does not match the tensors"),
        "{}",
        o.all()
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A `config.json` or a checkpoint's config with a huge shape is refused
/// before the model is allocated (issue 27, item 10), naming the files and
/// both sizes: by `generate --model`, `checkpoint from-hf`, `train
/// --init-from`, `checkpoint convert` and `generate` of a checkpoint.
#[test]
fn huge_shapes_are_refused_before_allocating() {
    let d = tmpdir("huge");
    let ck = train_with_checkpoints(&d, &[]);
    let fin = d.join("final.safetensors");
    let cj = d.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cj).unwrap()).unwrap();
    // 12e12 parameters' worth of embedding: the old code tried to allocate it.
    c["n_embd"] = 3_000_000_000u64.into();
    c["n_head"] = 1.into();
    std::fs::write(&cj, c.to_string()).unwrap();
    let refused = |o: &Out, what: &str, file: &str| {
        assert!(
            o.code != 0
                && o.all().contains("refused before allocating")
                && o.all().contains(file)
                && !o.all().contains("memory allocation"),
            "{what}: {}",
            o.all()
        );
    };
    let o = phalanx(&["generate", "--model", &s(&fin), "--tokens", "2"]);
    refused(&o, "generate --model", "final.safetensors");
    let o = phalanx(&["checkpoint", "from-hf", &s(&fin), &s(&d.join("imp"))]);
    refused(&o, "from-hf", "final.safetensors");
    assert!(!d.join("imp").join("step-00000000").exists());
    let o = train(&[
        "--set".into(),
        format!("model.n_embd={}", 3_000_000_000u64),
        "--set".into(),
        "model.n_head=1".into(),
        "--init-from".into(),
        s(&fin),
    ]);
    refused(&o, "train --init-from", "final.safetensors");

    // The checkpoint's own config, edited the same way.
    let step = ck.join("step-00000004");
    let mp = step.join("metadata.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    let mut cfg: toml::Table = m["config"].as_str().unwrap().parse().unwrap();
    let model = cfg["model"].as_table_mut().unwrap();
    model.insert("n_embd".into(), toml::Value::Integer(3_000_000_000));
    model.insert("n_head".into(), toml::Value::Integer(1));
    m["config"] = toml::to_string(&cfg).unwrap().into();
    std::fs::write(&mp, m.to_string()).unwrap();
    let o = phalanx(&[
        "checkpoint",
        "convert",
        &s(&step),
        &s(&d.join("x.safetensors")),
    ]);
    refused(&o, "checkpoint convert", "step-00000004");
    let o = phalanx(&["generate", "--model", &s(&step), "--tokens", "2"]);
    refused(&o, "generate of a checkpoint", "step-00000004");
    let _ = std::fs::remove_dir_all(&d);
}
