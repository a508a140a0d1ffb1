//! Launcher for kernels/attention.cu: q/k norm + RoPE + KV append, split-KV decode, combine + gate.

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::gpu::{DPtr, Gpu, Launch};

/// Positions per tile of the split-KV kernel (attention.cu ATTN_TILE).
pub const TILE: usize = 32;

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    Bf16,
    F32,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnPrepParams {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_gain: u64,
    pub k_gain: u64,
    pub inv_freq: u64,
    pub cursor: u64,
    pub k_off: i64,
    pub v_off: i64,
    pub q_out: u64,
    pub hq: i32,
    pub hkv: i32,
    pub dh: i32,
    pub rot: i32,
    pub max_ctx: i32,
    pub gated: i32,
    pub eps: f32,
    pub scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnDecodeParams {
    pub q: u64,
    pub cursor: u64,
    pub k_off: i64,
    pub v_off: i64,
    pub part_m: u64,
    pub part_l: u64,
    pub part_acc: u64,
    pub hq: i32,
    pub hkv: i32,
    pub dh: i32,
    pub max_ctx: i32,
    pub nsplit: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnCombineParams {
    pub part_m: u64,
    pub part_l: u64,
    pub part_acc: u64,
    pub qg: u64,
    pub y: u64,
    pub hq: i32,
    pub dh: i32,
    pub nsplit: i32,
    pub gated: i32,
}

/// Device buffers of one attention layer's decode step.
pub struct AttentionIo {
    /// q_proj output [Hq, (2)Dh], k [Hkv·Dh], v [Hkv·Dh]
    pub qg: DPtr,
    pub k: DPtr,
    pub v: DPtr,
    pub q_gain: DPtr,
    pub k_gain: DPtr,
    pub inv_freq: DPtr,
    pub cursor: DPtr,
    /// byte offsets of K and V caches [Hkv, max_ctx, Dh] in the sequence state
    pub k_off: usize,
    pub v_off: usize,
    /// scratch: q [Hq, Dh]; partials m, l [Hq, nsplit]; acc [Hq, nsplit, Dh]
    pub q: DPtr,
    pub part_m: DPtr,
    pub part_l: DPtr,
    pub part_acc: DPtr,
    pub nsplit: usize,
    /// output [Hq·Dh] (gated)
    pub y: DPtr,
}

pub fn check_dims(spec: &ModelSpec) -> Result<()> {
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    ensure!(
        dh % 32 == 0 && dh <= 256,
        "head_dim {dh}: the cuda attention kernels support multiples of 32 up to 256"
    );
    ensure!(
        hkv > 0 && hq % hkv == 0 && hq / hkv <= 16,
        "{hq} query heads over {hkv} KV heads: groups of ≤ 16 supported"
    );
    ensure!(
        spec.rotary_dim.is_multiple_of(2) && spec.rotary_dim <= dh,
        "rotary_dim {} must be even and ≤ head_dim",
        spec.rotary_dim
    );
    Ok(())
}

/// Dynamic shared memory of attn_decode.
pub fn decode_smem(spec: &ModelSpec, kv: KvDtype) -> usize {
    let g = spec.num_attention_heads / spec.num_key_value_heads;
    let dh = spec.head_dim;
    let pitch = match kv {
        KvDtype::F32 => dh + 4,
        KvDtype::Bf16 => dh + 8,
    };
    g * dh * 4 + TILE * pitch * kv.size() + TILE * dh * kv.size()
}

pub fn decode(
    gpu: &Gpu,
    spec: &ModelSpec,
    kv: KvDtype,
    max_ctx: usize,
    io: &AttentionIo,
) -> Result<Vec<Launch>> {
    check_dims(spec)?;
    ensure!(
        (1..=1024).contains(&io.nsplit),
        "attention: {} KV splits (attn_combine supports 1..=1024)",
        io.nsplit
    );
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    let prep = AttnPrepParams {
        qg: io.qg.0,
        k: io.k.0,
        v: io.v.0,
        q_gain: io.q_gain.0,
        k_gain: io.k_gain.0,
        inv_freq: io.inv_freq.0,
        cursor: io.cursor.0,
        k_off: io.k_off as i64,
        v_off: io.v_off as i64,
        q_out: io.q.0,
        hq: hq as i32,
        hkv: hkv as i32,
        dh: dh as i32,
        rot: spec.rotary_dim as i32,
        max_ctx: max_ctx as i32,
        gated: spec.attn_output_gate as i32,
        eps: spec.rms_norm_eps,
        scale: (dh as f32).powf(-0.5),
    };
    let dec = AttnDecodeParams {
        q: io.q.0,
        cursor: io.cursor.0,
        k_off: io.k_off as i64,
        v_off: io.v_off as i64,
        part_m: io.part_m.0,
        part_l: io.part_l.0,
        part_acc: io.part_acc.0,
        hq: hq as i32,
        hkv: hkv as i32,
        dh: dh as i32,
        max_ctx: max_ctx as i32,
        nsplit: io.nsplit as i32,
        pad: 0,
    };
    let comb = AttnCombineParams {
        part_m: io.part_m.0,
        part_l: io.part_l.0,
        part_acc: io.part_acc.0,
        qg: io.qg.0,
        y: io.y.0,
        hq: hq as i32,
        dh: dh as i32,
        nsplit: io.nsplit as i32,
        gated: spec.attn_output_gate as i32,
    };
    let g = hq / hkv;
    Ok(vec![
        Launch::new(
            gpu,
            &format!("attn_prep_{}", kv.suffix()),
            ((hq + hkv) as u32, 1, 1),
            128,
            (dh * 4) as u32,
            &prep,
        )?,
        Launch::new(
            gpu,
            &format!("attn_decode_{}", kv.suffix()),
            (io.nsplit as u32, hkv as u32, 1),
            (32 * g) as u32,
            decode_smem(spec, kv) as u32,
            &dec,
        )?,
        Launch::new(
            gpu,
            "attn_combine",
            (hq as u32, 1, 1),
            dh.min(256) as u32,
            0,
            &comb,
        )?,
    ])
}

/// Splits of the KV range: enough blocks to fill the GPU at long context, never more than the
/// context has tiles.
pub fn num_splits(max_ctx: usize) -> usize {
    max_ctx.div_ceil(TILE).clamp(1, 128)
}
