//! Llama on the engine: names and counts as HF's, init, block-by-block
//! backward against whole-model autograd (kept graph and recompute), tied
//! head, the config section (`model.arch`), presets, generation logits.

use candle_core::{DType, Device, Tensor};
use phalanx::engine::{Activations, Engine, EngineConfig};
use phalanx_models::arch;
use phalanx_models::llama::{self, config::LlamaSection, LlamaConfig};

fn small() -> LlamaConfig {
    LlamaConfig::new(2, 4, 2, 32, 40, 50, 16)
}

fn engine(cfg: &LlamaConfig, activations: Activations) -> Engine {
    let ecfg = EngineConfig {
        seed: 42,
        activations,
        ..Default::default()
    };
    llama::engine(cfg, &Device::Cpu, ecfg).unwrap()
}

fn tokens(b: usize, t: usize, vocab: usize, seed: u32) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..(b * (t + 1)) as u32)
        .map(|i| ((i + seed).wrapping_mul(2654435761) >> 7) % vocab as u32)
        .collect();
    let all = Tensor::from_vec(ids, (b, t + 1), &Device::Cpu).unwrap();
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
fn names_shapes_and_count_match_hf() {
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    assert_eq!(e.num_params(), cfg.num_params());
    let names: std::collections::HashSet<String> =
        e.layout().params().iter().map(|p| p.name.clone()).collect();
    assert_eq!(names, llama::hf::names(&cfg));
    let shape = |n: &str| e.layout().find(n).unwrap().shape.clone();
    assert_eq!(
        shape("model.layers.1.self_attn.k_proj.weight"),
        vec![16, 32]
    ); // GQA: 2 kv heads x 8
    assert_eq!(shape("model.layers.1.mlp.down_proj.weight"), vec![32, 40]);
    assert_eq!(shape("lm_head.weight"), vec![50, 32]);
    // Init: N(0, 0.02) matrices, norms 1.
    let big = LlamaConfig::new(1, 4, 4, 128, 256, 300, 8);
    let e = engine(&big, Activations::KeepGraph);
    let v = e.param("model.layers.0.mlp.gate_proj.weight").unwrap();
    let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.001, "{std}");
    assert!(e
        .param("model.norm.weight")
        .unwrap()
        .iter()
        .all(|&x| x == 1.0));
}

#[test]
fn tied_head_is_one_parameter_owned_by_the_embedding() {
    let mut cfg = small();
    cfg.tie_word_embeddings = true;
    let e = engine(&cfg, Activations::KeepGraph);
    assert_eq!(e.num_params(), cfg.num_params());
    assert_eq!(cfg.num_params() + 50 * 32, small().num_params());
    let l = e.layout();
    assert!(l.find("lm_head.weight").is_none());
    assert_eq!(l.find("model.embed_tokens.weight").unwrap().block, 0);
    assert_eq!(
        l.block(cfg.n_layer + 1).tied,
        vec![l.index_of("model.embed_tokens.weight").unwrap()]
    );
}

#[test]
fn block_backward_matches_whole_model_autograd() {
    for tie in [false, true] {
        let mut cfg = small();
        cfg.tie_word_embeddings = tie;
        for mode in [Activations::KeepGraph, Activations::Recompute] {
            let mut e = engine(&cfg, mode);
            let (x, y) = tokens(3, 12, cfg.vocab_size, 1);
            let (ref_loss, ref_grads) = e.reference_grads(&x, &y, 1.0).unwrap();
            e.zero_grad();
            let loss = e.forward_backward(&x, &y, 1.0).unwrap();
            assert!((loss - ref_loss).abs() <= 1e-6 * ref_loss, "{mode:?}");
            for p in e.layout().params() {
                let g = &e.grads_flat()[p.range()];
                assert!(g.iter().any(|&v| v != 0.0), "{} gets no gradient", p.name);
                let err = rel_err(g, &ref_grads[p.range()]);
                assert!(err < 1e-5, "tie {tie} {mode:?} {}: rel err {err}", p.name);
            }
        }
    }
}

