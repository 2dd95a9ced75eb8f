//! The planner's parameter counts are what the blocks declare: for GPT-2
//! (a vocabulary that tp 2 and 4 pad), Llama (kv heads split, and
//! replicated past their number; a tp size it refuses) and Qwen2 (q / k / v
//! biases, tied and untied), through `phalanx plan`'s path
//! (`family::plan_shape`), at every tp size it declares, each block's
//! per-rank count equals that block's elements in the layout the engine
//! builds on every rank of a real tensor-parallel group, and the whole
//! count the one-rank engine's; the sizes declared are the ones the
//! blocks accept. A block that declares another placement changes the
//! planner's count and memory; layers that declare different parameters
//! are refused; a 70B Llama is declared without allocating its parameters.

use candle_core::{Device, Tensor};
use candle_nn::{Init, VarBuilder};
use phalanx::config::TrainConfig;
use phalanx::engine::{Block, Engine, EngineConfig, FnBlock};
use phalanx::placement::{declare, Placement};
use phalanx::plan::{memory, Declarations, Layout, ModelShape};
use phalanx::tp::Tp;
use phalanx_models::common::plan::declared;
use phalanx_models::family;
use phalanx_models::llama::LlamaConfig;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;

fn cfg(sets: &[&str]) -> TrainConfig {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    family::build(None, &sets).unwrap()
}

/// Each block's elements in the layout an engine of `blocks` builds.
fn block_counts(blocks: phalanx::Result<Vec<Box<dyn Block>>>) -> phalanx::Result<Vec<usize>> {
    let ecfg = EngineConfig {
        defer_init: true,
        ..Default::default()
    };
    let e = Engine::new(blocks?, &Device::Cpu, ecfg)?;
    let l = e.layout();
    assert_eq!(
        l.blocks().iter().map(|b| b.range.len()).sum::<usize>(),
        e.num_params()
    );
    Ok(l.blocks().iter().map(|b| b.range.len()).collect())
}

/// The planner's count of each block on one of `tp` ranks.
fn planned(m: &ModelShape, tp: usize) -> Vec<usize> {
    let p = m.rank_params(tp);
    let mut v = vec![p.embedding];
    v.extend(std::iter::repeat_n(p.layer, m.n_layer));
    v.push(p.head);
    v
}

#[test]
fn per_rank_counts_are_the_engines_layouts() {
    let cases: &[(&str, &[&str])] = &[
        // 257 rows: padded at tp 2 and 4.
        (
            "gpt2",
            &[
                "model.arch=gpt2",
                "model.n_layer=2",
                "model.n_head=4",
                "model.n_embd=16",
                "model.vocab_size=257",
                "model.block_size=16",
            ],
        ),
        // 4 heads over 2 kv heads: split at tp 2, replicated at tp 4.
        (
            "llama",
            &[
                "model.arch=llama",
                "model.n_layer=2",
                "model.n_head=4",
                "model.n_kv_head=2",
                "model.n_embd=32",
                "model.intermediate_size=40",
                "model.vocab_size=250",
                "model.block_size=16",
            ],
        ),
        // 6 heads over 3 kv heads: tp 2 neither splits nor replicates them.
        (
            "llama 3 kv heads",
            &[
                "model.arch=llama",
                "model.n_layer=3",
                "model.n_head=6",
                "model.n_kv_head=3",
                "model.n_embd=24",
                "model.intermediate_size=48",
                "model.vocab_size=250",
                "model.block_size=16",
                "model.tie_word_embeddings=true",
            ],
        ),
        (
            "qwen2 tied",
            &[
                "model.arch=qwen2",
                "model.n_layer=2",
                "model.n_head=4",
                "model.n_kv_head=2",
                "model.n_embd=32",
                "model.intermediate_size=40",
                "model.vocab_size=254",
                "model.block_size=16",
                "model.tie_word_embeddings=true",
            ],
        ),
        (
            "qwen2 untied",
            &[
                "model.arch=qwen2",
                "model.n_layer=2",
                "model.n_head=4",
                "model.n_kv_head=1",
                "model.n_embd=32",
                "model.intermediate_size=40",
                "model.vocab_size=256",
                "model.block_size=16",
                "model.tie_word_embeddings=false",
            ],
        ),
    ];
    let (mut padded, mut replicated_kv, mut refused) = (false, false, false);
    for (what, sets) in cases {
        let c = cfg(sets);
        let f = family::of(&c).unwrap();
        let m = family::plan_shape(&c).unwrap();
        // One rank: the whole model.
        let whole = block_counts(f.blocks(&c)).unwrap();
        assert_eq!(whole, planned(&m, 1), "{what}: whole model");
        assert_eq!(whole.iter().sum::<usize>(), m.num_params(), "{what}");
        for tp in (2..=m.n_head).filter(|t| m.n_head.is_multiple_of(*t)) {
            let c2 = c.clone();
            let ranks = phalanx_comm::threads::run(tp, move |pg| {
                let f = family::of(&c2).unwrap();
                block_counts(f.tp_blocks(&c2, &Tp::new(pg, false))).ok()
            });
            assert_eq!(
                m.tp_ok(tp),
                ranks.iter().all(|r| r.is_some()),
                "{what} tp {tp}: declared for the planner iff the blocks build"
            );
            if !m.tp_ok(tp) {
                refused = true;
                continue;
            }
            for (r, counts) in ranks.iter().enumerate() {
                assert_eq!(
                    counts.as_ref().unwrap(),
                    &planned(&m, tp),
                    "{what} tp {tp} rank {r}"
                );
            }
            padded |= !m.vocab_size.is_multiple_of(tp);
            replicated_kv |=
                m.declared(tp).layer.iter().any(|p| {
                    p.name.ends_with("k_proj.weight") && p.placement == Placement::Replicate
                });
        }
    }
    assert!(padded && replicated_kv && refused, "the cases cover padding ({padded}), replicated kv heads ({replicated_kv}) and a refused size ({refused})");
}

