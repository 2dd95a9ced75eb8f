//! Activations and gradients between stages where they lie: on a GPU
//! through NCCL's point-to-point (`ncclSend` / `ncclRecv` on the tensor's
//! device memory, no copy through the host), on the CPU's device-generic
//! path through the same logic with host messages.
//!
//! NCCL's point-to-point has no tags: the messages between two ranks of a
//! communicator match in the order sent and received, and a send
//! completes only once its receive is posted. So each direction of each
//! pair of stages that exchange anything gets a group of its own (a
//! "link": its sender only sends on it, its receiver only receives, each
//! on a stream of its own, so a pending send never holds up anything
//! else), and a receiver posts its receives in the order its peer sends
//! (read from the peer's row of the schedule table, which every rank
//! holds), whatever order it consumes them in: to take a message, it
//! first posts every earlier one of that peer. A message's shape comes
//! first as a tagged header on the pipeline group (activations), or is
//! the shape of the activation the receiver sent (gradients).
//!
//! On host memory (the device-generic path) the data goes as a message
//! on the link tagged with its number on the link, so a receive posted
//! out of the sender's order would take another message's data, as on
//! NCCL, and the tests that compare the pipeline with one rank fail.
//! Sends on the device are held until complete, polled without waiting
//! at each send and awaited at the end of the step. Receives are posted
//! ahead ([`Links::post_ahead`], as far as the step's receive look-ahead
//! and what is known of their shapes allow), so on NCCL a transfer runs
//! as soon as its sender sends.

use std::collections::{BTreeSet, HashMap, VecDeque};

use candle_core::{DType, Device, Shape, Tensor};
use phalanx_comm::{bf16, f16, ProcessGroup, Work};

use super::p2p::{self, Dir};
use super::schedule::{Action, Schedule};
use crate::collective::start_p2p;
use crate::error::{Error, Result};

/// A message on a link: (direction, micro-batch, receiving chunk).
pub(super) type Key = (Dir, usize, usize);

/// One direction of one pair of stages.
struct Link {
    pg: ProcessGroup,
    /// The other stage's rank in `pg`.
    peer: usize,
    /// Messages so far (the host path's tags).
    seq: u64,
    /// Device sends not yet known to be complete: (tensor, mark).
    sending: VecDeque<(Tensor, u64)>,
}

/// A receive posted on a link.
enum Posted {
    Host(HostWork, Shape),
    Device(Tensor, u64),
}

enum HostWork {
    F32(Work<Vec<f32>>),
    BF16(Work<Vec<bf16>>),
    F16(Work<Vec<f16>>),
}

/// This stage's links, and what it receives on each, in its peer's order.
pub(super) struct Links {
    out: HashMap<usize, Link>,
    inp: HashMap<usize, Link>,
    /// Per peer stage, the messages it sends this stage in a step, in the
    /// order it sends them.
    plan: HashMap<usize, Vec<Key>>,
    /// Per peer stage, how many of them are posted this step.
    next: HashMap<usize, usize>,
    /// Per peer stage, how many of them were taken this step.
    taken: HashMap<usize, usize>,
    posted: HashMap<Key, Posted>,
    /// Activations' headers whose receives are posted (ahead of their
    /// data's).
    headers: HashMap<Key, Work<Vec<i64>>>,
}

/// The stage a chunk runs on.
fn owner(s: &Schedule, c: usize) -> usize {
    c % s.p
}

/// The message `a` sends, as (receiving stage, key); `None` for others.
fn sent(s: &Schedule, a: &Action) -> Option<(usize, Key)> {
    match *a {
        Action::SendAct { mb, chunk } => Some((owner(s, chunk + 1), (Dir::Act, mb, chunk + 1))),
        Action::SendGrad { mb, chunk } => Some((owner(s, chunk - 1), (Dir::Grad, mb, chunk - 1))),
        _ => None,
    }
}

