//! The prompt path, layer by layer: T tokens at positions p0..p0+T through one decoder layer, with
//! the batched kernels (gemm.cu, deltanet_prefill.cu, attention_prefill.cu, moe_prefill.cu), reading
//! and advancing the same per-sequence state as the decode step (forward::StateLayout):
//!
//!   x̂ = rmsnorm₀(h)·(1 + input_layernorm)                              → bf16 planes
//!   DeltaNet:  qkv, z, b, a = x̂·Wᵀ → conv/chunked rule/gated norm → h += out_proj
//!   attention: q+gate, k, v = x̂·Wᵀ → norm/RoPE/cache append/flash → h += o_proj
//!   x̂ = rmsnorm₀(h)·(1 + post_attention_layernorm)
//!   MoE: h += routed experts + gated shared expert  |  dense MLP: h += mlp(x̂)
//!
//! Entry points: [`PrefillScratch::new`] once (sized for the longest prompt chunk), then per chunk
//! [`prefill_embed`] and [`prefill_layer`] for every layer, in order, on one stream. Every function
//! returns launches (run them in order, or capture them); nothing is read back.
//!
//! Legend: T tokens of this chunk, D hidden, C conv channels, Hq/Hkv/Dh attention, Hk/Hv/Dk/Dv
//! DeltaNet, E/A/I/Is MoE.

use anyhow::{bail, ensure, Result};
use calla_model::ModelSpec;

use crate::attention::KvDtype;
use crate::attention_prefill::{self, AttentionPrefillIo};
use crate::deltanet_prefill::{self, DeltaNetPrefillIo};
use crate::gemm::{self, Gemm, GemmOut, Planes, Precision};
use crate::gpu::{DPtr, Gpu, Launch};
use crate::moe_prefill::{self, MoePrefillScratch};
use crate::pool::{Arena, Region, ScratchPlan, ALWAYS};
use crate::prompt_precision::{Product, PromptPrecision};
use crate::weights::{DevFfn, DevLayer, DevMatrix, DevMixer, DevModel};

/// This layer's state inside a sequence (absolute addresses: state base + StateLayout offsets).
#[derive(Debug, Clone, Copy)]
pub enum LayerState {
    /// conv ring `[K, C]` and S `[Hv, Dv, Dk]`, f32
    DeltaNet { conv_ring: DPtr, state: DPtr },
    /// K and V caches `[Hkv, max_ctx, Dh]`
    Attention {
        k_cache: DPtr,
        v_cache: DPtr,
        max_ctx: usize,
        kv: KvDtype,
    },
}

/// Options of the prompt path.
#[derive(Debug, Clone, Copy)]
pub struct PrefillOptions {
    /// Precision of each weight product (prompt_precision.rs; `Option<Precision>.into()`: one
    /// choice for all, None by each matrix's format). The MoE router always runs split.
    pub precision: PromptPrecision,
}

