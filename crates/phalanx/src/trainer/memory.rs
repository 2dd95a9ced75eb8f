//! Each rank's memory: the ledger's parameters, gradients, optimizer state,
//! activation and working peaks, and the process's peak RSS, gathered on
//! every rank after the first step and printed as one table.

use super::Trainer;
use crate::error::Result;
use crate::ledger::Mem;

/// One rank's memory at the end of the first step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryReport {
    pub rank: usize,
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
    pub activations_peak: usize,
    pub working_peak: usize,
    /// Peak resident set of the process (VmHWM), 0 where unknown.
    pub peak_rss: usize,
}

impl MemoryReport {
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

fn peak_rss() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

impl Trainer {
    /// This rank's params, grads, optimizer state, activation and working
    /// peaks (the ledger) and peak RSS, in bytes (`monitor::MEMORY_KINDS`).
    pub(super) fn memory_now(&self) -> [usize; 6] {
        let l = self.engine.ledger();
        [
            l.current(Mem::Params),
            l.current(Mem::Grads),
            l.current(Mem::OptState),
            l.peak(Mem::Activations),
            l.peak(Mem::Working),
            peak_rss(),
        ]
    }

    /// Every rank's ledger and peak RSS, gathered on every rank.
    pub(super) fn gather_memory(&self) -> Result<Vec<MemoryReport>> {
        let mut mine = vec![self.pg.global_rank() as i64];
        mine.extend(self.memory_now().map(|b| b as i64));
        let world = self.mesh.world();
        let mut all = vec![0i64; 7 * world.size()];
        world.all_gather(&mine, &mut all)?;
        Ok(all
            .chunks(7)
            .map(|c| MemoryReport {
                rank: c[0] as usize,
                params: c[1] as usize,
                grads: c[2] as usize,
                optimizer: c[3] as usize,
                activations_peak: c[4] as usize,
                working_peak: c[5] as usize,
                peak_rss: c[6] as usize,
            })
            .collect())
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The per-rank memory table printed after the first step.
pub fn print_memory(m: &[MemoryReport]) {
    println!("memory after a step (MiB)   params     grads optimizer  model states  activations(peak)  unsharded(peak)  peak RSS");
    for r in m {
        println!(
            "  rank {:<20} {:>9.2} {:>9.2} {:>9.2} {:>13.2} {:>18.2} {:>16.2} {:>9.1}",
            r.rank,
            mib(r.params),
            mib(r.grads),
            mib(r.optimizer),
            mib(r.model_states()),
            mib(r.activations_peak),
            mib(r.working_peak),
            mib(r.peak_rss)
        );
    }
}
