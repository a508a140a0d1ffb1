//! Lab for the prompt path at the real Qwen3.6-35B-A3B shape (q4 weights, 8-bit router, bf16 KV):
//! times every launch of one DeltaNet layer, one attention layer and one MoE block for a prompt of
//! T tokens (default 8192) with CUDA events (median of 5 after a warm-up), prints µs, TFLOP/s and
//! the whole-model estimate (30 DeltaNet + 10 attention layers, each with its MoE block).
//!
//!   [CALLA_PROMPT_PRECISION=mixed] cargo run --release -p calla-cuda --example lab_prefill -- [T]
//!
//! Ceilings (H200, measured in this workplace): ~790 TFLOP/s dense bf16, ~4.3 TB/s copy.
//!
//! Measured (H200, T = 8192, fast precision, bf16 KV, commit f445a94), µs per layer:
//!   DeltaNet mixer 6433: in_proj_qkv 1069 (257 TFLOP/s), z 548, b/a 45+43, conv 270, chunk 1214,
//!                        scan 2473, gated norm 136, out_proj 560 (246 TFLOP/s), rmsnorm 71
//!   attention mixer 5377: q 1067 (258), k/v 76+76, prep 202, flash 3320 (166 TFLOP/s), o 563
//!   MoE 2981: router (q8 split) 129, top-k 76, scan 7, scatter 22, gate/up 1325 (207 TFLOP/s),
//!             down 850 (162), shared 145 + 150, combine 208, rmsnorm 70
//!   square bf16 GEMM 8192³: 297 TFLOP/s fast, 175 split (the mma.sync kernel's own ceiling)
//!   whole model estimate: 366 ms for 8192 tokens = 22.4k tok/s (target 30k)
//! History: 13.1k (first version) → 18.2k (2 blocks/SM, batched DeltaNet loads) → 22.4k (bf16
//! magic-number q4 dequant, 16-byte smem reads in the DeltaNet kernels).
//! Split precision (then the default), session 4: 12.1k → 18.9k (q4 split products on wgmma,
//! `gemm_q4_wgx_split`; the DeltaNet scan's loads overlapped; the chunk solve in four chains), docs/performance.md "Session 4".
//! Half precision (`CALLA_PROMPT_PRECISION=half`, session 10): 273.5 ms (29.96k) at 749b20e
//! (`gemm_q4_wgh`: in_proj_qkv 299 µs per half, MoE gate/up 782, down 475), docs/performance.md
//! "Session 10". Session 11 (DeltaNet chunk transform and recurrence on tensor cores): half 227.0 ms
//! (36.1k); DeltaNet core per half prompt: chunk_tc 254, states 363, out 157 µs. The
//! mixers run their prompt in two halves here, so a mixer launch's TFLOP/s column is 2× too high.

#[path = "../tests/prefill_support/mod.rs"]
mod prefill_support;

use std::time::Instant;

use calla_cpu::random::Rng;
use calla_cuda::forward::StateLayout;
use calla_cuda::gemm::{self, Gemm, GemmOut, Precision};
use calla_cuda::gpu::{Gpu, Launch};
use calla_cuda::pool::Arena;
use calla_cuda::prefill_layer::{
    prefill_ffn, prefill_mixer, LayerState, PrefillOptions, PrefillScratch,
};
use calla_cuda::weights::upload_model;
use calla_cuda::KvDtype;
use calla_model::LayerKind;
use cudarc::driver::sys::CUevent_flags;
use prefill_support::*;

const REPS: usize = 5;

