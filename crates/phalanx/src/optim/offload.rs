//! Optimizer state offloaded to disk (DeepSpeed's `offload_optimizer.device
//! = nvme`): AdamW's moments live in two files and the update streams
//! through them chunk by chunk, so the memory held for optimizer state is
//! one chunk, whatever the model size.
//!
//! Explicit positioned reads and writes are used rather than a memory map:
//! mapped pages stay resident (and count in RSS) until the kernel decides to
//! evict them, while a bounded buffer is bounded. The update itself is the
//! in-memory AdamW's, so the results are identical.
//!
//! ```
//! use phalanx::engine::{Layout, ParamDecl};
//! use phalanx::ledger::{Ledger, Mem};
//! use phalanx::optim::{AdamWConfig, DiskAdamW, Optimizer};
//! let layout = Layout::new(vec![vec![ParamDecl::new("w", &[100, 10])]]).unwrap();
//! let dir = std::env::temp_dir().join(format!("phalanx-doc-offload-{}", std::process::id()));
//! let ledger = Ledger::new();
//! let mut opt = DiskAdamW::new(AdamWConfig::default(), &layout, 0..1000, &ledger, &dir, "r0", 128).unwrap();
//! let (mut p, g) = (vec![1.0f32; 1000], vec![0.5f32; 1000]);
//! opt.step(&mut p, &g, 1e-2, 1.0);
//! assert!(p.iter().all(|&x| x < 1.0));
//! assert!(ledger.peak(Mem::OptState) <= 2 * 128 * 4); // one chunk of m and v
//! // A second optimizer of the same tag (a pipeline stage's second range)
//! // has files of its own; both are unlinked once open, so nothing is
//! // left in the directory on any exit.
//! let mut two = DiskAdamW::new(AdamWConfig::default(), &layout, 0..1000, &ledger, &dir, "r0", 128).unwrap();
//! let mut q = vec![1.0f32; 1000];
//! two.step(&mut q, &vec![-3.0f32; 1000], 1e-2, 1.0);
//! opt.step(&mut p, &g, 1e-2, 1.0);
//! // Two steps on its own moments, as in memory.
//! let mut mem = phalanx::optim::AdamW::new(AdamWConfig::default(), &layout, 0..1000, &ledger);
//! let mut r = vec![1.0f32; 1000];
//! mem.step(&mut r, &g, 1e-2, 1.0);
//! mem.step(&mut r, &g, 1e-2, 1.0);
//! assert_eq!(p, r);
//! assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
//! ```

use super::{AdamW, AdamWConfig, Optimizer};
use crate::engine::Layout;
use crate::ledger::Ledger;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub struct DiskAdamW {
    cfg: AdamWConfig,
    layout: Layout,
    range: Range<usize>,
    ledger: Ledger,
    m: File,
    v: File,
    /// Where the (unlinked) files were made, for errors.
    dir: std::path::PathBuf,
    chunk: usize,
    t: u64,
}

impl DiskAdamW {
    /// State for `range` in two files of `dir` (`{tag}.adam_m.*.bin` and
    /// `.adam_v.*`, unlinked once open), streamed `chunk` elements at a
    /// time.
    pub fn new(
        cfg: AdamWConfig,
        layout: &Layout,
        range: Range<usize>,
        ledger: &Ledger,
        dir: &Path,
        tag: &str,
        chunk: usize,
    ) -> std::io::Result<DiskAdamW> {
        // Errors name the path (`nvme_path` may be a file, unwritable, full).
        let at = |p: &Path, e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))
        };
        std::fs::create_dir_all(dir).map_err(|e| at(dir, e))?;
        let bytes = range.len() as u64 * 4;
        // A file of its own each (another optimizer of this rank, say a
        // pipeline stage's second range, or another job sharing the
        // directory, never opens it), unlinked as soon as it is open: the
        // handle is the only reference, so no exit path leaves it behind.
        let open = |name: &str| -> std::io::Result<File> {
            let p = dir.join(format!(
                "{tag}.{name}.{}-{}.bin",
                std::process::id(),
                crate::fsutil::random_hex()
            ));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&p)
                .map_err(|e| at(&p, e))?;
            std::fs::remove_file(&p).map_err(|e| at(&p, e))?;
            f.set_len(bytes).map_err(|e| at(&p, e))?; // zeros: the initial moments
            reserve(&f, bytes).map_err(|e| at(&p, e))?;
            Ok(f)
        };
        let m = open("adam_m")?;
        let v = open("adam_v")?;
        Ok(DiskAdamW {
            cfg,
            layout: layout.clone(),
            range,
            ledger: ledger.clone(),
            m,
            v,
            dir: dir.to_path_buf(),
            chunk: chunk.max(1),
            t: 0,
        })
    }

    pub fn step_count(&self) -> u64 {
        self.t
    }
}

