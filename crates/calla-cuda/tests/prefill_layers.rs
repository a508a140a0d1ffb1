//! The public prompt entry points end to end: `prefill_embed` + `prefill_layer` over every layer of
//! a 4-layer model (DN, DN, DN, attention; MoE), in two chunks (the second continues the first's
//! state at p0 = T1), in the engine's own state layout (decode::StateLayout). Compared after every
//! layer with the CPU model's `l_out` trace.

mod prefill_support;

use std::collections::HashMap;

use calla_cpu::random::{tiny_spec, Rng};
use calla_cpu::{Logits, Model};
use calla_cuda::engine::decode::StateLayout;
use calla_cuda::engine::prefill::{
    prefill_embed, prefill_layer, LayerState, PrefillOptions, PrefillScratch, PromptRunner,
};
use calla_cuda::ops::prompt_precision::PromptPrecision;
use calla_cuda::ops::weights::upload_model;
use calla_cuda::runtime::pool::Arena;
use calla_cuda::KvDtype;
use calla_model::{Family, LayerKind};
use prefill_support::*;

fn run_case(label: &str, fmt: WFmt, kv: KvDtype, precision: PromptPrecision, tol: Tol) -> bool {
    let Some(gpu) = gpu() else { return true };
    let spec = tiny_spec(Family::Qwen35Moe, 1);
    let weights = random_weights(&spec, fmt, 0.5, 51);
    let cpu = Model::new(spec.clone(), &weights).unwrap();
    let mut warena = Arena::new(&gpu, 256 << 20);
    let model = upload_model(&gpu, &mut warena, &spec, &weights, None).unwrap();
    let d = spec.hidden_size;
    let mut rng = Rng::new(8);
    let chunks = [100usize, 37];
    let max_ctx = 256;
    let layout = StateLayout::new(&spec, max_ctx, kv);
    let mut arena = Arena::new(&gpu, 64 << 20);
    let state = arena.alloc_zeroed(layout.bytes).unwrap();
    let scratch = PrefillScratch::new(&mut arena, &spec, 128).unwrap();
    let h = arena.alloc_zeroed(128 * d * 4).unwrap();
    let mut seq = cpu.new_sequence();
    let mut ok = true;
    let mut p0 = 0;
    for (ci, &t) in chunks.iter().enumerate() {
        let tokens: Vec<u32> = (0..t).map(|_| rng.below(spec.vocab_size) as u32).collect();
        let mut trace: HashMap<(String, Option<usize>), Vec<f32>> = HashMap::new();
        let mut hook = |name: &str, layer: Option<usize>, v: &[f32]| {
            trace.insert((name.to_string(), layer), v.to_vec());
        };
        cpu.forward(&tokens, &mut seq, Logits::Skip, Some(&mut hook));

        let ids: Vec<i32> = tokens.iter().map(|x| *x as i32).collect();
        gpu.htod(scratch.tokens, &ids).unwrap();
        run(
            &gpu,
            &[prefill_embed(&gpu, &model, &scratch, t, h).unwrap()],
        );
        ok &= check(
            &format!("{label} chunk {ci} embed"),
            &download_f32(&gpu, h, t * d),
            &trace[&("embed".to_string(), None)],
            EXACTISH,
        );
        for (il, kind) in spec.layers.iter().enumerate() {
            let (a, b) = layout.layers[il];
            let st = match kind {
                LayerKind::DeltaNet => LayerState::DeltaNet {
                    conv_ring: state.offset(a),
                    state: state.offset(b),
                },
                LayerKind::Attention => LayerState::Attention {
                    k_cache: state.offset(a),
                    v_cache: state.offset(b),
                    max_ctx,
                    kv,
                },
            };
            let launches = prefill_layer(
                &gpu,
                &spec,
                &model,
                il,
                st,
                &scratch,
                h,
                p0,
                t,
                &PrefillOptions { precision },
            )
            .unwrap();
            run(&gpu, &launches);
            let want = &trace[&("l_out".to_string(), Some(il))];
            ok &= check(
                &format!("{label} chunk {ci} (p0={p0}, T={t}) layer {il} {kind:?} l_out"),
                &download_f32(&gpu, h, t * d),
                want,
                tol,
            );
        }
        p0 += t;
    }
    ok
}

