//! ZeRO-3 without recomputation (issue 29, item 2): the fused GPT-2
//! layers keep their activations, let go of their gathered parameters after
//! the forward and are served them gathered again for the backward, so no
//! layer's forward runs twice (only the embedding and the head, which have
//! no direct backward, are recomputed); the run equals DDP's, and holds
//! less than DDP; `train.activation_checkpointing = full` still recomputes
//! every block.

use crate::common;
use common::*;
use phalanx_models::gpt2::train::{self, GptRun};

/// Three layers: blocks = embedding, 3 layers, head.
fn shape(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "model.n_head=4".into(),
        "model.n_embd=32".into(),
        "model.n_layer=3".into(),
        "train.steps=3".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// (losses, parameters, blocks recomputed, model states + activation peak,
/// bytes sent in the last step) of rank 0.
fn zero3(world: usize, extra: &[&str]) -> (Vec<f32>, Vec<f32>, u64, usize, u64) {
    let cfg = config(world, 1, &shape(extra));
    let loader = loader(cfg.seq_len().unwrap());
    // Ring collectives: every gathered byte goes through the transport
    // and is counted (in-place shared-memory collectives are not).
    let ring = phalanx_comm::Config {
        algo: phalanx_comm::Algo::Ring,
        ..phalanx_comm::Config::from_env()
    };
    let deadline = phalanx_comm::threads::DEADLINE;
    phalanx_comm::threads::run_with(world, ring, deadline, move |pg| {
        let (report, trainer) = train::train(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        let recomputed = trainer.engine().stack().recomputed_blocks();
        let m = trainer.memory_report().unwrap()[0];
        let params = trainer.full_params().unwrap();
        Ok((
            report.losses,
            params,
            recomputed,
            m.model_states() + m.activations_peak,
            *report.comm_bytes.last().unwrap(),
        ))
    })
    .remove(0)
    .expect("rank failed")
}

#[test]
fn zero3_keeps_the_layers_activations_and_equals_ddp() {
    let ddp = zero3(2, &[]);
    let keep = zero3(2, &["zero_optimization.stage=3"]);
    let full = zero3(
        2,
        &[
            "zero_optimization.stage=3",
            "train.activation_checkpointing=\"full\"",
        ],
    );
    // 3 steps: the embedding and the head each step; every block with full.
    assert_eq!(ddp.2, 0, "DDP recomputes nothing");
    assert_eq!(keep.2, 3 * 2, "ZeRO-3 recomputed {} blocks", keep.2);
    assert_eq!(
        full.2,
        3 * 5,
        "full checkpointing recomputed {} blocks",
        full.2
    );
    for (what, o) in [("ZeRO-3", &keep), ("ZeRO-3, full", &full)] {
        for (k, (a, b)) in o.0.iter().zip(&ddp.0).enumerate() {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{what}: step {k}: loss {a} vs {b}"
            );
        }
        assert!(
            rel(&o.1, &ddp.1) < 1e-5,
            "{what}: parameters {}",
            rel(&o.1, &ddp.1)
        );
    }
    assert!(
        keep.3 < ddp.3,
        "ZeRO-3 holds {} B of model states and activations, DDP {} B",
        keep.3,
        ddp.3
    );
}

/// `zero_optimization.stage3_max_reuse_distance` (DeepSpeed's knob): the
/// blocks used again within that many parameters keep what the forward
/// gathered, so the backward gathers only the others: fewer bytes, the
/// same run.
#[test]
fn a_reuse_distance_skips_the_backward_gathers_of_the_last_blocks() {
    let z3 = |d: &str| {
        zero3(
            2,
            &[
                "zero_optimization.stage=3",
                &format!("zero_optimization.stage3_max_reuse_distance={d}"),
            ],
        )
    };
    let (base, some, all) = (z3("0"), z3("30000"), z3("1e9"));
    for (what, o) in [("some blocks kept", &some), ("every block kept", &all)] {
        assert_eq!(o.0, base.0, "{what}: losses");
        assert!(o.1 == base.1, "{what}: parameters");
    }
    assert!(
        base.4 > some.4 && some.4 > all.4,
        "bytes sent per step: {} (none kept) > {} (some) > {} (all)",
        base.4,
        some.4,
        all.4
    );
}
