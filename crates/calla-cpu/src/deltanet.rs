//! Gated DeltaNet (HF `Qwen3_5MoeGatedDeltaNet`): the layer, and the gated delta rule in its two forms.
//!
//! For T new tokens:
//!   qkv = in_proj_qkv(x) [T, C];  z = in_proj_z(x) [T, Hv·Dv];  b, a = in_proj_b/a(x) [T, Hv]
//!   qkv ← silu(causal depthwise conv1d over time, kernel K, no bias); the conv state is the last K−1
//!         PRE-conv rows, tap K−1 multiplies the newest input
//!   q, k, v = split(qkv, [Hk·Dk, Hk·Dk, Hv·Dv]);  q, k ← x·rsqrt(Σx² + 1e-6) per key head;  q ← q·Dk^−½
//!   β = sigmoid(b);  g = −exp(A_log) · softplus(a + dt_bias)      (per value head; decay α = exp(g))
//!   value head h reads key head h / (Hv/Hk); its state S_h is [Dk, Dv], f32:
//!     S ← α S;  S ← S + k (β (v − Sᵀk))ᵀ;  o = Sᵀ q                (the recurrent form, decode)
//!   or the same result chunk by chunk (the chunked form, prompts; see `deltanet_chunked`)
//!   o ← w · rmsnorm(o) · silu(z) per value head (gated norm);  out = out_proj(o)
//!
//! Legend: T tokens, D hidden, C conv channels = 2·Hk·Dk + Hv·Dv, K conv kernel, Hk/Hv key/value heads,
//! Dk/Dv their dims, L ≤ 64 tokens of one chunk.

use anyhow::{ensure, Result};
use calla_model::{DeltaNetWeights, ModelSpec};
use rayon::prelude::*;

use crate::linear::Linear;
use crate::norm::{gated_rms_norm, l2_norm, sigmoid, silu};
use crate::simd::{axpy, dot_f32};

/// Tokens per chunk of the chunked form (HF and FLA use 64).
pub const CHUNK: usize = 64;

/// A DeltaNet layer's sequence state.
#[derive(Debug, Clone)]
pub struct DeltaNetState {
    /// `[K−1, C]`: the last K−1 pre-conv inputs, oldest first (zeros before the first token).
    pub conv: Vec<f32>,
    /// `[Hv, Dk, Dv]`
    pub recurrent: Vec<f32>,
}

impl DeltaNetState {
    pub fn new(spec: &ModelSpec) -> DeltaNetState {
        DeltaNetState {
            conv: vec![0.0; (spec.linear_conv_kernel_dim - 1) * spec.linear_conv_dim()],
            recurrent: vec![
                0.0;
                spec.linear_num_value_heads
                    * spec.linear_key_head_dim
                    * spec.linear_value_head_dim
            ],
        }
    }
    pub fn byte_size(&self) -> usize {
        (self.conv.len() + self.recurrent.len()) * 4
    }
}

/// Which form of the delta rule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Token by token (`deltanet_decode_step`).
    Recurrent,
    /// Chunks of 64 (`deltanet_chunked`).
    Chunked,
}

/// One value head, one token: the recurrent gated delta rule.
/// state `[Dk, Dv]`, q/k `[Dk]` (normalised, q scaled), v `[Dv]`, out `[Dv]`.
pub fn deltanet_decode_step(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    out: &mut [f32],
) {
    let dv = v.len();
    let alpha = g.exp();
    // S ← α S;  kv_mem = Sᵀ k
    let mut kv_mem = vec![0f32; dv];
    for (row, ki) in state.chunks_exact_mut(dv).zip(k) {
        for s in row.iter_mut() {
            *s *= alpha;
        }
        axpy(*ki, row, &mut kv_mem);
    }
    // δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ q
    let delta: Vec<f32> = v.iter().zip(&kv_mem).map(|(v, m)| (v - m) * beta).collect();
    out.fill(0.0);
    for ((row, ki), qi) in state.chunks_exact_mut(dv).zip(k).zip(q) {
        axpy(*ki, &delta, row);
        axpy(*qi, row, out);
    }
}

