//! The mixer in pieces (engine/prefill.rs `mixer_pieces`, used when a chunk's DeltaNet/attention
//! buffers would exceed the MoE's) against the mixer in one piece: every layer's residual rows and
//! the whole sequence state (DeltaNet conv rings and states, K/V caches) must be bitwise equal —
//! pieces start at multiples of 64 tokens, so every kernel sees the chunks and query tiles of one
//! call. Two chunks (the second continues at an odd position), f32 and bf16 caches, split and
//! fast precision, and a real-dims DeltaNet + attention pair (MoE shrunk).

mod prefill_support;

use calla_cpu::random::{tiny_spec, Rng};
use calla_cuda::engine::decode::StateLayout;
use calla_cuda::engine::prefill::{
    prefill_embed, prefill_layer, LayerState, PrefillOptions, PrefillScratch,
};
use calla_cuda::ops::gemm::Precision;
use calla_cuda::ops::weights::upload_model;
use calla_cuda::runtime::pool::Arena;
use calla_cuda::KvDtype;
use calla_model::{Family, FeedForwardSpec, LayerKind, ModelSpec};
use prefill_support::*;

/// Runs `chunks` through every layer with mixer pieces of `pieces` tokens (None: one piece);
/// returns the residual rows after every layer of every chunk, then the final state bytes.
#[allow(clippy::too_many_arguments)]
fn run_all(
    gpu: &std::sync::Arc<calla_cuda::runtime::gpu::Gpu>,
    spec: &ModelSpec,
    model: &calla_cuda::ops::weights::DevModel,
    kv: KvDtype,
    precision: Option<Precision>,
    chunks: &[Vec<u32>],
    max_tokens: usize,
    pieces: Option<usize>,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let d = spec.hidden_size;
    let max_ctx: usize = chunks.iter().map(|c| c.len()).sum::<usize>() + 8;
    let layout = StateLayout::new(spec, max_ctx, kv);
    let mut arena = Arena::new(gpu, 64 << 20);
    let state = arena.alloc_zeroed(layout.bytes).unwrap();
    let tm = pieces.unwrap_or(max_tokens);
    let scratch = PrefillScratch::with_mixer_tokens(&mut arena, spec, max_tokens, tm).unwrap();
    let h = arena.alloc_zeroed(max_tokens * d * 4).unwrap();
    let opts = PrefillOptions {
        precision: precision.into(),
    };
    let mut rows = Vec::new();
    let mut p0 = 0;
    for chunk in chunks {
        let t = chunk.len();
        let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
        gpu.htod(scratch.tokens, &ids).unwrap();
        run(gpu, &[prefill_embed(gpu, model, &scratch, t, h).unwrap()]);
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
            let launches =
                prefill_layer(gpu, spec, model, il, st, &scratch, h, p0, t, &opts).unwrap();
            run(gpu, &launches);
            rows.push(download_f32(gpu, h, t * d));
        }
        p0 += t;
    }
    (rows, download_f32(gpu, state, layout.bytes / 4))
}

fn same_bits(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

fn case(label: &str, spec: &ModelSpec, fmt: WFmt, chunk_lens: &[usize], max_tokens: usize) -> bool {
    let Some(gpu) = gpu() else { return true };
    let weights = random_weights(spec, fmt, 0.5, 61);
    let mut warena = Arena::new(&gpu, 256 << 20);
    let model = upload_model(&gpu, &mut warena, spec, &weights, None).unwrap();
    let mut rng = Rng::new(17);
    let chunks: Vec<Vec<u32>> = chunk_lens
        .iter()
        .map(|&t| (0..t).map(|_| rng.below(spec.vocab_size) as u32).collect())
        .collect();
    let mut ok = true;
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        for precision in [Some(Precision::Split), Some(Precision::Fast)] {
            let whole = run_all(&gpu, spec, &model, kv, precision, &chunks, max_tokens, None);
            for pieces in [64, 128] {
                let split = run_all(
                    &gpu,
                    spec,
                    &model,
                    kv,
                    precision,
                    &chunks,
                    max_tokens,
                    Some(pieces),
                );
                let rows_differ: usize = whole
                    .0
                    .iter()
                    .zip(&split.0)
                    .map(|(a, b)| same_bits(a, b))
                    .sum();
                let state_differ = same_bits(&whole.1, &split.1);
                let pass = rows_differ == 0 && state_differ == 0 && whole.0.len() == split.0.len();
                println!(
                    "| {label}: {kv:?} KV, {precision:?}, pieces of {pieces} | {rows_differ} residual values, \
                     {state_differ} state values differ | {} |",
                    if pass { "PASS" } else { "FAIL" }
                );
                ok &= pass;
            }
        }
    }
    ok
}

#[test]
#[ignore = "needs CUDA"]
fn mixer_pieces_are_bitwise_one_piece_at_fixture_dims() {
    let spec = tiny_spec(Family::Qwen35Moe, 1); // DN, DN, DN, attention; MoE
    assert!(case("tiny f32", &spec, WFmt::F32, &[300, 77], 300));
    assert!(case("tiny q4", &spec, WFmt::Q4, &[300, 77], 300));
}

#[test]
#[ignore = "needs CUDA"]
fn mixer_pieces_are_bitwise_one_piece_at_real_dims() {
    let real = calla_model::synthetic::preset("qwen3.6-35b-a3b").unwrap();
    let mut spec = layers_spec(&real, &[LayerKind::DeltaNet, LayerKind::Attention]);
    // the mixers at the real dims; a small MoE (the feed-forward is not what is tested)
    spec.feed_forward = FeedForwardSpec::Moe {
        num_experts: 8,
        top_k: 2,
        expert_intermediate: 64,
        shared_intermediate: 64,
        norm_topk_prob: true,
    };
    assert!(case("real dims q4", &spec, WFmt::Q4, &[257, 130], 257));
}
