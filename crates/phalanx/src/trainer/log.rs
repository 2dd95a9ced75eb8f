//! What a run shows: a progress line on rank 0, a JSON log (one object per
//! step), and a loss-curve image (SVG) at the end.

use super::{Report, StepStats};
use crate::error::Result;
use std::io::Write;
use std::path::PathBuf;

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
    /// Continue from a checkpoint (`--resume`).
    pub resume: Option<Resume>,
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
            resume: None,
        }
    }
}

pub struct StepLog {
    lead: bool,
    opts: RunOptions,
    steps: usize,
    /// The JSON log and the path (for messages).
    json: Option<(std::fs::File, PathBuf)>,
}

impl StepLog {
    /// `resumed_at`: a run resumed at that step continues the JSON log of
    /// the run it continues: the lines of steps before it are kept, later
    /// ones (written after the checkpoint by a run that then died) and a
    /// torn last line are dropped, so every step appears once. Otherwise
    /// the log starts empty.
    pub fn new(
        opts: &RunOptions,
        lead: bool,
        steps: usize,
        resumed_at: Option<usize>,
    ) -> Result<StepLog> {
        let json = match (&opts.log_json, lead) {
            (Some(p), true) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                let err = |e: std::io::Error| {
                    crate::error::Error::Io(format!("cannot create {}: {e}", p.display()))
                };
                if let Some(at) = resumed_at {
                    keep_steps_before(p, at).map_err(err)?;
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
        Ok(StepLog {
            lead,
            opts: opts.clone(),
            steps,
            json,
        })
    }

    pub fn step(
        &mut self,
        s: &StepStats,
        val: Option<f32>,
        memory: Option<&[super::MemoryReport]>,
        stragglers: &[usize],
    ) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        if let Some((f, path)) = &mut self.json {
            let mut v = serde_json::json!({
                "step": s.step, "loss": s.loss, "lr": s.lr,
                "tokens_per_s": s.tokens_per_s, "step_ms": s.step_ms, "grad_norm": s.grad_norm,
                "comm_bytes": s.comm_bytes, "loss_scale": s.loss_scale,
                "compute_ms": s.compute_ms,
            });
            if !stragglers.is_empty() {
                v["stragglers"] = serde_json::json!(stragglers);
            }
            if s.skipped {
                v["skipped"] = serde_json::json!(true);
            }
            if let Some(val) = val {
                v["val_loss"] = serde_json::json!(val);
            }
            if let Some(m) = memory {
                v["memory"] = serde_json::to_value(m).unwrap_or_default();
            }
            // One write per line, and on failure (a full disk) the file is
            // cut back: a line is in the log whole or not at all.
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
            if let Some(v) = val {
                line += &format!(" | val {v:.4}");
            }
            // fp16: the loss scale, and why a step did not update.
            if s.loss_scale != 1.0 {
                line += &format!(" | scale {}", s.loss_scale);
            }
            if s.skipped {
                line += " | skipped: inf/NaN gradients";
                if s.loss_scale != 1.0 {
                    line += ", scale lowered";
                }
            }
            println!("{line}");
        }
        Ok(())
    }

    pub fn finish(&mut self, r: &Report) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        // The loss curve is cosmetic: failing to write it is a warning,
        // never what costs the run its model.
        if let Some(p) = &self.opts.plot {
            match write_loss_svg(p, &r.losses, &r.val_losses) {
                Ok(()) if self.opts.progress => println!("loss curve written to {}", p.display()),
                Ok(()) => {}
                Err(e) => eprintln!(
                    "warning: the loss curve was not written to {}: {e}",
                    p.display()
                ),
            }
        }
        Ok(())
    }
}

/// Keep the lines of JSON log `p` whose step is below `at` (rewritten
/// through a temporary file and a rename, so a crash leaves the old log or
/// the new one).
fn keep_steps_before(p: &std::path::Path, at: usize) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
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
        return Ok(());
    }
    let mut name = p.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = p.with_file_name(name);
    std::fs::write(&tmp, kept)?;
    std::fs::rename(&tmp, p)
}

/// A self-contained SVG line chart of training (and validation) loss.
pub fn write_loss_svg(path: &std::path::Path, losses: &[f32], val: &[(usize, f32)]) -> Result<()> {
    let (w, h, m) = (640.0f64, 400.0f64, 50.0f64);
    let n = losses.len().max(2) as f64;
    let all = losses
        .iter()
        .copied()
        .chain(val.iter().map(|v| v.1))
        .filter(|x| x.is_finite());
    let (lo, hi) = all.fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo <= hi {
        (lo as f64, (hi as f64).max(lo as f64 + 1e-6))
    } else {
        (0.0, 1.0)
    };
    let x = |i: f64| m + i / (n - 1.0) * (w - 2.0 * m);
    let y = |v: f64| h - m - (v - lo) / (hi - lo) * (h - 2.0 * m);
    let pts = |it: &mut dyn Iterator<Item = (f64, f64)>| {
        it.map(|(i, v)| format!("{:.1},{:.1}", x(i), y(v)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let train = pts(&mut losses
        .iter()
        .enumerate()
        .map(|(i, v)| (i as f64, *v as f64)));
    let valp = pts(&mut val.iter().map(|(i, v)| (*i as f64, *v as f64)));
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{cx}\" y=\"{t}\" text-anchor=\"middle\">step</text>\n\
         <text x=\"12\" y=\"{cy}\" transform=\"rotate(-90 12 {cy})\" text-anchor=\"middle\">loss</text>\n\
         <text x=\"{m}\" y=\"{lt}\" text-anchor=\"end\">{hi:.3}</text>\n\
         <text x=\"{m}\" y=\"{bb}\" text-anchor=\"end\">{lo:.3}</text>\n\
         <text x=\"{r}\" y=\"{t}\" text-anchor=\"end\">{last}</text>\n",
        b = h - m,
        r = w - m,
        cx = w / 2.0,
        t = h - m + 30.0,
        cy = h / 2.0,
        lt = m - 5.0,
        bb = h - m + 15.0,
        last = losses.len().saturating_sub(1),
    );
    s += &format!(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{train}\"/>\n"
    );
    if !val.is_empty() {
        s += &format!(
            "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"2\" points=\"{valp}\"/>\n"
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" fill=\"#1f77b4\">train</text><text x=\"{}\" y=\"{}\" fill=\"#d62728\">validation</text>\n</svg>\n",
        w - m - 120.0,
        m - 10.0,
        w - m - 70.0,
        m - 10.0
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, s)?;
    Ok(())
}