impl Links {
    /// The links of `stage` for `schedule` over the pipeline group `pp`
    /// (its rank is the stage). Collective over `pp`: one group per
    /// ordered pair of stages that exchange anything, made in the same
    /// order everywhere; on a device, each link then carries one element
    /// each way, so that NCCL connects its pairs now (in one order on
    /// every rank: no cycle of waits) rather than inside a later send.
    pub fn new(
        pp: &ProcessGroup,
        schedule: &Schedule,
        stage: usize,
        dev: &Device,
    ) -> Result<Links> {
        let mut pairs = BTreeSet::new();
        let mut plan: HashMap<usize, Vec<Key>> = HashMap::new();
        for (from, row) in schedule.ranks.iter().enumerate() {
            for a in row {
                if let Some((to, key)) = sent(schedule, a) {
                    pairs.insert((from, to));
                    if to == stage {
                        plan.entry(from).or_default().push(key);
                    }
                }
            }
        }
        let (mut out, mut inp) = (HashMap::new(), HashMap::new());
        for &(a, b) in &pairs {
            let Some(pg) = pp.new_group(&[a, b])? else {
                continue;
            };
            // `new_group` orders its ranks: the lower stage is rank 0.
            let link = |peer_stage: usize| Link {
                pg: pg.clone(),
                peer: usize::from(peer_stage > stage),
                seq: 0,
                sending: VecDeque::new(),
            };
            if a == stage {
                out.insert(b, link(b));
            } else {
                inp.insert(a, link(a));
            }
        }
        let links = Links {
            out,
            inp,
            next: plan.keys().map(|&k| (k, 0)).collect(),
            taken: plan.keys().map(|&k| (k, 0)).collect(),
            plan,
            posted: HashMap::new(),
            headers: HashMap::new(),
        };
        if !dev.is_cpu() {
            // One hardware queue for every stream serialises the links'
            // kernels: a send waiting for its receive then holds up the
            // receive queued after it on another link, on both stages.
            let conns = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok();
            if let Some(n) = conns.as_deref().and_then(|v| v.trim().parse::<u32>().ok()) {
                if n < 4 {
                    eprintln!(
                        "phalanx: warning: CUDA_DEVICE_MAX_CONNECTIONS={n}: the pipeline's \
                         NCCL links (a stream per direction of each pair of stages) may wait \
                         on each other's queued kernels; unset it (CUDA's default is 8)"
                    );
                }
            }
            links.connect(&pairs, stage, dev)?;
        }
        Ok(links)
    }

    /// One element each way on every link, pair by pair in order.
    fn connect(&self, pairs: &BTreeSet<(usize, usize)>, stage: usize, dev: &Device) -> Result<()> {
        for &(a, b) in pairs {
            let link = match (a == stage, b == stage) {
                (true, _) => &self.out[&b],
                (_, true) => &self.inp[&a],
                _ => continue,
            };
            let t = Tensor::zeros(1, DType::F32, dev)?;
            let mark = start_p2p(&link.pg, &t, a == stage, link.peer)?;
            link.pg.settle_device_to(mark)?;
        }
        Ok(())
    }

    /// A new step: nothing of the last one may be left.
    pub fn begin_step(&mut self) -> Result<()> {
        if !self.posted.is_empty() || !self.headers.is_empty() {
            return Err(Error::Check(format!(
                "pipeline links: {} receives of the last step were never taken",
                self.posted.len() + self.headers.len()
            )));
        }
        self.next.values_mut().for_each(|n| *n = 0);
        self.taken.values_mut().for_each(|n| *n = 0);
        Ok(())
    }

    /// Send `t` to stage `to` (its header first, on `pp` with tag
    /// `header`, when given).
    pub fn send(
        &mut self,
        pp: &ProcessGroup,
        t: &Tensor,
        to: usize,
        header: Option<u64>,
    ) -> Result<()> {
        if let Some(th) = header {
            p2p::send_header(pp, t, to, th)?;
        }
        let link = self
            .out
            .get_mut(&to)
            .ok_or_else(|| Error::Check(format!("pipeline links: no link to stage {to}")))?;
        let flat = t.flatten_all()?.contiguous()?;
        if flat.device().is_cpu() {
            p2p::send_data(&link.pg, &flat, link.peer, link.seq)?;
        } else {
            // Let go of the sends already complete, without waiting.
            while let Some((_, m)) = link.sending.front() {
                if !link.pg.device_done(*m)? {
                    break;
                }
                link.sending.pop_front();
            }
            let mark = start_p2p(&link.pg, &flat, true, link.peer)?;
            link.sending.push_back((flat, mark));
        }
        link.seq += 1;
        Ok(())
    }

