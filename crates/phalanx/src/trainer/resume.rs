//! Resuming the trainer from a checkpoint of any layout: `--resume PATH |
//! auto`, and automatically after a restart by the launcher; rank 0 picks
//! the newest checkpoint that verifies, every rank loads its share.

use super::{Resume, Trainer};
use crate::checkpoint::{self, Reader};
use crate::error::{Error, Result};
use crate::fault::restart_count;
use std::path::{Path, PathBuf};

impl Trainer {
    /// The checkpoint `--resume` asks for (collective: rank 0 decides for
    /// `auto`, so every rank loads the same one), loaded. Returns whether a
    /// checkpoint was loaded.
    ///
    /// A worker group restarted by the launcher (restart count > 0) with
    /// checkpoints on continues from the latest checkpoint under
    /// `checkpoint.dir`, whatever `--resume` says (that is where this job
    /// got to); only if there is none yet does it start as the first
    /// attempt did. With checkpoints off it starts over, and says so.
    pub(super) fn resume(&mut self, resume: Option<&Resume>) -> Result<bool> {
        let restart = restart_count();
        let on = self.cfg.checkpoint.interval > 0;
        let lead = self.mesh.world().rank() == 0;
        if restart > 0 && lead {
            if on {
                println!(
                    "restart {restart} of this job: resuming from the latest checkpoint under {}",
                    self.cfg.checkpoint.dir
                );
            } else {
                println!(
                    "note: restart {restart} of this job: checkpoints are off (checkpoint.interval = 0), \
                     so the restarted group starts from {}; set checkpoint.interval to lose at most one interval",
                    if resume.is_some() { "its --resume checkpoint" } else { "step 0" }
                );
            }
        }
        if restart > 0 && on {
            // Where the launcher names the job, only its own checkpoints
            // (an earlier experiment's in the same directory would
            // otherwise be taken for where this one got to); if it saved
            // none yet, the attempt starts as the first one did.
            // Rank 0's id decides (it picks the checkpoint): a rank whose
            // environment said otherwise must still take the same path.
            let job = crate::fault::job_id();
            let mut has = [job.is_some() as i64];
            self.mesh.world().broadcast(&mut has, 0)?;
            let filtered = has[0] == 1;
            let explicit = matches!(resume, Some(Resume::Path(_)));
            let loaded = self.resume_auto(!explicit && !filtered, job.as_deref())?;
            if loaded || (!explicit && !filtered) {
                return Ok(loaded);
            }
            if lead && filtered {
                println!(
                    "restart {restart}: no checkpoint of this job under {} yet; starting as the first attempt did",
                    self.cfg.checkpoint.dir
                );
            }
        }
        match resume {
            None => Ok(false),
            Some(Resume::Auto) => self.resume_auto(true, None),
            Some(Resume::Path(p)) => {
                let dir = self.resolve_resume(p)?;
                self.load_checkpoint(&dir)?;
                Ok(true)
            }
        }
    }

    /// The checkpoint `--resume PATH` names: PATH itself, or the newest
    /// under it. Rank 0 decides and every rank takes its choice (each
    /// reading `latest` and the listing itself could pick different steps
    /// while another job writes there, or through a network file system's
    /// cache). Collective.
    fn resolve_resume(&self, p: &Path) -> Result<PathBuf> {
        let world = self.mesh.world();
        let flag = |e: Error| match e {
            Error::Check(m) => Error::Check(format!("--resume {m}")),
            e => e,
        };
        // -2: rank 0 failed; -1: PATH itself; else the step under PATH.
        let mut pick = [-2i64];
        let mine = if world.rank() == 0 {
            let found = checkpoint::find(p).and_then(|d| {
                if d == p {
                    return Ok(-1);
                }
                let step = Reader::open(&d)?.meta.step;
                if d != p.join(checkpoint::step_dir_name(step)) {
                    return Err(Error::Check(format!(
                        "{}: holds step {step}, but is not named {}",
                        d.display(),
                        checkpoint::step_dir_name(step)
                    )));
                }
                Ok(step as i64)
            });
            if let Ok(v) = &found {
                pick[0] = *v;
            }
            Some(found)
        } else {
            None
        };
        world.broadcast(&mut pick, 0)?;
        match (pick[0], mine) {
            (_, Some(Err(e))) => Err(flag(e)),
            (-2, _) => Err(Error::Check(format!(
                "--resume {}: rank 0 found no checkpoint there (it says why)",
                p.display()
            ))),
            (-1, _) => Ok(p.to_path_buf()),
            (step, _) => Ok(p.join(checkpoint::step_dir_name(step as usize))),
        }
    }

