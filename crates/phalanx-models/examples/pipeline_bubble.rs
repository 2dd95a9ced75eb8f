//! The measured pipeline bubble of each schedule against theory, on ranks
//! as threads: the share of each rank's step window spent idle, the median
//! over steps 1.. (step 0 warms up), next to the simulated bubble (F = 1,
//! B = 2 = I + W, free messages) and, for GPipe / 1F1B / interleaved, the
//! closed form (p-1)/(m+p-1), divided by v for v interleaved chunks (when
//! m is a multiple of p).
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run --release -p phalanx-models --example pipeline_bubble -- [p] [micro_batch] [steps] [m,m,..]
//! ```
//!
//! The model (4 layers, 128 wide, context 64) is large enough that compute
//! dominates messages on one host. Use one Rayon thread per rank (ranks are
//! threads here): the CPU's cores are shared by the p ranks.

use std::sync::Arc;

use candle_core::Device;
use phalanx::data::{DataLoader, LoaderConfig, TokenData};
use phalanx::mesh::DeviceMesh;
use phalanx::strategy::pipeline::{Pipeline, PipelineConfig, Schedule, ScheduleKind};
use phalanx_models::gpt2::{config, train::build_engine};

fn cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name = info
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let avx512 = info.contains(" avx512f");
    format!("{name}, AVX-512 {}", if avx512 { "yes" } else { "no" })
}

/// (p-1)/(m+p-1)/v where the closed form is known.
fn theory(kind: ScheduleKind, p: usize, m: usize) -> Option<f64> {
    let base = (p - 1) as f64 / (m + p - 1) as f64;
    match kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB => Some(base),
        // Megatron's form holds for m a multiple of p.
        ScheduleKind::Interleaved { v } if m.is_multiple_of(p) => Some(base / v as f64),
        ScheduleKind::Interleaved { .. } => None,
        ScheduleKind::ZbH1 => None,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let p: usize = arg(1, "2").parse().expect("p");
    let micro: usize = arg(2, "4").parse().expect("micro_batch");
    let steps: u64 = arg(3, "6").parse().expect("steps");
    let ms: Vec<usize> = arg(4, "1,2,4,8")
        .split(',')
        .map(|m| m.trim().parse().expect("m"))
        .collect();
    assert!(p >= 2 && steps >= 2, "p >= 2 ranks and steps >= 2");
    let sets: Vec<String> = vec![
        "model.n_layer=4".into(),
        "model.n_head=4".into(),
        "model.n_embd=128".into(),
        "model.block_size=64".into(),
    ];
    let cfg = config::build(None, &sets).expect("config");
    let t = cfg.seq_len().unwrap();
    let lc = LoaderConfig {
        seq_len: t,
        val_fraction: 0.0,
        shuffle: true,
        seed: 7,
        vocab_size: Some(256),
    };
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/corpus.txt");
    let tokens: Vec<u32> = std::fs::read(path).expect("the corpus")[..200_000]
        .iter()
        .map(|&b| b as u32)
        .collect();
    let data = Arc::new(DataLoader::new(TokenData::from_tokens(tokens), lc).unwrap());
    println!(
        "# {}; {p} ranks as threads, micro-batch {micro} x {t} tokens, median of steps 1..{steps}",
        cpu()
    );
    let ranks: String = (0..p).map(|r| format!("  bubble r{r}")).collect();
    println!("schedule          m{ranks}  simulated     theory  step ms");
    let kinds = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { v: 2 },
        ScheduleKind::ZbH1,
    ];
    for kind in kinds {
        for &m in &ms {
            if Schedule::new(kind, p, m).is_err() {
                println!("{:<15} {m:>3}  (no table for p = {p})", kind.to_string());
                continue;
            }
            let (cfg, data) = (cfg.clone(), data.clone());
            let out = phalanx_comm::threads::run(p, move |pg| {
                let mesh = DeviceMesh::new(&pg, 1, p, 1).unwrap();
                let mut engine = build_engine(&cfg).unwrap();
                let pc = PipelineConfig {
                    schedule: kind,
                    micro_batches: m,
                    trace_steps: steps as usize,
                    ..Default::default()
                };
                let mut pipe = Pipeline::new(&engine, &mesh, pc).unwrap();
                for step in 0..steps {
                    let mut batch = |a: usize| {
                        Ok(data
                            .micro_batch(step, 0, 1, a, micro, m)?
                            .to_tensors(&Device::Cpu)?)
                    };
                    pipe.forward_backward(&mut engine, &mut batch).unwrap();
                }
                let median = |mut v: Vec<f64>| {
                    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                    v[v.len() / 2]
                };
                let st = &pipe.timeline().steps()[1..];
                let b = median(st.iter().map(|s| s.bubble()).collect());
                (b, median(st.iter().map(|s| s.window_us / 1e3).collect()))
            });
            let sim = Schedule::new(kind, p, m).unwrap();
            let sim = sim.simulate(&Default::default()).unwrap().bubble[0];
            let measured: String = out.iter().map(|o| format!("  {:>9.3}", o.0)).collect();
            let th = theory(kind, p, m).map_or("-".into(), |x| format!("{x:.3}"));
            println!(
                "{:<15} {m:>3}{measured}  {sim:>9.3}  {th:>9}  {:>7.1}",
                kind.to_string(),
                out[0].1
            );
        }
    }
}