/// The file's blocks, taken now: a sparse file would meet a full disk at
/// the first step's write, in the middle of a step (a panic there). A
/// file system without `fallocate` keeps the file sparse.
fn reserve(f: &File, bytes: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: a plain system call on a descriptor we own.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(()),
        Some(libc::ENOSPC) => Err(std::io::Error::new(
            e.kind(),
            format!("no space for {bytes} bytes of offloaded optimizer state ({e})"),
        )),
        _ => Err(e),
    }
}

// The step has no error path (`Optimizer::step_range`): a failed read or
// write ends the rank, naming the directory (a copy-on-write or
// compressing file system can still run out of space after `reserve`).
fn read(f: &File, dir: &Path, at: usize, out: &mut [f32]) {
    if let Err(e) = f.read_exact_at(bytemuck::cast_slice_mut(out), at as u64 * 4) {
        panic!("{}", io_failed(dir, "reading", e));
    }
}

fn write(f: &File, dir: &Path, at: usize, data: &[f32]) {
    if let Err(e) = f.write_all_at(bytemuck::cast_slice(data), at as u64 * 4) {
        panic!("{}", io_failed(dir, "writing", e));
    }
}

fn io_failed(dir: &Path, what: &str, e: std::io::Error) -> String {
    format!(
        "{what} offloaded optimizer state in {} (zero_optimization.offload_optimizer.nvme_path) \
         failed: {e}",
        dir.display()
    )
}

impl Optimizer for DiskAdamW {
    fn steps_in_ranges(&self) -> bool {
        true
    }

    fn begin_step(&mut self) {
        self.t += 1;
    }

    fn step_range(
        &mut self,
        sub: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
    ) {
        super::check_sub("DiskAdamW", &self.range, &sub, params.len(), grads.len());
        assert!(self.t > 0, "DiskAdamW: step_range before begin_step");
        let start = self.range.start;
        let mut m = vec![0f32; 0];
        let mut v = vec![0f32; 0];
        for lo in (sub.start..sub.end).step_by(self.chunk) {
            let hi = (lo + self.chunk).min(sub.end);
            m.resize(hi - lo, 0.0);
            v.resize(hi - lo, 0.0);
            read(&self.m, &self.dir, lo, &mut m);
            read(&self.v, &self.dir, lo, &mut v);
            // The in-memory AdamW on this chunk (its state charged while it
            // lives), at the step count `begin_step` set.
            let mut a = AdamW::new(self.cfg, &self.layout, start + lo..start + hi, &self.ledger);
            a.set_state(&m, &v, self.t - 1);
            let (p, g) = (
                lo - sub.start..hi - sub.start,
                lo - sub.start..hi - sub.start,
            );
            a.step(&mut params[p], &grads[g], lr, grad_scale);
            let (m2, v2) = a.state();
            write(&self.m, &self.dir, lo, m2);
            write(&self.v, &self.dir, lo, v2);
        }
    }

    fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    fn state_bytes(&self) -> usize {
        0
    }