/// By each matrix's format (as before the per-product policy: the kernel tests and the lab run
/// fast for quantised weights); the engine passes its `CudaOptions::prompt_precision`.
impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions {
            precision: PromptPrecision::AUTO,
        }
    }
}

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
/// [`prefill_mixer`] and of deltanet_prefill.rs / attention_prefill.rs `prefill_core`).
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
    // a, b → w, u, aqk, gcum), 4 scan (→ o), 5 gated norm (o, z → y), 6 out_proj (y → h)
    let dn_at = |a: usize, b: usize| (DN_STEPS + a, DN_STEPS + b);
    // attention: 0 in_proj GEMMs, 1 prep (qg, k, v → q, caches), 2 flash (q, qg's gate → y),
    // 3 o_proj (y → h)
    let at_at = |a: usize, b: usize| (ATTN_STEPS + a, ATTN_STEPS + b);
    vec![
        Region::new("dn.qkv", f(tm * spec.linear_conv_dim()), dn_at(0, 2)),
        Region::new("dn.z", f(tm * vd), dn_at(0, 5)),
        Region::new("dn.b", f(tm * spec.linear_num_value_heads), dn_at(0, 3)),
        Region::new("dn.a", f(tm * spec.linear_num_value_heads), dn_at(0, 3)),
        Region::new("dn.conv_out", f(dn.conv_out), dn_at(1, 4)),
        Region::new("dn.w", f(dn.w), dn_at(3, 4)),
        Region::new("dn.u", f(dn.u), dn_at(3, 4)),
        Region::new("dn.aqk", f(dn.aqk), dn_at(3, 4)),
        Region::new("dn.gcum", f(dn.gcum), dn_at(3, 4)),
        Region::new("dn.o", f(dn.o), dn_at(4, 5)),
        Region::new("dn.y.hi", plane(tm * vd), dn_at(5, 6)),
        Region::new("dn.y.lo", plane(tm * vd), dn_at(5, 6)),
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
        let planes = |name: &str, ld: usize| -> Result<Planes> {
            Ok(Planes::new(
                at(&format!("{name}.hi"))?,
                at(&format!("{name}.lo"))?,
                ld,
            ))
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
            xn: planes("xn", d)?,
            dn_qkv: at("dn.qkv")?,
            dn_z: at("dn.z")?,
            dn_b: at("dn.b")?,
            dn_a: at("dn.a")?,
            dn_conv_out: at("dn.conv_out")?,
            dn_w: at("dn.w")?,
            dn_u: at("dn.u")?,
            dn_aqk: at("dn.aqk")?,
            dn_gcum: at("dn.gcum")?,
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

/// Rows `row..` of planes with `ld` columns (lo stays NULL when absent).
fn plane_rows(p: Planes, row: usize) -> Planes {
    let at = |q: DPtr| {
        if q.is_null() {
            q
        } else {
            q.offset(row * p.ld * 2)
        }
    };
    Planes::new(at(p.hi), at(p.lo), p.ld)
}

/// The precision the options call for `product` over `w` (without a choice: by its format).
fn precision_of(w: &DevMatrix, product: Product, opts: &PrefillOptions) -> Precision {
    opts.precision.resolve(product, w.format)
}

/// `out (+)= x̂·Wᵀ` with the precision the options call for `product` (or the matrix format).
#[allow(clippy::too_many_arguments)]
fn project(
    gpu: &Gpu,
    xn: Planes,
    t: usize,
    w: &DevMatrix,
    product: Product,
    out: DPtr,
    accumulate: bool,
    opts: &PrefillOptions,
) -> Result<Launch> {
    let precision = precision_of(w, product, opts);
    gemm::gemm(
        gpu,
        &Gemm {
            a: xn.for_precision(precision),
            gather: None,
            m: t,
            w,
            n: w.rows,
            swiglu: false,
            out: GemmOut::F32 {
                ptr: out,
                ld: w.rows,
                accumulate,
            },
            row_scale: None,
            precision,
            grouped: None,
        },
    )
}

/// `h[t] = embed_tokens[tokens[t]]` for the chunk (tokens already in `s.tokens`).
pub fn prefill_embed(
    gpu: &Gpu,
    model: &DevModel,
    s: &PrefillScratch,
    t: usize,
    h: DPtr,
) -> Result<Launch> {
    ensure!(
        t <= s.max_tokens,
        "prefill: {t} tokens exceed the scratch's {}",
        s.max_tokens
    );
    gemm::embed_rows(gpu, &model.embed, s.tokens, t, h)
}

/// One decoder layer over the chunk: `h` `[T, D]` f32 is updated in place; the layer's state
/// advances from position `p0` to `p0 + t`. = [`prefill_mixer`] + [`prefill_ffn`].
#[allow(clippy::too_many_arguments)]
pub fn prefill_layer(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layer: usize,
    state: LayerState,
    s: &PrefillScratch,
    h: DPtr,
    p0: usize,
    t: usize,
    opts: &PrefillOptions,
) -> Result<Vec<Launch>> {
    let mut out = prefill_mixer(gpu, spec, model, layer, state, s, h, p0, t, opts)?;
    out.extend(prefill_ffn(gpu, spec, model, layer, s, h, t, opts)?);
    Ok(out)
}

fn layer_of<'m>(
    model: &'m DevModel,
    layer: usize,
    s: &PrefillScratch,
    t: usize,
) -> Result<&'m DevLayer> {
    ensure!(
        t > 0 && t <= s.max_tokens,
        "prefill: {t} tokens (scratch holds {})",
        s.max_tokens
    );
    model
        .layers
        .get(layer)
        .ok_or_else(|| anyhow::anyhow!("prefill: layer {layer} of {}", model.layers.len()))
}

