//! Keeping freed memory in the process for the next step.
//!
//! Every training step allocates and frees the same activation and
//! gradient tensors. glibc's malloc serves large blocks with `mmap` and
//! gives them back on `free` (and trims the heap's free top), so each step
//! took fresh pages from the kernel: about 43,000 minor page faults per
//! step for gpt-10m (B 8, T 256), each one a kernel entry plus a zeroed
//! page. [`retain_freed_memory`] raises the mmap and trim thresholds so the
//! freed blocks stay in the heap and the next step reuses them: a steady
//! step then faults on (almost) no page. Values are not touched, so
//! results are bit for bit the same.
//!
//! It costs memory: blocks freed into the heap fragment it, and the
//! resident size stays at its peak. Measured on gpt-10m, 2 ranks, with a
//! 1 GiB mmap threshold: peak RSS 785 against about 650 MiB (DDP) and 357
//! against about 300 MiB (ZeRO-3), for about 1.1x the tokens/s (1.00-1.46x
//! over 16 pairs). With the 32 MiB threshold below, on llama-60m (2 ranks
//! x 1 thread, micro-batch 4; `perf stat -e page-faults,task-clock` of a
//! 9-step run minus a 3-step one): bf16 went from 9,000 minor faults per
//! rank per step (67,000 once DDP's bucket copies were pooled: glibc's
//! mmap threshold then never adapted upwards) to none, and from 5.5 to 4.4
//! CPU-seconds per step; peak RSS of a rank from 2.10 to 2.27 GB (bf16)
//! and from 2.19 to 2.11 GB (fp32). So the `phalanx` binary turns it on first
//! thing ([`retain_unless_refused`]; `PHALANX_RETAIN_FREED=0` keeps glibc's
//! defaults), and a library user asks with `PHALANX_RETAIN_FREED=1`
//! ([`retain_if_asked`], which the engine calls when it is built) or calls
//! [`retain_freed_memory`].
//!
//! ```
//! phalanx::engine::heap::retain_freed_memory();
//! let before = phalanx::engine::heap::minor_faults();
//! assert!(phalanx::engine::heap::minor_faults() >= before);
//! ```

use std::sync::OnceLock;

/// Blocks up to this size come from the heap (glibc's default is 128 KiB,
/// adapting up to 32 MiB as blocks are freed): covers gpt-50m's largest
/// activation (25 MiB) and a llama-60m layer's bf16 weights (14 MiB);
/// larger blocks are mapped and unmapped as before, so a rare huge buffer
/// does not stay in the heap.
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the heap's top kept rather than returned to the kernel.
const TRIM_THRESHOLD: i32 = i32::MAX;

/// Set glibc's thresholds once per process (later calls do nothing).
/// Returns whether both settings took (false off glibc).
pub fn retain_freed_memory() -> bool {
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(set_thresholds)
}

/// [`retain_freed_memory`] unless `PHALANX_RETAIN_FREED=0`: what the
/// `phalanx` binary calls first in `main`, before any thread allocates.
/// Returns whether freed memory is now retained.
pub fn retain_unless_refused() -> bool {
    std::env::var("PHALANX_RETAIN_FREED").as_deref() != Ok("0") && retain_freed_memory()
}

/// [`retain_freed_memory`] when `PHALANX_RETAIN_FREED=1`; the engine calls
/// this when it is built. Returns whether freed memory is now retained.
pub fn retain_if_asked() -> bool {
    std::env::var("PHALANX_RETAIN_FREED").as_deref() == Ok("1") && retain_freed_memory()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // SAFETY: mallopt only changes malloc's parameters (under its lock).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    let _ = (MMAP_THRESHOLD, TRIM_THRESHOLD);
    false
}

/// Minor page faults of this process so far (all threads), from
/// `getrusage`; 0 where unavailable.
pub fn minor_faults() -> u64 {
    #[cfg(unix)]
    {
        // SAFETY: getrusage writes into the struct we pass.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 {
            return ru.ru_minflt as u64;
        }
    }
    0
}
