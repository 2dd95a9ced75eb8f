//! A pipeline stage with its gradients on the device (here the CPU's
//! device-generic path: the CPU kernels off for this whole binary) starts
//! its data-parallel all-reduce bucket by bucket inside each chunk's last
//! backward, as DDP's device path does, not after the chunk: under 1F1B,
//! ZB-H1 (the W pass) and interleaved 1F1B on dp 2 x pp 2, every block's
//! bucket (`bucket_bytes = 0`) is started within the timeline's span of
//! that last backward, and the gradients match the same stage's with the
//! reductions after the schedule (`overlap_dp = false`) and the host
//! path's (the flat buffer), tied embedding included. So does ZeRO-1's
//! reduce-scatter, each dp rank's piece of every owned range (the tied
//! embedding summed over its stages after the schedule, then cut).

mod common;

use candle_core::Device;
use phalanx::config::TrainConfig;
use phalanx::engine::shard_range;
use phalanx::mesh::DeviceMesh;
use phalanx::ops::set_host_kernels;
use phalanx::strategy::pipeline::trace::{write_chrome_trace, EventKind};
use phalanx::strategy::pipeline::{Pipeline, PipelineConfig, ScheduleKind};
use phalanx_comm::ReduceOp;
use phalanx_models::gpt2::train::build_engine;

const MICRO: usize = 2;
const T: usize = 8;
const M: usize = 3;
const STEPS: u64 = 2;

/// A GPT-2 of 6 layers (8 blocks: the embedding, the layers, the head that
/// reads the embedding again): two blocks or more in every chunk.
fn config() -> TrainConfig {
    let sets: Vec<String> = vec![
        "model.n_layer=6".into(),
        "model.n_head=2".into(),
        "model.n_embd=16".into(),
        format!("model.block_size={T}"),
        "log.plot=\"\"".into(),
    ];
    phalanx_models::gpt2::config::build(None, &sets).unwrap()
}

/// How a stage reduces its gradients in one run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// On the device, each bucket started inside its chunk's last backward.
    Buckets,
    /// On the device, every range after the schedule.
    After,
    /// The host path: the flat gradient buffer.
    Host,
}

