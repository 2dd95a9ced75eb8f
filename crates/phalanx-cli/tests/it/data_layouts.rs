//! The samples of a corpus (issue 28) do not depend on the layout that
//! trains on them: `phalanx train` on a mix of llm.c shards, JSONL and
//! plain text gives the same loss at every step on 1, 2 and 3
//! data-parallel ranks, under tensor parallel and under a pipeline. A
//! different sample anywhere would move a step's loss by far more than the
//! reduction order does.

use crate::common;
use common::*;

use std::path::Path;

/// llm.c shards (uint16 tokens, byte vocabulary), JSONL and text files,
/// and a config mixing them 2 : 1 : 1.
fn corpus(dir: &Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(repo().join("data/corpus.txt")).unwrap();
    let bytes = text.as_bytes();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    for j in 0..3 {
        let part = &bytes[j * 20_000..(j + 1) * 20_000];
        let mut header = [0u32; 256];
        header[0] = 20240520;
        header[1] = 1;
        header[2] = part.len() as u32;
        let mut out: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.extend(part.iter().flat_map(|&b| (b as u16).to_le_bytes()));
        std::fs::write(dir.join(format!("bin/train_{j:06}.bin")), out).unwrap();
    }
    let lines: String = text
        .lines()
        .skip(2000)
        .take(600)
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::json!({ "content": l }).to_string() + "\n")
        .collect();
    std::fs::write(dir.join("docs.jsonl"), lines).unwrap();
    std::fs::write(dir.join("book.txt"), &text[100_000..140_000]).unwrap();
    let cfg = dir.join("mix.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[data.sources]]\npath = \"{d}/bin/train_*.bin\"\nweight = 2\n\n\
             [[data.sources]]\npath = \"{d}/docs.jsonl\"\nweight = 1\nfield = \"content\"\n\n\
             [[data.sources]]\npath = [\"{d}/book.txt\"]\nweight = 1\n",
            d = dir.display()
        ),
    )
    .unwrap();
    cfg
}

