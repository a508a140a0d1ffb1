//! Launcher for kernels/decode_layer.cu: a decoder layer's decode step as one persistent launch
//! whose phases (in-projection, DeltaNet recurrence, out-projection, router + routing, gate/up,
//! down) are separated by grid barriers instead of kernel boundaries (docs/persistent-decode.md).
//! Attention layers run their in-projection and attention as before and the kernel from the
//! out-projection on. Formats: q4 projections and experts (MLX 4-bit checkpoints, the synthetic q4
//! model), router q8 or q4; anything else keeps the chain of launches (forward.rs).

use anyhow::Result;
use calla_model::ModelSpec;

use crate::deltanet::{self, DeltaNetParams};
use crate::forward::{Scratch, StateLayout};
use crate::gpu::{DPtr, Gpu, Launch};
use crate::matvec::{self, MatvecParams};
use crate::moe::{self, MoePersistentParams};
use crate::weights::{DevMatrix, DevMixer, DevModel, Format};

pub const THREADS: u32 = 256;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerParams {
    pub in_proj: MatvecParams,
    pub dn: DeltaNetParams,
    pub out_proj: MatvecParams,
    pub moe: MoePersistentParams,
    pub first_phase: i32,
    pub gated: i32,
    pub last_phase: i32,
    pub pad: i32,
    pub timing: u64,
}

/// Events a timed layer launch stamps (decode_layer.cu LAYER_EVENTS).
pub const EVENTS: usize = 12;
const EVENT_NAMES: [&str; EVENTS] = [
    "start",
    "in-proj done",
    "barrier 1",
    "DeltaNet done",
    "barrier 2",
    "out-proj done",
    "barrier 3",
    "router rows done",
    "routed (barrier 4)",
    "gate/up done",
    "barrier 5",
    "down done",
];
/// The most blocks a timed launch may have (the timing buffer's width).
pub const MAX_TIMED_BLOCKS: usize = 1024;

