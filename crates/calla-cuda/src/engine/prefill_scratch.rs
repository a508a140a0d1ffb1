//! The prompt path's activation scratch: one allocation laid out by a plan (pool.rs `ScratchPlan`) in
//! which buffers that are never live at the same time share bytes, and the mixer pieces that keep
//! the mixers' buffers within the bytes the MoE needs anyway. Used by engine/prefill.rs.
//!
//! Legend: T tokens of a chunk, D hidden, Hq/Dh attention, E/A/I MoE.

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::ops::deltanet_prefill;
use crate::ops::gemm::Planes;
use crate::ops::moe_prefill::{self, MoePrefillScratch};
use crate::runtime::gpu::DPtr;
use crate::runtime::pool::{Arena, Region, ScratchPlan, ALWAYS};

/// Activation scratch of the prompt path, sized for `max_tokens` per call: one allocation laid out
/// by a [`ScratchPlan`] (pool.rs), so buffers that are never live at the same time share bytes —
/// the DeltaNet, attention, MoE and dense-MLP buffers of a layer are used one phase after another.
/// The mixer (DeltaNet or attention) runs over at most `mixer_tokens` rows at a time (pieces that
/// start at multiples of 64 tokens, the DeltaNet chunk and the flash query tile, so every kernel
/// sees the same chunks and tiles as in one call: the results are bitwise those of one call), and
/// `mixer_tokens` is the largest size whose buffers fit in the bytes the MoE needs anyway.
pub struct PrefillScratch {
    pub max_tokens: usize,
    /// rows of one mixer piece (≤ max_tokens; a multiple of 64 when smaller)
    pub mixer_tokens: usize,
    /// i32 `[T]`: the chunk's token ids (filled by the caller)
    pub tokens: DPtr,
    /// planes `[T, D]`: the normalised layer input
    pub xn: Planes,
    pub dn_qkv: DPtr,
    pub dn_z: DPtr,
    pub dn_b: DPtr,
    pub dn_a: DPtr,
    pub dn_conv_out: DPtr,
    pub dn_w: DPtr,
    pub dn_u: DPtr,
    pub dn_aqk: DPtr,
    pub dn_gcum: DPtr,
    pub dn_h: DPtr,
    pub dn_o: DPtr,
    pub dn_y: Planes,
    pub at_qg: DPtr,
    pub at_k: DPtr,
    pub at_v: DPtr,
    pub at_q: Planes,
    pub at_y: Planes,
    pub moe: Option<MoePrefillScratch>,
    pub mlp_act: Option<Planes>,
    /// device bytes reserved
    pub bytes: usize,
}

/// Tokens of the smallest mixer piece: the DeltaNet chunk and the flash query tile.
pub const MIXER_ALIGN: usize = deltanet_prefill::CHUNK;

// Steps of each phase's launches on the plan's time axis (phases never overlap in time).
const DN_STEPS: usize = 100;
const ATTN_STEPS: usize = 200;
const MOE_STEPS: usize = 300;
const MLP_STEPS: usize = 400;

