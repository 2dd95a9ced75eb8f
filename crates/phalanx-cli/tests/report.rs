//! The run report: written at the end of `phalanx train` (`log.report`),
//! rebuilt from a JSON log by `phalanx report`, with the pipeline timeline
//! when there is a trace; a bad log is a clear error.

mod common;
use common::*;

#[test]
fn train_writes_the_report_and_report_rebuilds_it() {
    let d = fresh_dir("phalanx-report", "train");
    let log = d.join("log.jsonl");
    let html = d.join("report.html");
    let set = format!("log.report=\"{}\"", html.display());
    let mut args = vec![
        "train",
        "--nproc-per-node",
        "2",
        "--set",
        "train.steps=6",
        "--set",
        "parallel.pp=2",
        "--set",
        "model.n_layer=2",
        "--log-json",
        log.to_str().unwrap(),
    ];
    let trace = d.join("trace.json");
    args.extend(["--trace", trace.to_str().unwrap()]);
    args.extend_from_slice(SMALL);
    args.extend(["--set", &set]);
    let (code, out, err) = phalanx(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("report written to"), "{out}");
    let text = std::fs::read_to_string(&html).unwrap();
    for want in [
        "<!DOCTYPE html>",
        "Loss",
        "Tokens per second",
        "Model FLOPs utilisation",
        "MiB sent per step",
        "Memory per rank",
        "Stragglers",
        "Pipeline timeline",
        "<rect",
    ] {
        assert!(text.contains(want), "the report lacks {want}");
    }
    // One memory row per rank.
    assert_eq!(text.matches("<tr><td>").count(), 2, "{text}");

    // Rebuilt from the directory (its only JSON log, and trace.json).
    std::fs::remove_file(&html).unwrap();
    let (code, out, err) = phalanx(&["report", d.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    let again = std::fs::read_to_string(&html).unwrap();
    assert!(again.contains("Pipeline timeline"));
}

#[test]
fn a_bad_log_is_a_clear_error() {
    let d = fresh_dir("phalanx-report", "bad");
    let log = d.join("log.jsonl");
    std::fs::write(&log, "{\"step\": 0, \"loss\": 1.0}\nnot json\n").unwrap();
    let (code, _, err) = phalanx(&["report", log.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("line 2"), "{err}");
    assert!(!d.join("report.html").exists());
    let empty = fresh_dir("phalanx-report", "empty");
    let (code, _, err) = phalanx(&["report", empty.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("no JSON log"), "{err}");
}
