//! The `phalanx` command.
//!
//! - `phalanx run --nproc-per-node N -- PROGRAM ARGS`: launch a job (torchrun's flags).
//! - `phalanx train`: train GPT-2 (data parallel over local ranks by default).
//! - `phalanx plan`: rank layouts by predicted memory and step time.
//! - `phalanx generate`: sample text from a model.
//! - `phalanx bench collectives`: nccl-tests style collective sweep.
//! - `phalanx bench optimizer`: the optimizer's step on the device against the host's.
//! - `phalanx checkpoint inspect | convert | from-hf`: distributed checkpoints.
//! - `phalanx report LOG`: a run's HTML report.
//! - `phalanx tokenize`: text and JSONL -> llm.c token shards (or one file).

mod bench_collectives;
mod bench_device_memory;
mod bench_optimizer;
mod checkpoint_cmd;
mod config_args;
mod elastic;
mod generate;
mod hf_out;
mod launch;
mod launch_opts;
mod lighthouse;
mod local_ranks;
mod outputs;
mod plan;
mod rdzv;
mod report_cmd;
mod root_cause;
mod tokenize;
mod train;
mod workers;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "phalanx",
    version,
    about = "Distributed training for candle models"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Launch PROGRAM on several ranks (torchrun's flags and environment).
    Run {
        #[command(flatten)]
        launch: launch::LaunchOpts,
        /// The program and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<String>,
    },
    /// Train a model: GPT-2, Llama or Qwen2 (default: gpt-tiny on data/corpus.txt, 2 local
    /// ranks).
    Train {
        #[command(flatten)]
        opts: train::TrainOpts,
        #[command(flatten)]
        launch: launch::LaunchOpts,
    },
    /// Predict memory, communication and step time of every layout of a
    /// job; rank them and explain the best (or, with --params, the
    /// model-states calculator).
    Plan {
        #[command(flatten)]
        opts: plan::PlanOpts,
    },
    /// Sample text from a trained (or Hugging Face) model: a checkpoint or weights.
    Generate {
        #[command(flatten)]
        opts: generate::GenerateOpts,
    },
    /// Serve the lighthouse that fault-tolerant replica groups take their
    /// per-step quorums from (torchft's lighthouse).
    Lighthouse {
        #[command(flatten)]
        args: lighthouse::LighthouseArgs,
    },
    /// A replica group of one process training a toy model through a
    /// lighthouse, for the fault-tolerance tests.
    #[command(name = "_ft-worker", hide = true)]
    FtWorker {
        #[command(flatten)]
        args: lighthouse::FtWorkerArgs,
    },
    /// A worker used by the launcher's own tests: all-reduces in a loop and
    /// can crash on purpose.
    #[command(name = "_test-worker", hide = true)]
    TestWorker {
        #[arg(long)]
        die_rank: Option<usize>,
        #[arg(long, default_value_t = 300)]
        die_after_ms: u64,
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
    /// Print a pipeline schedule's table of actions per rank, check it, and
    /// simulate its bubble.
    Schedule {
        /// gpipe, 1f1b, interleaved:V, zb-h1
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Pipeline stages.
        #[arg(long, default_value_t = 4)]
        pp: usize,
        /// Micro-batches per step.
        #[arg(long = "micro-batches", default_value_t = 8)]
        micro_batches: usize,
        /// Also list the sends and receives.
        #[arg(long)]
        comm: bool,
    },
    /// Inspect and verify distributed checkpoints, convert them to and
    /// from Hugging Face weights (GPT-2, Llama, Qwen2).
    Checkpoint {
        #[command(subcommand)]
        what: checkpoint_cmd::CheckpointCmd,
    },
    /// A run's HTML report (loss, throughput, memory, bytes, stragglers,
    /// pipeline timeline) from its JSON log.
    Report {
        #[command(flatten)]
        opts: report_cmd::ReportOpts,
    },
    /// Encode text and JSONL files (many, globs, directories) into llm.c
    /// token shards on every core, resumably; or one text file into one
    /// `.bin` (INPUT OUTPUT). With a Hugging Face tokenizer.json or gpt2/byte.
    Tokenize {
        #[command(flatten)]
        opts: tokenize::TokenizeOpts,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

// Parsed once per run: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum BenchCmd {
    /// Sweep collective sizes and report time, algbw and busbw.
    Collectives {
        #[command(flatten)]
        opts: bench_collectives::BenchOpts,
        #[command(flatten)]
        launch: launch::LaunchOpts,
    },
    /// Time the optimizer's step on the device against the host's loop;
    /// `--check` compares their results first.
    Optimizer {
        #[command(flatten)]
        opts: bench_optimizer::OptimBenchOpts,
    },
}

/// torchrun's `PET_*` variables (as Kubeflow's PyTorchJob sets them) and
/// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, as the flags they stand for, for a
/// `phalanx run` or `phalanx train` that launches (not for a worker inside
/// a job, which inherits them and takes no launch flag); a flag given on
/// the command line wins.
fn pet_flags(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const VARS: [(&str, &str); 11] = [
        ("PET_NPROC_PER_NODE", "--nproc-per-node"),
        ("PET_NNODES", "--nnodes"),
        ("PET_NODE_RANK", "--node-rank"),
        ("PET_MASTER_ADDR", "--master-addr"),
        ("PET_MASTER_PORT", "--master-port"),
        ("PET_MAX_RESTARTS", "--max-restarts"),
        ("PET_RDZV_BACKEND", "--rdzv-backend"),
        ("PET_RDZV_ENDPOINT", "--rdzv-endpoint"),
        ("PET_RDZV_ID", "--rdzv-id"),
        ("PET_RDZV_CONF", "--rdzv-conf"),
        ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "--shutdown-timeout"),
    ];
    let launches = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|c| matches!(c, "run" | "train"));
    // (`run` always launches; `train` inside a job is a worker.)
    let worker = args.get(1).and_then(|a| a.to_str()) == Some("train") && launch::in_job();
    if !launches || worker {
        return args;
    }
    // The flags given, up to a `--` (what follows is the program's).
    let given: Vec<String> = args[2..]
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .take_while(|a| a != "--")
        .filter_map(|a| launch::flag_name(&a))
        .collect();
    // `--help` shows the flags, whatever the variables hold.
    let help = args[2..]
        .iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "--help" || a == "-h");
    if help {
        return args;
    }
    let mut extra = Vec::new();
    let mut from_env = Vec::new();
    for (var, flag) in VARS {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            if !given.iter().any(|g| g == flag) {
                from_env.push((flag, var, v.to_string_lossy().into_owned()));
                extra.push(flag.into());
                extra.push(v);
            }
        }
    }
    // A pod of Kubeflow's PyTorchJob (PET_NNODES, PET_NPROC_PER_NODE) whose
    // operator gives node 0's address only as MASTER_ADDR / MASTER_PORT
    // (as it does for one rank per pod): taken where the PET_ spelling is
    // missing, instead of the loopback default no other pod could reach.
    let pod = from_env
        .iter()
        .any(|(_, v, _)| matches!(*v, "PET_NNODES" | "PET_NPROC_PER_NODE"));
    for (var, pet, flag) in [
        ("MASTER_ADDR", "PET_MASTER_ADDR", "--master-addr"),
        ("MASTER_PORT", "PET_MASTER_PORT", "--master-port"),
    ] {
        let unset = |k: &str| std::env::var_os(k).is_none_or(|v| v.is_empty());
        if pod && unset(pet) && !given.iter().any(|g| g == flag) {
            if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                from_env.push((flag, var, v.to_string_lossy().into_owned()));
                extra.push(flag.into());
                extra.push(v);
            }
        }
    }
    launch::flags_from_env(from_env);
    args.splice(2..2, extra);
    args
}

