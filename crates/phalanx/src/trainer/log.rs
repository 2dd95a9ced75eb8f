//! What a run shows: a progress line on rank 0, a JSON log (one object per
//! step), and a loss-curve image (SVG) at the end.

use super::StepStats;
use crate::error::Result;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Print progress lines (rank 0).
    pub progress: bool,
    /// Print a line every this many steps.
    pub log_interval: usize,
    /// `{"step", "loss", "lr", "tokens_per_s", "step_ms"}` per line.
    pub log_json: Option<PathBuf>,
    /// Loss curve (SVG) written at the end.
    pub plot: Option<PathBuf>,
    /// Chrome / Perfetto trace of the pipeline schedule, written at the end.
    pub trace: Option<PathBuf>,
    /// The run's HTML report (`crate::report`), written at the end.
    pub report: Option<PathBuf>,
    /// Continue from a checkpoint (`--resume`).
    pub resume: Option<Resume>,
    /// A graceful stop (set, e.g., from a signal handler, on any rank):
    /// after the step during which it is seen on any rank, every rank
    /// stops, with a checkpoint of that step when checkpoints are on
    /// ([`Report::stopped_at`](super::Report::stopped_at)). Checked with
    /// one tiny all-reduce per step, only when given.
    pub stop: Option<&'static std::sync::atomic::AtomicBool>,
}

/// Where `--resume` continues from.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    /// A checkpoint, or a directory of them (its latest complete one).
    Path(PathBuf),
    /// The latest complete checkpoint under `checkpoint.dir`, if any; a
    /// fresh start otherwise.
    Auto,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            progress: false,
            log_interval: 10,
            log_json: None,
            plot: None,
            trace: None,
            report: None,
            resume: None,
            stop: None,
        }
    }
}

pub struct StepLog {
    lead: bool,
    opts: RunOptions,
    steps: usize,
    /// The JSON log and the path (for messages).
    json: Option<(std::fs::File, PathBuf)>,
    /// Every step's JSON object, for the report (rank 0, when one is asked for).
    records: Vec<serde_json::Value>,
    /// (step, loss) and (step, validation loss) for the loss curve (rank
    /// 0, when one is asked for): at the steps they belong to, also after
    /// a resume.
    losses: Vec<(usize, f32)>,
    val_losses: Vec<(usize, f32)>,
    /// Steps this run logged (0: resumed at or past `train.steps`).
    ran: usize,
}

