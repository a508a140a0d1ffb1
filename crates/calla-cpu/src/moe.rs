//! The feed-forward blocks: sparse MoE with a gated shared expert (HF `Qwen3_5MoeSparseMoeBlock`) and the
//! dense SwiGLU MLP (`qwen3_5`).
//!
//!   SwiGLU(x) = down(silu(gate(x)) ⊙ up(x))
//!   MoE(x)    = Σ_{e ∈ top-k} w_e · SwiGLU_e(x) + sigmoid(shared_gate · x) · SwiGLU_shared(x)
//!   where p = softmax(router(x)) over E experts, top-k by p (ties: lowest id), and w = p / Σ_topk p if
//!   norm_topk_prob (always for qwen3_5_moe), else w = p.
//!
//! Legend: T tokens, D hidden, E experts, A active experts (top_k), I expert intermediate.

use anyhow::{ensure, Result};
use calla_model::{FeedForwardSpec, FeedForwardWeights, MlpWeights, ModelSpec, MoeWeights};
use rayon::prelude::*;

use crate::linear::Linear;
use crate::norm::{sigmoid, silu};

pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(name: &str, w: &MlpWeights, hidden: usize, intermediate: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate_proj: Linear::new(
                &format!("{name}.gate_proj"),
                &w.gate_proj,
                intermediate,
                hidden,
            )?,
            up_proj: Linear::new(&format!("{name}.up_proj"), &w.up_proj, intermediate, hidden)?,
            down_proj: Linear::new(
                &format!("{name}.down_proj"),
                &w.down_proj,
                hidden,
                intermediate,
            )?,
        })
    }

    /// x `[T, D]` → out `[T, D]`
    pub fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) {
        let i = self.gate_proj.rows;
        let mut gate = vec![0f32; t * i]; // [T, I]
        self.gate_proj.matmul(x, t, &mut gate);
        let mut up = vec![0f32; t * i]; // [T, I]
        self.up_proj.matmul(x, t, &mut up);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        self.down_proj.matmul(&gate, t, out);
    }
}

/// Top-k routing of one token: `(expert, weight)` best first, from the router logits `[E]`.
pub fn route(logits: &[f32], top_k: usize, renormalise: bool) -> Vec<(usize, f32)> {
    // softmax in f32, as HF (`softmax(router_logits, dtype=float)`)
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // probability descending, ties to the lowest id (a stable sort keeps id order among equals)
    order.sort_by(|a, b| exps[*b].total_cmp(&exps[*a]));
    let mut chosen: Vec<(usize, f32)> = order[..top_k]
        .iter()
        .map(|e| (*e, exps[*e] / sum))
        .collect();
    if renormalise {
        let total: f32 = chosen.iter().map(|(_, p)| p).sum();
        for (_, p) in &mut chosen {
            *p /= total;
        }
    }
    chosen
}

pub struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    shared_expert: Option<Mlp>,
    shared_expert_gate: Option<Linear>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl Moe {
    /// x `[T, D]` → out `[T, D]`
    pub fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) {
        let d = self.router.cols;
        let e = self.experts.len();
        let mut logits = vec![0f32; t * e]; // [T, E]
        self.router.matmul(x, t, &mut logits);

        // tokens_of[e] = [(token, weight)], tokens ascending
        let mut tokens_of: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for (tok, row) in logits.chunks_exact(e).enumerate() {
            for (expert, w) in route(row, self.top_k, self.norm_topk_prob) {
                tokens_of[expert].push((tok, w));
            }
        }
        let active: Vec<usize> = (0..e).filter(|i| !tokens_of[*i].is_empty()).collect();
        // Each active expert runs on its tokens: y_e [n_e, D].
        let expert_out: Vec<Vec<f32>> = active
            .par_iter()
            .map(|&expert| {
                let toks = &tokens_of[expert];
                let mut xs = Vec::with_capacity(toks.len() * d);
                for (tok, _) in toks {
                    xs.extend_from_slice(&x[tok * d..(tok + 1) * d]);
                }
                let mut y = vec![0f32; toks.len() * d];
                self.experts[expert].forward(&xs, toks.len(), &mut y);
                y
            })
            .collect();
        // Σ_e w_e · y_e, experts in id order (fixed, as HF's index_add loop).
        out.fill(0.0);
        for (expert, y) in active.iter().zip(&expert_out) {
            for ((tok, w), y_row) in tokens_of[*expert].iter().zip(y.chunks_exact(d)) {
                crate::simd::axpy(*w, y_row, &mut out[tok * d..(tok + 1) * d]);
            }
        }

        if let (Some(shared), Some(gate)) = (&self.shared_expert, &self.shared_expert_gate) {
            let mut s = vec![0f32; t * d]; // [T, D]
            shared.forward(x, t, &mut s);
            let mut gate_logit = vec![0f32; t]; // [T, 1]
            gate.matmul(x, t, &mut gate_logit);
            for tok in 0..t {
                let scale = sigmoid(gate_logit[tok]);
                crate::simd::axpy(
                    scale,
                    &s[tok * d..(tok + 1) * d],
                    &mut out[tok * d..(tok + 1) * d],
                );
            }
        }
    }
}

