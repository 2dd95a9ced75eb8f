//! The gradient-reduction seam: where a ready bucket of gradients is handed
//! to communication. DDP (all-reduce), ZeRO-2/3 (reduce-scatter into the
//! owner's shard) and the pipeline's data-parallel axis all go through one
//! [`Reducer`]; what travels and how is a [`CommHook`] (PyTorch's
//! `register_comm_hook`): the default one reduces in `reduce_dtype`
//! (fp32, or bf16 / fp16 to halve the bytes, FSDP's `reduce_dtype`).
//!
//! A [`Bucket`] is a contiguous range of the flat gradient buffer that is
//! complete once block `ready_at` (its lowest block) has run its backward:
//! DDP's 25 MB buckets and ZeRO-3's per-block units are both buckets.
//!
//! ```
//! use phalanx::strategy::reduce::plan_buckets;
//! // Three blocks of 10, 20 and 30 floats; buckets of at most 100 bytes.
//! let ranges = vec![0..10, 10..30, 30..60];
//! let b = plan_buckets(&ranges, 100);
//! // Backward order: block 2 alone (120 B), then blocks 0-1 together (40 +
//! // 80 B): a bucket closes once it reaches the cap.
//! assert_eq!(b.iter().map(|b| b.range.clone()).collect::<Vec<_>>(), vec![30..60, 0..30]);
//! assert_eq!(b.iter().map(|b| b.ready_at).collect::<Vec<_>>(), vec![2, 0]);
//! // A cap of 0 gives one bucket per block (ZeRO-3's units).
//! assert_eq!(plan_buckets(&ranges, 0).len(), 3);
//! ```

use super::pool::Pool;
use crate::config::Precision;
use crate::error::Result;
use phalanx_comm::{ProcessGroup, ReduceOp, Work};
use std::ops::Range;

/// A contiguous range of the flat gradient buffer, ready when block
/// `ready_at` (its lowest block) has run its backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub range: Range<usize>,
    pub ready_at: usize,
}

/// Group blocks, last to first, into buckets of at least `cap` bytes (the
/// last bucket may be smaller). Empty blocks join their neighbours. A cap
/// of 0 makes every non-empty block its own bucket.
pub fn plan_buckets(block_ranges: &[Range<usize>], cap: usize) -> Vec<Bucket> {
    let mut out = Vec::new();
    let mut cur: Option<Bucket> = None;
    for (b, r) in block_ranges.iter().enumerate().rev() {
        let bucket = cur.get_or_insert(Bucket {
            range: r.clone(),
            ready_at: b,
        });
        bucket.range.start = r.start;
        bucket.ready_at = b;
        if bucket.range.len() * 4 >= cap.max(1) {
            out.push(cur.take().unwrap());
        }
    }
    if let Some(b) = cur {
        if !b.range.is_empty() || out.is_empty() {
            out.push(b);
        }
    }
    out
}

/// Which buckets backward has completed: blocks run their backward last to
/// first, so once block `b` is done every bucket whose lowest block is
/// `>= b` is complete. One cursor per micro-step.
#[derive(Debug, Default)]
pub struct ReadyCursor {
    next: usize,
}

impl ReadyCursor {
    /// The buckets that became complete when block `b` finished, in order.
    pub fn advance(&mut self, buckets: &[Bucket], b: usize) -> Range<usize> {
        let lo = self.next;
        while self.next < buckets.len() && buckets[self.next].ready_at >= b {
            self.next += 1;
        }
        lo..self.next
    }

    /// Error unless every bucket was launched.
    pub fn check_all(&self, buckets: &[Bucket], who: &str) -> Result<()> {
        if self.next == buckets.len() {
            Ok(())
        } else {
            Err(crate::error::Error::Check(format!(
                "{who}: only {} of {} gradient buckets were reduced",
                self.next,
                buckets.len()
            )))
        }
    }
}

/// How a bucket is reduced over the group.
#[derive(Debug, Clone, PartialEq)]
pub enum Collective {
    /// Every rank gets the average of the whole bucket.
    AllReduce,
    /// Rank r gets the average of its `counts[r]` elements (in rank order).
    ReduceScatter { counts: Vec<usize> },
}