impl StepLog {
    /// `resumed_at`: a run resumed at that step continues the JSON log of
    /// the run it continues: the lines of steps before it are kept, later
    /// ones (written after the checkpoint by a run that then died) and a
    /// torn last line are dropped, so every step appears once. Otherwise
    /// the log starts empty. The kept lines also start the loss curve and
    /// the report, which then show the whole run.
    pub fn new(
        opts: &RunOptions,
        lead: bool,
        steps: usize,
        resumed_at: Option<usize>,
    ) -> Result<StepLog> {
        let mut kept = String::new();
        let json = match (&opts.log_json, lead) {
            (Some(p), true) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                let err = |e: std::io::Error| {
                    crate::error::Error::Io(format!("cannot create {}: {e}", p.display()))
                };
                // (A resume with no step left to run leaves the log as it
                // is, as it leaves the curve and the report: the steps
                // after its checkpoint are another run's, not to be cut.)
                if let Some(at) = resumed_at.filter(|&at| at < steps) {
                    kept = keep_steps_before(p, at).map_err(err)?;
                }
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(resumed_at.is_some())
                    .truncate(resumed_at.is_none())
                    .open(p)
                    .map_err(err)?;
                Some((f, p.clone()))
            }
            _ => None,
        };
        let mut log = StepLog {
            lead,
            opts: opts.clone(),
            steps,
            json,
            records: Vec::new(),
            losses: Vec::new(),
            val_losses: Vec::new(),
            ran: 0,
        };
        for v in kept.lines().filter_map(|l| serde_json::from_str(l).ok()) {
            log.record(v);
        }
        Ok(log)
    }

    /// Keep a step's JSON object for the loss curve and the report (those
    /// asked for).
    fn record(&mut self, v: serde_json::Value) {
        let Some(step) = v["step"].as_u64().map(|s| s as usize) else {
            return;
        };
        if self.opts.plot.is_some() {
            if let Some(l) = v["loss"].as_f64() {
                self.losses.push((step, l as f32));
            }
            if let Some(l) = v["val_loss"].as_f64() {
                self.val_losses.push((step, l as f32));
            }
        }
        if self.opts.report.is_some() {
            self.records.push(v);
        }
    }

    pub fn step(
        &mut self,
        s: &StepStats,
        val: Option<f32>,
        memory: Option<&[super::MemoryReport]>,
        health: &crate::monitor::Health,
    ) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        self.ran += 1;
        if self.opts.plot.is_some() {
            self.losses.push((s.step, s.loss));
            if let Some(v) = val {
                self.val_losses.push((s.step, v));
            }
        }
        if self.json.is_some() || self.opts.report.is_some() {
            let mut v = serde_json::json!({
                "step": s.step, "loss": s.loss, "lr": s.lr,
                "tokens_per_s": s.tokens_per_s, "step_ms": s.step_ms, "grad_norm": s.grad_norm,
                "comm_bytes": s.comm_bytes, "loss_scale": s.loss_scale,
                "compute_ms": s.compute_ms,
            });
            if let Some(m) = s.mfu {
                v["mfu"] = serde_json::json!(m);
            }
            if let Some(r) = s.grad_reads {
                v["grad_reads"] = serde_json::json!(r);
            }
            if let Some(g) = s.groups_committed {
                v["groups_committed"] = serde_json::json!(g);
            }
            if let Some(b) = s.comm_bytes_total {
                v["comm_bytes_total"] = serde_json::json!(b);
            }
            if !health.stragglers.is_empty() {
                v["stragglers"] = serde_json::json!(health.stragglers);
            }
            if !health.new.is_empty() {
                v["straggler_events"] = serde_json::Value::Array(
                    health
                        .new
                        .iter()
                        .map(|s| {
                            serde_json::json!({"rank": s.rank, "host": s.host,
                                "compute_s": s.compute_s, "median_s": s.median_s, "steps": s.steps})
                        })
                        .collect(),
                );
            }
            if s.skipped {
                v["skipped"] = serde_json::json!(true);
            }
            if let Some(d) = &s.data {
                // A data-bound run shows here: the readers' tokens/s (busy
                // time only) against the step's, and an empty queue.
                v["data_skipped"] = serde_json::json!(d.skipped);
                v["data_queue"] = serde_json::json!(d.queued);
                v["data_tokenized"] = serde_json::json!(d.tokens);
                if d.busy_s > 0.0 {
                    v["data_tokenize_tokens_per_s"] = serde_json::json!(d.tokens as f64 / d.busy_s);
                }
            }
            if let Some(val) = val {
                v["val_loss"] = serde_json::json!(val);
            }
            if let Some(m) = memory {
                v["memory"] = serde_json::to_value(m).unwrap_or_default();
            }
            if let Some((f, path)) = &mut self.json {
                // One write per line, and on failure (a full disk) the file
                // is cut back: a line is in the log whole or not at all.
                let line = format!("{v}\n");
                let at = f.metadata().map(|m| m.len()).unwrap_or(0);
                if let Err(e) = f.write_all(line.as_bytes()) {
                    let _ = f.set_len(at);
                    return Err(crate::error::Error::Io(format!(
                        "{}: the JSON log line of step {} was not written: {e}",
                        path.display(),
                        s.step
                    )));
                }
            }
            if self.opts.report.is_some() {
                self.records.push(v);
            }
        }
        let every = self.opts.log_interval.max(1);
        if self.opts.progress
            && (s.step.is_multiple_of(every)
                || s.step + 1 == self.steps
                || val.is_some()
                || s.skipped)
        {
            let done = (s.step + 1) as f64 / self.steps.max(1) as f64;
            let filled = (done * 20.0).round() as usize;
            let bar: String = "#".repeat(filled) + &"-".repeat(20 - filled.min(20));
            let mut line = format!(
                "[{bar}] step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>8.0} tok/s | {:>6.1} ms",
                s.step + 1,
                self.steps,
                s.loss,
                s.lr,
                s.tokens_per_s,
                s.step_ms
            );
            if let Some(m) = s.mfu {
                line += &format!(" | MFU {:.1}%", m * 100.0);
            }
            if let Some(v) = val {
                line += &format!(" | val {v:.4}");
            }
            // fp16: the loss scale, and why a step did not update.
            if s.fp16 {
                line += &format!(" | scale {}", s.loss_scale);
            }
            if s.skipped {
                line += " | skipped: inf/NaN gradients";
                if s.scale_after < s.loss_scale {
                    line += &format!(", scale lowered to {}", s.scale_after);
                } else if s.fp16 {
                    line += &format!(", scale kept ({})", s.scale_kept_by);
                }
            }
            println!("{line}");
        }
        Ok(())
    }

    /// Write the loss curve and the report (rank 0). `trace`: the trace
    /// this run wrote, if it did (only that one is shown in the report).
    /// A run in which no step ran (resumed at or past `train.steps`)
    /// leaves the curve and the report of the run that got there.
    pub fn finish(&mut self, trace: Option<&Path>) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        if self.ran == 0 {
            let left: Vec<String> = [&self.opts.plot, &self.opts.report]
                .into_iter()
                .flatten()
                .map(|p| p.display().to_string())
                .collect();
            if self.opts.progress && !left.is_empty() {
                println!(
                    "no step ran in this run: {} left as they were",
                    left.join(" and ")
                );
            }
            return Ok(());
        }
        // The loss curve is cosmetic: failing to write it is a warning,
        // never what costs the run its model.
        if let Some(p) = &self.opts.plot {
            match write_loss_svg(p, &self.losses, &self.val_losses) {
                Ok(()) if self.opts.progress => println!("loss curve written to {}", p.display()),
                Ok(()) => {}
                Err(e) => eprintln!(
                    "warning: the loss curve was not written to {}: {e}",
                    p.display()
                ),
            }
        }
        if let Some(p) = &self.opts.report {
            // Cosmetic as well: a warning if it cannot be written. The
            // trace is read within bounds (a regular file, capped).
            let trace = trace.and_then(|t| {
                let text = crate::fsutil::read_text_capped("--trace", t, crate::fsutil::LOG_CAP);
                match text.and_then(|x| serde_json::from_str(&x).map_err(|e| e.to_string())) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        eprintln!("warning: the report has no pipeline timeline: {e}");
                        None
                    }
                }
            });
            let title = format!("Phalanx run: {} steps", self.records.len());
            let html = crate::report::html(&title, &self.records, trace.as_ref());
            match crate::report::write(p, &html) {
                Ok(()) if self.opts.progress => println!("report written to {}", p.display()),
                Ok(()) => {}
                Err(e) => eprintln!("warning: {e}"),
            }
        }
        Ok(())
    }
}