    /// `--resume auto`: load the latest checkpoint under `checkpoint.dir`
    /// that verifies (rank 0 picks, every rank loads it), of job `job` only
    /// when given. Returns whether one was loaded; `fresh_note`: say so on
    /// rank 0 when there is none.
    fn resume_auto(&mut self, fresh_note: bool, job: Option<&str>) -> Result<bool> {
        let root = PathBuf::from(&self.cfg.checkpoint.dir);
        let world = self.mesh.world().clone();
        let (rank, size) = (world.rank(), world.size());
        // Rank 0 proposes the newest checkpoint whose metadata opens and
        // whose files have their recorded sizes; every rank then checks the
        // checksums of its share of the files (file i on rank i mod world),
        // so that hashing a large checkpoint is spread over the ranks
        // rather than done by rank 0 while the others wait out their
        // collective deadline. A checkpoint any rank finds broken is
        // skipped (that rank says why) for the next one.
        let (cands, damaged) = if rank == 0 {
            for name in checkpoint::rotate::recover_replaced(&root) {
                eprintln!(
                    "note: {name} under {} was moved aside by a save that never finished replacing it; put back",
                    root.display()
                );
            }
            let cands = checkpoint::list(&root);
            let newest = cands
                .iter()
                .filter_map(|c| checkpoint::rotate::step_of_name(c.file_name()?.to_str()?))
                .max();
            // Newer step directories without their metadata (a save renames
            // a checkpoint into place whole): damaged, said, and counted as
            // failed (a run does not start fresh over them).
            let damaged: Vec<String> = checkpoint::incomplete(&root)
                .into_iter()
                .filter(|(step, _)| newest.is_none_or(|n| *step > n))
                .map(|(_, p)| {
                    eprintln!(
                        "warning: skipping {}: it has no metadata.json (a save never leaves one \
                         out: damaged?)",
                        p.display()
                    );
                    format!("{}: no metadata.json", p.display())
                })
                .collect();
            (cands, damaged)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut next = 0usize;
        let mut failed: Vec<String> = damaged;
        loop {
            let mut pick = [-1i64];
            if rank == 0 {
                while let Some(c) = cands.get(next) {
                    next += 1;
                    match checkpoint::Reader::open(c) {
                        Ok(r) if job.is_some() && r.meta.job.as_deref() != job => {
                            println!(
                                "note: {} was saved by {}, not this job ({}): not resuming from it",
                                c.display(),
                                r.meta.job.as_deref().unwrap_or("a job of unknown id"),
                                job.unwrap_or_default()
                            );
                        }
                        Ok(r) => {
                            pick[0] = r.meta.step as i64;
                            break;
                        }
                        Err(e) => {
                            eprintln!(
                                "warning: skipping checkpoint {}: {e}; trying an earlier one",
                                c.display()
                            );
                            failed.push(format!("{}: {e}", c.display()));
                        }
                    }
                }
            }
            world.broadcast(&mut pick, 0)?;
            if pick[0] < 0 {
                break;
            }
            let dir = root.join(checkpoint::step_dir_name(pick[0] as usize));
            // Each rank verifies its share of the files; every rank learns
            // the index of a file that failed (-1: none), so rank 0's
            // refusal, which the launcher shows, names it without hashing
            // the other ranks' files itself.
            let reader = checkpoint::Reader::open(&dir);
            // (-2: the metadata did not open on this rank.)
            let (mine, failed_file) = match &reader {
                Err(e) => (Some(e.to_string()), -2),
                Ok(r) => (rank..r.meta.files.len())
                    .step_by(size)
                    .find_map(|i| r.verify(i).err().map(|e| (Some(e.to_string()), i as i64)))
                    .unwrap_or((None, -1)),
            };
            if let Some(e) = &mine {
                eprintln!(
                    "warning: skipping checkpoint {} (rank {rank}): {e}; trying an earlier one",
                    dir.display()
                );
            }
            let mut bad = [mine.is_some() as i64, failed_file];
            world.all_reduce(&mut bad, phalanx_comm::ReduceOp::Max)?;
            if bad[0] == 0 {
                self.load_checkpoint(&dir)?;
                return Ok(true);
            }
            if rank == 0 {
                let named = reader.as_ref().ok().and_then(|r| {
                    let f = r.meta.files.get(usize::try_from(bad[1]).ok()?)?;
                    Some(format!(
                        "checkpoint file {} failed verification on rank {}",
                        dir.join(&f.name).display(),
                        bad[1] as usize % size
                    ))
                });
                let other = if bad[1] == -2 {
                    "another rank could not open it (its warning says why)"
                } else {
                    "a file failed verification (another rank says which)"
                };
                failed.push(format!(
                    "{}: {}",
                    dir.display(),
                    mine.or(named).unwrap_or_else(|| other.into())
                ));
            }
        }
        // Nothing verified: with checkpoints there, refuse rather than
        // start fresh over them (the run's rotation would delete them).
        let mut refused = [(rank == 0 && !failed.is_empty()) as i64];
        world.broadcast(&mut refused, 0)?;
        if refused[0] == 1 {
            return Err(Error::Check(if rank == 0 {
                format!(
                    "every checkpoint under {} fails verification, so this run will not start fresh over \
                     them (repair or move them, or choose another checkpoint.dir):\n  {}",
                    root.display(),
                    failed.join("\n  ")
                )
            } else {
                format!(
                    "no checkpoint under {} verifies (rank 0 lists them)",
                    root.display()
                )
            }));
        }
        if fresh_note && rank == 0 {
            println!(
                "--resume auto: no checkpoint under {}; starting fresh",
                root.display()
            );
        }
        Ok(false)
    }

    /// Load a checkpoint saved in any layout into this one: parameters and
    /// optimizer state of every range this rank owns, the loss scaler, and
    /// the step to continue from. Collective.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let t0 = std::time::Instant::now();
        let reader = Reader::open(dir)?;
        let layout = self.engine.layout().clone();
        let placement = self.placement.clone();
        reader.check_model(&layout, &*placement)?;
        let kind = self.strat.optimizers().first().map(|o| o.kind());
        let step = match (&reader.meta.optimizer, kind) {
            (Some((k, t)), Some(mine)) if k == mine => *t,
            (Some((k, _)), Some(mine)) => {
                if self.mesh.world().rank() == 0 {
                    eprintln!("warning: {} holds {k} state; this run uses {mine}: its optimizer starts fresh", dir.display());
                }
                0
            }
            _ => 0,
        };
        // The checkpoint's config, read once for the checks below.
        let saved = reader.meta.config.parse::<toml::Table>().ok();
        let saved_int = |s: &str, k: &str| {
            saved
                .as_ref()
                .and_then(|t| t.get(s))
                .and_then(|v| v.get(k))
                .and_then(|v| v.as_integer())
        };
        // Streaming DiLoCo's schedule decides which fragment an averaged
        // pseudo-gradient still in flight belongs to: under another
        // schedule it would land on another fragment, silently.
        if let Some(t) = &saved {
            let d = &self.cfg.diloco;
            let int = |k: &str| saved_int("diloco", k);
            let now = [
                ("inner_steps", d.inner_steps),
                ("fragments", d.fragments),
                ("overlap_steps", d.overlap_steps),
            ];
            // Only a DiLoCo checkpoint holds outer steps in flight (a DDP
            // one starts every group from its model).
            let saved_on = int("inner_steps").is_some_and(|h| h > 0)
                || t.get("diloco")
                    .and_then(|v| v.get("enabled"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false);
            if saved_on && !d.on() && self.mesh.world().rank() == 0 {
                eprintln!(
                    "note: {} was saved by DiLoCo; this run, without it, starts from its last \
                     outer step's model (each group's inner steps since are not in it)",
                    dir.display()
                );
            }
            let streaming = d.fragments > 1 || int("fragments").is_some_and(|f| f > 1);
            if d.on() && saved_on && streaming {
                for (k, v) in now {
                    if let Some(saved) = int(k).filter(|&s| s != v as i64) {
                        return Err(Error::Check(format!(
                            "--resume {}: Streaming DiLoCo's schedule differs: diloco.{k} = {saved} \
                             in the checkpoint, {v} here; its outer steps in flight belong to the \
                             checkpoint's fragments: resume with its diloco settings",
                            dir.display()
                        )));
                    }
                }
            }
        }
        let mut fill = |range: std::ops::Range<usize>, kind: &str| {
            reader.fill(&layout, &*placement, range, kind)
        };
        self.strat.load_state(&mut self.engine, &mut fill, step)?;
        self.load_hook_state(&reader)?;
        if reader.meta.precision == self.cfg.precision().to_string() {
            // The scale's history is the checkpoint's; its settings
            // (fp16.*, train.on_nonfinite) are this run's config.
            let (scaler, differs) = self.scaler.resumed(&reader.meta.loss_scaler);
            if differs && self.mesh.world().rank() == 0 {
                println!(
                    "note: the loss scaling settings differ from the checkpoint's (fp16.*, \
                     train.on_nonfinite): this run's config applies from here on"
                );
            }
            self.scaler = scaler;
        }
        self.start_step = reader.meta.step;
        // The data continues at the checkpoint's sample position, whatever
        // this run's global batch (a changed data config is refused, unless
        // data.on_resume_mismatch says to go on).
        let warn = self.cfg.data.on_resume_mismatch == crate::data::OnMismatch::Warn;
        let warning = self
            .loader
            .resume_at_or_warn(
                reader.meta.step as u64,
                reader.meta.samples_consumed,
                reader.meta.data.as_ref(),
                warn,
            )
            .map_err(|e| Error::Check(format!("resuming from {}: {e}", dir.display())))?;
        if let (Some(w), 0) = (warning, self.mesh.world().rank()) {
            eprintln!("warning: resuming from {}: {w}", dir.display());
        }
        // A checkpoint of step 0 (weights imported by `phalanx checkpoint
        // from-hf`) has no schedule or data position to continue.
        let trained = reader.meta.step > 0;
        if self.mesh.world().rank() == 0 && trained {
            // The schedule's length is train.steps unless optim.decay_steps
            // fixes it: a resume that changes train.steps reshapes the rate
            // from here on (a cosine at its floor starts decaying again).
            let now = self.cfg.train.steps as i64;
            if let (Some(steps), Some(0), 0) = (
                saved_int("train", "steps").filter(|&s| s != now),
                saved_int("optim", "decay_steps"),
                self.cfg.optim.decay_steps,
            ) {
                println!(
                    "note: the checkpoint's run had train.steps = {steps}, this one {now}: the \
                     learning-rate schedule, which spans train.steps, changes shape from here \
                     on; set optim.decay_steps = {steps} to keep the checkpoint's"
                );
            }
        }
        if self.mesh.world().rank() == 0 && trained && reader.meta.global_batch != self.global_batch
        {
            println!(
                "note: {} was trained with a global batch of {}, this run uses {}: the data \
                 continues at sample {} (no sample repeated or skipped)",
                dir.display(),
                reader.meta.global_batch,
                self.global_batch,
                reader.meta.samples_consumed
            );
        }
        if self.mesh.world().rank() == 0 {
            println!(
                "resumed from {} (step {}, saved by {} on {} rank(s)) in {:.1} ms",
                dir.display(),
                reader.meta.step,
                reader.meta.layout.strategy,
                reader.meta.layout.world,
                t0.elapsed().as_secs_f64() * 1e3
            );
            // A resume with no step left to run changes nothing on disk:
            // the newer checkpoints stay `latest`'s to take.
            if reader.meta.step < self.cfg.train.steps {
                self.mark_resumed(dir);
            }
        }
        Ok(())
    }

    /// Point `latest` at the checkpoint this run resumed, when it is one of
    /// the directory this run saves to: the saves that follow are then
    /// `after` it, so a resume after one of them was killed before its
    /// `latest` takes that one (see `checkpoint::list`), and a newer step
    /// of the line abandoned by resuming an older one is not taken over it.
    /// (Always rewritten, even where it names that one already: its time
    /// then says the checkpoints after it were left behind. Only by the
    /// run that holds the directory's lock, which saves there.)
    fn mark_resumed(&self, dir: &Path) {
        let root = Path::new(&self.cfg.checkpoint.dir);
        if self.cfg.checkpoint.interval == 0 || !checkpoint::lock::held(root) {
            return;
        }
        let Ok(dir) = dir.canonicalize() else {
            return;
        };
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            return;
        };
        let name = name.to_string_lossy();
        let ours = root.canonicalize().is_ok_and(|r| r == parent);
        // (A copy such as `best/` is no name `latest` is read by.)
        if ours && checkpoint::rotate::step_of_name(&name).is_some() {
            if let Err(e) = checkpoint::rotate::write_latest(root, &name) {
                eprintln!(
                    "warning: resumed from {}, but cannot point {} at it: {e}",
                    dir.display(),
                    root.join("latest").display()
                );
            }
        }
    }

