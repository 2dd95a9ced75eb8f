//! Collectives started on tensors where they lie and waited for later, one
//! by one: under NCCL each is launched on the communicator's own stream
//! and the call returns, so candle's stream goes on (the backward of
//! earlier blocks) while it runs, and a wait for one waits for its event
//! alone (the ones started after it may still run).
//!
//! On host memory a started collective is not run when started but when
//! it is waited for, or when a later collective on its group runs through
//! this module ([`super::all_reduce_in_place`] and the others flush it
//! first; the group's own host calls and tensor parallelism's exchanges,
//! on other groups, do not): the order NCCL's stream would finish them
//! in. A `Started` stays on the thread that made it. The CPU then computes what a
//! GPU would, and code that read a started tensor before waiting for it
//! reads it unreduced there too, so the device-generic tests catch it.

use super::{check_counts, may_be_in_flight, run_op, Coll};
use crate::error::{Error, Result};
use candle_core::Tensor;
use phalanx_comm::{DeviceMode, ProcessGroup, ReduceOp};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A collective's kind and counts, kept until it runs.
enum Owned {
    AllReduce(ReduceOp),
    AllGather(Vec<usize>),
    ReduceScatter(ReduceOp, Vec<usize>),
}

impl Owned {
    fn coll(&self) -> Coll<'_> {
        match self {
            Owned::AllReduce(op) => Coll::AllReduce(*op),
            Owned::AllGather(c) => Coll::AllGather(c),
            Owned::ReduceScatter(op, c) => Coll::ReduceScatter(*op, c),
        }
    }
}

/// A collective on host memory, started and not yet run.
struct Deferred {
    id: u64,
    pg: ProcessGroup,
    t: Tensor,
    coll: Owned,
    ran: Arc<AtomicBool>,
}

thread_local! {
    /// This thread's started host collectives not yet run, in the order
    /// started, and the next one's number. A rank's collectives are started
    /// and waited for on its own thread.
    static DEFERRED: RefCell<(u64, VecDeque<Deferred>)> = const { RefCell::new((0, VecDeque::new())) };
}

/// Run, in the order started, this thread's started host collectives on
/// `pg` numbered up to `through` (every one: `None`). A failure drops the
/// rest of them unrun.
pub(super) fn flush(pg: &ProcessGroup, through: Option<u64>) -> Result<()> {
    let due: VecDeque<Deferred> = DEFERRED.with(|d| {
        let mut d = d.borrow_mut();
        let (due, keep): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut d.1)
            .into_iter()
            .partition(|op| op.pg.same_group(pg) && through.is_none_or(|k| op.id <= k));
        d.1 = keep;
        due
    });
    for op in due {
        run_op(&op.pg, &op.t, op.coll.coll(), DeviceMode::Wait)?;
        op.ran.store(true, Ordering::Release);
    }
    Ok(())
}

/// Forget started host collectives `ids` (a [`Started`] dropped without a
/// wait: a failure on the way; its peers fail at their waits, as the
/// trainer's abort makes them).
fn cancel(ids: &[u64]) {
    let _ = DEFERRED.try_with(|d| d.borrow_mut().1.retain(|op| !ids.contains(&op.id)));
}

/// How a started collective is waited for.
enum Ticket {
    /// On device memory: the group's mark for it.
    Device(u64),
    /// On host memory: its number in this thread's queue, and whether it
    /// ran.
    Host(u64, Arc<AtomicBool>),
}

/// Collectives started on tensors where they lie and not yet waited for
/// (see the module docs). [`Started::wait_first`] waits for the earliest
/// ones, [`Started::wait`] for all. Each tensor is held until it is waited
/// for (and, after a failure that may have left a kernel over it, never
/// given back to candle's allocator).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use phalanx_comm::{threads, ReduceOp};
/// let sums = threads::run(2, |pg| {
///     let mut started = phalanx::collective::Started::new(&pg);
///     for k in 0..3 {
///         let t = Tensor::new(&[(k + pg.rank()) as f32], &Device::Cpu).unwrap();
///         started.all_reduce(t, ReduceOp::Sum).unwrap();
///     }
///     // The first one, while the others may still run.
///     let mut out = started.wait_first(1).unwrap();
///     out.extend(started.wait().unwrap());
///     out.iter().map(|t| t.to_vec1::<f32>().unwrap()[0]).collect::<Vec<_>>()
/// });
/// assert_eq!(sums, vec![vec![1.0, 3.0, 5.0]; 2]);
/// ```
pub struct Started<'a> {
    pg: &'a ProcessGroup,
    /// The collectives started and not yet returned, in order.
    pending: VecDeque<(Tensor, Ticket)>,
    /// How many were returned before them.
    returned: usize,
    /// Not `Send`: host collectives wait in their thread's queue.
    _thread: PhantomData<*const ()>,
}

impl<'a> Started<'a> {
    pub fn new(pg: &'a ProcessGroup) -> Self {
        Started {
            pg,
            pending: VecDeque::new(),
            returned: 0,
            _thread: PhantomData,
        }
    }

