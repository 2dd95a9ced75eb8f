//! The per-rank timeline of pipeline steps: when each pass ran (busy), how
//! long the rank waited, the measured bubble, and a Chrome / Perfetto trace
//! of every rank (open it at `ui.perfetto.dev` or `chrome://tracing`).
//!
//! A step's window runs from the barrier that starts it to the end of the
//! loss exchange that ends the schedule (every rank of the pipeline leaves it
//! together), so all ranks measure the same window; the bubble of a step is
//! `1 - busy / window`, busy being the sum of the forward and backward
//! passes. Gradient reductions after the schedule are recorded as events but
//! are outside the window.
//!
//! ```
//! use phalanx::strategy::pipeline::trace::{Event, EventKind, Timeline};
//! let mut t = Timeline::new(4);
//! t.begin_step(0);
//! t.record(Event { kind: EventKind::Forward, step: 0, mb: 0, chunk: 0, start_us: 0.0, dur_us: 30.0 });
//! t.end_step(100.0, 1, 0);
//! assert!((t.steps()[0].bubble() - 0.7).abs() < 1e-12);
//! ```

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use phalanx_comm::ProcessGroup;

use crate::error::{Error, Result};
use crate::mesh::Coords;

/// What an event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Forward,
    Backward,
    BackwardInput,
    BackwardWeight,
    /// Waiting for an activation to arrive.
    WaitAct,
    /// Waiting for a gradient to arrive.
    WaitGrad,
    SendAct,
    SendGrad,
    /// All-reduce of tied parameters' gradients over the pipeline.
    TieReduce,
    /// All-reduce of gradients over the data-parallel group.
    DpReduce,
    /// Data-parallel reductions (all-reduces, ZeRO-1's reduce-scatters)
    /// started inside a backward (no duration: they run on the
    /// communicator's stream; `DpReduce` waits for them).
    DpLaunch,
}

const KINDS: [EventKind; 11] = [
    EventKind::Forward,
    EventKind::Backward,
    EventKind::BackwardInput,
    EventKind::BackwardWeight,
    EventKind::WaitAct,
    EventKind::WaitGrad,
    EventKind::SendAct,
    EventKind::SendGrad,
    EventKind::TieReduce,
    EventKind::DpReduce,
    EventKind::DpLaunch,
];

impl EventKind {
    /// A forward or backward pass (what counts as busy).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            EventKind::Forward
                | EventKind::Backward
                | EventKind::BackwardInput
                | EventKind::BackwardWeight
        )
    }

    fn code(self) -> f64 {
        KINDS.iter().position(|k| *k == self).unwrap() as f64
    }
}

/// One timed span on a rank. Times are microseconds since the pipeline was
/// built (a barrier aligns the ranks' origins).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub kind: EventKind,
    pub step: u64,
    pub mb: usize,
    /// The rank's local chunk index (0 unless interleaved).
    pub chunk: usize,
    pub start_us: f64,
    pub dur_us: f64,
}

impl Event {
    /// `F3`, `I3`, `W3`, `B3` (`F3.1` for local chunk 1), `wait a3`, ...
    pub fn name(&self, v: usize) -> String {
        let c = if v > 1 {
            format!(".{}", self.chunk)
        } else {
            String::new()
        };
        let mb = self.mb;
        match self.kind {
            EventKind::Forward => format!("F{mb}{c}"),
            EventKind::Backward => format!("B{mb}{c}"),
            EventKind::BackwardInput => format!("I{mb}{c}"),
            EventKind::BackwardWeight => format!("W{mb}{c}"),
            EventKind::WaitAct => format!("wait act {mb}{c}"),
            EventKind::WaitGrad => format!("wait grad {mb}{c}"),
            EventKind::SendAct => format!("send act {mb}{c}"),
            EventKind::SendGrad => format!("send grad {mb}{c}"),
            EventKind::TieReduce => "all-reduce tied grads".into(),
            EventKind::DpReduce => "all-reduce dp grads".into(),
            EventKind::DpLaunch => format!("start dp reduction {mb}{c}"),
        }
    }
}

/// One step's summary on one rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// The schedule's window (see the module docs).
    pub window_us: f64,
    /// Time in forward and backward passes.
    pub busy_us: f64,
    /// Time blocked on receives (part of the idle time).
    pub wait_us: f64,
    /// Most (micro-batch, chunk) stashes held at once.
    pub peak_in_flight: usize,
    /// The ledger's peak of saved activations during the step.
    pub peak_activation_bytes: usize,
}

impl StepRecord {
    /// Idle fraction of the window.
    pub fn bubble(&self) -> f64 {
        if self.window_us <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy_us / self.window_us
    }

    pub fn idle_us(&self) -> f64 {
        self.window_us - self.busy_us
    }
}

/// The events and step summaries of one rank.
pub struct Timeline {
    epoch: Instant,
    steps: Vec<StepRecord>,
    events: VecDeque<Event>,
    /// Events are kept for this many recent steps (the trace's span).
    keep_steps: usize,
    current: StepRecord,
}

impl Timeline {
    /// A timeline whose clock starts now, keeping the events of the last
    /// `keep_steps` steps.
    pub fn new(keep_steps: usize) -> Timeline {
        Timeline {
            epoch: Instant::now(),
            steps: Vec::new(),
            events: VecDeque::new(),
            keep_steps: keep_steps.max(1),
            current: StepRecord::default(),
        }
    }

