//! The environments cluster schedulers give a job, started on one host:
//! Kubeflow's PyTorchJob (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`,
//! `RANK`, no `LOCAL_RANK`) and Slurm's `srun` (`SLURM_PROCID`, ... and no
//! `MASTER_ADDR`: the first node of `SLURM_JOB_NODELIST`, a port from
//! `SLURM_JOB_ID`). Each starts a 2-rank `phalanx train` with the losses
//! `phalanx run` gives, bit for bit.

use crate::common;
use common::*;

use std::process::Command;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(240);
const SECRET: &str = "8899aabbccddeeff00112233445566778899aabbccddeeff0011223344556677";

/// Two `phalanx train` processes, rank r getting `env(r)`; their losses.
fn two_ranks(name: &str, env: impl Fn(usize) -> Vec<(String, String)>) -> Vec<(u64, u64)> {
    let d = fresh_dir("phalanx-cluster-env", name);
    let log = d.join("log.jsonl");
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let mut c = Command::new(BIN);
            c.current_dir(repo()).arg("train").args(train_args(&log, 5));
            for v in LAUNCHER_VARS {
                c.env_remove(v);
            }
            c.envs(env(r)).env("PHALANX_TIMEOUT", "60");
            std::thread::spawn(move || run_until(c, DEADLINE))
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let run = h.join().unwrap();
        assert_eq!(run.code, 0, "{name} rank {r}: {run}");
        if r == 0 {
            assert!(run.out.contains("on 2 rank(s) (dp 2"), "{name}: {run}");
        }
    }
    let got = losses(&log);
    let _ = std::fs::remove_dir_all(&d);
    got
}

fn kv(k: &str, v: impl ToString) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// A free port at or above `from`.
fn free_port_from(from: u16) -> u16 {
    (from..u16::MAX)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port")
}

#[test]
fn a_pytorchjobs_variables_start_a_two_rank_job() {
    let d = fresh_dir("phalanx-cluster-env", "ref-k8s");
    let want = reference_losses(&d, 5, &[]);
    let port = free_port_from(31000);
    // What the training operator sets in each pod (one rank per pod), and
    // the secret the manifest passes from a Kubernetes Secret.
    let got = two_ranks("pytorchjob", |r| {
        vec![
            kv("MASTER_ADDR", "127.0.0.1"),
            kv("MASTER_PORT", port),
            kv("WORLD_SIZE", 2),
            kv("RANK", r),
            kv("PYTHONUNBUFFERED", 1),
            kv("PHALANX_SECRET", SECRET),
        ]
    });
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(&d);
}