/// One value head, T tokens: the chunked gated delta rule (HF `torch_chunk_gated_delta_rule`, the
/// UT/WY form of FLA), equal to T recurrent steps up to rounding.
/// state `[Dk, Dv]`, q/k `[T, Dk]`, v `[T, Dv]`, g/beta `[T]`, out `[T, Dv]`.
///
/// Per chunk of L tokens, with c_i = Σ_{j≤i} g_j (log decay since the chunk start):
///   A_ij = (β_i k_i · k_j)·e^{c_i−c_j} for j < i                 (strictly lower)
///   U = (I + A)⁻¹ (β v),  W = (I + A)⁻¹ (β k e^{c})              (forward substitution)
///   v'_i = U_i − W_i S;   o_i = e^{c_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{c_i−c_j} v'_j
///   S ← e^{c_{L−1}} S + Σ_i e^{c_{L−1}−c_i} k_i v'_iᵀ
#[allow(clippy::too_many_arguments)]
pub fn deltanet_chunked(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
) {
    let t = g.len();
    for c0 in (0..t).step_by(CHUNK) {
        let l = CHUNK.min(t - c0);
        let (q, k, v) = (
            &q[c0 * dk..(c0 + l) * dk],
            &k[c0 * dk..(c0 + l) * dk],
            &v[c0 * dv..(c0 + l) * dv],
        );
        let (g, beta) = (&g[c0..c0 + l], &beta[c0..c0 + l]);
        let out = &mut out[c0 * dv..(c0 + l) * dv];

        let mut cum = vec![0f32; l];
        let mut running = 0f32;
        for (c, g) in cum.iter_mut().zip(g) {
            running += g;
            *c = running;
        }
        let key = |i: usize| &k[i * dk..(i + 1) * dk];

        // A [L, L] strictly lower.
        let mut a = vec![0f32; l * l];
        for i in 0..l {
            for j in 0..i {
                a[i * l + j] = beta[i] * dot_f32(key(i), key(j)) * (cum[i] - cum[j]).exp();
            }
        }
        // U [L, Dv], W [L, Dk] by forward substitution on (I + A).
        let mut u = vec![0f32; l * dv];
        let mut w = vec![0f32; l * dk];
        for i in 0..l {
            let (u_done, u_rest) = u.split_at_mut(i * dv);
            let u_i = &mut u_rest[..dv];
            for (o, vi) in u_i.iter_mut().zip(&v[i * dv..(i + 1) * dv]) {
                *o = beta[i] * vi;
            }
            let (w_done, w_rest) = w.split_at_mut(i * dk);
            let w_i = &mut w_rest[..dk];
            let decay_i = cum[i].exp();
            for (o, ki) in w_i.iter_mut().zip(key(i)) {
                *o = beta[i] * ki * decay_i;
            }
            for j in 0..i {
                let a_ij = a[i * l + j];
                axpy(-a_ij, &u_done[j * dv..(j + 1) * dv], u_i);
                axpy(-a_ij, &w_done[j * dk..(j + 1) * dk], w_i);
            }
        }
        // v' = U − W S  [L, Dv]
        let mut v_new = u;
        for i in 0..l {
            let vn = &mut v_new[i * dv..(i + 1) * dv];
            for (wik, s_row) in w[i * dk..(i + 1) * dk].iter().zip(state.chunks_exact(dv)) {
                axpy(-wik, s_row, vn);
            }
        }
        // o_i = e^{c_i} q_i S + Σ_{j≤i} (q_i·k_j) e^{c_i−c_j} v'_j
        for i in 0..l {
            let o = &mut out[i * dv..(i + 1) * dv];
            o.fill(0.0);
            let q_i = &q[i * dk..(i + 1) * dk];
            let decay_i = cum[i].exp();
            for (qik, s_row) in q_i.iter().zip(state.chunks_exact(dv)) {
                axpy(qik * decay_i, s_row, o);
            }
            for j in 0..=i {
                let attn = dot_f32(q_i, key(j)) * (cum[i] - cum[j]).exp();
                axpy(attn, &v_new[j * dv..(j + 1) * dv], o);
            }
        }
        // S ← e^{c_last} S + Σ_i e^{c_last − c_i} k_i v'_iᵀ
        let last = cum[l - 1];
        let chunk_decay = last.exp();
        for s in state.iter_mut() {
            *s *= chunk_decay;
        }
        for i in 0..l {
            let decay = (last - cum[i]).exp();
            for (kik, s_row) in key(i).iter().zip(state.chunks_exact_mut(dv)) {
                axpy(kik * decay, &v_new[i * dv..(i + 1) * dv], s_row);
            }
        }
    }
}