    fn start(&mut self, t: Tensor, coll: Owned) -> Result<()> {
        let ticket = if t.device().is_cpu() {
            let ran = Arc::new(AtomicBool::new(false));
            let id = DEFERRED.with(|d| {
                let mut d = d.borrow_mut();
                let id = d.0;
                d.0 += 1;
                d.1.push_back(Deferred {
                    id,
                    pg: self.pg.clone(),
                    t: t.clone(),
                    coll,
                    ran: ran.clone(),
                });
                id
            });
            Ticket::Host(id, ran)
        } else {
            match run_op(self.pg, &t, coll.coll(), DeviceMode::Start)? {
                Some(mark) => Ticket::Device(mark),
                // A group of one off NCCL: the tensor is the result.
                None => Ticket::Host(u64::MAX, Arc::new(AtomicBool::new(true))),
            }
        };
        self.pending.push_back((t, ticket));
        Ok(())
    }

    /// Start the all-reduce of `t` (contiguous, the caller's own, as for
    /// [`super::all_reduce_in_place`]); nothing may read or write it until
    /// a wait returns it.
    pub fn all_reduce(&mut self, t: Tensor, op: ReduceOp) -> Result<()> {
        self.start(t, Owned::AllReduce(op))
    }

    /// Start [`super::all_gather_in_place`] on `t`, as
    /// [`Started::all_reduce`].
    pub fn all_gather(&mut self, t: Tensor, counts: &[usize]) -> Result<()> {
        check_counts("all-gather", self.pg, &t, counts)?;
        self.start(t, Owned::AllGather(counts.to_vec()))
    }

    /// Start [`super::reduce_scatter_v_in_place`] on `t`, as
    /// [`Started::all_reduce`].
    pub fn reduce_scatter_v(&mut self, t: Tensor, counts: &[usize], op: ReduceOp) -> Result<()> {
        check_counts("reduce-scatter", self.pg, &t, counts)?;
        self.start(t, Owned::ReduceScatter(op, counts.to_vec()))
    }

    /// How many collectives were started, in all.
    pub fn len(&self) -> usize {
        self.returned + self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wait for the first `n` collectives started (the later ones may
    /// still run); returns those of them not returned before, done, in the
    /// order started.
    pub fn wait_first(&mut self, n: usize) -> Result<Vec<Tensor>> {
        let k = n.saturating_sub(self.returned).min(self.pending.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let due = || self.pending.iter().take(k).map(|(_, tk)| tk);
        let host = due()
            .filter_map(|tk| match tk {
                Ticket::Host(id, _) if *id != u64::MAX => Some(*id),
                _ => None,
            })
            .max();
        let mark = due()
            .filter_map(|tk| match tk {
                Ticket::Device(m) => Some(*m),
                _ => None,
            })
            .max();
        if let Some(id) = host {
            flush(self.pg, Some(id))?;
            let ran = due().all(|tk| match tk {
                Ticket::Host(_, ran) => ran.load(Ordering::Acquire),
                _ => true,
            });
            if !ran {
                // Dropped unrun by an earlier failure of the group.
                if let Some(e) = self.pg.failure() {
                    return Err(Error::Comm(e));
                }
                return Err(Error::Check(
                    "a started collective was dropped unrun by an earlier failure or shutdown of \
                     its group"
                        .into(),
                ));
            }
        }
        if let Some(m) = mark {
            let ts: Vec<Tensor> = self.pending.iter().map(|(t, _)| t.clone()).collect();
            settle(self.pg, Some(m), &ts)?;
        }
        self.returned += k;
        Ok(self.pending.drain(..k).map(|(t, _)| t).collect())
    }

    /// Wait for every collective started; those not returned before, done,
    /// in the order started.
    pub fn wait(mut self) -> Result<Vec<Tensor>> {
        let n = self.len();
        self.wait_first(n)
    }
}

impl Drop for Started<'_> {
    /// Left without a wait (a failure on the way): the host ones are not
    /// run; the device's memory may still be under a kernel until the
    /// group settles.
    fn drop(&mut self) {
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter_map(|(_, tk)| match tk {
                Ticket::Host(id, _) => Some(*id),
                _ => None,
            })
            .collect();
        cancel(&ids);
        let on_device: Vec<Tensor> = self
            .pending
            .drain(..)
            .filter(|(_, tk)| matches!(tk, Ticket::Device(_)))
            .map(|(t, _)| t)
            .collect();
        if !on_device.is_empty() {
            let _ = settle(self.pg, None, &on_device);
        }
    }
}

/// Wait for `pg`'s started device collectives up to `mark` (all: `None`);
/// after a failure that may have left a kernel over `tensors`, keep them
/// from candle's allocator.
fn settle(pg: &ProcessGroup, mark: Option<u64>, tensors: &[Tensor]) -> Result<()> {
    let r = match mark {
        Some(m) => pg.settle_device_to(m),
        None => pg.settle_device(),
    };
    r.map_err(|e| {
        if may_be_in_flight(&e) {
            for t in tensors {
                std::mem::forget(t.clone());
            }
        }
        Error::Comm(e)
    })
}