/// `h += mixer(rmsnorm₀(h)·(1 + input_layernorm))` (DeltaNet or attention), advancing the state.
/// The norm covers all T rows; the mixer runs in [`mixer_pieces`] of the scratch's `mixer_tokens`,
/// each at its own positions (as consecutive prompt chunks would).
#[allow(clippy::too_many_arguments)]
pub fn prefill_mixer(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layer: usize,
    state: LayerState,
    s: &PrefillScratch,
    h: DPtr,
    p0: usize,
    t: usize,
    opts: &PrefillOptions,
) -> Result<Vec<Launch>> {
    let l = layer_of(model, layer, s, t)?;
    let d = spec.hidden_size;
    let mut out = vec![gemm::rmsnorm_planes(
        gpu,
        h,
        Some(l.input_gain),
        spec.rms_norm_eps,
        t,
        d,
        s.xn,
    )?];
    for (r0, n) in mixer_pieces(t, s.mixer_tokens) {
        let xn = plane_rows(s.xn, r0);
        let h = h.offset(r0 * d * 4);
        let p0 = p0 + r0;
        match (&l.mixer, state) {
            (DevMixer::DeltaNet(w), LayerState::DeltaNet { conv_ring, state }) => {
                for (m, dst) in w.in_proj.iter().zip([s.dn_qkv, s.dn_z, s.dn_b, s.dn_a]) {
                    out.push(project(gpu, xn, n, m, Product::MixerIn, dst, false, opts)?);
                }
                out.extend(deltanet_prefill::prefill_core(
                    gpu,
                    spec,
                    p0,
                    n,
                    &DeltaNetPrefillIo {
                        qkv: s.dn_qkv,
                        z: s.dn_z,
                        b: s.dn_b,
                        a: s.dn_a,
                        conv_w: w.conv_w,
                        a_log: w.a_log,
                        dt_bias: w.dt_bias,
                        norm_w: w.norm_w,
                        conv_ring,
                        state,
                        conv_out: s.dn_conv_out,
                        w: s.dn_w,
                        u: s.dn_u,
                        aqk: s.dn_aqk,
                        gcum: s.dn_gcum,
                        o: s.dn_o,
                        y: s.dn_y,
                    },
                )?);
                out.push(project(
                    gpu,
                    s.dn_y,
                    n,
                    &w.out_proj,
                    Product::MixerOut,
                    h,
                    true,
                    opts,
                )?);
            }
            (
                DevMixer::Attention(w),
                LayerState::Attention {
                    k_cache,
                    v_cache,
                    max_ctx,
                    kv,
                },
            ) => {
                for (m, dst) in w.in_proj.iter().zip([s.at_qg, s.at_k, s.at_v]) {
                    out.push(project(gpu, xn, n, m, Product::MixerIn, dst, false, opts)?);
                }
                out.extend(attention_prefill::prefill_core(
                    gpu,
                    spec,
                    p0,
                    n,
                    &AttentionPrefillIo {
                        qg: s.at_qg,
                        k: s.at_k,
                        v: s.at_v,
                        q_gain: w.q_gain,
                        k_gain: w.k_gain,
                        inv_freq: model.inv_freq,
                        k_cache,
                        v_cache,
                        max_ctx,
                        kv,
                        // the queries' lo plane only when o_proj runs split (attention_prefill.rs)
                        q: s.at_q
                            .for_precision(precision_of(&w.o_proj, Product::MixerOut, opts)),
                        y: s.at_y,
                    },
                )?);
                out.push(project(
                    gpu,
                    s.at_y,
                    n,
                    &w.o_proj,
                    Product::MixerOut,
                    h,
                    true,
                    opts,
                )?);
            }
            _ => bail!("prefill: layer {layer}'s state does not match its kind"),
        }
    }
    Ok(out)
}