fn pass(x: &Tensor) -> candle_core::Result<Tensor> {
    Ok(x.clone())
}

/// A block declaring `w` (this rank's `shape`) placed `p`, and a tied
/// table of 10 rows (4 wide) padded over tp.
fn toy(tp: usize, shape: (usize, usize), p: Placement) -> Vec<Box<dyn Block>> {
    let table = move |vb: VarBuilder| -> candle_core::Result<_> {
        let rows = 10usize.div_ceil(tp);
        declare(
            &vb,
            (rows, 4),
            "wte",
            Init::Const(0.0),
            Placement::vocab(10),
        )?;
        Ok(pass)
    };
    let layer = move |vb: VarBuilder| -> candle_core::Result<_> {
        declare(&vb, shape, "w", Init::Const(0.0), p)?;
        Ok(pass)
    };
    vec![
        Box::new(FnBlock::new(table)),
        Box::new(FnBlock::new(layer)),
        Box::new(FnBlock::new(table)),
    ]
}

#[test]
fn a_declared_placement_decides_the_count() {
    // The same whole (8, 8) matrix on 2 ranks: split by rows, or replicated.
    let split = declared(&toy(2, (4, 8), Placement::rows()), 2).unwrap();
    let whole = declared(&toy(2, (8, 8), Placement::Replicate), 2).unwrap();
    assert_eq!(
        (split.layer[0].shape.clone(), whole.layer[0].shape.clone()),
        (vec![8, 8], vec![8, 8])
    );
    assert_eq!((split.per_rank().layer, whole.per_rank().layer), (32, 64));
    // The table: 5 rows of the padded 10 each, tied (the head owns none).
    assert_eq!((split.per_rank().embedding, split.per_rank().head), (20, 0));
    assert_eq!(split.whole(), whole.whole());
    // The planner's memory follows: 3 layers of 32 more elements, 4 bytes
    // each for the parameters.
    let at1 = declared(&toy(1, (8, 8), Placement::Replicate), 1).unwrap();
    let shape =
        |d| ModelShape::gpt2(3, 2, 4, 10, 8).with_params(Declarations::new(vec![at1.clone(), d]));
    let mut l = Layout::ddp(1, 1, 1);
    l.tp = 2;
    let params = |m: &ModelShape| memory::per_rank(m, &l).params;
    assert_eq!(params(&shape(whole)) - params(&shape(split)), 3 * 32 * 4);
}

#[test]
fn layers_that_declare_different_parameters_are_refused() {
    let mut blocks = toy(2, (4, 8), Placement::rows());
    blocks.insert(2, toy(2, (8, 8), Placement::Replicate).remove(1));
    let e = declared(&blocks, 2).unwrap_err().to_string();
    assert!(e.contains("layer 1"), "{e}");
}

/// The largest allocation this thread asked for while watching (`None`:
/// not watching).
struct Watch;

thread_local! {
    static LARGEST: Cell<Option<usize>> = const { Cell::new(None) };
}

fn note(n: usize) {
    let _ = LARGEST.try_with(|c| {
        if let Some(m) = c.get() {
            c.set(Some(m.max(n)));
        }
    });
}

unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, l: AllocLayout) -> *mut u8 {
        note(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: AllocLayout) -> *mut u8 {
        note(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: AllocLayout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: AllocLayout, n: usize) -> *mut u8 {
        note(n);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static WATCH: Watch = Watch;

#[test]
fn a_70b_llama_is_declared_without_allocating_it() {
    // Llama 2 70B's shape: 80 layers, 64 heads over 8 kv heads, 8192 wide.
    let c = LlamaConfig::new(80, 64, 8, 8192, 28672, 32000, 4096);
    LARGEST.with(|l| l.set(Some(0)));
    let m = c.plan_shape(4096).unwrap();
    let largest = LARGEST.with(|l| l.take()).unwrap();
    assert_eq!(m.num_params(), c.num_params());
    assert!(m.num_params() > 68_000_000_000);
    // The token table alone is 1 GiB of f32; nothing near it was allocated.
    assert!(largest < 1 << 20, "largest allocation {largest} bytes");
    // kv heads split up to tp 8, replicated past it.
    let k = |tp: usize| {
        m.declared(tp)
            .layer
            .iter()
            .find(|p| p.name.ends_with("k_proj.weight"))
            .unwrap()
            .placement
    };
    assert_eq!((k(8), k(16)), (Placement::rows(), Placement::Replicate));
}
