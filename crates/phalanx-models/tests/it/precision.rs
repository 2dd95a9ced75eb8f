//! Mixed precision through the trainer: bf16 and fp16 runs track the fp32
//! run; fp16 dynamic loss scaling skips an overflowing step on every rank,
//! halves the scale, and afterwards equals a run that skipped that batch;
//! gradients reduced in bf16 track fp32 reduction.

use crate::common;
use common::*;
use phalanx::config::TrainConfig;
use phalanx_models::gpt2::train::{self, GptRun};

/// Loss and parameter distance of `out` (every rank) to `base`.
fn worst(out: &[RankResult], base: &RankResult) -> (f64, f64) {
    let mut dl = 0f64;
    let mut dp = 0f64;
    for o in out {
        assert_eq!(o.losses.len(), base.losses.len());
        for (a, b) in o.losses.iter().zip(&base.losses) {
            dl = dl.max(((a - b) / b).abs() as f64);
        }
        dp = dp.max(rel(&o.params, &base.params));
    }
    (dl, dp)
}

/// Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 =
/// 0.2% per value), fp16 11 bits (0.05%); six AdamW steps of lr 0.01 move
/// each parameter by up to ~0.06, so rounding that flips the sign of small
/// gradients can move a parameter by one lr: norm-relative parameter
/// differences of a few percent (bf16) and below 1% (fp16) are rounding,
/// while a wrong gradient (a missing scale, a lost block) gives O(1).
#[test]
fn bf16_and_fp16_track_fp32_under_ddp_and_zero_1_2_3() {
    let base = run(1, config(1, 1, &[])).remove(0);
    for (prec, loss_tol, param_tol) in [("bf16", 0.02, 0.08), ("fp16", 0.005, 0.02)] {
        for (what, extra) in [
            ("DDP", "zero_optimization.stage=0"),
            ("ZeRO-1", "zero_optimization.stage=1"),
            ("ZeRO-2", "zero_optimization.stage=2"),
            ("ZeRO-3", "zero_optimization.stage=3"),
        ] {
            let e = vec![format!("train.precision={prec}"), extra.to_string()];
            let out = run(2, config(2, 1, &e));
            let (dl, dp) = worst(&out, &base);
            assert!(
                dl < loss_tol && dp < param_tol,
                "{prec} {what}: loss {dl:e}, params {dp:e}"
            );
            // Replicas stay identical.
            assert_eq!(out[0].params, out[1].params, "{prec} {what}");
        }
    }
}

/// bf16 against bf16 under plain SGD: the layouts sum bf16 partial results
/// in another order (2^-8 relative rounding each), which moved the losses
/// by <= 1.8e-4, the gradient norms by <= 1.2e-2 and c_attn by <= 2.6e-4
/// here; the bounds leave about 4-10x of that. A gradient off by a factor
/// moves the norm by that factor.
const BF16_LOSS: f32 = 2e-3;
const BF16_GRAD: f32 = 5e-2;
const BF16_PARAM: f64 = 3e-3;

#[test]
fn bf16_under_tensor_and_pipeline_parallel() {
    let shape = ["model.n_head=6", "model.n_embd=36"];
    let mk = |extra: &[&str]| -> Vec<String> {
        shape.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    for (what, world, dp, accum, extra) in [
        (
            "tp 2 + sp",
            2,
            1,
            1,
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "model.block_size=16",
            ][..],
        ),
        ("pp 2, 1f1b", 2, 1, 2, &["parallel.pp=2"][..]),
    ] {
        // The bf16 1-rank run of the same shape (sequence parallel needs a
        // context divisible by tp): the layouts differ from it only in how
        // bf16 partial results are summed.
        let mut plain: Vec<&str> = extra
            .iter()
            .copied()
            .filter(|s| s.starts_with("model."))
            .collect();
        plain.push("train.precision=bf16");
        // Plain SGD: parameters move by lr x gradient, so their difference
        // is the gradients' (AdamW would turn sign flips of tiny gradients
        // into lr-sized steps).
        let sgd = plain_sgd();
        plain.extend(sgd.iter().map(|s| s.as_str()));
        let base = run(1, config(1, 1, &mk(&plain))).remove(0);
        let mut e = mk(extra);
        e.extend(sgd.iter().cloned());
        e.push("train.precision=bf16".into());
        let out = run(world, config(dp, accum, &e));
        let (mut dl, mut dg) = (0f32, 0f32);
        for o in &out {
            for (a, b) in o.losses.iter().zip(&base.losses) {
                dl = dl.max(((a - b) / b).abs());
            }
            for (a, b) in o.grad_norms.iter().zip(&base.grad_norms) {
                dg = dg.max(((a - b) / b).abs());
            }
        }
        let dw = rel(
            &out[0].named["transformer.h.0.attn.c_attn.weight"],
            &base.named["transformer.h.0.attn.c_attn.weight"],
        );
        assert!(
            base.losses[base.losses.len() - 1] < base.losses[0],
            "{what}: the bf16 SGD run should learn: {:?}",
            base.losses
        );
        assert!(
            dl < BF16_LOSS && dg < BF16_GRAD && dw < BF16_PARAM,
            "{what}: bf16 vs bf16 1-rank: loss {dl:e}, grad norm {dg:e}, c_attn {dw:e}"
        );
    }
}