/// A reduction in flight; `wait` gives this rank's averaged gradients.
pub struct Pending(Box<dyn FnOnce() -> Result<Vec<f32>> + Send>);

impl Pending {
    pub fn new(f: impl FnOnce() -> Result<Vec<f32>> + Send + 'static) -> Pending {
        Pending(Box::new(f))
    }
    /// A finished reduction.
    pub fn ready(v: Vec<f32>) -> Pending {
        Pending::new(move || Ok(v))
    }
    /// Wrap a communication `Work`.
    pub fn work(w: Work<Vec<f32>>) -> Pending {
        Pending::new(move || Ok(w.wait()?))
    }
    pub fn wait(self) -> Result<Vec<f32>> {
        (self.0)()
    }
}

/// One parameter inside a bucket (PyTorch's `GradBucket.parameters()`).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketParam {
    /// Start within the bucket's gradients, in elements.
    pub offset: usize,
    pub shape: Vec<usize>,
}

impl BucketParam {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a hook is told about the bucket it reduces: `id` is stable across
/// steps (for state kept per bucket: error feedback, warm starts), `params`
/// the parameters laid out in it (empty where the strategy does not say).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GradBucket {
    pub id: usize,
    pub params: Vec<BucketParam>,
}

/// The parameters of `layout` that lie inside each of `buckets`.
pub fn describe(layout: &crate::engine::Layout, buckets: &[Bucket]) -> Vec<GradBucket> {
    buckets
        .iter()
        .enumerate()
        .map(|(id, b)| GradBucket {
            id,
            params: layout
                .params()
                .iter()
                .filter(|p| p.offset >= b.range.start && p.offset + p.numel <= b.range.end)
                .map(|p| BucketParam {
                    offset: p.offset - b.range.start,
                    shape: p.shape.clone(),
                })
                .collect(),
        })
        .collect()
}

/// A communication hook: given a ready bucket's gradients (`grads`, f32,
/// this rank's local sum over its micro-batches) and the group, start their
/// reduction (the average over the group) and return it in flight.
pub trait CommHook: Send {
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        grads: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending;

    /// [`CommHook::reduce`] with buffers from `pool`: a hook that supports
    /// it takes its outputs from the pool and returns `grads` (taken from
    /// it) once sent, so that steady steps allocate nothing. The default
    /// reduces as `reduce` does, `grads` leaving the pool.
    fn reduce_pooled(
        &mut self,
        bucket: &GradBucket,
        grads: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
        pool: &Pool,
    ) -> Pending {
        pool.forget::<f32>(grads.capacity());
        self.reduce(bucket, grads, coll, pg)
    }

    /// Whether the hook is the plain f32 average of every gradient (the
    /// default hook in f32): then the reduction may run anywhere, on the
    /// device's own memory too. Any other hook runs on host buffers.
    fn is_plain_average(&self) -> bool {
        false
    }

    /// What the hook carries from one step to the next (error-feedback
    /// residuals, warm starts, the step counts a schedule reads), as named
    /// f32 arrays, this rank's own. Checkpoints save it per rank, so that a
    /// run resumed with [`CommHook::load_state`] continues bitwise as the
    /// one that never stopped. Called between steps (nothing in flight). A
    /// hook without state keeps the default: none.
    fn state(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    /// Restore what [`CommHook::state`] gave (the same rank of the same
    /// layout saved it). A hook without state refuses any: what it would
    /// drop was somebody's error feedback.
    fn load_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        match state.first() {
            None => Ok(()),
            Some((name, _)) => Err(crate::error::Error::Check(format!(
                "this communication hook keeps no state, but the checkpoint holds `{name}` \
                 (saved with another parallel.comm_hook?)"
            ))),
        }
    }
}

/// The default hook: the collective in `dtype` (f32 as is; bf16 / fp16:
/// cast before sending and back after, dividing by the group size first so
/// that fp16 sums cannot overflow).
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultHook {
    pub dtype: Precision,
}