/// Stable softplus as torch computes it (threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub struct DeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// `[C, K]`
    conv1d: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
    out_proj: Linear,
    key_heads: usize,
    value_heads: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
    eps: f32,
}

impl DeltaNet {
    pub fn new(spec: &ModelSpec, w: &DeltaNetWeights, layer: usize) -> Result<DeltaNet> {
        let d = spec.hidden_size;
        let n = |s: &str| format!("layers.{layer}.linear_attn.{s}");
        let (hk, hv) = (spec.linear_num_key_heads, spec.linear_num_value_heads);
        let (c, k) = (spec.linear_conv_dim(), spec.linear_conv_kernel_dim);
        ensure!(
            hk > 0 && hv % hk == 0 && k >= 1,
            "{}: value heads {hv} must be a multiple of key heads {hk}, conv kernel {k} ≥ 1",
            n("")
        );
        for (name, len, want) in [
            ("conv1d.weight", w.conv1d.len(), c * k),
            ("A_log", w.a_log.len(), hv),
            ("dt_bias", w.dt_bias.len(), hv),
            ("norm.weight", w.norm.len(), spec.linear_value_head_dim),
        ] {
            ensure!(len == want, "{}: {len} values, expected {want}", n(name));
        }
        Ok(DeltaNet {
            in_proj_qkv: Linear::new(&n("in_proj_qkv"), &w.in_proj_qkv, c, d)?,
            in_proj_z: Linear::new(&n("in_proj_z"), &w.in_proj_z, spec.linear_value_dim(), d)?,
            in_proj_b: Linear::new(&n("in_proj_b"), &w.in_proj_b, hv, d)?,
            in_proj_a: Linear::new(&n("in_proj_a"), &w.in_proj_a, hv, d)?,
            conv1d: w.conv1d.clone(),
            a_log: w.a_log.clone(),
            dt_bias: w.dt_bias.clone(),
            norm: w.norm.clone(),
            out_proj: Linear::new(&n("out_proj"), &w.out_proj, d, spec.linear_value_dim())?,
            key_heads: hk,
            value_heads: hv,
            dk: spec.linear_key_head_dim,
            dv: spec.linear_value_head_dim,
            kernel: k,
            eps: spec.rms_norm_eps,
        })
    }

    /// Causal depthwise conv1d + SiLU over `qkv` `[T, C]` in place, reading and advancing `conv_state`.
    fn conv(&self, qkv: &mut [f32], t: usize, conv_state: &mut [f32]) {
        let c = qkv.len() / t;
        let history = self.kernel - 1;
        // inputs [K−1+T, C]: the stored pre-conv rows, then the new ones
        let mut inputs = Vec::with_capacity((history + t) * c);
        inputs.extend_from_slice(conv_state);
        inputs.extend_from_slice(qkv);
        conv_state.copy_from_slice(&inputs[t * c..]);
        qkv.par_chunks_mut(c).enumerate().for_each(|(i, out)| {
            // output row i reads input rows i..i+K (tap K−1 = the newest, row i+K−1)
            for (ch, o) in out.iter_mut().enumerate() {
                let taps = &self.conv1d[ch * self.kernel..(ch + 1) * self.kernel];
                let mut acc = 0f32;
                for (tap, w) in taps.iter().enumerate() {
                    acc += w * inputs[(i + tap) * c + ch];
                }
                *o = silu(acc);
            }
        });
    }

