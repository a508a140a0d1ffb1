//! Launcher for deltanet.cu: the fused Gated DeltaNet decode step.
//!
//! Each value head is served by [`SPLIT`] blocks (one thread-block cluster, sm_90+) that each own
//! about Dv/SPLIT value columns of its state, or by one block on older devices (see the kernel
//! header for why and how the gated norm's Σo² crosses the blocks).

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const THREADS: u32 = 256;
/// Blocks per value head where thread-block clusters exist (the `_split8` kernels' cluster size).
pub const SPLIT: u32 = 8;
/// Conv taps the kernel holds in registers (DN_MAX_K).
pub const MAX_CONV_TAPS: usize = 8;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DeltaNetParams {
    pub qkv: u64,
    pub z: u64,
    pub b: u64,
    pub a: u64,
    pub conv_w: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub norm_w: u64,
    pub cursor: u64,
    pub conv_off: i64,
    pub state_off: i64,
    pub y: u64,
    pub hk: i32,
    pub hv: i32,
    pub dk: i32,
    pub dv: i32,
    pub k: i32,
    pub eps: f32,
    pub q_scale: f32,
    pub pad: i32,
}

/// Device buffers of one DeltaNet layer's decode step.
pub struct DeltaNetIo {
    /// projections: qkv [C], z [Hv·Dv], b [Hv], a [Hv]
    pub qkv: DPtr,
    pub z: DPtr,
    pub b: DPtr,
    pub a: DPtr,
    pub conv_w: DPtr,
    pub a_log: DPtr,
    pub dt_bias: DPtr,
    pub norm_w: DPtr,
    pub cursor: DPtr,
    /// byte offsets in the sequence state of the conv ring [K, C] and S [Hv, Dv, Dk]
    pub conv_off: usize,
    pub state_off: usize,
    /// output [Hv·Dv]
    pub y: DPtr,
}

pub fn check_dims(spec: &ModelSpec) -> Result<()> {
    let (hk, hv, dk, dv) = (
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    // dims the compiled kernels do not cover run deltanet_general.cu
    crate::ops::deltanet_general::check_head_dims(dk, dv)?;
    ensure!(
        hk > 0 && hv % hk == 0,
        "linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}"
    );
    ensure!(
        (1..=MAX_CONV_TAPS).contains(&spec.linear_conv_kernel_dim),
        "linear_conv_kernel_dim {}: the cuda DeltaNet kernel supports 1 to {MAX_CONV_TAPS}",
        spec.linear_conv_kernel_dim
    );
    Ok(())
}

/// Whether the device runs thread-block clusters (compute capability 9.0 or newer: `gpu.arch` is
/// `sm_90a`, `sm_100`, …), so the `_split8` kernels exist in its module.
pub fn has_clusters(gpu: &Gpu) -> bool {
    let digits: String = gpu
        .arch
        .trim_start_matches("sm_")
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse::<u32>().is_ok_and(|cc| cc >= 90)
}

/// The decode step with the split the device supports: [`SPLIT`] blocks per head on sm_90+, else 1.
pub fn decode(gpu: &Gpu, spec: &ModelSpec, io: &DeltaNetIo) -> Result<Launch> {
    let split = if has_clusters(gpu) { SPLIT } else { 1 };
    decode_split(gpu, spec, io, split)
}

/// The decode step with `split` blocks per value head: 1 (any device) or [`SPLIT`] (sm_90+).
pub fn decode_split(gpu: &Gpu, spec: &ModelSpec, io: &DeltaNetIo, split: u32) -> Result<Launch> {
    check_dims(spec)?;
    ensure!(
        split == 1 || split == SPLIT,
        "DeltaNet decode: {split} blocks per head (the kernels exist for 1 and {SPLIT})"
    );
    ensure!(
        split == 1 || has_clusters(gpu),
        "DeltaNet decode: {split} blocks per head need thread-block clusters (sm_90+), this device is {}",
        gpu.arch
    );
    if crate::ops::deltanet_general::decode_is_general(spec) {
        return crate::ops::deltanet_general::decode(gpu, spec, io); // one block per head, any split
    }
    let p = params(spec, io);
    let dk = spec.linear_key_head_dim;
    let name = if split == 1 {
        format!("deltanet_decode_kpl{}", dk / 32)
    } else {
        format!("deltanet_decode_kpl{}_split{split}", dk / 32)
    };
    Launch::new(
        gpu,
        &name,
        (spec.linear_num_value_heads as u32 * split, 1, 1),
        THREADS,
        0,
        &p,
    )
}

/// The decode step with [`SPLIT`] blocks per value head and no cluster, leaving w·o·silu(z) in
/// `io.y` and after it the blocks' Σo² parts [Hv, SPLIT]: the out-projection finishes the gated
/// RMSNorm in its prologue (matvec::matvec_head_norm). Where that applies it is the default
/// (without `KernelChoices::deltanet_norm_in_out_projection` the whole norm stays here, in a cluster).
pub fn decode_parts(gpu: &Gpu, spec: &ModelSpec, io: &DeltaNetIo) -> Result<Launch> {
    check_dims(spec)?;
    if crate::ops::deltanet_general::decode_is_general(spec) {
        return crate::ops::deltanet_general::decode_parts(gpu, spec, io);
    }
    let p = params(spec, io);
    let name = parts_kernel(gpu.choices().compiled_copies, spec);
    Launch::new(
        gpu,
        &name,
        (spec.linear_num_value_heads as u32 * SPLIT, 1, 1),
        THREADS,
        0,
        &p,
    )
}

/// The `_parts` kernel for `spec`'s dims: a copy compiled for Qwen3.5/3.6's DeltaNet (Dk = Dv = 128,
/// 4 conv taps, 2 value heads per key head; its index arithmetic folds away), else the one that
/// reads them from its parameters (always without `compiled_copies`).
pub fn parts_kernel(compiled_copies: bool, spec: &ModelSpec) -> String {
    let qwen35 = spec.linear_key_head_dim == 128
        && spec.linear_value_head_dim == 128
        && spec.linear_conv_kernel_dim == 4
        && spec.linear_num_value_heads == 2 * spec.linear_num_key_heads;
    if qwen35 && compiled_copies {
        format!("deltanet_decode_kpl4_split{SPLIT}_parts_k4_v128_r2")
    } else {
        format!(
            "deltanet_decode_kpl{}_split{SPLIT}_parts",
            spec.linear_key_head_dim / 32
        )
    }
}

/// The decode step's parameters; the dims must have
/// passed [`check_dims`].
pub fn params(spec: &ModelSpec, io: &DeltaNetIo) -> DeltaNetParams {
    let dk = spec.linear_key_head_dim;
    DeltaNetParams {
        qkv: io.qkv.0,
        z: io.z.0,
        b: io.b.0,
        a: io.a.0,
        conv_w: io.conv_w.0,
        a_log: io.a_log.0,
        dt_bias: io.dt_bias.0,
        norm_w: io.norm_w.0,
        cursor: io.cursor.0,
        conv_off: io.conv_off as i64,
        state_off: io.state_off as i64,
        y: io.y.0,
        hk: spec.linear_num_key_heads as i32,
        hv: spec.linear_num_value_heads as i32,
        dk: dk as i32,
        dv: spec.linear_value_head_dim as i32,
        k: spec.linear_conv_kernel_dim as i32,
        eps: spec.rms_norm_eps,
        q_scale: (dk as f32).powf(-0.5),
        pad: 0,
    }
}
