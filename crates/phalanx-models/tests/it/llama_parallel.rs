//! Llama through the generic strategies: DDP, ZeRO-1/2/3 and pipeline
//! parallel (alone and with dp) reproduce 1-rank training (losses, and the
//! whole model gathered by name), with no Llama-specific strategy code;
//! `--save-final` under ZeRO-3 and pipeline writes the same model. Tensor
//! parallel (kv heads split, and replicated when n_kv_head < tp; sequence
//! parallel; tp x dp with ZeRO; tied head) reproduces it too.

use crate::common;
use common::llama::{base, config, run, STEPS};
use common::{assert_named_match, loader};
use phalanx_models::llama::train::{self, LlamaRun};

#[test]
fn ddp_and_zero_1_2_3_reproduce_one_rank() {
    let base = base();
    assert!(base.losses[STEPS - 1] < base.losses[0], "{:?}", base.losses);
    for (what, world, accum, extra) in [
        ("DDP 2 ranks", 2, 1, vec![]),
        (
            "ZeRO-1 2 ranks accum 2",
            2,
            2,
            vec!["zero_optimization.stage=1"],
        ),
        (
            "ZeRO-2 3 ranks",
            3,
            1,
            vec!["zero_optimization.stage=2", "parallel.bucket_mb=0.01"],
        ),
        ("ZeRO-3 2 ranks", 2, 1, vec!["zero_optimization.stage=3"]),
    ] {
        let out = run(world, config(world, accum, &extra), LlamaRun::default());
        assert_named_match(what, &out, &base, 1e-5);
    }
}

