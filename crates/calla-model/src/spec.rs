//! The validated, backend-neutral description of a text model of the Qwen3.5/3.6/Next family.
//!
//! Built by `config` from config.json (field names there mirror the JSON). Every backend reads this and
//! nothing else about the architecture.

/// Which member of the family: decides only tensor layouts at load time and the router rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_5_moe` / `qwen3_5_moe_text` (Qwen3.5/3.6-35B-A3B and siblings).
    Qwen35Moe,
    /// `qwen3_5` / `qwen3_5_text`: same blocks with a dense SwiGLU MLP.
    Qwen35Dense,
    /// `qwen3_next`: interleaved in_proj_qkvz / in_proj_ba (canonicalised at load), router renormalises
    /// only if `norm_topk_prob`.
    Qwen3Next,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet ("linear_attention").
    DeltaNet,
    /// Gated full attention ("full_attention").
    Attention,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FeedForwardSpec {
    Moe {
        num_experts: usize,
        /// experts per token (`num_experts_per_tok`)
        top_k: usize,
        /// `moe_intermediate_size`
        expert_intermediate: usize,
        /// `shared_expert_intermediate_size`; 0 = no shared expert
        shared_intermediate: usize,
        /// renormalise the top-k probabilities (always true for qwen3_5_moe)
        norm_topk_prob: bool,
    },
    Dense {
        intermediate: usize,
    },
}

/// Hyperparameters of the text model, validated. Dimension legend used across calla:
/// `D` hidden, `Hq`/`Hkv` attention heads, `Dh` head dim, `Hk`/`Hv` DeltaNet key/value heads,
/// `Dk`/`Dv` their dims, `E` experts, `A` active experts (top_k), `I` expert intermediate, `V` vocab.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    /// V (embedding rows; may be padded beyond the tokenizer's vocabulary)
    pub vocab_size: usize,
    /// D
    pub hidden_size: usize,
    /// one entry per decoder layer
    pub layers: Vec<LayerKind>,
    pub rms_norm_eps: f32,

    // Gated attention.
    /// Hq
    pub num_attention_heads: usize,
    /// Hkv
    pub num_key_value_heads: usize,
    /// Dh
    pub head_dim: usize,
    /// Dims of each head that get NeoX RoPE (head_dim × partial_rotary_factor), even.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// q_proj emits per head [q | gate]; attention output is multiplied by sigmoid(gate).
    pub attn_output_gate: bool,

    // Gated DeltaNet.
    /// Hk
    pub linear_num_key_heads: usize,
    /// Hv (a multiple of Hk; value head h uses key head h / (Hv/Hk))
    pub linear_num_value_heads: usize,
    /// Dk
    pub linear_key_head_dim: usize,
    /// Dv
    pub linear_value_head_dim: usize,
    /// causal conv1d kernel size (4)
    pub linear_conv_kernel_dim: usize,

    pub feed_forward: FeedForwardSpec,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Stop tokens: the top-level list of config.json / generation_config.json wins over text_config's.
    pub eos_token_ids: Vec<u32>,
}

impl ModelSpec {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Hk·Dk
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// Hv·Dv
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the DeltaNet conv: [q | k | v] = 2·Hk·Dk + Hv·Dv
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    /// Rows of q_proj: Hq·Dh, doubled when it carries the output gate.
    pub fn q_proj_rows(&self) -> usize {
        self.num_attention_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    pub fn num_attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }
    pub fn num_deltanet_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::DeltaNet)
            .count()
    }
}
