//! `phalanx train`: train a model of any family (`model.arch`: GPT-2,
//! Llama, Qwen2) from a config on one or more ranks. `--init-from DIR`
//! (Hugging Face weights with their `config.json`) picks the family and the
//! shape from that `config.json`.
//!
//! Outside a job it launches itself through `phalanx run` with
//! `--nproc-per-node` ranks (default 2); inside one, every rank trains its
//! data-parallel slice and rank 0 reports.
//!
//! `--max-restarts K` is passed to that launch: a failed group is restarted
//! up to K times, and with `checkpoint.interval` > 0 the restarted ranks
//! resume from the latest complete checkpoint (see `phalanx::trainer`).
//!
//! A DeepSpeed config's `"auto"` values (Hugging Face Trainer-style) take
//! Phalanx's own settings; rank 0 prints what each became before training.

use clap::Args;
use phalanx::config::TrainConfig;
use phalanx::trainer::{Resume, RunOptions};
use phalanx_models::{family, train};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args, Debug, Clone)]
pub struct TrainOpts {
    #[command(flatten)]
    pub cfg: crate::config_args::ConfigArgs,
    /// Start from Hugging Face weights: a `model.safetensors`, a
    /// `model.safetensors.index.json` (Llama, Qwen2) or a directory holding
    /// either. A `config.json` beside them picks the family and the model's
    /// shape; a `--set model.KEY` that disagrees with it is an error.
    #[arg(long = "init-from")]
    pub init_from: Option<PathBuf>,
    /// Save the trained model in Hugging Face layout (with config.json beside
    /// it). GPT-2: the safetensors file; Llama, Qwen2: a directory
    /// (model.safetensors, or shards and an index past 5 GB), or a
    /// `.safetensors` file.
    #[arg(long = "save-final")]
    pub save_final: Option<PathBuf>,
    /// One JSON object per step: step, loss, lr, tokens_per_s, step_ms.
    #[arg(long = "log-json")]
    pub log_json: Option<PathBuf>,
    /// Write a Chrome / Perfetto trace of the pipeline schedule (pp > 1).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Continue from a checkpoint: a checkpoint directory, a directory of
    /// checkpoints (its latest complete one), or `auto` (the latest under
    /// `checkpoint.dir`, else a fresh start).
    #[arg(long, value_name = "PATH|auto")]
    pub resume: Option<String>,
    /// Print the resolved config and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Let --save-final replace a `config.json` / `tokenizer.json` in its
    /// directory that describes another model (refused otherwise).
    #[arg(long)]
    pub force: bool,
}

/// The config: the flags', with the model of `--init-from`'s `config.json`
/// when there is one (and where the `config.json` read is).
fn build(opts: &TrainOpts) -> phalanx::Result<(TrainConfig, Option<PathBuf>)> {
    match &opts.init_from {
        Some(p) => {
            // The model's own tokenizer (beside its weights, recorded in
            // its config.json, or its family's), unless one is named: a
            // downloaded model's ids are its tokenizer's, not bytes.
            let mut sets =
                crate::generate::default_tokenizer_sets(p, opts.cfg.file(), &opts.cfg.set)?;
            sets.extend(opts.cfg.set.iter().cloned());
            family::build_for_hf(opts.cfg.file(), &sets, p).map_err(|e| match e {
                // Messages about the model directory name --init-from.
                phalanx::Error::Check(m) => phalanx::Error::Check(format!("--init-from: {m}")),
                e => e,
            })
        }
        None => Ok((opts.cfg.build()?, None)),
    }
}

