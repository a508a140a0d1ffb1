//! The canonical weight tree that every checkpoint style is mapped onto at load.
//!
//! Conventions (whatever the checkpoint stored):
//! - zero-centred norms (input/post-attention/final/q_norm/k_norm) hold `w` as HF does; the forward
//!   applies `x̂·(1 + w)`. MLX stores `1 + w`: the loader subtracts 1.
//! - the DeltaNet gated norm holds its plain gain (applied as `w·x̂·silu(z)`).
//! - DeltaNet projections use Qwen3.5's separate layout: in_proj_qkv rows are [q (Hk·Dk) | k (Hk·Dk) |
//!   v (Hv·Dv)], head-major; Qwen3-Next's per-key-head interleaved qkvz/ba is reordered into this.
//! - conv1d is `[C, K]` row-major f32 (HF [C,1,K] and MLX [C,K,1] both map here); tap K-1 multiplies
//!   the newest input.
//! - q_proj keeps HF's per-head `[q (Dh) | gate (Dh)]` row order.

use crate::matrix::Matrix;

#[derive(Debug, Clone)]
pub struct Weights {
    /// `[V, D]`
    pub embed_tokens: Matrix,
    pub layers: Vec<LayerWeights>,
    /// `[D]`, zero-centred
    pub final_norm: Vec<f32>,
    /// `[V, D]`; a clone of `embed_tokens` (sharing its bytes) when embeddings are tied.
    pub lm_head: Matrix,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[D]`, zero-centred
    pub input_layernorm: Vec<f32>,
    /// `[D]`, zero-centred
    pub post_attention_layernorm: Vec<f32>,
    pub mixer: MixerWeights,
    pub feed_forward: FeedForwardWeights,
}

#[derive(Debug, Clone)]
pub enum MixerWeights {
    DeltaNet(DeltaNetWeights),
    Attention(AttentionWeights),
}

#[derive(Debug, Clone)]
pub struct DeltaNetWeights {
    /// `[2·Hk·Dk + Hv·Dv, D]`
    pub in_proj_qkv: Matrix,
    /// `[Hv·Dv, D]`
    pub in_proj_z: Matrix,
    /// `[Hv, D]` (beta = sigmoid(b))
    pub in_proj_b: Matrix,
    /// `[Hv, D]` (decay input a)
    pub in_proj_a: Matrix,
    /// `[C, K]` with C = 2·Hk·Dk + Hv·Dv
    pub conv1d: Vec<f32>,
    /// `[Hv]`
    pub a_log: Vec<f32>,
    /// `[Hv]`
    pub dt_bias: Vec<f32>,
    /// `[Dv]`, plain gain of the gated RMSNorm
    pub norm: Vec<f32>,
    /// `[D, Hv·Dv]`
    pub out_proj: Matrix,
}

#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `[Hq·Dh·2, D]` with per-head [q | gate] rows (or `[Hq·Dh, D]` without the output gate)
    pub q_proj: Matrix,
    /// `[Hkv·Dh, D]`
    pub k_proj: Matrix,
    /// `[Hkv·Dh, D]`
    pub v_proj: Matrix,
    /// `[D, Hq·Dh]`
    pub o_proj: Matrix,
    /// `[Dh]`, zero-centred
    pub q_norm: Vec<f32>,
    /// `[Dh]`, zero-centred
    pub k_norm: Vec<f32>,
}

// One per layer, built once at load: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum FeedForwardWeights {
    Moe(MoeWeights),
    Dense(MlpWeights),
}

/// SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
pub struct MlpWeights {
    /// `[I, D]`
    pub gate_proj: Matrix,
    /// `[I, D]`
    pub up_proj: Matrix,
    /// `[D, I]`
    pub down_proj: Matrix,
}

#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// router `[E, D]`
    pub router: Matrix,
    /// E experts
    pub experts: Vec<MlpWeights>,
    pub shared_expert: Option<MlpWeights>,
    /// `[1, D]`: the shared expert's output is scaled by sigmoid(shared_expert_gate · x)
    pub shared_expert_gate: Option<Matrix>,
}

pub mod assemble;
pub mod export;
pub mod names;
pub mod qwen3next;
pub mod read;
pub mod stats;
pub mod store;