/// The regions of the mixers for pieces of `tm` tokens (lifetimes: the launch order of
/// engine/prefill.rs `prefill_mixer` and of deltanet_prefill.rs / attention_prefill.rs `prefill_core`).
fn mixer_regions(spec: &ModelSpec, tm: usize) -> Vec<Region> {
    let dn = deltanet_prefill::scratch_sizes(spec, tm);
    let (hq, dh, vd) = (
        spec.num_attention_heads,
        spec.head_dim,
        spec.linear_value_dim(),
    );
    let f = |n: usize| n * 4;
    let plane = |n: usize| n * 2;
    // DeltaNet: 0 in_proj GEMMs, 1 conv (qkv → conv_out), 2 ring (reads qkv), 3 chunk (conv_out,
    // a, b → w, u, aqk, gcum), 4 states (conv_out, w, u, gcum → v' over u, h; or the CUDA-core scan
    // → o), 5 out (conv_out, u, aqk, gcum, h → o), 6 gated norm (o, z → y), 7 out_proj (y → h)
    let dn_at = |a: usize, b: usize| (DN_STEPS + a, DN_STEPS + b);
    // attention: 0 in_proj GEMMs, 1 prep (qg, k, v → q, caches), 2 flash (q, qg's gate → y),
    // 3 o_proj (y → h)
    let at_at = |a: usize, b: usize| (ATTN_STEPS + a, ATTN_STEPS + b);
    vec![
        Region::new("dn.qkv", f(tm * spec.linear_conv_dim()), dn_at(0, 2)),
        Region::new("dn.z", f(tm * vd), dn_at(0, 6)),
        Region::new("dn.b", f(tm * spec.linear_num_value_heads), dn_at(0, 3)),
        Region::new("dn.a", f(tm * spec.linear_num_value_heads), dn_at(0, 3)),
        Region::new("dn.conv_out", f(dn.conv_out), dn_at(1, 5)),
        Region::new("dn.w", f(dn.w), dn_at(3, 4)),
        Region::new("dn.u", f(dn.u), dn_at(3, 5)),
        Region::new("dn.aqk", f(dn.aqk), dn_at(3, 5)),
        Region::new("dn.gcum", f(dn.gcum), dn_at(3, 5)),
        Region::new("dn.h", f(dn.h), dn_at(4, 5)),
        Region::new("dn.o", f(dn.o), dn_at(4, 6)),
        Region::new("dn.y.hi", plane(tm * vd), dn_at(6, 7)),
        Region::new("dn.y.lo", plane(tm * vd), dn_at(6, 7)),
        Region::new("at.qg", f(tm * spec.q_proj_rows()), at_at(0, 2)),
        Region::new("at.k", f(tm * spec.kv_dim()), at_at(0, 1)),
        Region::new("at.v", f(tm * spec.kv_dim()), at_at(0, 1)),
        Region::new("at.q.hi", plane(tm * hq * dh), at_at(1, 2)),
        Region::new("at.q.lo", plane(tm * hq * dh), at_at(1, 2)),
        Region::new("at.y.hi", plane(tm * hq * dh), at_at(2, 3)),
        Region::new("at.y.lo", plane(tm * hq * dh), at_at(2, 3)),
    ]
}

/// The regions that do not depend on the mixer piece: inputs (always live) and the feed-forward.
fn chunk_regions(spec: &ModelSpec, t: usize) -> Vec<Region> {
    let d = spec.hidden_size;
    let mut r = vec![
        Region::new("tokens", t * 4, ALWAYS),
        Region::new("xn.hi", t * d * 2, ALWAYS),
        Region::new("xn.lo", t * d * 2, ALWAYS),
        // x̂ for half-precision products (the router reads hi + lo, so it cannot share)
        Region::new("xn.f16", t * d * 2, ALWAYS),
    ];
    if let calla_model::FeedForwardSpec::Dense { intermediate } = &spec.feed_forward {
        let n = t * intermediate * 2;
        let at = (MLP_STEPS, MLP_STEPS + 1);
        r.push(Region::new("mlp.act.hi", n, at));
        r.push(Region::new("mlp.act.lo", n, at));
    }
    r.extend(moe_prefill::scratch_regions(spec, t, MOE_STEPS));
    r
}

/// The layout of the prompt scratch for chunks of up to `max_tokens` tokens with mixer pieces of
/// `mixer_tokens`.
pub fn scratch_plan(spec: &ModelSpec, max_tokens: usize, mixer_tokens: usize) -> ScratchPlan {
    let mut r = chunk_regions(spec, max_tokens);
    r.extend(mixer_regions(spec, mixer_tokens));
    ScratchPlan::new(r)
}

/// Bytes the mixer may add to the feed-forward's before it is cut into pieces: below this, extra
/// launches would cost more than the memory is worth (short prompts run the mixer in one piece).
pub const MIXER_SLACK: usize = 64 << 20;