/// Median time in µs of `launches` run back to back (after one warm-up), and each launch's median.
fn time(gpu: &Gpu, launches: &[Launch]) -> (f64, Vec<f64>) {
    let ev = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    run(gpu, launches);
    let mut per: Vec<Vec<f64>> = vec![Vec::new(); launches.len()];
    let mut total = Vec::new();
    for _ in 0..REPS {
        let marks: Vec<_> = (0..=launches.len()).map(|_| ev()).collect();
        marks[0].record(&gpu.stream).unwrap();
        for (i, l) in launches.iter().enumerate() {
            l.run(gpu).unwrap();
            marks[i + 1].record(&gpu.stream).unwrap();
        }
        gpu.sync().unwrap();
        for i in 0..launches.len() {
            per[i].push(marks[i].elapsed_ms(&marks[i + 1]).unwrap() as f64 * 1e3);
        }
        total.push(marks[0].elapsed_ms(&marks[launches.len()]).unwrap() as f64 * 1e3);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    (median(&mut total), per.iter_mut().map(median).collect())
}

fn report(title: &str, launches: &[Launch], flops: &[f64], gpu: &Gpu) -> f64 {
    let (total, per) = time(gpu, launches);
    println!("\n{title}: {total:.0} µs");
    for (i, (l, us)) in launches.iter().zip(&per).enumerate() {
        let f = flops.get(i).copied().unwrap_or(0.0);
        let rate = if f > 0.0 {
            format!(
                "{:7.1} TFLOP/s ({:4.1}% of 790)",
                f / us * 1e-6,
                f / us * 1e-6 / 7.9
            )
        } else {
            String::new()
        };
        println!(
            "  {:<34} grid {:>5}×{:<4} {:>9.1} µs  {rate}",
            l.name, l.grid.0, l.grid.1, us
        );
    }
    total
}

fn main() {
    let t: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(8192);
    let gpu = Gpu::new(0).unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "{} — prompt of {t} tokens at the Qwen3.6-35B-A3B shape, q4 weights, bf16 KV",
        gpu.describe()
    );
    let base = calla_model::synthetic::preset("qwen3.6-35b-a3b").unwrap();
    let spec = layers_spec(&base, &[LayerKind::DeltaNet, LayerKind::Attention]);
    let start = Instant::now();
    let weights = random_weights(&spec, WFmt::Q4, 1.0, 3);
    let mut warena = Arena::new(&gpu, 1 << 30);
    let model = upload_model(&gpu, &mut warena, &spec, &weights, None).unwrap();
    println!(
        "weights: {:.2} GB generated and uploaded in {:.1} s",
        model.bytes as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );

    let d = spec.hidden_size;
    let layout = StateLayout::new(&spec, t + 64, KvDtype::Bf16);
    let mut arena = Arena::new(&gpu, 1 << 30);
    let state = arena.alloc_zeroed(layout.bytes).unwrap();
    let scratch = PrefillScratch::new(&mut arena, &spec, t).unwrap();
    println!(
        "scratch for {t} tokens: {:.2} GB; sequence state {:.2} GB",
        scratch.bytes as f64 / 1e9,
        layout.bytes as f64 / 1e9
    );
    let mut rng = Rng::new(1);
    let h = upload_f32(&mut arena, &rng.normal_vec(t * d, 1.0));
    // CALLA_PROMPT_PRECISION picks the per-product policy (e.g. mixed); default: by weight format
    // (fast for these q4 weights; the router is split either way)
    let opts = PrefillOptions {
        precision: calla_cuda::PromptPrecision::from_env()
            .expect("CALLA_PROMPT_PRECISION")
            .unwrap_or(calla_cuda::PromptPrecision::AUTO),
    };
    println!("prompt precision: {}", opts.precision);
    let tf = t as f64;

    // DeltaNet mixer
    let (a, b) = layout.layers[0];
    let dn = prefill_mixer(
        &gpu,
        &spec,
        &model,
        0,
        LayerState::DeltaNet {
            conv_ring: state.offset(a),
            state: state.offset(b),
        },
        &scratch,
        h,
        0,
        t,
        &opts,
    )
    .unwrap();
    let c = spec.linear_conv_dim() as f64;
    let vd = spec.linear_value_dim() as f64;
    let hv = spec.linear_num_value_heads as f64;
    let df = d as f64;
    let dn_flops = [
        0.0,
        2.0 * tf * c * df,
        2.0 * tf * vd * df,
        2.0 * tf * hv * df,
        2.0 * tf * hv * df,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        2.0 * tf * df * vd,
    ];
    let dn_us = report(
        "DeltaNet mixer (norm, in_proj ×4, conv, ring, chunk, scan, norm, out_proj)",
        &dn,
        &dn_flops,
        &gpu,
    );

    // attention mixer, prompt from position 0
    let (ka, va) = layout.layers[1];
    let at = prefill_mixer(
        &gpu,
        &spec,
        &model,
        1,
        LayerState::Attention {
            k_cache: state.offset(ka),
            v_cache: state.offset(va),
            max_ctx: layout.max_ctx,
            kv: KvDtype::Bf16,
        },
        &scratch,
        h,
        0,
        t,
        &opts,
    )
    .unwrap();
    let (hq, dh, kvd) = (
        spec.num_attention_heads as f64,
        spec.head_dim as f64,
        spec.kv_dim() as f64,
    );
    let attn_core = 2.0 * hq * dh * tf * (tf + 1.0); // QKᵀ and PV over the causal triangle
    let at_flops = [
        0.0,
        2.0 * tf * 2.0 * hq * dh * df,
        2.0 * tf * kvd * df,
        2.0 * tf * kvd * df,
        0.0,
        attn_core,
        2.0 * tf * df * hq * dh,
    ];
    let at_us = report(
        "attention mixer (norm, q/k/v, prep, flash, o_proj)",
        &at,
        &at_flops,
        &gpu,
    );

    // MoE block
    let moe = prefill_ffn(&gpu, &spec, &model, 0, &scratch, h, t, &opts).unwrap();
    let (e, aa, i, is, _) = calla_cuda::moe_prefill::moe_dims(&spec).unwrap();
    let (e, aa, i, is) = (e as f64, aa as f64, i as f64, is as f64);
    let moe_flops = [
        0.0,
        3.0 * 2.0 * tf * e * df,
        0.0,
        0.0,
        0.0,
        2.0 * tf * aa * 2.0 * i * df,
        2.0 * tf * aa * i * df,
        2.0 * tf * 2.0 * is * df,
        2.0 * tf * is * df,
        0.0,
    ];
    let moe_us = report(
        "MoE block (norm, router, top-k, scan, scatter, gate/up, down, shared ×2, combine)",
        &moe,
        &moe_flops,
        &gpu,
    );

    let h_now = download_f32(&gpu, h, t * d);
    let bad = h_now.iter().filter(|v| !v.is_finite()).count();
    println!(
        "\nresidual after the layers: rms {:.3}, {bad} non-finite values",
        rms(&h_now)
    );

    // the kernel's own ceiling: a square bf16 GEMM
    let n = 8192;
    let mut sq = Arena::new(&gpu, 1 << 30);
    let wm = matrix(&mut rng, 1024, n, 0.01, WFmt::Bf16); // small host matrix, tiled below
    let mut big = Vec::with_capacity(n * n * 2);
    let bytes = match &wm.data {
        calla_model::MatrixData::Dense { data, .. } => data.bytes().to_vec(),
        _ => unreachable!(),
    };
    for _ in 0..n / 1024 {
        big.extend_from_slice(&bytes);
    }
    let wbig = dense_from_bytes(n, n, big);
    let wdev = upload_matrix(&gpu, &mut sq, "square", &wbig);
    let xp = alloc_planes(&mut sq, n * n, n);
    let xd = upload_f32(&mut sq, &rng.normal_vec(n * n / 8, 1.0));
    // fill the planes: 8 conversions of an eighth each
    let mut fills = Vec::new();
    for part in 0..8 {
        let off = part * n * n / 8 * 2;
        let p = gemm::Planes::new(xp.hi.offset(off), xp.lo.offset(off), n);
        fills.push(gemm::rmsnorm_planes(&gpu, xd, None, 0.0, n / 8, n, p).unwrap());
    }
    run(&gpu, &fills);
    let y = sq.alloc(n * n * 4).unwrap();
    for prec in [Precision::Fast, Precision::Split] {
        let g = gemm::gemm(
            &gpu,
            &Gemm {
                a: xp.for_precision(prec),
                gather: None,
                m: n,
                w: &wdev,
                n,
                swiglu: false,
                out: GemmOut::F32 {
                    ptr: y,
                    ld: n,
                    accumulate: false,
                },
                row_scale: None,
                precision: prec,
                grouped: None,
            },
        )
        .unwrap();
        let f = 2.0 * (n as f64).powi(3);
        report(
            &format!("square bf16 GEMM {n}³, {prec:?}"),
            &[g],
            &[f],
            &gpu,
        );
    }

    let per_model = 30.0 * (dn_us + moe_us) + 10.0 * (at_us + moe_us);
    println!(
        "\nestimate, 40 layers (30 DeltaNet + 10 attention, MoE each): {:.1} ms for {t} tokens = {:.0} tok/s \
         (DeltaNet mixer {dn_us:.0} µs, attention mixer {at_us:.0} µs, MoE {moe_us:.0} µs per layer; target ≥ 30,000 tok/s)",
        per_model / 1e3,
        tf / (per_model * 1e-6)
    );
}

fn dense_from_bytes(rows: usize, cols: usize, bytes: Vec<u8>) -> calla_model::Matrix {
    calla_model::Matrix {
        rows,
        cols,
        data: calla_model::MatrixData::Dense {
            dtype: calla_model::DType::BF16,
            data: calla_model::Blob::from_vec(bytes),
        },
    }
}
