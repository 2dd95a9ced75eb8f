//! The trainer's checkpoints: save every `checkpoint.interval` steps and at
//! the end (synchronously, or in the background with `checkpoint.async`);
//! resuming from them is `super::resume`.

use super::Trainer;
use crate::checkpoint::{self, write::Header, SavedLayout, Snapshot};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

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
        // One run at a time writes (and rotates) a checkpoint directory.
        checkpoint::lock::lock(dir, "checkpoint.dir")?;
        let probe = dir.join(format!(".probe-{}", std::process::id()));
        std::fs::write(&probe, b"").map_err(fail)?;
        std::fs::remove_file(&probe).map_err(fail)
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
        // The hook's residuals and counters are this rank's own.
        let snap = Snapshot::new(self.engine.layout(), &*self.placement, &ranges)
            .with_rank_state(self.strat.hook_state());
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
            samples_consumed: self.loader.position(steps_done as u64, self.data_batch()),
            // Only rank 0's is written. Working it out means reading the
            // text stream up to the step's position, which ranks that read
            // no data (a pipeline's middle stages) would do from scratch
            // while the others wait in the save.
            data: if m.world().rank() == 0 {
                Some(self.loader.state_at(steps_done as u64, self.data_batch())?)
            } else {
                None
            },
            config: self.cfg.to_toml(),
            job: crate::fault::job_id(),
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
