//! Launcher for attention_prefill.cu: q/k norm + partial RoPE + KV-cache append for the
//! prompt's positions, then causal flash attention with the output gate, on the decode kernel's
//! KV cache (`[Hkv, max_ctx, Dh]`, bf16 or f32 — attention.rs `KvDtype`).
//!
//! Legend: T prompt tokens, p0 first position, Hq/Hkv heads, Dh head dim, R rotary dims.

use anyhow::{bail, ensure, Result};
use calla_model::ModelSpec;

use crate::ops::attention::KvDtype;
use crate::ops::gemm::Planes;
use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const BQ: usize = 64;

/// Device buffers of one attention layer's prompt.
#[derive(Debug, Clone, Copy)]
pub struct AttentionPrefillIo {
    /// projections: q_proj output `[T, Hq·(2)Dh]` (per head [q | gate]), k and v `[T, Hkv·Dh]`, f32
    pub qg: DPtr,
    pub k: DPtr,
    pub v: DPtr,
    /// weights: `1 + q_norm`, `1 + k_norm` `[Dh]`; RoPE inverse frequencies `[R/2]`
    pub q_gain: DPtr,
    pub k_gain: DPtr,
    pub inv_freq: DPtr,
    /// this layer's caches in the sequence
    pub k_cache: DPtr,
    pub v_cache: DPtr,
    pub max_ctx: usize,
    pub kv: KvDtype,
    /// scratch: rotated, scaled queries as planes `[T, Hq, Dh]`. With an f32 cache, a lo plane
    /// asks for split precision (≈ f32: hi·hi + lo·hi + hi·lo); without one the f32 K/V tiles are
    /// rounded to bf16 (fast precision). bf16 caches ignore lo.
    pub q: Planes,
    /// output: gated attention as planes `[T, Hq·Dh]` (o_proj's input)
    pub y: Planes,
}

pub fn check_dims(spec: &ModelSpec) -> Result<()> {
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    if !matches!(dh, 32 | 64 | 128 | 256) {
        bail!("attention prefill supports head_dim 32, 64, 128 or 256 (got {dh})");
    }
    ensure!(
        hkv > 0 && hq % hkv == 0,
        "attention prefill: {hq} query heads over {hkv} KV heads"
    );
    ensure!(
        spec.rotary_dim.is_multiple_of(2) && spec.rotary_dim <= dh,
        "rotary_dim {} must be even and ≤ head_dim",
        spec.rotary_dim
    );
    Ok(())
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AttnpPrepParams {
    qg: u64,
    k: u64,
    v: u64,
    q_gain: u64,
    k_gain: u64,
    inv_freq: u64,
    k_cache: u64,
    v_cache: u64,
    q_hi: u64,
    q_lo: u64,
    t: i32,
    p0: i32,
    hq: i32,
    hkv: i32,
    dh: i32,
    rot: i32,
    max_ctx: i32,
    gated: i32,
    eps: f32,
    scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AttnpFlashParams {
    q_hi: u64,
    q_lo: u64,
    k_cache: u64,
    v_cache: u64,
    qg: u64,
    out_hi: u64,
    out_lo: u64,
    t: i32,
    p0: i32,
    hq: i32,
    hkv: i32,
    max_ctx: i32,
    gated: i32,
    qg_ld: i32,
    pad: i32,
    out_f16: u64,
}

fn suffix(kv: KvDtype) -> &'static str {
    match kv {
        KvDtype::Bf16 => "bf16",
        KvDtype::F32 => "f32",
    }
}

/// Dynamic shared memory of the flash kernel: Q, K, V tiles (and their lo halves when split).
pub fn flash_smem(dh: usize, split: bool) -> usize {
    let tiles = if split { 6 } else { 3 };
    tiles * BQ * dh * 2
}

/// The launches of one attention layer's core for `t` tokens at positions `p0..p0+t`.
pub fn prefill_core(
    gpu: &Gpu,
    spec: &ModelSpec,
    p0: usize,
    t: usize,
    io: &AttentionPrefillIo,
) -> Result<Vec<Launch>> {
    check_dims(spec)?;
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    ensure!(t > 0, "attention prefill: no tokens");
    ensure!(
        p0 + t <= io.max_ctx,
        "attention prefill: positions {p0}..{} exceed the cache's {} positions",
        p0 + t,
        io.max_ctx
    );
    ensure!(
        io.q.ld == dh && io.y.ld == hq * dh,
        "attention prefill: plane strides {} / {}",
        io.q.ld,
        io.y.ld
    );
    // f32 caches: split precision when the caller gives the queries' lo plane, else bf16 products
    let split = io.kv == KvDtype::F32 && !io.q.lo.is_null();
    let flash_kernel = match (io.kv, split) {
        (KvDtype::Bf16, _) => format!("prefill_attn_flash_d{dh}_bf16"),
        (KvDtype::F32, true) => format!("prefill_attn_flash_d{dh}_f32"),
        (KvDtype::F32, false) => format!("prefill_attn_flash_d{dh}_f32fast"),
    };
    let gated = spec.attn_output_gate;
    let prep = AttnpPrepParams {
        qg: io.qg.0,
        k: io.k.0,
        v: io.v.0,
        q_gain: io.q_gain.0,
        k_gain: io.k_gain.0,
        inv_freq: io.inv_freq.0,
        k_cache: io.k_cache.0,
        v_cache: io.v_cache.0,
        q_hi: io.q.hi.0,
        q_lo: if split { io.q.lo.0 } else { 0 },
        t: t as i32,
        p0: p0 as i32,
        hq: hq as i32,
        hkv: hkv as i32,
        dh: dh as i32,
        rot: spec.rotary_dim as i32,
        max_ctx: io.max_ctx as i32,
        gated: gated as i32,
        eps: spec.rms_norm_eps,
        scale: (dh as f32).powf(-0.5),
    };
    let flash = AttnpFlashParams {
        q_hi: io.q.hi.0,
        q_lo: if split { io.q.lo.0 } else { 0 },
        k_cache: io.k_cache.0,
        v_cache: io.v_cache.0,
        qg: io.qg.0,
        out_hi: io.y.hi.0,
        out_lo: io.y.lo.0,
        t: t as i32,
        p0: p0 as i32,
        hq: hq as i32,
        hkv: hkv as i32,
        max_ctx: io.max_ctx as i32,
        gated: gated as i32,
        qg_ld: (hq * dh * if gated { 2 } else { 1 }) as i32,
        pad: 0,
        out_f16: io.y.f16.0,
    };
    Ok(vec![
        Launch::new(
            gpu,
            &format!("prefill_attn_prep_{}", suffix(io.kv)),
            (t as u32, (hq + hkv) as u32, 1),
            128,
            (dh * 4) as u32,
            &prep,
        )?,
        Launch::new(
            gpu,
            &flash_kernel,
            (t.div_ceil(BQ) as u32, hq as u32, 1),
            128,
            flash_smem(dh, split) as u32,
            &flash,
        )?,
    ])
}