    fn kind(&self) -> &'static str {
        "adamw"
    }

    /// Reads the offloaded moments into memory (a checkpoint's staging copy).
    fn state(&self) -> std::io::Result<super::OptimState> {
        let n = self.range.len();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        self.m.read_exact_at(bytemuck::cast_slice_mut(&mut m), 0)?;
        self.v.read_exact_at(bytemuck::cast_slice_mut(&mut v), 0)?;
        Ok((vec![("exp_avg", m), ("exp_avg_sq", v)], self.t))
    }

    fn state_names(&self) -> Vec<&'static str> {
        vec!["exp_avg", "exp_avg_sq"]
    }

    fn load_state(&mut self, name: &str, values: &[f32]) -> std::io::Result<()> {
        let f = match name {
            "exp_avg" => &self.m,
            "exp_avg_sq" => &self.v,
            _ => return Err(super::unknown_state("adamw", name)),
        };
        if values.len() != self.range.len() {
            return Err(std::io::Error::other(format!(
                "adamw state {name:?}: {} values for a range of {}",
                values.len(),
                self.range.len()
            )));
        }
        f.write_all_at(bytemuck::cast_slice(values), 0)
    }

    fn set_step_count(&mut self, t: u64) {
        self.t = t;
    }
}

/// The optimizer a training config asks for, over `range` of the flat buffer.
pub fn from_config(
    o: &crate::config::OptimConfig,
    layout: &Layout,
    range: Range<usize>,
    ledger: &Ledger,
    offload: Option<(&Path, &str)>,
) -> std::io::Result<Box<dyn Optimizer + Send>> {
    let adam = adamw_config(o);
    // "adam" is DeepSpeed's Adam with its default adam_w_mode = true: AdamW.
    Ok(match (o.name.is_adam(), offload) {
        (true, None) => Box::new(AdamW::new(adam, layout, range, ledger)),
        (true, Some((dir, tag))) => Box::new(DiskAdamW::new(
            adam,
            layout,
            range,
            ledger,
            dir,
            tag,
            1 << 20,
        )?),
        (_, Some(_)) => {
            return Err(std::io::Error::other(
                "optimizer offload is built for adamw (and adam) only",
            ));
        }
        _ => Box::new(super::Sgd::new(sgd_config(o), layout, range, ledger)),
    })
}

/// The optimizer `o` names with its state for `range` on `device` and its
/// step run there ([`super::DeviceOptimizer`]): what a rank computing off
/// the CPU kernels gets unless the optimizer is offloaded.
pub fn from_config_on(
    o: &crate::config::OptimConfig,
    layout: &Layout,
    range: Range<usize>,
    ledger: &Ledger,
    device: &candle_core::Device,
) -> std::io::Result<Box<dyn Optimizer + Send>> {
    if range.is_empty() {
        // An empty shard (more ranks than elements) has nothing to put on
        // the device; a device may also refuse an allocation of 0 bytes.
        return from_config(o, layout, range, ledger, None);
    }
    let opt = if o.name.is_adam() {
        super::DeviceOptimizer::adamw(adamw_config(o), layout, range, ledger, device)
    } else {
        super::DeviceOptimizer::sgd(sgd_config(o), layout, range, ledger, device)
    };
    Ok(Box::new(opt.map_err(|e| {
        std::io::Error::other(format!("optimizer state on {:?}: {e}", device.location()))
    })?))
}

fn adamw_config(o: &crate::config::OptimConfig) -> AdamWConfig {
    AdamWConfig {
        beta1: o.betas[0] as f32,
        beta2: o.betas[1] as f32,
        eps: o.eps as f32,
        weight_decay: o.weight_decay as f32,
    }
}

fn sgd_config(o: &crate::config::OptimConfig) -> super::SgdConfig {
    super::SgdConfig {
        momentum: o.momentum as f32,
        nesterov: false,
        weight_decay: o.weight_decay as f32,
    }
}
