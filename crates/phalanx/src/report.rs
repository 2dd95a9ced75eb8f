//! A run's report: one self-contained HTML file (inline SVG, no scripts,
//! nothing fetched) with the loss and validation curves, tokens/s, bytes
//! per step, per-rank memory, stragglers and, for pipelines, the timeline
//! of the last step. `phalanx train` writes it at the end (`log.report`);
//! `phalanx report LOG.jsonl` builds it from a JSON log afterwards.
//!
//! ```
//! use serde_json::json;
//! let steps = vec![
//!     json!({"step": 0, "loss": 5.5, "tokens_per_s": 1000.0, "comm_bytes": 4096}),
//!     json!({"step": 1, "loss": 4.0, "tokens_per_s": 1200.0, "comm_bytes": 4096, "val_loss": 4.2}),
//! ];
//! let html = phalanx::report::html("run", &steps, None);
//! assert!(html.starts_with("<!DOCTYPE html>") && html.contains("<svg"));
//! ```

use crate::error::{Error, Result};
use serde_json::Value;
use std::fmt::Write;
use std::path::Path;

/// One line of a chart: (label, colour, points).
pub type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

/// An SVG line chart of `series` (points with non-finite values skipped).
pub fn line_chart(title: &str, xlabel: &str, series: &[Series]) -> String {
    let (w, h, m) = (640.0f64, 320.0f64, 60.0f64);
    let pts = || {
        series
            .iter()
            .flat_map(|s| s.2.iter())
            .filter(|p| p.0.is_finite() && p.1.is_finite())
    };
    let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (x0, x1) = if x0 <= x1 {
        (x0, x1.max(x0 + 1.0))
    } else {
        (0.0, 1.0)
    };
    let (y0, y1) = if y0 <= y1 {
        (y0, y1.max(y0 + 1e-9))
    } else {
        (0.0, 1.0)
    };
    let x = |v: f64| m + (v - x0) / (x1 - x0) * (w - 2.0 * m);
    let y = |v: f64| h - m + 10.0 - (v - y0) / (y1 - y0) * (h - 2.0 * m);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{m}\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{t}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{cx}\" y=\"{xl}\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"{l}\" y=\"{t}\" text-anchor=\"end\">{}</text>\n\
         <text x=\"{l}\" y=\"{b}\" text-anchor=\"end\">{}</text>\n\
         <text x=\"{m}\" y=\"{xl}\">{}</text><text x=\"{r}\" y=\"{xl}\" text-anchor=\"end\">{}</text>\n",
        esc(title),
        esc(xlabel),
        num(y1),
        num(y0),
        num(x0),
        num(x1),
        b = h - m + 10.0,
        t = m - 20.0 + 10.0,
        r = w - m,
        l = m - 4.0,
        cx = w / 2.0,
        xl = h - m + 28.0,
    );
    for (k, (label, colour, p)) in series.iter().enumerate() {
        // A caller's colour is a string like any other.
        let colour = esc(colour);
        let line: Vec<String> = p
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>",
            line.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{colour}\">{}</text>",
            w - m - 100.0,
            30.0 + 14.0 * k as f64,
            esc(label)
        );
    }
    s + "</svg>\n"
}

fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{v:.0}")
    } else if v.abs() >= 1e5 || (v != 0.0 && v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

/// Escape `s` for HTML text and for a quoted attribute value (either
/// quote): every string that reaches the page from a log, a trace or a
/// path goes through this or [`text`]. The report has no scripts, so no
/// string ever lands in inline JS or JSON; should one be added, it needs
/// its own escaping of `</script>` as well.
fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A log value as page text: a string's contents (not its JSON quoting),
/// a number as written, anything else as its JSON; always escaped, since a
/// log is input like any other (a hand-edited or hostile one included).
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => esc(s),
        Value::Null => String::new(),
        v => esc(&v.to_string()),
    }
}

