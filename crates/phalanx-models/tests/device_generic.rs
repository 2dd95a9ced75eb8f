//! The device-generic path on the CPU. With Phalanx's CPU kernels off
//! (`PHALANX_HOST_KERNELS=0`, here `phalanx::ops::set_host_kernels`), every
//! op takes the branch a CUDA device takes: candle's composed ops (matmul,
//! softmax, layer norm ...), no direct layers, the tensor-parallel
//! exchanges building their buffers on the tensor's device, and the
//! vocabulary-parallel loss in candle's ops. Trained that way under each strategy,
//! Llama and GPT-2 reproduce their 1-rank runs on the CPU kernels, as
//! `scripts/gpu_check.sh` checks the same strategies on a GPU.
//!
//! One test per binary: the switch is process-wide.

mod common;
use common::llama::{self, STEPS};
use common::{assert_named_match, RankResult};
use phalanx::engine::flat::deferred_reads;
use phalanx::engine::resident::{downloads, uploads};
use phalanx::ops::{kernel_runs, set_host_kernels};
use phalanx::optim::device::{read_back, steps as device_opt_steps};
use phalanx_models::llama::train::LlamaRun;

/// The strategies run on the generic path: (what, world, dp, accum, overrides).
fn strategies() -> Vec<(&'static str, usize, usize, usize, Vec<&'static str>)> {
    vec![
        ("1 rank", 1, 1, 1, vec![]),
        ("DDP 2 ranks", 2, 2, 1, vec![]),
        // Buckets of 10 KB: each averaged as the backward completes it.
        (
            "DDP 2 ranks, 2 micro-batches, small buckets",
            2,
            2,
            2,
            vec!["parallel.bucket_mb=0.01"],
        ),
        // Several buckets over the step's held sum of 2 micro-batches.
        (
            "ZeRO-1 2 ranks",
            2,
            2,
            2,
            vec!["zero_optimization.stage=1", "parallel.bucket_mb=0.01"],
        ),
        // 3 ranks: shards of ceil(n / 3) cut the buckets (of 10 KB)
        // unevenly.
        (
            "ZeRO-1 3 ranks",
            3,
            3,
            1,
            vec!["zero_optimization.stage=1", "parallel.bucket_mb=0.01"],
        ),
        (
            "ZeRO-2 2 ranks, 2 micro-batches",
            2,
            2,
            2,
            vec!["zero_optimization.stage=2", "parallel.bucket_mb=0.01"],
        ),
        ("ZeRO-3 2 ranks", 2, 2, 1, vec!["zero_optimization.stage=3"]),
        // 3 ranks: the shards cut blocks unevenly (the reduce-scatter's
        // uneven form); 2 micro-batches summed in the pieces; nothing
        // gathered ahead.
        (
            "ZeRO-3 3 ranks, 2 micro-batches",
            3,
            3,
            2,
            vec![
                "zero_optimization.stage=3",
                "parallel.forward_prefetch=0",
                "parallel.backward_prefetch=0",
            ],
        ),
        // Two blocks gathered ahead, each waited for just before it runs
        // (a started gather runs on the CPU only when waited for, so one
        // read early would be caught), the reduce-scatters waited for a
        // block later.
        (
            "ZeRO-3 2 ranks, 2 blocks ahead, 2 micro-batches",
            2,
            2,
            2,
            vec![
                "zero_optimization.stage=3",
                "parallel.forward_prefetch=2",
                "parallel.backward_prefetch=2",
            ],
        ),
        // The last blocks keep their forward gathers for the backward
        // (a block gathered ahead in the forward, then kept).
        (
            "ZeRO-3, kept gathers, full recompute",
            2,
            2,
            1,
            vec![
                "zero_optimization.stage=3",
                "zero_optimization.stage3_max_reuse_distance=1e9",
                "train.activation_checkpointing=full",
            ],
        ),
        // The shard kept in host memory (offload_param.device = cpu): the
        // host path, each block uploaded for its pass.
        (
            "ZeRO-3, parameters offloaded to the host",
            2,
            2,
            1,
            vec![
                "zero_optimization.stage=3",
                "zero_optimization.offload_param.device=cpu",
            ],
        ),
        // Sharded within pairs, the pieces averaged over the replicas.
        (
            "HYBRID_SHARD 2 x 2",
            4,
            4,
            1,
            vec![
                "parallel.sharding_strategy=HYBRID_SHARD",
                "parallel.hybrid_shard_size=2",
            ],
        ),
        ("tp 2", 2, 1, 1, vec!["parallel.tp=2"]),
        ("pp 2 (1f1b)", 2, 1, 4, vec!["parallel.pp=2"]),
        (
            "pp 2 (zero-bubble)",
            2,
            1,
            4,
            vec!["parallel.pp=2", "parallel.pp_schedule=\"zb-h1\""],
        ),
        // Two chunks per stage, 3 micro-batches: a link carries
        // activations and gradients of several chunks, which its receiver
        // takes in another order than its sender sends them (links post in
        // the sender's).
        (
            "pp 2 (interleaved)",
            2,
            1,
            3,
            vec!["parallel.pp=2", "parallel.pp_schedule=\"interleaved:2\""],
        ),
        // The chunks' dp averages started inside their last backwards:
        // under zero-bubble block by block in the last W pass (buckets of
        // one block), interleaved one bucket per chunk while the other
        // chunk still computes.
        (
            "dp 2 x pp 2 (zero-bubble)",
            4,
            2,
            2,
            vec![
                "parallel.pp=2",
                "parallel.pp_schedule=\"zb-h1\"",
                "parallel.bucket_mb=0.0001",
            ],
        ),
        (
            "dp 2 x pp 2 (interleaved)",
            4,
            2,
            2,
            vec!["parallel.pp=2", "parallel.pp_schedule=\"interleaved:2\""],
        ),
        (
            "dp 2 x pp 2 x tp 2",
            8,
            2,
            2,
            vec!["parallel.pp=2", "parallel.tp=2"],
        ),
        (
            "dp 2 x pp 2, ZeRO-1",
            4,
            2,
            2,
            vec!["parallel.pp=2", "zero_optimization.stage=1"],
        ),
        (
            "full recompute, ZeRO-2",
            2,
            2,
            1,
            vec![
                "train.activation_checkpointing=full",
                "zero_optimization.stage=2",
            ],
        ),
    ]
}