#[test]
fn logits_without_targets_and_context_guard() {
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    let (x, _) = tokens(2, 5, cfg.vocab_size, 0);
    let logits = e.forward(&x).unwrap();
    assert_eq!(logits.dims(), &[2, 5, cfg.vocab_size]);
    assert_eq!(logits.dtype(), DType::F32);
    // Causal: the logits at position 2 do not depend on later tokens.
    let (x2, _) = tokens(2, 5, cfg.vocab_size, 9);
    let mixed = Tensor::cat(
        &[&x.narrow(1, 0, 3).unwrap(), &x2.narrow(1, 3, 2).unwrap()],
        1,
    )
    .unwrap();
    let l2 = e.forward(&mixed).unwrap();
    let a: Vec<f32> = logits
        .narrow(1, 0, 3)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f32> = l2
        .narrow(1, 0, 3)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(rel_err(&a, &b) < 1e-6);
    let (x, _) = tokens(1, cfg.block_size + 1, cfg.vocab_size, 0);
    let err = e.forward(&x).unwrap_err().to_string();
    assert!(err.contains("exceeds the context length"), "{err}");
}

#[test]
fn config_section_arch_and_presets() {
    let sets = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let cfg = arch::build(
        None,
        &sets(&[
            "model.arch=llama",
            "model.n_kv_head=1",
            "model.rope_theta=500000.0",
        ]),
    )
    .unwrap();
    assert_eq!(arch::of(&cfg).unwrap().name(), "llama");
    let m = LlamaSection::of(&cfg).unwrap().model();
    assert_eq!(
        (m.n_layer, m.n_head, m.n_kv_head, m.vocab_size),
        (4, 4, 1, 256)
    );
    assert_eq!(
        (m.rope_theta, m.rms_norm_eps, m.tie_word_embeddings),
        (500000.0, 1e-5, false)
    );
    assert_eq!(cfg.seq_len(), Some(128));
    // The preset alone implies the architecture.
    let cfg = arch::build(None, &sets(&["model.preset=llama-60m"])).unwrap();
    let m = LlamaSection::of(&cfg).unwrap().model();
    assert_eq!(m.num_params(), 60_175_104);
    assert_eq!(
        LlamaConfig::preset("tinyllama-1.1b").unwrap().num_params(),
        1_100_048_384
    );
    // Llama 3.2 1B: tied head, Llama 3 rotary scaling, HF's parameter count.
    let cfg = arch::build(None, &sets(&["model.preset=llama-3.2-1b"])).unwrap();
    let m = LlamaSection::of(&cfg).unwrap().model();
    assert_eq!(m.num_params(), 1_235_814_400);
    assert!(
        matches!(m.rope_scaling, llama::config::RopeScaling::Llama3 { factor, .. } if factor == 32.0)
    );
    // Scaling divides the lowest frequency by the factor and keeps the highest.
    let base = LlamaConfig {
        rope_scaling: llama::config::RopeScaling::None,
        ..m
    }
    .inv_freq();
    let inv = m.inv_freq();
    assert_eq!(inv[0], base[0]);
    assert!((inv[31] * 32.0 - base[31]).abs() < 1e-6 * base[31]);
    // GPT-2 stays the default, and its sections still read.
    let g = arch::build(None, &[]).unwrap();
    assert_eq!(arch::of(&g).unwrap().name(), "gpt2");
    assert_eq!(
        phalanx_models::gpt2::config::Gpt2Section::of(&g)
            .unwrap()
            .n_layer,
        4
    );
    // Errors name the key.
    for (s, want) in [
        (
            vec!["model.arch=gpt2", "model.n_kv_head=2"],
            "unknown key `model.n_kv_head`",
        ),
        (
            vec!["model.arch=llama", "model.preset=gpt-tiny"],
            "unknown model.preset \"gpt-tiny\" for model.arch = \"llama\"",
        ),
        (vec!["model.arch=mamba"], "unknown model.arch \"mamba\""),
        (
            vec!["model.arch=llama", "model.rope_scaling=yarn"],
            "model.rope_scaling \"yarn\"",
        ),
        (
            vec![
                "model.arch=llama",
                "model.rope_scaling=llama3",
                "model.rope_high_freq_factor=0.5",
            ],
            "model.rope_high_freq_factor (0.5)",
        ),
        (
            vec!["model.arch=llama", "model.n_kv_head=3"],
            "model.n_head (4) must be a multiple of model.n_kv_head (3)",
        ),
        (
            vec!["model.arch=llama", "model.rope_factor=32"],
            "set model.rope_scaling = \"llama3\" to use them",
        ),
        (
            vec!["model.arch=llama", "model.n_embd=100", "model.n_head=20"],
            "must be even",
        ),
    ] {
        let e = arch::build(None, &sets(&s)).unwrap_err().to_string();
        assert!(e.contains(want), "{s:?}: {e}");
    }
    assert!(LlamaSection::of(&g)
        .unwrap_err()
        .to_string()
        .contains("not a Llama config"));
}

