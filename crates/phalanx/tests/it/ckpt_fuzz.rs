//! `metadata.json` fuzzing (issue 27, item 11): a checkpoint saved by two
//! ZeRO-2 ranks in fp16 is resumed on one rank after each of a few hundred
//! mutations of its metadata (every field set to zero, negative, huge,
//! fractional, the wrong type or null; keys removed; arrays emptied,
//! shortened or grown; entries duplicated or swapped). Each one either
//! resumes and trains a step to a finite loss, or is refused with an error
//! that names the mutated field: never a panic, never a file read outside
//! the checkpoint.

use crate::example;

use phalanx::trainer::{Resume, RunOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn config(steps: usize, dir: &Path, every: usize) -> phalanx::config::TrainConfig {
    let sets = [
        format!("train.steps={steps}"),
        "train.micro_batch_size=2".into(),
        "train.eval_interval=1000".into(),
        "zero_optimization.stage=2".into(),
        "fp16.enabled=true".into(),
        format!("checkpoint.dir={:?}", dir.display().to_string()),
        format!("checkpoint.interval={every}"),
        "log.plot=\"\"".into(),
    ];
    phalanx::config::TrainConfig::build(None, &sets).expect("valid config")
}

/// Resume `ck` on one rank and train one step: the loss, or the error.
fn resume(ck: &Path, scratch: &Path) -> Result<f32, String> {
    let cfg = config(3, scratch, 0);
    let ck = ck.to_path_buf();
    let mut out = phalanx_comm::threads::run(1, move |pg| {
        let mut t = example::trainer(pg, &cfg).map_err(|e| e.to_string())?;
        let opts = RunOptions {
            resume: Some(Resume::Path(ck.clone())),
            ..Default::default()
        };
        let r = t.run(&opts).map_err(|e| e.to_string())?;
        // (No loss when the checkpoint's step is the last: nothing to do.)
        Ok(r.losses.last().copied().unwrap_or(0.0))
    });
    out.remove(0)
}

/// Every leaf and container of `v` with its path.
fn paths(v: &Value, at: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(json!(k));
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            // The first and the last element.
            let n = a.len();
            let mut idx: Vec<usize> = (0..n.min(1)).collect();
            if n > 1 {
                idx.push(n - 1);
            }
            for i in idx {
                at.push(json!(i));
                paths(&a[i], at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn get_mut<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match k {
        Value::String(s) => &mut v[s.as_str()],
        Value::Number(i) => &mut v[i.as_u64().unwrap() as usize],
        _ => unreachable!(),
    })
}

/// The mutations of the value at one path.
fn mutations(v: &Value) -> Vec<Value> {
    let mut out = vec![Value::Null];
    match v {
        Value::Number(n) => {
            let x = n.as_f64().unwrap();
            out.extend([
                json!(0),
                json!(-1),
                json!(u64::MAX),
                json!(1e30),
                json!(x + 0.5),
                json!("7"),
            ]);
            if let Some(u) = n.as_u64() {
                out.push(json!(u + 1));
            }
        }
        Value::String(_) => out.extend([
            json!(""),
            json!("../x"),
            json!("/etc/passwd"),
            json!("param"),
            json!("0".repeat(64)),
            json!(3),
        ]),
        Value::Array(a) => {
            out.push(json!([]));
            out.push(json!({}));
            if let Some(f) = a.first() {
                let mut grown = a.clone();
                grown.push(f.clone());
                out.push(Value::Array(grown));
                out.push(Value::Array(a[..a.len() - 1].to_vec()));
            }
        }
        Value::Object(_) => out.extend([json!({}), json!([]), json!(1)]),
        _ => out.push(json!(1)),
    }
    out
}

/// The names an error may use for the field at `path`: its keys, and an
/// array's name with the index (`entries[3]`).
fn names(path: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, k) in path.iter().enumerate() {
        match k {
            Value::String(s) => out.push(s.clone()),
            Value::Number(n) => {
                if let Some(Value::String(a)) = i.checked_sub(1).map(|j| &path[j]) {
                    out.push(format!("{a}[{n}]"));
                }
            }
            _ => {}
        }
    }
    out
}

fn fresh(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("phalanx-ckfuzz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn mutated_metadata_loads_or_is_refused_naming_the_field() {
    let root = fresh("save");
    let cfg = config(2, &root.join("ck"), 2);
    phalanx_comm::threads::run(2, move |pg| {
        let mut t = example::trainer(pg, &cfg).unwrap();
        t.run(&Default::default()).unwrap();
    });
    let ck = root.join("ck").join(phalanx::checkpoint::step_dir_name(2));
    let meta_path = ck.join("metadata.json");
    let original = std::fs::read_to_string(&meta_path).unwrap();
    let base: Value = serde_json::from_str(&original).unwrap();
    let scratch = root.join("scratch");
    let clean = resume(&ck, &scratch).expect("the saved checkpoint resumes");
    assert!(clean.is_finite());

    let mut all = Vec::new();
    paths(&base, &mut Vec::new(), &mut all);
    // (description, names the error may use, metadata text).
    let mut cases: Vec<(String, Vec<String>, String)> = Vec::new();
    for p in all.iter().filter(|p| !p.is_empty()) {
        let parent = &p[..p.len() - 1];
        let here = get_mut(&mut base.clone(), p).clone();
        for m in mutations(&here) {
            let mut v = base.clone();
            *get_mut(&mut v, p) = m.clone();
            cases.push((format!("{p:?} = {m}"), names(p), v.to_string()));
        }
        // Remove an object's key.
        if let Some(Value::String(k)) = p.last() {
            let mut v = base.clone();
            get_mut(&mut v, parent)
                .as_object_mut()
                .unwrap()
                .remove(k.as_str());
            cases.push((format!("{p:?} removed"), names(p), v.to_string()));
        }
    }
    // Structural: an entry twice, two entries' keys swapped, an entry
    // moved to the other file.
    let n = base["entries"].as_array().unwrap().len();
    assert!(n > 4, "{n} entries");
    {
        let mut v = base.clone();
        let e0 = v["entries"][0].clone();
        v["entries"].as_array_mut().unwrap().push(e0);
        cases.push((
            "entry 0 twice".into(),
            vec!["entries".into()],
            v.to_string(),
        ));
        let mut v = base.clone();
        let (a, b) = (
            v["entries"][0]["key"].clone(),
            v["entries"][1]["key"].clone(),
        );
        v["entries"][0]["key"] = b;
        v["entries"][1]["key"] = a;
        cases.push(("keys swapped".into(), vec!["entries".into()], v.to_string()));
        let mut v = base.clone();
        let f = v["entries"][0]["file"].as_u64().unwrap();
        v["entries"][0]["file"] = json!(1 - f);
        cases.push((
            "entry 0 in the other file".into(),
            vec!["entries".into()],
            v.to_string(),
        ));
    }
    assert!(cases.len() >= 300, "only {} cases", cases.len());

    let (mut loaded, mut refused, mut bad) = (0, 0, Vec::new());
    for (what, names, text) in &cases {
        std::fs::write(&meta_path, text).unwrap();
        let _ = std::fs::remove_dir_all(&scratch);
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| resume(&ck, &scratch)));
        match got {
            Err(_) => bad.push(format!("{what}: the resume panicked")),
            Ok(Ok(loss)) if !loss.is_finite() => {
                bad.push(format!("{what}: loaded, but the loss is {loss}"))
            }
            Ok(Ok(_)) => loaded += 1,
            Ok(Err(e)) if !names.iter().any(|n| e.contains(n.as_str())) => bad.push(format!(
                "{what}: the error does not name the field ({names:?}): {e}"
            )),
            Ok(Err(_)) => refused += 1,
        }
    }
    std::fs::write(&meta_path, &original).unwrap();
    println!(
        "{} mutations: {loaded} loaded, {refused} refused",
        cases.len()
    );
    assert!(
        bad.is_empty(),
        "{} of {}:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
    assert!(refused > cases.len() / 2 && loaded > 0);
    // Nothing was written outside the checkpoint (a repair or a save).
    assert!(!root.join("x").exists() && !ck.parent().unwrap().join("x").exists());
    let _ = std::fs::remove_dir_all(&root);
}
