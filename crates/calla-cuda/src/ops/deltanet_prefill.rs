//! Launcher for deltanet_prefill.cu: the Gated DeltaNet core of a prompt (conv + L2 norm,
//! conv-ring update, per-chunk UT transform, the sequential chunk scan, gated RMSNorm), reading and
//! advancing the decode path's state (conv ring `[K, C]`, S `[Hv, Dv, Dk]`, both f32).
//!
//! Legend: T prompt tokens, p0 first position, C conv channels = 2·Hk·Dk + Hv·Dv, K conv kernel,
//! Hk/Hv key/value heads, Dk/Dv their dims, NC = ⌈T/64⌉ chunks.

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::ops::gemm::Planes;
use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const CHUNK: usize = 64;
const MAX_K: usize = 8;
const BV: usize = 32;
/// threads of `prefill_dn_states` (32·DN_ST_WARPS in the kernel)
const STATES_THREADS: u32 = 512;
/// value columns per block of `prefill_dn_out`
const OUT_BV: usize = 64;

/// Device buffers of one DeltaNet layer's prompt core.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetPrefillIo {
    /// projections: qkv `[T, C]` (pre-conv), z `[T, Hv·Dv]`, b and a `[T, Hv]`, all f32
    pub qkv: DPtr,
    pub z: DPtr,
    pub b: DPtr,
    pub a: DPtr,
    /// weights (DevDeltaNet): conv `[C, K]`, A_log and dt_bias `[Hv]`, gated-norm gain `[Dv]`, f32
    pub conv_w: DPtr,
    pub a_log: DPtr,
    pub dt_bias: DPtr,
    pub norm_w: DPtr,
    /// this layer's state in the sequence: conv ring `[K, C]`, S `[Hv, Dv, Dk]`
    pub conv_ring: DPtr,
    pub state: DPtr,
    /// scratch (see [`DeltaNetScratchSizes`])
    pub conv_out: DPtr,
    pub w: DPtr,
    pub u: DPtr,
    pub aqk: DPtr,
    pub gcum: DPtr,
    /// the state before each chunk `[NC, Hv, Dv, Dk]` (tensor-core scan only)
    pub h: DPtr,
    pub o: DPtr,
    /// output: gated-norm result as planes `[T, Hv·Dv]` (out_proj's input)
    pub y: Planes,
}

/// f32 element counts of the scratch buffers for a prompt of `t` tokens.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetScratchSizes {
    pub conv_out: usize,
    pub w: usize,
    pub u: usize,
    pub aqk: usize,
    pub gcum: usize,
    pub h: usize,
    pub o: usize,
}

