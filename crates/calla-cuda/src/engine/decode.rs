//! The decode step as a fixed chain of launches, built once per backend:
//!
//!   embed(cursor.token) → h
//!   per layer:  DeltaNet: matvec[qkv|z|b|a](rmsnorm(h)) → deltanet_decode → h += out_proj·y
//!               attention: matvec[q+gate|k|v](rmsnorm(h)) → attn_decode (norm + RoPE + cache append,
//!                          split-KV on tensor cores, merge + gate: one launch) → h += o_proj·y
//!               MoE: router+top-k(rmsnorm(h)) → gate/up (routed + shared) → h += down+combine
//!               Where the formats allow (q4 out-projection on the tensor cores, q8/q4 router), the
//!               router runs inside the out-projection (fused routing: moe::fused_route_tail) and
//!               gate/up takes the top-k from its sums: 5 launches per layer instead of 6.
//!   head: logits = lm_head·rmsnorm(h) → select (argmax / sampling, advances the cursor); for plain
//!         greedy, where lm_head runs on the tensor cores, one launch that also selects
//!         (matvec::head_greedy)
//!
//! Everything that changes between steps (token, position, the sequence's state address, sampling
//! settings and draw counter) is read from device memory, so the chain is captured once as a graph.
//! Legend: D hidden, C conv channels, Hk/Hv DeltaNet heads, Dk/Dv their dims, Hq/Hkv attention heads,
//! Dh head dim, E experts, A active experts, I/Is expert/shared intermediate, V vocabulary.

use anyhow::{ensure, Result};
use calla_model::{FeedForwardSpec, LayerKind, ModelSpec};

use crate::ops::attention::{self, AttentionIo, KvDtype};
use crate::ops::deltanet::{self, DeltaNetIo};
use crate::ops::matvec;
use crate::ops::moe::{self, MoeIo, MoeWeightsRef};
use crate::ops::weights::{DevFfn, DevMatrix, DevMixer, DevModel};
use crate::runtime::gpu::{DPtr, Gpu, Launch};
use crate::runtime::pool::Arena;

/// Byte offsets of each layer's state inside a sequence's state buffer.
#[derive(Debug, Clone)]
pub struct StateLayout {
    /// per layer: DeltaNet (conv ring [K, C] f32, S [Hv, Dv, Dk] f32) or attention (K, V caches
    /// [Hkv, max_ctx, Dh]) offsets
    pub layers: Vec<(usize, usize)>,
    pub bytes: usize,
    pub max_ctx: usize,
    pub kv: KvDtype,
    /// bytes of one position's K and V over all attention layers
    pub kv_bytes_per_token: usize,
    /// bytes of one position of one kv head's K (or V) cache: head_dim × the element size
    pub kv_row_bytes: usize,
    pub kv_heads: usize,
}

impl StateLayout {
    pub fn new(spec: &ModelSpec, max_ctx: usize, kv: KvDtype) -> StateLayout {
        let align = |n: usize| n.div_ceil(256) * 256;
        let mut off = 0;
        let mut layers = Vec::new();
        for kind in &spec.layers {
            match kind {
                LayerKind::DeltaNet => {
                    let conv = spec.linear_conv_kernel_dim * spec.linear_conv_dim() * 4;
                    let s = spec.linear_num_value_heads
                        * spec.linear_value_head_dim
                        * spec.linear_key_head_dim
                        * 4;
                    layers.push((off, off + align(conv)));
                    off += align(conv) + align(s);
                }
                LayerKind::Attention => {
                    let cache = spec.num_key_value_heads * max_ctx * spec.head_dim * kv.size();
                    layers.push((off, off + align(cache)));
                    off += 2 * align(cache);
                }
            }
        }
        let kv_bytes_per_token =
            spec.num_attention_layers() * 2 * spec.num_key_value_heads * spec.head_dim * kv.size();
        StateLayout {
            layers,
            bytes: off,
            max_ctx,
            kv,
            kv_bytes_per_token,
            kv_row_bytes: spec.head_dim * kv.size(),
            kv_heads: spec.num_key_value_heads,
        }
    }

