//! What the planner knows of a model: a decoder-only transformer of one of
//! two families, and from it the parameters of each block (whole, and on
//! one tensor-parallel rank), the activations a layer keeps per token, and
//! the training FLOPs per token.
//!
//! | | GPT-2 | Llama |
//! |---|---|---|
//! | layer | LayerNorms, `c_attn` (3C × C) + biases, `c_proj`, 4C MLP with biases: 12 C² + 13 C | 2 RMSNorms, q / o (Q × C), k / v (KV × C), SwiGLU gate / up / down (M × C), no biases |
//! | embedding | token (V × C) + positions (T × C) | token (V × C) |
//! | head | final LayerNorm; the token table tied | final RMSNorm + `lm_head` (V × C) unless tied |
//!
//! with Q = n_head × head_dim, KV = n_kv_head × head_dim, M the MLP width.
//!
//! ```
//! use phalanx::plan::{model_flops_per_token, ModelShape};
//! // Llama 3.2 1B: 16 layers, 32 heads over 8 kv heads, 2048 wide, MLP 8192, tied.
//! let m = ModelShape::llama(16, 32, 8, 2048, 64, 8192, 128256, 2048, true);
//! assert_eq!(m.num_params(), 1_235_814_400);
//! // 6 x (the matrices the tokens go through: layers and the head) + 12 L T Q.
//! let matmul = 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192) + 128256 * 2048;
//! assert_eq!(model_flops_per_token(&m), 6.0 * matmul as f64 + 12.0 * (16 * 2048 * 2048) as f64);
//! ```

/// The architecture family: what is in a layer besides its matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Learned positions, LayerNorms and biases, GELU MLP 4C wide, the
    /// head tied to the token table.
    Gpt2,
    /// Rotary positions (no table), RMSNorms, no biases, SwiGLU MLP,
    /// grouped-query attention, a head of its own unless tied.
    Llama,
}

/// A decoder-only transformer's shape, what the estimates need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    pub family: Family,
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (`n_head` without grouped-query attention).
    pub n_kv_head: usize,
    pub n_embd: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// The MLP's hidden width (4 C for GPT-2).
    pub mlp_hidden: usize,
    pub vocab_size: usize,
    /// Context length T of a training sample.
    pub seq_len: usize,
    /// The head's matrix is the token table.
    pub tied_embeddings: bool,
    /// A Llama-style layer's q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
}

impl ModelShape {
    pub fn gpt2(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        vocab_size: usize,
        seq_len: usize,
    ) -> Self {
        ModelShape {
            family: Family::Gpt2,
            n_layer,
            n_head,
            n_kv_head: n_head,
            n_embd,
            head_dim: n_embd / n_head.max(1),
            mlp_hidden: 4 * n_embd,
            vocab_size,
            seq_len,
            tied_embeddings: true,
            qkv_bias: false,
        }
    }

