//! The prompt path, layer by layer: T tokens at positions p0..p0+T through one decoder layer, with
//! the batched kernels (gemm.cu, deltanet_prefill.cu, attention_prefill.cu, moe_prefill.cu), reading
//! and advancing the same per-sequence state as the decode step (decode::StateLayout):
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

pub use crate::engine::prefill_scratch::{
    mixer_pieces, mixer_tokens_for, scratch_plan, PrefillScratch, MIXER_ALIGN,
};
use crate::ops::attention::KvDtype;
use crate::ops::attention_prefill::{self, AttentionPrefillIo};
use crate::ops::deltanet_prefill::{self, DeltaNetPrefillIo};
use crate::ops::gemm::{self, Gemm, GemmOut, Planes, Precision};
use crate::ops::moe_prefill;
use crate::ops::prompt_precision::{Product, PromptPrecision};
use crate::ops::weights::{DevFfn, DevLayer, DevMatrix, DevMixer, DevModel};
use crate::runtime::gpu::{DPtr, Gpu, Launch};
use crate::runtime::pool::Arena;

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

/// By each matrix's format (as before the per-product policy: the kernel tests run
/// fast for quantised weights); the engine passes its `CudaOptions::prompt_precision`.
impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions {
            precision: PromptPrecision::AUTO,
        }
    }
}

/// Rows `row..` of planes with `ld` columns (absent planes stay NULL).
fn plane_rows(p: Planes, row: usize) -> Planes {
    let at = |q: DPtr| {
        if q.is_null() {
            q
        } else {
            q.offset(row * p.ld * 2)
        }
    };
    Planes::new(at(p.hi), at(p.lo), p.ld).with_f16(at(p.f16))
}

/// The precision the options call for `product` over `w` (without a choice: by its format), as
/// this device can run it (`gemm::runnable`).
fn precision_of(gpu: &Gpu, w: &DevMatrix, product: Product, opts: &PrefillOptions) -> Precision {
    gemm::precision_for(gpu, &opts.precision, product, w)
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
    let precision = precision_of(gpu, w, product, opts);
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
    // x̂'s readers here are the in-projections: the norm writes the planes they read
    let (in_proj, in_product): (&[DevMatrix], Product) = match &l.mixer {
        DevMixer::DeltaNet(w) => (&w.in_proj, Product::DeltaNetIn),
        DevMixer::Attention(w) => (&w.in_proj, Product::AttentionIn),
    };
    let readers = in_proj
        .iter()
        .map(|m| precision_of(gpu, m, in_product, opts));
    let mut out = vec![gemm::rmsnorm_planes(
        gpu,
        h,
        Some(l.input_gain),
        spec.rms_norm_eps,
        t,
        d,
        s.xn.for_readers(readers),
    )?];
    for (r0, n) in mixer_pieces(t, s.mixer_tokens) {
        let xn = plane_rows(s.xn, r0);
        let h = h.offset(r0 * d * 4);
        let p0 = p0 + r0;
        match (&l.mixer, state) {
            (DevMixer::DeltaNet(w), LayerState::DeltaNet { conv_ring, state }) => {
                for (m, dst) in w.in_proj.iter().zip([s.dn_qkv, s.dn_z, s.dn_b, s.dn_a]) {
                    out.push(project(gpu, xn, n, m, in_product, dst, false, opts)?);
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
                        h: s.dn_h,
                        o: s.dn_o,
                        y: s.dn_y.for_precision(precision_of(
                            gpu,
                            &w.out_proj,
                            Product::MixerOut,
                            opts,
                        )),
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
                let o_prec = precision_of(gpu, &w.o_proj, Product::MixerOut, opts);
                for (m, dst) in w.in_proj.iter().zip([s.at_qg, s.at_k, s.at_v]) {
                    out.push(project(gpu, xn, n, m, in_product, dst, false, opts)?);
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
                        // the queries' lo plane only when o_proj runs split or half
                        // (attention_prefill.rs: flash over an f32 cache then keeps ≈ f32)
                        q: s.at_q.for_precision(match o_prec {
                            Precision::Half => Precision::Split,
                            p => p,
                        }),
                        y: s.at_y.for_precision(o_prec),
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
    // x̂'s readers: the router, the routed and the shared gate/up, and the top-k's shared-expert
    // gate (hi + lo, as split); or the dense MLP's gate/up
    let readers: Vec<Precision> = match &l.ffn {
        DevFfn::Moe(m) => [
            (Product::Router, &m.router),
            (Product::ExpertGateUp, &m.gate_up),
        ]
        .into_iter()
        .chain(
            m.shared
                .as_ref()
                .map(|(gate_up, _)| (Product::Shared, gate_up)),
        )
        .map(|(product, w)| precision_of(gpu, w, product, opts))
        .chain([Precision::Split])
        .collect(),
        DevFfn::Dense(m) => vec![precision_of(gpu, &m.gate_up, Product::Shared, opts)],
    };
    let mut out = vec![gemm::rmsnorm_planes(
        gpu,
        h,
        Some(l.post_gain),
        spec.rms_norm_eps,
        t,
        spec.hidden_size,
        s.xn.for_readers(readers),
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
/// backend's prompt path (`backend::prompt::run_prompt_tokens`). Owns the scratch and the residual rows.
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
        layout: &crate::engine::decode::StateLayout,
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
