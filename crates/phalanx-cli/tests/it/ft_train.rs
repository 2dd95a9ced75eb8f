//! `phalanx train` as replica groups of a fault-tolerant job
//! (`[fault_tolerance]`), each group a `phalanx train` process tree on this
//! host: groups of two ranks (DDP, ZeRO-2, ZeRO-3, TP, PP inside) reproduce a plain
//! four-rank job; a killed group (of one rank, and of two ranks under
//! ZeRO-2) does not stop the other, which never restarts and logs every
//! step once, and heals from it when started again, ending with
//! byte-identical weights; DiLoCo over a quorum equals DiLoCo in a plain
//! job bit for bit, a group lost during its inner steps drops out of
//! that outer step and heals at the next one, and an outer average that
//! failed on one group only heals it from the other.

use crate::common;
use common::ft::*;
use common::*;

use std::path::Path;
use std::process::Command;

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn sets(kv: &[String]) -> Vec<String> {
    kv.iter()
        .flat_map(|s| ["--set".to_string(), s.clone()])
        .collect()
}

/// The JSON log's lines.
fn log(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("no log at {}: {e}", p.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn loss_values(p: &Path) -> Vec<f64> {
    log(p).iter().map(|v| v["loss"].as_f64().unwrap()).collect()
}

/// A group's command line: the small model for `steps` steps, its JSON
/// log and final weights in `d`, and `extra` settings.
fn group_args(d: &Path, name: &str, steps: usize, extra: &[String]) -> Vec<String> {
    let mut a = train_args(&d.join(format!("{name}.jsonl")), steps);
    a.extend(sets(extra));
    a.extend([
        "--save-final".to_string(),
        d.join(format!("{name}.safetensors")).display().to_string(),
    ]);
    a
}

/// The same training as a plain job of `nproc` ranks: its losses and final
/// weights' bytes.
fn plain(
    d: &Path,
    nproc: usize,
    steps: usize,
    extra: &[String],
    threads: Option<usize>,
    env: &[(&str, &str)],
) -> (Vec<f64>, Vec<u8>) {
    let mut c = Command::new(BIN);
    if let Some(t) = threads {
        c.env("RAYON_NUM_THREADS", t.to_string());
    }
    c.envs(env.iter().copied());
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", &nproc.to_string()])
        .args(group_args(d, "plain", steps, extra));
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    let mut p = Proc::spawn(d, "plain", c);
    assert_eq!(p.wait(), 0, "{}", p.output());
    (
        loss_values(&d.join("plain.jsonl")),
        std::fs::read(d.join("plain.safetensors")).unwrap(),
    )
}

/// Two replica groups of `nproc` ranks, no failure: each group's losses
/// and final weights' bytes.
fn two_groups(
    d: &Path,
    nproc: usize,
    steps: usize,
    extra: &[String],
    threads: Option<usize>,
    env: &[(&str, &str)],
) -> [(Vec<f64>, Vec<u8>); 2] {
    let (_lh, addr) = lighthouse(d, "2");
    let grp = Group {
        nproc,
        addr: &addr,
        replicas: 2,
        fault: None,
        threads,
        env,
    };
    let mut g: Vec<Proc> = (0..2)
        .map(|i| {
            let name = format!("g{i}");
            grp.start(d, &name, i, &group_args(d, &name, steps, extra))
        })
        .collect();
    for p in g.iter_mut() {
        assert_eq!(p.wait(), 0, "{}", p.output());
    }
    [0, 1].map(|i| {
        (
            loss_values(&d.join(format!("g{i}.jsonl"))),
            std::fs::read(d.join(format!("g{i}.safetensors"))).unwrap(),
        )
    })
}

/// Groups of two ranks with `layout` inside reproduce the plain job of
/// four: each step's loss, the mean of the two groups' (each group logs
/// the mean over its own samples), within float tolerance; both groups
/// end with the same bytes.
fn groups_of_two_match_four_ranks(name: &str, layout: &[&str]) {
    groups_of_two_match_four_ranks_with(name, layout, &[]);
}

/// As [`groups_of_two_match_four_ranks`], every rank with `env` more.
fn groups_of_two_match_four_ranks_with(name: &str, layout: &[&str], env: &[(&str, &str)]) {
    let d = fresh_dir("phalanx-ft-train", name);
    let steps = 8;
    let layout = strs(layout);
    let (want, _) = plain(&d, 4, steps, &layout, None, env);
    let [(l0, w0), (l1, w1)] = two_groups(&d, 2, steps, &layout, None, env);
    assert_eq!((l0.len(), l1.len()), (steps, steps));
    for s in 0..steps {
        let got = (l0[s] + l1[s]) / 2.0;
        assert!(
            (got - want[s]).abs() <= 1e-5 * want[s].abs(),
            "{name} step {s}: groups {got} vs plain {}",
            want[s]
        );
    }
    assert!(w0 == w1, "{name}: the groups' final weights differ");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn replica_groups_of_two_ddp_ranks_match_a_four_rank_job() {
    groups_of_two_match_four_ranks("ddp", &[]);
}

/// The device-generic path (the one a GPU takes): there DDP would keep its
/// gradients on the device and average them in place, which the
/// cross-group average could not see; under fault tolerance the trainer
/// keeps them on the host (without that guard each group stepped on its
/// own gradients and this failed). ZeRO-1 likewise.
#[test]
fn replica_groups_on_the_device_generic_path_match_a_four_rank_job() {
    let generic = [("PHALANX_HOST_KERNELS", "0")];
    groups_of_two_match_four_ranks_with("ddp-generic", &[], &generic);
    groups_of_two_match_four_ranks_with("zero1-generic", &["zero_optimization.stage=1"], &generic);
}

#[test]
fn replica_groups_of_two_zero2_ranks_match_a_four_rank_job() {
    groups_of_two_match_four_ranks("zero2", &["zero_optimization.stage=2"]);
}

#[test]
fn replica_groups_of_two_zero3_ranks_match_a_four_rank_job() {
    groups_of_two_match_four_ranks("zero3", &["zero_optimization.stage=3"]);
}

#[test]
fn replica_groups_of_two_tensor_parallel_ranks_match_a_four_rank_job() {
    groups_of_two_match_four_ranks("tp2", &["parallel.tp=2"]);
}

#[test]
fn replica_groups_of_a_two_stage_pipeline_match_a_four_rank_job() {
    groups_of_two_match_four_ranks("pp2", &["parallel.pp=2", "train.grad_accum_steps=2"]);
}

/// Groups 0 and 1 of `grp` train `steps` steps with `extra`; group 1 (its
/// launcher and ranks) is SIGKILLed once group 0 printed `at`, and started
/// again once group 0 printed `alone` (training without it). Both end with
/// exit code 0, and group 0 trained once, logging every step once.
/// Returns group 0's and the restarted group 1's stdout, and group 0's log.
fn kill_and_restart(
    d: &Path,
    grp: &Group,
    steps: usize,
    extra: &[String],
    at: &str,
    alone: &str,
) -> (String, String, Vec<serde_json::Value>) {
    let mut a = grp.start(d, "a", 0, &group_args(d, "a", steps, extra));
    let mut b = grp.start(d, "b", 1, &group_args(d, "b", steps, extra));
    b.wait_for(" of 2 group(s) [0, 1]");
    a.wait_for(at);
    // `alone` may have been said already (a trained alone before b's
    // first quorum): wait for it to be said after the kill.
    let seen = a.stdout().matches(alone).count();
    b.signal_group(libc::SIGKILL);
    let _ = b.wait();
    a.wait_for_more(alone, seen);
    let mut b2 = grp.start(d, "b2", 1, &group_args(d, "b", steps, extra));
    assert_eq!(a.wait(), 0, "{}", a.output());
    assert_eq!(b2.wait(), 0, "{}", b2.output());
    let (oa, ob) = (a.stdout(), b2.stdout());
    assert_eq!(oa.matches("training ").count(), 1, "{oa}");
    let la = log(&d.join("a.jsonl"));
    let steps_a: Vec<u64> = la.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps_a, (0..steps as u64).collect::<Vec<_>>(), "{oa}");
    (oa, ob, la)
}

/// Group 1 (`nproc` ranks, `layout` inside) is killed mid-run and started
/// again; group 0 never restarts and logs every step once (with 2 groups,
/// then 1, then 2 again); group 1 heals from group 0 (checkpoints exist
/// but are not read) and both end with byte-identical final weights.
fn killed_group_heals(name: &str, nproc: usize, layout: &[&str]) {
    let d = fresh_dir("phalanx-ft-train", name);
    let (_lh, addr) = lighthouse(&d, "1");
    let steps = 60;
    let mut extra = strs(layout);
    extra.extend([
        // Every 5 steps the groups compare their states' digests.
        "parallel.check_params_every=5".to_string(),
        "checkpoint.interval=20".to_string(),
        format!("checkpoint.dir=\"{}\"", d.join("ckpt").display()),
    ]);
    // Slow enough that the kill lands mid-run and that the group started
    // again (a few seconds on a loaded machine) joins before the end.
    let grp = Group {
        nproc,
        addr: &addr,
        replicas: 2,
        fault: Some("slow:0:100"),
        threads: None,
        env: &[],
    };
    let (_, ob, la) = kill_and_restart(
        &d,
        &grp,
        steps,
        &extra,
        &format!("step    11/{steps}"),
        "of 1 group(s) [0]",
    );
    // Every step says how many groups' samples it committed.
    let mut runs: Vec<u64> = la
        .iter()
        .map(|v| v["groups_committed"].as_u64().unwrap())
        .collect();
    runs.dedup();
    assert!(runs.ends_with(&[2, 1, 2]), "{runs:?}");
    assert!(ob.contains("healed from group 0 at step "), "{ob}");
    // The bytes sent to the other group count: a step committed by two
    // one-rank groups sent its gradients across (they counted nothing).
    if nproc == 1 {
        let last = la.last().unwrap();
        assert_eq!(last["groups_committed"], 2, "{last}");
        assert!(last["comm_bytes"].as_u64().unwrap() > 0, "{last}");
    }
    let wa = std::fs::read(d.join("a.safetensors")).unwrap();
    let wb = std::fs::read(d.join("b.safetensors")).unwrap();
    assert!(wa == wb, "{name}: the healed group's final weights differ");
    // Each group keeps its own checkpoints under checkpoint.dir.
    for g in 0..2 {
        let dir = d.join(format!("ckpt/replica-{g}/step-{steps:08}"));
        assert!(dir.join("metadata.json").is_file(), "{}", dir.display());
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_killed_one_rank_group_does_not_stop_the_other_and_heals_from_it() {
    killed_group_heals("kill1", 1, &[]);
}

#[test]
fn a_killed_two_rank_zero2_group_does_not_stop_the_other_and_heals_from_it() {
    killed_group_heals("kill2", 2, &["zero_optimization.stage=2"]);
}

const DILOCO: &[&str] = &[
    "diloco.inner_steps=4",
    "diloco.outer_lr=0.7",
    "diloco.outer_momentum=0.9",
];

/// DiLoCo over a quorum of two one-rank groups is DiLoCo on two ranks of a
/// plain job: the same final weights, byte for byte, and each step's loss
/// (the plain job logs the groups' mean).
#[test]
fn diloco_over_a_quorum_equals_diloco_in_a_plain_job() {
    let d = fresh_dir("phalanx-ft-train", "diloco");
    let steps = 12;
    let cfg = strs(DILOCO);
    // One kernel thread per rank everywhere: the plain job's two ranks
    // would otherwise split the cores that each group has alone, and sum
    // their matmuls in another order.
    let (want, w) = plain(&d, 2, steps, &cfg, Some(1), &[]);
    let [(l0, w0), (l1, w1)] = two_groups(&d, 1, steps, &cfg, Some(1), &[]);
    // (The logs' decimal losses average to within a unit in the last place.)
    for s in 0..steps {
        let got = (l0[s] + l1[s]) / 2.0;
        assert!(
            (got - want[s]).abs() <= 1e-6 * want[s].abs(),
            "step {s}: {got} vs {}",
            want[s]
        );
    }
    assert!(w0 == w1, "the groups' final weights differ");
    assert!(
        w0 == w,
        "the groups' final weights differ from the plain job's"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// DiLoCo groups: group 1 is killed during its inner steps; group 0 takes
/// the next outer steps alone, never restarts and logs every step once;
/// group 1 started again joins at group 0's next outer step, healed from
/// it, and both end with byte-identical weights.
#[test]
fn a_diloco_group_lost_in_its_inner_steps_drops_out_and_heals_at_an_outer_step() {
    let d = fresh_dir("phalanx-ft-train", "diloco-kill");
    let (_lh, addr) = lighthouse(&d, "1");
    let steps = 60;
    let mut cfg = strs(DILOCO);
    cfg[0] = "diloco.inner_steps=5".into();
    // After every outer step the groups compare their states' digests.
    cfg.push("parallel.check_params_every=1".into());
    let grp = Group {
        nproc: 1,
        addr: &addr,
        replicas: 2,
        fault: Some("slow:0:100"),
        threads: None,
        env: &[],
    };
    let (_, ob, _) = kill_and_restart(
        &d,
        &grp,
        steps,
        &cfg,
        &format!("step    21/{steps}"),
        "over 1 of 1 group(s) [0]",
    );
    // b2 healed at an outer step (a multiple of H).
    let healed = ob
        .lines()
        .find_map(|l| l.split("healed from group 0 at step ").nth(1))
        .unwrap_or_else(|| panic!("no heal:\n{ob}"));
    let at: usize = healed.split_whitespace().next().unwrap().parse().unwrap();
    assert!(at > 21 && at.is_multiple_of(5), "healed at step {at}");
    let wa = std::fs::read(d.join("a.safetensors")).unwrap();
    let wb = std::fs::read(d.join("b.safetensors")).unwrap();
    assert!(wa == wb, "the healed group's final weights differ");
    let _ = std::fs::remove_dir_all(&d);
}

/// DiLoCo groups 0 and 1 (group 2 lost in its inner steps, so the outer
/// step after step 8 is over a changed quorum): the outer average completes
/// everywhere but fails on group 0 afterwards (a member lost at its very
/// end). Group 1 has applied the outer step, and its heal from group 0
/// fails; both retry at the same step. Group 1 is ahead and group 0 heals
/// from it, rather than both applying group 0's pseudo-gradient again (group
/// 1 twice) and going on apart, which the digest check after each outer
/// step would stop.
#[test]
fn an_outer_average_that_failed_on_one_group_only_heals_it_from_the_others() {
    let d = fresh_dir("phalanx-ft-train", "diloco-partial");
    // All three in the first quorum however far apart they start (a
    // loss is published at once; only additions wait).
    let (_lh, addr) = lighthouse_with(&d, "2", "5");
    let steps = 16;
    let mut cfg = strs(DILOCO);
    cfg.push("parallel.check_params_every=1".into());
    // Slow steps, so that group 2 joins before the first outer step
    // whenever it starts; it dies before step 5, after that outer step.
    let faults = [
        "lose-outer-average:8,slow:0:150",
        "slow:0:150",
        "exit-at-step:0:5,slow:0:150",
    ];
    let mut g: Vec<Proc> = faults
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let grp = Group {
                nproc: 1,
                addr: &addr,
                replicas: 3,
                fault: Some(f),
                threads: None,
                env: &[],
            };
            let name = format!("g{i}");
            grp.start(&d, &name, i, &group_args(&d, &name, steps, &cfg))
        })
        .collect();
    assert_eq!(g[2].wait(), 137, "{}", g[2].output());
    for p in g.iter_mut().take(2) {
        assert_eq!(p.wait(), 0, "{}", p.output());
    }
    let o0 = g[0].stdout();
    assert!(
        o0.contains("healed from group 1 at step 8 (was at step 8)"),
        "{}",
        g[0].output()
    );
    let w0 = std::fs::read(d.join("g0.safetensors")).unwrap();
    let w1 = std::fs::read(d.join("g1.safetensors")).unwrap();
    assert!(w0 == w1, "the groups' final weights differ");
    let _ = std::fs::remove_dir_all(&d);
}

/// DiLoCo groups 0 and 1 (at least 2 for a quorum): the outer average after
/// step 8 completes on both but fails on group 1 afterwards, while group 0,
/// its quorum unchanged, applies it, checkpoints step 8 and dies. Started
/// again from that checkpoint, group 0 has applied the outer step: group 1,
/// retrying the same step, heals from it rather than applying its own
/// pseudo-gradient alone beside it (the digest check would stop that).
#[test]
fn a_group_resumed_after_an_outer_step_heals_the_group_still_retrying_it() {
    let d = fresh_dir("phalanx-ft-train", "diloco-resumed");
    let (_lh, addr) = lighthouse_with(&d, "2", "5");
    let steps = 16;
    let mut cfg = strs(DILOCO);
    cfg.push("parallel.check_params_every=1".into());
    cfg.push("checkpoint.interval=4".into());
    let start = |name: &str, g: usize, fault: &str, extra: &[String]| {
        let grp = Group {
            nproc: 1,
            addr: &addr,
            replicas: 2,
            fault: Some(fault),
            threads: None,
            env: &[],
        };
        let mut c = cfg.clone();
        c.push(format!("checkpoint.dir=\"{}\"", d.join("ckpt").display()));
        let mut args = group_args(&d, &format!("g{g}"), steps, &c);
        args.extend(extra.iter().cloned());
        grp.start(&d, name, g, &args)
    };
    let mut g0 = start("g0", 0, "exit-at-step:0:8,slow:0:150", &[]);
    let mut g1 = start("g1", 1, "lose-outer-average:8,slow:0:150", &[]);
    assert_eq!(g0.wait(), 137, "{}", g0.output());
    let mut g0b = start("g0b", 0, "slow:0:150", &["--resume".into(), "auto".into()]);
    assert_eq!(g0b.wait(), 0, "{}", g0b.output());
    assert_eq!(g1.wait(), 0, "{}", g1.output());
    assert!(
        g0b.stdout().contains("step 8, saved by"),
        "resumed elsewhere:\n{}",
        g0b.output()
    );
    assert!(
        g1.stdout()
            .contains("healed from group 0 at step 8 (was at step 8)"),
        "{}",
        g1.output()
    );
    let w0 = std::fs::read(d.join("g0.safetensors")).unwrap();
    let w1 = std::fs::read(d.join("g1.safetensors")).unwrap();
    assert!(w0 == w1, "the groups' final weights differ");
    let _ = std::fs::remove_dir_all(&d);
}

/// A replica group of several ranks whose quorum timeout is not below the
/// collective timeout is refused before it waits: its other ranks would
/// time out in their broadcast while its first rank still waits for the
/// quorum, hiding the lighthouse's status.
#[test]
fn a_quorum_timeout_past_the_collective_timeout_is_refused() {
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", "2"])
        .args(sets(&strs(&[
            "train.steps=1",
            // Nothing listens there: the refusal comes first.
            "fault_tolerance.lighthouse=\"127.0.0.1:9\"",
            "fault_tolerance.quorum_timeout=30",
        ])))
        .env("PHALANX_SECRET", "00112233445566778899aabbccddeeff")
        .env("PHALANX_TIMEOUT", "20");
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    let r = run_until(c, std::time::Duration::from_secs(120));
    assert_ne!(r.code, 0, "{r}");
    assert!(
        r.err
            .contains("fault_tolerance.quorum_timeout = 30 s is not below the collective timeout"),
        "{r}"
    );
}

/// A group started without the lighthouse's `PHALANX_SECRET` is told to
/// export it (its launcher's own secret, made for its ranks, used to fail
/// the lighthouse's handshake as "peer does not hold the job secret").
#[test]
fn a_group_without_the_lighthouses_secret_is_told_to_export_it() {
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .args(["train", "--nproc-per-node", "1"])
        .args(sets(&strs(&[
            "train.steps=1",
            "fault_tolerance.lighthouse=\"127.0.0.1:9\"",
        ])))
        .env_remove("PHALANX_SECRET");
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    let r = run_until(c, std::time::Duration::from_secs(120));
    assert_ne!(r.code, 0, "{r}");
    assert!(
        r.err.contains("export the lighthouse's to every group"),
        "{r}"
    );
}

/// A group that trains with other settings (another learning rate) is
/// refused at its first quorum, naming the key, and the other goes on: at
/// the start every group is new, and the healer's (the first group's)
/// settings are the reference. (They used to train on, silently
/// diverging.) Both are in the first quorum (--min-replicas 2), so the
/// one left then waits for a second group, up to its quorum timeout.
#[test]
fn a_group_with_other_settings_is_refused_naming_the_key() {
    let d = fresh_dir("phalanx-ft-train", "settings");
    let (_lh, addr) = lighthouse(&d, "2");
    let grp = Group::one_rank_of_two(&addr);
    let quick = "fault_tolerance.quorum_timeout=3".to_string();
    let mut b = grp.start(
        &d,
        "b",
        1,
        &group_args(&d, "b", 30, &["optim.lr=0.01".to_string(), quick.clone()]),
    );
    let mut a = grp.start(&d, "a", 0, &group_args(&d, "a", 30, &[quick]));
    assert_ne!(b.wait(), 0, "{}", b.output());
    let _ = a.wait();
    let err = std::fs::read_to_string(&b.err).unwrap();
    assert!(
        err.contains("replica group 1 does not train with the settings of the quorum")
            && err.contains("optim.lr: group 1 0.01, group 0"),
        "{err}"
    );
    let err = std::fs::read_to_string(&a.err).unwrap();
    assert!(
        err.contains("warning: replica group 1 (new to the quorum) trains with other settings"),
        "{err}"
    );
}

/// A group that finishes tells the lighthouse, which drops it at once: a
/// group started right after it is in no quorum with it. A killed group
/// cannot say so: the lighthouse counts it until its heartbeat timeout (4 s
/// here), so the next group's first quorum counts it, and that group gives
/// the quorum up as soon as the lighthouse forms the next one without the
/// dead group, instead of waiting fault_tolerance.quorum_timeout (60 s
/// here) for it.
#[test]
fn a_finished_group_leaves_and_a_quorum_counting_a_killed_one_is_given_up() {
    let d = fresh_dir("phalanx-ft-train", "finished");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut lh = Proc::start(
        &d,
        "lighthouse",
        &[
            "lighthouse",
            "--bind",
            &addr,
            "--min-replicas",
            "1",
            "--heartbeat-timeout",
            "4",
            "--join-timeout",
            "0.3",
        ],
    );
    lh.wait_for("phalanx lighthouse at");
    let grp = Group::one_rank_of_two(&addr);
    let slow = ["fault_tolerance.quorum_timeout=60".to_string()];
    let mut a = grp.start(&d, "a", 0, &group_args(&d, "a", 2, &slow));
    assert_eq!(a.wait(), 0, "{}", a.output());
    let mut b = grp.start(&d, "b", 1, &group_args(&d, "b", 2, &slow));
    assert_eq!(b.wait(), 0, "{}", b.output());
    let out = b.output();
    assert!(
        !out.contains("given up") && !out.contains("never published"),
        "{out}"
    );
    // Killed at step 1: it leaves no word.
    let killed = Group {
        fault: Some("exit-at-step:0:1"),
        ..Group::one_rank_of_two(&addr)
    };
    let mut c = killed.start(&d, "c", 0, &group_args(&d, "c", 3, &slow));
    assert_ne!(c.wait(), 0, "{}", c.output());
    let mut e = grp.start(&d, "e", 1, &group_args(&d, "e", 2, &slow));
    assert_eq!(e.wait(), 0, "{}", e.output());
    let out = e.output();
    assert!(
        out.contains("given up") && !out.contains("never published"),
        "{out}"
    );
}
