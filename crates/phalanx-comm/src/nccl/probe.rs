//! Finding and loading the NVIDIA libraries the NCCL backend needs, with an
//! error that names what is missing instead of a panic.
//!
//! Status: built and unit-tested on CPU only; not yet run on GPU hardware.
//!
//! - The driver (`libcuda.so.1`, `libcuda.so`) is called through
//!   `cudarc::driver::sys`, whose loader panics when it finds no library; so
//!   [`driver`] first opens it by the same names itself (cudarc's candidate
//!   list includes both) and refuses with a [`CommError`] when it cannot,
//!   then checks `cuInit` and the device count.
//! - NCCL is loaded here, not through `cudarc::nccl::sys`: cudarc looks for
//!   `libnccl.so`, `libnccl.so.<CUDA major>`, `.1`, `.9`..`.12` but never
//!   `libnccl.so.2`, the only name the PyPI wheel (`nvidia-nccl-cu12`) and
//!   Debian's runtime package (`libnccl2`) install. [`nccl`] tries
//!   `libnccl.so.2` then `libnccl.so`, in `PHALANX_NCCL_LIBRARY` (a file or
//!   a directory), the directories of `LD_LIBRARY_PATH`, then the dynamic
//!   loader's own search, and resolves the few functions the backend calls
//!   ([`NcclApi`]). cudarc gives the types (`ncclUniqueId`, the enums).

use crate::error::{CommError, Result};
use cudarc::driver::sys as cu;
use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// NCCL's library names, preferred first (the runtime name, then the
/// development symlink).
pub const NCCL_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
/// The CUDA driver's names (both are in cudarc's own candidate list).
pub const DRIVER_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Directories to look in for NCCL, in order: `PHALANX_NCCL_LIBRARY` (when
/// it names a directory, or the directory of the file it names), then
/// those of `LD_LIBRARY_PATH`.
pub fn search_dirs(
    phalanx_nccl_library: Option<&str>,
    ld_library_path: Option<&str>,
) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for spec in [phalanx_nccl_library, ld_library_path]
        .into_iter()
        .flatten()
    {
        for part in spec.split(':').filter(|p| !p.is_empty()) {
            let p = PathBuf::from(part);
            let d = if p.is_file() {
                p.parent().map(Path::to_path_buf)
            } else {
                Some(p)
            };
            if let Some(d) = d.filter(|d| !dirs.contains(d)) {
                dirs.push(d);
            }
        }
    }
    dirs
}

