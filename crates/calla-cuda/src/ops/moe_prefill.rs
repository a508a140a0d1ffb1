//! Launcher for the MoE block of a prompt: moe_prefill.cu (top-A routing, counting sort,
//! tile map, combine) around gemm.cu launches (router; grouped gate/up with SwiGLU; grouped down;
//! the shared expert with its sigmoid gate as a per-row scale). Eight launches, nothing read back.
//! Also the dense SwiGLU MLP (Qwen3.5 dense).
//!
//! Legend: T tokens, D hidden, E experts, A active experts, I / Is expert / shared intermediate,
//! S = T·A sorted (token, expert) slots.

use anyhow::{ensure, Result};
use calla_model::{FeedForwardSpec, ModelSpec};

use crate::ops::gemm::{self, Gemm, GemmOut, Grouped, Planes, Precision};
use crate::ops::prompt_precision::{Product, PromptPrecision};
use crate::ops::weights::{DevMlp, DevMoe};
use crate::runtime::gpu::{DPtr, Gpu, Launch};
use crate::runtime::pool::{Region, ScratchPlan, ALWAYS};

pub const MAX_EXPERTS: usize = 1024;
const TOKENS_PER_BLOCK: usize = 8;

/// The MoE dims of a spec: (E, A, I, Is, norm_topk_prob).
pub fn moe_dims(spec: &ModelSpec) -> Option<(usize, usize, usize, usize, bool)> {
    match &spec.feed_forward {
        FeedForwardSpec::Moe {
            num_experts,
            top_k,
            expert_intermediate,
            shared_intermediate,
            norm_topk_prob,
        } => Some((
            *num_experts,
            *top_k,
            *expert_intermediate,
            *shared_intermediate,
            *norm_topk_prob,
        )),
        FeedForwardSpec::Dense { .. } => None,
    }
}

/// Upper bound of the grouped GEMMs' tiles: Σ_e ⌈n_e/BM⌉ ≤ ⌈S/BM⌉ + min(E, S).
pub fn max_tiles(t: usize, e: usize, a: usize) -> usize {
    (t * a).div_ceil(gemm::BM) + e.min(t * a)
}

/// Device buffers of one MoE prompt block (sized for up to T tokens; see `PrefillScratch`).
#[derive(Debug, Clone, Copy)]
pub struct MoePrefillScratch {
    /// f32 `[T, E]`
    pub logits: DPtr,
    /// i32 / f32 `[T, A]`
    pub ids: DPtr,
    pub weights: DPtr,
    /// f32 `[T]`: sigmoid(shared gate)
    pub shared_w: DPtr,
    /// u32 `[E]`, zero between calls (allocate zeroed: the scan re-zeroes it)
    pub counts: DPtr,
    /// i32 `[E + 1]`, `[E]`
    pub offsets: DPtr,
    pub cursor: DPtr,
    /// int4 `[max_tiles]`, i32
    pub tile_map: DPtr,
    pub tile_count: DPtr,
    /// i32 `[S]`
    pub sorted_token: DPtr,
    pub slot_of: DPtr,
    /// planes `[S, I]`: silu(gate)·up per slot
    pub act: Planes,
    /// f32 `[S, D]`: down output per slot
    pub y_slot: DPtr,
    /// planes `[T, Is]`
    pub shared_act: Planes,
}