/// A PyTorchJob with `nprocPerNode: 2` over 2 pods: the operator gives
/// each pod RANK = its index and WORLD_SIZE = 4 beside torchrun's PET_*
/// flags, and the pod's command launches its 2 ranks as torchrun would
/// (it took itself for one rank of 4 and waited for ranks that never came).
#[test]
fn a_pytorchjob_with_nproc_per_node_launches_each_pods_ranks() {
    let d = fresh_dir("phalanx-cluster-env", "k8s-nproc");
    let log = d.join("log.jsonl");
    let port = free_port_from(31500);
    let pods: Vec<_> = (0..2)
        .map(|pod| {
            let mut c = Command::new(BIN);
            c.current_dir(repo()).arg("train").args(train_args(&log, 2));
            for v in LAUNCHER_VARS {
                c.env_remove(v);
            }
            c.envs([
                kv("MASTER_ADDR", "127.0.0.1"),
                kv("MASTER_PORT", port),
                kv("WORLD_SIZE", 4),
                kv("RANK", pod),
                kv("PET_NPROC_PER_NODE", 2),
                kv("PET_NNODES", 2),
                kv("PET_NODE_RANK", pod),
                kv("PHALANX_SECRET", SECRET),
            ])
            .env("PHALANX_TIMEOUT", "60");
            // Pod 1 has node 0's address as MASTER_ADDR / MASTER_PORT
            // only (as some operators give it): its launcher takes them,
            // not the loopback default and port 29500.
            if pod == 0 {
                c.envs([
                    kv("PET_MASTER_ADDR", "127.0.0.1"),
                    kv("PET_MASTER_PORT", port),
                ]);
            } else {
                c.env_remove("PET_MASTER_ADDR")
                    .env_remove("PET_MASTER_PORT");
            }
            std::thread::spawn(move || run_until(c, DEADLINE))
        })
        .collect();
    for (pod, h) in pods.into_iter().enumerate() {
        let run = h.join().unwrap();
        assert_eq!(run.code, 0, "pod {pod}: {run}");
        if pod == 0 {
            assert!(run.out.contains("on 4 rank(s) (dp 4"), "{run}");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn srun_variables_start_a_two_rank_job_without_master_addr() {
    let d = fresh_dir("phalanx-cluster-env", "ref-slurm");
    let want = reference_losses(&d, 5, &[]);
    // The store's port is 15000 + SLURM_JOB_ID % 10000: pick a job id whose port is free.
    let port = free_port_from(15000 + (std::process::id() % 9000) as u16);
    let job = 4_240_000 + (port - 15000) as u64;
    let got = two_ranks("srun", |r| {
        vec![
            kv("SLURM_PROCID", r),
            kv("SLURM_NTASKS", 2),
            kv("SLURM_LOCALID", r),
            kv("SLURM_NTASKS_PER_NODE", "2"),
            kv("SLURM_JOB_ID", job),
            kv("SLURM_STEP_ID", 0),
            kv("SLURM_JOB_NODELIST", "localhost"),
        ]
    });
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(&d);
}

/// Under srun, the store's address comes from the node list and its port
/// from the job id; a job whose first node is another host needs the secret.
#[test]
fn srun_takes_the_store_address_from_the_node_list_and_the_job_id() {
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--set", "train.steps=1"]);
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    c.env_remove("PHALANX_SECRET").envs([
        kv("SLURM_PROCID", 1),
        kv("SLURM_NTASKS", 2),
        kv("SLURM_LOCALID", 0),
        kv("SLURM_NTASKS_PER_NODE", "1(x2)"),
        kv("SLURM_JOB_ID", 987_654),
        kv("SLURM_STEP_ID", 1),
        // The step's nodes, not the allocation's, hold its task 0.
        kv("SLURM_STEP_NODELIST", "gpu[017-018]"),
        kv("SLURM_JOB_NODELIST", "gpu[001-018]"),
    ]);
    let r = run_until(c, DEADLINE);
    assert_eq!(r.code, 1, "{r}");
    assert!(
        r.err.contains("PHALANX_SECRET is not set") && r.err.contains("gpu017:22654"),
        "{r}"
    );
}

/// Under mpirun and srun (no `WORLD_SIZE`), the batch number a config
/// leaves to derive from `train.global_batch_size` is derived for the
/// job's world, as under torchrun: 16 = micro 4 x dp x accum.
#[test]
fn mpirun_and_srun_jobs_derive_the_batch_for_their_world() {
    for (env, accum) in [
        (
            vec![kv("OMPI_COMM_WORLD_RANK", 0), kv("OMPI_COMM_WORLD_SIZE", 2)],
            2,
        ),
        (
            vec![
                kv("SLURM_PROCID", 0),
                kv("SLURM_NTASKS", 4),
                kv("SLURM_STEP_ID", 0),
            ],
            1,
        ),
        // A step of 4 tasks in an allocation of 8: the step's count is
        // the world (8 would not divide 16 into micro-batches of 4).
        (
            vec![
                kv("SLURM_PROCID", 0),
                kv("SLURM_NTASKS", 8),
                kv("SLURM_STEP_NUM_TASKS", 4),
                kv("SLURM_STEP_ID", 3),
            ],
            1,
        ),
        (vec![kv("RANK", 0), kv("WORLD_SIZE", 4)], 1),
    ] {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).args([
            "train",
            "--print-config",
            "--set",
            "train.global_batch_size=16",
            "--set",
            "train.micro_batch_size=4",
        ]);
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        c.envs(env.clone());
        let r = run_until(c, DEADLINE);
        assert_eq!(r.code, 0, "{env:?}: {r}");
        assert!(
            r.out.contains(&format!("grad_accum_steps = {accum}\n")),
            "{env:?}: {r}"
        );
    }
}

/// An sbatch script's own shell has `SLURM_PROCID=0` and the allocation's
/// `SLURM_NTASKS` but no step id: `phalanx train` there is a single process
/// that launches its own local ranks, as without any Slurm variable (not
/// rank 0 of 8 waiting for seven ranks that never come).
#[test]
fn an_sbatch_shell_is_no_srun_step() {
    let print = |env: Vec<(String, String)>| {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).args([
            "train",
            "--print-config",
            "--set",
            "train.global_batch_size=64",
            "--set",
            "train.micro_batch_size=4",
        ]);
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        c.envs(env);
        let r = run_until(c, DEADLINE);
        assert_eq!(r.code, 0, "{r}");
        r.out
    };
    let alone = print(vec![]);
    let shell = print(vec![
        kv("SLURM_PROCID", 0),
        kv("SLURM_NTASKS", 8),
        kv("SLURM_LOCALID", 0),
        kv("SLURM_NTASKS_PER_NODE", 8),
        kv("SLURM_JOB_ID", 4242),
    ]);
    assert_eq!(shell, alone);
    let step = print(vec![
        kv("SLURM_PROCID", 0),
        kv("SLURM_NTASKS", 8),
        kv("SLURM_LOCALID", 0),
        kv("SLURM_NTASKS_PER_NODE", 8),
        kv("SLURM_JOB_ID", 4242),
        kv("SLURM_STEP_ID", 0),
    ]);
    // 64 = micro 4 x 8 ranks x accum 2.
    assert!(step.contains("grad_accum_steps = 2\n"), "{step}");
}

/// `phalanx train` started by another launcher (torchrun's RANK set, or
/// srun's variables) with launch flags on its command line says they are
/// that launcher's; a `PET_*` variable the pod inherits is no such flag.
#[test]
fn launch_flags_inside_another_launchers_job_get_a_note() {
    let d = fresh_dir("phalanx-cluster-env", "flags-in-job");
    let log = d.join("log.jsonl");
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(BIN);
        c.current_dir(repo())
            .arg("train")
            .args(train_args(&log, 1))
            .args(extra);
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        c.envs(env.iter().copied());
        run_until(c, DEADLINE)
    };
    let torch = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
    let r = run(&["--nproc-per-node", "4"], &torch);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.err.contains("a job torchrun started"), "{r}");
    assert!(r.err.contains("are that launcher's to give"), "{r}");
    // Under srun (no RANK): said as well.
    let srun = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_STEP_ID", "0"),
    ];
    let r = run(&["--nproc-per-node", "4"], &srun);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.err.contains("a job srun started"), "{r}");
    // (torchrun's "gpu", which a launching phalanx refuses, is no error
    // for a worker, which takes no launch flag.)
    let r = run(
        &[],
        &[&torch[..], &[("PET_NPROC_PER_NODE", "gpu")]].concat(),
    );
    assert_eq!(r.code, 0, "{r}");
    assert!(!r.err.contains("launcher's to give"), "{r}");
    let _ = std::fs::remove_dir_all(&d);
}