/// The files to try, best first: an explicit file in `PHALANX_NCCL_LIBRARY`,
/// then each of `names` in each of `dirs` where such a file exists (a
/// directory with only `libnccl.so.2`, the wheel's layout, yields that).
pub fn candidates(explicit: Option<&str>, dirs: &[PathBuf], names: &[&str]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = explicit
        .into_iter()
        .flat_map(|s| s.split(':'))
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect();
    for d in dirs {
        for n in names {
            let p = d.join(n);
            if p.exists() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// The NCCL functions the backend calls (their C signatures; enums as
/// `c_int`, streams as `void*`).
#[allow(non_snake_case)]
pub struct NcclApi {
    _lib: libloading::Library,
    /// Where it was loaded from, for messages.
    pub path: String,
    pub ncclGetVersion: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub ncclGetErrorString: unsafe extern "C" fn(c_int) -> *const c_char,
    pub ncclGetUniqueId: unsafe extern "C" fn(*mut super::layout::UniqueId) -> c_int,
    pub ncclCommInitRank:
        unsafe extern "C" fn(*mut Comm, c_int, super::layout::UniqueId, c_int) -> c_int,
    pub ncclCommSplit: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> c_int,
    pub ncclCommDestroy: unsafe extern "C" fn(Comm) -> c_int,
    pub ncclCommAbort: unsafe extern "C" fn(Comm) -> c_int,
    pub ncclCommGetAsyncError: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub ncclAllReduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> c_int,
    pub ncclReduceScatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> c_int,
    pub ncclAllGather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
    pub ncclBroadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> c_int,
    pub ncclReduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> c_int,
    pub ncclSend: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub ncclRecv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub ncclGroupStart: unsafe extern "C" fn() -> c_int,
    pub ncclGroupEnd: unsafe extern "C" fn() -> c_int,
}

/// An NCCL communicator handle (`ncclComm_t`).
pub type Comm = *mut c_void;
/// A CUDA stream handle as NCCL takes it (`cudaStream_t`).
pub type Stream = *mut c_void;

// SAFETY: the table holds plain function pointers and the library that
// keeps them valid; NCCL's entry points may be called from any thread.
unsafe impl Send for NcclApi {}
unsafe impl Sync for NcclApi {}

impl NcclApi {
    fn load(path: &Path) -> std::result::Result<NcclApi, String> {
        // SAFETY: loading NCCL runs its initialisers, which have no
        // preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        Self::resolve(lib, path.display().to_string())
    }

    fn resolve(lib: libloading::Library, path: String) -> std::result::Result<NcclApi, String> {
        macro_rules! sym {
            ($name:ident) => {{
                // SAFETY: the field's type is the C signature of the symbol
                // of the same name (NCCL's nccl.h).
                let s = unsafe { lib.get(concat!(stringify!($name), "\0").as_bytes()) }.map_err(
                    |e| {
                        format!(
                            "{path} has no {}: {e} (Phalanx needs NCCL 2.18 or later, \
                             for ncclCommSplit)",
                            stringify!($name)
                        )
                    },
                )?;
                *s
            }};
        }
        Ok(NcclApi {
            ncclGetVersion: sym!(ncclGetVersion),
            ncclGetErrorString: sym!(ncclGetErrorString),
            ncclGetUniqueId: sym!(ncclGetUniqueId),
            ncclCommInitRank: sym!(ncclCommInitRank),
            ncclCommSplit: sym!(ncclCommSplit),
            ncclCommDestroy: sym!(ncclCommDestroy),
            ncclCommAbort: sym!(ncclCommAbort),
            ncclCommGetAsyncError: sym!(ncclCommGetAsyncError),
            ncclAllReduce: sym!(ncclAllReduce),
            ncclReduceScatter: sym!(ncclReduceScatter),
            ncclAllGather: sym!(ncclAllGather),
            ncclBroadcast: sym!(ncclBroadcast),
            ncclReduce: sym!(ncclReduce),
            ncclSend: sym!(ncclSend),
            ncclRecv: sym!(ncclRecv),
            ncclGroupStart: sym!(ncclGroupStart),
            ncclGroupEnd: sym!(ncclGroupEnd),
            path,
            _lib: lib,
        })
    }

    /// NCCL's version as `major.minor.patch`.
    pub fn version(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: an out-parameter.
        unsafe { (self.ncclGetVersion)(&mut v) };
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }

    /// `rc` as an error naming `what`, or Ok for ncclSuccess.
    pub fn check(&self, rc: c_int, what: &dyn Fn() -> String) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let msg = unsafe { std::ffi::CStr::from_ptr((self.ncclGetErrorString)(rc)) };
        Err(CommError::Io(format!(
            "{}: NCCL error {rc} ({})",
            what(),
            msg.to_string_lossy()
        )))
    }
}

/// The loaded NCCL library (loaded once per process).
pub fn nccl() -> Result<&'static NcclApi> {
    static API: OnceLock<std::result::Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(|| {
        let explicit = std::env::var("PHALANX_NCCL_LIBRARY").ok();
        let ld = std::env::var("LD_LIBRARY_PATH").ok();
        let dirs = search_dirs(explicit.as_deref(), ld.as_deref());
        let mut tried = Vec::new();
        for p in candidates(explicit.as_deref(), &dirs, &NCCL_NAMES) {
            match NcclApi::load(&p) {
                Ok(api) => return Ok(api),
                Err(e) => tried.push(format!("{}: {e}", p.display())),
            }
        }
        // The dynamic loader's own search (ld.so.cache, RUNPATH).
        for n in NCCL_NAMES {
            // SAFETY: as in `NcclApi::load`.
            match unsafe { libloading::Library::new(n) } {
                Ok(lib) => return NcclApi::resolve(lib, n.to_string()),
                Err(e) => tried.push(format!("{n}: {e}")),
            }
        }
        Err(format!(
            "libnccl was not found (looked for {} in PHALANX_NCCL_LIBRARY, LD_LIBRARY_PATH and \
             the system's library path: {}). Install NCCL (e.g. `pip install nvidia-nccl-cu12` \
             and set PHALANX_NCCL_LIBRARY to its nvidia/nccl/lib directory, or Debian's libnccl2)",
            NCCL_NAMES.join(" or "),
            tried.join("; ")
        ))
    })
    .as_ref()
    .map_err(|e| CommError::Io(e.clone()))
}

/// A CUDA driver error as a message naming `what`.
pub fn cu_error(rc: cu::CUresult, what: &str) -> CommError {
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: an out-parameter; the driver returns a static string or null.
    unsafe { cu::cuGetErrorString(rc, &mut s) };
    let msg = if s.is_null() {
        format!("{rc:?}")
    } else {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    };
    CommError::Io(format!("{what}: CUDA error {} ({msg})", rc as u32))
}

/// `rc` as a result naming `what`.
pub fn cu_check(rc: cu::CUresult, what: &str) -> Result<()> {
    if rc == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cu_error(rc, what))
    }
}

