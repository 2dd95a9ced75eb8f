//! A skipped step leaves the compression hooks as they were: under fp16 an
//! overflow at step K skips the step on every rank, and the hook's state
//! (int8's and top-k's error-feedback residuals, top-k's velocity and
//! warm-up count, PowerSGD's Q, residual and count) goes back to what it
//! was before the step. The run then goes on exactly as a run that never
//! saw step K: the same later steps, the same parameters and the same hook
//! state, to the bit (the scale is not halved: one overflow is within
//! `fp16.hysteresis = 2`). Kept, the state of the overflowing step would
//! carry its inf or NaN into every later step, each skipped in turn.

use crate::common;
use common::*;
use phalanx::config::TrainConfig;
use phalanx_models::gpt2::train::{self, GptRun};

const STEPS: usize = 8;
const K: usize = 3;

/// What one rank did: skipped flags, losses, final parameters, hook state.
struct Trace {
    skipped: Vec<bool>,
    losses: Vec<f32>,
    params: Vec<f32>,
    state: Vec<(String, Vec<f32>)>,
}

/// Run `steps` (indices: the data and learning rate follow them) on 2
/// ranks (threads); with `overflow`, dp rank 1 overflows at step K.
fn drive(cfg: TrainConfig, steps: Vec<usize>, overflow: bool) -> Vec<Trace> {
    let loader = loader(cfg.seq_len().unwrap());
    phalanx_comm::threads::run(2, move |pg| {
        let mut t = train::trainer(&cfg, pg, loader.clone(), &GptRun::default()).unwrap();
        if overflow {
            phalanx::fault::inject_overflow(K, 1);
        }
        let mut tr = Trace {
            skipped: Vec::new(),
            losses: Vec::new(),
            params: Vec::new(),
            state: Vec::new(),
        };
        for &k in &steps {
            let s = t.step(k).unwrap();
            tr.skipped.push(s.skipped);
            tr.losses.push(s.loss);
        }
        phalanx::fault::clear();
        tr.params = t.full_params().unwrap();
        tr.state = t.strategy().hook_state();
        tr
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn an_overflow_skips_one_step_and_leaves_the_hook_state_as_it_was() {
    let base = [
        "train.precision=fp16",
        "fp16.initial_scale_power=12",
        "fp16.hysteresis=2",
        "optim.schedule=constant",
        "parallel.topk_ratio=0.1",
        "parallel.powersgd_start_iter=1",
        "parallel.check_params_every=1",
    ];
    let cases: [(&str, &[&str]); 7] = [
        ("int8", &["parallel.comm_hook=int8"]),
        (
            "top-k",
            &[
                "parallel.comm_hook=topk",
                "parallel.topk_warmup_steps=0",
                "parallel.topk_freeze_variance=false",
            ],
        ),
        (
            "top-k with DGC momentum (SGD)",
            &[
                "parallel.comm_hook=topk",
                "parallel.topk_warmup_steps=2",
                "parallel.topk_momentum=0.9",
                "optim.name=sgd",
                "optim.momentum=0",
            ],
        ),
        (
            "top-k with AdamW (frozen variance)",
            &["parallel.comm_hook=topk", "parallel.topk_warmup_steps=2"],
        ),
        ("PowerSGD", &["parallel.comm_hook=powersgd"]),
        (
            "int8 under ZeRO-2",
            &["parallel.comm_hook=int8", "zero_optimization.stage=2"],
        ),
        (
            "ZeRO++ qgZ (int8 under ZeRO-3)",
            &[
                "zero_optimization.stage=3",
                "zero_optimization.zero_quantized_gradients=true",
            ],
        ),
    ];
    for (name, sets) in cases {
        let e: Vec<String> = base.iter().chain(sets).map(|s| s.to_string()).collect();
        let cfg = config(2, 1, &e);
        let hit = drive(cfg.clone(), (0..STEPS).collect(), true);
        let reference = drive(cfg, (0..STEPS).filter(|&s| s != K).collect(), false);
        for (r, (h, re)) in hit.iter().zip(&reference).enumerate() {
            let flags: Vec<bool> = (0..STEPS).map(|s| s == K).collect();
            assert_eq!(
                h.skipped, flags,
                "{name}, rank {r}: only step {K} is skipped"
            );
            assert!(re.skipped.iter().all(|s| !s));
            let later: Vec<f32> = (0..STEPS)
                .filter(|&s| s != K)
                .map(|s| h.losses[s])
                .collect();
            assert_eq!(bits(&later), bits(&re.losses), "{name}, rank {r}: losses");
            assert!(
                h.params.iter().all(|x| x.is_finite()),
                "{name}, rank {r}: parameters"
            );
            assert!(
                bits(&h.params) == bits(&re.params),
                "{name}, rank {r}: the parameters differ from the run without step {K}"
            );
            assert!(!h.state.is_empty(), "{name}: the hook keeps state");
            assert_eq!(
                h.state.len(),
                re.state.len(),
                "{name}, rank {r}: hook state"
            );
            for ((n, v), (rn, rv)) in h.state.iter().zip(&re.state) {
                assert_eq!(n, rn);
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "{name}, rank {r}: {n} holds inf or NaN"
                );
                assert!(bits(v) == bits(rv), "{name}, rank {r}: {n} differs");
            }
        }
    }
}