pub fn scratch_sizes(spec: &ModelSpec, t: usize) -> DeltaNetScratchSizes {
    let (hv, dk, dv) = (
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    DeltaNetScratchSizes {
        conv_out: t * spec.linear_conv_dim(),
        w: t * hv * dk,
        u: t * hv * dv,
        aqk: t.div_ceil(CHUNK) * hv * CHUNK * CHUNK,
        gcum: t * hv,
        h: t.div_ceil(CHUNK) * hv * dv * dk,
        o: t * hv * dv,
    }
}

pub fn check_dims(spec: &ModelSpec) -> Result<()> {
    let (hk, hv, dk, dv) = (
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    ensure!(
        hk > 0 && hv % hk == 0,
        "DeltaNet prefill: {hv} value heads over {hk} key heads"
    );
    ensure!(
        (1..=128).contains(&dk) && (1..=256).contains(&dv) && dk % 4 == 0 && dv % 4 == 0,
        "DeltaNet prefill supports key head dims ≤ 128 and value head dims ≤ 256, multiples of 4 (got {dk}, {dv})"
    );
    ensure!(
        (1..=MAX_K).contains(&spec.linear_conv_kernel_dim),
        "DeltaNet prefill supports conv kernels of 1..={MAX_K} taps (got {})",
        spec.linear_conv_kernel_dim
    );
    Ok(())
}

/// The trailing `int T, C, Hk, Hv, Dk, Dv` of the chunk, scan, states and out kernels' params (the
/// same bytes as six `i32` fields: alignment 4, after the pointers).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnDims {
    t: i32,
    c: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnConvParams {
    qkv: u64,
    conv_w: u64,
    ring: u64,
    out: u64,
    t: i32,
    p0: i32,
    c: i32,
    k: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    q_scale: f32,
    pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnRingParams {
    qkv: u64,
    ring: u64,
    t: i32,
    p0: i32,
    c: i32,
    k: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnChunkParams {
    qkvc: u64,
    a: u64,
    b: u64,
    a_log: u64,
    dt_bias: u64,
    w_out: u64,
    u_out: u64,
    aqk_out: u64,
    gcum_out: u64,
    dims: DnDims,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnScanParams {
    qkvc: u64,
    w_in: u64,
    u_in: u64,
    aqk_in: u64,
    gcum_in: u64,
    state: u64,
    o_out: u64,
    dims: DnDims,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnStatesParams {
    qkvc: u64,
    w_in: u64,
    u_io: u64,
    gcum_in: u64,
    state: u64,
    h_out: u64,
    dims: DnDims,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnOutParams {
    qkvc: u64,
    v_in: u64,
    aqk_in: u64,
    gcum_in: u64,
    h_in: u64,
    o_out: u64,
    dims: DnDims,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DnNormParams {
    o: u64,
    z: u64,
    norm_w: u64,
    out_hi: u64,
    out_lo: u64,
    t: i32,
    hv: i32,
    dv: i32,
    eps: f32,
    out_f16: u64,
}

/// The chunk transform and the scan run on tensor cores (`prefill_dn_chunk_tc`, then
/// `prefill_dn_states` and `prefill_dn_out`; 3xbf16, near f32) where the key head dim is a multiple
/// of 16, the value head dim of 8 and the two sum to at most 256 (the chunk kernel's 8 warps own 4
/// column tiles of [U | W] each), else on CUDA cores (`prefill_dn_chunk`, `prefill_dn_scan`). The
/// two paths' intermediates differ (the tensor-core chunk kernel leaves Aqk's upper blocks unwritten,
/// which only the tensor-core scan tolerates), so one choice holds for both.
fn on_tensor_cores(dk: usize, dv: usize) -> bool {
    dk.is_multiple_of(16) && dv.is_multiple_of(8) && dk + dv <= 256
}

/// The launches of one layer's DeltaNet core for `t` tokens at positions `p0..p0+t`.
pub fn prefill_core(
    gpu: &Gpu,
    spec: &ModelSpec,
    p0: usize,
    t: usize,
    io: &DeltaNetPrefillIo,
) -> Result<Vec<Launch>> {
    check_dims(spec)?;
    ensure!(t > 0, "DeltaNet prefill: no tokens");
    ensure!(
        io.y.ld == spec.linear_value_dim(),
        "DeltaNet prefill: output stride {}",
        io.y.ld
    );
    let (hk, hv, dk, dv) = (
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    let (c, k) = (spec.linear_conv_dim(), spec.linear_conv_kernel_dim);
    let nc = t.div_ceil(CHUNK);
    let (ti, ci, p0i) = (t as i32, c as i32, p0 as i32);
    let dims = DnDims {
        t: ti,
        c: ci,
        hk: hk as i32,
        hv: hv as i32,
        dk: dk as i32,
        dv: dv as i32,
    };
    let mut out = Vec::with_capacity(5);

    let conv = DnConvParams {
        qkv: io.qkv.0,
        conv_w: io.conv_w.0,
        ring: io.conv_ring.0,
        out: io.conv_out.0,
        t: ti,
        p0: p0i,
        c: ci,
        k: k as i32,
        hk: dims.hk,
        hv: dims.hv,
        dk: dims.dk,
        dv: dims.dv,
        q_scale: (dk as f32).powf(-0.5),
        pad: 0,
    };
    let width = dk.max(dv);
    out.push(Launch::new(
        gpu,
        "prefill_dn_conv",
        (nc as u32, (2 * hk + hv) as u32, 1),
        128,
        (CHUNK * (width + 1) * 4) as u32,
        &conv,
    )?);
    let ring = DnRingParams {
        qkv: io.qkv.0,
        ring: io.conv_ring.0,
        t: ti,
        p0: p0i,
        c: ci,
        k: k as i32,
    };
    out.push(Launch::new(
        gpu,
        "prefill_dn_ring",
        (c.div_ceil(256) as u32, k as u32, 1),
        256,
        0,
        &ring,
    )?);

    let chunk = DnChunkParams {
        qkvc: io.conv_out.0,
        a: io.a.0,
        b: io.b.0,
        a_log: io.a_log.0,
        dt_bias: io.dt_bias.0,
        w_out: io.w.0,
        u_out: io.u.0,
        aqk_out: io.aqk.0,
        gcum_out: io.gcum.0,
        dims,
    };
    let tc = on_tensor_cores(dk, dv);
    let (chunk_kernel, chunk_smem) = if tc {
        // (kernel layout: q, k rows of ⌈Dk/32⌉·32 + 8 floats, aliased later by the [v | k] rows of
        // Dv + Dk + 4; A [64, 72]; cumulative gates; β)
        let region = (2 * CHUNK * (dk.next_multiple_of(32) + 8)).max(CHUNK * (dv + dk + 4));
        ("prefill_dn_chunk_tc", (region + CHUNK * 72 + 2 * CHUNK) * 4)
    } else {
        // (kernel layout: q, k rows of Dk + 4 floats, aliased later by [U | W]; A; cumulative gates; β)
        let region = (2 * CHUNK * (dk + 4)).max(CHUNK * (dv + dk));
        ("prefill_dn_chunk", (region + CHUNK * 68 + 2 * CHUNK) * 4) // A rows of 68: float4 reads
    };
    out.push(Launch::new(
        gpu,
        chunk_kernel,
        (nc as u32, hv as u32, 1),
        256,
        chunk_smem as u32,
        &chunk,
    )?);

    if tc {
        // the sequential part: v' (over U) and the state before each chunk
        let states = DnStatesParams {
            qkvc: io.conv_out.0,
            w_in: io.w.0,
            u_io: io.u.0,
            gcum_in: io.gcum.0,
            state: io.state.0,
            h_out: io.h.0,
            dims,
        };
        // (kernel layout, two buffers of: W rows of ⌈Dk/32⌉·32 + 8 floats, k rows of Dk + 4, U rows
        // of 40, gates; then v' [64, 36], decays, and the S planes [32, ⌈Dk/16⌉·8 + 4] ×2 in words)
        let w_pitch = dk.next_multiple_of(32) + 8;
        let s_pitch = (dk / 2).next_multiple_of(8) + 4;
        let floats =
            2 * CHUNK * (w_pitch + dk + 4 + 40) + CHUNK * 36 + 3 * CHUNK + 2 * BV * s_pitch;
        out.push(Launch::new(
            gpu,
            "prefill_dn_states",
            (dv.div_ceil(BV) as u32, hv as u32, 1),
            STATES_THREADS,
            (floats * 4) as u32,
            &states,
        )?);
        let o = DnOutParams {
            qkvc: io.conv_out.0,
            v_in: io.u.0,
            aqk_in: io.aqk.0,
            gcum_in: io.gcum.0,
            h_in: io.h.0,
            o_out: io.o.0,
            dims,
        };
        // (kernel layout: q rows and h rows of ⌈Dk/32⌉·32 + 8 floats; Aqk [64, 72]; v' [64, 68]; gates)
        let floats = 2 * CHUNK * (dk.next_multiple_of(32) + 8) + CHUNK * (72 + 68) + CHUNK;
        out.push(Launch::new(
            gpu,
            "prefill_dn_out",
            (nc as u32, hv as u32, dv.div_ceil(OUT_BV) as u32),
            256,
            (floats * 4) as u32,
            &o,
        )?);
    } else {
        let scan = DnScanParams {
            qkvc: io.conv_out.0,
            w_in: io.w.0,
            u_in: io.u.0,
            aqk_in: io.aqk.0,
            gcum_in: io.gcum.0,
            state: io.state.0,
            o_out: io.o.0,
            dims,
        };
        // (kernel layout: W, q, k rows and the S tile of Dk + 4 floats; U [64, 33]; v' [64, 36];
        // Aqk [64, 65]; cumulative gates and decays)
        let floats = (3 * CHUNK + BV) * (dk + 4) + CHUNK * (33 + 36 + 65) + 2 * CHUNK;
        out.push(Launch::new(
            gpu,
            "prefill_dn_scan",
            (dv.div_ceil(BV) as u32, hv as u32, 1),
            256,
            (floats * 4) as u32,
            &scan,
        )?);
    }

    let norm = DnNormParams {
        o: io.o.0,
        z: io.z.0,
        norm_w: io.norm_w.0,
        out_hi: io.y.hi.0,
        out_lo: io.y.lo.0,
        t: ti,
        hv: dims.hv,
        dv: dims.dv,
        eps: spec.rms_norm_eps,
        out_f16: io.y.f16.0,
    };
    out.push(Launch::new(
        gpu,
        "prefill_dn_norm",
        ((t * hv).div_ceil(8) as u32, 1, 1),
        256,
        0,
        &norm,
    )?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// The sizes the kernels' `static_assert`s state (deltanet_prefill.cu).
    #[test]
    fn parameter_structs_match_the_kernels() {
        assert_eq!(size_of::<DnConvParams>(), 72);
        assert_eq!(size_of::<DnRingParams>(), 32);
        assert_eq!(size_of::<DnChunkParams>(), 96);
        assert_eq!(size_of::<DnScanParams>(), 80);
        assert_eq!(size_of::<DnStatesParams>(), 72);
        assert_eq!(size_of::<DnOutParams>(), 72);
        assert_eq!(size_of::<DnNormParams>(), 64);
    }
}
