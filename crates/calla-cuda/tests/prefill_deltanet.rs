//! The DeltaNet prompt path (norm → projections → conv/chunked rule/gated norm → out_proj, through
//! `prefill_mixer`) against calla_cpu's `DeltaNet::forward` (Rule::Chunked), at the fixture dims and
//! the real dims, from an empty state and from a random carried state at an odd position; checks
//! the output, the recurrent state (decode layout `[Hv, Dv, Dk]`) and the conv ring.

mod prefill_support;

use calla_cpu::deltanet::{DeltaNet, DeltaNetState, Rule};
use calla_cpu::random::{tiny_spec, Rng};
use calla_cuda::engine::prefill::{prefill_mixer, LayerState, PrefillOptions, PrefillScratch};
use calla_cuda::ops::gemm::Precision;
use calla_cuda::ops::weights::upload_model;
use calla_cuda::runtime::pool::Arena;
use calla_model::{Family, FeedForwardSpec, LayerKind, MixerWeights, ModelSpec};
use prefill_support::*;

fn mixer_spec(base: &ModelSpec) -> ModelSpec {
    let mut s = layers_spec(base, &[LayerKind::DeltaNet]);
    s.feed_forward = FeedForwardSpec::Dense { intermediate: 128 }; // not exercised here
    s
}

