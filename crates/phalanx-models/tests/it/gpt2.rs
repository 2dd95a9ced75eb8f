//! GPT-2 on the engine: block-by-block backward against whole-model autograd
//! and against an independent composed-candle implementation, the ledger,
//! accumulation, hooks, training.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use phalanx::engine::{Activations, Engine, EngineConfig};
use phalanx::ledger::Mem;
use phalanx::optim::{AdamW, AdamWConfig, Optimizer};
use phalanx_models::gpt2::{self, Gpt2Config};

fn small() -> Gpt2Config {
    Gpt2Config::new(2, 2, 32, 50, 16)
}

fn engine(cfg: &Gpt2Config, activations: Activations) -> Engine {
    let ecfg = EngineConfig {
        seed: 42,
        activations,
        ..Default::default()
    };
    gpt2::engine(cfg, &Device::Cpu, ecfg).unwrap()
}

fn tokens(b: usize, t: usize, vocab: usize, seed: u32) -> (Tensor, Tensor) {
    let n = b * (t + 1);
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| ((i + seed).wrapping_mul(2654435761) >> 7) % vocab as u32)
        .collect();
    let dev = Device::Cpu;
    let all = Tensor::from_vec(ids, (b, t + 1), &dev).unwrap();
    (
        all.narrow(1, 0, t).unwrap().contiguous().unwrap(),
        all.narrow(1, 1, t).unwrap().contiguous().unwrap(),
    )
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn param_count_and_names_match_hf() {
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    assert_eq!(e.num_params(), cfg.num_params());
    let l = e.layout();
    assert_eq!(l.num_blocks(), cfg.n_layer + 2);
    for name in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.1.ln_1.weight",
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.h.1.ln_2.bias",
        "transformer.ln_f.weight",
    ] {
        assert!(l.find(name).is_some(), "{name}");
    }
    // The head reads the tied wte owned by block 0.
    let wte = l.find("transformer.wte.weight").unwrap();
    assert_eq!(wte.block, 0);
    assert_eq!(
        l.block(cfg.n_layer + 1).tied,
        vec![l.index_of("transformer.wte.weight").unwrap()]
    );
}

#[test]
fn init_follows_gpt2() {
    let cfg = Gpt2Config::new(4, 2, 64, 300, 32);
    let e = engine(&cfg, Activations::KeepGraph);
    let std = |name: &str| {
        let v = e.param(name).unwrap();
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32).sqrt()
    };
    assert!((std("transformer.wte.weight") - 0.02).abs() < 0.001);
    assert!((std("transformer.h.0.attn.c_attn.weight") - 0.02).abs() < 0.001);
    let proj = 0.02 / (2.0 * 4f32).sqrt();
    assert!((std("transformer.h.3.attn.c_proj.weight") - proj).abs() < 0.0005);
    assert!((std("transformer.h.3.mlp.c_proj.weight") - proj).abs() < 0.0005);
    assert!(e
        .param("transformer.h.2.mlp.c_fc.bias")
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
    assert!(e
        .param("transformer.ln_f.weight")
        .unwrap()
        .iter()
        .all(|&v| v == 1.0));
    // Same seed, same weights (every rank agrees without a broadcast).
    let e2 = engine(&cfg, Activations::Recompute);
    assert_eq!(e.params_flat(), e2.params_flat());
}

#[test]
fn block_backward_matches_whole_model_autograd() {
    let cfg = small();
    for mode in [Activations::KeepGraph, Activations::Recompute] {
        let mut e = engine(&cfg, mode);
        let (x, y) = tokens(3, 12, cfg.vocab_size, 1);
        let (ref_loss, ref_grads) = e.reference_grads(&x, &y, 1.0).unwrap();
        e.zero_grad();
        let loss = e.forward_backward(&x, &y, 1.0).unwrap();
        assert!(
            (loss - ref_loss).abs() <= 1e-6 * ref_loss,
            "{mode:?}: {loss} vs {ref_loss}"
        );
        for p in e.layout().params() {
            let err = rel_err(&e.grads_flat()[p.range()], &ref_grads[p.range()]);
            assert!(err < 1e-5, "{mode:?} {}: rel err {err}", p.name);
        }
    }
}

