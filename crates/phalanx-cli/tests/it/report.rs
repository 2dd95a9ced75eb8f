//! The run report: written at the end of `phalanx train` (`log.report`),
//! rebuilt from a JSON log by `phalanx report`, with the pipeline timeline
//! when there is a trace; a bad log is a clear error.

use crate::common;
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

    // A shorter run's log beside that trace (which it did not write): the
    // trace holds steps the log does not, and is not drawn.
    let lines: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .take(2)
        .map(String::from)
        .collect();
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    let (code, out, err) = phalanx(&["report", d.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("holds more steps than the log"), "{err}");
    let again = std::fs::read_to_string(&html).unwrap();
    assert!(!again.contains("Pipeline timeline"));
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
    // A last line cut short (a run still writing it) is left out, said so;
    // the same line ended by a newline is an error.
    std::fs::write(
        &log,
        "{\"step\": 0, \"loss\": 1.0}\n{\"step\": 1, \"loss\": 0.9}\n{\"step\": 2, \"lo",
    )
    .unwrap();
    let (code, _, err) = phalanx(&["report", log.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("its last line (3) is cut short"), "{err}");
    assert!(d.join("report.html").exists());
    std::fs::write(&log, "{\"step\": 0, \"loss\": 1.0}\n{\"step\": 2, \"lo\n").unwrap();
    let (code, _, err) = phalanx(&["report", log.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("line 2 is not a step"), "{err}");
    let empty = fresh_dir("phalanx-report", "empty");
    let (code, _, err) = phalanx(&["report", empty.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("no JSON log"), "{err}");
}

/// Everything the report renders from a log, a trace or a path is escaped:
/// hostile strings in every such field never become markup (a `rank` of
/// `<script>…` used to land in the page as a script).
#[test]
fn hostile_strings_in_a_log_are_escaped_everywhere() {
    // One per way out of HTML text or a quoted attribute.
    const HOSTILE: [&str; 4] = [
        "<script>alert(1)</script>",
        "\"><img src=x onerror=alert(2)>",
        "' onmouseover='alert(3)",
        "</title></svg><iframe src=javascript:alert(4)>",
    ];
    // The title comes from the log's path: a directory named with markup.
    let root = fresh_dir("phalanx-report", "hostile");
    let d = root.join("<b>&'\"");
    std::fs::create_dir_all(&d).unwrap();
    let log = d.join("log.jsonl");
    // The memory table is drawn from the first step that has one.
    let mut memory: Vec<_> = HOSTILE
        .iter()
        .map(|h| serde_json::json!({"rank": h, "params": h, "grads": 1.0}))
        .collect();
    memory.push(serde_json::json!({"rank": {"nested": HOSTILE[0]}, "params": 2.0}));
    let mut lines = String::new();
    for (i, h) in HOSTILE.iter().enumerate() {
        let step = serde_json::json!({
            "step": i,
            "loss": 2.0,
            "tokens_per_s": 10.0,
            "comm_bytes": 8,
            "memory": memory,
            "straggler_events": [
                {"rank": h, "host": h, "compute_s": h, "median_s": 0.5},
            ],
        });
        lines += &format!("{step}\n");
    }
    std::fs::write(&log, lines).unwrap();
    let mut events = vec![];
    for h in HOSTILE {
        events.push(serde_json::json!({
            "ph": "X", "name": h, "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0,
            "args": {"step": 3},
        }));
        // Strings where the timeline expects numbers are skipped.
        events.push(serde_json::json!({
            "ph": "X", "name": "F0", "pid": h, "tid": h, "ts": 1.0, "dur": 2.0,
            "args": {"step": 3},
        }));
    }
    let trace = d.join("trace.json");
    std::fs::write(
        &trace,
        serde_json::json!({"traceEvents": events}).to_string(),
    )
    .unwrap();
    let (code, out, err) = phalanx(&["report", d.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    let page = std::fs::read_to_string(d.join("report.html")).unwrap();
    // Every field was rendered (so the checks below saw it): the escaped
    // forms are on the page.
    for h in HOSTILE {
        let escaped = h
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
            .replace('\'', "&#39;");
        // memory rank, straggler rank and host, timeline title: 4 places.
        let n = page.matches(&escaped).count();
        assert!(n >= 4, "{h:?} is rendered escaped {n} times:\n{page}");
        assert!(!page.contains(h), "{h:?} reached the page raw:\n{page}");
    }
    assert!(page.contains("&lt;b&gt;&amp;&#39;&quot;"), "{page}");
    // Only the report's own tags, and no attribute but its own.
    let allowed = [
        "!DOCTYPE", "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "svg",
        "rect", "text", "line", "polyline", "table", "tr", "th", "td",
    ];
    for tag in page.split('<').skip(1) {
        let name: String = tag
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '!')
            .collect();
        assert!(allowed.contains(&name.as_str()), "tag <{name}> in:\n{page}");
    }
    for bad in ["onerror=", "onmouseover=", "javascript:"] {
        // Only inside escaped text, never as markup: no raw quote or
        // angle bracket precedes them within a tag.
        for (i, _) in page.match_indices(bad) {
            let open = page[..i].rfind('<').unwrap_or(0);
            let close = page[..i].rfind('>').unwrap_or(0);
            assert!(close > open, "{bad} inside a tag at {i}:\n{page}");
        }
    }
}

/// `phalanx train` flags of the small model for `steps` steps, its loss
/// curve and report under `d`, checkpoints every 2 steps in `d/ck`.
fn resumable(d: &std::path::Path, steps: usize) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--nproc-per-node", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(train_args(&d.join("log.jsonl"), steps));
    for set in [
        format!("log.plot={:?}", d.join("loss.svg").to_str().unwrap()),
        format!("log.report={:?}", d.join("report.html").to_str().unwrap()),
        format!("checkpoint.dir={:?}", d.join("ck").to_str().unwrap()),
        "checkpoint.interval=2".into(),
    ] {
        a.extend(["--set".into(), set]);
    }
    a
}

/// After a resume the loss curve is drawn at the steps the losses belong
/// to (the whole run's, from the kept JSON log), not at 0..n; a resume with
/// nothing left to do leaves the curve and the report as they were.
#[test]
fn a_resumed_run_plots_its_steps_and_one_with_nothing_to_do_keeps_the_plot() {
    let d = fresh_dir("phalanx-report", "resume-plot");
    let run = |steps: usize, resume: bool| {
        let mut a = resumable(&d, steps);
        if resume {
            a.extend(["--resume".into(), d.join("ck").to_str().unwrap().into()]);
        }
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        let (code, out, err) = phalanx(&a);
        assert_eq!(code, 0, "{out}\n{err}");
        out
    };
    run(4, false);
    run(6, true);
    let svg = std::fs::read_to_string(d.join("loss.svg")).unwrap();
    // The x axis ends at step 5 (steps 4 and 5 ran in the resumed run):
    // drawn at their index it ended at 1.
    assert!(svg.contains("text-anchor=\"end\">5</text>"), "{svg}");
    let html = std::fs::read_to_string(d.join("report.html")).unwrap();
    assert!(html.contains("<p>6 steps;"), "{html}");
    let out = run(6, true);
    assert!(out.contains("nothing to do"), "{out}");
    assert!(out.contains("left as they were"), "{out}");
    assert_eq!(std::fs::read_to_string(d.join("loss.svg")).unwrap(), svg);
    assert_eq!(
        std::fs::read_to_string(d.join("report.html")).unwrap(),
        html
    );
}

/// The report shows a trace only when this run wrote it: a run without a
/// pipeline never shows (nor reads) what an earlier run left at `--trace`,
/// and a FIFO there cannot stall rank 0.
#[test]
fn the_report_shows_only_a_trace_this_run_wrote() {
    let d = fresh_dir("phalanx-report", "old-trace");
    let html = d.join("report.html");
    let old = d.join("trace.json");
    let event = serde_json::json!({
        "ph": "X", "name": "F0", "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0,
        "args": {"step": 3},
    });
    std::fs::write(
        &old,
        serde_json::json!({"traceEvents": [event]}).to_string(),
    )
    .unwrap();
    let fifo = d.join("trace.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for trace in [&old, &fifo] {
        let _ = std::fs::remove_file(&html);
        let mut c = std::process::Command::new(BIN);
        c.current_dir(repo())
            .env_remove("RANK")
            .arg("train")
            .args(["--nproc-per-node", "1"])
            .args(train_args(&d.join("log.jsonl"), 2))
            .args(["--trace", trace.to_str().unwrap()])
            .args(["--set", &format!("log.report={:?}", html.to_str().unwrap())]);
        let r = run_until(c, std::time::Duration::from_secs(120));
        assert_eq!(r.code, 0, "{r}");
        let page = std::fs::read_to_string(&html).unwrap();
        assert!(
            !page.contains("Pipeline timeline"),
            "{trace:?}: an old trace shown"
        );
    }
}
