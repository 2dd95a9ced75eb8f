//! Qwen2 against float64 transformers in every layout the trainer offers:
//! `phalanx train`'s path (`family::build_for_hf` reads the fixture's
//! `config.json`, `--init-from` its weights) on the fixture's token stream,
//! in the order Phalanx's loader serves it, must give transformers' loss at
//! every step and its final parameters (gathered by name from every rank,
//! q / k / v biases included), on one rank and under DDP, ZeRO-1/2/3,
//! tensor parallel (kv heads split, and replicated; sequence parallel),
//! pipeline parallel and pp x tp x dp. `--save-final` under tp and ZeRO-3
//! writes HF's names and a `config.json` that reads back as Qwen2.
//!
//! The fixtures: `tests/fixtures/make_qwen2_fixture.py` (see its header).

use crate::fixture;
use candle_core::{DType, Device, Tensor};
use fixture::*;
use phalanx::config::TrainConfig;
use phalanx::data::{DataLoader, LoaderConfig, TokenData};
use phalanx_models::train::{self, Run};
use phalanx_models::{family, qwen2};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

struct Fixture {
    case: &'static str,
    expected: HashMap<String, Tensor>,
    /// Steps, global batch, sequence length.
    steps: usize,
    batch: usize,
    seq: usize,
}

fn fixture(case: &'static str) -> Fixture {
    let expected = expected(case);
    let (steps, batch, seq) = expected["inputs"].dims3().unwrap();
    Fixture {
        case,
        expected,
        steps,
        batch,
        seq,
    }
}

impl Fixture {
    /// The fixture's token stream, unshuffled, in samples of its length.
    fn loader(&self) -> Arc<DataLoader> {
        let ids: Vec<u32> = self.expected["tokens"]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let lc = LoaderConfig {
            seq_len: self.seq,
            val_fraction: 0.0,
            shuffle: false,
            seed: 0,
            vocab_size: Some(1 << 20),
        };
        Arc::new(DataLoader::new(TokenData::from_tokens(ids), lc).unwrap())
    }

    /// transformers' training, as the fixture recorded it.
    fn optim(&self) -> Vec<String> {
        let s = |x: &str| x.to_string();
        let mut o = vec![
            s("optim.grad_clip=0.0"),
            s("optim.warmup_steps=0"),
            s("optim.schedule=constant"),
        ];
        if self.case == "qwen2_tied_gqa" {
            o.extend([
                s("optim.name=adamw"),
                s("optim.lr=3e-3"),
                s("optim.weight_decay=0.1"),
                s("optim.betas=[0.9, 0.95]"),
                s("optim.eps=1e-8"),
            ]);
        } else {
            o.extend([
                s("optim.name=sgd"),
                s("optim.lr=0.5"),
                s("optim.momentum=0.0"),
                s("optim.weight_decay=0.0"),
            ]);
        }
        o
    }

    /// The config `phalanx train --init-from DIR` builds: the model from
    /// the fixture's config.json (only the context set, to the samples'),
    /// the fixture's optimizer, the layout of `extra`.
    fn config(&self, dp: usize, accum: usize, extra: &[&str]) -> TrainConfig {
        let mut sets = vec![
            format!("model.block_size={}", self.seq),
            format!("train.steps={}", self.steps),
            format!("train.micro_batch_size={}", self.batch / dp / accum),
            format!("train.grad_accum_steps={accum}"),
            "train.eval_interval=0".into(),
            "log.plot=\"\"".into(),
            "log.report=\"\"".into(),
        ];
        sets.extend(self.optim());
        sets.extend(extra.iter().map(|s| s.to_string()));
        let (cfg, cj) = family::build_for_hf(None, &sets, &dir(self.case)).unwrap();
        assert!(cj.is_some());
        assert_eq!(family::of(&cfg).unwrap().name(), "qwen2");
        cfg
    }
}

struct RankResult {
    losses: Vec<f32>,
    named: HashMap<String, Vec<f32>>,
}

fn run(world: usize, cfg: TrainConfig, f: &Fixture, save: Option<PathBuf>) -> Vec<RankResult> {
    let loader = f.loader();
    let r = Run {
        init_from: Some(dir(f.case)),
        save_final: save,
        ..Default::default()
    };
    phalanx_comm::threads::run(world, move |pg| {
        let (report, mut trainer) = train::train(&cfg, pg, loader.clone(), &r).unwrap();
        let named = train::full_named_params(&mut trainer, &cfg)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        RankResult {
            losses: report.losses,
            named,
        }
    })
}

