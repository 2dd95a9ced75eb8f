//! `phalanx::plan` for Llama against what Llama training does, ranks as
//! threads: the planner's parameter count is the model's for every preset
//! (tied and untied), its predicted bytes per step equal rank 0's measured
//! `comm_bytes` within 5% (DDP, ZeRO-1/2/3, tensor parallel with kv heads
//! split and replicated, with recomputation, a pipeline) and its model
//! states the ledger's within 5%; the MFU the trainer logs uses the Llama
//! FLOPs; the selection splits a Llama whose layer does not fit.

use phalanx::plan::{self, select, Hardware, Layout};
use phalanx_models::arch;
use phalanx_models::llama::train::{self, LlamaRun};
use phalanx_models::llama::LlamaConfig;

use crate::common;

/// 2 layers, 4 heads over 2 kv heads, 32 wide, MLP 40, context 16.
fn cfg(extra: &[&str]) -> phalanx::config::TrainConfig {
    let mut sets: Vec<String> = [
        "model.arch=llama",
        "model.n_layer=2",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.n_embd=32",
        "model.intermediate_size=40",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_interval=0",
        "log.plot=\"\"",
        "log.report=\"\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    arch::build(None, &sets).unwrap()
}

#[test]
fn plan_shape_counts_the_model_parameters() {
    for p in LlamaConfig::PRESETS {
        let m = LlamaConfig::preset(p).unwrap();
        let s = m.plan_shape(m.block_size.min(2048)).unwrap();
        assert_eq!(s.num_params(), m.num_params(), "{p}");
        let tied = LlamaConfig {
            tie_word_embeddings: !m.tie_word_embeddings,
            ..m
        };
        assert_eq!(
            tied.plan_shape(16).unwrap().num_params(),
            tied.num_params(),
            "{p} retied"
        );
    }
    // head_dim set apart from the width.
    let mut m = LlamaConfig::new(2, 4, 2, 24, 40, 256, 16);
    m.head_size = 8;
    assert_eq!(m.plan_shape(16).unwrap().num_params(), m.num_params());
    // The config's shape, through `model.arch`.
    let c = cfg(&[]);
    let s = arch::plan_shape(&c).unwrap();
    assert_eq!(s.family, plan::Family::Llama);
    assert_eq!(
        s.num_params(),
        train::model_config(&c).unwrap().num_params()
    );
}

/// Rank 0's comm_bytes of its second step, its ledger's model states, and
/// the MFU it reports.
fn measure(world: usize, cfg: &phalanx::config::TrainConfig) -> (u64, usize) {
    let loader = common::loader(cfg.seq_len().unwrap());
    let c = cfg.clone();
    let out = phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&c, pg, loader.clone(), &LlamaRun::default()).unwrap();
        t.step(0).unwrap();
        let bytes = t.step(1).unwrap().comm_bytes;
        let states = t.memory_report().unwrap()[0].model_states();
        (bytes, states)
    });
    out[0]
}

#[test]
fn predicted_bytes_and_model_states_match_llama_training() {
    let cases: &[(usize, &[&str])] = &[
        (2, &[]),
        (2, &["zero_optimization.stage=1"]),
        (
            3,
            &["zero_optimization.stage=2", "train.grad_accum_steps=2"],
        ),
        (2, &["zero_optimization.stage=3"]),
        (2, &["parallel.tp=2"]),
        (4, &["parallel.tp=4"]),
        (
            2,
            &["parallel.tp=2", "train.activation_checkpointing=\"full\""],
        ),
        (2, &["parallel.pp=2", "train.grad_accum_steps=2"]),
        (2, &["model.tie_word_embeddings=true", "parallel.pp=2"]),
        (
            2,
            &[
                "model.tie_word_embeddings=true",
                "zero_optimization.stage=3",
            ],
        ),
    ];
    for (world, extra) in cases {
        let c = cfg(extra);
        let m = arch::plan_shape(&c).unwrap();
        let l = Layout::from_config(&c, *world).unwrap();
        let predicted = plan::comm::bytes_per_step(&m, &l);
        let (measured, states) = measure(*world, &c);
        let err = (predicted as f64 - measured as f64).abs() / measured as f64;
        assert!(
            err <= 0.05,
            "{world} ranks {extra:?}: predicted {predicted} bytes per step, measured {measured}"
        );
        if l.pp == 1 {
            let p = plan::memory::per_rank(&m, &l).model_states();
            let err = (p as f64 - states as f64).abs() / states as f64;
            assert!(
                err <= 0.05,
                "{world} ranks {extra:?}: model states predicted {p}, ledger {states}"
            );
        }
    }
}

#[test]
fn llama_runs_report_mfu_from_the_llama_flops() {
    let c = cfg(&["train.steps=2"]);
    let loader = common::loader(c.seq_len().unwrap());
    let out = phalanx_comm::threads::run(1, move |pg| {
        let t = train::trainer(&c, pg, loader.clone(), &LlamaRun::default()).unwrap();
        t.flops_per_token()
    });
    let m = arch::plan_shape(&cfg(&[])).unwrap();
    // 6 x (2 layers x (q, o 32x32; k, v 16x32; 3 x 40x32) + head 256x32)
    // + 12 x 2 layers x 16 positions x 32.
    let by_hand = 6.0 * (2 * (2 * 1024 + 2 * 512 + 3 * 1280) + 256 * 32) as f64 + 12.0 * 1024.0;
    assert_eq!(plan::model_flops_per_token(&m), by_hand);
    assert_eq!(out[0], Some(by_hand));
}

const GIB: u64 = 1 << 30;

#[test]
fn selection_splits_a_llama_whose_layer_does_not_fit() {
    // 8192 wide, MLP 28672, 64 heads over 8 kv heads: one layer is ~0.9B
    // parameters, 14 GiB of fp32 model states; 8 GiB per rank.
    let m = LlamaConfig::new(4, 64, 8, 8192, 28672, 32000, 512)
        .plan_shape(512)
        .unwrap();
    let hw = Hardware::new(8, 1, 8 * GIB, 100e12, 100e9);
    let ranked = select::rank(&select::enumerate(&m, &hw, &Layout::ddp(8, 1, 1)), &m, &hw);
    assert!(ranked[0].fits, "{}", select::explain(&m, &ranked, &hw));
    assert!(ranked[0].layout.tp > 1, "{:?}", ranked[0].layout);
    // A small Llama fits: plain DDP.
    let small = LlamaConfig::new(4, 4, 2, 128, 352, 256, 128)
        .plan_shape(128)
        .unwrap();
    let ranked = select::rank(
        &select::enumerate(&small, &hw, &Layout::ddp(8, 8, 1)),
        &small,
        &hw,
    );
    let b = ranked[0].layout;
    assert_eq!((b.dp, b.tp, b.pp, b.zero_stage), (8, 1, 1, 0));
    // Every layout enumerated is one Llama's tensor parallel accepts: tp 4
    // over 2 kv heads replicates them; 8 does not divide the 4 heads.
    assert!(ranked.iter().any(|c| c.layout.tp == 4));
    assert!(ranked.iter().all(|c| c.layout.tp <= 4));
    // 3 kv heads: tp 2 neither splits nor replicates them.
    let odd = LlamaConfig::new(4, 6, 3, 192, 352, 256, 128)
        .plan_shape(128)
        .unwrap();
    let tps: Vec<usize> = select::enumerate(&odd, &hw, &Layout::ddp(8, 8, 1))
        .iter()
        .map(|l| l.tp)
        .collect();
    assert!(!tps.contains(&2) && tps.contains(&1), "{tps:?}");
}
