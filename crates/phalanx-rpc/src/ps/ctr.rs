//! A click-through-rate model on synthetic data with a known generating
//! model, for the `parameter_server` example and the tests.
//!
//! Each example has `fields` categorical features; field f's raw id is
//! drawn skewed (id = vocab * u^3, so a few ids are frequent and most are
//! rare, as in real logs) and hashed into a table of `rows` rows. The true
//! click probability is sigmoid(b* + sum_f w*(f, raw id)) with w* fixed
//! by a hash. The model: one embedding row of `dim` values per hashed id;
//! logit = b + sum_f (e_f[0] + <e_f[1..], v_f>), with dense v (per field,
//! dim-1 values) and b. Its gradients are written out by hand: the model
//! is small, and the example is about the parameter server.

use super::{mix, unit, Optim, PsConfig};
use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct CtrSpec {
    pub fields: usize,
    /// Raw ids per field.
    pub vocab: u64,
    /// Rows of the hashed embedding table.
    pub rows: u64,
    pub dim: usize,
    pub seed: u64,
}

/// `n` examples: `fields` row ids each, and labels (0 or 1).
pub struct Batch {
    pub ids: Vec<u64>,
    pub labels: Vec<f32>,
    /// The generating model's logits (for the best achievable loss).
    pub true_logits: Vec<f32>,
}

impl Batch {
    /// The generating model's own mean log loss on this batch: the floor
    /// a perfect fit reaches.
    pub fn bayes_loss(&self) -> f32 {
        let n = self.labels.len();
        let s: f32 = (0..n)
            .map(|i| bce(self.true_logits[i], self.labels[i]))
            .sum();
        s / n as f32
    }
}

/// A step's loss and gradients, rows aggregated per distinct id (in the
/// order of first appearance).
pub struct Grads {
    pub loss: f32,
    pub ids: Vec<u64>,
    pub rows: Vec<f32>,
    pub dense: Vec<f32>,
}

impl CtrSpec {
    pub fn dense_len(&self) -> usize {
        self.fields * (self.dim - 1) + 1
    }

    /// The servers' configuration: table `emb` and dense vector `vb`.
    pub fn ps_config(&self, trainers: usize, optim: Optim, staleness: Option<u64>) -> PsConfig {
        let init: Vec<f32> = (0..self.dense_len())
            .map(|i| {
                if i + 1 == self.dense_len() {
                    0.0
                } else {
                    (unit(mix(self.seed ^ 0xd3 ^ mix(i as u64))) * 2.0 - 1.0) * 0.5
                }
            })
            .collect();
        PsConfig::new(trainers, optim, staleness)
            .table("emb", self.dim, 0.05)
            .dense("vb", init)
            .seed(self.seed)
    }

    fn true_weight(&self, field: usize, raw: u64) -> f32 {
        let h = mix(self.seed ^ 0x7e ^ mix((field as u64) << 40 ^ raw));
        // Sum of four uniforms: roughly normal, standard deviation ~0.58.
        let s: f32 = (0..4).map(|k| unit(mix(h + k))).sum::<f32>() - 2.0;
        s * 1.4
    }

    /// Batch `step` of stream `stream` (a trainer), `n` examples.
    pub fn batch(&self, stream: u64, step: u64, n: usize) -> Batch {
        let mut h = mix(self.seed ^ mix(stream.wrapping_mul(0x1000_0001) ^ mix(step)));
        let mut next = || {
            h = mix(h);
            unit(h)
        };
        let mut ids = Vec::with_capacity(n * self.fields);
        let mut labels = Vec::with_capacity(n);
        let mut true_logits = Vec::with_capacity(n);
        for _ in 0..n {
            let mut logit = -0.5f32;
            for f in 0..self.fields {
                let u = next();
                let raw = ((u * u * u) * self.vocab as f32) as u64;
                logit += self.true_weight(f, raw);
                ids.push(mix((f as u64) << 48 ^ raw) % self.rows);
            }
            let p = 1.0 / (1.0 + (-logit).exp());
            labels.push(if next() < p { 1.0 } else { 0.0 });
            true_logits.push(logit);
        }
        Batch {
            ids,
            labels,
            true_logits,
        }
    }

    fn logit(&self, rows: &[f32], dense: &[f32], i: usize) -> f32 {
        let (d, f) = (self.dim, self.fields);
        let mut z = dense[dense.len() - 1];
        for k in 0..f {
            let e = &rows[(i * f + k) * d..(i * f + k + 1) * d];
            let v = &dense[k * (d - 1)..(k + 1) * (d - 1)];
            z += e[0] + e[1..].iter().zip(v).map(|(a, b)| a * b).sum::<f32>();
        }
        z
    }

    /// Mean log loss; `rows` holds the row of every id of `b`, in order.
    pub fn loss(&self, b: &Batch, rows: &[f32], dense: &[f32]) -> f32 {
        let n = b.labels.len();
        let total: f32 = (0..n)
            .map(|i| bce(self.logit(rows, dense, i), b.labels[i]))
            .sum();
        total / n as f32
    }

    /// Loss and gradients of the mean log loss.
    pub fn grads(&self, b: &Batch, rows: &[f32], dense: &[f32]) -> Grads {
        let (d, f, n) = (self.dim, self.fields, b.labels.len());
        let mut at: HashMap<u64, usize> = HashMap::new();
        let mut ids = Vec::new();
        let mut gr: Vec<f32> = Vec::new();
        let mut gd = vec![0.0f32; dense.len()];
        let mut loss = 0.0;
        for i in 0..n {
            let z = self.logit(rows, dense, i);
            loss += bce(z, b.labels[i]);
            let g = (1.0 / (1.0 + (-z).exp()) - b.labels[i]) / n as f32;
            gd[dense.len() - 1] += g;
            for k in 0..f {
                let id = b.ids[i * f + k];
                let slot = *at.entry(id).or_insert_with(|| {
                    ids.push(id);
                    gr.resize(gr.len() + d, 0.0);
                    ids.len() - 1
                });
                let e = &rows[(i * f + k) * d..(i * f + k + 1) * d];
                let v = &dense[k * (d - 1)..(k + 1) * (d - 1)];
                let ge = &mut gr[slot * d..(slot + 1) * d];
                ge[0] += g;
                for j in 0..d - 1 {
                    ge[1 + j] += g * v[j];
                    gd[k * (d - 1) + j] += g * e[1 + j];
                }
            }
        }
        Grads {
            loss: loss / n as f32,
            ids,
            rows: gr,
            dense: gd,
        }
    }
}

/// Binary cross-entropy of a logit, computed stably.
fn bce(z: f32, y: f32) -> f32 {
    z.max(0.0) - z * y + (-z.abs()).exp().ln_1p()
}