    /// This rank's communication-hook state (error-feedback residuals,
    /// PowerSGD's Q, DGC's velocity, the counters the warm-ups read), saved
    /// by the same rank. It belongs to each rank's buckets, so it is loaded
    /// only into the layout that saved it: another layout with the same
    /// hook is refused (its error says how to go on), except in an elastic
    /// job (`PHALANX_ELASTIC=1`, or a restarted worker group), where it
    /// starts fresh with a note; a run with another hook starts its own
    /// fresh.
    fn load_hook_state(&mut self, reader: &Reader) -> Result<()> {
        if reader.meta.rank_state.is_empty() {
            return Ok(());
        }
        let lead = self.mesh.world().rank() == 0;
        let mine = crate::strategy::hook_kind(&self.cfg);
        let saved = saved_hook(&reader.meta.config);
        if saved != Some(mine) {
            if lead {
                println!(
                    "note: {} holds the state of parallel.comm_hook = {}; this run uses {mine}, \
                     which starts its own fresh",
                    reader.dir().display(),
                    saved.map_or("(unknown)".to_string(), |k| k.to_string())
                );
            }
            return Ok(());
        }
        let m = &self.mesh;
        let here = (
            m.world().size(),
            m.dp_size,
            m.pp_size,
            m.tp_size,
            self.cfg.sharding().map(|s| s.stage).unwrap_or(0),
        );
        let l = &reader.meta.layout;
        let there = (l.world, l.dp, l.pp, l.tp, l.zero_stage);
        // The strategy too: a pipeline schedule of other chunks (1f1b to
        // interleaved:2) gives a rank other layers in a buffer of the same
        // length, where residuals would land on the wrong parameters.
        let (name, saved_name) = (self.strat.name(), l.strategy.clone());
        let same = here == there && buckets_of(&name) == buckets_of(&saved_name);
        // An elastic job re-formed with other members (or a restarted
        // worker group, whose world can only have changed so) would meet
        // the refusal below at every round: there the hook starts fresh,
        // as PyTorch's hooks do after a restart.
        let elastic = std::env::var("PHALANX_ELASTIC").as_deref() == Ok("1") || restart_count() > 0;
        if !same && elastic {
            if lead {
                println!(
                    "note: {} holds each rank's parallel.comm_hook = {mine} state for {} ranks \
                     (dp {}, pp {}, tp {}); this elastic round has {} (dp {}, pp {}, tp {}): the \
                     hook starts fresh (error-feedback residuals and warm-up counters reset), the \
                     model and optimizer carry over",
                    reader.dir().display(),
                    there.0,
                    there.1,
                    there.2,
                    there.3,
                    here.0,
                    here.1,
                    here.2,
                    here.3
                );
            }
            return Ok(());
        }
        if !same {
            return Err(Error::Check(format!(
                "{} holds each rank's parallel.comm_hook = {mine} state (error-feedback residuals, \
                 warm starts, step counts), saved by {} ranks (dp {}, pp {}, tp {}, ZeRO stage {}, \
                 {saved_name}); this run is {} ranks (dp {}, pp {}, tp {}, ZeRO stage {}, {name}). \
                 That state belongs to \
                 each rank's gradient buckets and cannot be split or merged: resume on the saved \
                 layout for an exact continuation, or once with another parallel.comm_hook \
                 (e.g. none) to carry the model and optimizer over without it",
                reader.dir().display(),
                there.0,
                there.1,
                there.2,
                there.3,
                there.4,
                here.0,
                here.1,
                here.2,
                here.3,
                here.4
            )));
        }
        let state = reader.rank_state(m.world().rank())?;
        self.strat.load_hook_state(&state)
    }
}