    /// The regions a state of `len` positions occupies, as (offset in the full state, offset in
    /// the compact one, bytes): each DeltaNet layer's conv ring and recurrent state whole, each
    /// attention layer's K and V caches the first `len` positions of every kv head. A compact state
    /// (a prefix-cache entry) holds exactly these, back to back.
    pub fn regions(&self, spec_layers: &[LayerKind], len: usize) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        let mut at = 0;
        for (i, kind) in spec_layers.iter().enumerate() {
            let end = self.layers.get(i + 1).map_or(self.bytes, |l| l.0);
            let (a, b) = self.layers[i];
            match kind {
                LayerKind::DeltaNet => {
                    out.push((a, at, end - a));
                    at += end - a;
                }
                LayerKind::Attention => {
                    let head = self.max_ctx * self.kv_row_bytes;
                    let used = len.min(self.max_ctx) * self.kv_row_bytes;
                    for base in [a, b] {
                        for h in 0..self.kv_heads {
                            out.push((base + h * head, at, used));
                            at += used;
                        }
                    }
                }
            }
        }
        out
    }
}

/// Per-step activations and scratch, allocated once.
pub struct Scratch {
    pub cursor: DPtr,
    /// residual stream [D]
    pub h: DPtr,
    pub dn_qkv: DPtr,
    pub dn_z: DPtr,
    pub dn_b: DPtr,
    pub dn_a: DPtr,
    pub dn_y: DPtr,
    pub at_qg: DPtr,
    pub at_k: DPtr,
    pub at_v: DPtr,
    /// attention merge tickets, u32 [attention::ticket_words]
    pub attn_tickets: DPtr,
    pub at_y: DPtr,
    pub part_m: DPtr,
    pub part_l: DPtr,
    pub part_acc: DPtr,
    pub nsplit: usize,
    pub xn: DPtr,
    pub router_logits: DPtr,
    pub topk_ids: DPtr,
    pub topk_w: DPtr,
    pub shared_w: DPtr,
    pub router_counter: DPtr,
    /// the fused routing's accumulators (i64 [moe::route_acc_words], zero between layers)
    pub route_acc: DPtr,
    pub act: DPtr,
    pub act_stride: usize,
    pub one: DPtr,
    /// [V]
    pub logits: DPtr,
}

impl Scratch {
    pub fn new(arena: &mut Arena, spec: &ModelSpec, max_ctx: usize) -> Result<Scratch> {
        let d = spec.hidden_size;
        let (hq, dh) = (spec.num_attention_heads, spec.head_dim);
        let nsplit = attention::num_splits(max_ctx);
        let (e, a, i, is) = match &spec.feed_forward {
            FeedForwardSpec::Moe {
                num_experts,
                top_k,
                expert_intermediate,
                shared_intermediate,
                ..
            } => (
                *num_experts,
                *top_k,
                *expert_intermediate,
                *shared_intermediate,
            ),
            FeedForwardSpec::Dense { intermediate } => (0, 0, 0, *intermediate),
        };
        // a multiple of 32: moe.cu's down kernel stages all slots' rows as one padded vector
        let act_stride = i.max(is).max(1).next_multiple_of(32);
        let mut f32s = |n: usize| arena.alloc_zeroed(n.max(1) * 4);
        let scratch = Scratch {
            cursor: f32s(4)?,
            h: f32s(d)?,
            dn_qkv: f32s(spec.linear_conv_dim())?,
            dn_z: f32s(spec.linear_value_dim())?,
            dn_b: f32s(spec.linear_num_value_heads)?,
            dn_a: f32s(spec.linear_num_value_heads)?,
            // y, then the DeltaNet norm's Σo² parts per block (deltanet::decode_parts)
            dn_y: f32s(
                spec.linear_value_dim() + spec.linear_num_value_heads * deltanet::SPLIT as usize,
            )?,
            at_qg: f32s(spec.q_proj_rows())?,
            at_k: f32s(spec.kv_dim())?,
            at_v: f32s(spec.kv_dim())?,
            attn_tickets: f32s(attention::ticket_words(spec.num_key_value_heads, nsplit))?,
            at_y: f32s(hq * dh)?,
            part_m: f32s(hq * nsplit)?,
            part_l: f32s(hq * nsplit)?,
            part_acc: f32s(hq * nsplit * dh)?,
            nsplit,
            xn: f32s(d)?,
            router_logits: f32s(e + 1)?,
            topk_ids: f32s(a)?,
            topk_w: f32s(a)?,
            shared_w: f32s(1)?,
            router_counter: f32s(1)?,
            route_acc: f32s(2 * crate::ops::moe::route_acc_words(e))?,
            act: f32s((a + 1) * act_stride)?,
            act_stride,
            one: f32s(1)?,
            logits: f32s(spec.vocab_size)?,
        };
        arena_upload_one(arena, scratch.one)?;
        Ok(scratch)
    }
}