/// A JSON log: one object per line (as `--log-json` writes). A line that
/// is not a JSON object is an error naming it, except a last line cut
/// short (no newline after it: a run still writing, or one killed
/// mid-line), which is left out with a note (the second value).
pub fn read_log(path: &Path) -> Result<(Vec<Value>, Option<String>)> {
    let text = crate::fsutil::read_text_capped("the JSON log", path, crate::fsutil::LOG_CAP)
        .map_err(|e| Error::Io(format!("cannot read it: {e}")))?;
    let mut out = Vec::new();
    let mut note = None;
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.is_object() && v["step"].is_u64() => out.push(v),
            _ if i + 1 == lines.len() && !text.ends_with('\n') => {
                note = Some(format!(
                    "{}: its last line ({}) is cut short (a run still writing it?): left out",
                    path.display(),
                    i + 1
                ));
            }
            _ => {
                return Err(Error::Check(format!(
                    "{}: line {} is not a step of a Phalanx JSON log",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    if out.is_empty() {
        return Err(Error::Check(format!(
            "{}: no steps in the log",
            path.display()
        )));
    }
    Ok((out, note))
}

fn series(steps: &[Value], key: &str) -> Vec<(f64, f64)> {
    steps
        .iter()
        .filter_map(|s| Some((s["step"].as_f64()?, s[key].as_f64()?)))
        .collect()
}

/// The report of a run: its steps (JSON log objects) and, for a pipeline,
/// its Chrome trace.
pub fn html(title: &str, steps: &[Value], trace: Option<&Value>) -> String {
    let mut h = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n\
         <style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse}} \
         td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} svg{{margin:8px}}</style></head><body>\n\
         <h1>{t}</h1>\n",
        t = esc(title)
    );
    let loss = series(steps, "loss");
    let tok = series(steps, "tokens_per_s");
    let timed: Vec<f64> = tok.iter().skip(2).map(|p| p.1).collect();
    let _ = writeln!(
        h,
        "<p>{} steps; loss {} → {}; mean {:.0} tokens/s after two warm-up steps.</p>",
        steps.len(),
        loss.first().map_or("?".into(), |p| format!("{:.4}", p.1)),
        loss.last().map_or("?".into(), |p| format!("{:.4}", p.1)),
        timed.iter().sum::<f64>() / timed.len().max(1) as f64
    );
    h += &line_chart(
        "Loss",
        "step",
        &[
            ("train", "#1f77b4", loss),
            ("validation", "#d62728", series(steps, "val_loss")),
        ],
    );
    h += &line_chart("Tokens per second", "step", &[("tokens/s", "#2ca02c", tok)]);
    let mfu: Vec<(f64, f64)> = series(steps, "mfu")
        .into_iter()
        .map(|(s, m)| (s, 100.0 * m))
        .collect();
    if !mfu.is_empty() {
        h += &line_chart(
            "Model FLOPs utilisation (%, against the probed matmul peak)",
            "step",
            &[("MFU %", "#8c564b", mfu)],
        );
    }
    let mib: Vec<(f64, f64)> = series(steps, "comm_bytes")
        .into_iter()
        .map(|(s, b)| (s, b / (1 << 20) as f64))
        .collect();
    h += &line_chart(
        "MiB sent per step (rank 0)",
        "step",
        &[("MiB", "#9467bd", mib)],
    );
    h += &memory_table(steps);
    h += &stragglers(steps);
    if let Some(t) = trace {
        h += &timeline(t);
    }
    h + "</body></html>\n"
}

fn memory_table(steps: &[Value]) -> String {
    let Some(mem) = steps.iter().find_map(|s| s["memory"].as_array()) else {
        return String::new();
    };
    let cols = [
        "params",
        "grads",
        "optimizer",
        "activations_peak",
        "working_peak",
        "peak_rss",
    ];
    let mut s = String::from(
        "<h2>Memory per rank (MiB, after the first step)</h2>\n<table><tr><th>rank</th>",
    );
    for c in cols {
        let _ = write!(s, "<th>{c}</th>");
    }
    s += "</tr>\n";
    for r in mem {
        let _ = write!(s, "<tr><td>{}</td>", text(&r["rank"]));
        for c in cols {
            let _ = write!(
                s,
                "<td>{:.2}</td>",
                r[c].as_f64().unwrap_or(0.0) / (1 << 20) as f64
            );
        }
        s += "</tr>\n";
    }
    s + "</table>\n"
}