    /// Post, without waiting, the receives each peer's next messages
    /// need, up to `ahead` beyond those taken, as far as their shapes are
    /// known (a gradient's once this stage's activation was made, an
    /// activation's once its header is in): on NCCL the transfer then runs
    /// as soon as the peer sends, while this stage computes.
    pub fn post_ahead(
        &mut self,
        pp: &ProcessGroup,
        step: u64,
        dev: &Device,
        grad_shape: &dyn Fn(usize, usize) -> Option<(Shape, DType)>,
        ahead: usize,
    ) -> Result<()> {
        let mut peers: Vec<usize> = self.plan.keys().copied().collect();
        peers.sort_unstable();
        for from in peers {
            while self.next[&from] < self.taken[&from] + ahead
                && self.post_next(pp, from, step, dev, grad_shape, false)?
            {}
        }
        Ok(())
    }

    /// Post the receive of stage `from`'s next message, in its send order.
    /// Without `block`, only where its shape is known now (`Ok(false)`
    /// where not, or where none is left).
    fn post_next(
        &mut self,
        pp: &ProcessGroup,
        from: usize,
        step: u64,
        dev: &Device,
        grad_shape: &dyn Fn(usize, usize) -> Option<(Shape, DType)>,
        block: bool,
    ) -> Result<bool> {
        let n = self.next.get(&from).copied().unwrap_or(0);
        let Some(&k) = self.plan.get(&from).and_then(|p| p.get(n)) else {
            return match block {
                true => Err(Error::Check(format!(
                    "pipeline links: stage {from} sends no more messages this step"
                ))),
                false => Ok(false),
            };
        };
        let (dir, mb, c) = k;
        let (shape, dtype) = match dir {
            Dir::Grad => match (grad_shape(mb, c), block) {
                (Some(s), _) => s,
                (None, false) => return Ok(false),
                (None, true) => {
                    return Err(Error::Check(format!(
                        "pipeline links: the gradient {k:?} comes before its activation was made"
                    )))
                }
            },
            _ => {
                let tag = p2p::tag(step, Dir::ActHeader, mb, c);
                let w = self
                    .headers
                    .remove(&k)
                    .unwrap_or_else(|| p2p::post_header(pp, from, tag));
                if !block && !w.is_completed() {
                    self.headers.insert(k, w);
                    return Ok(false);
                }
                p2p::header_of(w)?
            }
        };
        let link = self
            .inp
            .get_mut(&from)
            .ok_or_else(|| Error::Check(format!("pipeline links: no link from stage {from}")))?;
        let posted = if dev.is_cpu() {
            let n = shape.elem_count();
            let (pg, peer, tag) = (&link.pg, link.peer, link.seq);
            let w = match dtype {
                DType::F32 => HostWork::F32(pg.recv_async(vec![0f32; n], peer, tag)),
                DType::BF16 => HostWork::BF16(pg.recv_async(vec![bf16::ZERO; n], peer, tag)),
                DType::F16 => HostWork::F16(pg.recv_async(vec![f16::ZERO; n], peer, tag)),
                d => return Err(Error::Check(format!("pipeline links: a {d:?} activation"))),
            };
            Posted::Host(w, shape)
        } else {
            let buf = Tensor::zeros(shape, dtype, dev)?;
            let mark = start_p2p(&link.pg, &buf, false, link.peer)?;
            Posted::Device(buf, mark)
        };
        link.seq += 1;
        self.posted.insert(k, posted);
        self.next.insert(from, n + 1);
        Ok(true)
    }

    /// Take message `key` from stage `from`, posting first every message
    /// that stage sends before it. `grad_shape(mb, chunk)` is the shape and
    /// dtype of the activation a gradient answers (this stage's output).
    pub fn recv(
        &mut self,
        pp: &ProcessGroup,
        from: usize,
        key: Key,
        step: u64,
        dev: &Device,
        grad_shape: &dyn Fn(usize, usize) -> Option<(Shape, DType)>,
    ) -> Result<Tensor> {
        while !self.posted.contains_key(&key) {
            self.post_next(pp, from, step, dev, grad_shape, true)?;
        }
        *self.taken.entry(from).or_default() += 1;
        let link = &self.inp[&from];
        match self.posted.remove(&key).expect("posted above") {
            Posted::Host(w, shape) => Ok(match w {
                HostWork::F32(w) => Tensor::from_vec(w.wait()?, shape, dev)?,
                HostWork::BF16(w) => Tensor::from_vec(w.wait()?, shape, dev)?,
                HostWork::F16(w) => Tensor::from_vec(w.wait()?, shape, dev)?,
            }),
            Posted::Device(buf, mark) => {
                link.pg.settle_device_to(mark)?;
                Ok(buf)
            }
        }
    }