/// Parse the command line; an error about a flag that a `PET_*` variable
/// gave (see `pet_flags`) also names the variable, which the user set (or
/// Kubeflow did), not the flag.
fn parse_cli(args: Vec<std::ffi::OsString>) -> Cli {
    Cli::try_parse_from(args).unwrap_or_else(|e| {
        if !e.use_stderr() {
            e.exit() // --help, --version
        }
        let _ = e.print();
        if let Some(note) = launch::env_flag_note(&e.to_string()) {
            eprintln!("{note}");
        }
        std::process::exit(e.exit_code())
    })
}

/// torchtitan's spelling of an override, `--train.steps=100` or
/// `--train.steps 100`, as `--set train.steps=100` (for the commands that
/// take `--set`; up to a `--`). The section must be one of the config's.
fn section_flags(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let takes_set = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|c| matches!(c, "train" | "plan" | "generate"));
    if !takes_set {
        return args;
    }
    let sections: Vec<String> = toml::Value::try_from(phalanx::config::TrainConfig::default())
        .ok()
        .and_then(|v| v.as_table().map(|t| t.keys().cloned().collect()))
        .unwrap_or_default();
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    out.extend(it.by_ref().take(2));
    while let Some(a) = it.next() {
        let Some(flag) = a.to_str().and_then(|s| s.strip_prefix("--")) else {
            out.push(a);
            continue;
        };
        if flag.is_empty() {
            // `--`: what follows is not ours.
            out.push(a);
            out.extend(it.by_ref());
            break;
        }
        let (key, value) = match flag.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (flag.to_string(), None),
        };
        let ours = key
            .split_once('.')
            .is_some_and(|(sec, k)| !k.is_empty() && sections.iter().any(|s| s == sec));
        if !ours {
            out.push(a);
            continue;
        }
        let value = match value {
            Some(v) => v,
            // A flag alone (or before another flag) is a boolean set true,
            // as torchtitan's `--checkpoint.enable_checkpoint`.
            None => {
                let next = it.peek().map(|v| v.to_str().map(str::to_string));
                match next {
                    Some(Some(v)) if !v.starts_with("--") => {
                        it.next();
                        v
                    }
                    // (Not UTF-8: clap names it.)
                    Some(None) => {
                        out.push(a);
                        continue;
                    }
                    _ => "true".to_string(),
                }
            }
        };
        out.push("--set".into());
        out.push(format!("{key}={value}").into());
    }
    out
}

