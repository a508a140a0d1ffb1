//! Parameter and byte counts of a [`Weights`] tree, per format, and the bytes one decoded token reads.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::matrix::Matrix;
use crate::spec::{FeedForwardSpec, ModelSpec};
use crate::weights::{FeedForwardWeights, LayerWeights, MixerWeights, MlpWeights, Weights};

/// Name under which the f32 vectors (norms, conv taps, A_log, dt_bias) are counted.
pub const VECTORS_FORMAT: &str = "f32 (vectors)";

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FormatCount {
    pub matrices: usize,
    pub params: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct WeightStats {
    /// format name ("bf16", "q4g64", …, and [`VECTORS_FORMAT`]) → counts. A tied LM head is counted once.
    pub formats: BTreeMap<String, FormatCount>,
    pub total_params: u64,
    pub total_bytes: u64,
    /// Weight bytes one decode step reads: one embedding row, every mixer and norm, the router,
    /// `top_k` average experts and the shared expert per layer, the final norm and the whole LM head.
    pub bytes_per_token: u64,
}

impl WeightStats {
    fn add_matrix(&mut self, m: &Matrix) {
        let entry = self.formats.entry(m.format_name()).or_default();
        entry.matrices += 1;
        entry.params += m.num_params() as u64;
        entry.bytes += m.byte_size() as u64;
        self.total_params += m.num_params() as u64;
        self.total_bytes += m.byte_size() as u64;
    }
    fn add_vector(&mut self, v: &[f32]) {
        let entry = self.formats.entry(VECTORS_FORMAT.to_string()).or_default();
        entry.matrices += 1;
        entry.params += v.len() as u64;
        entry.bytes += 4 * v.len() as u64;
        self.total_params += v.len() as u64;
        self.total_bytes += 4 * v.len() as u64;
    }
}

fn mlp_matrices(m: &MlpWeights) -> [&Matrix; 3] {
    [&m.gate_proj, &m.up_proj, &m.down_proj]
}

fn mlp_bytes(m: &MlpWeights) -> u64 {
    mlp_matrices(m).iter().map(|x| x.byte_size() as u64).sum()
}

/// Matrices and vectors every token reads in a layer, excluding the routed experts.
fn layer_always_read(layer: &LayerWeights) -> (Vec<&Matrix>, Vec<&[f32]>) {
    let mut matrices = Vec::new();
    let mut vectors: Vec<&[f32]> = vec![&layer.input_layernorm, &layer.post_attention_layernorm];
    match &layer.mixer {
        MixerWeights::DeltaNet(dn) => {
            matrices.extend([
                &dn.in_proj_qkv,
                &dn.in_proj_z,
                &dn.in_proj_b,
                &dn.in_proj_a,
                &dn.out_proj,
            ]);
            vectors.extend([&dn.conv1d[..], &dn.a_log, &dn.dt_bias, &dn.norm]);
        }
        MixerWeights::Attention(at) => {
            matrices.extend([&at.q_proj, &at.k_proj, &at.v_proj, &at.o_proj]);
            vectors.extend([&at.q_norm[..], &at.k_norm]);
        }
    }
    match &layer.feed_forward {
        FeedForwardWeights::Dense(mlp) => matrices.extend(mlp_matrices(mlp)),
        FeedForwardWeights::Moe(moe) => {
            matrices.push(&moe.router);
            if let Some(shared) = &moe.shared_expert {
                matrices.extend(mlp_matrices(shared));
            }
            if let Some(gate) = &moe.shared_expert_gate {
                matrices.push(gate);
            }
        }
    }
    (matrices, vectors)
}

pub fn weight_stats(spec: &ModelSpec, weights: &Weights) -> WeightStats {
    let mut stats = WeightStats::default();
    let top_k = match spec.feed_forward {
        FeedForwardSpec::Moe { top_k, .. } => top_k as u64,
        FeedForwardSpec::Dense { .. } => 0,
    };
    stats.add_matrix(&weights.embed_tokens);
    let mut per_token =
        (weights.embed_tokens.byte_size() / weights.embed_tokens.rows.max(1)) as u64;
    for layer in &weights.layers {
        let (matrices, vectors) = layer_always_read(layer);
        for m in matrices {
            stats.add_matrix(m);
            per_token += m.byte_size() as u64;
        }
        for v in vectors {
            stats.add_vector(v);
            per_token += 4 * v.len() as u64;
        }
        if let FeedForwardWeights::Moe(moe) = &layer.feed_forward {
            let mut experts_bytes = 0;
            for expert in &moe.experts {
                mlp_matrices(expert)
                    .iter()
                    .for_each(|m| stats.add_matrix(m));
                experts_bytes += mlp_bytes(expert);
            }
            if !moe.experts.is_empty() {
                per_token += top_k * experts_bytes / moe.experts.len() as u64;
            }
        }
    }
    stats.add_vector(&weights.final_norm);
    per_token += 4 * weights.final_norm.len() as u64;
    if !spec.tie_word_embeddings {
        stats.add_matrix(&weights.lm_head);
    }
    per_token += weights.lm_head.byte_size() as u64;
    stats.bytes_per_token = per_token;
    stats
}