/// (label, spec, weight format, precision, tolerance of outputs, state and ring, cases (T, p0))
fn run_case(
    label: &str,
    spec: &ModelSpec,
    fmt: WFmt,
    precision: Option<Precision>,
    tol: Tol,
    cases: &[(usize, usize)],
) -> bool {
    let Some(gpu) = gpu() else { return true };
    let weights = random_weights(spec, fmt, 0.5, 21);
    let mut warena = Arena::new(&gpu, 256 << 20);
    let model = upload_model(&gpu, &mut warena, spec, &weights, None).unwrap();
    let MixerWeights::DeltaNet(dw) = &weights.layers[0].mixer else {
        unreachable!()
    };
    let cpu = DeltaNet::new(spec, dw, 0).unwrap();
    let (d, c, k) = (
        spec.hidden_size,
        spec.linear_conv_dim(),
        spec.linear_conv_kernel_dim,
    );
    let (hv, dk, dv) = (
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    let mut rng = Rng::new(5);
    let mut ok = true;
    for &(t, p0) in cases {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let h_in = rng.normal_vec(t * d, 1.0);
        // the carried state: zeros at position 0, random otherwise
        let mut st = DeltaNetState::new(spec);
        if p0 > 0 {
            st.conv = rng.normal_vec(st.conv.len(), 1.0);
            st.recurrent = rng.normal_vec(st.recurrent.len(), 0.05);
        }
        let mut ring = vec![0f32; k * c];
        for i in 0..k - 1 {
            let pos = p0 as i64 - (k as i64 - 1) + i as i64; // CPU conv row i is position p0−K+1+i
            if pos >= 0 || p0 > 0 {
                let slot = pos.rem_euclid(k as i64) as usize;
                ring[slot * c..(slot + 1) * c].copy_from_slice(&st.conv[i * c..(i + 1) * c]);
            }
        }
        let s_gpu = transpose_state(&st.recurrent, hv, dk, dv);

        let mut xn = vec![0f32; t * d];
        calla_cpu::norm::rms_norm_zero_centred_into(
            &h_in,
            &weights.layers[0].input_layernorm,
            spec.rms_norm_eps,
            &mut xn,
        );
        let mut want = vec![0f32; t * d];
        let mut cpu_state = st.clone();
        cpu.forward(&xn, t, &mut cpu_state, Rule::Chunked, &mut want);

        let scratch = PrefillScratch::new(&mut arena, spec, t).unwrap();
        let ring_d = upload_f32(&mut arena, &ring);
        let s_d = upload_f32(&mut arena, &s_gpu);
        let h = upload_f32(&mut arena, &h_in);
        let launches = prefill_mixer(
            &gpu,
            spec,
            &model,
            0,
            LayerState::DeltaNet {
                conv_ring: ring_d,
                state: s_d,
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
        ok &= check(
            &format!("{label} T={t} p0={p0} deltanet_out"),
            &got,
            &want,
            tol,
        );
        let s_got = download_f32(&gpu, s_d, s_gpu.len());
        ok &= check(
            &format!("{label} T={t} p0={p0} state S"),
            &s_got,
            &transpose_state(&cpu_state.recurrent, hv, dk, dv),
            tol,
        );
        let ring_got = download_f32(&gpu, ring_d, ring.len());
        let p_end = (p0 + t) as i64;
        let mut ring_rows = Vec::new();
        for i in 0..k - 1 {
            let pos = p_end - (k as i64 - 1) + i as i64;
            let slot = pos.rem_euclid(k as i64) as usize;
            ring_rows.extend_from_slice(&ring_got[slot * c..(slot + 1) * c]);
        }
        ok &= check(
            &format!("{label} T={t} p0={p0} conv ring"),
            &ring_rows,
            &cpu_state.conv,
            tol,
        );
    }
    ok
}

/// `[Hv, Dk, Dv]` (CPU) ↔ `[Hv, Dv, Dk]` (GPU, decode layout); the map is its own inverse in shape.
fn transpose_state(s: &[f32], hv: usize, a: usize, b: usize) -> Vec<f32> {
    let mut out = vec![0f32; s.len()];
    for h in 0..hv {
        for i in 0..a {
            for j in 0..b {
                out[(h * b + j) * a + i] = s[(h * a + i) * b + j];
            }
        }
    }
    out
}

#[test]
#[ignore = "needs CUDA"]
fn fixture_dims_f32_and_q4() {
    let spec = mixer_spec(&tiny_spec(Family::Qwen35Moe, 1));
    let mut cases: Vec<(usize, usize)> = TOKEN_COUNTS.iter().map(|t| (*t, 0)).collect();
    cases.extend([(1, 5), (7, 2), (150, 37), (64, 64)]);
    let ok = run_case("tiny f32 (split)", &spec, WFmt::F32, None, SPLIT, &cases)
        & run_case(
            "tiny q4 split",
            &spec,
            WFmt::Q4,
            Some(Precision::Split),
            SPLIT,
            &cases[..6],
        )
        & run_case("tiny q4 fast", &spec, WFmt::Q4, None, FAST, &cases[4..8]);
    assert!(ok, "DeltaNet prefill out of tolerance (see above)");
}

#[test]
#[ignore = "needs CUDA"]
fn real_dims_q4() {
    let spec = mixer_spec(&calla_model::synthetic::preset("qwen3.6-35b-a3b").unwrap());
    let ok = run_case(
        "real q4 fast",
        &spec,
        WFmt::Q4,
        None,
        FAST,
        &[(65, 0), (1000, 0), (300, 77)],
    );
    assert!(ok, "DeltaNet prefill out of tolerance (see above)");
}

/// Split precision at the real dims: the projections ≈ f32, so the chunked core's own accuracy
/// (3xTF32 on the tensor cores) shows against SPLIT's tolerance.
#[test]
#[ignore = "needs CUDA"]
fn real_dims_q4_split() {
    let spec = mixer_spec(&calla_model::synthetic::preset("qwen3.6-35b-a3b").unwrap());
    let ok = run_case(
        "real q4 split",
        &spec,
        WFmt::Q4,
        Some(Precision::Split),
        SPLIT,
        &[(1000, 0), (300, 77)],
    );
    assert!(ok, "DeltaNet prefill out of tolerance (see above)");
}

/// Head dims the tensor-core kernels do not take (Dk % 16 ≠ 0; Dk + Dv > 256) run the CUDA-core
/// chunk and scan kernels: the fallback keeps its own check.
#[test]
#[ignore = "needs CUDA"]
fn cuda_core_fallback_dims() {
    let mut ok = true;
    for (dk, dv) in [(40, 16), (64, 256)] {
        let mut spec = mixer_spec(&tiny_spec(Family::Qwen35Moe, 1));
        spec.linear_key_head_dim = dk;
        spec.linear_value_head_dim = dv;
        ok &= run_case(
            &format!("Dk {dk} Dv {dv} f32 (split)"),
            &spec,
            WFmt::F32,
            None,
            SPLIT,
            &[(150, 0), (70, 37)],
        );
    }
    assert!(ok, "DeltaNet prefill out of tolerance (see above)");
}

/// Head dims beyond the decode kernels' compiled copies (docs: every checkpoint the CPU engine runs
/// also runs on CUDA) that the chunked prompt kernels take: Dk 16, 48, 96 (tensor cores), 20, 24
/// (CUDA cores). (Other dims run prompts through the decode chain: dn_general_engine_matches_cpu.)
/// Several 64-token chunks, from an empty state and from a random carried state at an odd position.
/// (Hv·Dv a multiple of 64: the out-projection GEMM's K.)
#[test]
#[ignore = "needs CUDA"]
fn dn_general_dims_prefill() {
    let mut ok = true;
    // (Hk, Hv, Dk, Dv)
    for (hk, hv, dk, dv) in [
        (2, 4, 16, 16),
        (2, 8, 20, 24),
        (2, 4, 24, 32),
        (1, 4, 48, 48),
        (1, 2, 96, 96),
    ] {
        let mut spec = mixer_spec(&tiny_spec(Family::Qwen35Moe, 1));
        spec.linear_num_key_heads = hk;
        spec.linear_num_value_heads = hv;
        spec.linear_key_head_dim = dk;
        spec.linear_value_head_dim = dv;
        assert!(!calla_cuda::ops::deltanet_general::prefill_is_general(
            &spec
        ));
        ok &= run_case(
            &format!("dn_general Hk {hk} Hv {hv} Dk {dk} Dv {dv} f32 (split)"),
            &spec,
            WFmt::F32,
            None,
            SPLIT,
            &[(150, 0), (70, 37), (1, 5), (64, 64)],
        );
    }
    assert!(ok, "DeltaNet prefill out of tolerance (see above)");
}