/// One run driven step by step on `world` ranks: `steps` lists the step
/// indices to run (data and learning rate follow the index), `inject` makes
/// data-parallel rank r overflow at step k. Returns each rank's losses,
/// skipped flags, loss scales and final parameters.
type Trace = (Vec<f32>, Vec<bool>, Vec<f64>, Vec<f32>);
fn drive(
    world: usize,
    cfg: TrainConfig,
    steps: Vec<usize>,
    inject: Option<(usize, usize)>,
) -> Vec<Trace> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(world, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        if let Some((k, r)) = inject {
            phalanx::fault::inject_overflow(k, r);
        }
        let mut tr: Trace = Default::default();
        for &k in &steps {
            let s = t.step(k).unwrap();
            tr.0.push(s.loss);
            tr.1.push(s.skipped);
            tr.2.push(s.loss_scale);
        }
        tr.3 = t.full_params().unwrap();
        tr
    })
}

#[test]
fn fp16_overflow_skips_the_step_everywhere_and_halves_the_scale() {
    let e: Vec<String> = [
        "train.precision=fp16",
        "fp16.hysteresis=1",
        "fp16.initial_scale_power=12",
        "optim.schedule=constant",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for stage in [0, 3] {
        let mut e = e.clone();
        e.push(format!("zero_optimization.stage={stage}"));
        let cfg = config(2, 1, &e);
        let k = 2;
        let hit = drive(2, cfg.clone(), (0..STEPS).collect(), Some((k, 1)));
        let skip: Vec<usize> = (0..STEPS).filter(|&s| s != k).collect();
        let reference = drive(2, cfg, skip, None);
        for (r, (h, re)) in hit.iter().zip(&reference).enumerate() {
            let flags: Vec<bool> = (0..STEPS).map(|s| s == k).collect();
            assert_eq!(h.1, flags, "stage {stage} rank {r}: skipped flags");
            assert_eq!(
                h.2[k], 4096.0,
                "stage {stage}: the overflowing step ran at 2^12"
            );
            assert_eq!(
                h.2[k + 1],
                2048.0,
                "stage {stage}: the scale is halved after it"
            );
            assert!(re.2.iter().all(|&s| s == 4096.0));
            // Up to step k the runs are the same run, bit for bit.
            assert_eq!(
                h.0[..k],
                re.0[..k],
                "stage {stage} rank {r}: losses before the overflow"
            );
            // Afterwards: the same as never having seen step k's batch.
            // The scales differ by a power of two, which fp16 rounding does
            // not see except for gradients at the subnormal edge (below
            // 2^-14 / scale), which then round differently: 1e-3
            // norm-relative allows that and nothing else (an update made
            // from the overflowing step's inf/NaN gradients gives NaN; a
            // missed unscale, a factor of 2048).
            let e = rel(&h.3, &re.3);
            assert!(
                e < 1e-3,
                "stage {stage} rank {r}: parameters differ by {e:e}"
            );
            let later: Vec<f32> =
                h.0.iter()
                    .enumerate()
                    .filter(|(s, _)| *s != k)
                    .map(|(_, l)| *l)
                    .collect();
            for (a, b) in later.iter().zip(&re.0) {
                assert!(
                    ((a - b) / b).abs() < 1e-3,
                    "stage {stage} rank {r}: loss {a} vs {b}"
                );
            }
        }
        assert_eq!(
            hit[0].3, hit[1].3,
            "stage {stage}: ranks hold identical parameters"
        );
    }
}

#[test]
fn gradients_reduced_in_bf16_track_fp32_and_send_half_the_bytes() {
    let base = run(1, config(1, 1, &[])).remove(0);
    let out = run(2, config(2, 1, &["train.reduce_dtype=bf16".into()]));
    let (dl, dp) = worst(&out, &base);
    assert!(
        dl < 0.01 && dp < 0.05,
        "reduce in bf16: loss {dl:e}, params {dp:e}"
    );
    let (f32b, bf16b) = (
        step_bytes(&["train.reduce_dtype=fp32"]),
        step_bytes(&["train.reduce_dtype=bf16"]),
    );
    // Gradients dominate a DDP step's traffic: bf16 halves them.
    assert!(
        (bf16b as f64) < 0.6 * f32b as f64,
        "bytes per step: fp32 {f32b}, bf16 {bf16b}"
    );
}

/// Bytes rank 0 sends in its second step, 2 ranks.
fn step_bytes(extra: &[&str]) -> u64 {
    let e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let cfg = config(2, 1, &e);
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        t.step(0).unwrap();
        t.step(1).unwrap().comm_bytes
    })[0]
}

/// ZeRO-3 gathers parameters in the compute dtype: the block casts them to
/// it anyway, so training is that of DDP in bf16, with fewer bytes.
#[test]
fn zero3_gathers_in_the_compute_dtype() {
    let ddp = run(2, config(2, 1, &["train.precision=bf16".into()]));
    let z3 = run(
        2,
        config(
            2,
            1,
            &[
                "train.precision=bf16".into(),
                "zero_optimization.stage=3".into(),
            ],
        ),
    );
    let (dl, dp) = worst(&z3, &ddp[0]);
    assert!(
        dl < 1e-4 && dp < 1e-3,
        "ZeRO-3 vs DDP in bf16: loss {dl:e}, params {dp:e}"
    );
    let f = step_bytes(&["zero_optimization.stage=3"]);
    let h = step_bytes(&["zero_optimization.stage=3", "train.precision=bf16"]);
    // Two gathers (forward, backward) and one reduce-scatter per block: the
    // gathers at half size give 2/3 of the bytes.
    assert!(
        (h as f64) < 0.75 * f as f64,
        "ZeRO-3 bytes per step: fp32 {f}, bf16 {h}"
    );
}
