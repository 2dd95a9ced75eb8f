//! Tensor parallel equivalence: GPT-2 split over tp = 2, 3, 4 ranks (and
//! composed with data parallelism) reproduces 1-rank training, in losses,
//! gradients and parameters.

use crate::common;
use common::*;

/// A TP-friendly shape: 6 heads (divisible by 2 and 3), 4 heads for tp 4.
fn shape(heads: usize) -> Vec<String> {
    vec![
        format!("model.n_head={heads}"),
        format!("model.n_embd={}", heads * 6),
    ]
}

fn with(mut a: Vec<String>, b: &[&str]) -> Vec<String> {
    a.extend(b.iter().map(|s| s.to_string()));
    a
}

/// `world` ranks with the tp size given in `extra`; the data-parallel size
/// (which sets the micro-batch at the fixed global batch) is world / tp.
fn check(what: &str, heads: usize, world: usize, accum: usize, extra: &[&str]) {
    let tp: usize = extra
        .iter()
        .find_map(|e| e.strip_prefix("parallel.tp="))
        .map_or(1, |v| v.parse().unwrap());
    // The base run shares the model's context length.
    let ctx: Vec<&str> = extra
        .iter()
        .copied()
        .filter(|e| e.starts_with("model.block_size"))
        .collect();
    let base = run(1, config(1, 1, &with(shape(heads), &ctx))).remove(0);
    let out = run(world, config(world / tp, accum, &with(shape(heads), extra)));
    assert_named_match(what, &out, &base, 1e-5);
}

#[test]
fn tp2_and_tp4_reproduce_one_rank() {
    check("tp 2", 6, 2, 1, &["parallel.tp=2"]);
    check("tp 4", 4, 4, 2, &["parallel.tp=4"]);
}

#[test]
fn vocabulary_not_divisible_by_tp_is_padded_and_masked() {
    // 256 byte tokens over 3 ranks: padded to 258, the pad never counts.
    check("tp 3", 6, 3, 1, &["parallel.tp=3"]);
}

#[test]
fn gradients_match_one_rank() {
    // One plain SGD step with lr 1: the parameter change is minus the
    // gradient, so equal parameters mean equal gradients.
    let sgd = [
        "optim.name=sgd",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "optim.lr=1",
        "optim.schedule=constant",
        "optim.grad_clip=0",
        "train.steps=1",
        "optim.warmup_steps=0",
    ];
    let base = run(1, config(1, 1, &with(shape(6), &sgd))).remove(0);
    let out = run(
        2,
        config(
            1,
            1,
            &with(shape(6), &[&sgd[..], &["parallel.tp=2"]].concat()),
        ),
    );
    assert_named_match("tp 2 gradient", &out, &base, 1e-5);
}

#[test]
fn sequence_parallel_reproduces_one_rank() {
    check(
        "tp 2 + sequence parallel",
        6,
        2,
        1,
        &[
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "model.block_size=16",
        ],
    );
}

#[test]
fn tp_times_dp_with_ddp_and_zero2() {
    check("tp 2 x dp 2 (DDP)", 6, 4, 1, &["parallel.tp=2"]);
    check(
        "tp 2 x dp 2 (ZeRO-2)",
        6,
        4,
        1,
        &["parallel.tp=2", "zero_optimization.stage=2"],
    );
    check(
        "tp 2 x dp 2 (ZeRO-3)",
        6,
        4,
        1,
        &["parallel.tp=2", "zero_optimization.stage=3"],
    );
    check(
        "tp 2 x dp 2 (ZeRO-1 + SP)",
        6,
        4,
        1,
        &[
            "parallel.tp=2",
            "zero_optimization.stage=1",
            "parallel.sequence_parallel=true",
            "model.block_size=16",
        ],
    );
}

#[test]
fn n_head_not_divisible_by_tp_is_a_clear_error() {
    let cfg = config(1, 1, &with(shape(6), &["parallel.tp=4"]));
    let out = phalanx_comm::threads::run(4, move |pg| {
        let loader = loader(15);
        phalanx_models::gpt2::train::train(&cfg, pg, loader, &Default::default())
            .err()
            .map(|e| e.to_string())
    });
    for e in out {
        let e = e.expect("must fail");
        assert!(
            e.contains("n_head (6) is not divisible by the tensor-parallel size 4"),
            "{e}"
        );
    }
}

#[test]
fn hf_weights_round_trip_under_tensor_parallel() {
    use phalanx_models::gpt2::train::{self, GptRun};
    let dir = std::env::temp_dir().join(format!("phalanx-tp-hf-{}", std::process::id()));
    let path = dir.join("model.safetensors");
    // Train with tp 2 and save: the file holds the whole model in HF layout.
    let cfg = config(1, 1, &with(shape(6), &["parallel.tp=2", "train.steps=2"]));
    let save = GptRun {
        save_final: Some(path.clone()),
        ..Default::default()
    };
    let (c2, p2) = (cfg.clone(), path.clone());
    let trained = phalanx_comm::threads::run(2, move |pg| {
        let (_, mut t) = train::train(&c2, pg, loader(15), &save).unwrap();
        train::full_named_params(&mut t, &c2).unwrap()
    });
    // A single-rank engine loads it and holds exactly the gathered model.
    let one = config(1, 1, &with(shape(6), &["train.steps=2"]));
    let mut e = train::build_engine(&one).unwrap();
    phalanx_models::gpt2::hf::load_safetensors(&mut e, &p2).unwrap();
    for (name, t) in &trained[0] {
        assert_eq!(
            e.param(name).unwrap(),
            &t.flatten_all().unwrap().to_vec1::<f32>().unwrap()[..],
            "{name}"
        );
    }
    // A tp 4 model of another shape cannot load it: a clear error.
    let init = GptRun {
        init_from: Some(path.clone()),
        ..Default::default()
    };
    let c4 = config(
        1,
        1,
        &[
            shape(4),
            vec!["parallel.tp=4".into(), "train.steps=1".into()],
        ]
        .concat(),
    );
    let err = phalanx_comm::threads::run(4, move |pg| {
        train::train(&c4, pg, loader(15), &init)
            .err()
            .map(|e| e.to_string())
    });
    for e in err {
        let e = e.expect("mismatched shapes must fail");
        assert!(e.contains("expected shape"), "{e}");
    }
    // tp 2 ranks each load their shard of it and start from the same loss
    // as a single rank that loads it whole.
    let init = GptRun {
        init_from: Some(path.clone()),
        ..Default::default()
    };
    let c2b = config(1, 1, &with(shape(6), &["parallel.tp=2", "train.steps=1"]));
    let one1 = config(1, 1, &with(shape(6), &["train.steps=1"]));
    let init1 = init.clone();
    let l2 = phalanx_comm::threads::run(2, move |pg| {
        train::train(&c2b, pg, loader(15), &init).unwrap().0.losses[0]
    });
    let l1 = phalanx_comm::threads::run(1, move |pg| {
        train::train(&one1, pg, loader(15), &init1)
            .unwrap()
            .0
            .losses[0]
    });
    assert!(
        (l2[0] - l1[0]).abs() / l1[0] < 1e-5,
        "{} vs {}",
        l2[0],
        l1[0]
    );
    assert!(l1[0] < 5.5, "started from the trained weights: {}", l1[0]);
    let _ = std::fs::remove_dir_all(dir);
}
