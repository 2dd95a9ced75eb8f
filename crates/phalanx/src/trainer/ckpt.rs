//! The trainer's checkpoints: save every `checkpoint.interval` steps and at
//! the end (synchronously, or in the background with `checkpoint.async`),
//! resume from a checkpoint of any layout (`--resume PATH | auto`, and
//! automatically after a restart by the launcher).

use super::{Resume, Trainer};
use crate::checkpoint::{self, write::Header, Reader, SavedLayout, Snapshot};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The launcher's restart count (torchrun's and ours): > 0 in a restarted
/// worker group.
fn restart_count() -> usize {
    ["PHALANX_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .filter_map(|v| v.parse().ok())
        .max()
        .unwrap_or(0)
}

impl Trainer {
    /// Check before training that checkpoints can be written (the
    /// directory exists or can be made, and takes a file).
    pub(super) fn preflight_checkpoints(&self) -> Result<()> {
        if self.cfg.checkpoint.interval == 0 || self.mesh.world().rank() != 0 {
            return Ok(());
        }
        let dir = Path::new(&self.cfg.checkpoint.dir);
        let fail = |e: std::io::Error| {
            Error::Io(format!(
                "checkpoint.dir {} is not writable: {e}",
                dir.display()
            ))
        };
        std::fs::create_dir_all(dir).map_err(fail)?;
        let probe = dir.join(format!(".probe-{}", std::process::id()));
        std::fs::write(&probe, b"").map_err(fail)?;
        std::fs::remove_file(&probe).map_err(fail)
    }

    /// The checkpoint `--resume` asks for (collective: rank 0 decides for
    /// `auto`, so every rank loads the same one), loaded. Returns whether a
    /// checkpoint was loaded.
    pub(super) fn resume(&mut self, resume: Option<&Resume>) -> Result<bool> {
        let auto = Resume::Auto;
        let resume = match resume {
            Some(r) => r,
            // A group restarted by the launcher continues where it stopped.
            None if restart_count() > 0 && self.cfg.checkpoint.interval > 0 => &auto,
            None => return Ok(false),
        };
        let dir = match resume {
            Resume::Path(p) => checkpoint::find(p).map_err(|e| match e {
                Error::Check(m) => Error::Check(format!("--resume {m}")),
                e => e,
            })?,
            Resume::Auto => {
                let root = PathBuf::from(&self.cfg.checkpoint.dir);
                let world = self.mesh.world();
                // Rank 0 verifies and picks; the others follow.
                let mut pick = [-1i64];
                if world.rank() == 0 {
                    if let Some((dir, r)) = checkpoint::find_latest(&root) {
                        let _ = dir;
                        pick[0] = r.meta.step as i64;
                    }
                }
                world.broadcast(&mut pick, 0)?;
                if pick[0] < 0 {
                    if world.rank() == 0 {
                        println!(
                            "--resume auto: no checkpoint under {}; starting fresh",
                            root.display()
                        );
                    }
                    return Ok(false);
                }
                root.join(checkpoint::step_dir_name(pick[0] as usize))
            }
        };
        self.load_checkpoint(&dir)?;
        Ok(true)
    }

    /// Load a checkpoint saved in any layout into this one: parameters and
    /// optimizer state of every range this rank owns, the loss scaler, and
    /// the step to continue from. Collective.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
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
        let mut fill = |range: std::ops::Range<usize>, kind: &str| {
            reader.fill(&layout, &*placement, range, kind)
        };
        self.strat.load_state(&mut self.engine, &mut fill, step)?;
        if reader.meta.precision == self.cfg.precision().to_string() {
            self.scaler = reader.meta.loss_scaler;
        }
        self.start_step = reader.meta.step;
        if self.mesh.world().rank() == 0 {
            println!(
                "resumed from {} (step {}, saved by {} on {} rank(s))",
                dir.display(),
                reader.meta.step,
                reader.meta.layout.strategy,
                reader.meta.layout.world
            );
        }
        Ok(())
    }

    /// Write a checkpoint of the state after `steps_done` steps (every rank
    /// calls this). With `checkpoint.async` the write runs in the background
    /// and this returns the previous save's directory, if one finished.
    pub fn save_checkpoint(&mut self, steps_done: usize) -> Result<Option<PathBuf>> {
        let mut ranges = self.strat.save_state(&self.engine)?;
        // Tensor parallel: what every tp rank holds whole is written by tp
        // rank 0 only.
        if self.mesh.tp_size > 1 && self.mesh.tp().rank() > 0 {
            ranges = ranges
                .iter()
                .flat_map(|r| r.without(&self.tp_replicated))
                .collect();
        }
        let snap = Snapshot::new(self.engine.layout(), &*self.placement, &ranges);
        let m = &self.mesh;
        let header = Header {
            step: steps_done,
            layout: SavedLayout {
                world: m.world().size(),
                dp: m.dp_size,
                pp: m.pp_size,
                tp: m.tp_size,
                zero_stage: self.cfg.sharding().map(|s| s.stage).unwrap_or(0),
                strategy: self.strat.name(),
            },
            precision: self.cfg.precision().to_string(),
            loss_scaler: self.scaler,
            global_batch: self.global_batch,
            config: self.cfg.to_toml(),
        };
        let root = PathBuf::from(&self.cfg.checkpoint.dir);
        let keep = self.cfg.checkpoint.keep;
        match &mut self.ckpt_async {
            Some(w) => w.submit(root, snap, header, keep),
            None => checkpoint::write::save(m.world(), &root, &snap, &header, keep).map(Some),
        }
    }

    /// Wait for a background checkpoint write, if one is in flight.
    pub fn wait_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        match &mut self.ckpt_async {
            Some(w) => w.wait(),
            None => Ok(None),
        }
    }

    /// Where this rank's parameters sit in the global tensors (tensor
    /// parallel models say; the default is whole tensors).
    pub fn set_placement(&mut self, p: std::sync::Arc<dyn checkpoint::Placement>) {
        self.placement = p;
    }

    /// The step the next `run` starts at (after a resume).
    pub fn start_step(&self) -> usize {
        self.start_step
    }
}
