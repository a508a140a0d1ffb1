//! Backend-neutral sampling rules.
//!
//! Order (as vLLM applies them): logit_bias → repetition penalty (prompt + output) → presence and
//! frequency penalties (output) → temperature == 0 ⇒ argmax (ties: lowest id) → divide by temperature →
//! top-k → top-p → min-p → draw with u = philox(seed, step). Log-probabilities reported to users are of
//! the raw logits, not of this transformed distribution.

use serde::{Deserialize, Serialize};

use crate::backend::{Selection, TokenChoice};
use crate::constraint::TokenMask;

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

// ---------------------------------------------------------------------------------------------------
// The reference sampler. Every backend's selection must equal `select_token` on the same logits.

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the Random123
/// and cuRAND generator): 10 rounds over a 128-bit counter with a 64-bit key.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The uniform draw of step `step` under `seed`, in [0, 1). Exact recipe (GPU backends replicate it):
/// key = [seed as u32, (seed >> 32) as u32], counter = [step as u32, (step >> 32) as u32, 0, 0],
/// r = philox4x32_10(counter, key)[0], u = (r >> 8) as f32 · 2⁻²⁴ (exact: 24 bits fit an f32).
pub fn uniform(seed: u64, step: u64) -> f32 {
    let r = philox4x32_10(
        [step as u32, (step >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (r[0] >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// NaN counts as −∞ everywhere below, so a broken logit can never be chosen over a finite one.
fn sanitise(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Index of the largest value, ties to the lowest index (0 when all are −∞).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// log Σ exp(x) (NaN as −∞).
fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values
        .iter()
        .map(|v| sanitise(*v))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f32 = values.iter().map(|v| (sanitise(*v) - max).exp()).sum();
    max + sum.ln()
}

/// The `n` best ids by (value descending, id ascending).
fn best_ids(values: &[f32], n: usize) -> Vec<u32> {
    let by_rank = |a: &u32, b: &u32| {
        sanitise(values[*b as usize])
            .total_cmp(&sanitise(values[*a as usize]))
            .then(a.cmp(b))
    };
    let n = n.min(values.len());
    if n == 0 {
        return Vec::new();
    }
    let mut ids: Vec<u32> = (0..values.len() as u32).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, by_rank);
        ids.truncate(n);
    }
    ids.sort_unstable_by(by_rank);
    ids
}

/// The raw logits after logit_bias, the repetition penalty (prompt + output) and the presence and
/// frequency penalties (output): steps 1–3 of the order in this file's header. NaN becomes −∞.
pub fn adjusted_logits(logits: &[f32], sel: &Selection) -> Vec<f32> {
    let p = sel.params;
    let v = logits.len();
    let mut z: Vec<f32> = logits.iter().map(|x| sanitise(*x)).collect();
    for (id, bias) in &p.logit_bias {
        if let Some(x) = z.get_mut(*id as usize) {
            *x += bias;
        }
    }
    if p.repetition_penalty != 1.0 {
        let mut seen = vec![false; v];
        for id in sel.prompt.iter().chain(sel.generated) {
            if let Some(s) = seen.get_mut(*id as usize) {
                *s = true;
            }
        }
        for (x, s) in z.iter_mut().zip(&seen) {
            if *s {
                *x = if *x > 0.0 {
                    *x / p.repetition_penalty
                } else {
                    *x * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = std::collections::BTreeMap::<u32, u32>::new();
        for id in sel.generated {
            *counts.entry(*id).or_default() += 1;
        }
        for (id, count) in counts {
            if let Some(x) = z.get_mut(id as usize) {
                *x -= p.presence_penalty + p.frequency_penalty * count as f32;
            }
        }
    }
    z
}

/// Choose the next token (see the header for the order), and report its log-probability and the
/// `sel.top_logprobs` best alternatives from the log-softmax of the RAW logits.
///
/// Sampling, exactly (temperature > 0), over z = adjusted_logits / temperature:
/// 1. kept = ids with finite z.
/// 2. top-k (0 < k < |kept|): keep the k best by (z descending, id ascending).
/// 3. top-p (< 1): p = softmax of z over kept (the sum in `weight_tree`'s order); walk kept by (p
///    descending, id ascending) and keep each id whose preceding cumulative p (f32, in that order)
///    is < top_p.
/// 4. min-p (> 0): keep ids with exp(z − z_max) ≥ min_p (p ≥ min_p · p_max).
/// 5. w_i = exp(z_i − z_max) over kept, total = the root of `weight_tree`, target =
///    uniform(seed, step) · total; the id `tree_draw` lands on is drawn.
///
/// The sums are a pairwise tree over the id space, not a running sum in id order: the same f32
/// values on every backend (exact zeros for the ids not kept change nothing), and a GPU computes them
/// in parallel, where a sequential sum over 248K ids cost it ~28 ms per token (docs/experiments.md,
/// "Token selection and sampling").
pub fn select_token(logits: &[f32], sel: &Selection) -> TokenChoice {
    select_with_mask(logits, sel, None)
}

/// `select_token` among the tokens `allowed` only: disallowed tokens get −∞ after the adjustments
/// (logit_bias, penalties), before temperature, truncation and the draw. Log-probabilities stay
/// those of the raw logits. An error when the mask leaves no token with a finite logit.
pub fn select_token_masked(
    logits: &[f32],
    sel: &Selection,
    allowed: Option<&TokenMask>,
) -> anyhow::Result<TokenChoice> {
    let choice = select_with_mask(logits, sel, allowed);
    if let Some(mask) = allowed {
        anyhow::ensure!(
            mask.allows(choice.token),
            "the constraint allows no token with a finite logit ({} allowed of {})",
            mask.count(),
            logits.len()
        );
    }
    Ok(choice)
}

fn select_with_mask(logits: &[f32], sel: &Selection, allowed: Option<&TokenMask>) -> TokenChoice {
    let p = sel.params;
    let lse = log_sum_exp(logits);
    let logprob = |id: u32| sanitise(logits[id as usize]) - lse;
    let top = best_ids(logits, sel.top_logprobs)
        .into_iter()
        .map(|id| (id, logprob(id)))
        .collect();

    let mut z = adjusted_logits(logits, sel);
    if let Some(mask) = allowed {
        mask.apply(&mut z);
    }
    let token = if p.is_greedy() {
        argmax(&z) as u32
    } else {
        sample(&z, p, sel.step).unwrap_or_else(|| argmax(&z) as u32)
    };
    TokenChoice {
        token,
        logprob: logprob(token),
        top,
    }
}

/// Steps 1–5 of `select_token`'s sampling; None when no token has a finite logit.
fn sample(adjusted: &[f32], p: &SamplingParams, step: u64) -> Option<u32> {
    let z: Vec<f32> = adjusted.iter().map(|x| x / p.temperature).collect();
    let mut kept: Vec<u32> = (0..z.len() as u32)
        .filter(|i| z[*i as usize].is_finite())
        .collect();
    if kept.is_empty() {
        return None;
    }
    let by_rank = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
    if p.top_k > 0 && p.top_k < kept.len() {
        kept.select_nth_unstable_by(p.top_k - 1, by_rank);
        kept.truncate(p.top_k);
        kept.sort_unstable();
    }
    let z_max = kept
        .iter()
        .map(|i| z[*i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |i: u32| (z[i as usize] - z_max).exp();
    if p.top_p < 1.0 {
        let total = weight_tree(z.len(), &kept, weight)
            .last()
            .map_or(0.0, |root| root[0]);
        let mut ranked = kept.clone();
        ranked.sort_unstable_by(by_rank);
        let mut cumulative = 0f32;
        let mut keep = Vec::new();
        for id in ranked {
            if cumulative >= p.top_p {
                break;
            }
            cumulative += (z[id as usize] - z_max).exp() / total;
            keep.push(id);
        }
        keep.sort_unstable();
        kept = keep;
    }
    if p.min_p > 0.0 {
        kept.retain(|i| (z[*i as usize] - z_max).exp() >= p.min_p);
    }
    if kept.is_empty() {
        return None;
    }
    let tree = weight_tree(z.len(), &kept, weight);
    let total = tree.last().map_or(0.0, |root| root[0]);
    Some(tree_draw(&tree, uniform(p.seed, step) * total))
}

/// The sampling sums' order, shared by every backend: leaf i is `weight(i)` for the ids in `kept`
/// and 0 for the others, padded with zeros to a power of two ≥ `n_ids`; each node is its left
/// child + its right child (f32). Returns the levels, leaves first, the root (the total) last.
pub fn weight_tree(n_ids: usize, kept: &[u32], weight: impl Fn(u32) -> f32) -> Vec<Vec<f32>> {
    let mut level = vec![0f32; n_ids.next_power_of_two().max(1)];
    for &id in kept {
        level[id as usize] = weight(id);
    }
    let mut levels = vec![level];
    while let Some(last) = levels.last().filter(|l| l.len() > 1) {
        let next = last.chunks(2).map(|pair| pair[0] + pair[1]).collect();
        levels.push(next);
    }
    levels
}

/// The id a draw of `target` (in [0, total)) lands on: from the root, into the left child while the
/// target is below its sum or the right child is empty, else into the right child with the left's
/// sum taken off (f32). Every node taken has a positive sum, so the leaf is a kept id.
pub fn tree_draw(levels: &[Vec<f32>], mut target: f32) -> u32 {
    let mut node = 0usize;
    for level in levels[..levels.len() - 1].iter().rev() {
        let (left, right) = (level[2 * node], level[2 * node + 1]);
        if target < left || right == 0.0 {
            node *= 2;
        } else {
            target -= left;
            node = 2 * node + 1;
        }
    }
    node as u32
}

#[cfg(test)]
mod tests;
