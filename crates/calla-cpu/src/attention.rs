//! Gated full attention (HF `Qwen3_5MoeAttention`), with its KV cache.
//!
//! For T new tokens at positions p0..p0+T:
//!   [q | gate] = q_proj(x)          per head: rows [h·2Dh, h·2Dh+Dh) are q, the next Dh the gate
//!   k = k_proj(x), v = v_proj(x)
//!   q, k ← zero-centred RMSNorm per head (q_norm / k_norm)
//!   q, k ← NeoX RoPE on dims [0, rotary_dim): pairs (i, i + rotary_dim/2), angle = pos · θ^(−2i/rotary_dim)
//!   o_h = softmax(q_h · K_{h/(Hq/Hkv)}ᵀ · Dh^−½, causal) · V      (GQA: q head h uses KV head h·Hkv/Hq)
//!   o ← o ⊙ sigmoid(gate);  out = o_proj(o)
//!
//! Legend: T new tokens, P cached positions (after appending), D hidden, Hq/Hkv heads, Dh head dim.

use anyhow::Result;
use calla_model::{AttentionWeights, ModelSpec};
use rayon::prelude::*;

use crate::linear::Linear;
use crate::norm::{rms_norm_zero_centred, sigmoid};
use crate::simd;

/// Keys and values of every past position: `[P, Hkv, Dh]` each (RoPE already applied to keys).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl KvCache {
    pub fn byte_size(&self) -> usize {
        (self.keys.len() + self.values.len()) * 4
    }
}

/// The inverse frequencies of the rotated pairs, computed as HF does (f32): `1 / θ^(2i/rotary_dim)`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(rotary_dim: usize, theta: f64) -> Rope {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / rotary_dim as f32;
                1.0 / (theta as f32).powf(exponent)
            })
            .collect();
        Rope { inv_freq }
    }

    /// Rotate the first `rotary_dim` dims of one head vector at `pos` (NeoX half split).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, inv_freq) in self.inv_freq.iter().enumerate() {
            // HF: freqs = inv_freq · pos in f32, then cos/sin.
            let angle = pos as f32 * inv_freq;
            let (sin, cos) = (angle.sin(), angle.cos());
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * cos - x2 * sin;
            x[i + half] = x2 * cos + x1 * sin;
        }
    }
}

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    gated: bool,
    eps: f32,
}

impl Attention {
    pub fn new(spec: &ModelSpec, w: &AttentionWeights, layer: usize) -> Result<Attention> {
        let d = spec.hidden_size;
        let n = |s: &str| format!("layers.{layer}.self_attn.{s}");
        let dh = spec.head_dim;
        anyhow::ensure!(
            w.q_norm.len() == dh && w.k_norm.len() == dh,
            "{}: q_norm/k_norm have {}/{} entries, expected head_dim {dh}",
            n("q_norm"),
            w.q_norm.len(),
            w.k_norm.len()
        );
        anyhow::ensure!(
            spec.num_attention_heads % spec.num_key_value_heads.max(1) == 0
                && spec.rotary_dim % 2 == 0
                && spec.rotary_dim <= dh,
            "{}: heads {}/{} or rotary_dim {} inconsistent with head_dim {dh}",
            n(""),
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.rotary_dim
        );
        Ok(Attention {
            q_proj: Linear::new(&n("q_proj"), &w.q_proj, spec.q_proj_rows(), d)?,
            k_proj: Linear::new(&n("k_proj"), &w.k_proj, spec.kv_dim(), d)?,
            v_proj: Linear::new(&n("v_proj"), &w.v_proj, spec.kv_dim(), d)?,
            o_proj: Linear::new(&n("o_proj"), &w.o_proj, d, spec.num_attention_heads * dh)?,
            q_norm: w.q_norm.clone(),
            k_norm: w.k_norm.clone(),
            rope: Rope::new(spec.rotary_dim, spec.rope_theta),
            heads: spec.num_attention_heads,
            kv_heads: spec.num_key_value_heads,
            head_dim: dh,
            gated: spec.attn_output_gate,
            eps: spec.rms_norm_eps,
        })
    }

