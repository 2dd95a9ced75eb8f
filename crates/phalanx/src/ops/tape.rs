//! Deferred weight gradients: the zero-bubble pipeline's W pass without
//! recomputation.
//!
//! ZB-H1 splits a block's backward into B (the input gradient, on the
//! critical path between stages) and W (the parameter gradients, run later
//! to fill the bubble). candle computes every gradient of a graph in one
//! `backward()`, so the engine runs B on a graph whose parameters are
//! constants, and each op of `phalanx::ops` whose weight is a constant, while
//! a tape is recording on this thread, hands in what its weight gradient
//! needs (for a linear: its input x and its output gradient dy) instead of
//! dropping that work. The W pass then runs the weight-gradient kernels on
//! the kept tensors: no block build and no forward again.
//!
//! The kernels are the ones the fused backward runs (same gemm calls, same
//! dtypes), so B then W gives the gradients of one backward: bit for bit for
//! a parameter used once, within rounding when one is used twice (there the
//! single backward sums the uses before adding them to the gradient buffer).
//!
//! Ops outside this crate can take part: implement [`DeferredGrad`] and call
//! [`defer`] from the op's `bwd` when the weight is not tracked.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use phalanx::ops::{linear, tape};
//! let dev = Device::Cpu;
//! let x = Var::new(&[[1f32, 2.]], &dev).unwrap();                  // (1, 2), tracked
//! let w = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &dev).unwrap(); // (3, 2), a constant
//! let y = linear(x.as_tensor(), &w, None).unwrap();
//! let (grads, deferred) = tape::recording(|| y.sum_all().unwrap().backward()).unwrap();
//! assert!(grads.get(x.as_tensor()).is_some());         // B: the input gradient
//! let dw = deferred[0].compute().unwrap();              // W: later, from the tape
//! assert_eq!(dw[0].0.id(), w.id());
//! assert_eq!(dw[0].1.to_vec2::<f32>().unwrap(), vec![vec![1., 2.]; 3]);
//! ```

use std::cell::RefCell;

use candle_core::{Result, Tensor};

/// One op's postponed weight-gradient work.
pub trait DeferredGrad: Send {
    /// `(weight as the op received it, its gradient)` for each weight of the
    /// op, the gradient in that weight's dtype and shape.
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>>;
    /// The tensors kept alive until [`DeferredGrad::compute`] (for the
    /// memory ledger).
    fn kept(&self) -> Vec<&Tensor>;
    /// Bytes kept outside tensors (a fused block's own buffers).
    fn kept_buffer_bytes(&self) -> usize {
        0
    }
    /// The weights [`DeferredGrad::accumulate_into`] writes, in its slot
    /// order; `None` (the default): the work only has `compute`.
    fn targets(&self) -> Option<Vec<&Tensor>> {
        None
    }
    /// Adds each target's gradient (f32, flat, the target's element count)
    /// straight into its slot of `slots` (a flat gradient buffer's ranges),
    /// instead of returning it as a fresh tensor for the caller to add: no
    /// temporary to zero, fill and add per weight. Called only when
    /// [`DeferredGrad::targets`] is `Some` and no target is fp16: an fp16
    /// weight's gradient is rounded to fp16 (`compute`), which is where an
    /// overflow becomes the inf the loss scaler skips on.
    fn accumulate_into(&self, slots: Vec<&mut [f32]>) -> Result<()> {
        let _ = slots;
        candle_core::bail!("this deferred gradient has no accumulate_into (targets() is None)")
    }
}

/// Gradients already computed (a kernel that yields a weight's gradient
/// together with the input's, like the norms'): the W pass only adds them in.
pub struct Ready(pub Vec<(Tensor, Tensor)>);

impl DeferredGrad for Ready {
    fn compute(&self) -> Result<Vec<(Tensor, Tensor)>> {
        Ok(self.0.clone())
    }

    fn kept(&self) -> Vec<&Tensor> {
        self.0.iter().map(|(_, g)| g).collect()
    }
}

thread_local! {
    static TAPE: RefCell<Option<Vec<Box<dyn DeferredGrad>>>> = const { RefCell::new(None) };
}

/// Runs `f` (typically a `backward()`) with a tape recording on this
/// thread, and returns its result with what the ops deferred, in the order
/// they deferred it. Tapes do not nest: an inner call records its own.
pub fn recording<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Vec<Box<dyn DeferredGrad>>)> {
    // Restores the outer state on every exit path, panics included.
    struct Restore(Option<Vec<Box<dyn DeferredGrad>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            TAPE.with(|t| *t.borrow_mut() = outer);
        }
    }
    let outer = TAPE.with(|t| t.borrow_mut().replace(Vec::new()));
    let restore = Restore(outer);
    let out = f();
    let taken = TAPE.with(|t| t.borrow_mut().take()).unwrap_or_default();
    drop(restore);
    Ok((out?, taken))
}

thread_local! {
    static COLLECTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (the engine building a block whose backward it runs under a
/// tape) with [`will_collect`] true: a block may then build modules, like
/// the fused GPT-2 layer, whose parameter gradients leave only through the
/// tape. Outside it (plain candle autograd) they must not.
pub fn collected<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COLLECTED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(COLLECTED.with(|c| c.replace(true)));
    f()
}

/// Whether the module being built will have its backward run under a tape
/// whose deferred work is collected (see [`collected`]).
pub fn will_collect() -> bool {
    COLLECTED.with(|c| c.get())
}

/// Whether a tape is recording on this thread.
pub fn active() -> bool {
    TAPE.with(|t| t.borrow().is_some())
}

/// Hands `work` to the recording tape. Returns false (and drops it) when no
/// tape records: the caller then has nothing to do for an untracked weight.
pub fn defer(work: Box<dyn DeferredGrad>) -> bool {
    TAPE.with(|t| match t.borrow_mut().as_mut() {
        Some(tape) => {
            tape.push(work);
            true
        }
        None => false,
    })
}
