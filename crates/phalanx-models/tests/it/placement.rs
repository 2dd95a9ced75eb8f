//! Declared placements: for every parameter of GPT-2, Llama (kv heads split
//! and replicated) and Llama with q/k/v biases (Qwen2's layer), on tp 2
//! and 3, the placement a tensor-parallel block declares gives the slice
//! (rule) of the name-suffix tables it replaced (written out below), and
//! the whole shape of the one-rank engine's parameter of that name.

use candle_core::Device;
use phalanx::engine::{Block, Engine, EngineConfig, Rule};
use phalanx::tp::{padded_vocab, Tp};
use phalanx_models::gpt2::{self, Gpt2Config};
use phalanx_models::llama::{self, LlamaConfig};
use std::collections::HashMap;
use std::ops::Range;

fn part(n: usize, t: usize, tp: usize) -> Range<usize> {
    (t * n / tp)..((t + 1) * n / tp)
}

fn vocab_rows(vocab: usize, t: usize, tp: usize) -> Rule {
    let rows = padded_vocab(vocab, tp) / tp;
    Rule::Rows(std::iter::once(t * rows..(t + 1) * rows).collect())
}

/// GPT-2's former table (`full` the whole shape).
fn gpt2_rule(name: &str, full: &[usize], vocab: usize, t: usize, tp: usize) -> Rule {
    let ends = |s: &str| name.ends_with(s);
    if ends("wte.weight") {
        return vocab_rows(vocab, t, tp);
    }
    if ends("attn.c_attn.weight") || ends("attn.c_attn.bias") {
        let c = full[0] / 3;
        let p = part(c, t, tp);
        return Rule::Rows((0..3).map(|k| k * c + p.start..k * c + p.end).collect());
    }
    if ends("mlp.c_fc.weight") || ends("mlp.c_fc.bias") {
        return Rule::Rows(vec![part(full[0], t, tp)]);
    }
    if ends("attn.c_proj.weight") || ends("mlp.c_proj.weight") {
        return Rule::Cols(part(full[1], t, tp));
    }
    Rule::Full
}

/// Llama's former table.
fn llama_rule(cfg: &LlamaConfig, name: &str, full: &[usize], t: usize, tp: usize) -> Rule {
    let ends = |s: &str| name.ends_with(s);
    if ends("embed_tokens.weight") || name == "lm_head.weight" {
        return vocab_rows(cfg.vocab_size, t, tp);
    }
    let kv = [
        "k_proj.weight",
        "v_proj.weight",
        "k_proj.bias",
        "v_proj.bias",
    ];
    if kv.iter().any(|s| ends(s)) {
        return if cfg.n_kv_head >= tp {
            Rule::Rows(vec![part(full[0], t, tp)])
        } else {
            Rule::Full
        };
    }
    let rows = [
        "q_proj.weight",
        "q_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
    ];
    if rows.iter().any(|s| ends(s)) {
        return Rule::Rows(vec![part(full[0], t, tp)]);
    }
    if ends("o_proj.weight") || ends("down_proj.weight") {
        return Rule::Cols(part(full[1], t, tp));
    }
    Rule::Full
}

fn layout_only() -> EngineConfig {
    EngineConfig {
        defer_init: true,
        ..Default::default()
    }
}

/// The whole model's shapes by name.
fn whole_shapes(blocks: Vec<Box<dyn Block>>) -> HashMap<String, Vec<usize>> {
    let e = Engine::new(blocks, &Device::Cpu, layout_only()).unwrap();
    e.layout()
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect()
}

/// On every rank of `tp`: every parameter's declared rule and whole shape
/// against the table's and the one-rank engine's.
fn check(
    what: &str,
    tp: usize,
    whole: HashMap<String, Vec<usize>>,
    blocks: impl Fn(&Tp) -> Vec<Box<dyn Block>> + Send + Sync + 'static,
    table: impl Fn(&str, &[usize], usize, usize) -> Rule,
) {
    // Per rank: (name, rule, whole shape) as declared.
    let ranks = phalanx_comm::threads::run(tp, move |pg| {
        let t = Tp::new(pg, false);
        let e = Engine::new(blocks(&t), &Device::Cpu, layout_only()).unwrap();
        e.layout()
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.rule(t.rank(), tp), p.full_shape(tp)))
            .collect::<Vec<_>>()
    });
    for (rank, params) in ranks.iter().enumerate() {
        assert_eq!(params.len(), whole.len(), "{what} tp {tp}: parameter count");
        for (name, rule, full) in params {
            assert_eq!(
                Some(full),
                whole.get(name),
                "{what} tp {tp}: whole shape of {name}"
            );
            assert_eq!(
                rule,
                &table(name, full, rank, tp),
                "{what} tp {tp} rank {rank}: rule of {name}"
            );
        }
        // The placements are not all `Replicate`.
        assert!(
            params.iter().any(|p| p.1 != Rule::Full),
            "{what} tp {tp}: nothing split"
        );
    }
}

#[test]
fn gpt2_placements_give_the_former_rules() {
    for tp in [2, 3] {
        // 6 heads of 2, a vocabulary that tp 2 and 3 pad (256 -> 258).
        let cfg = Gpt2Config::new(2, 6, 12, 256, 16);
        let whole = whole_shapes(gpt2::blocks(&cfg).unwrap());
        check(
            "gpt2",
            tp,
            whole,
            move |t| gpt2::blocks_tp(&cfg, Some(t.clone())).unwrap(),
            |n, f, t, tp| gpt2_rule(n, f, cfg.vocab_size, t, tp),
        );
    }
}

#[test]
fn llama_placements_give_the_former_rules() {
    for tp in [2, 3] {
        for (kv, bias, tied) in [(tp, false, false), (1, false, true), (tp, true, true)] {
            // 6 heads of 4; kv heads split (tp of them) or replicated (1).
            let mut cfg = LlamaConfig::new(2, 6, kv, 24, 48, 250, 16);
            cfg.qkv_bias = bias;
            cfg.tie_word_embeddings = tied;
            let whole = whole_shapes(llama::blocks(&cfg).unwrap());
            check(
                &format!("llama (kv {kv}, bias {bias}, tied {tied})"),
                tp,
                whole,
                move |t| llama::tp::blocks_tp(&cfg, t).unwrap(),
                |n, f, t, tp| llama_rule(&cfg, n, f, t, tp),
            );
        }
    }
}