impl CommHook for DefaultHook {
    fn is_plain_average(&self) -> bool {
        self.dtype == Precision::Fp32
    }

    /// The pooled path on a pool of its own (its buffers freed with the
    /// reduction): the same values.
    fn reduce(
        &mut self,
        bucket: &GradBucket,
        grads: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
    ) -> Pending {
        let pool = Pool::new(&crate::ledger::Ledger::new());
        self.reduce_pooled(bucket, grads, coll, pg, &pool)
    }

    fn reduce_pooled(
        &mut self,
        _bucket: &GradBucket,
        grads: Vec<f32>,
        coll: &Collective,
        pg: &ProcessGroup,
        pool: &Pool,
    ) -> Pending {
        match self.dtype {
            Precision::Fp32 => Pending::work(launch_pooled(pg, grads, coll, ReduceOp::Avg, pool)),
            Precision::Bf16 => cast_reduce_pooled::<half::bf16>(pg, grads, coll, pool),
            Precision::Fp16 => cast_reduce_pooled::<half::f16>(pg, grads, coll, pool),
        }
    }
}

/// Start `coll` on `buf`: the reduce-scatter's output from `pool` and its
/// input returned there as soon as it is sent (an all-reduce works in
/// place).
fn launch_pooled<T: phalanx_comm::Element>(
    pg: &ProcessGroup,
    buf: Vec<T>,
    coll: &Collective,
    op: ReduceOp,
    pool: &Pool,
) -> Work<Vec<T>> {
    match coll {
        Collective::AllReduce => pg.all_reduce_async(buf, op),
        Collective::ReduceScatter { counts } => {
            let out = pool.take(counts.get(pg.rank()).copied().unwrap_or(0));
            let p = pool.clone();
            pg.reduce_scatter_into_async(buf, counts.clone(), op, out, move |v| p.put(v))
        }
    }
}

trait Half: phalanx_comm::Element + Copy {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl Half for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}
impl Half for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// The collective in half precision `T`: each gradient divided by the
/// group size (so that fp16 sums cannot overflow), cast, summed, and
/// widened back; buffers from `pool`.
fn cast_reduce_pooled<T: Half>(
    pg: &ProcessGroup,
    grads: Vec<f32>,
    coll: &Collective,
    pool: &Pool,
) -> Pending {
    let inv = 1.0 / pg.size() as f32;
    let mut buf: Vec<T> = pool.take(grads.len());
    for (b, &g) in buf.iter_mut().zip(&grads) {
        *b = T::from_f32(g * inv);
    }
    pool.put(grads);
    let w = launch_pooled(pg, buf, coll, ReduceOp::Sum, pool);
    let pool = pool.clone();
    Pending::new(move || {
        let h = w.wait()?;
        let mut out: Vec<f32> = pool.take(h.len());
        for (o, &x) in out.iter_mut().zip(&h) {
            *o = x.to_f32();
        }
        pool.put(h);
        Ok(out)
    })
}

/// Hands ready buckets to the hook and collects the results.
pub struct Reducer {
    pg: ProcessGroup,
    hook: Box<dyn CommHook>,
    inflight: Vec<(usize, Pending)>,
    /// What each bucket holds, by id (see [`Reducer::describe`]).
    described: std::collections::HashMap<usize, GradBucket>,
    /// Buffers for the hook ([`CommHook::reduce_pooled`]), when set.
    pool: Option<Pool>,
    /// The hook's state as it was before this step's first reduction
    /// ([`Reducer::settle`] restores it when the step is skipped).
    before: Option<Vec<(String, Vec<f32>)>>,
    /// Whether to keep `before` at all ([`Reducer::set_rollback`]).
    rollback: bool,
}

impl Reducer {
    pub fn new(pg: ProcessGroup, hook: Box<dyn CommHook>) -> Reducer {
        Reducer {
            pg,
            hook,
            inflight: Vec::new(),
            described: Default::default(),
            pool: None,
            before: None,
            rollback: true,
        }
    }

    /// Reduce through `pool` ([`CommHook::reduce_pooled`]): launched
    /// gradients should come from it, and what [`Reducer::wait_all`] gives
    /// may be returned to it.
    pub fn set_pool(&mut self, pool: Pool) {
        self.pool = Some(pool);
    }

