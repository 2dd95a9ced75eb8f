//! `phalanx plan`: predict memory, communication and step time of every
//! layout of a training job, rank them and explain the recommended one
//! (see `phalanx::plan`); or, with `--params N` and no model shapes, the
//! model-states calculator per ZeRO stage and precision (the ZeRO paper's
//! terms; DeepSpeed's `estimate_zero*_model_states_mem_needs` add its own
//! working buffers, see docs/planning.md).
//!
//! ```text
//! phalanx plan --set model.preset=gpt-50m --nproc 2
//! phalanx plan --config ds_config.json --nproc 8 --nnodes 2 --device-memory 80GB --json
//! phalanx plan --params 7B --nproc 8
//! ```

use clap::Args;
use phalanx::config::{OffloadDevice, Recompute, TrainConfig};
use phalanx::plan::{
    self, human_bytes as h, memory, select, Candidate, Hardware, Layout, ModelShape,
};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct PlanOpts {
    #[command(flatten)]
    pub cfg: crate::config_args::ConfigArgs,
    /// Ranks per node.
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Memory per rank (e.g. 80GB, 16GiB); default: this machine's RAM
    /// divided among the ranks of a node.
    #[arg(long = "device-memory")]
    pub device_memory: Option<String>,
    /// Matmul throughput per rank in FLOP/s (default: measured here, divided
    /// among the ranks of a node, which share its cores).
    #[arg(long)]
    pub flops: Option<f64>,
    /// Bytes/s between ranks of a node (default: measured here).
    #[arg(long)]
    pub bandwidth: Option<f64>,
    /// Bytes/s between nodes (default: --bandwidth).
    #[arg(long = "inter-bandwidth")]
    pub inter_bandwidth: Option<f64>,
    /// Model-states calculator for this many parameters (7B, 350M, ...),
    /// without model shapes.
    #[arg(long)]
    pub params: Option<String>,
    /// One JSON object per layout (one per line).
    #[arg(long)]
    pub json: bool,
    /// Write the recommended layout as a TOML config for `phalanx train`.
    #[arg(long = "write-config", value_name = "FILE")]
    pub write_config: Option<PathBuf>,
    /// Predict only the layout the config asks for (to compare with a run).
    #[arg(long = "config-layout")]
    pub config_layout: bool,
    /// Rows of the table (0: all).
    #[arg(long, default_value_t = 20)]
    pub top: usize,
}

pub fn main(o: &PlanOpts) -> i32 {
    match run(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx plan: {e}");
            2
        }
    }
}