    /// The end of a step: every send complete (its peer has taken it), and
    /// every message of the plan taken.
    pub fn end_step(&mut self) -> Result<()> {
        for link in self.out.values_mut() {
            if let Some((_, last)) = link.sending.back() {
                link.pg.settle_device_to(*last)?;
            }
            link.sending.clear();
        }
        let short = self
            .plan
            .iter()
            .find(|(from, keys)| self.next.get(from).copied().unwrap_or(0) != keys.len());
        if let Some((from, keys)) = short {
            return Err(Error::Check(format!(
                "pipeline links: {} of stage {from}'s {} messages were taken this step",
                self.next.get(from).copied().unwrap_or(0),
                keys.len()
            )));
        }
        if !self.posted.is_empty() || !self.headers.is_empty() {
            return Err(Error::Check(format!(
                "pipeline links: {} messages were received and never taken this step",
                self.posted.len() + self.headers.len()
            )));
        }
        Ok(())
    }
}

impl Drop for Links {
    /// Left in the middle of a step (a failure on the way): a send whose
    /// receive was never posted, or a receive whose send never comes,
    /// would hold its NCCL communicator's destroy forever, so those links
    /// are aborted, and their device buffers never given back to candle
    /// (a kernel may still be over them; the process is failing anyway).
    fn drop(&mut self) {
        for link in self.out.values_mut() {
            let open = link
                .sending
                .back()
                .is_some_and(|(_, m)| !link.pg.device_done(*m).unwrap_or(false));
            if open {
                link.pg
                    .abort("a pipeline link was let go with a send in flight");
                for (t, _) in link.sending.drain(..) {
                    std::mem::forget(t);
                }
            }
        }
        for (key, posted) in self.posted.drain() {
            if let Posted::Device(buf, _) = posted {
                let from = self
                    .plan
                    .iter()
                    .find(|(_, keys)| keys.contains(&key))
                    .map(|(from, _)| *from);
                if let Some(link) = from.and_then(|f| self.inp.get(&f)) {
                    link.pg
                        .abort("a pipeline link was let go with a receive in flight");
                }
                std::mem::forget(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::pipeline::schedule::ScheduleKind;

    /// The order stage `r` takes its messages in, and the order its peers
    /// send them (2 stages: one peer).
    fn orders(s: &Schedule, r: usize) -> (Vec<Key>, Vec<Key>) {
        let taken = s.ranks[r]
            .iter()
            .filter_map(|a| match *a {
                Action::RecvAct { mb, chunk } => Some((Dir::Act, mb, chunk)),
                Action::RecvGrad { mb, chunk } => Some((Dir::Grad, mb, chunk)),
                _ => None,
            })
            .collect();
        let sent = s
            .ranks
            .iter()
            .flat_map(|row| row.iter().filter_map(|a| sent(s, a)))
            .filter(|(to, _)| *to == r)
            .map(|(_, k)| k)
            .collect();
        (taken, sent)
    }

    #[test]
    fn interleaved_stages_take_messages_out_of_their_send_order() {
        // What makes links post in the sender's order: under interleaving
        // a stage takes its peer's messages in another order than they are
        // sent where the micro-batches are not a multiple of the stages (so
        // the device-generic interleaved run, 3 on 2, checks it), under
        // 1F1B in the same.
        let s = Schedule::new(ScheduleKind::Interleaved { v: 2 }, 2, 3).unwrap();
        assert!((0..2).any(|r| {
            let (taken, sent) = orders(&s, r);
            assert_eq!(taken.len(), sent.len());
            taken != sent
        }));
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4).unwrap();
        assert!((0..2).all(|r| {
            let (taken, sent) = orders(&s, r);
            taken == sent
        }));
    }
}
