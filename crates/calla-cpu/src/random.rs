//! Seeded random inputs and weights for tests and benchmarks (never zeros, never a fixed pattern).

use calla_model::{
    AttentionWeights, DeltaNetWeights, Family, FeedForwardSpec, FeedForwardWeights, LayerKind,
    LayerWeights, Matrix, MixerWeights, MlpWeights, ModelSpec, MoeWeights, Weights,
};

/// SplitMix64: small, seedable, good enough for test data.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.uniform()
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * std).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// MLX affine quantisation of a row-major `[rows, cols]` matrix (`bits` 4 or 8, `group_size`
/// columns per (scale, bias) pair): the loader's quantiser, bit-exact to mlx-lm
/// (calla_model::quant::quantize_values), so tests quantise exactly as `--quant` does.
pub fn quantise_affine(
    rows: usize,
    cols: usize,
    values: &[f32],
    bits: u32,
    group_size: usize,
) -> Matrix {
    calla_model::quant::quantize_values(rows, cols, values, bits, group_size)
}

/// A small spec with the shape of the test fixtures: [DN, DN, DN, Attn] × `groups`, every dimension
/// different so that a transposed index shows up as a shape error or a wrong result.
pub fn tiny_spec(family: Family, groups: usize) -> ModelSpec {
    let mut layers = Vec::new();
    for _ in 0..groups {
        layers.extend([
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::Attention,
        ]);
    }
    ModelSpec {
        family,
        vocab_size: 384,
        hidden_size: 128,
        layers,
        rms_norm_eps: 1e-6,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        rotary_dim: 8,
        rope_theta: 10_000_000.0,
        attn_output_gate: true,
        linear_num_key_heads: 2,
        linear_num_value_heads: 4,
        linear_key_head_dim: 32,
        linear_value_head_dim: 16,
        linear_conv_kernel_dim: 4,
        feed_forward: match family {
            Family::Qwen35Dense => FeedForwardSpec::Dense { intermediate: 192 },
            _ => FeedForwardSpec::Moe {
                num_experts: 8,
                top_k: 2,
                expert_intermediate: 64,
                shared_intermediate: 192,
                // qwen3_next configs may leave routing unnormalised: exercise that branch
                norm_topk_prob: family != Family::Qwen3Next,
            },
        },
        tie_word_embeddings: false,
        max_position_embeddings: 4096,
        eos_token_ids: vec![1, 2],
    }
}

fn matrix(rng: &mut Rng, rows: usize, cols: usize, gain: f32) -> Matrix {
    let std = gain / (cols as f32).sqrt();
    Matrix::dense_f32(rows, cols, &rng.normal_vec(rows * cols, std))
}

fn mlp(rng: &mut Rng, hidden: usize, intermediate: usize, gain: f32) -> MlpWeights {
    MlpWeights {
        gate_proj: matrix(rng, intermediate, hidden, gain),
        up_proj: matrix(rng, intermediate, hidden, gain),
        down_proj: matrix(rng, hidden, intermediate, gain),
    }
}

/// Random f32 weights for `spec` with projections of gain 1 (std 1/√cols): every block contributes
/// strongly to the residual stream, which makes these models chaotic (a 0.1% change of the embedding
/// moves the logits by a few %), good for exact-agreement tests.
pub fn random_weights(spec: &ModelSpec, seed: u64) -> Weights {
    random_weights_with_gain(spec, seed, 1.0)
}