fn arena_upload_one(arena: &mut Arena, at: DPtr) -> Result<()> {
    arena.gpu().htod(at, &[1.0f32])
}

/// The launches of one layer for one token: `h += mixer(rmsnorm(h))`, then `h += ffn(rmsnorm(h))`.
/// Where the formats allow, the MoE router runs inside the mixer's out-projection (the fused
/// routing, moe::fused_route_tail) instead of as a launch of its own.
pub fn layer_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
) -> Result<Vec<Launch>> {
    let io = moe_io(model, spec, s, i);
    let weights = moe_weights(model, spec, i);
    let route = weights.as_ref().and_then(|w| {
        let (out_proj, k) = match &model.layers[i].mixer {
            DevMixer::DeltaNet(m) => (&m.out_proj, spec.linear_value_dim()),
            DevMixer::Attention(m) => (&m.o_proj, spec.num_attention_heads * spec.head_dim),
        };
        moe::fused_route_tail(gpu.choices(), w, &io, out_proj, k, s.route_acc)
    });
    let mut out = mixer_launches_routed(gpu, spec, model, layout, s, i, route.as_ref())?;
    match (&weights, route) {
        (Some(w), Some(_)) => out.extend(moe::moe_after_fused_routing(gpu, w, &io, s.route_acc)?),
        _ => out.extend(ffn_launches(gpu, spec, model, s, i)?),
    }
    Ok(out)
}

/// `h += mixer(rmsnorm(h))` (DeltaNet or attention) for layer `i`.
pub fn mixer_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
) -> Result<Vec<Launch>> {
    mixer_launches_routed(gpu, spec, model, layout, s, i, None)
}