/// The per-step losses of a 3-step run with `extra` arguments.
fn losses(dir: &Path, cfg: &Path, name: &str, extra: &[&str]) -> Vec<f64> {
    let log = dir.join(format!("{name}.jsonl"));
    let mut args = vec![
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "model.n_layer=2",
        "--set",
        "model.n_head=2",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.block_size=32",
        "--set",
        "train.steps=3",
        "--set",
        "train.eval_interval=0",
        "--set",
        "log.plot=\"\"",
        "--set",
        "log.report=\"\"",
        "--log-json",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = phalanx(&args);
    assert_eq!(code, 0, "{name}: {out}\n{err}");
    // The first line names the sources and their shares.
    assert!(
        out.contains("data 3 sources:") && out.contains("docs.jsonl (25%)"),
        "{out}"
    );
    std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_mixed_corpus_gives_the_same_losses_on_every_layout() {
    let dir = fresh_dir("phalanx-data-layouts", "mix");
    let cfg = corpus(&dir);
    let one = losses(
        &dir,
        &cfg,
        "one",
        &[
            "--nproc-per-node",
            "1",
            "--set",
            "train.micro_batch_size=12",
        ],
    );
    assert_eq!(one.len(), 3);
    let layouts: &[(&str, &[&str])] = &[
        (
            "dp2",
            &["--nproc-per-node", "2", "--set", "train.micro_batch_size=6"],
        ),
        (
            "dp3",
            &["--nproc-per-node", "3", "--set", "train.micro_batch_size=4"],
        ),
        (
            "dp2-accum2",
            &[
                "--nproc-per-node",
                "2",
                "--set",
                "train.micro_batch_size=3",
                "--set",
                "train.grad_accum_steps=2",
            ],
        ),
        (
            "tp2",
            &[
                "--nproc-per-node",
                "2",
                "--set",
                "parallel.tp=2",
                "--set",
                "train.micro_batch_size=12",
            ],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--set",
                "parallel.pp=2",
                "--set",
                "train.micro_batch_size=6",
                "--set",
                "train.grad_accum_steps=2",
            ],
        ),
    ];
    for (name, extra) in layouts {
        let got = losses(&dir, &cfg, name, extra);
        for (k, (a, b)) in got.iter().zip(&one).enumerate() {
            assert!(
                ((a - b) / b).abs() < 2e-5,
                "{name}: step {k}: loss {a} vs {b} on one rank ({got:?} vs {one:?})"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Text sources hold no validation tail: a run asking for validation over
/// them is told it gets none (it used to log no validation loss, silently).
#[test]
fn validation_over_text_sources_only_is_said_to_be_missing() {
    let dir = fresh_dir("phalanx-data-layouts", "noval");
    corpus(&dir);
    let data = format!("data.path=\"{}\"", dir.join("docs.jsonl").display());
    let (code, out, err) = phalanx(&[
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        &data,
        "--set",
        "data.field=\"content\"",
        "--set",
        "model.n_layer=1",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.block_size=32",
        "--set",
        "train.steps=1",
        "--set",
        "train.eval_interval=1",
        "--set",
        "log.plot=\"\"",
        "--set",
        "log.report=\"\"",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("note: no validation data"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run stopped by a bad record resumes with `data.on_bad_record =
/// "skip"` (what a run under `error` trained on is the same under `skip`),
/// and after the bad line is removed with `data.on_resume_mismatch =
/// "warn"` (the content changed: refused without it, naming the key).
#[test]
fn a_run_stopped_by_a_bad_record_resumes_skipping_it_or_after_the_fix() {
    let dir = fresh_dir("phalanx-data-layouts", "bad-record");
    let text = std::fs::read_to_string(repo().join("data/corpus.txt")).unwrap();
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(600)
        .map(|l| serde_json::json!({ "text": l }).to_string())
        .collect();
    std::fs::create_dir_all(dir.join("sb")).unwrap();
    for (j, part) in lines.chunks(60).enumerate() {
        let mut body = part.join("\n") + "\n";
        if j == 7 {
            body = body.replacen('\n', "\n{\"text\": broken\n", 3);
        }
        std::fs::write(dir.join(format!("sb/s{j}.jsonl")), body).unwrap();
    }
    let data = format!("data.path=[\"{}\"]", dir.join("sb").display());
    let ck = format!("checkpoint.dir=\"{}\"", dir.join("ck").display());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--nproc-per-node",
            "1",
            "--set",
            &data,
            "--set",
            &ck,
            "--set",
            "checkpoint.interval=50",
            "--set",
            "train.steps=2000",
        ];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(extra);
        phalanx(&args)
    };
    let (code, out, err) = run(&[]);
    assert_ne!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("s7.jsonl") && err.contains("not a JSON record"),
        "{err}"
    );
    assert!(
        dir.join("ck/latest").is_file(),
        "no checkpoint before the bad record: {out}"
    );
    let (code, out, err) = run(&["--set", "data.on_bad_record=\"skip\"", "--resume", "auto"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resumed from"), "{out}");
    // The line fixed instead: the data changed, refused without the key.
    std::fs::remove_dir_all(dir.join("ck")).unwrap();
    let (code, ..) = run(&[]);
    assert_ne!(code, 0);
    let fixed = std::fs::read_to_string(dir.join("sb/s7.jsonl"))
        .unwrap()
        .replace("{\"text\": broken\n", "");
    std::fs::write(dir.join("sb/s7.jsonl"), fixed).unwrap();
    let (code, _, err) = run(&["--resume", "auto"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("data.content") && err.contains("data.on_resume_mismatch"),
        "{err}"
    );
    let (code, out, err) = run(&[
        "--set",
        "data.on_resume_mismatch=\"warn\"",
        "--resume",
        "auto",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("warning: resuming from") && err.contains("data.content"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
