//! The attention prompt path (norm → q+gate/k/v projections → q/k norm, partial RoPE, KV append →
//! causal flash attention + gate → o_proj, through `prefill_mixer`) against calla_cpu's
//! `Attention::forward`, with f32 caches (split precision, and fast: tiles rounded to bf16) and bf16 caches, from an empty cache and
//! after random cached positions; checks the output and the appended cache rows.

mod prefill_support;

use calla_cpu::attention::{Attention, KvCache};
use calla_cpu::random::{tiny_spec, Rng};
use calla_cuda::engine::prefill::{prefill_mixer, LayerState, PrefillOptions, PrefillScratch};
use calla_cuda::ops::gemm::Precision;
use calla_cuda::ops::weights::upload_model;
use calla_cuda::runtime::pool::Arena;
use calla_cuda::KvDtype;
use calla_model::{Family, FeedForwardSpec, LayerKind, MixerWeights, ModelSpec};
use prefill_support::*;

fn mixer_spec(base: &ModelSpec) -> ModelSpec {
    let mut s = layers_spec(base, &[LayerKind::Attention]);
    s.feed_forward = FeedForwardSpec::Dense { intermediate: 128 }; // not exercised here
    s
}

fn round_bf16(v: &mut [f32]) {
    for x in v {
        *x = bf16_bits_to_f32(f32_to_bf16_bits(*x));
    }
}

/// Cache `[Hkv, max_ctx, Dh]` bytes from per-position rows `[P, Hkv, Dh]`.
fn to_cache(rows: &[f32], hkv: usize, dh: usize, max_ctx: usize, kv: KvDtype) -> Vec<u8> {
    let p = rows.len() / (hkv * dh);
    let mut f = vec![0f32; hkv * max_ctx * dh];
    for pos in 0..p {
        for h in 0..hkv {
            f[(h * max_ctx + pos) * dh..(h * max_ctx + pos + 1) * dh]
                .copy_from_slice(&rows[(pos * hkv + h) * dh..(pos * hkv + h + 1) * dh]);
        }
    }
    match kv {
        KvDtype::F32 => bytemuck::cast_slice(&f).to_vec(),
        KvDtype::Bf16 => f
            .iter()
            .flat_map(|v| f32_to_bf16_bits(*v).to_le_bytes())
            .collect(),
    }
}

/// Rows `[P, Hkv, Dh]` for positions [from, to) from a downloaded cache.
fn from_cache(
    bytes: &[u8],
    hkv: usize,
    dh: usize,
    max_ctx: usize,
    kv: KvDtype,
    from: usize,
    to: usize,
) -> Vec<f32> {
    let read = |i: usize| match kv {
        KvDtype::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        KvDtype::Bf16 => bf16_bits_to_f32(u16::from_le_bytes(
            bytes[2 * i..2 * i + 2].try_into().unwrap(),
        )),
    };
    let mut out = Vec::new();
    for pos in from..to {
        for h in 0..hkv {
            for d in 0..dh {
                out.push(read((h * max_ctx + pos) * dh + d));
            }
        }
    }
    out
}