    /// Tell hooks which parameters each bucket holds (from [`describe`]).
    pub fn describe(&mut self, buckets: Vec<GradBucket>) {
        self.described = buckets.into_iter().map(|b| (b.id, b)).collect();
    }

    /// Whether a step may still be skipped after its reduction (fp16's
    /// overflow, `train.on_nonfinite = "skip"`): only then is the hook's
    /// state copied before each step for [`Reducer::settle`] (a copy as
    /// large as the gradients for the error-feedback hooks). On by default.
    pub fn set_rollback(&mut self, on: bool) {
        self.rollback = on;
        if !on {
            self.before = None;
        }
    }

    /// Replace the communication hook (`register_comm_hook`).
    pub fn set_hook(&mut self, hook: Box<dyn CommHook>) {
        self.hook = hook;
        self.before = None;
    }

    /// The hook is the plain f32 average ([`CommHook::is_plain_average`]).
    pub fn plain_average(&self) -> bool {
        self.hook.is_plain_average()
    }

    /// The hook's state, for checkpoints ([`CommHook::state`]).
    pub fn hook_state(&self) -> Vec<(String, Vec<f32>)> {
        self.hook.state()
    }

    /// Restore the hook's state ([`CommHook::load_state`]).
    pub fn load_hook_state(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        self.before = None;
        self.hook.load_state(state)
    }

    /// End the step whose gradients this reducer's hook reduced: `applied`
    /// says whether the optimizer stepped on them. A step skipped (an fp16
    /// overflow, `train.on_nonfinite = "skip"`) or failed leaves the hook's
    /// state (error-feedback residuals, velocities, PowerSGD's Q, the
    /// reduction counts) as it was before the step, so that one bad step
    /// does not carry its inf or NaN into every later one and the run goes
    /// on as if the step had never been taken. Every strategy that reduces
    /// through a hook calls this once per step, after the finiteness
    /// verdict.
    pub fn settle(&mut self, applied: bool) -> Result<()> {
        match self.before.take() {
            Some(before) if !applied => self.hook.load_state(&before),
            _ => Ok(()),
        }
    }

    /// [`Reducer::settle`] after a step whose outcome is `out` (applied
    /// when it is `Ok` and not skipped), then `out` as it was.
    pub fn settled(
        &mut self,
        out: Result<crate::optim::step::StepOutcome>,
    ) -> Result<crate::optim::step::StepOutcome> {
        self.settle(matches!(&out, Ok(o) if !o.skipped))?;
        out
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Start reducing bucket `id`'s gradients.
    pub fn launch(&mut self, id: usize, grads: Vec<f32>, coll: &Collective) {
        let p = if self.pg.size() == 1 {
            // One rank: the average is the gradient itself (and its
            // reduce-scatter piece is all of it).
            Pending::ready(grads)
        } else {
            if self.rollback && self.before.is_none() {
                // The first reduction of the step: what to go back to if
                // the step is skipped (see `settle`).
                self.before = Some(self.hook.state());
            }
            let fallback;
            let bucket = match self.described.get(&id) {
                Some(b) => b,
                None => {
                    fallback = GradBucket {
                        id,
                        params: Vec::new(),
                    };
                    &fallback
                }
            };
            match &self.pool {
                Some(pool) => self.hook.reduce_pooled(bucket, grads, coll, &self.pg, pool),
                None => self.hook.reduce(bucket, grads, coll, &self.pg),
            }
        };
        self.inflight.push((id, p));
    }

    /// How many reductions are in flight.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Wait for every launched reduction, in launch order: (bucket id, this
    /// rank's reduced gradients).
    pub fn wait_all(&mut self) -> Result<Vec<(usize, Vec<f32>)>> {
        let mut out = Vec::with_capacity(self.inflight.len());
        let mut first_err = None;
        for (id, p) in self.inflight.drain(..) {
            // Wait for all, even after an error, so no work outlives the step.
            match p.wait() {
                Ok(v) => out.push((id, v)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}