/// The mixer piece for chunks of `max_tokens`: the largest of `max_tokens` and the multiples of 64
/// below it whose plan is at most [`MIXER_SLACK`] larger than the feed-forward's alone, made even: a chunk that needs n pieces gets n pieces of ⌈T/n⌉ rounded up to 64. When
/// even 64 rows exceed the feed-forward's bytes (small models), 64 (or `max_tokens`, if smaller).
pub fn mixer_tokens_for(spec: &ModelSpec, max_tokens: usize) -> usize {
    let t = max_tokens.max(1);
    let ffn_only = ScratchPlan::new(chunk_regions(spec, t)).bytes;
    let fits = |tm: usize| scratch_plan(spec, t, tm).bytes <= ffn_only + MIXER_SLACK;
    let below = (1..=(t - 1) / MIXER_ALIGN).rev().map(|k| k * MIXER_ALIGN);
    let mut candidates = std::iter::once(t).chain(below);
    let best = candidates
        .find(|&tm| fits(tm))
        .unwrap_or(MIXER_ALIGN.min(t));
    let pieces = t.div_ceil(best);
    if pieces == 1 {
        return t;
    }
    (t.div_ceil(pieces).div_ceil(MIXER_ALIGN) * MIXER_ALIGN).min(best)
}

/// The pieces `(first row, rows)` a mixer call of `t` tokens runs in, for pieces of at most
/// `mixer_tokens` (a multiple of [`MIXER_ALIGN`] when smaller than the chunk): as few as possible,
/// of equal size (a multiple of 64) but the last.
pub fn mixer_pieces(t: usize, mixer_tokens: usize) -> Vec<(usize, usize)> {
    if t <= mixer_tokens {
        return vec![(0, t)];
    }
    let n = t.div_ceil(mixer_tokens);
    let len = (t.div_ceil(n).div_ceil(MIXER_ALIGN) * MIXER_ALIGN).min(mixer_tokens);
    (0..t)
        .step_by(len)
        .map(|s0| (s0, len.min(t - s0)))
        .collect()
}

impl PrefillScratch {
    /// Scratch for chunks of up to `max_tokens`, mixer pieces chosen by [`mixer_tokens_for`].
    pub fn new(arena: &mut Arena, spec: &ModelSpec, max_tokens: usize) -> Result<PrefillScratch> {
        ensure!(max_tokens > 0, "prefill scratch for 0 tokens");
        let tm = mixer_tokens_for(spec, max_tokens);
        Self::with_mixer_tokens(arena, spec, max_tokens, tm)
    }