/// The layer whose launch stamps its phases (`CALLA_LAYER_TIMING=layer`, a lab switch).
pub fn timed_layer() -> Option<usize> {
    std::env::var("CALLA_LAYER_TIMING")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// A report of the timed layer's last launch from its stamps (u64 [EVENTS][2][MAX_TIMED_BLOCKS]: SM clock,
/// global timer): per event, across blocks, the median and the maximum since the block's own start
/// (SM clock, converted at `clock_mhz`), and the global-timer spread of the starts.
pub fn timing_report(stamps: &[u64], clock_mhz: f64) -> String {
    let at = |e: usize, kind: usize, b: usize| stamps[(e * 2 + kind) * MAX_TIMED_BLOCKS + b];
    let blocks = (0..MAX_TIMED_BLOCKS)
        .take_while(|&b| at(0, 1, b) != 0)
        .count();
    let mut out = format!(
        "timed layer: {blocks} blocks, µs since each block's start (SM clock at {clock_mhz:.0} MHz)\n"
    );
    let starts: Vec<u64> = (0..blocks).map(|b| at(0, 1, b)).collect();
    let (lo, hi) = (
        starts.iter().min().copied().unwrap_or(0),
        starts.iter().max().copied().unwrap_or(0),
    );
    out += &format!(
        "  start spread (global timer): {:.2} µs\n",
        (hi - lo) as f64 / 1e3
    );
    for (e, name) in EVENT_NAMES.iter().enumerate().skip(1) {
        let mut v: Vec<f64> = (0..blocks)
            .filter(|&b| at(e, 0, b) != 0)
            .map(|b| at(e, 0, b).wrapping_sub(at(0, 0, b)) as f64 / clock_mhz)
            .collect();
        if v.is_empty() {
            continue;
        }
        v.sort_by(f64::total_cmp);
        out += &format!(
            "  {name:<20} median {:7.2}  max {:7.2}  min {:7.2}\n",
            v[v.len() / 2],
            v[v.len() - 1],
            v[0]
        );
    }
    out
}

/// The last phase each launch runs: 6, or less with `CALLA_LAYER_LAST_PHASE` (a lab switch that
/// times the phases by leaving the later ones out; the results are then wrong).
fn last_phase() -> i32 {
    std::env::var("CALLA_LAYER_LAST_PHASE")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(6, |k| k.clamp(1, 6))
}

/// Whether the decode step uses the persistent layer kernel where the formats allow:
/// `CALLA_DECODE=layer`. Off by default: correct (the engine test holds it to the chain), but
/// measured slower than the chain of launches (226 against 333 tok/s at 4K, docs/performance.md,
/// "Session 3"): its phases run slower than the same device functions as kernels of their own.
pub fn enabled_by_env() -> bool {
    std::env::var("CALLA_DECODE").is_ok_and(|v| v == "layer")
}

/// Blocks per SM of the persistent grid: what fits (occupancy), capped by
/// `CALLA_LAYER_BLOCKS_PER_SM` when set (measurements).
fn blocks_per_sm(fits: usize) -> usize {
    std::env::var("CALLA_LAYER_BLOCKS_PER_SM")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(fits, |cap| cap.clamp(1, fits))
}

/// A q4 matrix the phases read with 32-column units and whole units per group.
fn q4(m: &DevMatrix) -> bool {
    m.format == Format::Q4 && m.group_size.is_multiple_of(32) && m.cols.is_multiple_of(32)
}

/// The launches of layer `i` with the persistent kernel, or None when its formats or shapes have no
/// such kernel (the caller then builds the chain).
pub fn layer_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
) -> Result<Option<Vec<Launch>>> {
    let layer = &model.layers[i];
    let d = spec.hidden_size;
    let eps = spec.rms_norm_eps;
    let Some(w) = crate::forward::moe_weights(model, spec, i) else {
        return Ok(None);
    };
    let io = crate::forward::moe_io(model, spec, s, i);
    if !d.is_multiple_of(32) {
        return Ok(None);
    }
    let Some(moe_params) = moe::persistent_params(&w, &io, s.layer_sync)? else {
        return Ok(None);
    };
    let slots = moe_params.d.slot_end as usize;
    let mut launches = Vec::new();
    let mut p = LayerParams {
        moe: moe_params,
        last_phase: last_phase(),
        timing: match s.layer_timing {
            Some((buf, layer)) if layer == i => buf.0,
            _ => 0,
        },
        ..Default::default()
    };
    let kpl = spec.linear_key_head_dim / 32;
    match &layer.mixer {
        DevMixer::DeltaNet(dw) => {
            let value_dim = spec.linear_value_dim();
            let gs = dw.in_proj[0].group_size;
            if deltanet::check_dims(spec).is_err()
                || crate::deltanet_general::decode_is_general(spec)
                || !dw.in_proj.iter().all(|m| q4(m) && m.group_size == gs)
                || dw.in_proj.len() > 4
                || !q4(&dw.out_proj)
                || !value_dim.is_multiple_of(32)
                || !spec.linear_value_head_dim.is_multiple_of(4)
            {
                return Ok(None);
            }
            let segs: Vec<(DevMatrix, DPtr)> = dw
                .in_proj
                .iter()
                .copied()
                .zip([s.dn_qkv, s.dn_z, s.dn_b, s.dn_a])
                .collect();
            let seg_refs: Vec<&(DevMatrix, DPtr)> = segs.iter().collect();
            p.in_proj = matvec::params(s.h, d, Some((layer.input_gain, eps)), &seg_refs, false)?;
            let io = crate::forward::deltanet_io(model, layout, s, i)
                .ok_or_else(|| anyhow::anyhow!("layer {i} is not a DeltaNet layer"))?;
            p.dn = deltanet::params(spec, &io);
            p.out_proj = matvec::params(s.dn_y, value_dim, None, &[&(dw.out_proj, s.h)], true)?;
            p.first_phase = 1;
            p.gated = 1;
        }
        DevMixer::Attention(aw) => {
            let k = spec.num_attention_heads * spec.head_dim;
            if !q4(&aw.o_proj) || !k.is_multiple_of(32) {
                return Ok(None);
            }
            // in-projection and attention as launches of their own; the kernel from phase 3 on
            launches.extend(crate::forward::attention_core_launches(
                gpu, spec, model, layout, s, i,
            )?);
            p.out_proj = matvec::params(s.at_y, k, None, &[&(aw.o_proj, s.h)], true)?;
            p.first_phase = 3;
            p.gated = 0;
        }
    }
    if let Some(k) = std::env::var("CALLA_LAYER_FIRST_PHASE")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        p.first_phase = p.first_phase.max(k.clamp(1, 6)); // lab: later phases alone
    }
    let kpl = if matches!(layer.mixer, DevMixer::DeltaNet(_)) {
        kpl
    } else {
        4
    };
    let name = format!("decode_layer_kpl{kpl}_{}", w.router.format.suffix());
    let floats = [
        matvec::xpad_len(d) + d / 32,
        matvec::xpad_len(p.out_proj.k as usize) + p.out_proj.k as usize / 32,
        moe::persistent_smem_floats(&w, &io, slots),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let smem = (floats * 4) as u32;
    // every block resident at once, or the grid barrier never opens
    let fits = gpu.resident_blocks(&name, THREADS, smem)?;
    let grid = gpu.sm_count as usize * blocks_per_sm(fits);
    anyhow::ensure!(
        p.timing == 0 || grid <= MAX_TIMED_BLOCKS,
        "layer timing: {grid} blocks"
    );
    launches.push(Launch::new(
        gpu,
        &name,
        (grid as u32, 1, 1),
        THREADS,
        smem,
        &p,
    )?);
    Ok(Some(launches))
}