/// The final parameters' tolerance (max-relative), as on one rank in
/// qwen2_hf.rs: 2e-5, and 5e-3 for the k bias under AdamW (whose gradient
/// is near zero in its lowest-frequency rotary elements; see there).
fn tolerance(case: &str, name: &str) -> f64 {
    if case == "qwen2_tied_gqa" && name.ends_with("k_proj.bias") {
        5e-3
    } else {
        2e-5
    }
}

/// Every rank's losses within 1e-5 relative of transformers', every final
/// parameter within [`tolerance`].
fn assert_matches_transformers(what: &str, f: &Fixture, out: &[RankResult]) {
    let want = f64s(&f.expected["losses"]);
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.losses.len(), want.len(), "{what}: rank {r}");
        for (k, (a, b)) in o.losses.iter().zip(&want).enumerate() {
            let a = *a as f64;
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{} {what}: rank {r} step {k} loss {a} vs transformers {b}",
                f.case
            );
        }
        let finals: Vec<&String> = f
            .expected
            .keys()
            .filter(|k| k.starts_with("final."))
            .collect();
        assert_eq!(o.named.len(), finals.len(), "{what}: rank {r} parameters");
        let mut worst = 0f64;
        for k in finals {
            let name = &k["final.".len()..];
            let ours: Vec<f64> = o.named[name].iter().map(|&v| v as f64).collect();
            let e = rel_max(&ours, &f64s(&f.expected[k]));
            let tol = tolerance(f.case, name);
            if tol == 2e-5 {
                worst = worst.max(e);
            } else if r == 0 {
                println!("{} {what}: `{name}` max rel err {e:e}", f.case);
            }
            assert!(
                e < tol,
                "{} {what}: rank {r} `{name}` differs by {e:e}",
                f.case
            );
        }
        if r == 0 {
            println!("{} {what}: final parameters max rel err {worst:e}", f.case);
        }
    }
}

#[test]
fn one_rank_ddp_and_zero_1_2_3_match_transformers() {
    for case in ["qwen2_tied_gqa", "qwen2_untied"] {
        let f = fixture(case);
        for (what, world, accum, extra) in [
            ("1 rank", 1, 1, vec![]),
            ("1 rank, accum 2", 1, 2, vec![]),
            ("DDP 2 ranks", 2, 1, vec![]),
            (
                "ZeRO-1 2 ranks accum 2",
                2,
                2,
                vec!["zero_optimization.stage=1"],
            ),
            (
                "ZeRO-2 4 ranks",
                4,
                1,
                vec!["zero_optimization.stage=2", "parallel.bucket_mb=0.01"],
            ),
            ("ZeRO-3 2 ranks", 2, 1, vec!["zero_optimization.stage=3"]),
        ] {
            let out = run(world, f.config(world, accum, &extra), &f, None);
            assert_matches_transformers(what, &f, &out);
        }
    }
}

#[test]
fn tensor_parallel_with_the_biases_split_matches_transformers() {
    // Both 4 heads over 2 kv heads: tp 2 splits the kv heads (and the k / v
    // biases), tp 4 replicates them.
    for case in ["qwen2_tied_gqa", "qwen2_untied"] {
        let f = fixture(case);
        for (what, world, dp, extra) in [
            ("tp 2 (kv heads split)", 2, 1, vec!["parallel.tp=2"]),
            ("tp 4 (kv heads replicated)", 4, 1, vec!["parallel.tp=4"]),
            (
                "tp 2 + sequence parallel",
                2,
                1,
                vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
            ),
            (
                "tp 2 x dp 2 ZeRO-1",
                4,
                2,
                vec!["parallel.tp=2", "zero_optimization.stage=1"],
            ),
        ] {
            let out = run(world, f.config(dp, 1, &extra), &f, None);
            assert_matches_transformers(what, &f, &out);
        }
    }
    // Replicated kv heads under sequence parallelism (their gradients are
    // partial sums the trainer completes).
    let f = fixture("qwen2_untied");
    let extra = ["parallel.tp=4", "parallel.sequence_parallel=true"];
    let out = run(4, f.config(1, 1, &extra), &f, None);
    assert_matches_transformers("tp 4 + sequence parallel (kv replicated)", &f, &out);
}