#[test]
#[ignore = "needs CUDA"]
fn four_layers_two_chunks_f32_and_q4() {
    let auto = PromptPrecision::AUTO;
    let half = PromptPrecision::HALF;
    let ok = run_case(
        "tiny f32 weights, f32 KV",
        WFmt::F32,
        KvDtype::F32,
        auto,
        SPLIT,
    ) & run_case(
        "tiny q4 weights (fast), bf16 KV",
        WFmt::Q4,
        KvDtype::Bf16,
        auto,
        FAST,
    ) & run_case(
        "tiny q4 weights (half), f32 KV",
        WFmt::Q4,
        KvDtype::F32,
        half,
        HALF,
    ) & run_case(
        "tiny q4 weights (half), bf16 KV",
        WFmt::Q4,
        KvDtype::Bf16,
        half,
        FAST,
    );
    assert!(ok, "prefill layers out of tolerance (see above)");
}

/// `PromptRunner` (the backend's entry point) over a prompt longer than its chunk size: the residual
/// rows of the last chunk, the copied last row, and a decode-layout state that continues correctly
/// (a second prompt after the first).
fn runner_case(label: &str, fmt: WFmt, kv: KvDtype, tol: Tol) -> bool {
    let Some(gpu) = gpu() else { return true };
    let spec = tiny_spec(Family::Qwen35Moe, 1);
    let weights = random_weights(&spec, fmt, 0.5, 52);
    let cpu = Model::new(spec.clone(), &weights).unwrap();
    let mut warena = Arena::new(&gpu, 256 << 20);
    let model = upload_model(&gpu, &mut warena, &spec, &weights, None).unwrap();
    let d = spec.hidden_size;
    let mut rng = Rng::new(9);
    let layout = StateLayout::new(&spec, 512, kv);
    let mut arena = Arena::new(&gpu, 64 << 20);
    let state = arena.alloc_zeroed(layout.bytes).unwrap();
    let last = arena.alloc_zeroed(d * 4).unwrap();
    let runner = PromptRunner::new(&mut arena, &spec, 64, PrefillOptions::default()).unwrap();
    let mut seq = cpu.new_sequence();
    let mut ok = true;
    let mut p0 = 0;
    for t in [137usize, 70] {
        let tokens: Vec<u32> = (0..t).map(|_| rng.below(spec.vocab_size) as u32).collect();
        let n_layers = spec.num_layers();
        let mut l_out = Vec::new();
        let mut hook = |name: &str, layer: Option<usize>, v: &[f32]| {
            if name == "l_out" && layer == Some(n_layers - 1) {
                l_out = v.to_vec();
            }
        };
        cpu.forward(&tokens, &mut seq, Logits::Skip, Some(&mut hook));
        runner
            .run(&gpu, &spec, &model, &layout, state, p0, &tokens, Some(last))
            .unwrap();
        gpu.sync().unwrap();
        let rows_last_chunk = (t - 1) % 64 + 1;
        let got = download_f32(&gpu, runner.h, rows_last_chunk * d);
        ok &= check(
            &format!("{label} prompt of {t} at p0={p0} (chunks of 64): last chunk rows"),
            &got,
            &l_out[(t - rows_last_chunk) * d..],
            tol,
        );
        ok &= check(
            &format!("{label} prompt of {t} at p0={p0}: last row copied"),
            &download_f32(&gpu, last, d),
            &l_out[(t - 1) * d..],
            tol,
        );
        p0 += t;
    }
    ok
}

#[test]
#[ignore = "needs CUDA"]
fn prompt_runner_chunks_and_continues() {
    let ok = runner_case("runner f32, f32 KV", WFmt::F32, KvDtype::F32, SPLIT)
        & runner_case("runner q4 fast, bf16 KV", WFmt::Q4, KvDtype::Bf16, FAST);
    assert!(ok, "prompt runner out of tolerance (see above)");
}