#[test]
fn kv_cache_matches_full_recompute() {
    use phalanx_models::llama::generate::Generator;
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    let (x, _) = tokens(1, cfg.block_size, cfg.vocab_size, 4);
    let ids: Vec<u32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let full = e.forward(&x).unwrap().squeeze(0).unwrap(); // (T, V)
    let mut g = Generator::new(&e, &cfg).unwrap();
    // A 5-token prompt, then one token at a time from the cache.
    let mut got = vec![g.step(&ids[..5]).unwrap()];
    for &id in &ids[5..] {
        got.push(g.step(&[id]).unwrap());
    }
    let got = Tensor::cat(&got, 0).unwrap();
    let a: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = full.flatten_all().unwrap().to_vec1().unwrap();
    let err = rel_err(&a, &b);
    assert!(err < 1e-5, "cached logits differ by {err}");
    let err = g.step(&[1]).unwrap_err().to_string();
    assert!(err.contains("exceeds the context length"), "{err}");
    g.reset();
    assert!(g.is_empty());
}

/// A prompt fed in pieces (as generation feeds a long one) gives the
/// logits of feeding it whole.
#[test]
fn a_prompt_fed_in_pieces_matches_the_full_forward() {
    use phalanx_models::common::generate::Decoder;
    use phalanx_models::llama::generate::CachedDecoder;
    let cfg = small();
    let e = engine(&cfg, Activations::KeepGraph);
    let (x, _) = tokens(1, cfg.block_size, cfg.vocab_size, 5);
    let ids: Vec<u32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let full = e.forward(&x).unwrap().squeeze(0).unwrap(); // (T, V)
    let want: Vec<f32> = full.get(ids.len() - 1).unwrap().to_vec1().unwrap();
    for chunk in [1, 3, ids.len()] {
        let mut d = CachedDecoder::new(&e, &cfg).unwrap().prefill_chunk(chunk);
        let got = d.next_logits(&ids, 0).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 1e-5, "pieces of {chunk}: logits differ by {err}");
    }
}

/// Values and gradients (of x and w) of a fused op and its composed reference.
fn fused_vs_composed(
    shape: &[usize],
    fused: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    composed: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    w_shape: &[usize],
) -> f32 {
    use candle_core::Var;
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, w_shape, &dev).unwrap()).unwrap();
    let gy = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
    let run = |f: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>| {
        let y = f(x.as_tensor(), w.as_tensor()).unwrap();
        let g = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (
            v(&y),
            v(g.get(x.as_tensor()).unwrap()),
            g.get(w.as_tensor()).map(v),
        )
    };
    let (a, b) = (run(fused), run(composed));
    let mut worst = rel_err(&a.0, &b.0).max(rel_err(&a.1, &b.1));
    if let (Some(p), Some(q)) = (&a.2, &b.2) {
        worst = worst.max(rel_err(p, q));
    }
    worst
}

#[test]
fn fused_ops_match_composed_candle() {
    use phalanx_models::llama::{blocks, ops};
    // RMSNorm: 70 rows of 48 (one with a vectorised tail).
    let e = fused_vs_composed(
        &[2, 35, 48],
        &|x, w| ops::rms_norm(x, w, 1e-5),
        &|x, w| blocks::rms_norm_composed(x, w, 1e-5),
        &[48],
    );
    assert!(e < 1e-5, "rms_norm {e}");
    // Rotary at an offset (as the KV cache uses it), d = 8, 3 heads.
    let e = fused_vs_composed(
        &[2, 7, 3, 8],
        &|x, _| ops::rope(x, &[1.0, 0.3, 0.05, 0.001], 5),
        &|x, _| {
            let inv = [1.0, 0.3, 0.05, 0.001];
            let (c, s) = blocks::rope_tables(&inv, 5, 7, DType::F32, &Device::Cpu)?;
            blocks::apply_rope(x, &c, &s)
        },
        &[1],
    );
    assert!(e < 1e-5, "rope {e}");
    // SwiGLU: "w" is the up projection's output, of x's shape.
    let e = fused_vs_composed(
        &[3, 5, 40],
        &|g, u| ops::swiglu(g, u),
        &|g, u| g.silu()? * u,
        &[3, 5, 40],
    );
    assert!(e < 1e-5, "swiglu {e}");
}
