//! `phalanx report LOG`: a run's HTML report from its JSON log (and its
//! pipeline trace), the same file `phalanx train` writes at the end
//! (`log.report`).

use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ReportOpts {
    /// The run's JSON log (`--log-json`), or a directory holding exactly one
    /// `*.jsonl` (and maybe `trace.json`).
    pub run: PathBuf,
    /// The pipeline trace (`--trace`) to draw the timeline from.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Where the HTML goes (default: beside the log, `report.html`).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

pub fn main(o: &ReportOpts) -> i32 {
    match run(o) {
        Ok(out) => {
            println!("report written to {}", out.display());
            0
        }
        Err(e) => {
            eprintln!("phalanx report: error: {e}");
            1
        }
    }
}

/// The log of `run`: the file itself, or a directory's only `*.jsonl`.
fn find_log(run: &Path) -> Result<PathBuf, String> {
    if !run.is_dir() {
        return Ok(run.to_path_buf());
    }
    let mut logs: Vec<PathBuf> = std::fs::read_dir(run)
        .map_err(|e| format!("cannot read {}: {e}", run.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    logs.sort();
    match logs.len() {
        1 => Ok(logs.remove(0)),
        0 => Err(format!(
            "{} holds no JSON log (*.jsonl); train with --log-json FILE",
            run.display()
        )),
        _ => Err(format!(
            "{} holds several JSON logs ({}); name one",
            run.display(),
            logs.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn run(o: &ReportOpts) -> Result<PathBuf, String> {
    let log = find_log(&o.run)?;
    let (steps, cut) = phalanx::report::read_log(&log).map_err(|e| e.to_string())?;
    if let Some(note) = cut {
        eprintln!("note: {note}");
    }
    let trace_path = o.trace.clone().or_else(|| {
        let t = o.run.join("trace.json");
        (o.run.is_dir() && t.exists()).then_some(t)
    });
    let mut trace = match &trace_path {
        Some(t) => {
            let text = phalanx::fsutil::read_text_capped("the trace", t, phalanx::fsutil::LOG_CAP)
                .map_err(|e| format!("cannot read it: {e}"))?;
            Some(
                serde_json::from_str::<serde_json::Value>(&text)
                    .map_err(|e| format!("{} is not a JSON trace: {e}", t.display()))?,
            )
        }
        None => None,
    };
    // A trace.json found beside the log (not named with --trace) may be an
    // earlier run's (this one wrote none): one holding more steps than the
    // log is not drawn. (A trace counts the steps of its own process from
    // 0, also after a resume; the log counts the run's.)
    if let (None, Some(t), Some(path)) = (&o.trace, &trace, &trace_path) {
        let logged = steps.iter().filter(|s| s["step"].is_u64()).count() as u64;
        let foreign = t["traceEvents"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["args"]["step"].as_u64())
            .any(|s| s >= logged);
        if foreign {
            eprintln!(
                "note: {} holds more steps than the log (another run's trace?): not drawn; name \
                 it with --trace to draw it",
                path.display()
            );
            trace = None;
        }
    }
    let out = o
        .output
        .clone()
        .unwrap_or_else(|| log.with_file_name("report.html"));
    let mut io = crate::outputs::Io::new();
    io.output("--output", &out).input("the JSON log", &log);
    if let Some(t) = &trace_path {
        io.input("the trace (--trace)", t);
    }
    io.check()?;
    let title = format!("Phalanx run: {}", log.display());
    let html = phalanx::report::html(&title, &steps, trace.as_ref());
    phalanx::report::write(&out, &html).map_err(|e| e.to_string())?;
    Ok(out)
}