    /// A Llama: `head_dim` is the size of one head (n_embd / n_head unless
    /// the model sets it apart), `intermediate_size` the SwiGLU width.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        n_layer: usize,
        n_head: usize,
        n_kv_head: usize,
        n_embd: usize,
        head_dim: usize,
        intermediate_size: usize,
        vocab_size: usize,
        seq_len: usize,
        tied_embeddings: bool,
    ) -> Self {
        ModelShape {
            family: Family::Llama,
            n_layer,
            n_head,
            n_kv_head,
            n_embd,
            head_dim,
            mlp_hidden: intermediate_size,
            vocab_size,
            seq_len,
            tied_embeddings,
            qkv_bias: false,
        }
    }

    /// The same shape with (or without) q, k and v biases (Qwen2's layer).
    pub fn with_qkv_bias(self, qkv_bias: bool) -> Self {
        ModelShape { qkv_bias, ..self }
    }

    /// The q, k and v biases of one layer (0 without them).
    fn qkv_bias_params(&self) -> usize {
        if self.qkv_bias {
            self.q_dim() + 2 * self.kv_dim()
        } else {
            0
        }
    }

    /// Width of the queries (and of the attention output): n_head × head_dim.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the keys (and values): n_kv_head × head_dim.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Whether the layout splits key/value heads over `tp` ranks (else
    /// every rank holds them all: Llama with fewer kv heads than ranks).
    pub fn kv_split(&self, tp: usize) -> bool {
        self.family == Family::Gpt2 || self.n_kv_head >= tp
    }

    /// Whether the model can run on `tp` tensor-parallel ranks: the heads
    /// (and, for Llama, the MLP width and the kv heads, split or
    /// replicated) divide.
    pub fn tp_ok(&self, tp: usize) -> bool {
        let tp = tp.max(1);
        if !self.n_head.is_multiple_of(tp) {
            return false;
        }
        match self.family {
            Family::Gpt2 => true,
            Family::Llama => {
                self.mlp_hidden.is_multiple_of(tp)
                    && if self.kv_split(tp) {
                        self.n_kv_head.is_multiple_of(tp)
                    } else {
                        tp.is_multiple_of(self.n_kv_head.max(1))
                    }
            }
        }
    }

    /// The matrices of one layer (the parameters tokens are multiplied by).
    pub fn layer_matrix_params(&self) -> usize {
        let c = self.n_embd;
        2 * self.q_dim() * c + 2 * self.kv_dim() * c + self.mlp_matrices() * c * self.mlp_hidden
    }

    /// Matrices of the MLP: 2 for GPT-2 (fc, proj), 3 for SwiGLU.
    fn mlp_matrices(&self) -> usize {
        match self.family {
            Family::Gpt2 => 2,
            Family::Llama => 3,
        }
    }

    /// Parameters of one layer beside its matrices: GPT-2's biases and two
    /// LayerNorms (13 C with the 4C MLP), Llama's two RMSNorm weights (and
    /// Qwen2's q / k / v biases).
    fn layer_vector_params(&self) -> usize {
        let c = self.n_embd;
        match self.family {
            // ln_1, ln_2 (weight and bias), c_attn's bias (3C), the two
            // c_proj biases, c_fc's bias.
            Family::Gpt2 => 4 * c + self.q_dim() + 2 * self.kv_dim() + 2 * c + self.mlp_hidden,
            Family::Llama => 2 * c + self.qkv_bias_params(),
        }
    }

    /// Parameters of one transformer layer (GPT-2: 12 C² + 13 C).
    pub fn layer_params(&self) -> usize {
        self.layer_matrix_params() + self.layer_vector_params()
    }

    /// One layer's parameters on one of `tp` tensor-parallel ranks: the
    /// matrices split (Llama's k / v whole when its kv heads are
    /// replicated); GPT-2's column-parallel biases split, its row-parallel
    /// biases and LayerNorms replicated; norms replicated; q / k / v
    /// biases (Qwen2) as their matrices.
    pub fn layer_params_tp(&self, tp: usize) -> usize {
        let tp = tp.max(1);
        let c = self.n_embd;
        match self.family {
            Family::Gpt2 => (self.layer_params() - 6 * c) / tp + 6 * c,
            Family::Llama => {
                let kv = 2 * self.kv_dim() * c;
                let split = self.layer_matrix_params() - kv;
                let kv_local = |n: usize| if self.kv_split(tp) { n / tp } else { n };
                // q, k and v biases are split like their matrices' rows.
                let (qb, kvb) = match self.qkv_bias {
                    true => (self.q_dim(), 2 * self.kv_dim()),
                    false => (0, 0),
                };
                split / tp + kv_local(kv) + 2 * c + qb / tp + kv_local(kvb)
            }
        }
    }

    /// Embedding block: the token table (and GPT-2's position table).
    pub fn embedding_params(&self) -> usize {
        self.embedding_params_tp(1)
    }

    /// The embedding block on one of `tp` ranks (vocabulary-parallel rows).
    pub fn embedding_params_tp(&self, tp: usize) -> usize {
        let positions = match self.family {
            Family::Gpt2 => self.seq_len * self.n_embd,
            Family::Llama => 0,
        };
        self.vocab_size.div_ceil(tp.max(1)) * self.n_embd + positions
    }

    /// Head block's own parameters: the final norm (GPT-2's LayerNorm has
    /// a bias) and `lm_head` unless tied to the token table.
    pub fn head_params(&self) -> usize {
        self.head_params_tp(1)
    }

    /// The head block on one of `tp` ranks (vocabulary-parallel rows).
    pub fn head_params_tp(&self, tp: usize) -> usize {
        let norm = match self.family {
            Family::Gpt2 => 2 * self.n_embd,
            Family::Llama => self.n_embd,
        };
        let own = if self.tied_embeddings {
            0
        } else {
            self.vocab_size.div_ceil(tp.max(1)) * self.n_embd
        };
        norm + own
    }

    /// All parameters, a tied table counted once.
    pub fn num_params(&self) -> usize {
        self.embedding_params() + self.n_layer * self.layer_params() + self.head_params()
    }

    /// Elements per token one layer keeps for backward on one of `tp`
    /// ranks that are split over tp (the rest, 7 C, is replicated; see
    /// [`super::memory`]), without the attention probabilities.
    pub fn layer_split_activations(&self, tp: usize) -> usize {
        let tp = tp.max(1);
        match self.family {
            // qkv 3C, attention output C, MLP hidden 4C and GELU 4C.
            Family::Gpt2 => (3 * self.n_embd + self.n_embd + 2 * self.mlp_hidden) / tp,
            // q and rotated q, k, rotated k, v, the kv heads repeated for
            // their query heads (with n_head > n_kv_head), the packed
            // [q | k | v] (3Q), the attention output; gate, up, SwiGLU.
            Family::Llama => {
                let (q, kv) = (self.q_dim(), self.kv_dim());
                let kv_local = if self.kv_split(tp) { kv / tp } else { kv };
                let repeat = if self.n_head > self.n_kv_head {
                    2 * q / tp
                } else {
                    0
                };
                6 * q / tp + 3 * kv_local + repeat + 3 * self.mlp_hidden / tp
            }
        }
    }

    /// Elements per token of the widest gradients alive together in one
    /// layer's backward (the MLP's hidden ones), on one of `tp` ranks.
    pub fn layer_backward_transient(&self, tp: usize) -> usize {
        self.mlp_matrices() * self.mlp_hidden / tp.max(1)
    }
}