/// GPT-2's strategies on the generic path (6 heads, 36 wide: tp 2 divides it).
fn gpt_strategies() -> Vec<(&'static str, usize, usize, usize, Vec<&'static str>)> {
    vec![
        ("1 rank", 1, 1, 1, vec![]),
        ("DDP 2 ranks", 2, 2, 1, vec![]),
        ("ZeRO-3 2 ranks", 2, 2, 1, vec!["zero_optimization.stage=3"]),
        // The tied embedding's bucket complete only after the embedding.
        (
            "ZeRO-2 2 ranks, small buckets",
            2,
            2,
            1,
            vec!["zero_optimization.stage=2", "parallel.bucket_mb=0.01"],
        ),
        ("tp 2", 2, 1, 1, vec!["parallel.tp=2"]),
        ("pp 2 (1f1b)", 2, 1, 4, vec!["parallel.pp=2"]),
        // Each chunk's dp average started block by block in its last
        // backward, the tied embedding summed over the stages after.
        (
            "dp 2 x pp 2",
            4,
            2,
            2,
            vec!["parallel.pp=2", "parallel.bucket_mb=0.0001"],
        ),
        // Each block's reduce-scatter started in its chunk's last backward;
        // the tied embedding summed over the stages after, then cut.
        (
            "dp 2 x pp 2, ZeRO-1",
            4,
            2,
            2,
            vec![
                "parallel.pp=2",
                "zero_optimization.stage=1",
                "parallel.bucket_mb=0.0001",
            ],
        ),
    ]
}