/// A report piped into a reader that stops early (`phalanx plan | head`)
/// ends the command quietly with status 141, as a Unix tool killed by
/// SIGPIPE does (a failure under `set -o pipefail`: an `inspect` of a
/// corrupt checkpoint, or a `--write-config` not written yet, must not pass
/// for a success), for the report commands only, not with a panic: Rust's
/// `println!` panics on a closed stdout (SIGPIPE stays ignored, since the
/// transports write to sockets whose peer may be gone).
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + libc::SIGPIPE);
        }
        default(info);
    }));
}

fn main() {
    // Before any thread starts: glibc keeps freed blocks for the next step.
    phalanx::engine::heap::retain_unless_refused();
    let cli = parse_cli(pet_flags(section_flags(std::env::args_os().collect())));
    // The commands that print a report on this process's own stdout (not a
    // training rank, whose output goes to its launcher, nor a launcher).
    if matches!(
        cli.cmd,
        Cmd::Plan { .. } | Cmd::Schedule { .. } | Cmd::Checkpoint { .. } | Cmd::Report { .. }
    ) {
        quiet_on_closed_stdout();
    }
    // Not for `run`, a launcher started once per node by srun or mpirun:
    // it divides the node's cores among its own workers.
    if !matches!(cli.cmd, Cmd::Run { .. }) {
        launch::share_cores_under_external_launcher();
    }
    let code = match cli.cmd {
        Cmd::Run { launch, cmd } => launch::run(&launch, &cmd),
        Cmd::Train { opts, launch } => train::main(&opts, &launch),
        Cmd::Generate { opts } => generate::main(&opts),
        Cmd::Plan { opts } => plan::main(&opts),
        Cmd::TestWorker {
            die_rank,
            die_after_ms,
            iters,
        } => test_worker(die_rank, die_after_ms, iters),
        Cmd::Schedule {
            schedule,
            pp,
            micro_batches,
            comm,
        } => print_schedule(&schedule, pp, micro_batches, comm),
        Cmd::Checkpoint { what } => checkpoint_cmd::main(&what),
        Cmd::Report { opts } => report_cmd::main(&opts),
        Cmd::Lighthouse { args } => lighthouse::main(&args),
        Cmd::FtWorker { args } => lighthouse::worker(&args),
        Cmd::Tokenize { opts } => tokenize::main(&opts),
        Cmd::Bench {
            what: BenchCmd::Collectives { opts, launch },
        } => bench_collectives::main(&opts, &launch),
        Cmd::Bench {
            what: BenchCmd::Optimizer { opts },
        } => bench_optimizer::main(&opts),
    };
    std::process::exit(code);
}

