//! Backend-neutral sampling rules.
//!
//! Order (as vLLM applies them): logit_bias → repetition penalty (prompt + output) → presence and
//! frequency penalties (output) → temperature == 0 ⇒ argmax (ties: lowest id) → divide by temperature →
//! top-k → top-p → min-p → draw with u = philox(seed, step). Log-probabilities reported to users are of
//! the raw logits, not of this transformed distribution.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy
    pub temperature: f32,
    /// 0 = disabled
    pub top_k: usize,
    /// 1 = disabled
    pub top_p: f32,
    /// 0 = disabled
    pub min_p: f32,
    /// 1 = disabled; >1 discourages tokens seen in prompt or output (HF/vLLM rule: positive logits are
    /// divided, negative multiplied)
    pub repetition_penalty: f32,
    /// subtracted once from the logit of every token present in the output
    pub presence_penalty: f32,
    /// subtracted per occurrence in the output
    pub frequency_penalty: f32,
    pub seed: u64,
    /// added to the raw logits before everything else
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}