fn gpt_run(world: usize, dp: usize, accum: usize, extra: &[&str]) -> Vec<RankResult> {
    let mut sets = vec!["model.n_head=6".to_string(), "model.n_embd=36".to_string()];
    sets.extend(extra.iter().map(|s| s.to_string()));
    common::run(world, common::config(dp, accum, &sets))
}

fn llama_run(world: usize, dp: usize, accum: usize, extra: &[&str]) -> Vec<RankResult> {
    llama::run(world, llama::config(dp, accum, extra), LlamaRun::default())
}

/// ZeRO-3 on 2 ranks evaluating every 2 steps on a tenth of the corpus
/// held out: rank 0's validation losses.
fn zero3_val_losses() -> Vec<(usize, f32)> {
    use phalanx::data::{DataLoader, LoaderConfig, TokenData};
    let extra = ["zero_optimization.stage=3", "train.eval_interval=2"];
    let cfg = llama::config(2, 1, &extra);
    let lc = LoaderConfig {
        seq_len: cfg.seq_len().unwrap(),
        val_fraction: 0.1,
        shuffle: true,
        seed: 7,
        vocab_size: Some(256),
    };
    let data = TokenData::from_tokens(common::corpus());
    let loader = std::sync::Arc::new(DataLoader::new(data, lc).unwrap());
    let out = phalanx_comm::threads::run(2, move |pg| {
        let run = LlamaRun::default();
        let (report, _) =
            phalanx_models::llama::train::train(&cfg, pg, loader.clone(), &run).unwrap();
        report.val_losses
    });
    out[0].clone()
}

