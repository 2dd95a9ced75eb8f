//! Options that name a choice are parsed once into enums: the same strings
//! as before are accepted, `to_toml()` writes canonical names that build
//! the same config again, and a bad value is an error naming its key.

use phalanx::config::{
    LrScheduleKind, OffloadDevice, OptimName, PpPartition, PpSchedule, ShardingStrategy,
    TrainConfig, WarmupType,
};
use phalanx::data::Tokenizer;
use phalanx::strategy::pipeline::ScheduleKind;

fn build(sets: &[&str]) -> Result<TrainConfig, String> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    TrainConfig::build(None, &sets).map_err(|e| e.to_string())
}

/// The config built again from its own TOML.
fn round_trip(c: &TrainConfig) -> TrainConfig {
    let dir = std::env::temp_dir().join(format!("phalanx-choices-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = dir.join(format!("{n}.toml"));
    std::fs::write(&p, c.to_toml()).unwrap();
    let back = TrainConfig::build(Some(&p), &[]).unwrap();
    std::fs::remove_file(&p).unwrap();
    back
}

#[test]
fn defaults_are_the_old_strings() {
    let c = build(&[]).unwrap();
    assert_eq!(c.data.tokenizer, Tokenizer::Byte);
    assert_eq!(c.optim.name, OptimName::AdamW);
    assert_eq!(c.optim.schedule, LrScheduleKind::Cosine);
    assert_eq!(c.optim.warmup_type, WarmupType::Linear);
    assert_eq!(c.parallel.sharding_strategy, ShardingStrategy::Unset);
    assert_eq!(
        c.parallel.pp_schedule,
        PpSchedule::new(ScheduleKind::OneFOneB)
    );
    assert_eq!(c.parallel.pp_partition, PpPartition::Balanced);
    assert_eq!(
        c.zero_optimization.offload_optimizer.device,
        OffloadDevice::None
    );
    let t = c.to_toml();
    for line in [
        "tokenizer = \"byte\"",
        "name = \"adamw\"",
        "schedule = \"cosine\"",
        "warmup_type = \"linear\"",
        "sharding_strategy = \"\"",
        "pp_schedule = \"1f1b\"",
        "pp_partition = \"balanced\"",
        "device = \"none\"",
    ] {
        assert!(t.lines().any(|l| l == line), "{line} not in\n{t}");
    }
    assert_eq!(round_trip(&c), c);
}

#[test]
fn every_choice_parses_and_round_trips() {
    let cases: &[&[&str]] = &[
        &[
            "data.tokenizer=gpt2",
            "optim.name=adam",
            "optim.schedule=warmup_linear",
        ],
        &[
            "optim.name=sgd",
            "optim.schedule=constant",
            "optim.warmup_type=log",
        ],
        &[
            "optim.schedule=warmup_constant",
            "parallel.sharding_strategy=shard_grad_op",
        ],
        &[
            "parallel.sharding_strategy=HYBRID_SHARD",
            "parallel.hybrid_shard_size=2",
        ],
        &[
            "parallel.sharding_strategy=No_Shard",
            "parallel.pp_schedule=gpipe",
        ],
        &[
            "parallel.pp_schedule=interleaved",
            "parallel.pp_partition=time",
        ],
        &[
            "parallel.pp_schedule=interleaved:4",
            "parallel.pp_partition=\"1, 2,3\"",
        ],
        &["parallel.pp_schedule=zb-h1", "parallel.pp_partition=[2, 2]"],
        &[
            "zero_optimization.stage=3",
            "zero_optimization.offload_param.device=nvme",
            "zero_optimization.offload_optimizer.device=cpu",
        ],
    ];
    for sets in cases {
        let c = build(sets).unwrap();
        assert_eq!(round_trip(&c), c, "{sets:?}");
    }
    let c = build(&["parallel.sharding_strategy=full_shard"]).unwrap();
    assert_eq!(c.parallel.sharding_strategy, ShardingStrategy::FullShard);
    assert_eq!(c.sharding().unwrap().stage, 3);
    let c = build(&[
        "parallel.pp_schedule=interleaved",
        "parallel.pp_virtual_stages=3",
    ])
    .unwrap();
    assert_eq!(
        c.parallel.pp_schedule.kind(c.parallel.pp_virtual_stages),
        ScheduleKind::Interleaved { v: 3 }
    );
    let c = build(&[
        "parallel.pp_schedule=interleaved:4",
        "parallel.pp_virtual_stages=3",
    ])
    .unwrap();
    assert_eq!(
        c.parallel.pp_schedule.kind(3),
        ScheduleKind::Interleaved { v: 4 }
    );
    let c = build(&["parallel.pp_partition=\"2,3,3\""]).unwrap();
    assert_eq!(c.parallel.pp_partition, PpPartition::Counts(vec![2, 3, 3]));
    assert!(c.to_toml().contains("pp_partition = \"2,3,3\""));
}

#[test]
fn bad_values_name_their_key() {
    let cases: &[(&str, &str)] = &[
        (
            "data.tokenizer=bpe",
            r#"data.tokenizer must be "byte", "gpt2" or the path of a Hugging Face tokenizer.json, not "bpe""#,
        ),
        (
            "optim.name=lion",
            r#"optim.name must be "adamw", "adam" or "sgd", not "lion""#,
        ),
        (
            "optim.schedule=onecycle",
            r#"optim.schedule must be "cosine", "constant", "warmup_constant" or "warmup_linear""#,
        ),
        (
            "optim.warmup_type=exp",
            r#"optim.warmup_type must be "linear" or "log", not "exp""#,
        ),
        (
            "parallel.sharding_strategy=PARTIAL",
            r#"parallel.sharding_strategy must be "FULL_SHARD""#,
        ),
        (
            "parallel.pp_schedule=pipedream2",
            r#"parallel.pp_schedule must be "gpipe""#,
        ),
        (
            "parallel.pp_schedule=interleaved:1",
            "parallel.pp_schedule must have at least 2 chunks",
        ),
        (
            "parallel.pp_partition=even",
            r#"parallel.pp_partition must be "balanced", "time" or block counts"#,
        ),
        (
            "zero_optimization.offload_param.device=disk",
            r#"zero_optimization.offload_param.device must be "none", "cpu" or "nvme", not "disk""#,
        ),
        (
            "zero_optimization.offload_optimizer.device=3",
            r#"zero_optimization.offload_optimizer.device must be"#,
        ),
    ];
    for (set, want) in cases {
        let e = build(&[set]).unwrap_err();
        assert!(e.contains(want), "{set}: {e}");
    }
}

#[test]
fn toml_files_give_the_same_choices() {
    let dir = std::env::temp_dir().join(format!("phalanx-choices-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("c.toml");
    std::fs::write(
        &p,
        "[data]\ntokenizer = \"gpt2\"\n[optim]\nname = \"sgd\"\n[parallel]\npp_schedule = \"GPipe\"\n",
    )
    .unwrap();
    let c = TrainConfig::build(Some(&p), &[]).unwrap();
    assert_eq!(
        (c.data.tokenizer, c.optim.name, c.parallel.pp_schedule),
        (
            Tokenizer::Gpt2.into(),
            OptimName::Sgd,
            PpSchedule::new(ScheduleKind::Gpipe)
        )
    );
    std::fs::write(&p, "[data]\ntokenizer = \"bpe\"\n").unwrap();
    let e = TrainConfig::build(Some(&p), &[]).unwrap_err().to_string();
    assert!(e.contains("data.tokenizer must be"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_device_is_a_setting_and_one_this_build_lacks_is_refused_up_front() {
    let c = build(&[]).unwrap();
    assert_eq!(c.train.device, phalanx::config::DeviceKind::Cpu);
    assert!(c.device().unwrap().is_cpu());
    assert_eq!(round_trip(&c).train.device, c.train.device);
    let e = build(&["train.device=\"cuda\""]).unwrap_err();
    assert!(
        e.contains("train.device = \"cuda\"") && e.contains("no CUDA backend"),
        "{e}"
    );
    let e = build(&["train.device=\"tpu\""]).unwrap_err();
    assert!(
        e.contains(r#"train.device must be "cpu" or "cuda", not "tpu""#),
        "{e}"
    );
}

/// A batch number left to derive from `train.global_batch_size` is not
/// printed (at its default it would read back as given, and the identity
/// check would fail on the job's world); read back, it is derived again.
#[test]
fn a_printed_config_leaves_out_the_batch_number_still_to_derive() {
    for (given, derived) in [
        ("train.micro_batch_size=4", "grad_accum_steps"),
        ("train.grad_accum_steps=2", "micro_batch_size"),
    ] {
        let c = build(&["train.global_batch_size=32", given]).unwrap();
        let t = c.to_toml();
        assert!(
            !t.lines().any(|l| l.starts_with(&format!("{derived} ="))),
            "{derived} printed:\n{t}"
        );
        let mut back = round_trip(&c);
        back.resolve_batch(2).unwrap();
        assert_eq!(back.global_batch(2), 32, "{given}");
        let mut c = c;
        c.resolve_batch(2).unwrap();
        assert_eq!(back.train.micro_batch_size, c.train.micro_batch_size);
        assert_eq!(back.train.grad_accum_steps, c.train.grad_accum_steps);
    }
}

/// `data.path` beside `[[data.sources]]` is refused naming both, also where
/// it names its default (which used to be ignored without a word).
#[test]
fn data_path_beside_sources_is_refused_even_as_its_default() {
    let sources = r#"data.sources=[{path="a.bin", weight=1.0}]"#;
    assert!(build(&[sources]).is_ok());
    for path in [r#"data.path="b.bin""#, r#"data.path="data/corpus.txt""#] {
        let e = build(&[sources, path]).unwrap_err();
        assert!(
            e.contains("and [[data.sources]] both name the training data; set one"),
            "{path}: {e}"
        );
    }
}