/// GPT-2 written independently with candle's composed ops (no phalanx ops,
/// no blocks), HF's formulas; weights read from the engine.
fn composed_gpt2(
    cfg: &Gpt2Config,
    w: &dyn Fn(&str) -> Tensor,
    idx: &Tensor,
    tgt: &Tensor,
) -> Result<Tensor> {
    let (b, t) = idx.dims2()?;
    let (c, nh) = (cfg.n_embd, cfg.n_head);
    let hs = c / nh;
    let ln = |x: &Tensor, p: &str| {
        candle_nn::ops::layer_norm_slow(
            x,
            &w(&format!("{p}.weight")),
            &w(&format!("{p}.bias")),
            1e-5,
        )
    };
    // HF Conv1D: y = x @ W + b with W (in, out): our weight is (out, in).
    let conv1d = |x: &Tensor, p: &str| {
        x.broadcast_matmul(&w(&format!("{p}.weight")).t()?)?
            .broadcast_add(&w(&format!("{p}.bias")))
    };
    let wte = w("transformer.wte.weight");
    let mut x = wte
        .embedding(&idx.flatten_all()?)?
        .reshape((b, t, c))?
        .broadcast_add(&w("transformer.wpe.weight").narrow(0, 0, t)?)?;
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t > k / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), idx.device())?;
    for i in 0..cfg.n_layer {
        let p = format!("transformer.h.{i}");
        let qkv = conv1d(&ln(&x, &format!("{p}.ln_1"))?, &format!("{p}.attn.c_attn"))?;
        let split = |k: usize| -> Result<Tensor> {
            qkv.narrow(2, k * c, c)?
                .reshape((b, t, nh, hs))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?)? / (hs as f64).sqrt())?.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        x = (x + conv1d(&y, &format!("{p}.attn.c_proj"))?)?;
        let h = conv1d(&ln(&x, &format!("{p}.ln_2"))?, &format!("{p}.mlp.c_fc"))?.gelu()?;
        x = (&x + conv1d(&h, &format!("{p}.mlp.c_proj"))?)?;
    }
    let logits = ln(&x, "transformer.ln_f")?
        .reshape((b * t, c))?
        .matmul(&wte.t()?)?;
    candle_nn::loss::cross_entropy(&logits, &tgt.flatten_all()?)
}

#[test]
fn matches_independent_composed_implementation() {
    let cfg = small();
    let mut e = engine(&cfg, Activations::KeepGraph);
    let (x, y) = tokens(2, 16, cfg.vocab_size, 7);
    let vars: Vec<(String, Var)> = e
        .layout()
        .params()
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                Var::from_tensor(&e.param_tensor(&p.name).unwrap()).unwrap(),
            )
        })
        .collect();
    let get = |n: &str| {
        vars.iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .as_tensor()
            .clone()
    };
    let loss = composed_gpt2(&cfg, &get, &x, &y).unwrap();
    let grads = loss.backward().unwrap();
    e.zero_grad();
    let our = e.forward_backward(&x, &y, 1.0).unwrap();
    let want = loss.to_scalar::<f32>().unwrap();
    assert!((our - want).abs() < 1e-5 * want, "{our} vs {want}");
    for (name, v) in &vars {
        let g = grads
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let err = rel_err(e.grad(name).unwrap(), &g);
        assert!(err < 1e-4, "{name}: rel err {err}");
    }
}

#[test]
fn ledger_model_states_are_16_bytes_per_param() {
    let cfg = small();
    let e = engine(&cfg, Activations::Recompute);
    let n = e.num_params();
    let _opt = AdamW::new(AdamWConfig::default(), e.layout(), 0..n, e.ledger());
    let l = e.ledger();
    assert_eq!(l.current(Mem::Params), 4 * n);
    assert_eq!(l.current(Mem::Grads), 4 * n);
    assert_eq!(l.current(Mem::OptState), 8 * n);
    assert_eq!(l.model_state_bytes(), 16 * n);
}

