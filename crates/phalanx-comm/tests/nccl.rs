//! `PHALANX_BACKEND=nccl` on a machine without a GPU: a prompt error that
//! names what is missing (with `--features nccl`: the driver, a device or
//! libnccl; without it: the cargo feature), never a panic or a hang.
//!
//! One test per binary touches the process's environment, so this file has
//! exactly one test in each build.

use std::time::{Duration, Instant};

fn init_with_nccl() -> (String, Duration) {
    for k in ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"] {
        std::env::remove_var(k);
    }
    std::env::set_var("PHALANX_BACKEND", "nccl");
    std::env::set_var("PHALANX_TIMEOUT", "5");
    let t = Instant::now();
    let r = std::panic::catch_unwind(phalanx_comm::init_process_group);
    let took = t.elapsed();
    let e = match r {
        Err(_) => panic!("PHALANX_BACKEND=nccl panicked instead of returning an error"),
        Ok(Ok(pg)) => {
            // A machine with a GPU and NCCL: nothing to refuse.
            assert_eq!(pg.backend_name(), "nccl");
            return (String::new(), took);
        }
        Ok(Err(e)) => e.to_string(),
    };
    (e, took)
}

#[cfg(not(feature = "nccl"))]
#[test]
fn without_the_feature_the_error_names_it() {
    let (e, took) = init_with_nccl();
    assert!(
        e.contains("--features nccl") && e.contains("feature `nccl`"),
        "{e}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[cfg(feature = "nccl")]
#[test]
fn without_a_gpu_the_error_names_what_is_missing() {
    let (e, took) = init_with_nccl();
    if e.is_empty() {
        eprintln!("this machine has a GPU and NCCL: nothing to refuse");
        return;
    }
    assert!(
        e.contains("CUDA driver library")
            || e.contains("0 CUDA devices")
            || e.contains("libnccl was not found"),
        "{e}"
    );
    assert!(e.contains("PHALANX_BACKEND=nccl"), "{e}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    eprintln!("refused in {took:?}: {e}");
}