/// Keep the lines of JSON log `p` whose step is below `at` (rewritten
/// through a temporary file and a rename, so a crash leaves the old log or
/// the new one); returns them.
fn keep_steps_before(p: &Path, at: usize) -> std::io::Result<String> {
    let text = match std::fs::read_to_string(p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
        Err(e) => return Err(e),
    };
    let step = |l: &str| {
        serde_json::from_str::<serde_json::Value>(l)
            .ok()
            .and_then(|v| v["step"].as_u64())
    };
    let kept: String = text
        .lines()
        .filter(|l| step(l).is_some_and(|s| (s as usize) < at))
        .flat_map(|l| [l, "\n"])
        .collect();
    if kept == text {
        return Ok(kept);
    }
    // Whole or not at all, with no temporary left on an error.
    crate::fsutil::write_atomic(p, kept.as_bytes())?;
    Ok(kept)
}

/// A self-contained SVG line chart of training (and validation) loss, as
/// (step, loss) points.
pub fn write_loss_svg(path: &Path, losses: &[(usize, f32)], val: &[(usize, f32)]) -> Result<()> {
    let svg = crate::report::line_chart(
        "Loss",
        "step",
        &[
            (
                "train",
                "#1f77b4",
                losses.iter().map(|(i, v)| (*i as f64, *v as f64)).collect(),
            ),
            (
                "validation",
                "#d62728",
                val.iter().map(|(i, v)| (*i as f64, *v as f64)).collect(),
            ),
        ],
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    crate::fsutil::write_atomic(path, svg.as_bytes())?;
    Ok(())
}