/// `h += ffn(rmsnorm₀(h)·(1 + post_attention_layernorm))` (MoE or dense MLP).
#[allow(clippy::too_many_arguments)]
pub fn prefill_ffn(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layer: usize,
    s: &PrefillScratch,
    h: DPtr,
    t: usize,
    opts: &PrefillOptions,
) -> Result<Vec<Launch>> {
    let l = layer_of(model, layer, s, t)?;
    let mut out = vec![gemm::rmsnorm_planes(
        gpu,
        h,
        Some(l.post_gain),
        spec.rms_norm_eps,
        t,
        spec.hidden_size,
        s.xn,
    )?];
    match &l.ffn {
        DevFfn::Moe(m) => {
            let ms = s
                .moe
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("prefill: no MoE scratch for a MoE layer"))?;
            out.extend(moe_prefill::prefill_moe(
                gpu,
                spec,
                m,
                s.xn,
                h,
                t,
                ms,
                &opts.precision,
            )?);
        }
        DevFfn::Dense(m) => {
            let act = s
                .mlp_act
                .ok_or_else(|| anyhow::anyhow!("prefill: no MLP scratch for a dense layer"))?;
            out.extend(moe_prefill::prefill_mlp(
                gpu,
                m,
                s.xn,
                h,
                t,
                act,
                &opts.precision,
            )?);
        }
    }
    Ok(out)
}

/// A whole prompt through every layer, in chunks of at most `max_tokens`: the entry point for the
/// backend's prompt path (`prefill::run_prompt_tokens`). Owns the scratch and the residual rows.
pub struct PromptRunner {
    pub scratch: PrefillScratch,
    /// f32 `[max_tokens, D]`: the chunk's residual stream
    pub h: DPtr,
    pub opts: PrefillOptions,
}

impl PromptRunner {
    pub fn new(
        arena: &mut Arena,
        spec: &ModelSpec,
        max_tokens: usize,
        opts: PrefillOptions,
    ) -> Result<PromptRunner> {
        let scratch = PrefillScratch::new(arena, spec, max_tokens)?;
        let h = arena.alloc_zeroed(max_tokens * spec.hidden_size * 4)?;
        Ok(PromptRunner { scratch, h, opts })
    }

    /// Run `tokens` at positions `p0..` through every layer, advancing the sequence whose state
    /// starts at `state_base` (laid out as `layout`). When `last_h` is given, the last token's
    /// residual row is copied there (the decode step's h `[D]`, for the head). Everything is
    /// queued on the stream; nothing is read back. Token ids must already be checked (< vocab).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        spec: &ModelSpec,
        model: &DevModel,
        layout: &crate::forward::StateLayout,
        state_base: DPtr,
        p0: usize,
        tokens: &[u32],
        last_h: Option<DPtr>,
    ) -> Result<()> {
        ensure!(!tokens.is_empty(), "prefill: no tokens");
        ensure!(
            p0 + tokens.len() <= layout.max_ctx,
            "prefill: positions {p0}..{} exceed the {} the state holds",
            p0 + tokens.len(),
            layout.max_ctx
        );
        let d = spec.hidden_size;
        let mut pos = p0;
        let mut last_rows = 0;
        for chunk in tokens.chunks(self.scratch.max_tokens) {
            let t = chunk.len();
            let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
            gpu.htod(self.scratch.tokens, &ids)?; // ordered after the previous chunk's kernels
            prefill_embed(gpu, model, &self.scratch, t, self.h)?.run(gpu)?;
            for (il, kind) in spec.layers.iter().enumerate() {
                let (a, b) = layout.layers[il];
                let state = match kind {
                    calla_model::LayerKind::DeltaNet => LayerState::DeltaNet {
                        conv_ring: state_base.offset(a),
                        state: state_base.offset(b),
                    },
                    calla_model::LayerKind::Attention => LayerState::Attention {
                        k_cache: state_base.offset(a),
                        v_cache: state_base.offset(b),
                        max_ctx: layout.max_ctx,
                        kv: layout.kv,
                    },
                };
                for l in prefill_layer(
                    gpu,
                    spec,
                    model,
                    il,
                    state,
                    &self.scratch,
                    self.h,
                    pos,
                    t,
                    &self.opts,
                )? {
                    l.run(gpu)?;
                }
            }
            pos += t;
            last_rows = t;
        }
        if let Some(dst) = last_h {
            gpu.dtod(dst, self.h.offset((last_rows - 1) * d * 4), d * 4)?;
        }
        Ok(())
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
        let xn = 2 * t * 2048 * 2;
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
            for keep in ["moe.counts", "xn.hi", "xn.lo", "tokens"] {
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