    /// x `[T, D]` → out `[T, D]`, appending T positions to `cache`.
    pub fn forward(&self, x: &[f32], t: usize, cache: &mut KvCache, out: &mut [f32]) {
        let (hq, hkv, dh) = (self.heads, self.kv_heads, self.head_dim);
        let q_rows = self.q_proj.rows;
        let kv_dim = hkv * dh;
        let p0 = cache.keys.len() / kv_dim;

        let mut q_and_gate = vec![0f32; t * q_rows]; // [T, Hq, 2·Dh] (or [T, Hq, Dh] ungated)
        self.q_proj.matmul(x, t, &mut q_and_gate);
        let mut k = vec![0f32; t * kv_dim]; // [T, Hkv, Dh]
        self.k_proj.matmul(x, t, &mut k);
        let mut v = vec![0f32; t * kv_dim]; // [T, Hkv, Dh]
        self.v_proj.matmul(x, t, &mut v);

        // Split per head: q [T, Hq, Dh], gate [T, Hq, Dh].
        let stride = if self.gated { 2 * dh } else { dh };
        let mut q = vec![0f32; t * hq * dh];
        let mut gate = vec![0f32; if self.gated { t * hq * dh } else { 0 }];
        for (i, head_block) in q_and_gate.chunks_exact(stride).enumerate() {
            q[i * dh..(i + 1) * dh].copy_from_slice(&head_block[..dh]);
            if self.gated {
                gate[i * dh..(i + 1) * dh].copy_from_slice(&head_block[dh..]);
            }
        }

        rms_norm_zero_centred(&mut q, &self.q_norm, self.eps);
        rms_norm_zero_centred(&mut k, &self.k_norm, self.eps);
        for (i, head) in q.chunks_exact_mut(dh).enumerate() {
            self.rope.apply(head, p0 + i / hq);
        }
        for (i, head) in k.chunks_exact_mut(dh).enumerate() {
            self.rope.apply(head, p0 + i / hkv);
        }
        cache.keys.extend_from_slice(&k);
        cache.values.extend_from_slice(&v);

        // o [T, Hq, Dh]: one task per (token, head).
        let scale = (dh as f32).powf(-0.5);
        let group = hq / hkv;
        let (keys, values) = (&cache.keys, &cache.values);
        let mut o = vec![0f32; t * hq * dh];
        o.par_chunks_mut(dh).enumerate().for_each(|(i, o_head)| {
            let (tok, h) = (i / hq, i % hq);
            let kv_h = h / group;
            let q_head = &q[i * dh..(i + 1) * dh];
            let visible = p0 + tok + 1; // causal: positions 0..=p0+tok
            let mut scores: Vec<f32> = (0..visible)
                .map(|p| {
                    let key = &keys[(p * hkv + kv_h) * dh..(p * hkv + kv_h + 1) * dh];
                    simd::dot_f32(q_head, key) * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in &mut scores {
                *s = (*s - max).exp();
                sum += *s;
            }
            o_head.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let value = &values[(p * hkv + kv_h) * dh..(p * hkv + kv_h + 1) * dh];
                simd::axpy(s / sum, value, o_head);
            }
        });
        if self.gated {
            for (o, g) in o.iter_mut().zip(&gate) {
                *o *= sigmoid(*g);
            }
        }
        self.o_proj.matmul(&o, t, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_half_apart_and_keeps_the_rest() {
        let rope = Rope::new(4, 10_000.0);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope.apply(&mut x, 3);
        // pair (0, 2) at angle 3·1, pair (1, 3) at angle 3·0.01
        let (a0, a1) = (3.0f32, 3.0f32 * 0.01);
        let want = [
            1.0 * a0.cos() - 3.0 * a0.sin(),
            2.0 * a1.cos() - 4.0 * a1.sin(),
            3.0 * a0.cos() + 1.0 * a0.sin(),
            4.0 * a1.cos() + 2.0 * a1.sin(),
            5.0,
            6.0,
        ];
        for (g, w) in x.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{x:?} vs {want:?}");
        }
    }
}
