//! A two-layer perceptron (tanh hidden layer) with its gradient written
//! out, and Adam: the policy and the baseline of the learner are this
//! small, and a hand-written pass costs microseconds where a tensor
//! library's dispatch would dominate.

/// Parameters, flat: W1 (hidden x inputs), b1, W2 (outputs x hidden), b2.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub inputs: usize,
    pub hidden: usize,
    pub outputs: usize,
    pub params: Vec<f32>,
}

impl Mlp {
    pub fn new(inputs: usize, hidden: usize, outputs: usize, rng: &mut super::Rng) -> Mlp {
        let n = hidden * inputs + hidden + outputs * hidden + outputs;
        let mut params = vec![0.0; n];
        let (s1, s2) = (1.0 / (inputs as f32).sqrt(), 1.0 / (hidden as f32).sqrt());
        for (i, p) in params.iter_mut().enumerate() {
            let s = if i < hidden * inputs + hidden { s1 } else { s2 };
            *p = (rng.uniform() * 2.0 - 1.0) * s;
        }
        Mlp {
            inputs,
            hidden,
            outputs,
            params,
        }
    }

    fn split(&self) -> (usize, usize, usize) {
        let w1 = self.hidden * self.inputs;
        (
            w1,
            w1 + self.hidden,
            w1 + self.hidden + self.outputs * self.hidden,
        )
    }

    /// Hidden activations and outputs for input `x`.
    pub fn forward(&self, x: &[f32], h: &mut Vec<f32>, out: &mut Vec<f32>) {
        forward(
            &self.params,
            self.inputs,
            self.hidden,
            self.outputs,
            x,
            h,
            out,
        )
    }

    /// Add the gradient for output gradient `dout` at input `x` (with the
    /// hidden activations `h` of that input) to `grad`.
    pub fn backward(&self, x: &[f32], h: &[f32], dout: &[f32], grad: &mut [f32]) {
        let (b1, w2, b2) = self.split();
        let (ni, nh) = (self.inputs, self.hidden);
        for o in 0..self.outputs {
            grad[b2 + o] += dout[o];
            for j in 0..nh {
                grad[w2 + o * nh + j] += dout[o] * h[j];
            }
        }
        for j in 0..nh {
            let dh: f32 = (0..self.outputs)
                .map(|o| self.params[w2 + o * nh + j] * dout[o])
                .sum();
            let dpre = dh * (1.0 - h[j] * h[j]);
            grad[b1 + j] += dpre;
            for i in 0..ni {
                grad[j * ni + i] += dpre * x[i];
            }
        }
    }
}

/// The forward pass over flat parameters (observers run it on the
/// parameters they received, without building an `Mlp`).
pub fn forward(
    p: &[f32],
    ni: usize,
    nh: usize,
    no: usize,
    x: &[f32],
    h: &mut Vec<f32>,
    out: &mut Vec<f32>,
) {
    let (b1, w2) = (nh * ni, nh * ni + nh);
    let b2 = w2 + no * nh;
    h.clear();
    for j in 0..nh {
        let s: f32 = (0..ni).map(|i| p[j * ni + i] * x[i]).sum::<f32>() + p[b1 + j];
        h.push(s.tanh());
    }
    out.clear();
    for o in 0..no {
        let s: f32 = (0..nh).map(|j| p[w2 + o * nh + j] * h[j]).sum::<f32>() + p[b2 + o];
        out.push(s);
    }
}

/// Adam (Kingma & Ba) over a flat parameter vector.
pub struct Adam {
    lr: f32,
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl Adam {
    pub fn new(n: usize, lr: f32) -> Adam {
        Adam {
            lr,
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        }
    }

    pub fn step(&mut self, p: &mut [f32], g: &[f32]) {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        self.t += 1;
        let (c1, c2) = (1.0 - b1.powi(self.t), 1.0 - b2.powi(self.t));
        for i in 0..p.len() {
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g[i] * g[i];
            p[i] -= self.lr * (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + eps);
        }
    }
}

/// Softmax of `z` into `p`.
pub fn softmax(z: &[f32], p: &mut Vec<f32>) {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    p.clear();
    p.extend(z.iter().map(|v| (v - m).exp()));
    let s: f32 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= s);
}