fn stragglers(steps: &[Value]) -> String {
    let events: Vec<(u64, &Value)> = steps
        .iter()
        .filter_map(|s| Some((s["step"].as_u64()?, s["straggler_events"].as_array()?)))
        .flat_map(|(k, e)| e.iter().map(move |v| (k, v)))
        .collect();
    let mut s = String::from("<h2>Stragglers</h2>\n");
    if events.is_empty() {
        return s + "<p>None reported.</p>\n";
    }
    s += "<table><tr><th>step</th><th>rank</th><th>host</th><th>compute s</th><th>median s</th></tr>\n";
    for (k, e) in events {
        let _ = writeln!(
            s,
            "<tr><td>{k}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td></tr>",
            text(&e["rank"]),
            text(&e["host"]),
            e["compute_s"].as_f64().unwrap_or(f64::NAN),
            e["median_s"].as_f64().unwrap_or(f64::NAN)
        );
    }
    s + "</table>\n"
}

/// The last step of a pipeline trace, one row per rank and thread.
fn timeline(trace: &Value) -> String {
    let Some(ev) = trace["traceEvents"].as_array() else {
        return String::new();
    };
    let x: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    let last = x.iter().filter_map(|e| e["args"]["step"].as_u64()).max();
    let x: Vec<&Value> = x
        .into_iter()
        .filter(|e| e["args"]["step"].as_u64() == last)
        .collect();
    if x.is_empty() {
        return String::new();
    }
    let t0 = x
        .iter()
        .filter_map(|e| e["ts"].as_f64())
        .fold(f64::MAX, f64::min);
    let t1 = x
        .iter()
        .filter_map(|e| Some(e["ts"].as_f64()? + e["dur"].as_f64()?))
        .fold(f64::MIN, f64::max);
    let rows: Vec<(u64, u64)> = {
        let mut r: Vec<(u64, u64)> = x
            .iter()
            .filter_map(|e| Some((e["pid"].as_u64()?, e["tid"].as_u64()?)))
            .collect();
        r.sort_unstable();
        r.dedup();
        r
    };
    let (w, row, left) = (1200.0, 22.0, 110.0);
    let h = row * rows.len() as f64 + 40.0;
    let mut s = format!(
        "<h2>Pipeline timeline (step {})</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"10\">\n",
        last.unwrap_or(0)
    );
    for (i, (pid, tid)) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"4\" y=\"{}\">rank {pid} {}</text>",
            20.0 + row * i as f64 + 14.0,
            if *tid == 0 { "compute" } else { "comm" }
        );
    }
    let scale = (w - left - 10.0) / (t1 - t0).max(1.0);
    for e in x {
        let (Some(pid), Some(tid), Some(ts), Some(dur)) = (
            e["pid"].as_u64(),
            e["tid"].as_u64(),
            e["ts"].as_f64(),
            e["dur"].as_f64(),
        ) else {
            continue;
        };
        let i = rows.iter().position(|r| *r == (pid, tid)).unwrap_or(0);
        let name = e["name"].as_str().unwrap_or("");
        let colour = match name.chars().next() {
            Some('F') => "#4c9be8",
            Some('B') => "#e8844c",
            Some('W') => "#5cb85c",
            _ => "#aaaaaa",
        };
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{}\" fill=\"{colour}\" stroke=\"white\"><title>{}</title></rect>",
            left + (ts - t0) * scale,
            20.0 + row * i as f64,
            (dur * scale).max(0.5),
            row - 4.0,
            esc(name)
        );
    }
    s + "</svg>\n"
}

/// Write `html` to `path` whole (temporary file, then rename).
pub fn write(path: &Path, html: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    crate::fsutil::write_atomic(path, html.as_bytes())
        .map_err(|e| Error::Io(format!("cannot write the report {}: {e}", path.display())))
}