/// Training FLOPs per token, forward and backward: 6 per parameter a token
/// is multiplied by (2 forward, 4 backward) plus 12 L T Q for the attention
/// scores and their product with the values (PaLM's and nanoGPT's count,
/// as Megatron's; llm.c counts half of the latter for the causal mask).
/// GPT-2 counts all its parameters, 6 N (the tied table is the head's
/// matrix; positions and biases are a small part), as nanoGPT does; Llama
/// counts its matrices: the layers' (grouped-query k / v are narrower,
/// SwiGLU has three) and the head's, not the token table it only indexes.
/// MFU = tokens/s × this / peak FLOP/s.
pub fn model_flops_per_token(m: &ModelShape) -> f64 {
    let params = match m.family {
        Family::Gpt2 => m.num_params(),
        Family::Llama => m.n_layer * m.layer_matrix_params() + m.vocab_size * m.n_embd,
    };
    6.0 * params as f64 + 12.0 * (m.n_layer * m.seq_len * m.q_dim()) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_count_matches_hf() {
        let m = ModelShape::gpt2(12, 12, 768, 50257, 1024);
        assert_eq!(m.num_params(), 124_439_808);
        assert_eq!(m.layer_params(), 12 * 768 * 768 + 13 * 768);
        assert_eq!(
            model_flops_per_token(&m),
            6.0 * 124_439_808.0 + 12.0 * (12 * 1024 * 768) as f64
        );
    }

    /// A tiny Llama counted by hand: 2 layers, 4 heads over 2 kv heads of
    /// 8, 32 wide, MLP 64, vocabulary 256, context 16, untied.
    #[test]
    fn llama_flops_by_hand() {
        let m = ModelShape::llama(2, 4, 2, 32, 8, 64, 256, 16, false);
        // q 32x32, o 32x32, k 16x32, v 16x32, gate/up/down 64x32 each.
        let layer_mat = 1024 + 1024 + 512 + 512 + 3 * 2048;
        assert_eq!(layer_mat, 9216);
        assert_eq!(m.layer_matrix_params(), 9216);
        assert_eq!(m.layer_params(), 9216 + 64);
        // embed 256x32, 2 layers, final norm 32, lm_head 256x32.
        assert_eq!(m.num_params(), 8192 + 2 * 9280 + 32 + 8192);
        // 6 x (2 x 9216 + 8192) + 12 x 2 layers x 16 positions x 32.
        assert_eq!(model_flops_per_token(&m), 6.0 * 26624.0 + 12288.0);
        assert_eq!(model_flops_per_token(&m), 172_032.0);
        // Tied: the head's matrix is the table, still multiplied once.
        let tied = ModelShape {
            tied_embeddings: true,
            ..m
        };
        assert_eq!(tied.num_params(), m.num_params() - 8192);
        assert_eq!(model_flops_per_token(&tied), 172_032.0);
    }

    #[test]
    fn llama_tensor_parallel_shares() {
        let m = ModelShape::llama(2, 4, 2, 32, 8, 64, 256, 16, false);
        // tp 2: kv heads split, everything but the norms halves.
        assert_eq!(m.layer_params_tp(2), 9216 / 2 + 64);
        // tp 4 > 2 kv heads: k and v (2 x 16 x 32) whole on every rank.
        assert_eq!(m.layer_params_tp(4), (9216 - 1024) / 4 + 1024 + 64);
        assert_eq!(m.embedding_params_tp(4), 64 * 32);
        assert_eq!(m.head_params_tp(4), 32 + 64 * 32);
        assert!(m.tp_ok(2) && m.tp_ok(4));
        assert!(!m.tp_ok(8), "8 does not divide 4 heads");
        let odd = ModelShape::llama(2, 6, 3, 48, 8, 64, 256, 16, false);
        assert!(!odd.tp_ok(2), "3 kv heads split over 2 ranks");
        // GPT-2's share is the formula the planner had: (12C²+7C)/tp + 6C.
        let g = ModelShape::gpt2(2, 4, 36, 256, 16);
        assert_eq!(g.layer_params_tp(2), (12 * 36 * 36 + 7 * 36) / 2 + 6 * 36);
    }
}