fn run(o: &PlanOpts) -> Result<(), String> {
    if o.nproc == 0 || o.nnodes == 0 {
        return Err("--nproc and --nnodes must be at least 1".into());
    }
    // The largest job the planner searches: far beyond any cluster, and
    // small enough that the search over its layouts takes moments.
    const MAX_WORLD: usize = 1 << 20;
    if o.nproc.checked_mul(o.nnodes).is_none_or(|w| w > MAX_WORLD) {
        return Err(format!(
            "--nproc {} x --nnodes {} ranks is more than the planner searches ({MAX_WORLD})",
            o.nproc, o.nnodes
        ));
    }
    for (key, v) in [
        ("--flops", o.flops),
        ("--bandwidth", o.bandwidth),
        ("--inter-bandwidth", o.inter_bandwidth),
    ] {
        if let Some(x) = v.filter(|x| !(x.is_finite() && *x > 0.0)) {
            return Err(format!("{key} {x} must be a positive number"));
        }
    }
    let device_memory = match &o.device_memory {
        Some(s) => plan::parse_bytes(s)?,
        None => machine_ram()? / o.nproc as u64,
    };
    if let Some(p) = &o.params {
        // The calculator has no model shapes and no layouts to write.
        for (flag, given) in [
            ("--write-config", o.write_config.is_some()),
            ("--config-layout", o.config_layout),
        ] {
            if given {
                return Err(format!(
                    "{flag} needs a model (--config / --set), not --params: the calculator \
                     counts model states only"
                ));
            }
        }
        let n = plan::parse_count(p).map_err(|e| format!("--params: {e}"))?;
        return calculator(n, o, device_memory);
    }
    let cfg = o.cfg.build().map_err(|e| e.to_string())?;
    // The output is checked before the probes and the search.
    if let Some(path) = &o.write_config {
        crate::outputs::check_plan_output(&cfg, &o.cfg, path)?;
    }
    let m = phalanx_models::family::plan_shape(&cfg).map_err(|e| e.to_string())?;
    let title = phalanx_models::family::of(&cfg)
        .map_err(|e| e.to_string())?
        .title();
    let world = o.nproc * o.nnodes;
    let base = Layout::from_config(&cfg, world).map_err(|e| e.to_string())?;
    // The probe runs alone and uses every core; the ranks of a node share
    // them, so each gets its share.
    let flops = o
        .flops
        .unwrap_or_else(|| plan::probe_matmul_flops() / o.nproc.max(1) as f64);
    let bw = o
        .bandwidth
        .unwrap_or_else(|| plan::probe_bandwidth(32 << 20));
    let hw = Hardware {
        inter_bw: o.inter_bandwidth.unwrap_or(bw),
        ..Hardware::new(o.nproc, o.nnodes, device_memory, flops, bw)
    };
    let data_tokens = data_tokens(&cfg);
    let layouts = if o.config_layout {
        if !m.tp_ok(base.tp) {
            return Err(format!(
                "parallel.tp = {}: the model's blocks cannot be cut for {} tensor-parallel ranks \
                 (they can for tp in {:?})",
                base.tp,
                base.tp,
                m.params.sizes().collect::<Vec<_>>()
            ));
        }
        vec![base]
    } else {
        select::enumerate(&m, &hw, &base)
    };
    let mut ranked = select::rank(&layouts, &m, &hw);
    for c in &mut ranked {
        // The token data every rank holds, counted in its overhead.
        c.memory.overhead += data_tokens * memory::BYTES_PER_TOKEN;
        c.fits = c.memory.total() <= hw.device_memory;
    }
    let ranked = select::sort(ranked);
    if o.json {
        for c in &ranked {
            println!("{}", json(c));
        }
    } else {
        print_table(title, &m, &hw, &base, &ranked, o.top, data_tokens);
    }
    if let Some(path) = &o.write_config {
        let best = ranked.first().ok_or("no layout to write")?;
        if !best.fits {
            return Err(format!(
                "--write-config {}: not written, no layout fits the device memory ({} per rank \
                 needed at best): a config that runs out of memory is not one to start from",
                path.display(),
                h(best.memory.total())
            ));
        }
        let text = recommended_config(&cfg, &best.layout);
        crate::outputs::check_plan_output(&cfg, &o.cfg, path)?;
        phalanx::fsutil::write_atomic(path, text.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        if !o.json {
            println!("wrote {} ({})", path.display(), best.layout.name());
        }
    }
    Ok(())
}

/// Tokens of the training data a rank holds in memory: a text file is
/// tokenized into memory (about a token per byte with the byte
/// tokenizer, one per four bytes with GPT-2's); `.bin` files are mapped.
fn data_tokens(cfg: &TrainConfig) -> u64 {
    // A corpus (sources, globs, JSONL) is mapped or streamed, never held whole.
    if cfg.data.uses_corpus() {
        return 0;
    }
    let path = cfg.data.path.to_string();
    let p = std::path::Path::new(&path);
    if p.extension().is_some_and(|e| e == "bin") {
        return 0;
    }
    let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    match cfg.data.tokenizer.builtin() {
        Some(phalanx::config::Tokenizer::Byte) => len,
        _ => len / 4,
    }
}

fn machine_ram() -> Result<u64, String> {
    let s = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| format!("cannot read /proc/meminfo ({e}); give --device-memory"))?;
    s.lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no MemTotal in /proc/meminfo; give --device-memory".into())
}