#[test]
fn every_strategy_on_the_generic_path_reproduces_the_fused_one_rank_run() {
    // The generic path first: no op may take the CPU kernels.
    set_host_kernels(Some(false));
    let host = kernel_runs();
    let mut runs = Vec::new();
    for (what, world, dp, accum, extra) in strategies() {
        // The optimizer's state and step on the device too
        // (optim::DeviceOptimizer): every rank steps every step there.
        let (before, down, up) = (device_opt_steps(), downloads(), uploads());
        let (back, deferred) = (read_back(), deferred_reads());
        runs.push((what, llama_run(world, dp, accum, &extra)));
        let (back, deferred) = (read_back() - back, deferred_reads() - deferred);
        let up = uploads() - up;
        let stepped = device_opt_steps() - before;
        assert!(
            stepped >= world * STEPS,
            "{what}: {stepped} optimizer steps on the device, wanted {world} ranks x {STEPS}"
        );
        // DDP's gradients stay on the device through the optimizer's step:
        // with one data-parallel rank there is nothing to reduce, with two
        // they are averaged where they lie (collective; NCCL on a
        // GPU). Nor do its parameters come back each step: the flat
        // buffer's values stay on the device (FlatBuffer::defer_to) until
        // the run's end reads them, once per rank.
        let read = downloads() - down;
        match what {
            // ZeRO-1 reduces them there as well (each bucket
            // reduce-scattered as the last backward completes it), steps
            // its shard in the kept copies and gathers the others' shards
            // there. ZeRO-2 reduce-scatters each micro-batch's there,
            // bucket by bucket.
            "1 rank"
            | "tp 2"
            | "DDP 2 ranks"
            | "DDP 2 ranks, 2 micro-batches, small buckets"
            | "ZeRO-1 2 ranks"
            | "ZeRO-1 3 ranks"
            | "ZeRO-2 2 ranks, 2 micro-batches"
            | "full recompute, ZeRO-2" => {
                assert_eq!(read, 0, "{what}: gradients read back");
                assert_eq!(back, 0, "{what}: the optimizer wrote the parameters back");
                assert_eq!(
                    deferred, world,
                    "{what}: parameters read back {deferred} times"
                );
            }
            // A pipeline stage holds its micro-batches' gradients there,
            // sums tied copies and averages over dp there, and steps
            // there; its optimizers write the new values to the host
            // buffer.
            // ZeRO-3 gathers each block's parameters from the shard it
            // keeps there, reduce-scatters each block's gradients there,
            // and steps the shard there, writing it to the host's.
            "pp 2 (1f1b)"
            | "pp 2 (zero-bubble)"
            | "pp 2 (interleaved)"
            | "dp 2 x pp 2 (zero-bubble)"
            | "dp 2 x pp 2 (interleaved)"
            | "dp 2 x pp 2 x tp 2"
            | "ZeRO-3 2 ranks"
            | "ZeRO-3 3 ranks, 2 micro-batches"
            | "ZeRO-3 2 ranks, 2 blocks ahead, 2 micro-batches"
            | "ZeRO-3, kept gathers, full recompute"
            | "HYBRID_SHARD 2 x 2" => {
                assert_eq!(read, 0, "{what}: gradients read back");
                assert!(back > 0, "{what}: the host buffer was not kept current");
                // No block's parameters went up from the host: each was
                // served from its gather on the device.
                if what.starts_with("ZeRO-3") || what.starts_with("HYBRID") {
                    assert_eq!(up, 0, "{what}: {up} parameters uploaded");
                }
            }
            // Under ZeRO-1 each dp rank steps its piece of every range and
            // the pieces are gathered there; the gathered ranges go to the
            // host buffer whole, not through the optimizer (the final
            // comparison reads that buffer).
            "dp 2 x pp 2, ZeRO-1" => {
                assert_eq!(read, 0, "{what}: gradients read back");
                assert_eq!(back, 0, "{what}: the optimizer wrote its piece back too");
            }
            _ => {
                assert!(
                    read > 0,
                    "{what}: no gradient read back, yet reduced on the host"
                );
                assert!(back > 0, "{what}: the host buffer was not kept current");
            }
        }
    }
    // The 3-rank ZeRO-1 run's shards are uneven (a model that 3 does not
    // divide).
    let (_, z3) = runs.iter().find(|(w, _)| *w == "ZeRO-1 3 ranks").unwrap();
    let n: usize = z3[0].named.values().map(|v| v.len()).sum();
    assert_ne!(
        n % 3,
        0,
        "{n} parameters: ZeRO-1's shards on 3 ranks are even"
    );
    // Unless offloaded: DeepSpeed's offload_optimizer.device = cpu keeps
    // the state in host memory and steps with the host's loop.
    let before = device_opt_steps();
    let offloaded = llama_run(2, 2, 1, &["zero_optimization.offload_optimizer.device=cpu"]);
    assert_eq!(
        device_opt_steps(),
        before,
        "offloaded, yet stepped on the device"
    );
    runs.push(("DDP 2 ranks, optimizer offloaded to the host", offloaded));
    // ZeRO-2 with its optimizer on the host reduce-scatters into the
    // host's shard, bucket by bucket, and reads the gradients back.
    let down = downloads();
    let offloaded = llama_run(
        2,
        2,
        2,
        &[
            "zero_optimization.stage=2",
            "zero_optimization.offload_optimizer.device=cpu",
        ],
    );
    assert!(
        downloads() > down,
        "ZeRO-2 offloaded: the gradients never reached the host"
    );
    runs.push(("ZeRO-2 2 ranks, optimizer offloaded to the host", offloaded));
    // A hook other than the plain f32 average reduces host buffers: there
    // the gradients go, bucket by bucket as backward makes them.
    let down = downloads();
    llama_run(2, 2, 1, &["train.reduce_dtype=bf16"]);
    assert!(
        downloads() > down,
        "DDP with bf16 reduction: the gradients never reached the host"
    );
    let bf16 = llama_run(1, 1, 1, &["train.precision=bf16"]).remove(0);
    // The parameters stay on the device between changes, and DDP's
    // micro-batches add their gradients up there (engine::resident): 4
    // micro-batches with full recomputation (8 builds of each block per
    // step, 4 backwards) upload the parameters as often as 1 micro-batch
    // does, and neither reads a gradient back.
    let counted = |accum, extra: &[&str]| {
        let (up, down) = (uploads(), downloads());
        let out = llama_run(2, 2, accum, extra);
        (uploads() - up, downloads() - down, out)
    };
    let (up1, down1, _) = counted(1, &[]);
    let (up4, down4, out) = counted(4, &["train.activation_checkpointing=full"]);
    eprintln!(
        "DDP 2 ranks, {STEPS} steps: uploads {up1} (1 micro-batch) {up4} (4, recomputed); \
         gradient reads {down1} and {down4}"
    );
    assert!(up1 > 0, "nothing was uploaded");
    assert_eq!(down1, 0, "DDP 2 ranks read gradients back");
    assert_eq!(up4, up1, "micro-batches or recomputation uploaded again");
    // And the optimizer steps on the device's copies and keeps its result
    // as the next forward's (optim::DeviceOptimizer::step_on): the
    // parameters go up once, for the first forward, however many steps.
    let (up_first, _, _) = counted(1, &["train.steps=1"]);
    assert_eq!(up1, up_first, "later steps uploaded the parameters again");
    // So does each pipeline stage's optimizer over its own ranges.
    let pp_uploads = |extra: &[&str]| {
        let up = uploads();
        llama_run(2, 1, 4, extra);
        uploads() - up
    };
    let (pp_all, pp_first) = (
        pp_uploads(&["parallel.pp=2"]),
        pp_uploads(&["parallel.pp=2", "train.steps=1"]),
    );
    assert_eq!(
        pp_all, pp_first,
        "pp 2: later steps uploaded the parameters again"
    );
    // GPT-2's last stage owns two ranges (the tied embedding, its
    // blocks): each kept across the step as well.
    let gpt_pp_uploads = |steps: usize| {
        let up = uploads();
        gpt_run(2, 1, 4, &["parallel.pp=2", &format!("train.steps={steps}")]);
        uploads() - up
    };
    let (gpt_all, gpt_first) = (gpt_pp_uploads(STEPS), gpt_pp_uploads(1));
    // And under ZeRO-1 over dp, whose pieces are gathered in the kept copies.
    let z1 = ["parallel.pp=2", "zero_optimization.stage=1"];
    let pp_z1 = |extra: &[&str]| {
        let up = uploads();
        llama_run(4, 2, 2, &[&z1[..], extra].concat());
        uploads() - up
    };
    assert_eq!(
        pp_z1(&[]),
        pp_z1(&["train.steps=1"]),
        "dp 2 x pp 2, ZeRO-1: later steps uploaded the parameters again"
    );
    assert_eq!(
        gpt_all, gpt_first,
        "GPT-2 pp 2: later steps uploaded the parameters again"
    );
    // As does ZeRO-1 with its gradients on the device: its shard stepped
    // in the kept copies and the others' gathered there.
    let z1_uploads = |extra: &[&str]| {
        let up = uploads();
        llama_run(2, 2, 2, extra);
        uploads() - up
    };
    let (z1_all, z1_first) = (
        z1_uploads(&["zero_optimization.stage=1"]),
        z1_uploads(&["zero_optimization.stage=1", "train.steps=1"]),
    );
    eprintln!(
        "ZeRO-1 2 ranks, 2 micro-batches: uploads {z1_all} in {STEPS} steps, {z1_first} in 1"
    );
    assert_eq!(
        z1_all, z1_first,
        "ZeRO-1: later steps uploaded the parameters again"
    );
    assert_eq!(down4, down1, "held micro-batches read their gradients back");
    runs.push(("DDP 2 ranks, 4 micro-batches, full recompute", out));
    let gpt_runs: Vec<_> = gpt_strategies()
        .into_iter()
        .map(|(what, world, dp, accum, extra)| {
            let (up, down) = (uploads(), downloads());
            let out = gpt_run(world, dp, accum, &extra);
            let (up, down) = (uploads() - up, downloads() - down);
            // The tied embedding's gradient, from the head and the
            // embedding, reduced on the device too; ZeRO-3 serves every
            // block from its gathers there (ZeRO-2 uploads its kept copies
            // once, for the first forward).
            if what.starts_with("ZeRO-3") {
                assert_eq!((up, down), (0, 0), "GPT-2 {what}: uploads, gradient reads");
            } else if what.starts_with("ZeRO") {
                assert_eq!(down, 0, "GPT-2 {what}: gradient reads");
            }
            (what, out)
        })
        .collect();
    // Sequence parallelism sums the replicated parameters' gradients over
    // tp in the trainer, from the flat buffer: there they must go, though
    // DDP has one data-parallel rank (a 16-token context, which tp divides).
    let sp = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "model.block_size=16",
    ];
    let down = downloads();
    let gpt_sp = gpt_run(2, 1, 1, &sp);
    assert!(
        downloads() > down,
        "sequence parallel: the gradients never reached the host"
    );
    // ZeRO-3's evaluation gathers its blocks from the shards kept on the
    // device too: nothing goes up from the host.
    let up = uploads();
    let z3_val = zero3_val_losses();
    assert_eq!(uploads() - up, 0, "ZeRO-3's evaluation uploaded parameters");
    assert!(!z3_val.is_empty(), "ZeRO-3 did not evaluate");
    assert_eq!(
        kernel_runs(),
        host,
        "an op took the CPU kernels while they were off"
    );

    // The 1-rank runs on the CPU kernels (direct layers, fused ops), and
    // the host's optimizer.
    set_host_kernels(Some(true));
    let before = device_opt_steps();
    let base = llama::base();
    assert!(kernel_runs() > host, "the CPU kernels did not run");
    assert_eq!(
        device_opt_steps(),
        before,
        "the CPU kernels' run stepped on the device"
    );
    assert!(base.losses[STEPS - 1] < base.losses[0], "{:?}", base.losses);
    for (what, out) in &runs {
        assert_named_match(&format!("generic {what}"), out, &base, 1e-5);
    }
    // bf16 rounds differently on the two paths: each within 2% of fp32's.
    let base_bf16 = llama_run(1, 1, 1, &["train.precision=bf16"]).remove(0);
    for (k, ((g, f), b)) in bf16
        .losses
        .iter()
        .zip(&base_bf16.losses)
        .zip(&base.losses)
        .enumerate()
    {
        for (name, v) in [("generic", g), ("fused", f)] {
            assert!(
                ((v - b) / b).abs() < 0.02,
                "step {k}: {name} bf16 {v} vs fp32 {b}"
            );
        }
    }
    // The same validation losses as the host path's.
    let host_val = zero3_val_losses();
    assert_eq!(host_val.len(), z3_val.len());
    for ((k, d), (j, h)) in z3_val.iter().zip(&host_val) {
        assert_eq!(k, j);
        assert!(
            ((d - h) / h).abs() < 1e-5,
            "step {k}: ZeRO-3's validation loss {d} on the device, {h} on the host"
        );
    }
    let gpt_base = gpt_run(1, 1, 1, &[]).remove(0);
    for (what, out) in &gpt_runs {
        assert_named_match(&format!("GPT-2 generic {what}"), out, &gpt_base, 1e-5);
    }
    let gpt_base16 = gpt_run(1, 1, 1, &["model.block_size=16"]).remove(0);
    assert_named_match(
        "GPT-2 generic tp 2 + sequence parallel",
        &gpt_sp,
        &gpt_base16,
        1e-5,
    );
    set_host_kernels(None);
}