/// The MoE block's buffers for T tokens as scratch-plan regions, with the launch steps of
/// [`prefill_moe`] from `s0` (0 router, 1 top-A, 2 scan, 3 scatter, 4 gate/up, 5 down, 6 shared
/// gate/up, 7 shared down, 8 combine) as lifetimes, so buffers that are dead share bytes: the down
/// output `y_slot` (T·A·D f32, the largest) reuses the router logits', ids' and sorted tokens'
/// bytes, the shared expert's activations reuse the routed ones'. `counts` must be zero on entry
/// (the scan re-zeroes it): it is never shared, and the caller zeroes the allocation once.
pub fn scratch_regions(spec: &ModelSpec, t: usize, s0: usize) -> Vec<Region> {
    let Some((e, a, i, is, _)) = moe_dims(spec) else {
        return Vec::new();
    };
    let d = spec.hidden_size;
    let slots = t * a;
    let at = |first: usize, last: usize| (s0 + first, s0 + last);
    let plane = |rows: usize, cols: usize| rows * cols.max(1) * 2;
    vec![
        Region::new("moe.logits", t * e * 4, at(0, 1)),
        Region::new("moe.ids", slots * 4, at(1, 3)),
        Region::new("moe.weights", slots * 4, at(1, 8)),
        Region::new("moe.shared_w", t * 4, at(1, 7)),
        Region::new("moe.counts", e * 4, ALWAYS),
        Region::new("moe.offsets", (e + 1) * 4, at(2, 2)),
        Region::new("moe.cursor", e * 4, at(2, 3)),
        Region::new("moe.tile_map", 16 * max_tiles(t, e, a), at(2, 5)),
        Region::new("moe.tile_count", 4, at(2, 5)),
        Region::new("moe.sorted_token", slots * 4, at(3, 4)),
        Region::new("moe.slot_of", slots * 4, at(3, 8)),
        Region::new("moe.act.hi", plane(slots, i), at(4, 5)),
        Region::new("moe.act.lo", plane(slots, i), at(4, 5)),
        Region::new("moe.y_slot", slots * d * 4, at(5, 8)),
        Region::new("moe.shared_act.hi", plane(t, is), at(6, 7)),
        Region::new("moe.shared_act.lo", plane(t, is), at(6, 7)),
    ]
}