    /// Scratch with mixer pieces of `mixer_tokens` (= max_tokens: the mixer in one piece).
    pub fn with_mixer_tokens(
        arena: &mut Arena,
        spec: &ModelSpec,
        max_tokens: usize,
        mixer_tokens: usize,
    ) -> Result<PrefillScratch> {
        ensure!(max_tokens > 0, "prefill scratch for 0 tokens");
        ensure!(
            mixer_tokens == max_tokens
                || (mixer_tokens > 0
                    && mixer_tokens < max_tokens
                    && mixer_tokens.is_multiple_of(MIXER_ALIGN)),
            "prefill: mixer pieces of {mixer_tokens} tokens (chunks of {max_tokens}; pieces must be \
             the chunk or a smaller multiple of {MIXER_ALIGN})"
        );
        let plan = scratch_plan(spec, max_tokens, mixer_tokens);
        debug_assert!(plan.is_consistent());
        // Zeroed once: the MoE counts must start at zero (the other buffers are written before
        // they are read, as they were when each had its own bytes).
        let base = arena.alloc_zeroed(plan.bytes)?;
        let at = |name: &str| plan.offset(name).map(|o| base.offset(o));
        // Planes read by one consumer only: the f16 plane shares the lo plane's bytes (the
        // producer writes what that consumer reads, `Planes::for_precision`).
        let planes = |name: &str, ld: usize| -> Result<Planes> {
            let lo = at(&format!("{name}.lo"))?;
            Ok(Planes::new(at(&format!("{name}.hi"))?, lo, ld).with_f16(lo))
        };
        let (d, hq, dh) = (spec.hidden_size, spec.num_attention_heads, spec.head_dim);
        let mlp_act = match &spec.feed_forward {
            calla_model::FeedForwardSpec::Dense { intermediate } => {
                Some(planes("mlp.act", *intermediate)?)
            }
            _ => None,
        };
        let moe = match moe_prefill::moe_dims(spec) {
            Some(_) => Some(MoePrefillScratch::from_plan(spec, base, &plan)?),
            None => None,
        };
        Ok(PrefillScratch {
            max_tokens,
            mixer_tokens,
            tokens: at("tokens")?,
            xn: Planes::new(at("xn.hi")?, at("xn.lo")?, d).with_f16(at("xn.f16")?),
            dn_qkv: at("dn.qkv")?,
            dn_z: at("dn.z")?,
            dn_b: at("dn.b")?,
            dn_a: at("dn.a")?,
            dn_conv_out: at("dn.conv_out")?,
            dn_w: at("dn.w")?,
            dn_u: at("dn.u")?,
            dn_aqk: at("dn.aqk")?,
            dn_gcum: at("dn.gcum")?,
            dn_h: at("dn.h")?,
            dn_o: at("dn.o")?,
            dn_y: planes("dn.y", spec.linear_value_dim())?,
            at_qg: at("at.qg")?,
            at_k: at("at.k")?,
            at_v: at("at.v")?,
            at_q: planes("at.q", dh)?,
            at_y: planes("at.y", hq * dh)?,
            moe,
            mlp_act,
            bytes: plan.bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calla_model::synthetic::preset;

    fn real() -> ModelSpec {
        preset("qwen3.6-35b-a3b").expect("preset")
    }

    /// The layout before plans: every buffer its own bytes, for the whole chunk.
    fn separate_bytes(spec: &ModelSpec, t: usize) -> usize {
        let mut r = chunk_regions(spec, t);
        r.extend(mixer_regions(spec, t));
        r.iter().map(|r| r.bytes.div_ceil(256) * 256).sum()
    }

    #[test]
    fn mixer_pieces_cover_the_call_at_multiples_of_64() {
        for (t, tm) in [
            (8192, 4096),
            (8191, 4096),
            (8193, 4096),
            (100, 64),
            (5000, 1984),
            (7, 7),
        ] {
            let pieces = mixer_pieces(t, tm);
            let mut next = 0;
            for &(r0, n) in &pieces {
                assert_eq!(r0, next, "t={t} tm={tm}: {pieces:?}");
                assert_eq!(r0 % MIXER_ALIGN, 0, "t={t} tm={tm}: {pieces:?}");
                assert!(n >= 1 && n <= tm, "t={t} tm={tm}: {pieces:?}");
                next += n;
            }
            assert_eq!(next, t);
            assert_eq!(
                pieces.len(),
                t.div_ceil(tm),
                "as few pieces as the size allows"
            );
        }
        assert_eq!(mixer_pieces(8192, 6144), vec![(0, 4096), (4096, 4096)]);
        assert_eq!(mixer_pieces(300, 8192), vec![(0, 300)]);
    }

    #[test]
    fn real_shape_8k_plan_shares_the_mixer_bytes_with_the_moe() {
        let spec = real();
        let t = 8192;
        let tm = mixer_tokens_for(&spec, t);
        assert_eq!(tm % MIXER_ALIGN, 0);
        assert!(
            tm < t,
            "the 8K DeltaNet buffers exceed the MoE's: pieces expected"
        );
        let plan = scratch_plan(&spec, t, tm);
        assert!(plan.is_consistent());
        let ffn_only = ScratchPlan::new(chunk_regions(&spec, t)).bytes;
        assert!(
            plan.bytes <= ffn_only + MIXER_SLACK,
            "{} > {ffn_only}",
            plan.bytes
        );
        eprintln!(
            "real shape, T={t}: mixer pieces of {tm}; plan {} B (feed-forward alone {ffn_only} B, \
             every buffer separate {} B)",
            plan.bytes,
            separate_bytes(&spec, t)
        );
        // the MoE's down output (T·A·D f32) is the largest buffer; the plan is barely above it
        // plus the always-live x̂ planes
        let y_slot = t * 8 * 2048 * 4;
        let xn = 3 * t * 2048 * 2;
        assert!(plan.bytes >= y_slot + xn);
        assert!(
            plan.bytes < y_slot + xn + t * 8 * 512 * 4 + (8 << 20),
            "{}",
            plan.bytes
        );
        // against every buffer on its own bytes (the layout this replaces): under a third
        let before = separate_bytes(&spec, t);
        assert!(3 * plan.bytes < before, "{} vs {before}", plan.bytes);
        // DeltaNet and MoE buffers really share bytes
        let (dn, moe) = (
            plan.offset("dn.conv_out").unwrap(),
            plan.offset("moe.y_slot").unwrap(),
        );
        let y_end = moe + y_slot;
        assert!(dn < y_end && moe < dn + tm * spec.linear_conv_dim() * 4);
    }

    #[test]
    fn moe_counts_and_inputs_never_share_bytes() {
        for (spec, t) in [
            (real(), 8192),
            (real(), 700),
            (preset("tiny").unwrap(), 333),
        ] {
            let tm = mixer_tokens_for(&spec, t);
            let plan = scratch_plan(&spec, t, tm);
            assert!(plan.is_consistent());
            for keep in ["moe.counts", "xn.hi", "xn.lo", "xn.f16", "tokens"] {
                let i = plan.regions.iter().position(|r| r.name == keep).unwrap();
                let (a, ea) = (plan.offsets[i], plan.offsets[i] + plan.regions[i].bytes);
                for (j, r) in plan.regions.iter().enumerate() {
                    let (b, eb) = (plan.offsets[j], plan.offsets[j] + r.bytes);
                    assert!(j == i || ea <= b || eb <= a, "{keep} overlaps {}", r.name);
                }
            }
        }
    }

    #[test]
    fn real_shape_scratch_grows_with_the_chunk_and_stays_under_half_of_separate_buffers() {
        let spec = real();
        let mut last = 0;
        for t in [512, 2048, 4096, 8192] {
            let tm = mixer_tokens_for(&spec, t);
            let plan = scratch_plan(&spec, t, tm);
            let separate = separate_bytes(&spec, t);
            eprintln!(
                "real shape T={t}: pieces of {tm}, plan {:.1} MB, separate {:.1} MB",
                plan.bytes as f64 / 1e6,
                separate as f64 / 1e6
            );
            assert!(plan.bytes > last);
            assert!(2 * plan.bytes < separate, "T={t}");
            last = plan.bytes;
        }
    }

    #[test]
    fn mixer_tokens_are_the_chunk_or_a_smaller_multiple_of_64() {
        let tiny = preset("tiny").unwrap();
        for spec in [real(), tiny] {
            for t in [1, 63, 64, 65, 100, 128, 129, 1000, 2048, 4097, 8192] {
                let tm = mixer_tokens_for(&spec, t);
                assert!(
                    tm == t || (tm < t && tm.is_multiple_of(MIXER_ALIGN)),
                    "t={t}: {tm}"
                );
                // larger pieces never fit in fewer bytes than the chosen one needs
                let chosen = scratch_plan(&spec, t, tm).bytes;
                if tm < t {
                    let bigger = scratch_plan(&spec, t, (tm + MIXER_ALIGN).min(t)).bytes;
                    assert!(bigger >= chosen, "t={t}: {bigger} < {chosen}");
                }
            }
        }
        // a short real-shape prompt: the MoE buffers dominate and the mixer runs in one piece
        assert_eq!(mixer_tokens_for(&real(), 100), 100);
    }
}