pub fn main(opts: &TrainOpts, launch: &crate::launch::LaunchOpts) -> i32 {
    let (cfg, hf_config) = match build(opts) {
        Ok(c) => c,
        Err(e) => {
            crate::elastic::fail("phalanx train", e);
            return 2;
        }
    };
    if opts.print_config {
        print!("{}", cfg.to_toml());
        return 0;
    }
    if !crate::launch::in_job() {
        if let Err(e) = check_outputs(&cfg, opts).and_then(|()| check_init_from(&cfg, opts)) {
            crate::elastic::fail("phalanx train", e);
            return 2;
        }
        let n = launch.nproc_per_node.unwrap_or(2);
        // Check what can be checked before starting any process.
        if let Err(e) = crate::local_ranks::check(n) {
            eprintln!("phalanx train: {e}");
            if let Some(note) = crate::launch::env_flag_note(&e) {
                eprintln!("{note}");
            }
            return 2;
        }
        // The batch numbers a DeepSpeed-style config leaves to derive are
        // derived for this dp size (each rank derives them again when it
        // builds its config inside the job). The world is every node's
        // ranks; an elastic range (--nnodes MIN:MAX) has no one size, and
        // each round's ranks check their own.
        let world = match launch.nnodes_range() {
            Ok((lo, hi)) if lo == hi => n.checked_mul(lo),
            _ => None,
        };
        let mut resolved = cfg.clone();
        if let Err(e) = world.map_or(Ok(()), |world| {
            cfg.dp_for_world(world).and_then(|dp| {
                resolved.resolve_batch(dp)?;
                phalanx::data::micro_batch_size(
                    resolved.global_batch(dp),
                    dp,
                    resolved.train.grad_accum_steps,
                )
                .map(|_| ())
                .map_err(|e| phalanx::config::ConfigError(e.to_string()))
            })
        }) {
            crate::elastic::fail("phalanx train", e);
            return 2;
        }
        if let Err(e) = check_layout(&cfg) {
            crate::elastic::fail("phalanx train", e);
            return 2;
        }
        return crate::launch::relaunch_self(launch, n);
    }
    // Started by another launcher (torchrun, mpirun, srun): the job's
    // layout is that launcher's, and these flags say nothing to it.
    let own = std::env::var_os(crate::launch::OUTPUTS_CHECKED).is_some();
    // (On the command line: a PET_* variable is torchrun's own, inherited.)
    let given = std::env::args_os().any(|a| {
        crate::launch::flag_name(&a.to_string_lossy()).is_some_and(|f| {
            matches!(
                f.as_str(),
                "--nproc-per-node" | "--nnodes" | "--max-restarts"
            )
        })
    });
    // (Said by rank 0 of whichever launcher: torchrun's RANK, mpirun's,
    // srun's.)
    let rank0 = phalanx_comm::JobSizes::from_env()
        .ok()
        .filter(|j| j.in_job() && j.rank == 0);
    if let (false, true, Some(j)) = (own, given, rank0) {
        eprintln!(
            "note: phalanx train runs inside a job {} started: --nproc-per-node, --nnodes \
             and --max-restarts are that launcher's to give, and have no effect here",
            j.source
        );
    }
    match run(&cfg, hf_config.as_deref(), opts) {
        Ok(None) => 0,
        // Stopped at a step boundary at the elastic agent's request.
        Ok(Some(_)) => crate::launch::STOPPED_EXIT,
        Err(e) => {
            crate::elastic::fail("phalanx train: error", e);
            1
        }
    }
}