// One per layer: the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum FeedForward {
    Moe(Moe),
    Dense(Mlp),
}

impl FeedForward {
    pub fn new(spec: &ModelSpec, w: &FeedForwardWeights, layer: usize) -> Result<FeedForward> {
        let d = spec.hidden_size;
        match (&spec.feed_forward, w) {
            (
                FeedForwardSpec::Moe {
                    num_experts,
                    top_k,
                    expert_intermediate,
                    shared_intermediate,
                    norm_topk_prob,
                },
                FeedForwardWeights::Moe(w),
            ) => {
                let n = |s: &str| format!("layers.{layer}.mlp.{s}");
                ensure!(
                    w.experts.len() == *num_experts && *top_k >= 1 && top_k <= num_experts,
                    "{}: {} experts with top_k {top_k}, expected {num_experts}",
                    n("experts"),
                    w.experts.len()
                );
                let MoeWeights {
                    router,
                    experts,
                    shared_expert,
                    shared_expert_gate,
                } = w;
                let experts = experts
                    .iter()
                    .enumerate()
                    .map(|(i, m)| Mlp::new(&n(&format!("experts.{i}")), m, d, *expert_intermediate))
                    .collect::<Result<Vec<_>>>()?;
                ensure!(
                    (*shared_intermediate > 0)
                        == (shared_expert.is_some() && shared_expert_gate.is_some()),
                    "{}: shared_expert_intermediate_size is {shared_intermediate} but the shared expert \
                     and its gate are {}present",
                    n("shared_expert"),
                    if shared_expert.is_some() { "" } else { "not " }
                );
                Ok(FeedForward::Moe(Moe {
                    router: Linear::new(&n("gate"), router, *num_experts, d)?,
                    experts,
                    shared_expert: shared_expert
                        .as_ref()
                        .map(|m| Mlp::new(&n("shared_expert"), m, d, *shared_intermediate))
                        .transpose()?,
                    shared_expert_gate: shared_expert_gate
                        .as_ref()
                        .map(|m| Linear::new(&n("shared_expert_gate"), m, 1, d))
                        .transpose()?,
                    top_k: *top_k,
                    norm_topk_prob: *norm_topk_prob,
                }))
            }
            (FeedForwardSpec::Dense { intermediate }, FeedForwardWeights::Dense(w)) => Ok(
                FeedForward::Dense(Mlp::new(&format!("layers.{layer}.mlp"), w, d, *intermediate)?),
            ),
            _ => anyhow::bail!(
                "layers.{layer}.mlp: the spec and the weights disagree on MoE versus dense feed-forward"
            ),
        }
    }

    pub fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) {
        match self {
            FeedForward::Moe(m) => m.forward(x, t, out),
            FeedForward::Dense(m) => m.forward(x, t, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_top_k_by_probability_ties_to_lowest_id_and_renormalises() {
        let logits = [0.5, 2.0, -1.0, 2.0, 1.0];
        let r = route(&logits, 3, true);
        let ids: Vec<usize> = r.iter().map(|(e, _)| *e).collect();
        assert_eq!(ids, [1, 3, 4]);
        let z: f32 = [2.0f32, 2.0, 1.0].iter().map(|l| l.exp()).sum();
        for ((_, w), l) in r.iter().zip([2.0f32, 2.0, 1.0]) {
            assert!((w - l.exp() / z).abs() < 1e-6, "{r:?}");
        }
        // without renormalisation, the weights are the full-softmax probabilities
        let full: f32 = logits.iter().map(|l| l.exp()).sum();
        let r = route(&logits, 2, false);
        assert!((r[0].1 - 2f32.exp() / full).abs() < 1e-6);
    }
}