#[test]
fn pipeline_reproduces_one_rank_and_saves_the_whole_model() {
    let base = base();
    let dir = std::env::temp_dir().join(format!("phalanx-llama-pp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (what, world, dp, extra) in [
        ("pp 2 (1f1b)", 2, 1, vec!["parallel.pp=2"]),
        (
            "pp 2 x dp 2 (gpipe)",
            4,
            2,
            vec!["parallel.pp=2", "parallel.pp_schedule=gpipe"],
        ),
    ] {
        let cfg = config(dp, 4, &extra);
        let save = dir.join(what.replace(' ', "_"));
        let r = LlamaRun {
            save_final: Some(save.clone()),
            ..Default::default()
        };
        let out = run(world, cfg, r);
        assert_named_match(what, &out, &base, 1e-5);
        // The saved directory holds every stage's tensors.
        let saved = candle_core::safetensors::load(
            save.join("model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        assert_eq!(saved.len(), base.named.len(), "{what}");
        for (name, want) in &base.named {
            let got: Vec<f32> = saved[name].flatten_all().unwrap().to_vec1().unwrap();
            let e = common::rel(&got, want);
            assert!(e < 1e-4, "{what}: saved `{name}` differs by {e:e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensor_parallel_reproduces_one_rank() {
    let base = base();
    for (what, world, dp, extra) in [
        ("tp 2 (kv heads split)", 2, 1, vec!["parallel.tp=2"]),
        ("tp 4 (kv heads replicated)", 4, 1, vec!["parallel.tp=4"]),
        (
            "tp 2 + sequence parallel",
            2,
            1,
            vec![
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "model.block_size=16",
            ],
        ),
        (
            "tp 4 + sequence parallel (kv heads replicated)",
            4,
            1,
            vec![
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "model.block_size=16",
            ],
        ),
        (
            "tp 2 x dp 2 ZeRO-1",
            4,
            2,
            vec!["parallel.tp=2", "zero_optimization.stage=1"],
        ),
    ] {
        let mut cfg_base = None;
        if what.contains("sequence") {
            cfg_base = Some(
                run(
                    1,
                    config(1, 1, &["model.block_size=16"]),
                    LlamaRun::default(),
                )
                .remove(0),
            );
        }
        let out = run(world, config(dp, 1, &extra), LlamaRun::default());
        assert_named_match(what, &out, cfg_base.as_ref().unwrap_or(&base), 1e-5);
    }
}

#[test]
fn pipeline_x_tensor_parallel_reproduces_one_rank() {
    let base = base();
    // pp 2 x tp 2 (kv heads split), and pp 2 x tp 4 (kv heads replicated).
    for (world, tp) in [(4, 2), (8, 4)] {
        let tp_set = format!("parallel.tp={tp}");
        let cfg = config(1, 4, &["parallel.pp=2", &tp_set]);
        let out = run(world, cfg, LlamaRun::default());
        assert_named_match(&format!("pp 2 x tp {tp}"), &out, &base, 1e-5);
    }
}

#[test]
fn tensor_parallel_tied_head_and_init_from() {
    // Tied head under tp 2: the vocabulary-parallel embedding and head share
    // one shard; and --init-from a saved directory loads the slices.
    let tied = ["model.tie_word_embeddings=true"];
    let base = run(1, config(1, 1, &tied), LlamaRun::default()).remove(0);
    let out = run(
        2,
        config(1, 1, &["model.tie_word_embeddings=true", "parallel.tp=2"]),
        LlamaRun::default(),
    );
    assert_named_match("tp 2 tied", &out, &base, 1e-5);
    let dir = std::env::temp_dir().join(format!("phalanx-llama-tp-init-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = LlamaRun {
        save_final: Some(dir.clone()),
        ..Default::default()
    };
    let first = run(1, config(1, 1, &[]), save).remove(0);
    let from = LlamaRun {
        init_from: Some(dir.clone()),
        ..Default::default()
    };
    let a = run(1, config(1, 1, &[]), from.clone()).remove(0);
    let b = run(4, config(1, 1, &["parallel.tp=4"]), from);
    assert!(
        a.losses[0] < first.losses[0],
        "{:?} vs {:?}",
        a.losses,
        first.losses
    );
    assert_named_match("tp 4 from a saved model", &b, &a, 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensor_parallel_shapes_that_do_not_divide_are_refused() {
    let loader = loader(15);
    for (extra, world, want) in [
        (
            vec!["parallel.tp=3"],
            3,
            "model.n_head (4) is not divisible by the tensor-parallel size 3",
        ),
        (
            // 3 kv heads can be neither split over 4 ranks nor replicated.
            vec![
                "parallel.tp=4",
                "model.n_head=12",
                "model.n_kv_head=3",
                "model.n_embd=48",
                "model.intermediate_size=64",
            ],
            4,
            "the tensor-parallel size 4 is not a multiple of model.n_kv_head (3)",
        ),
    ] {
        let cfg = config(1, 1, &extra);
        let l = loader.clone();
        let errs = phalanx_comm::threads::run(world, move |pg| {
            train::trainer(&cfg, pg, l.clone(), &LlamaRun::default())
                .err()
                .map(|e| e.to_string())
        });
        for e in errs {
            let e = e.expect("must be refused");
            assert!(e.contains(want), "{e}");
        }
    }
}

#[test]
fn bf16_and_recompute_track_fp32() {
    // Mixed precision (bf16 compute over f32 masters) through the fused
    // RMSNorm / rotary / SwiGLU ops' half paths: the losses stay within 2%
    // of fp32's and fall; activation checkpointing changes nothing.
    let base = base();
    let bf16 = run(
        1,
        config(1, 1, &["train.precision=bf16"]),
        LlamaRun::default(),
    )
    .remove(0);
    for (k, (a, b)) in bf16.losses.iter().zip(&base.losses).enumerate() {
        assert!(((a - b) / b).abs() < 0.02, "step {k}: bf16 {a} vs fp32 {b}");
    }
    assert!(bf16.losses[STEPS - 1] < bf16.losses[0], "{:?}", bf16.losses);
    let recompute = run(
        2,
        config(
            2,
            1,
            &[
                "train.activation_checkpointing=full",
                "zero_optimization.stage=2",
            ],
        ),
        LlamaRun::default(),
    );
    assert_named_match("ZeRO-2 + full recompute", &recompute, &base, 1e-5);
}

#[test]
fn head_dim_apart_from_width_under_tensor_parallel() {
    // model.head_dim = 12 at 32 wide: q_proj (48, 32), o_proj (32, 48).
    let hd = ["model.head_dim=12"];
    let base = run(1, config(1, 1, &hd), LlamaRun::default()).remove(0);
    assert_eq!(
        base.named["model.layers.0.self_attn.q_proj.weight"].len(),
        48 * 32
    );
    for tp in [2, 4] {
        let tp_set = format!("parallel.tp={tp}");
        let out = run(
            tp,
            config(1, 1, &["model.head_dim=12", &tp_set]),
            LlamaRun::default(),
        );
        assert_named_match(&format!("tp {tp}, head_dim 12"), &out, &base, 1e-5);
    }
}
