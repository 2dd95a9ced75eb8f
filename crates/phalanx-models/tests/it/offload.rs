//! ZeRO-3 parameter offload (`zero_optimization.offload_param`): the shard
//! in a file reproduces in-memory ZeRO-3 bit for bit with less memory held,
//! leaves no file behind, and an unusable directory is a clear error; the
//! chunked optimizer step it relies on equals the whole-range step bitwise.

use crate::common;
use common::*;
use phalanx::engine::{Layout, ParamDecl};
use phalanx::ledger::Ledger;
use phalanx::optim::{AdamW, AdamWConfig, DiskAdamW, Optimizer, Sgd, SgdConfig};
use phalanx_models::gpt2::train::{self, GptRun};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("phalanx-{name}-{}", std::process::id()))
}

fn zero3(prefetch: usize) -> Vec<String> {
    vec![
        "zero_optimization.stage=3".into(),
        format!("parallel.forward_prefetch={prefetch}"),
        format!("parallel.backward_prefetch={prefetch}"),
    ]
}

fn offload(dir: &Path, chunk: usize) -> Vec<String> {
    vec![
        "zero_optimization.offload_param.device=nvme".into(),
        format!(
            "zero_optimization.offload_param.nvme_path=\"{}\"",
            dir.display()
        ),
        format!("zero_optimization.offload_param.buffer_size={chunk}"),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bitwise(what: &str, a: &[RankResult], b: &[RankResult]) {
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(bits(&x.losses), bits(&y.losses), "{what}: rank {r} losses");
        assert!(
            bits(&x.params) == bits(&y.params),
            "{what}: rank {r} parameters differ"
        );
    }
}

#[test]
fn nvme_param_offload_reproduces_zero3_bitwise_with_less_memory() {
    let base = run(1, config(1, 1, &[])).remove(0);
    let dir = temp("param-offload");
    // (world, accum, prefetch, chunk elements, optimizer state offloaded too)
    for (w, accum, prefetch, chunk, opt_off) in [(2, 1, 1, 1 << 20, false), (3, 2, 2, 1000, true)] {
        let what = format!("ZeRO-3 nvme param offload, world {w} chunk {chunk}");
        let plain = run(w, config(w, accum, &zero3(prefetch)));
        let mut e = zero3(prefetch);
        e.extend(offload(&dir, chunk));
        if opt_off {
            e.push("zero_optimization.offload_optimizer.device=nvme".into());
            e.push(format!(
                "zero_optimization.offload_optimizer.nvme_path=\"{}\"",
                dir.display()
            ));
        }
        let out = run(w, config(w, accum, &e));
        assert_matches(&what, &out, &base);
        assert_bitwise(&what, &out, &plain);
        for (a, b) in out[0].memory.iter().zip(&plain[0].memory) {
            // The plain run holds its shard; the offloaded one only what is
            // in flight (nothing between steps).
            let shard = b.params;
            assert!(shard > 0 && a.params < shard, "{what}: {a:?} vs {b:?}");
            assert!(a.model_states() < b.model_states(), "{what}");
        }
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert!(left.is_empty(), "{what}: files left behind: {left:?}");
    }
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn cpu_param_offload_runs_as_in_memory_zero3() {
    let plain = run(2, config(2, 1, &zero3(1)));
    let mut e = zero3(1);
    e.push("zero_optimization.offload_param.device=cpu".into());
    let out = run(2, config(2, 1, &e));
    assert_bitwise("offload_param.device=cpu", &out, &plain);
    assert_eq!(out[0].memory[0].params, plain[0].memory[0].params);
}

#[test]
fn an_unwritable_nvme_path_is_an_error_naming_it() {
    // A directory cannot be created under a regular file (whoever we run as).
    let file = temp("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("offload");
    let mut e = zero3(1);
    e.extend(offload(&bad, 1 << 20));
    let cfg = config(2, 1, &e);
    let errs = phalanx_comm::threads::run(2, move |pg| {
        match train::train(&cfg, pg, loader(cfg.seq_len().unwrap()), &GptRun::default()) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    });
    for msg in errs {
        assert!(msg.contains(&bad.display().to_string()), "{msg:?}");
    }
    // The optimizer's state offloaded to NVMe: the same (its errors named
    // no path).
    let mut e = zero3(1);
    e.extend([
        "zero_optimization.offload_optimizer.device=nvme".to_string(),
        format!(
            "zero_optimization.offload_optimizer.nvme_path=\"{}\"",
            bad.display()
        ),
    ]);
    let cfg = config(2, 1, &e);
    let errs = phalanx_comm::threads::run(2, move |pg| {
        match train::train(&cfg, pg, loader(cfg.seq_len().unwrap()), &GptRun::default()) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    });
    std::fs::remove_file(&file).unwrap();
    for msg in errs {
        assert!(
            msg.contains(&bad.display().to_string()) && msg.contains("offload_optimizer"),
            "{msg:?}"
        );
    }
}

fn layout() -> Layout {
    Layout::new(vec![
        vec![ParamDecl::new("w", &[37, 11]), ParamDecl::new("b", &[11])],
        vec![ParamDecl::new("w2", &[11, 19]), ParamDecl::new("ln", &[19])],
    ])
    .unwrap()
}

fn data(n: usize, seed: u32, step: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32 ^ seed)
                .wrapping_mul(2654435761)
                .wrapping_add(step as u32 * 97);
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Three steps whole vs. in uneven pieces (crossing the weight-decay
/// segments): identical bits. `a` and `b` own the same range.
fn chunked_equals_whole(a: &mut dyn Optimizer, b: &mut dyn Optimizer) {
    let r = a.range();
    let (mut pa, mut pb) = (data(r.len(), 1, 0), data(r.len(), 1, 0));
    for step in 0..3 {
        let g = data(r.len(), 2, step);
        a.step(&mut pa, &g, 1e-2, 0.7);
        b.begin_step();
        let cuts = [0, 7, 20, 400, 411, 620, r.len()];
        for c in cuts.windows(2) {
            let s = c[0].min(r.len())..c[1].min(r.len());
            b.step_range(s.clone(), &mut pb[s.clone()], &g[s], 1e-2, 0.7);
        }
        assert_eq!(bits(&pa), bits(&pb), "step {step}");
    }
}

#[test]
fn chunked_optimizer_steps_equal_whole_steps_bitwise() {
    let l = layout();
    let n = l.num_params();
    let ledger = Ledger::new();
    // AdamW over the whole buffer and over an inner range.
    for range in [0..n, 5..n - 3] {
        let cfg = AdamWConfig::default();
        let mut a = AdamW::new(cfg, &l, range.clone(), &ledger);
        let mut b = AdamW::new(cfg, &l, range.clone(), &ledger);
        chunked_equals_whole(&mut a, &mut b);
        assert_eq!(a.state(), b.state());
        assert_eq!(a.step_count(), 3);
        assert_eq!(b.step_count(), 3);
        // The disk-offloaded AdamW, stepped in pieces, against the whole in-memory one.
        let dir = temp("chunked-adamw");
        let mut a = AdamW::new(cfg, &l, range.clone(), &ledger);
        let mut d = DiskAdamW::new(cfg, &l, range.clone(), &ledger, &dir, "t", 64).unwrap();
        chunked_equals_whole(&mut a, &mut d);
        assert_eq!(d.step_count(), 3);
        drop(d);
        std::fs::remove_dir(&dir).unwrap();
    }
    for nesterov in [false, true] {
        let cfg = SgdConfig {
            momentum: 0.9,
            nesterov,
            weight_decay: 0.1,
        };
        let mut a = Sgd::new(cfg, &l, 3..n, &ledger);
        let mut b = Sgd::new(cfg, &l, 3..n, &ledger);
        chunked_equals_whole(&mut a, &mut b);
        assert_eq!(a.state(), b.state());
    }
}