/// The config's notes are said once: by `phalanx train`'s launcher, not
/// again by rank 0 of the ranks it starts (a DeepSpeed file's warnings
/// likewise).
#[test]
fn config_notes_are_said_once() {
    let d = fresh_dir("phalanx-cluster-env", "said-once");
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", "2"])
        .args(train_args(&d.join("log.jsonl"), 2))
        .args(["--set", "optim.warmup_steps=5"]);
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    let r = run_until(c, DEADLINE);
    assert_eq!(r.code, 0, "{r}");
    let all = format!("{}{}", r.out, r.err);
    assert_eq!(all.matches("is not below train.steps").count(), 1, "{all}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A bad `PET_*` value in a launching pod is reported as the flag it stands
/// for and named as the variable (the pod's command line has no such flag);
/// `--help` still helps.
#[test]
fn a_bad_pet_variable_is_named() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(BIN);
        c.current_dir(repo()).args(args);
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        c.envs(env.iter().copied());
        run_until(c, DEADLINE)
    };
    // Refused by the flag's parser ...
    let r = run(&["train"], &[("PET_NPROC_PER_NODE", "abc")]);
    assert_eq!(r.code, 2, "{r}");
    assert!(
        r.err.contains("it came from PET_NPROC_PER_NODE=\"abc\""),
        "{r}"
    );
    // ... and by the launcher's check.
    let r = run(
        &["run", "--", "true"],
        &[("PET_NNODES", "x"), ("PET_NPROC_PER_NODE", "1")],
    );
    assert_eq!(r.code, 2, "{r}");
    assert!(r.err.contains("--nnodes x: expected"), "{r}");
    assert!(r.err.contains("it came from PET_NNODES=\"x\""), "{r}");
    assert!(!r.err.contains("PET_NPROC_PER_NODE"), "{r}");
    // Both flags of a message that names two are traced to their variables.
    let r = run(
        &["run", "--", "true"],
        &[
            ("PET_NNODES", "1"),
            ("PET_NODE_RANK", "3"),
            ("PET_NPROC_PER_NODE", "1"),
        ],
    );
    assert_eq!(r.code, 2, "{r}");
    assert!(
        r.err.contains("--node-rank 3 must be below --nnodes 1"),
        "{r}"
    );
    assert!(
        r.err.contains("it came from PET_NODE_RANK=\"3\"")
            && r.err.contains("it came from PET_NNODES=\"1\""),
        "{r}"
    );
    // A flag given on the command line wins, and is no variable's.
    let r = run(
        &["run", "--nnodes", "y", "--", "true"],
        &[("PET_NNODES", "x")],
    );
    assert_eq!(r.code, 2, "{r}");
    assert!(
        r.err.contains("--nnodes y") && !r.err.contains("PET_NNODES"),
        "{r}"
    );
    let r = run(&["train", "--help"], &[("PET_NPROC_PER_NODE", "abc")]);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("Usage"), "{r}");
}