/// Random f32 weights whose projections have std `gain/√cols`; gain 0.5 gives a calm model (branches
/// ≈ 5–10% of the residual stream), closer to a trained model's sensitivity to weight noise.
pub fn random_weights_with_gain(spec: &ModelSpec, seed: u64, gain: f32) -> Weights {
    let mut rng = Rng::new(seed);
    let d = spec.hidden_size;
    let layers = spec
        .layers
        .iter()
        .map(|kind| {
            let mixer = match kind {
                LayerKind::DeltaNet => {
                    let hv = spec.linear_num_value_heads;
                    let c = spec.linear_conv_dim();
                    let k = spec.linear_conv_kernel_dim;
                    MixerWeights::DeltaNet(DeltaNetWeights {
                        in_proj_qkv: matrix(&mut rng, c, d, gain),
                        in_proj_z: matrix(&mut rng, spec.linear_value_dim(), d, gain),
                        in_proj_b: matrix(&mut rng, hv, d, gain),
                        in_proj_a: matrix(&mut rng, hv, d, gain),
                        conv1d: rng.normal_vec(c * k, 0.5),
                        a_log: (0..hv).map(|_| rng.range(1.0, 16.0).ln()).collect(),
                        dt_bias: (0..hv).map(|_| rng.range(-1.0, 1.0)).collect(),
                        norm: (0..spec.linear_value_head_dim)
                            .map(|_| rng.range(0.8, 1.2))
                            .collect(),
                        out_proj: matrix(&mut rng, d, spec.linear_value_dim(), gain),
                    })
                }
                LayerKind::Attention => MixerWeights::Attention(AttentionWeights {
                    q_proj: matrix(&mut rng, spec.q_proj_rows(), d, gain),
                    k_proj: matrix(&mut rng, spec.kv_dim(), d, gain),
                    v_proj: matrix(&mut rng, spec.kv_dim(), d, gain),
                    o_proj: matrix(&mut rng, d, spec.num_attention_heads * spec.head_dim, gain),
                    q_norm: rng.normal_vec(spec.head_dim, 0.1),
                    k_norm: rng.normal_vec(spec.head_dim, 0.1),
                }),
            };
            let feed_forward = match &spec.feed_forward {
                FeedForwardSpec::Moe {
                    num_experts,
                    expert_intermediate,
                    shared_intermediate,
                    ..
                } => FeedForwardWeights::Moe(MoeWeights {
                    router: matrix(&mut rng, *num_experts, d, gain),
                    experts: (0..*num_experts)
                        .map(|_| mlp(&mut rng, d, *expert_intermediate, gain))
                        .collect(),
                    shared_expert: (*shared_intermediate > 0)
                        .then(|| mlp(&mut rng, d, *shared_intermediate, gain)),
                    shared_expert_gate: (*shared_intermediate > 0)
                        .then(|| matrix(&mut rng, 1, d, gain)),
                }),
                FeedForwardSpec::Dense { intermediate } => {
                    FeedForwardWeights::Dense(mlp(&mut rng, d, *intermediate, gain))
                }
            };
            LayerWeights {
                input_layernorm: rng.normal_vec(d, 0.1),
                post_attention_layernorm: rng.normal_vec(d, 0.1),
                mixer,
                feed_forward,
            }
        })
        .collect();
    // Embedding rows of norm ~1 per element, lm_head like any projection.
    let embed_tokens = Matrix::dense_f32(
        spec.vocab_size,
        d,
        &rng.normal_vec(spec.vocab_size * d, 1.0),
    );
    let lm_head = matrix(&mut rng, spec.vocab_size, d, gain);
    Weights {
        embed_tokens,
        layers,
        final_norm: rng.normal_vec(d, 0.1),
        lm_head,
    }
}

/// Every matrix of `w` quantised to `bits` (group `group_size`), the rest unchanged.
pub fn quantise_weights(w: &Weights, bits: u32, group_size: usize) -> Weights {
    let q = |m: &Matrix| quantise_affine(m.rows, m.cols, &m.to_f32(), bits, group_size);
    let q_mlp = |m: &MlpWeights| MlpWeights {
        gate_proj: q(&m.gate_proj),
        up_proj: q(&m.up_proj),
        down_proj: q(&m.down_proj),
    };
    let mut out = w.clone();
    out.embed_tokens = q(&w.embed_tokens);
    out.lm_head = q(&w.lm_head);
    for layer in &mut out.layers {
        match &mut layer.mixer {
            MixerWeights::DeltaNet(dn) => {
                dn.in_proj_qkv = q(&dn.in_proj_qkv);
                dn.in_proj_z = q(&dn.in_proj_z);
                dn.out_proj = q(&dn.out_proj);
                // in_proj_a/b stay f32: with Hv rows of D they are too small to matter.
            }
            MixerWeights::Attention(at) => {
                at.q_proj = q(&at.q_proj);
                at.k_proj = q(&at.k_proj);
                at.v_proj = q(&at.v_proj);
                at.o_proj = q(&at.o_proj);
            }
        }
        match &mut layer.feed_forward {
            FeedForwardWeights::Moe(moe) => {
                moe.experts = moe.experts.iter().map(q_mlp).collect();
                moe.shared_expert = moe.shared_expert.as_ref().map(q_mlp);
            }
            FeedForwardWeights::Dense(m) => *m = q_mlp(m),
        }
    }
    out
}
