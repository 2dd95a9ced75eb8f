//! Shared-memory segments exist only as mappings of the job's processes:
//! no descriptor stays open, nothing has a name, and a group's segments are
//! unmapped once it is gone. (Alone in its binary: other tests' groups in
//! the same process would show up in /proc/self/maps too.)

use phalanx_comm::{threads, Config, ReduceOp, TransportPref};
use std::time::{Duration, Instant};

/// Mappings of shared-memory rings and of all-reduce slots.
fn mapped_of(kind: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .matches(&format!("memfd:phalanx-shm-{kind}"))
        .count()
}

fn mapped() -> usize {
    mapped_of("ring") + mapped_of("slot")
}

fn open_memfds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy().contains("memfd:phalanx"))
                .unwrap_or(false)
        })
        .count()
}

#[test]
fn segments_live_exactly_as_long_as_the_group() {
    assert_eq!(mapped(), 0);
    let cfg = Config {
        transport: TransportPref::Shm,
        ..Config::default()
    };
    let out = threads::run_with(3, cfg, threads::DEADLINE, |pg| {
        let mut x = vec![1.0f32; 1 << 20];
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        assert!(x.iter().all(|v| *v == 3.0));
        // Every rank is set up; none has gone yet.
        let seen = (mapped_of("ring"), mapped_of("slot"), open_memfds());
        pg.barrier()?;
        Ok(seen)
    });
    for (r, o) in out.into_iter().enumerate() {
        // 3 ranks x 2 peers x (own ring + the peer's ring); 3 ranks x
        // every rank's slot; no descriptors.
        assert_eq!(o.unwrap(), (12, 9, 0), "rank {r}");
    }
    // Gone once the ranks are: reader threads let go within a sleep slice
    // (the 60 s bound is a hang guard; the check is that they go at all).
    let t0 = Instant::now();
    while mapped() > 0 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(mapped(), 0, "segments outlived the group");
}