/// The model's shape against the layout, before any rank starts (once, not
/// from every rank): heads, kv heads and widths by `parallel.tp` (rank 0's
/// blocks built detached, as the planner does), and the blocks into
/// `parallel.pp` stages (times the chunks per rank of `interleaved`) as
/// `parallel.pp_partition` says. Each rank checks again when it builds its
/// blocks (under another launcher only they do).
fn check_layout(cfg: &TrainConfig) -> Result<(), String> {
    let f = family::of(cfg).map_err(|e| e.to_string())?;
    let tp = cfg.parallel.tp;
    let blocks = if tp > 1 {
        f.tp_blocks(cfg, &phalanx::tp::Tp::detached(0, tp))
    } else {
        f.blocks(cfg)
    }
    .map_err(|e| e.to_string())?;
    if cfg.parallel.pp > 1 {
        use phalanx::strategy::pipeline::{partition, strategy::pipeline_config};
        let pc = pipeline_config(cfg).map_err(|e| e.to_string())?;
        let chunks = cfg.parallel.pp * pc.schedule.chunks_per_rank();
        partition::check_split(blocks.len(), chunks, &pc.partition).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Every output path (sidecars included), checked before any rank starts
/// against every input (see `crate::outputs`), and --save-final's
/// directory for another model's files (see `crate::hf_out`).
fn check_outputs(cfg: &TrainConfig, opts: &TrainOpts) -> Result<(), String> {
    let log_json = opts
        .log_json
        .clone()
        .or_else(|| (!cfg.log.json.is_empty()).then(|| cfg.log.json.clone().into()));
    let mut io = crate::outputs::Io::new();
    let mut foreign = None;
    if let Some(p) = &opts.save_final {
        // Saving to a directory (Llama, Qwen2) writes model.safetensors in
        // it; config.json (and a tokenizer.json tokenizer) go beside.
        let f = family::of(cfg).map_err(|e| e.to_string())?;
        let weights = f.hf_weights_file(p);
        let dir = phalanx_models::common::hf::model_dir(&weights);
        io.output("--save-final", &weights)
            .output("--save-final's config.json", &dir.join("config.json"));
        let tok = cfg.data.tokenizer.json_path();
        if let Some(t) = tok {
            // Not written when it already is the tokenizer read.
            let src = phalanx_models::hf_tokenizer::json_path(t);
            let dst = dir.join("tokenizer.json");
            if crate::outputs::resolve(&src) != crate::outputs::resolve(&dst) {
                io.output("--save-final's tokenizer.json", &dst);
            }
        }
        foreign = Some((dir, tok));
    }
    if let Some(p) = &log_json {
        io.output("--log-json", p);
    }
    if let Some(p) = &opts.trace {
        io.output("--trace", p);
    }
    for (key, v) in [("log.plot", &cfg.log.plot), ("log.report", &cfg.log.report)] {
        if let Some(p) = cfg.log_output(v) {
            io.output(key, &p);
        }
    }
    let flag = if opts.cfg.config.is_some() {
        "--config"
    } else {
        "--deepspeed-config"
    };
    crate::outputs::config_inputs(&mut io, cfg, opts.cfg.file().map(|f| (flag, f)));
    if let Some(p) = &opts.init_from {
        io.input("--init-from model", p);
        if let Some(cj) = family::hf_config_path(p) {
            io.input("--init-from config.json", &cj);
        }
    }
    let ckdir = std::path::Path::new(&cfg.checkpoint.dir);
    match opts.resume.as_deref() {
        None => {}
        Some("auto") => {
            io.checkpoint_input("--resume auto checkpoint (checkpoint.dir)", ckdir);
        }
        Some(p) => {
            io.checkpoint_input("--resume checkpoint", std::path::Path::new(p));
        }
    }
    if cfg.checkpoint.interval > 0 {
        // Under fault tolerance each replica group writes its own
        // `replica-N` directory in it (see `phalanx::trainer`).
        let ft = &cfg.fault_tolerance;
        let dir = if ft.enabled() {
            ckdir.join(format!("replica-{}", ft.replica_id))
        } else {
            ckdir.to_path_buf()
        };
        io.checkpoint_output("checkpoint.dir", &dir);
    }
    let z = "zero_optimization";
    for (key, dir) in [
        ("offload_optimizer", cfg.offload_dir()),
        ("offload_param", cfg.param_offload_dir()),
    ] {
        if let Some(d) = dir {
            io.scratch_dir(&format!("{z}.{key}.nvme_path"), &d);
        }
    }
    io.check()?;
    // Inputs first: a link to an input is named as such, not as a foreign file.
    match foreign {
        Some((dir, tok)) => crate::hf_out::check_dir(&dir, cfg, tok, "--save-final", opts.force),
        None => Ok(()),
    }
}

/// `--init-from` weights whose `config.json` disagrees with the model
/// config are refused before any rank starts (every rank would refuse them).
fn check_init_from(cfg: &TrainConfig, opts: &TrainOpts) -> Result<(), String> {
    let Some(p) = &opts.init_from else {
        return Ok(());
    };
    let f = family::of(cfg).map_err(|e| e.to_string())?;
    f.check_hf(cfg, p)
        .map_err(|e| format!("--init-from {}: {e}", p.display()))
}

/// Under an elastic launch (`PHALANX_ELASTIC=1`), a run that resumes keeps
/// the global batch of the checkpoint it resumes, whatever the world size
/// it re-formed with, unless `train.global_batch_size` is set: the
/// micro-batch or the accumulation adjusts (said in the log). Collective.
fn elastic_batch(
    cfg: &TrainConfig,
    pg: &phalanx_comm::ProcessGroup,
    opts: &TrainOpts,
) -> phalanx::Result<Option<TrainConfig>> {
    let resumes = opts.resume.is_some() || phalanx::fault::restart_count() > 0;
    if std::env::var("PHALANX_ELASTIC").as_deref() != Ok("1")
        || !resumes
        || cfg.train.global_batch_size != 0
    {
        return Ok(None);
    }
    // Rank 0 reads the checkpoint's metadata; everyone takes its batch.
    let mut global = [0i64];
    if pg.rank() == 0 {
        let root = match opts.resume.as_deref() {
            None | Some("auto") => PathBuf::from(&cfg.checkpoint.dir),
            Some(p) => PathBuf::from(p),
        };
        let reader = phalanx::checkpoint::Reader::open(&root)
            .ok()
            // The metadata is all it reads: the resume verifies the files.
            .or_else(|| phalanx::checkpoint::find_latest_unverified(&root).map(|(_, r)| r));
        if let Some(r) = reader {
            global[0] = r.meta.global_batch as i64;
        }
    }
    pg.broadcast(&mut global, 0)?;
    if global[0] <= 0 {
        return Ok(None);
    }
    let mut c = cfg.clone();
    let dp = c.dp_for_world(pg.size())?;
    let note = c.keep_global_batch(global[0] as usize, dp)?;
    if let (Some(n), true) = (note, pg.rank() == 0) {
        println!("elastic: {n}");
    }
    Ok(Some(c))
}

/// Set by SIGUSR1 under an elastic agent: stop after this step.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Train as one rank of the job; `Some(step)` when a graceful stop ended it.
fn run(
    cfg: &TrainConfig,
    hf_config: Option<&std::path::Path>,
    opts: &TrainOpts,
) -> phalanx::Result<Option<usize>> {
    let elastic = std::env::var("PHALANX_ELASTIC").as_deref() == Ok("1");
    if elastic {
        // SAFETY: installing a handler that only stores to an atomic.
        unsafe {
            libc::signal(libc::SIGUSR1, on_stop as *const () as libc::sighandler_t);
        }
    }
    // The device first (as torch.cuda.set_device before
    // init_process_group): a rank without a usable GPU fails here, alone,
    // naming what is missing, before it meets the others.
    cfg.device()?;
    let pg = phalanx_comm::init_process_group()?;
    let r = as_rank(cfg, hf_config, opts, &pg, elastic);
    if let Err(e) = &r {
        // Peers waiting in a collective with this rank fail at once with
        // this error (`rank N (host) aborted: …`) instead of a bare
        // "shut down before sending" or, on NCCL, a timeout.
        pg.fail_peers(&e.to_string());
    }
    r
}

/// `run` once the process group is up: everything a rank does in the job.
fn as_rank(
    cfg: &TrainConfig,
    hf_config: Option<&std::path::Path>,
    opts: &TrainOpts,
    pg: &phalanx_comm::ProcessGroup,
    elastic: bool,
) -> phalanx::Result<Option<usize>> {
    let lead = pg.rank() == 0;
    if lead && std::env::var_os(crate::launch::OUTPUTS_CHECKED).is_none() {
        // Under torchrun, mpirun, srun or `phalanx run -- phalanx train`
        // no launcher of ours checked the outputs before the ranks
        // started: rank 0 does, before anything is read or written (its
        // error reaches the others through `fail_peers`).
        check_outputs(cfg, opts)
            .and_then(|()| check_init_from(cfg, opts))
            .map_err(phalanx::Error::Check)?;
    }
    let elastic_cfg = elastic_batch(cfg, pg, opts)?;
    let cfg = elastic_cfg.as_ref().unwrap_or(cfg);
    let family = family::of(cfg)?;
    let loader = Arc::new(train::open_data(cfg)?);
    if lead {
        let m = family.summary(cfg)?;
        let name = match hf_config {
            Some(p) => p.display().to_string(),
            None => cfg
                .model
                .get("preset")
                .and_then(|p| p.as_str())
                .unwrap_or("")
                .to_string(),
        };
        let model = format!(
            "model {name} ({}: {}, {} parameters)",
            m.title,
            m.shape(),
            m.num_params
        );
        let tokens = match (loader.streams_text(), loader.train_tokens()) {
            (true, 0) => "train text tokenized as it streams".to_string(),
            (true, n) => format!("{n} train tokens + text tokenized as it streams"),
            (false, n) => format!("{n} train"),
        };
        println!(
            "{model}, data {} ({} tokenizer): {tokens} / {} val tokens",
            cfg.data.describe(),
            cfg.data.tokenizer,
            loader.val_tokens()
        );
        for n in loader.notes() {
            println!("note: {n}");
        }
        if cfg.train.eval_interval > 0 && loader.val_tokens() == 0 {
            println!(
                "note: no validation data, so no validation loss: text sources hold none out \
                 (data.val_fraction takes the tail of token files); give data.val_path, or set \
                 train.eval_interval = 0"
            );
        }
        // What a Trainer-style DeepSpeed config's "auto" values became, once
        // per run (rank 0, where the batch numbers are resolved for dp).
        if let Some(s) = cfg.deepspeed_auto_summary(cfg.dp_for_world(pg.size())?) {
            println!("{s}");
        }
    }
    let log_json = opts
        .log_json
        .clone()
        .or_else(|| (!cfg.log.json.is_empty()).then(|| cfg.log.json.clone().into()));
    let plot = cfg.log_output(&cfg.log.plot);
    let run_opts = RunOptions {
        progress: true,
        log_interval: cfg.log.interval,
        log_json,
        plot,
        trace: opts.trace.clone(),
        report: cfg.log_output(&cfg.log.report),
        resume: opts.resume.as_deref().map(|r| match r {
            "auto" => Resume::Auto,
            p => Resume::Path(p.into()),
        }),
        stop: elastic.then_some(&STOP),
    };
    let t0 = std::time::Instant::now();
    let (init_from, save_final) = (opts.init_from.clone(), opts.save_final.clone());
    let run = train::Run {
        init_from,
        save_final,
        run: run_opts,
    };
    let (report, trainer) = train::train(cfg, pg.clone(), loader, &run)?;
    if lead && report.losses.is_empty() && report.stopped_at.is_none() {
        // Resumed at or past train.steps: no step ran, so no loss to show.
        println!(
            "nothing to do: resumed at step {}, and train.steps = {}; raise train.steps to \
             train further",
            trainer.start_step(),
            cfg.train.steps
        );
    } else if lead {
        let first = report.losses.first().copied().unwrap_or(f32::NAN);
        let last = report.losses.last().copied().unwrap_or(f32::NAN);
        print!(
            "done: {} steps in {:.1} s, loss {first:.4} -> {last:.4}, {:.0} tokens/s",
            report.losses.len(),
            t0.elapsed().as_secs_f64(),
            report.tokens_per_s
        );
        if let Some((_, v)) = report.val_losses.last() {
            print!(", val loss {v:.4}");
        }
        if report.skipped > 0 {
            print!(
                "; {} of {} steps skipped (inf/NaN gradients)",
                report.skipped,
                report.losses.len()
            );
        }
        println!();
    }
    match (lead, &opts.save_final, report.stopped_at) {
        (true, Some(p), None) => println!(
            "saved {} (Hugging Face {} layout)",
            p.display(),
            family.title()
        ),
        // The model is partly trained: the round that finishes saves it.
        (true, Some(p), Some(at)) => println!(
            "--save-final {} not saved: stopped after step {at} of train.steps = {}; the run \
             that resumes and finishes saves it",
            p.display(),
            cfg.train.steps
        ),
        _ => {}
    }
    pg.shutdown();
    Ok(report.stopped_at)
}