#[test]
fn pipeline_and_3d_match_transformers() {
    for case in ["qwen2_tied_gqa", "qwen2_untied"] {
        let f = fixture(case);
        for (what, world, dp, accum, extra) in [
            ("pp 2 (1f1b)", 2, 1, 4, vec!["parallel.pp=2"]),
            (
                "pp 2 (gpipe)",
                2,
                1,
                2,
                vec!["parallel.pp=2", "parallel.pp_schedule=gpipe"],
            ),
            (
                "pp 2 x tp 2 x dp 2",
                8,
                2,
                2,
                vec!["parallel.pp=2", "parallel.tp=2"],
            ),
        ] {
            let out = run(world, f.config(dp, accum, &extra), &f, None);
            assert_matches_transformers(what, &f, &out);
        }
    }
}

#[test]
fn save_final_under_tp_and_zero3_writes_hf_qwen2() {
    let f = fixture("qwen2_tied_gqa");
    let tmp = std::env::temp_dir().join(format!("phalanx-qwen2-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    for (what, world, extra) in [
        ("tp 2", 2, vec!["parallel.tp=2"]),
        ("ZeRO-3", 2, vec!["zero_optimization.stage=3"]),
    ] {
        let dp = if what == "tp 2" { 1 } else { 2 };
        let out_dir = tmp.join(what.replace(' ', "_"));
        let out = run(world, f.config(dp, 1, &extra), &f, Some(out_dir.clone()));
        assert_matches_transformers(what, &f, &out);
        let saved = candle_core::safetensors::load(out_dir.join("model.safetensors"), &Device::Cpu)
            .unwrap();
        // HF's names, the tied head saved once, the biases whole.
        assert!(!saved.contains_key("lm_head.weight"), "{what}");
        assert_eq!(
            saved["model.layers.1.self_attn.k_proj.bias"].dims(),
            &[16],
            "{what}"
        );
        for (k, want) in &f.expected {
            let Some(name) = k.strip_prefix("final.") else {
                continue;
            };
            let e = rel_max(&f64s(&saved[name]), &f64s(want));
            assert!(
                e < tolerance(f.case, name),
                "{what}: saved `{name}` differs by {e:e}"
            );
        }
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(json["model_type"], "qwen2");
        assert_eq!(
            json["architectures"],
            serde_json::json!(["Qwen2ForCausalLM"])
        );
        let back = qwen2::hf::config_from_json(&json).unwrap();
        assert!(back.qkv_bias && back.tie_word_embeddings);
        // The imported model's context, kept though it trained at f.seq.
        let imported = hf_config(f.case)["max_position_embeddings"]
            .as_u64()
            .unwrap() as usize;
        assert_eq!(back.block_size, f.seq.max(imported));
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn the_planner_counts_the_biases_whole_and_per_rank() {
    // The planner's parameters of a Qwen2 are what its blocks declare, q /
    // k / v biases included: its parameter count is the trainer's engine's,
    // whole and on every tp rank (kv heads, and their biases, split at tp 2
    // and replicated at tp 4).
    for case in ["qwen2_tied_gqa", "qwen2_untied"] {
        let f = fixture(case);
        let cfg = f.config(1, 1, &[]);
        let m = family::plan_shape(&cfg).unwrap();
        let biases = m
            .declared(1)
            .layer
            .iter()
            .filter(|p| p.name.ends_with("_proj.bias"));
        assert_eq!(biases.count(), 3, "{case}: q, k and v biases");
        let whole = train::build_engine(&cfg).unwrap().num_params();
        assert_eq!(m.num_params(), whole, "{case}");
        for tp in [2, 4] {
            let cfg = f.config(1, 1, &[&format!("parallel.tp={tp}")]);
            let want = m.rank_params(tp).total(m.n_layer);
            let loader = f.loader();
            let counts = phalanx_comm::threads::run(tp, move |pg| {
                let t = train::trainer(&cfg, pg, loader.clone(), &Run::default()).unwrap();
                t.engine().num_params()
            });
            for (r, n) in counts.iter().enumerate() {
                assert_eq!(*n, want, "{case} tp {tp} rank {r}");
            }
        }
    }
}