#[test]
fn recompute_saves_only_block_inputs() {
    let cfg = small();
    let mut e = engine(&cfg, Activations::Recompute);
    let (b, t) = (2, 16);
    let (x, y) = tokens(b, t, cfg.vocab_size, 3);
    let (_loss, stash) = e.forward_range(0..e.num_blocks(), &x, Some(&y)).unwrap();
    // token ids (u32) + one (B, T, C) f32 input per layer and for the head.
    let want = 4 * b * t + (cfg.n_layer + 1) * 4 * b * t * cfg.n_embd;
    assert_eq!(e.ledger().current(Mem::Activations), want);
    let one = Tensor::new(1f32, &Device::Cpu).unwrap();
    e.backward_range(stash, &one, &mut |_, _| Ok(())).unwrap();
    assert_eq!(e.ledger().current(Mem::Activations), 0);
}

#[test]
fn hooks_fire_head_first_and_wte_sums_both_uses() {
    let cfg = small();
    let mut e = engine(&cfg, Activations::KeepGraph);
    let (x, y) = tokens(2, 8, cfg.vocab_size, 5);
    let wte = e.layout().find("transformer.wte.weight").unwrap().range();
    let mut order = Vec::new();
    let mut wte_after_head = Vec::new();
    e.zero_grad();
    e.forward_backward_with(&x, &y, 1.0, &mut |b, g| {
        if order.is_empty() {
            wte_after_head = g[wte.clone()].to_vec();
        }
        order.push(b);
        Ok(())
    })
    .unwrap();
    assert_eq!(order, (0..cfg.n_layer + 2).rev().collect::<Vec<_>>());
    // After the head, wte holds the head's part only; the embedding adds to it.
    assert!(wte_after_head.iter().any(|&v| v != 0.0));
    assert!(rel_err(&e.grads_flat()[wte], &wte_after_head) > 1e-4);
}

#[test]
fn accumulation_matches_one_big_batch() {
    let cfg = small();
    let mut e = engine(&cfg, Activations::KeepGraph);
    let (x, y) = tokens(4, 8, cfg.vocab_size, 11);
    e.zero_grad();
    e.forward_backward(&x, &y, 1.0).unwrap();
    let full = e.grads_flat().to_vec();
    e.zero_grad();
    for k in 0..4 {
        let (xk, yk) = (x.narrow(0, k, 1).unwrap(), y.narrow(0, k, 1).unwrap());
        e.forward_backward(&xk, &yk, 0.25).unwrap();
    }
    assert!(rel_err(e.grads_flat(), &full) < 1e-5);
}

#[test]
fn trains_on_a_repeated_batch() {
    let cfg = small();
    let mut e = engine(&cfg, Activations::KeepGraph);
    let n = e.num_params();
    let mut opt = AdamW::new(
        AdamWConfig {
            weight_decay: 0.1,
            ..Default::default()
        },
        e.layout(),
        0..n,
        e.ledger(),
    );
    let (x, y) = tokens(4, 16, cfg.vocab_size, 2);
    let first = e.eval_loss(&x, &y).unwrap();
    assert!(
        (first - (cfg.vocab_size as f32).ln()).abs() < 0.2,
        "init loss {first}"
    );
    for _ in 0..40 {
        e.zero_grad();
        e.forward_backward(&x, &y, 1.0).unwrap();
        let (p, g) = e.params_and_grads_mut();
        let norm = phalanx::optim::clip::clip_grad_norm(g, 1.0);
        assert!(norm.is_finite());
        opt.step(p, g, 3e-3, 1.0);
    }
    let last = e.eval_loss(&x, &y).unwrap();
    assert!(last < 0.5 * first, "{first} -> {last}");
}

#[test]
fn logits_without_targets() {
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    let (x, _) = tokens(2, 5, cfg.vocab_size, 0);
    let logits = e.forward(&x).unwrap();
    assert_eq!(logits.dims(), &[2, 5, cfg.vocab_size]);
    assert_eq!(logits.dtype(), DType::F32);
    // Too long a sequence is a clear error.
    let (x, _) = tokens(1, cfg.block_size + 1, cfg.vocab_size, 0);
    let err = e.forward(&x).unwrap_err().to_string();
    assert!(err.contains("exceeds the context length"), "{err}");
}

#[test]
fn presets_and_tp_guard() {
    assert_eq!(
        Gpt2Config::preset("gpt-tiny").unwrap(),
        Gpt2Config::new(4, 4, 128, 256, 128)
    );
    assert_eq!(
        Gpt2Config::preset("gpt2-124m").unwrap().num_params(),
        124_439_808
    );
    assert!(Gpt2Config::preset("gpt5").is_err());
}