/// Check the driver: its library, `cuInit`, and at least one device.
/// Returns the number of devices.
pub fn driver() -> Result<usize> {
    static DRIVER: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: opening the driver library runs no code with
            // preconditions; the handle only proves it can be loaded (cudarc
            // opens it again, by the same names, and keeps it).
            let found = DRIVER_NAMES
                .iter()
                .any(|n| unsafe { libloading::Library::new(n) }.is_ok());
            if !found {
                return Err(format!(
                    "the CUDA driver library ({}) is not on this machine: no NVIDIA driver is \
                     installed, so the NCCL backend cannot run here (use PHALANX_BACKEND=native)",
                    DRIVER_NAMES.join(" or ")
                ));
            }
            // SAFETY: the library is present, so cudarc's loader succeeds.
            let rc = unsafe { cu::cuInit(0) };
            if rc == cu::CUresult::CUDA_ERROR_NO_DEVICE {
                return Err("the CUDA driver found no device (0 CUDA devices)".into());
            }
            if rc != cu::CUresult::CUDA_SUCCESS {
                return Err(format!(
                    "the CUDA driver failed to start ({}); is the NVIDIA driver loaded and \
                     libcuda.so.1 the real driver, not the toolkit's stub?",
                    cu_error(rc, "cuInit")
                ));
            }
            let mut n: c_int = 0;
            // SAFETY: an out-parameter, after cuInit.
            let rc = unsafe { cu::cuDeviceGetCount(&mut n) };
            if rc != cu::CUresult::CUDA_SUCCESS {
                return Err(cu_error(rc, "cuDeviceGetCount").to_string());
            }
            if n <= 0 {
                return Err("the CUDA driver found no device (0 CUDA devices)".into());
            }
            Ok(n as usize)
        })
        .clone()
        .map_err(CommError::Io)
}

/// Everything the backend needs, checked in the order a user fixes it:
/// driver, devices, then NCCL. Fails within the time of a few `dlopen`s.
pub fn require() -> Result<(usize, &'static NcclApi)> {
    let what = |e: CommError| match e {
        CommError::Io(m) => CommError::Io(format!("PHALANX_BACKEND=nccl: {m}")),
        e => e,
    };
    let devices = driver().map_err(what)?;
    let api = nccl().map_err(what)?;
    Ok((devices, api))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("phalanx-nccl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn finds_the_wheels_libnccl_so_2_without_libnccl_so() {
        let d = tmpdir("wheel");
        std::fs::write(d.join("libnccl.so.2"), b"not really a library").unwrap();
        let ld = format!("/nonexistent/lib:{}", d.display());
        let dirs = search_dirs(None, Some(&ld));
        assert_eq!(dirs, vec![PathBuf::from("/nonexistent/lib"), d.clone()]);
        let c = candidates(None, &dirs, &NCCL_NAMES);
        assert_eq!(c, vec![d.join("libnccl.so.2")]);
        // Both names present: the runtime name first.
        std::fs::write(d.join("libnccl.so"), b"").unwrap();
        let c = candidates(None, &dirs, &NCCL_NAMES);
        assert_eq!(c, vec![d.join("libnccl.so.2"), d.join("libnccl.so")]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn phalanx_nccl_library_may_name_a_file_or_a_directory() {
        let d = tmpdir("explicit");
        let f = d.join("libnccl.so.2.21.5");
        std::fs::write(&f, b"").unwrap();
        std::fs::write(d.join("libnccl.so.2"), b"").unwrap();
        let spec = f.display().to_string();
        let dirs = search_dirs(Some(&spec), None);
        assert_eq!(dirs, vec![d.clone()]);
        let c = candidates(Some(&spec), &dirs, &NCCL_NAMES);
        assert_eq!(c, vec![f.clone(), d.join("libnccl.so.2")]);
        let dspec = d.display().to_string();
        let dirs = search_dirs(Some(&dspec), Some(&dspec));
        assert_eq!(dirs, vec![d.clone()], "a directory is searched once");
        assert_eq!(
            candidates(Some(&dspec), &dirs, &NCCL_NAMES),
            vec![d.join("libnccl.so.2")]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_broken_libnccl_so_2_is_tried_by_that_name_and_refused_with_a_message() {
        // The only test here that loads: `nccl()` is once per process.
        let d = tmpdir("broken");
        std::fs::write(d.join("libnccl.so.2"), b"not an ELF file").unwrap();
        std::env::set_var("PHALANX_NCCL_LIBRARY", &d);
        match nccl() {
            // A machine with a real libnccl on the system's path.
            Ok(api) => assert!(!api.path.starts_with(&*d.to_string_lossy())),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("libnccl was not found"), "{e}");
                assert!(
                    e.contains(&*d.join("libnccl.so.2").to_string_lossy()),
                    "{e}"
                );
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_directory_without_nccl_yields_nothing() {
        let d = tmpdir("empty");
        std::fs::write(d.join("libcudart.so.12"), b"").unwrap();
        let dirs = search_dirs(None, Some(&d.display().to_string()));
        assert!(candidates(None, &dirs, &NCCL_NAMES).is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