fn json(c: &Candidate) -> serde_json::Value {
    let l = &c.layout;
    let e = &c.memory;
    serde_json::json!({
        "dp": l.dp, "tp": l.tp, "pp": l.pp, "zero_stage": l.zero_stage,
        "precision": l.precision.name(), "activation_checkpointing": l.activation_checkpointing,
        "offload_optimizer": l.offload_optimizer,
        "micro_batch_size": l.micro_batch, "grad_accum_steps": l.grad_accum,
        "global_batch_size": l.global_batch(),
        "params_bytes": e.params, "grads_bytes": e.grads, "optimizer_bytes": e.optimizer,
        "activations_bytes": e.activations, "working_bytes": e.working,
        "comm_buffer_bytes": e.comm_buffers, "overhead_bytes": e.overhead,
        "peak_bytes_per_rank": e.total(), "comm_bytes_per_step": c.comm_bytes_per_step,
        "compute_seconds": c.compute_seconds, "comm_seconds": c.comm_seconds,
        "step_seconds": c.step_seconds, "fits": c.fits,
    })
}

fn mib(b: u64) -> String {
    format!("{:.0}", b as f64 / (1 << 20) as f64)
}

fn print_table(
    title: &str,
    m: &ModelShape,
    hw: &Hardware,
    base: &Layout,
    ranked: &[Candidate],
    top: usize,
    data_tokens: u64,
) {
    // The family's name, and the planner's shape (GPT-2's layer, or a
    // Llama-style one with its kv heads and MLP).
    let kind = match m.family {
        plan::Family::Gpt2 => format!("{title}, {} heads", m.n_head),
        plan::Family::Llama => format!(
            "{title}, {} heads / {} kv heads, MLP {}",
            m.n_head, m.n_kv_head, m.mlp_hidden
        ),
    };
    println!(
        "model: {kind}, {} layers, {} wide, vocab {}, context {}: {} parameters, {:.3e} FLOP/token",
        m.n_layer,
        m.n_embd,
        m.vocab_size,
        m.seq_len,
        m.num_params(),
        plan::model_flops_per_token(m)
    );
    println!(
        "hardware: {} node(s) x {} ranks, {} per rank, {:.1} GFLOP/s per rank, links {:.2} GB/s (inter-node {:.2} GB/s)",
        hw.nnodes,
        hw.nproc,
        h(hw.device_memory),
        hw.flops / 1e9,
        hw.intra_bw / 1e9,
        hw.inter_bw / 1e9
    );
    println!(
        "global batch {} sequences = micro-batch {} x dp {} x grad_accum {} (kept for every layout; accumulation derived)",
        base.global_batch(),
        base.micro_batch,
        base.dp,
        base.grad_accum
    );
    println!(
        "  #  {:<34} {:>9} {:>7} {:>7} {:>7} {:>8} {:>7} {:>9} {:>4} {:>10} {:>8}",
        "layout (MiB per rank)",
        "micro*acc",
        "params",
        "grads",
        "optim",
        "activ",
        "other",
        "peak",
        "fits",
        "comm MB",
        "step s"
    );
    let n = if top == 0 {
        ranked.len()
    } else {
        top.min(ranked.len())
    };
    for (i, c) in ranked.iter().take(n).enumerate() {
        let e = &c.memory;
        println!(
            "{:>3}  {:<34} {:>9} {:>7} {:>7} {:>7} {:>8} {:>7} {:>9} {:>4} {:>10.1} {:>8.3}",
            i + 1,
            c.layout.name(),
            format!("{}x{}", c.layout.micro_batch, c.layout.grad_accum),
            mib(e.params),
            mib(e.grads),
            mib(e.optimizer),
            mib(e.activations),
            mib(e.working + e.comm_buffers + e.overhead),
            mib(e.total()),
            if c.fits { "yes" } else { "NO" },
            c.comm_bytes_per_step as f64 / 1e6,
            c.step_seconds
        );
    }
    if n < ranked.len() {
        println!("  ... {} more (--top 0 shows all)", ranked.len() - n);
    }
    // Plain DDP is judged with the data too, as the rows were.
    println!(
        "\n{}",
        select::explain_with_data(m, ranked, hw, data_tokens)
    );
}

