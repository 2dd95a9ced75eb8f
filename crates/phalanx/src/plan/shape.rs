//! What the planner knows of a model: a decoder-only transformer of one of
//! two families, its parameters as its blocks declare them ([`super::params`]:
//! every parameter count, whole or on one tensor-parallel rank, comes from
//! the declared shapes and placements), and from its shape the activations
//! a layer keeps per token and the training FLOPs per token.
//!
//! | | GPT-2 | Llama |
//! |---|---|---|
//! | activations | LayerNorms, GELU MLP 4C wide | RMSNorms, grouped-query attention, SwiGLU MLP |
//! | FLOPs | 6 per parameter (nanoGPT) | 6 per matrix parameter of the layers and the head |
//!
//! ```
//! use phalanx::placement::Placement;
//! use phalanx::plan::{model_flops_per_token, Declarations, ModelShape, Param};
//! // A Llama-shaped model by hand: 2 layers, C = 8, 2 heads of 4 over 1 kv head,
//! // MLP 16, vocabulary 32, tied; what its blocks would declare.
//! let (rows, cols) = (Placement::rows(), Placement::cols());
//! let table = Param::new("embed", &[32, 8], Placement::vocab(32));
//! let layer = vec![
//!     Param::new("q", &[8, 8], rows), Param::new("k", &[4, 8], Placement::Replicate),
//!     Param::new("v", &[4, 8], Placement::Replicate), Param::new("o", &[8, 8], cols),
//!     Param::new("gate", &[16, 8], rows), Param::new("up", &[16, 8], rows),
//!     Param::new("down", &[8, 16], cols), Param::new("norm", &[8], Placement::Replicate),
//! ];
//! let head = vec![Param::new("final_norm", &[8], Placement::Replicate), table.clone()];
//! let params = Declarations::uniform(&[1, 2], vec![table], layer, head);
//! let m = ModelShape::llama(2, 2, 1, 8, 4, 16, 32, 16).with_params(params);
//! assert_eq!(m.num_params(), 32 * 8 + 2 * (64 + 32 + 32 + 64 + 3 * 128 + 8) + 8);
//! assert!(m.tied_embeddings());
//! // On 2 ranks: half the table, q, o and the MLP; k, v and the norms whole.
//! assert_eq!(m.rank_params(2).layer, (64 + 64 + 3 * 128) / 2 + 32 + 32 + 8);
//! // 6 x (the matrices the tokens go through: layers and the head) + 12 L T Q.
//! let matmul = 2 * (64 + 32 + 32 + 64 + 3 * 128) + 32 * 8;
//! assert_eq!(model_flops_per_token(&m), 6.0 * matmul as f64 + 12.0 * (2 * 16 * 8) as f64);
//! ```

use super::params::{BlockParams, Declarations, Declared};

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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// What the model's blocks declare at each tp size they can be cut
    /// for: every parameter count comes from it ([`super::params`]).
    pub params: Declarations,
}

impl ModelShape {
    /// A GPT-2; its parameters come from [`ModelShape::with_params`] (a
    /// model family's `plan_shape` declares its blocks).
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
            params: Declarations::default(),
        }
    }

    /// A Llama: `head_dim` is the size of one head (n_embd / n_head unless
    /// the model sets it apart), `intermediate_size` the SwiGLU width; its
    /// parameters come from [`ModelShape::with_params`].
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
            params: Declarations::default(),
        }
    }

    /// The same shape with the parameters its blocks declare.
    pub fn with_params(self, params: Declarations) -> Self {
        ModelShape { params, ..self }
    }

    /// What the blocks declare on `tp` ranks. Panics if they were not
    /// declared for `tp` (see [`ModelShape::tp_ok`]).
    pub fn declared(&self, tp: usize) -> &Declared {
        let tp = tp.max(1);
        self.params.at(tp).unwrap_or_else(|| {
            panic!(
                "the planner's model has no parameters declared for tp = {tp} (declared: {:?}; \
                 a model family's plan_shape declares its blocks)",
                self.params.sizes().collect::<Vec<_>>()
            )
        })
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
    /// every rank holds them all: Llama with fewer kv heads than ranks),
    /// for the activations and the communication they cost.
    pub fn kv_split(&self, tp: usize) -> bool {
        self.family == Family::Gpt2 || self.n_kv_head >= tp
    }

    /// Whether the model can run on `tp` tensor-parallel ranks: its blocks
    /// could be declared for them (their heads, MLP width and kv heads,
    /// split or replicated, divide).
    pub fn tp_ok(&self, tp: usize) -> bool {
        self.params.at(tp.max(1)).is_some()
    }

    /// One of `tp` ranks' parameters of each kind of block, by the declared
    /// placements.
    pub fn rank_params(&self, tp: usize) -> BlockParams {
        self.declared(tp).per_rank()
    }

    /// The whole model's parameters of each kind of block.
    pub fn whole_params(&self) -> BlockParams {
        self.declared(1).whole()
    }

    /// The matrices of one layer (the parameters tokens are multiplied by).
    pub fn layer_matrix_params(&self) -> usize {
        self.declared(1).matrices().0
    }

    /// Matrices of the MLP: 2 for GPT-2 (fc, proj), 3 for SwiGLU.
    fn mlp_matrices(&self) -> usize {
        match self.family {
            Family::Gpt2 => 2,
            Family::Llama => 3,
        }
    }

    /// Parameters of one transformer layer.
    pub fn layer_params(&self) -> usize {
        self.whole_params().layer
    }

    /// All parameters, a tied table counted once.
    pub fn num_params(&self) -> usize {
        self.whole_params().total(self.n_layer)
    }

    /// Whether the head's matrix is the token table (the head declares
    /// the embedding's table).
    pub fn tied_embeddings(&self) -> bool {
        self.declared(1).tied()
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

    /// Whether a layer on one of `tp` ranks runs Llama's direct layer
    /// (`phalanx_models::llama::direct`: Llama and Qwen2 without tensor
    /// parallel), which keeps its activations in f32 whatever the compute
    /// dtype.
    pub fn direct_layer(&self, tp: usize) -> bool {
        self.family == Family::Llama && tp.max(1) == 1
    }

    /// f32 elements per token the direct Llama layer keeps besides its
    /// input and the probabilities: the first RMSNorm's output, the
    /// residual and the second RMSNorm's output (3C); q | k | v rotated,
    /// the kv heads repeated for their query heads (3Q), the attention
    /// output (Q); gate, up and SwiGLU (3M).
    pub fn direct_layer_activations(&self) -> usize {
        3 * self.n_embd + 4 * self.q_dim() + 3 * self.mlp_hidden
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
        Family::Llama => {
            let (layer, head) = m.declared(1).matrices();
            m.n_layer * layer + head
        }
    };
    6.0 * params as f64 + 12.0 * (m.n_layer * m.seq_len * m.q_dim()) as f64
}