    /// Restart the clock (after a barrier, so that ranks share an origin).
    pub fn reset_epoch(&mut self) {
        self.epoch = Instant::now();
    }

    /// Microseconds since the origin.
    pub fn now_us(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    pub fn begin_step(&mut self, step: u64) {
        self.current = StepRecord {
            step,
            ..StepRecord::default()
        };
        while self
            .events
            .front()
            .is_some_and(|e| e.step + self.keep_steps as u64 <= step)
        {
            self.events.pop_front();
        }
    }

    pub fn record(&mut self, e: Event) {
        if e.kind.is_compute() {
            self.current.busy_us += e.dur_us;
        } else if matches!(e.kind, EventKind::WaitAct | EventKind::WaitGrad) {
            self.current.wait_us += e.dur_us;
        }
        self.events.push_back(e);
    }

    /// Close the step: its window, peak stashes and activation bytes.
    pub fn end_step(&mut self, window_us: f64, peak_in_flight: usize, peak_bytes: usize) {
        let mut r = std::mem::take(&mut self.current);
        r.window_us = window_us;
        r.peak_in_flight = peak_in_flight;
        r.peak_activation_bytes = peak_bytes;
        self.steps.push(r);
    }

    /// Every step so far.
    pub fn steps(&self) -> &[StepRecord] {
        &self.steps
    }

    /// The kept events, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    /// Idle / window over all steps but the first (warm-up: allocations,
    /// first-touch pages) when there are several.
    pub fn bubble_fraction(&self) -> Option<f64> {
        let s = if self.steps.len() > 1 {
            &self.steps[1..]
        } else {
            &self.steps[..]
        };
        let window: f64 = s.iter().map(|r| r.window_us).sum();
        let idle: f64 = s.iter().map(|r| r.idle_us()).sum();
        (window > 0.0).then(|| idle / window)
    }

    /// Most stashes held at once over all steps.
    pub fn peak_in_flight(&self) -> usize {
        self.steps
            .iter()
            .map(|s| s.peak_in_flight)
            .max()
            .unwrap_or(0)
    }
}

/// Gather every rank's events on rank 0 of `world` and write them there as
/// a Chrome trace (`pid` = world rank, `tid` 0 = passes, 1 = communication).
/// Collective over `world`.
pub fn write_chrome_trace(
    world: &ProcessGroup,
    coords: Coords,
    v: usize,
    timeline: &Timeline,
    path: &Path,
) -> Result<()> {
    let mut mine = vec![
        coords.pp as f64,
        coords.dp as f64,
        coords.tp as f64,
        v as f64,
    ];
    for e in timeline.events() {
        mine.extend([
            e.kind.code(),
            e.step as f64,
            e.mb as f64,
            e.chunk as f64,
            e.start_us,
            e.dur_us,
        ]);
    }
    let n = world.size();
    let mut counts = vec![0i64; n];
    world.all_gather(&[mine.len() as i64], &mut counts)?;
    let counts: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
    let mut all = vec![0f64; counts.iter().sum()];
    world.all_gather_v(&mine, &counts, &mut all)?;
    if world.rank() != 0 {
        return Ok(());
    }
    let mut out = String::from("{\"traceEvents\":[\n");
    let mut first = true;
    let mut at = 0;
    for (rank, &len) in counts.iter().enumerate() {
        let d = &all[at..at + len];
        at += len;
        let v = d[3] as usize;
        let sep = |first: &mut bool| if std::mem::take(first) { "" } else { ",\n" };
        let _ = write!(
            out,
            "{}{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank} (pp {}, dp {}, tp {})\"}}}}",
            sep(&mut first),
            d[0],
            d[1],
            d[2]
        );
        for e in d[4..].chunks_exact(6) {
            let ev = Event {
                kind: KINDS[e[0] as usize],
                step: e[1] as u64,
                mb: e[2] as usize,
                chunk: e[3] as usize,
                start_us: e[4],
                dur_us: e[5],
            };
            let tid = if ev.kind.is_compute() { 0 } else { 1 };
            if ev.kind == EventKind::DpLaunch {
                // A moment, not a span: an instant event on the comm row.
                let _ = write!(
                    out,
                    "{}{{\"name\":\"{}\",\"ph\":\"i\",\"s\":\"t\",\"ts\":{:.3},\"pid\":{rank},\"tid\":{tid},\"args\":{{\"step\":{}}}}}",
                    sep(&mut first),
                    ev.name(v),
                    ev.start_us,
                    ev.step
                );
                continue;
            }
            let _ = write!(
                out,
                "{}{{\"name\":\"{}\",\"ph\":\"X\",\"ts\":{:.3},\"dur\":{:.3},\"pid\":{rank},\"tid\":{tid},\"args\":{{\"step\":{}}}}}",
                sep(&mut first),
                ev.name(v),
                ev.start_us,
                ev.dur_us,
                ev.step
            );
        }
    }
    out.push_str("\n]}\n");
    // Whole or not at all (a temporary renamed over it).
    crate::fsutil::write_atomic(path, out.as_bytes())
        .map_err(|e| Error::Io(format!("writing the pipeline trace: {e}")))
}