/// What of a strategy's name decides its ranks' gradient buckets: the
/// name, except that a pipeline's schedule counts only by its chunks per
/// rank (gpipe, 1f1b and zb-h1 give a rank the same layers; interleaved:V
/// gives it V chunks).
fn buckets_of(strategy: &str) -> String {
    let Some(rest) = strategy.strip_prefix("pipeline ") else {
        return strategy.to_string();
    };
    let (schedule, dp) = rest.split_once(' ').unwrap_or((rest, ""));
    let chunks = schedule.parse::<crate::config::ScheduleKind>().map_or_else(
        |_| schedule.to_string(),
        |k| k.chunks_per_rank().to_string(),
    );
    format!("pipeline of {chunks} chunk(s) per rank {dp}")
}

/// The communication hook the run that saved `config` (its TOML) used,
/// if the text says.
fn saved_hook(config: &str) -> Option<crate::config::CommHookKind> {
    let t: toml::Table = config.parse().ok()?;
    let get = |sec: &str, key: &str| t.get(sec).and_then(|s| s.get(key)).cloned();
    let hook = match get("parallel", "comm_hook") {
        Some(toml::Value::String(s)) => s.parse().ok()?,
        Some(_) => return None,
        None => crate::config::CommHookKind::None,
    };
    let qgz = matches!(
        get("zero_optimization", "zero_quantized_gradients"),
        Some(toml::Value::Boolean(true))
    );
    Some(match hook {
        crate::config::CommHookKind::None if qgz => crate::config::CommHookKind::Int8,
        k => k,
    })
}

#[cfg(test)]
mod tests {
    use super::buckets_of;

    #[test]
    fn hook_state_follows_a_pipelines_chunks_not_its_schedules_name() {
        let same = |a: &str, b: &str| buckets_of(a) == buckets_of(b);
        assert!(same("pipeline gpipe + DDP", "pipeline 1f1b + DDP"));
        assert!(same("pipeline zb-h1 + ZeRO-1", "pipeline 1f1b + ZeRO-1"));
        assert!(!same("pipeline 1f1b + DDP", "pipeline interleaved:2 + DDP"));
        assert!(!same(
            "pipeline interleaved:2 + DDP",
            "pipeline interleaved:3 + DDP"
        ));
        assert!(!same("pipeline 1f1b + DDP", "pipeline 1f1b + ZeRO-1"));
        assert!(same("DDP", "DDP"));
        assert!(!same("DDP", "ZeRO-1"));
    }
}
