//! GPT-2 blocks built with a bf16 / f16 `VarBuilder` over f32 master
//! weights (what `train.precision = bf16 | fp16` does): the loss stays f32
//! and close to the f32 build's, and the f32 master Vars' gradients (through
//! the casts) point the same way as the f32 gradients.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use phalanx::engine::{Block, BlockModule, Ctx};
use phalanx::tp::Tp;
use phalanx_models::gpt2::{blocks, blocks_tp, Gpt2Config};

fn tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<u32> = (0..b * t)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

/// The f32 master Vars of `blocks`, initialised by building them once in f32.
fn master_vars(blocks: &[Box<dyn Block>]) -> HashMap<String, Var> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    for b in blocks {
        b.build(vb.clone()).unwrap();
    }
    let data = vm.data().lock().unwrap();
    data.clone()
}

/// Build every block with `dtype` over the master Vars (a half VarBuilder
/// hands each block `var.to_dtype(dtype)`), run the model on (x, y) and
/// backprop: (loss, gradient of each master Var, activation dtypes).
fn loss_and_grads(
    blocks: &[Box<dyn Block>],
    vars: &HashMap<String, Var>,
    dtype: DType,
    x: &Tensor,
    y: &Tensor,
) -> (f32, HashMap<String, Tensor>, Vec<DType>) {
    let ts: HashMap<String, Tensor> = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let vb = VarBuilder::from_tensors(ts, dtype, &Device::Cpu);
    let modules: Vec<Box<dyn BlockModule>> = blocks
        .iter()
        .map(|b| b.build(vb.clone()).unwrap())
        .collect();
    let ctx = Ctx {
        targets: Some(y),
        train: true,
    };
    let mut h = x.clone();
    let mut dtypes = vec![];
    for m in &modules {
        h = m.forward(&h, &ctx).unwrap();
        dtypes.push(h.dtype());
    }
    let loss = h.to_scalar::<f32>().unwrap();
    let g = h.backward().unwrap();
    let grads = vars
        .iter()
        .map(|(k, v)| {
            let gv = g.get(v.as_tensor()).expect("a master Var has no gradient");
            assert_eq!(gv.dtype(), DType::F32, "{k}: master gradient dtype");
            (k.clone(), gv.clone())
        })
        .collect();
    (loss, grads, dtypes)
}

fn cosine(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    let dot: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Loss within `loss_tol` (relative) and every master gradient with cosine
/// similarity above `min_cos`.
fn compare(
    blocks: &[Box<dyn Block>],
    vars: &HashMap<String, Var>,
    dtype: DType,
    x: &Tensor,
    y: &Tensor,
    min_cos: f64,
) -> (f32, f32) {
    let (l32, g32, d32) = loss_and_grads(blocks, vars, DType::F32, x, y);
    let (lh, gh, dh) = loss_and_grads(blocks, vars, dtype, x, y);
    assert!(d32.iter().all(|&d| d == DType::F32));
    // Embedding and layers in the compute dtype, the head's loss in f32.
    let n = dh.len();
    assert!(dh[..n - 1].iter().all(|&d| d == dtype), "{dh:?}");
    assert_eq!(dh[n - 1], DType::F32, "loss dtype");
    let rel = ((lh - l32) / l32).abs();
    eprintln!("{dtype:?}: loss {lh} vs f32 {l32} (relative {rel:.2e})");
    assert!(rel < 0.01, "{dtype:?} loss {lh} vs f32 {l32}");
    let mut worst = (f64::INFINITY, String::new());
    for (k, g) in &g32 {
        let c = cosine(&gh[k], g);
        if c < worst.0 {
            worst = (c, k.clone());
        }
    }
    eprintln!(
        "{dtype:?}: lowest gradient cosine {:.5} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0 > min_cos,
        "{dtype:?}: cosine {} for {}",
        worst.0,
        worst.1
    );
    (l32, lh)
}

#[test]
fn gpt2_bf16_and_f16_blocks_match_f32() {
    let cfg = Gpt2Config::new(2, 4, 128, 256, 64);
    let bs = blocks(&cfg).unwrap();
    let vars = master_vars(&bs);
    let (x, y) = (tokens(4, 64, 256, 1), tokens(4, 64, 256, 2));
    compare(&bs, &vars, DType::BF16, &x, &y, 0.99);
    compare(&bs, &vars, DType::F16, &x, &y, 0.999);
}

#[test]
fn gpt2_bf16_generation_logits_are_f32() {
    let cfg = Gpt2Config::new(1, 2, 32, 64, 16);
    let bs = blocks(&cfg).unwrap();
    let vars = master_vars(&bs);
    let ts: HashMap<String, Tensor> = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let vb = VarBuilder::from_tensors(ts, DType::BF16, &Device::Cpu);
    let ctx = Ctx {
        targets: None,
        train: false,
    };
    let mut h = tokens(2, 16, 64, 3);
    for b in &bs {
        h = b.build(vb.clone()).unwrap().forward(&h, &ctx).unwrap();
    }
    assert_eq!(h.dtype(), DType::F32);
    assert_eq!(h.dims(), &[2, 16, 64]);
}

/// Tensor parallel (2 ranks as threads, with and without sequence
/// parallelism) in bf16: the collectives, the vocabulary-parallel embedding
/// and cross-entropy take half tensors; each rank's loss and master
/// gradients match the same rank's f32 run.
#[test]
fn gpt2_tensor_parallel_bf16_matches_f32() {
    for sp in [false, true] {
        let out = phalanx_comm::threads::run(2, move |pg| {
            // vocab 255: padded to 256 over the ranks.
            let cfg = Gpt2Config::new(1, 4, 64, 255, 32);
            let bs = blocks_tp(&cfg, Some(Tp::new(pg, sp))).unwrap();
            let vars = master_vars(&bs);
            let (x, y) = (tokens(2, 32, 255, 4), tokens(2, 32, 255, 5));
            compare(&bs, &vars, DType::BF16, &x, &y, 0.99)
        });
        assert_eq!(out.len(), 2);
    }
}
