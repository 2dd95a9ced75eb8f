//! Rank 0's Prometheus endpoint: `GET /metrics` answers with every rank's
//! latest figures in the Prometheus / OpenMetrics text format, labelled by
//! rank and host (`prometheus-client` writes the format; [`super::http`]
//! serves it, bounded in what any client may cost, from a thread that
//! stops when the exporter is dropped).
//!
//! | metric | kind |
//! |---|---|
//! | `phalanx_step`, `phalanx_loss`, `phalanx_tokens_per_second`, `phalanx_step_seconds`, `phalanx_compute_seconds`, `phalanx_grad_norm` | gauge |
//! | `phalanx_comm_bytes_total` | counter |
//! | `phalanx_memory_bytes{kind=params/grads/optimizer/activations_peak/working_peak/peak_rss}` | gauge |
//! | `phalanx_mfu` (where the peak is known), `phalanx_loss_scale` (fp16) | gauge |
//! | `phalanx_straggler` (1 while the rank is one) | gauge |

use super::http::{Handler, Reply};
use super::{Figures, MEMORY_KINDS};
use crate::error::{Error, Result};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    rank: String,
    host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MemLabels {
    rank: String,
    host: String,
    kind: String,
}

type G = Family<RankLabels, Gauge<f64, AtomicU64>>;

struct Metrics {
    registry: Registry,
    gauges: Vec<(&'static str, G)>,
    comm: Family<RankLabels, Counter<u64>>,
    memory: Family<MemLabels, Gauge<f64, AtomicU64>>,
    mfu: G,
    loss_scale: G,
    straggler: G,
}

/// The gauges every rank has, with their help text.
const GAUGES: [(&str, &str); 6] = [
    ("phalanx_step", "The last step the rank finished (0-based)"),
    ("phalanx_loss", "Training loss of the last step"),
    (
        "phalanx_tokens_per_second",
        "Tokens per second of the last step (the whole job's batch over this rank's step time)",
    ),
    ("phalanx_step_seconds", "Wall time of the last step"),
    (
        "phalanx_compute_seconds",
        "The last step minus the time blocked in communication",
    ),
    ("phalanx_grad_norm", "Global gradient norm of the last step"),
];

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::default();
        let mut gauges = Vec::new();
        for (name, help) in GAUGES {
            let g = G::default();
            registry.register(name, help, g.clone());
            gauges.push((name, g));
        }
        let comm = Family::<RankLabels, Counter<u64>>::default();
        // The client appends `_total` to counters.
        registry.register("phalanx_comm_bytes", "Bytes sent to peers", comm.clone());
        let memory = Family::<MemLabels, Gauge<f64, AtomicU64>>::default();
        registry.register("phalanx_memory_bytes", "Memory by kind", memory.clone());
        let (mfu, loss_scale, straggler) = (G::default(), G::default(), G::default());
        registry.register(
            "phalanx_mfu",
            "Model FLOPs utilisation of the last step",
            mfu.clone(),
        );
        registry.register("phalanx_loss_scale", "fp16 loss scale", loss_scale.clone());
        registry.register(
            "phalanx_straggler",
            "1 while the rank is reported as a straggler",
            straggler.clone(),
        );
        Metrics {
            registry,
            gauges,
            comm,
            memory,
            mfu,
            loss_scale,
            straggler,
        }
    }
}

/// The running endpoint.
pub struct Exporter {
    metrics: Arc<Mutex<Metrics>>,
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    /// Bind `host:port` and serve in a thread.
    pub fn start(host: &str, port: u16) -> Result<Exporter> {
        let listener = std::net::TcpListener::bind((host, port)).map_err(|e| {
            // A port in use or reserved is the port's fault; a name that
            // does not resolve, or an address of another machine, the host's.
            let key = match e.kind() {
                std::io::ErrorKind::AddrInUse | std::io::ErrorKind::PermissionDenied => {
                    "monitor.prometheus_port"
                }
                _ => "monitor.prometheus_host",
            };
            Error::Io(format!("{key}: cannot serve metrics on {host}:{port}: {e}"))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Io(format!("the metrics server has no address: {e}")))?;
        let metrics = Arc::new(Mutex::new(Metrics::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, s) = (metrics.clone(), stop.clone());
        let handler: Handler = Arc::new(move |target: &str| reply(target, &m));
        let thread = std::thread::Builder::new()
            .name("phalanx-metrics".into())
            .spawn(move || super::http::serve(listener, s, handler))
            .map_err(|e| Error::Io(format!("cannot start the metrics thread: {e}")))?;
        Ok(Exporter {
            metrics,
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Publish every rank's figures.
    pub fn update(&self, ranks: &[Figures], hosts: &[String], stragglers: &[usize]) {
        let m = self.metrics.lock().unwrap();
        for (r, f) in ranks.iter().enumerate() {
            let l = RankLabels {
                rank: r.to_string(),
                host: hosts.get(r).cloned().unwrap_or_default(),
            };
            let vals = [
                f.step as f64,
                f.loss,
                f.tokens_per_s,
                f.step_s,
                f.compute_s,
                f.grad_norm,
            ];
            for ((_, g), v) in m.gauges.iter().zip(vals) {
                g.get_or_create(&l).set(v);
            }
            let c = m.comm.get_or_create(&l);
            let seen = c.get();
            c.inc_by(f.comm_bytes_total.saturating_sub(seen));
            for (k, (_, bytes)) in f.memory.iter().enumerate() {
                let ml = MemLabels {
                    rank: l.rank.clone(),
                    host: l.host.clone(),
                    kind: MEMORY_KINDS[k].into(),
                };
                m.memory.get_or_create(&ml).set(*bytes as f64);
            }
            if let Some(x) = f.mfu {
                m.mfu.get_or_create(&l).set(x);
            }
            if let Some(x) = f.loss_scale {
                m.loss_scale.get_or_create(&l).set(x);
            }
            m.straggler
                .get_or_create(&l)
                .set(stragglers.contains(&r) as u8 as f64);
        }
    }
}

/// The answer to a request for `target`.
fn reply(target: &str, m: &Mutex<Metrics>) -> Reply {
    if target != "/metrics" && !target.starts_with("/metrics?") {
        return Reply::text(404, "not found: the metrics are at /metrics\n");
    }
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &m.lock().unwrap().registry) {
        Ok(()) => Reply {
            status: 200,
            content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
            body: body.into_bytes(),
        },
        Err(_) => Reply::text(500, "encoding failed\n"),
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