/// The config with the recommended layout's keys set.
fn recommended_config(cfg: &TrainConfig, l: &Layout) -> String {
    let mut c = cfg.clone();
    c.parallel.dp = l.dp;
    c.parallel.tp = l.tp;
    c.parallel.pp = l.pp;
    c.parallel.sharding_strategy = Default::default();
    c.zero_optimization.stage = l.zero_stage;
    c.train.precision = l.precision;
    c.fp16.enabled = false;
    c.bf16.enabled = false;
    c.train.activation_checkpointing = if l.activation_checkpointing {
        Recompute::Full
    } else {
        Recompute::None
    };
    c.zero_optimization.offload_optimizer.device = if l.offload_optimizer {
        OffloadDevice::Nvme
    } else {
        OffloadDevice::None
    };
    c.train.micro_batch_size = l.micro_batch;
    c.train.grad_accum_steps = l.grad_accum;
    c.train.global_batch_size = l.global_batch();
    format!(
        "# written by `phalanx plan`: {} ({} ranks)\n{}",
        l.name(),
        l.world(),
        c.to_toml()
    )
}

/// `--params N`: model states per rank by ZeRO stage and precision.
fn calculator(n: u64, o: &PlanOpts, device_memory: u64) -> Result<(), String> {
    let world = o.nproc * o.nnodes;
    let rows: [(&str, u64, u64, u64); 2] = [
        ("mixed (bf16/fp16 + f32 master, Adam)", 2, 2, 12),
        ("fp32 Adam (Phalanx: f32 masters always)", 4, 4, 8),
    ];
    if !o.json {
        println!(
            "model states of {n} parameters ({:.2}B) on {} node(s) x {} ranks ({world} data-parallel), per rank; device memory {}",
            n as f64 / 1e9,
            o.nnodes,
            o.nproc,
            h(device_memory)
        );
        println!(
            "  {:<42} {:<7} {:<9} {:>12} {:>12} {:>12} {:>12} {:>14} {:>5}",
            "precision",
            "stage",
            "offload",
            "params",
            "grads",
            "optimizer",
            "per rank",
            "host per node",
            "fits"
        );
    }
    for (name, p, g, k) in rows {
        for stage in 0..=3u8 {
            for offload in [false, true] {
                if offload && stage == 0 {
                    continue;
                }
                let s = memory::model_states(n, world, stage, p, g, k);
                let (dev, host) = if offload {
                    (
                        s.params.saturating_add(s.grads),
                        s.optimizer.saturating_mul(o.nproc as u64),
                    )
                } else {
                    (s.total(), 0)
                };
                let fits = dev <= device_memory;
                if o.json {
                    println!(
                        "{}",
                        serde_json::json!({"precision": name, "zero_stage": stage, "offload_optimizer": offload,
                            "params_bytes": s.params, "grads_bytes": s.grads, "optimizer_bytes": s.optimizer,
                            "per_rank_bytes": dev, "host_bytes_per_node": host, "fits": fits})
                    );
                } else {
                    println!(
                        "  {:<42} {:<7} {:<9} {:>12} {:>12} {:>12} {:>12} {:>14} {:>5}",
                        name,
                        stage,
                        if offload { "optimizer" } else { "none" },
                        h(s.params),
                        h(s.grads),
                        h(s.optimizer),
                        h(dev),
                        h(host),
                        if fits { "yes" } else { "NO" }
                    );
                }
            }
        }
    }
    if !o.json {
        println!("(model states only: add activations, working copies and buffers; give a model config for the full plan)");
    }
    Ok(())
}
