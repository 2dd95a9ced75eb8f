//! `Trainer::run`: the training loop around `Trainer::step`: resume,
//! schedule, validation, checkpoints (synchronous or asynchronous), fault
//! injection, logs and the monitor, and the final report.

use super::{print_memory, Report, RunOptions, StepLog, Trainer};
use crate::error::Result;
use crate::fault;
use std::time::Instant;

impl Trainer {
    /// Train for `train.steps` steps, logging on global rank 0.
    ///
    /// An error aborts the job's process group with it
    /// (`ProcessGroup::fail_peers`; not under MPI): the other ranks, whatever
    /// collective they wait in, fail at once with `rank N (host) aborted:
    /// <this error>` rather than with a bare "shut down" or, on NCCL, a
    /// timeout.
    pub fn run(&mut self, opts: &RunOptions) -> Result<Report> {
        let r = self.run_steps(opts);
        if let Err(e) = &r {
            if let Some(f) = self.ft.as_mut() {
                // The other replica groups go on without this one at once.
                f.mgr.abort(&e.to_string());
            }
            self.mesh.world().fail_peers(&e.to_string());
        }
        r
    }

    fn run_steps(&mut self, opts: &RunOptions) -> Result<Report> {
        let steps = self.cfg.train.steps;
        let lead = self.pg.global_rank() == 0;
        if self.cfg.fault_tolerance.enabled() {
            // Groups may share a file system: each keeps its own checkpoints.
            let ft = &self.cfg.fault_tolerance;
            self.cfg.checkpoint.dir =
                format!("{}/replica-{}", self.cfg.checkpoint.dir, ft.replica_id);
        }
        self.preflight_checkpoints()?;
        let resumed = self.resume(opts.resume.as_ref())?;
        let first = self.start_step;
        let mut log = StepLog::new(opts, lead, steps, resumed.then_some(first))?;
        let m = &self.mesh;
        if lead && opts.progress {
            println!(
                "training {} parameters per rank on {} rank(s) (dp {} x pp {} x tp {}): global batch {} x {} tokens \
                 (micro-batch {} x grad_accum {}), {} steps; {}, {} compute{}{}",
                self.strat.local_params(&self.engine),
                m.world().size(),
                m.dp_size,
                m.pp_size,
                m.tp_size,
                self.global_batch,
                self.loader.seq_len(),
                self.micro,
                self.cfg.train.grad_accum_steps,
                steps,
                self.strat.name(),
                self.cfg.precision(),
                match self.cfg.train.reduce_dtype {
                    crate::config::Precision::Fp32 => String::new(),
                    r => format!(", gradients reduced in {r}"),
                },
                match self.cfg.recompute() {
                    crate::config::Recompute::None => String::new(),
                    r => format!(", activation checkpointing {r}"),
                },
            );
        }
        let (h, frags) = (
            self.cfg.diloco.inner_steps,
            self.cfg.diloco.fragments.max(1),
        );
        if lead && opts.progress && self.cfg.diloco.on() && h > 0 {
            let lost = crate::strategy::diloco::Schedule {
                inner_steps: h,
                fragments: frags,
            }
            .left_out(steps);
            if frags == 1 && lost[0] > 0 {
                println!(
                    "note: train.steps = {steps} is not a multiple of diloco.inner_steps = {h}: \
                     the last {} inner steps of each group are not in the final model (the \
                     anchor)",
                    lost[0]
                );
            } else if lost.iter().any(|&n| n > 0) {
                let each: Vec<String> = lost.iter().map(|n| n.to_string()).collect();
                println!(
                    "note: the {frags} fragments sync at staggered steps, so the final model \
                     (the anchor) leaves out the last {} inner steps of fragments 0 to {} \
                     (train.steps = {steps}, diloco.inner_steps = {h})",
                    each.join("/"),
                    frags - 1
                );
            }
        }
        let mut report = Report::default();
        let every = self.cfg.checkpoint.interval;
        let mut tok_s = Vec::new();
        // Peers for straggler detection: the ranks at the same pipeline stage.
        let stage = self.mesh.coords().pp;
        let mut monitor =
            crate::monitor::Monitor::new(self.mesh.world(), stage, &self.cfg.monitor)?;
        if let (Some(url), true) = (monitor.metrics_url(), opts.progress) {
            println!("Prometheus metrics at {url}");
        }
        let sent_at_start = self.bytes_sent();
        let peak = self.matmul_peak()?;
        let mut k = first;
        if self.cfg.fault_tolerance.enabled() {
            self.ft = Some(super::ft::Ft::connect(&self.cfg, &self.mesh)?);
            if self.strat.diloco_mut().is_some() {
                // Join the groups at their next outer step (or all start
                // together): take the quorum's state. A checkpoint of an
                // outer step's step was saved after that outer step.
                let h = self.cfg.diloco.inner_steps.max(1);
                let applied = k > 0 && k.is_multiple_of(h);
                k = self.ft_outer(k, false, applied, lead)?;
            }
        }
        while k < steps {
            if let Some(f) = self.ft.as_mut() {
                if let Some(nk) = f.resume_at.take() {
                    k = nk;
                }
                if f.diloco.is_none() {
                    if f.sync {
                        k = self.ft_begin(k, lead)?;
                    } else {
                        // Checked during the forward, read after it.
                        f.mgr
                            .start_quorum(k as u64)
                            .map_err(crate::error::Error::Comm)?;
                    }
                }
                if k >= steps {
                    break;
                }
            }
            fault::at_step(self.mesh.world().rank(), k);
            if let Some(m) = fault::error_at(self.mesh.world().rank(), k) {
                return Err(crate::Error::Check(m));
            }
            let Some(mut s) = self.step_inner(k)? else {
                continue; // not committed: the same step with the next quorum
            };
            s.mfu = self
                .flops_per_token
                .zip(peak)
                .map(|(f, p)| f * s.tokens_per_s / p);
            s.comm_bytes_total = Some(self.bytes_sent() - sent_at_start);
            let health = monitor.after_step(&self.figures(&s, sent_at_start))?;
            for st in &health.new {
                if lead && opts.progress {
                    println!(
                        "{st} (monitor.straggler_factor = {})",
                        self.cfg.monitor.straggler_factor
                    );
                }
                report.stragglers.push((k, st.clone()));
            }
            report.losses.push(s.loss);
            report.grad_norms.push(s.grad_norm);
            report.comm_bytes.push(s.comm_bytes);
            tok_s.push(s.tokens_per_s);
            let eval_now = self.cfg.train.eval_interval > 0
                && ((k + 1).is_multiple_of(self.cfg.train.eval_interval) || k + 1 == steps);
            let val = if eval_now { self.evaluate()? } else { None };
            if let Some(v) = val {
                report.val_losses.push((k, v));
            }
            let mem = if k == first {
                self.memory.as_deref()
            } else {
                None
            };
            if let (Some(m), true, true) = (mem, lead, opts.progress) {
                print_memory(m);
            }
            log.step(&s, val, mem, &health)?;
            report.skipped += usize::from(s.skipped);
            // A dynamic fp16 scale stuck at its minimum while the gradients
            // keep overflowing is an error, not a run that silently skips
            // every step; said after the step is logged, so the log holds
            // the step that ended it (every rank has the same verdict and
            // scaler: all end here).
            self.scaler.check_floor().map_err(crate::Error::Check)?;
            if every > 0 && ((k + 1).is_multiple_of(every) || k + 1 == steps) {
                let t0 = Instant::now();
                let done = self.save_checkpoint(k + 1)?;
                if lead && opts.progress {
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    match (&self.ckpt_async, done) {
                        (Some(_), _) => println!(
                            "checkpoint of step {} staged in {ms:.1} ms, writing in the background",
                            k + 1
                        ),
                        (None, Some(d)) => {
                            println!("checkpoint {} written in {ms:.1} ms", d.display())
                        }
                        (None, None) => {}
                    }
                }
            }
            if self.stop_agreed(opts)? && k + 1 < steps {
                if every > 0 && !(k + 1).is_multiple_of(every) {
                    self.save_checkpoint(k + 1)?;
                }
                if lead && opts.progress {
                    println!(
                        "stopping after step {} as asked{}",
                        k + 1,
                        if every > 0 {
                            " (checkpoint of it saved)"
                        } else {
                            ""
                        }
                    );
                }
                report.stopped_at = Some(k + 1);
                break;
            }
            k += 1;
        }
        if let (Some(f), true) = (&self.ft, lead && opts.progress) {
            println!(
                "fault tolerance: {} samples committed over the run by this group's quorums",
                f.samples_committed
            );
        }
        if let Some(d) = self.wait_checkpoint()? {
            if lead && opts.progress {
                println!("checkpoint {} written", d.display());
            }
        }
        if report.stopped_at.is_none() {
            // After the last checkpoint, which resumes exactly without it.
            self.strat.finish_run(&mut self.engine, steps)?;
        }
        // After two warm-up steps; a shorter run averages what it has.
        let timed = if tok_s.len() > 2 {
            &tok_s[2..]
        } else {
            &tok_s[..]
        };
        report.tokens_per_s = if timed.is_empty() {
            0.0
        } else {
            timed.iter().sum::<f64>() / timed.len() as f64
        };
        // The trace this run wrote, if it did: the only one the report shows.
        let mut trace = None;
        if let Some(p) = self.strat.pipeline() {
            self.report_pipeline(p, &mut report, lead && opts.progress)?;
            if let Some(path) = &opts.trace {
                // Cosmetic too: a warning, never the run's end. (Collective:
                // every rank takes part whatever happens on rank 0.)
                match p.write_trace(path) {
                    Err(e) if lead => eprintln!(
                        "warning: the trace was not written to {}: {e}",
                        path.display()
                    ),
                    Ok(()) => {
                        trace = Some(path.as_path());
                        if lead && opts.progress {
                            println!(
                                "pipeline trace written to {} (open in Perfetto or chrome://tracing)",
                                path.display()
                            );
                        }
                    }
                    _ => {}
                }
            }
        } else if let (Some(path), true) = (&opts.trace, lead) {
            println!("no trace written to {}: timelines are recorded for pipeline runs (parallel.pp > 1)", path.display());
        }
        log.finish(trace)?;
        Ok(report)
    }

    /// Whether any rank was asked to stop (collective when a stop flag is given).
    fn stop_agreed(&self, opts: &RunOptions) -> Result<bool> {
        let Some(flag) = opts.stop else {
            return Ok(false);
        };
        let mut v = [u8::from(flag.load(std::sync::atomic::Ordering::SeqCst)) as f32];
        self.mesh
            .world()
            .all_reduce(&mut v, phalanx_comm::ReduceOp::Max)?;
        Ok(v[0] > 0.0)
    }
}