fn test_worker(die_rank: Option<usize>, die_after_ms: u64, iters: usize) -> i32 {
    let pg = match phalanx_comm::init_process_group() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("init failed: {e}");
            return 1;
        }
    };
    let r = pg.rank();
    if let Err(e) = pg.barrier() {
        eprintln!("rank {r}: barrier failed: {e}");
        return 1;
    }
    // (Tests wait for this line to act on a rank past its set-up.)
    eprintln!("rank {r}: set up");
    let t0 = std::time::Instant::now();
    let mut x = vec![1.0f32; 1 << 20];
    for i in 0..iters {
        if Some(r) == die_rank && t0.elapsed().as_millis() as u64 >= die_after_ms {
            std::process::abort();
        }
        if let Err(e) = pg.all_reduce(&mut x, phalanx_comm::ReduceOp::Avg) {
            eprintln!(
                "rank {r}: failed at iteration {i} after {} ms: {e}",
                t0.elapsed().as_millis()
            );
            return 1;
        }
        if Some(r) == die_rank {
            std::thread::sleep(std::time::Duration::from_millis(die_after_ms / 4 + 1));
        }
    }
    println!("rank {r}: ok x[0]={}", x[0]);
    0
}

/// The most actions `phalanx schedule` prints (at most 3 per micro-batch
/// and chunk: a forward, and a backward or zero-bubble's two halves).
const SCHEDULE_MAX_ACTIONS: usize = 1 << 18;

fn print_schedule(kind: &str, pp: usize, m: usize, comm: bool) -> i32 {
    use phalanx::strategy::pipeline::{Costs, Schedule, ScheduleKind};
    let run = || -> phalanx::Result<()> {
        let kind: ScheduleKind = kind.parse()?;
        // The table holds every rank's actions: p x v chunks, each with m
        // forwards and m backwards (zero-bubble's split backward: 2m).
        // Beyond a quarter of a million nothing reads it.
        let actions = [pp, kind.chunks_per_rank(), m, 3]
            .iter()
            .try_fold(1usize, |a, &k| a.checked_mul(k));
        if actions.is_none_or(|a| a > SCHEDULE_MAX_ACTIONS) {
            return Err(phalanx::Error::Check(format!(
                "--pp {pp} x the schedule's chunks per rank ({}) x --micro-batches {m} is \
                 more than a printed table holds (at most {SCHEDULE_MAX_ACTIONS} actions)",
                kind.chunks_per_rank()
            )));
        }
        let s = Schedule::new(kind, pp, m)?;
        s.validate()?;
        if comm {
            println!("{s:#}");
        } else {
            println!("{s}");
        }
        let sim = s.simulate(&Costs::default())?;
        let bubble: Vec<String> = sim.bubble.iter().map(|b| format!("{b:.3}")).collect();
        println!(
            "valid; simulated bubble per rank [{}] (GPipe/1F1B theory (p-1)/(m+p-1) = {:.3})",
            bubble.join(", "),
            (pp - 1) as f64 / (m + pp - 1) as f64
        );
        Ok(())
    };
    match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("phalanx schedule: {e}");
            2
        }
    }
}