fn run_case(
    label: &str,
    spec: &ModelSpec,
    fmt: WFmt,
    kv: KvDtype,
    precision: Option<Precision>,
    tol: Tol,
    cases: &[(usize, usize)],
) -> bool {
    let Some(gpu) = gpu() else { return true };
    let weights = random_weights(spec, fmt, 0.5, 31);
    let mut warena = Arena::new(&gpu, 256 << 20);
    let model = upload_model(&gpu, &mut warena, spec, &weights, None).unwrap();
    let MixerWeights::Attention(aw) = &weights.layers[0].mixer else {
        unreachable!()
    };
    let cpu = Attention::new(spec, aw, 0).unwrap();
    let (d, hkv, dh) = (spec.hidden_size, spec.num_key_value_heads, spec.head_dim);
    let mut rng = Rng::new(6);
    let mut ok = true;
    for &(t, p0) in cases {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let max_ctx = p0 + t + 5;
        let h_in = rng.normal_vec(t * d, 1.0);
        let mut cache = KvCache {
            keys: rng.normal_vec(p0 * hkv * dh, 1.0),
            values: rng.normal_vec(p0 * hkv * dh, 1.0),
        };
        if kv == KvDtype::Bf16 {
            round_bf16(&mut cache.keys);
            round_bf16(&mut cache.values);
        }
        let k_bytes = to_cache(&cache.keys, hkv, dh, max_ctx, kv);
        let v_bytes = to_cache(&cache.values, hkv, dh, max_ctx, kv);

        let mut xn = vec![0f32; t * d];
        calla_cpu::norm::rms_norm_zero_centred_into(
            &h_in,
            &weights.layers[0].input_layernorm,
            spec.rms_norm_eps,
            &mut xn,
        );
        let mut want = vec![0f32; t * d];
        cpu.forward(&xn, t, &mut cache, &mut want);

        let scratch = PrefillScratch::new(&mut arena, spec, t).unwrap();
        let kc = arena.upload(&k_bytes).unwrap();
        let vc = arena.upload(&v_bytes).unwrap();
        let h = upload_f32(&mut arena, &h_in);
        let launches = prefill_mixer(
            &gpu,
            spec,
            &model,
            0,
            LayerState::Attention {
                k_cache: kc,
                v_cache: vc,
                max_ctx,
                kv,
            },
            &scratch,
            h,
            p0,
            t,
            &PrefillOptions {
                precision: precision.into(),
            },
        )
        .unwrap();
        run(&gpu, &launches);
        let got: Vec<f32> = download_f32(&gpu, h, t * d)
            .iter()
            .zip(&h_in)
            .map(|(a, b)| a - b)
            .collect();
        ok &= check(&format!("{label} T={t} p0={p0} attn_out"), &got, &want, tol);
        let mut kb = vec![0u8; k_bytes.len()];
        gpu.dtoh(kc, &mut kb).unwrap();
        let mut vb = vec![0u8; v_bytes.len()];
        gpu.dtoh(vc, &mut vb).unwrap();
        let n0 = p0 * hkv * dh;
        // bf16 caches: the rows are the f32 reference rounded to bf16 (≤ 2^-9 relative) plus the
        // projection's own error
        let kv_tol = if kv == KvDtype::Bf16 {
            Tol {
                atol_rms: tol.atol_rms,
                rtol: 8e-3,
                rms_rel: tol.rms_rel,
            }
        } else {
            tol
        };
        ok &= check(
            &format!("{label} T={t} p0={p0} K cache rows"),
            &from_cache(&kb, hkv, dh, max_ctx, kv, p0, p0 + t),
            &cache.keys[n0..],
            kv_tol,
        );
        ok &= check(
            &format!("{label} T={t} p0={p0} V cache rows"),
            &from_cache(&vb, hkv, dh, max_ctx, kv, p0, p0 + t),
            &cache.values[n0..],
            kv_tol,
        );
        // the rows before p0 are untouched
        ok &= check(
            &format!("{label} T={t} p0={p0} K cache prefix kept"),
            &from_cache(&kb, hkv, dh, max_ctx, kv, 0, p0),
            &cache.keys[..n0],
            EXACT,
        );
    }
    ok
}

#[test]
#[ignore = "needs CUDA"]
fn fixture_dims_f32_and_bf16_caches() {
    let spec = mixer_spec(&tiny_spec(Family::Qwen35Moe, 1));
    let mut cases: Vec<(usize, usize)> = TOKEN_COUNTS.iter().map(|t| (*t, 0)).collect();
    cases.extend([(1, 70), (7, 3), (150, 37), (65, 128)]);
    let ok = run_case(
        "tiny f32 weights, f32 KV",
        &spec,
        WFmt::F32,
        KvDtype::F32,
        None,
        SPLIT,
        &cases,
    ) & run_case(
        "tiny f32 weights, bf16 KV",
        &spec,
        WFmt::F32,
        KvDtype::Bf16,
        None,
        FAST,
        &cases,
    ) & run_case(
        "tiny q4 weights, f32 KV, split",
        &spec,
        WFmt::Q4,
        KvDtype::F32,
        Some(Precision::Split),
        SPLIT,
        &cases[..7],
    ) & run_case(
        "tiny q4 weights, f32 KV, fast (f32 tiles rounded to bf16)",
        &spec,
        WFmt::Q4,
        KvDtype::F32,
        None,
        FAST,
        &cases,
    );
    assert!(ok, "attention prefill out of tolerance (see above)");
}

#[test]
#[ignore = "needs CUDA"]
fn real_dims_q4_bf16_and_f32_caches() {
    let spec = mixer_spec(&calla_model::synthetic::preset("qwen3.6-35b-a3b").unwrap());
    let ok = run_case(
        "real q4, bf16 KV",
        &spec,
        WFmt::Q4,
        KvDtype::Bf16,
        None,
        FAST,
        &[(65, 0), (1000, 0), (200, 333)],
    ) & run_case(
        "real q4 fast, f32 KV",
        &spec,
        WFmt::Q4,
        KvDtype::F32,
        None,
        FAST,
        &[(65, 0), (1000, 0), (200, 333)],
    ) & run_case(
        "real q4 split, f32 KV",
        &spec,
        WFmt::Q4,
        KvDtype::F32,
        Some(Precision::Split),
        SPLIT,
        &[(150, 0), (64, 100)],
    );
    assert!(ok, "attention prefill out of tolerance (see above)");
}