/// [`mixer_launches`], with the out-projection also running the MoE router (`route`).
fn mixer_launches_routed(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
    route: Option<&moe::RouteTail>,
) -> Result<Vec<Launch>> {
    let d = spec.hidden_size;
    let layer = &model.layers[i];
    let eps = spec.rms_norm_eps;
    let mut out = Vec::new();
    match &layer.mixer {
        DevMixer::DeltaNet(w) => {
            let outs = [s.dn_qkv, s.dn_z, s.dn_b, s.dn_a];
            let segs: Vec<_> = w.in_proj.iter().copied().zip(outs).collect();
            out.extend(matvec::matvec(
                gpu,
                s.h,
                d,
                Some((layer.input_gain, eps)),
                &segs,
                false,
            )?);
            let io = deltanet_io(model, layout, s, i)
                .ok_or_else(|| anyhow::anyhow!("layer {i} is not a DeltaNet layer"))?;
            let kv = spec.linear_value_dim();
            let head_norm = matvec::HeadNorm {
                head_dim: spec.linear_value_head_dim,
                nparts: deltanet::SPLIT as usize,
                eps: spec.rms_norm_eps,
            };
            let choices = gpu.choices();
            if choices.deltanet_norm_in_out_projection
                && matvec::head_norm_applies(choices.dot_engine, kv, head_norm, &w.out_proj)
            {
                // the norm's Σo² parts per block, finished in the out-projection (no
                // cluster in DeltaNet)
                out.push(deltanet::decode_parts(gpu, spec, &io)?);
                out.push(matvec::matvec_head_norm(
                    gpu,
                    s.dn_y,
                    kv,
                    head_norm,
                    &(w.out_proj, s.h),
                    true,
                    route,
                )?);
            } else {
                out.push(deltanet::decode(gpu, spec, &io)?);
                out.extend(out_projection(gpu, s.dn_y, kv, &(w.out_proj, s.h), route)?);
            }
        }
        DevMixer::Attention(w) => {
            out.extend(attention_core_launches(gpu, spec, model, layout, s, i)?);
            let k = spec.num_attention_heads * spec.head_dim;
            out.extend(out_projection(gpu, s.at_y, k, &(w.o_proj, s.h), route)?);
        }
    }
    Ok(out)
}

/// `h += W·y`, with the MoE router over the new h when `route` is given.
fn out_projection(
    gpu: &Gpu,
    y: DPtr,
    k: usize,
    segment: &(DevMatrix, DPtr),
    route: Option<&moe::RouteTail>,
) -> Result<Vec<Launch>> {
    match route {
        Some(r) => Ok(vec![matvec::matvec_routed(gpu, y, k, segment, r)?]),
        None => matvec::matvec(gpu, y, k, None, std::slice::from_ref(segment), true),
    }
}

/// An attention layer's in-projection and attention (into `s.at_y`), without the output projection.
pub fn attention_core_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
) -> Result<Vec<Launch>> {
    let d = spec.hidden_size;
    let layer = &model.layers[i];
    let eps = spec.rms_norm_eps;
    let mut out = Vec::new();
    match &layer.mixer {
        DevMixer::DeltaNet(_) => anyhow::bail!("layer {i} is not an attention layer"),
        DevMixer::Attention(w) => {
            let (k_off, v_off) = layout.layers[i];
            let segs: Vec<_> = w
                .in_proj
                .iter()
                .copied()
                .zip([s.at_qg, s.at_k, s.at_v])
                .collect();
            out.extend(matvec::matvec(
                gpu,
                s.h,
                d,
                Some((layer.input_gain, eps)),
                &segs,
                false,
            )?);
            out.extend(attention::decode(
                gpu,
                spec,
                layout.kv,
                layout.max_ctx,
                &AttentionIo {
                    qg: s.at_qg,
                    k: s.at_k,
                    v: s.at_v,
                    q_gain: w.q_gain,
                    k_gain: w.k_gain,
                    inv_freq: model.inv_freq,
                    cursor: s.cursor,
                    k_off,
                    v_off,
                    part_m: s.part_m,
                    part_l: s.part_l,
                    part_acc: s.part_acc,
                    tickets: s.attn_tickets,
                    nsplit: s.nsplit,
                    y: s.at_y,
                },
            )?);
        }
    }
    Ok(out)
}

/// The DeltaNet decode step's device buffers for layer `i` (None for an attention layer).
pub fn deltanet_io(
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
    i: usize,
) -> Option<DeltaNetIo> {
    let DevMixer::DeltaNet(w) = &model.layers[i].mixer else {
        return None;
    };
    let (conv_off, state_off) = layout.layers[i];
    Some(DeltaNetIo {
        qkv: s.dn_qkv,
        z: s.dn_z,
        b: s.dn_b,
        a: s.dn_a,
        conv_w: w.conv_w,
        a_log: w.a_log,
        dt_bias: w.dt_bias,
        norm_w: w.norm_w,
        cursor: s.cursor,
        conv_off,
        state_off,
        y: s.dn_y,
    })
}