impl MoePrefillScratch {
    /// The buffers of [`scratch_regions`] inside a planned allocation at `base`.
    pub fn from_plan(
        spec: &ModelSpec,
        base: DPtr,
        plan: &ScratchPlan,
    ) -> Result<MoePrefillScratch> {
        let (_, _, i, is, _) = moe_dims(spec)
            .ok_or_else(|| anyhow::anyhow!("MoE scratch for a dense feed-forward"))?;
        let at = |name: &str| plan.offset(name).map(|o| base.offset(o));
        Ok(MoePrefillScratch {
            logits: at("moe.logits")?,
            ids: at("moe.ids")?,
            weights: at("moe.weights")?,
            shared_w: at("moe.shared_w")?,
            counts: at("moe.counts")?,
            offsets: at("moe.offsets")?,
            cursor: at("moe.cursor")?,
            tile_map: at("moe.tile_map")?,
            tile_count: at("moe.tile_count")?,
            sorted_token: at("moe.sorted_token")?,
            slot_of: at("moe.slot_of")?,
            // read by the down product only: f16 shares the lo plane's bytes (gemm::Planes)
            act: Planes::new(at("moe.act.hi")?, at("moe.act.lo")?, i).with_f16(at("moe.act.lo")?),
            y_slot: at("moe.y_slot")?,
            shared_act: Planes::new(
                at("moe.shared_act.hi")?,
                at("moe.shared_act.lo")?,
                is.max(1),
            )
            .with_f16(at("moe.shared_act.lo")?),
        })
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct TopkParams {
    logits: u64,
    xn_hi: u64,
    xn_lo: u64,
    shared_gate: u64,
    ids: u64,
    weights: u64,
    shared_w: u64,
    counts: u64,
    t: i32,
    e: i32,
    a: i32,
    d: i32,
    norm_topk: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ScanParams {
    counts: u64,
    offsets: u64,
    cursor: u64,
    tile_map: u64,
    tile_count: u64,
    e: i32,
    bm: i32,
    max_tiles: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ScatterParams {
    ids: u64,
    cursor: u64,
    sorted_token: u64,
    slot_of: u64,
    t: i32,
    a: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct CombineParams {
    h: u64,
    y_slot: u64,
    slot_of: u64,
    weights: u64,
    t: i32,
    a: i32,
    d: i32,
    y_f16: i32,
}

/// `h += MoE(x̂)` for T tokens. `xn` is x̂ = rmsnorm₀(h)·(1 + post_attention_layernorm) as planes
/// `[T, D]` with the lo plane (the router always runs in split precision: routing must agree with
/// the f32 reference). `policy` chooses the routed gate/up, routed down and shared expert products'
/// precisions independently: the gate/up output planes carry the lo plane exactly when the down
/// product reads it (split), whatever the gate/up's own precision, so every combination is
/// consistent.
#[allow(clippy::too_many_arguments)]
pub fn prefill_moe(
    gpu: &Gpu,
    spec: &ModelSpec,
    w: &DevMoe,
    xn: Planes,
    h: DPtr,
    t: usize,
    s: &MoePrefillScratch,
    policy: &PromptPrecision,
) -> Result<Vec<Launch>> {
    let (e, a, i, is, norm_topk) = moe_dims(spec)
        .ok_or_else(|| anyhow::anyhow!("prefill_moe: the spec has a dense feed-forward"))?;
    let d = spec.hidden_size;
    ensure!(
        e <= MAX_EXPERTS && (1..=e).contains(&a),
        "prefill_moe: {e} experts, top {a} (≤ {MAX_EXPERTS})"
    );
    ensure!(
        !xn.lo.is_null() && xn.ld == d,
        "prefill_moe: x̂ needs both planes of stride {d}"
    );
    ensure!(
        w.router.rows == e && w.gate_up.rows == e * 2 * i && w.down.rows == e * d,
        "prefill_moe: expert shapes"
    );
    ensure!(
        d.is_multiple_of(4),
        "prefill_moe: hidden size {d} is not a multiple of 4 (the combine reads 4 columns at a time)"
    );
    let slots = t * a;
    let tiles = max_tiles(t, e, a);
    let up_prec = gemm::precision_for(gpu, policy, Product::ExpertGateUp, &w.gate_up);
    let down_prec = gemm::precision_for(gpu, policy, Product::ExpertDown, &w.down);
    let mut out = Vec::with_capacity(9);

    // 1. router logits [T, E]
    out.push(gemm::gemm(
        gpu,
        &Gemm {
            a: xn,
            gather: None,
            m: t,
            w: &w.router,
            n: e,
            swiglu: false,
            out: GemmOut::F32 {
                ptr: s.logits,
                ld: e,
                accumulate: false,
            },
            row_scale: None,
            precision: gemm::precision_for(gpu, policy, Product::Router, &w.router),
            grouped: None,
        },
    )?);
    // 2.–4. top-A, counting sort, tile map
    let topk = TopkParams {
        logits: s.logits.0,
        xn_hi: xn.hi.0,
        xn_lo: xn.lo.0,
        shared_gate: w.shared_gate.map(|g| g.0).unwrap_or(0),
        ids: s.ids.0,
        weights: s.weights.0,
        shared_w: s.shared_w.0,
        counts: s.counts.0,
        t: t as i32,
        e: e as i32,
        a: a as i32,
        d: d as i32,
        norm_topk: norm_topk as i32,
        pad: 0,
    };
    out.push(Launch::new(
        gpu,
        "prefill_moe_topk",
        (t.div_ceil(TOKENS_PER_BLOCK) as u32, 1, 1),
        (32 * TOKENS_PER_BLOCK) as u32,
        (TOKENS_PER_BLOCK * e * 4) as u32,
        &topk,
    )?);
    let scan = ScanParams {
        counts: s.counts.0,
        offsets: s.offsets.0,
        cursor: s.cursor.0,
        tile_map: s.tile_map.0,
        tile_count: s.tile_count.0,
        e: e as i32,
        bm: gemm::BM as i32,
        max_tiles: tiles as i32,
        pad: 0,
    };
    out.push(Launch::new(
        gpu,
        "prefill_moe_scan",
        (1, 1, 1),
        1024,
        0,
        &scan,
    )?);
    let scatter = ScatterParams {
        ids: s.ids.0,
        cursor: s.cursor.0,
        sorted_token: s.sorted_token.0,
        slot_of: s.slot_of.0,
        t: t as i32,
        a: a as i32,
    };
    out.push(Launch::new(
        gpu,
        "prefill_moe_scatter",
        (slots.div_ceil(256) as u32, 1, 1),
        256,
        0,
        &scatter,
    )?);
    // 5. routed gate/up (+SwiGLU) over all experts: act[slot] = silu(gate_e x̂_t)·(up_e x̂_t)
    out.push(gemm::gemm(
        gpu,
        &Gemm {
            a: xn.for_precision(up_prec),
            gather: Some(s.sorted_token),
            m: slots,
            w: &w.gate_up,
            n: 2 * i,
            swiglu: true,
            // the lo plane only for a split down (the epilogue splits the f32 result either way)
            out: GemmOut::Planes(s.act.for_precision(down_prec)),
            row_scale: None,
            precision: up_prec,
            grouped: Some(Grouped {
                tile_map: s.tile_map,
                tile_count: s.tile_count,
                max_tiles: tiles,
                expert_rows: 2 * i,
            }),
        },
    )?);
    // 6. routed down: y_slot[slot] = down_e act[slot]
    out.push(gemm::gemm(
        gpu,
        &Gemm {
            a: s.act.for_precision(down_prec),
            gather: None,
            m: slots,
            w: &w.down,
            n: d,
            swiglu: false,
            // half: the slot rows in f16 too (half the bytes written here and read by the combine)
            out: if down_prec == Precision::Half {
                GemmOut::Planes(Planes::new(DPtr::NULL, DPtr::NULL, d).with_f16(s.y_slot))
            } else {
                GemmOut::F32 {
                    ptr: s.y_slot,
                    ld: d,
                    accumulate: false,
                }
            },
            row_scale: None,
            precision: down_prec,
            grouped: Some(Grouped {
                tile_map: s.tile_map,
                tile_count: s.tile_count,
                max_tiles: tiles,
                expert_rows: d,
            }),
        },
    )?);
    // 7. shared expert: h += sg ⊙ down_s(silu(gate_s x̂)·up_s x̂)
    if let Some((gate_up, down)) = &w.shared {
        ensure!(
            gate_up.rows == 2 * is && down.rows == d,
            "prefill_moe: shared expert shapes"
        );
        let sup = gemm::precision_for(gpu, policy, Product::Shared, gate_up);
        let sdown = gemm::precision_for(gpu, policy, Product::Shared, down);
        out.push(gemm::gemm(
            gpu,
            &Gemm {
                a: xn.for_precision(sup),
                gather: None,
                m: t,
                w: gate_up,
                n: 2 * is,
                swiglu: true,
                out: GemmOut::Planes(s.shared_act.for_precision(sdown)),
                row_scale: None,
                precision: sup,
                grouped: None,
            },
        )?);
        out.push(gemm::gemm(
            gpu,
            &Gemm {
                a: s.shared_act.for_precision(sdown),
                gather: None,
                m: t,
                w: down,
                n: d,
                swiglu: false,
                out: GemmOut::F32 {
                    ptr: h,
                    ld: d,
                    accumulate: true,
                },
                row_scale: Some(s.shared_w),
                precision: sdown,
                grouped: None,
            },
        )?);
    }
    // 8. h += Σ_k w[t,k] · y_slot[slot_of[t,k]]
    let combine = CombineParams {
        h: h.0,
        y_slot: s.y_slot.0,
        slot_of: s.slot_of.0,
        weights: s.weights.0,
        t: t as i32,
        a: a as i32,
        d: d as i32,
        y_f16: (down_prec == Precision::Half) as i32,
    };
    out.push(Launch::new(
        gpu,
        "prefill_moe_combine",
        (t as u32, 1, 1),
        256,
        0,
        &combine,
    )?);
    Ok(out)
}

/// `h += down(silu(gate x̂)·up x̂)` for T tokens (dense MLP, the policy's `shared` group). `act`
/// holds planes `[T, I]`.
pub fn prefill_mlp(
    gpu: &Gpu,
    w: &DevMlp,
    xn: Planes,
    h: DPtr,
    t: usize,
    act: Planes,
    policy: &PromptPrecision,
) -> Result<Vec<Launch>> {
    let up_prec = gemm::precision_for(gpu, policy, Product::Shared, &w.gate_up);
    let down_prec = gemm::precision_for(gpu, policy, Product::Shared, &w.down);
    let i = w.gate_up.rows / 2;
    let d = w.down.rows;
    Ok(vec![
        gemm::gemm(
            gpu,
            &Gemm {
                a: xn.for_precision(up_prec),
                gather: None,
                m: t,
                w: &w.gate_up,
                n: 2 * i,
                swiglu: true,
                out: GemmOut::Planes(act.for_precision(down_prec)),
                row_scale: None,
                precision: up_prec,
                grouped: None,
            },
        )?,
        gemm::gemm(
            gpu,
            &Gemm {
                a: act.for_precision(down_prec),
                gather: None,
                m: t,
                w: &w.down,
                n: d,
                swiglu: false,
                out: GemmOut::F32 {
                    ptr: h,
                    ld: d,
                    accumulate: true,
                },
                row_scale: None,
                precision: down_prec,
                grouped: None,
            },
        )?,
    ])
}