/// Per rank: every step's gradients of its owned ranges (averaged over
/// dp, tied parts summed over the stages), and the `DpLaunch` events that
/// fell outside their chunk's last backward (described), with how many fell
/// inside.
fn run(kind: ScheduleKind, path: Path, zero1: bool) -> Vec<(Vec<Vec<f32>>, Vec<String>, usize)> {
    let data = common::loader(T);
    phalanx_comm::threads::run(4, move |pg| {
        let cfg = config();
        let mesh = DeviceMesh::new(&pg, 2, 2, 1).unwrap();
        let mut engine = build_engine(&cfg).unwrap();
        let pc = PipelineConfig {
            schedule: kind,
            micro_batches: M,
            overlap_dp: path != Path::After,
            bucket_bytes: 0,
            ..Default::default()
        };
        let mut pipe = Pipeline::new(&engine, &mesh, pc).unwrap();
        let dp_rank = mesh.coords().dp;
        let mut grads = Vec::new();
        for step in 0..STEPS {
            let mut batch = |a: usize| {
                let b = data.micro_batch(step, dp_rank, 2, a, MICRO, M)?;
                Ok(b.to_tensors(&Device::Cpu)?)
            };
            let mut g = Vec::new();
            if path == Path::Host {
                pipe.forward_backward(&mut engine, &mut batch).unwrap();
                for r in pipe.owned_ranges() {
                    // ZeRO-1: this dp rank's piece of each.
                    let r = match zero1 {
                        true => {
                            let s = shard_range(r.len(), dp_rank, 2);
                            r.start + s.start..r.start + s.end
                        }
                        false => r.clone(),
                    };
                    g.extend_from_slice(&engine.grads_flat()[r]);
                }
            } else if zero1 {
                let (_, gs) = pipe
                    .forward_backward_scattered(&mut engine, &mut batch)
                    .unwrap();
                for t in gs.into_iter().flatten() {
                    g.extend(t.to_vec1::<f32>().unwrap());
                }
            } else {
                let (_, gs) = pipe
                    .forward_backward_on_device(&mut engine, &mut batch, false)
                    .unwrap();
                for t in gs {
                    g.extend(t.to_vec1::<f32>().unwrap());
                }
            }
            grads.push(g);
        }
        if path == Path::Buckets && !zero1 && kind == ScheduleKind::OneFOneB {
            // The starts in the Chrome trace: instants on the comm row.
            let f =
                std::env::temp_dir().join(format!("phalanx-buckets-{}.json", std::process::id()));
            let v = 1;
            write_chrome_trace(mesh.world(), mesh.coords(), v, pipe.timeline(), &f).unwrap();
            mesh.world().barrier().unwrap();
            let text = std::fs::read_to_string(&f).unwrap();
            let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
            let starts = trace["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["ph"] == "i" && e["tid"] == 1)
                .filter(|e| {
                    e["name"]
                        .as_str()
                        .unwrap()
                        .starts_with("start dp reduction")
                })
                .count();
            // Every rank's starts, once each.
            let mine = pipe
                .timeline()
                .events()
                .filter(|e| e.kind == EventKind::DpLaunch)
                .count();
            let mut all = [mine as f32];
            mesh.world().all_reduce(&mut all, ReduceOp::Sum).unwrap();
            assert!(
                mine > 0 && starts == all[0] as usize,
                "{starts} starts in the trace, {all:?} made"
            );
            mesh.world().barrier().unwrap();
            if pg.rank() == 0 {
                std::fs::remove_file(&f).unwrap();
            }
        }
        // Each DpLaunch against its chunk's last backward of that step.
        let events: Vec<_> = pipe.timeline().events().cloned().collect();
        let (mut outside, mut inside) = (Vec::new(), 0);
        for l in events.iter().filter(|e| e.kind == EventKind::DpLaunch) {
            let last = events
                .iter()
                .filter(|e| e.step == l.step && e.chunk == l.chunk)
                .filter(|e| matches!(e.kind, EventKind::Backward | EventKind::BackwardWeight))
                .max_by(|a, b| a.start_us.total_cmp(&b.start_us))
                .expect("a last backward");
            if l.start_us >= last.start_us && l.start_us <= last.start_us + last.dur_us {
                inside += 1;
            } else {
                outside.push(format!("{l:?} outside {last:?}"));
            }
        }
        (grads, outside, inside)
    })
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

#[test]
fn each_bucket_starts_inside_its_chunks_last_backward_and_the_gradients_match() {
    set_host_kernels(Some(false));
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved { v: 2 },
    ] {
        for zero1 in [false, true] {
            let buckets = run(kind, Path::Buckets, zero1);
            let after = run(kind, Path::After, zero1);
            let host = run(kind, Path::Host, zero1);
            for (rank, ((b, a), h)) in buckets.iter().zip(&after).zip(&host).enumerate() {
                assert!(b.1.is_empty(), "{kind:?} rank {rank}: {:?}", b.1);
                // Every local chunk's last backward, every step, started more
                // than one bucket (each block's), all inside it.
                let chunks = match kind {
                    ScheduleKind::Interleaved { v } => v,
                    _ => 1,
                };
                assert!(
                    b.2 >= 2 * chunks * STEPS as usize,
                    "{kind:?} rank {rank}: {} buckets started inside the last backwards",
                    b.2
                );
                assert_eq!(
                    a.2, 0,
                    "nothing is started inside a backward after the schedule"
                );
                for step in 0..STEPS as usize {
                    let (gb, ga, gh) = (&b.0[step], &a.0[step], &h.0[step]);
                    assert_eq!(gb.len(), ga.len());
                    let (e1, e2) = (rel(gb, ga), rel(gb, gh));
                    let what = format!("{kind:?} (ZeRO-1: {zero1}) rank {rank} step {step}");
                    assert!(e1 < 1e-6, "{what}: vs after {e1}");
                    assert!(e2 < 1e-5, "{what}: vs host {e2}");
                }
            }
        }
    }
    set_host_kernels(None);
}