    /// x `[T, D]` → out `[T, D]`, advancing `state` by T tokens with the given form of the rule.
    pub fn forward(
        &self,
        x: &[f32],
        t: usize,
        state: &mut DeltaNetState,
        rule: Rule,
        out: &mut [f32],
    ) {
        let (hk, hv, dk, dv) = (self.key_heads, self.value_heads, self.dk, self.dv);
        let key_dim = hk * dk;
        let c = self.in_proj_qkv.rows;
        let mut qkv = vec![0f32; t * c]; // [T, C]
        self.in_proj_qkv.matmul(x, t, &mut qkv);
        let mut z = vec![0f32; t * hv * dv]; // [T, Hv, Dv]
        self.in_proj_z.matmul(x, t, &mut z);
        let mut b = vec![0f32; t * hv]; // [T, Hv]
        self.in_proj_b.matmul(x, t, &mut b);
        let mut a = vec![0f32; t * hv]; // [T, Hv]
        self.in_proj_a.matmul(x, t, &mut a);

        self.conv(&mut qkv, t, &mut state.conv);

        // Gather per key head: q, k [Hk, T, Dk]; per value head: v [Hv, T, Dv], g, β [Hv, T].
        let mut q = vec![0f32; hk * t * dk];
        let mut k = vec![0f32; hk * t * dk];
        let mut v = vec![0f32; hv * t * dv];
        for (i, row) in qkv.chunks_exact(c).enumerate() {
            for h in 0..hk {
                let dst = (h * t + i) * dk..(h * t + i + 1) * dk;
                q[dst.clone()].copy_from_slice(&row[h * dk..(h + 1) * dk]);
                k[dst].copy_from_slice(&row[key_dim + h * dk..key_dim + (h + 1) * dk]);
            }
            for h in 0..hv {
                let src = 2 * key_dim + h * dv;
                v[(h * t + i) * dv..(h * t + i + 1) * dv].copy_from_slice(&row[src..src + dv]);
            }
        }
        l2_norm(&mut q, dk);
        l2_norm(&mut k, dk);
        let q_scale = (dk as f32).powf(-0.5);
        for x in &mut q {
            *x *= q_scale;
        }
        let mut g = vec![0f32; hv * t];
        let mut beta = vec![0f32; hv * t];
        for i in 0..t {
            for h in 0..hv {
                let ai = a[i * hv + h];
                g[h * t + i] = -self.a_log[h].exp() * softplus(ai + self.dt_bias[h]);
                beta[h * t + i] = sigmoid(b[i * hv + h]);
            }
        }

        // The rule, one task per value head: o [Hv, T, Dv].
        let per_key = hv / hk;
        let mut o = vec![0f32; hv * t * dv];
        o.par_chunks_mut(t * dv)
            .zip(state.recurrent.par_chunks_mut(dk * dv))
            .enumerate()
            .for_each(|(h, (o_h, s_h))| {
                let kh = h / per_key;
                let (q_h, k_h) = (
                    &q[kh * t * dk..(kh + 1) * t * dk],
                    &k[kh * t * dk..(kh + 1) * t * dk],
                );
                let v_h = &v[h * t * dv..(h + 1) * t * dv];
                let (g_h, beta_h) = (&g[h * t..(h + 1) * t], &beta[h * t..(h + 1) * t]);
                match rule {
                    Rule::Chunked => deltanet_chunked(s_h, q_h, k_h, v_h, g_h, beta_h, o_h, dk, dv),
                    Rule::Recurrent => {
                        for i in 0..t {
                            deltanet_decode_step(
                                s_h,
                                &q_h[i * dk..(i + 1) * dk],
                                &k_h[i * dk..(i + 1) * dk],
                                &v_h[i * dv..(i + 1) * dv],
                                g_h[i],
                                beta_h[i],
                                &mut o_h[i * dv..(i + 1) * dv],
                            );
                        }
                    }
                }
            });

        // Back to [T, Hv, Dv], gated norm with z, out_proj.
        let mut o_t = vec![0f32; t * hv * dv];
        for h in 0..hv {
            for i in 0..t {
                o_t[(i * hv + h) * dv..(i * hv + h + 1) * dv]
                    .copy_from_slice(&o[(h * t + i) * dv..(h * t + i + 1) * dv]);
            }
        }
        gated_rms_norm(&mut o_t, &z, &self.norm, self.eps);
        self.out_proj.matmul(&o_t, t, out);
    }
}

#[cfg(test)]
mod tests;
