//! A pipeline stage holds only its own blocks: it allocates, initialises,
//! loads (`--init-from` reads only its tensors), updates and evaluates only
//! them, and its parameters and gradients are about 1/p of the model.

use crate::common;
use common::*;
use phalanx::engine::Engine;
use phalanx_models::gpt2::{hf, train};

fn sets(extra: &[&str]) -> Vec<String> {
    ["model.n_layer=4"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn stages_hold_about_one_pth_of_parameters_and_gradients() {
    let one = run(1, config(1, 1, &sets(&[]))).remove(0);
    let full = one.memory[0].params;
    let pp2 = run(2, config(1, 2, &sets(&["parallel.pp=2"])));
    // Same training (the equivalence the pipeline tests check in depth).
    assert_named_match("pp 2", &pp2, &one, 1e-5);
    for m in &pp2[0].memory {
        // Half the blocks, plus the tied embedding on the last stage.
        assert!(
            m.params < full * 7 / 10 && m.grads < full * 7 / 10,
            "rank {}: params {} B, grads {} B of a {full} B model",
            m.rank,
            m.params,
            m.grads
        );
    }
    let held: usize = pp2[0].memory.iter().map(|m| m.params).sum();
    assert!(held >= full, "every parameter is held somewhere");
}

#[test]
fn evaluation_and_init_from_run_through_the_stages() {
    let dir = std::env::temp_dir().join(format!("phalanx-ppmem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    // A model to start from: seed 5, saved in HF layout.
    let cfg1 = config(1, 1, &sets(&["train.seed=5"]));
    let src: Engine = train::build_engine(&cfg1).unwrap();
    hf::save_safetensors(&src, &file).unwrap();
    let want = src.params_flat().to_vec();
    let cfg = config(1, 2, &sets(&["parallel.pp=2"]));
    let loader = loader(cfg.seq_len().unwrap());
    let batch = loader.micro_batch(0, 0, 1, 0, 4, 1).unwrap();
    let (x, y) = batch.to_tensors(&candle_core::Device::Cpu).unwrap();
    let expect = src.eval_loss(&x, &y).unwrap();
    let run = train::GptRun {
        init_from: Some(file.clone()),
        ..Default::default()
    };
    let out = phalanx_comm::threads::run(2, move |pg| {
        let t = train::trainer(&cfg, pg, loader.clone(), &run).unwrap();
        let loss = t.strategy().eval_loss(t.engine(), &x, &y).unwrap();
        (
            loss,
            t.full_params().unwrap(),
            t.engine().held().map(|h| h.to_vec()),
        )
    });
    for (r, (loss, params, held)) in out.iter().enumerate() {
        assert!(held.is_some(), "rank {r} holds only its stage");
        assert_eq!(
            params, &want,
            "rank {r}: the loaded model, assembled from the stages"
        );
        assert!(
            ((loss - expect) / expect).abs() < 1e-5,
            "rank {r}: eval {loss} vs {expect}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
