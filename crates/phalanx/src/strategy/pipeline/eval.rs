//! Evaluation through the pipeline: each stage runs only its own chunks
//! (it holds only their parameters), activations travel forward as in
//! training, and the last chunk's loss reaches every stage.

use super::p2p::{self, Dir};
use super::Pipeline;
use crate::engine::Engine;
use crate::error::Result;
use candle_core::Tensor;
use phalanx_comm::ReduceOp;

/// The tag "step" of evaluation messages (training steps use the others).
const EVAL_STEP: u64 = 0xff_ffff;

impl Pipeline {
    /// Mean loss of one batch without autograd, on every stage.
    /// Collective over the pipeline group.
    pub fn eval_loss(&self, engine: &Engine, x: &Tensor, y: &Tensor) -> Result<f32> {
        let pp = self.mesh.pp();
        let p = pp.size();
        let n = self.chunks.len();
        let owner = |c: usize| c % p;
        let dev = engine.device().clone();
        let mut carried: Option<Tensor> = None;
        let mut loss = [0f64];
        for c in (0..n).filter(|&c| owner(c) == self.stage) {
            let input = if c == 0 {
                x.clone()
            } else if owner(c - 1) == self.stage {
                carried.take().expect("the previous chunk ran here")
            } else {
                let (th, td) = (
                    p2p::tag(EVAL_STEP, Dir::ActHeader, 0, c),
                    p2p::tag(EVAL_STEP, Dir::Act, 0, c),
                );
                p2p::post_act(pp, owner(c - 1), th, td).wait(pp, &dev)?
            };
            let last = c + 1 == n;
            let out = engine.stack().forward_eval(
                self.chunks[c].clone(),
                &input,
                last.then_some(y),
                engine.param_source(),
            )?;
            if last {
                loss[0] = out.to_scalar::<f32>()? as f64;
            } else if owner(c + 1) == self.stage {
                carried = Some(out);
            } else {
                let (th, td) = (
                    p2p::tag(EVAL_STEP, Dir::ActHeader, 0, c + 1),
                    p2p::tag(EVAL_STEP, Dir::Act, 0, c + 1),
                );
                p2p::send_tensor(pp, &out, owner(c + 1), td, Some(th))?;
            }
        }
        pp.all_reduce(&mut loss, ReduceOp::Sum)?;
        Ok(loss[0] as f32)
    }
}