/// The MoE (or dense MLP) step's device buffers for layer `i`.
pub fn moe_io(model: &DevModel, spec: &ModelSpec, s: &Scratch, i: usize) -> MoeIo {
    MoeIo {
        h: s.h,
        norm_gain: model.layers[i].post_gain,
        eps: spec.rms_norm_eps,
        xn: s.xn,
        logits: s.router_logits,
        topk_ids: s.topk_ids,
        topk_w: s.topk_w,
        shared_w: s.shared_w,
        counter: s.router_counter,
        act: s.act,
        act_stride: s.act_stride,
        one: s.one,
    }
}

/// Layer `i`'s routed experts, or None for a dense MLP (or weights that do not match the config).
pub fn moe_weights<'a>(
    model: &'a DevModel,
    spec: &ModelSpec,
    i: usize,
) -> Option<MoeWeightsRef<'a>> {
    match (&model.layers[i].ffn, &spec.feed_forward) {
        (
            DevFfn::Moe(m),
            FeedForwardSpec::Moe {
                num_experts,
                top_k,
                norm_topk_prob,
                ..
            },
        ) => Some(MoeWeightsRef {
            router: &m.router,
            gate_up: &m.gate_up,
            down: &m.down,
            experts: *num_experts,
            top_k: *top_k,
            norm_topk: *norm_topk_prob,
            shared: m.shared.as_ref().map(|(a, b)| (a, b)),
            shared_gate: m.shared_gate,
        }),
        _ => None,
    }
}

/// `h += ffn(rmsnorm(h))` (MoE with the shared expert, or the dense MLP) for layer `i`.
pub fn ffn_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    s: &Scratch,
    i: usize,
) -> Result<Vec<Launch>> {
    let io = moe_io(model, spec, s, i);
    if let Some(w) = moe_weights(model, spec, i) {
        return moe::moe(gpu, &w, &io);
    }
    match (&model.layers[i].ffn, &spec.feed_forward) {
        (DevFfn::Dense(m), FeedForwardSpec::Dense { .. }) => {
            moe::dense_mlp(gpu, &m.gate_up, &m.down, &io)
        }
        _ => anyhow::bail!("layer {i}: feed-forward weights do not match the config"),
    }
}

/// embed + every layer: one token through the model (no head).
pub fn body_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    layout: &StateLayout,
    s: &Scratch,
) -> Result<Vec<Launch>> {
    ensure!(
        model.layers.len() == spec.num_layers(),
        "model and spec disagree on layers"
    );
    let mut out = vec![matvec::embed(gpu, &model.embed, s.cursor, s.h)?];
    for i in 0..spec.num_layers() {
        out.extend(layer_launches(gpu, spec, model, layout, s, i)?);
    }
    Ok(out)
}

/// Final norm + lm_head into `s.logits`.
pub fn head_launches(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    s: &Scratch,
) -> Result<Vec<Launch>> {
    matvec::matvec(
        gpu,
        s.h,
        spec.hidden_size,
        Some((model.final_gain, spec.rms_norm_eps)),
        &[(model.lm_head, s.logits)],
        false,
    )
}

/// Final norm + lm_head into `s.logits` with plain greedy selection fused in, publishing into
/// `token` (matvec::head_greedy), where the formats allow; else None.
pub fn head_greedy_launch(
    gpu: &Gpu,
    spec: &ModelSpec,
    model: &DevModel,
    s: &Scratch,
    selector: &crate::ops::select::Selector,
    token: crate::ops::select::TokenOut,
) -> Result<Option<Launch>> {
    matvec::head_greedy(
        gpu,
        s.h,
        spec.hidden_size,
        Some((model.final_gain, spec.rms_norm_eps)),
        &(model.lm_head, s.logits),
        selector,
        token,
    )
}
