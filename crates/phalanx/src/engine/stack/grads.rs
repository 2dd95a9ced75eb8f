//! How a backward's gradients reach their sink: candle's gradients of the
//! served parameters, and the weight gradients the ops deferred to a tape
//! (straight into the sink's buffer where both sides can). Off the CPU
//! kernels, a held backward keeps them on the device instead
//! ([`super::super::resident::HeldGrads`]).

use std::collections::{HashMap, HashSet};

use candle_core::{bail, DType, Result, TensorId};

use super::super::backend::Served;
use super::super::flat::GradSink;
use super::super::layout::ParamInfo;
use super::super::resident;
use super::Stack;
use crate::ops::cpu::{with_f32, with_f32_any};
use crate::ops::tape::DeferredGrad;

impl Stack {
    /// Runs deferred weight-gradient work and adds each gradient of a
    /// parameter (found by tensor id in `ids`) into `sink`, in the order the
    /// ops deferred it. Returns the parameters that got one. Work on a
    /// constant that is not a parameter is dropped (a single backward
    /// computes nothing for it either).
    pub(in crate::engine) fn accumulate_deferred<S: GradSink>(
        &self,
        work: Vec<Box<dyn DeferredGrad>>,
        ids: &HashMap<TensorId, usize>,
        sink: &mut S,
    ) -> Result<HashSet<usize>> {
        let mut got = HashSet::new();
        for w in work {
            // Straight into the sink's buffer when both sides can: the
            // work's weights all parameters here, the sink one f32 buffer.
            // fp16 weights keep `compute`, which rounds each gradient to
            // fp16: that rounding is where a gradient past 65504 becomes
            // the inf the loss scaler skips on. (bf16 has f32's range;
            // its gradients stay f32, more precise than rounded.)
            if let Some(ks) = w.targets().and_then(|ts| {
                ts.iter()
                    .map(|t| match t.dtype() {
                        DType::F16 => None,
                        _ => ids.get(&t.id()).copied(),
                    })
                    .collect::<Option<Vec<usize>>>()
            }) {
                let infos: Vec<&ParamInfo> = ks.iter().map(|&k| &self.layout.params()[k]).collect();
                if let Some(slots) = sink.slots(&infos) {
                    w.accumulate_into(slots)?;
                    got.extend(ks);
                    continue;
                }
            }
            for (t, g) in w.compute()? {
                let Some(&k) = ids.get(&t.id()) else { continue };
                with_f32_any(&g, |g| sink.accumulate(&self.layout.params()[k], g))??;
                got.insert(k);
            }
        }
        Ok(got)
    }

    /// Adds each served parameter's gradient (candle's, and what its ops
    /// deferred to `work`) into `sink`; a parameter with neither is an error
    /// naming it (and block `b`, when given).
    pub(super) fn accumulate_vars<S: GradSink>(
        &self,
        b: Option<usize>,
        served: &Served,
        grads: Option<&candle_core::backprop::GradStore>,
        work: Vec<Box<dyn DeferredGrad>>,
        sink: &mut S,
    ) -> Result<()> {
        let got = self.accumulate_deferred(work, &served.ids, sink)?;
        // Off the CPU kernels, a held backward keeps its gradients on the
        // device; the next one adds them in and reads the sum back.
        let on_device = !crate::ops::host_kernels(&self.device);
        let hold = on_device && self.held.holding();
        for (k, var) in &served.vars {
            let p = &self.layout.params()[*k];
            match grads.and_then(|g| g.get(var.as_tensor())) {
                Some(g) if hold => self.held.add(*k, g)?,
                Some(g) if on_device => {
                    let g = match self.held.take(*k) {
                        Some(h) => (h + g)?,
                        None => g.clone(),
                    };
                    resident::downloaded();
                    with_f32(&g, |g| sink.accumulate(p, g))??
                }
                Some(g) => with_f32(g, |g| sink.accumulate(p, g))??,
                None if got.contains(k) => {}
                None => {
                    let block = b.map_or(String::new(), |b| format!(" (block {b})"));
                    bail!(
                        "parameter `{}`{block} received no gradient: it is unused, or an op \
                         without backward (candle-nn's fused layer_norm/softmax_last_dim) cut it \
                         off; use phalanx::ops",
                        p.name
                    )
                }
            }
        }
        if on_device && !hold {
            // A parameter whose gradient came only through deferred work
            // this time still has its held sum read back.
            for (k, _) in &served.vars {
                if let Some(h) = self.held.take(*k) {
                    resident::downloaded();
                    with_f32(&h, |h| sink.accumulate(&self.layout.params()[*k], h))??;
                }
            }
        }
        Ok(())
    }
}
