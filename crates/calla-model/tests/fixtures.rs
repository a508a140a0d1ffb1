//! The real fixtures (tests/fixtures/models/*, written by transformers 5.24 and mlx-lm): each loads,
//! and the canonical weights equal what the reference stored — including the Qwen3-Next reorder, the
//! MLX norm shift and bit-exact MLX quantisation.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use calla_model::load::{load_model, LoadOptions, LoadedModel, Quant};
use calla_model::quant::quantize_affine;
use calla_model::weights::assemble::ExpertLayout;
use calla_model::weights::names::CheckpointStyle;
use calla_model::weights::{FeedForwardWeights, MixerWeights};
use calla_model::{Family, FeedForwardSpec, LayerKind, Matrix, MatrixData};

fn fixture(name: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name);
    if dir.join("config.json").is_file() {
        Some(dir)
    } else {
        eprintln!("SKIPPED: fixture {} is absent", dir.display());
        None
    }
}

fn load(name: &str) -> Option<LoadedModel> {
    let dir = fixture(name)?;
    Some(load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// Raw f32 values of tensors straight from a safetensors file (independent of the loader).
fn raw_tensors(dir: &std::path::Path, file: &str) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(_, t)| t.dtype() == safetensors::Dtype::F32)
        .map(|(name, t)| {
            let values = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (t.shape().to_vec(), values))
        })
        .collect()
}

fn tiny_dims_ok(m: &LoadedModel) {
    let s = &m.spec;
    assert_eq!((s.hidden_size, s.vocab_size, s.num_layers()), (128, 512, 4));
    assert_eq!(
        s.layers,
        vec![
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::Attention
        ]
    );
    assert_eq!(
        (
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
            s.rotary_dim
        ),
        (4, 2, 32, 8)
    );
    assert_eq!(
        (
            s.linear_num_key_heads,
            s.linear_num_value_heads,
            s.linear_key_head_dim
        ),
        (2, 4, 32)
    );
    assert_eq!(s.rope_theta, 1e7);
    assert!(!s.tie_word_embeddings);
}

#[test]
fn causal_perexpert_loads() {
    let Some(m) = load("qwen35moe-causal-perexpert") else {
        return;
    };
    tiny_dims_ok(&m);
    assert_eq!(m.spec.family, Family::Qwen35Moe);
    assert_eq!(m.report.style, CheckpointStyle::HfCausal);
    assert_eq!(m.report.expert_layout, Some(ExpertLayout::PerExpert));
    assert!(!m.report.norms_stored_plus_one);
    assert_eq!(m.generation.top_k, Some(20));
    // Norms are held as HF stores them: compare with the raw tensor.
    let raw = raw_tensors(&m.dir, "model.safetensors");
    assert_eq!(
        m.weights.layers[3].input_layernorm,
        raw["model.layers.3.input_layernorm.weight"].1
    );
    let (shape, gate) = &raw["model.layers.2.mlp.experts.5.gate_proj.weight"];
    assert_eq!(shape, &vec![64, 128]);
    match &m.weights.layers[2].feed_forward {
        FeedForwardWeights::Moe(moe) => assert_eq!(&moe.experts[5].gate_proj.to_f32(), gate),
        _ => panic!("MoE expected"),
    }
}

#[test]
fn cond_fused_loads_and_ignores_vision_and_mtp() {
    let Some(m) = load("qwen35moe-cond-fused") else {
        return;
    };
    tiny_dims_ok(&m);
    let r = &m.report;
    assert_eq!(r.style, CheckpointStyle::HfConditional);
    assert_eq!(r.expert_layout, Some(ExpertLayout::Fused));
    assert_eq!(r.files.len(), 2);
    assert!(
        r.ignored_counts.get("vision").copied().unwrap_or(0) > 0,
        "{:?}",
        r.ignored_counts
    );
    assert!(
        r.ignored_counts.get("mtp").copied().unwrap_or(0) > 0,
        "{:?}",
        r.ignored_counts
    );
    assert!(r.stats.formats.contains_key("bf16"));
    // The stop list is the top-level/generation list, not text_config's scalar.
    assert_eq!(m.spec.eos_token_ids, vec![481, 479]);
}

/// The fused [E, 2I, D] gate_up_proj splits into per-expert gate (first I rows) and up (next I).
#[test]
fn cond_fused_expert_views_match_the_fused_tensor() {
    let Some(m) = load("qwen35moe-cond-fused") else {
        return;
    };
    let dir = m.dir.clone();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let name = "model.language_model.layers.1.mlp.experts.gate_up_proj";
    let file = index["weight_map"][name].as_str().unwrap();
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.shape(), &[8, 128, 128]);
    let bf = |i: usize| half::bf16::from_le_bytes([t.data()[2 * i], t.data()[2 * i + 1]]).to_f32();
    let moe = match &m.weights.layers[1].feed_forward {
        FeedForwardWeights::Moe(moe) => moe,
        _ => panic!("MoE expected"),
    };
    // Zero copy: the per-expert matrices are views into one buffer (the mapped fused tensor), expert
    // e's gate at e·2I·D elements, its up I·D elements further.
    let ptr = |m: &Matrix| match &m.data {
        MatrixData::Dense { data, .. } => data.bytes().as_ptr() as usize,
        _ => panic!("bf16 expected"),
    };
    let base = ptr(&moe.experts[0].gate_proj);
    for e in 0..8 {
        assert_eq!(ptr(&moe.experts[e].gate_proj) - base, e * 128 * 128 * 2);
        assert_eq!(
            ptr(&moe.experts[e].up_proj) - base,
            (e * 128 + 64) * 128 * 2
        );
    }
    for e in [0usize, 3, 7] {
        let gate = moe.experts[e].gate_proj.to_f32();
        let up = moe.experts[e].up_proj.to_f32();
        for r in [0usize, 17, 63] {
            for c in [0usize, 50, 127] {
                assert_eq!(
                    gate[r * 128 + c],
                    bf((e * 128 + r) * 128 + c),
                    "gate e{e} r{r} c{c}"
                );
                assert_eq!(
                    up[r * 128 + c],
                    bf((e * 128 + 64 + r) * 128 + c),
                    "up e{e} r{r} c{c}"
                );
            }
        }
    }
}

/// Qwen3-Next: the loaded in_proj_qkv / z / b / a equal the per-key-head split of the stored
/// in_proj_qkvz / in_proj_ba, done here the way transformers does it (view [Hk, block], split).
#[test]
fn qwen3next_reordered_projections_equal_the_per_head_split() {
    let Some(m) = load("qwen3next") else { return };
    tiny_dims_ok(&m);
    assert_eq!(m.spec.family, Family::Qwen3Next);
    assert!(m.report.deltanet_interleaved);
    let raw = raw_tensors(&m.dir, "model.safetensors");
    let (d, hk, dk, dv, r) = (128usize, 2usize, 32usize, 32usize, 2usize);
    for layer in 0..3 {
        let (shape, qkvz) = &raw[&format!("model.layers.{layer}.linear_attn.in_proj_qkvz.weight")];
        assert_eq!(shape, &vec![2 * hk * dk + 2 * hk * r * dv, d]);
        let (_, ba) = &raw[&format!("model.layers.{layer}.linear_attn.in_proj_ba.weight")];
        // rows of key-head group g: [q dk | k dk | v r·dv | z r·dv]
        let block = 2 * dk + 2 * r * dv;
        let rows =
            |src: &[f32], start: usize, count: usize| src[start * d..(start + count) * d].to_vec();
        let (mut q, mut k, mut v, mut z) = (vec![], vec![], vec![], vec![]);
        let (mut b, mut a) = (vec![], vec![]);
        for g in 0..hk {
            q.extend(rows(qkvz, g * block, dk));
            k.extend(rows(qkvz, g * block + dk, dk));
            v.extend(rows(qkvz, g * block + 2 * dk, r * dv));
            z.extend(rows(qkvz, g * block + 2 * dk + r * dv, r * dv));
            b.extend(rows(ba, g * 2 * r, r));
            a.extend(rows(ba, g * 2 * r + r, r));
        }
        let qkv: Vec<f32> = [q, k, v].concat();
        match &m.weights.layers[layer].mixer {
            MixerWeights::DeltaNet(dn) => {
                assert_eq!(dn.in_proj_qkv.to_f32(), qkv, "layer {layer} qkv");
                assert_eq!(dn.in_proj_z.to_f32(), z, "layer {layer} z");
                assert_eq!(dn.in_proj_b.to_f32(), b, "layer {layer} b");
                assert_eq!(dn.in_proj_a.to_f32(), a, "layer {layer} a");
            }
            _ => panic!("layer {layer} is DeltaNet"),
        }
    }
}

#[test]
fn dense_loads() {
    let Some(m) = load("qwen35-dense") else {
        return;
    };
    tiny_dims_ok(&m);
    assert_eq!(
        m.spec.feed_forward,
        FeedForwardSpec::Dense { intermediate: 256 }
    );
    assert_eq!(m.report.expert_layout, None);
}

fn affine_bytes(m: &Matrix) -> (u32, usize, &[u8], &[u8], &[u8]) {
    match &m.data {
        MatrixData::Affine {
            bits,
            group_size,
            codes,
            scales,
            biases,
            ..
        } => (
            *bits,
            *group_size,
            codes.bytes(),
            scales.bytes(),
            biases.bytes(),
        ),
        _ => panic!("expected an affine matrix, found {}", m.format_name()),
    }
}

/// The MLX fixture is mlx-lm's conversion of cond-fused. Loaded, its dequantised matrices are within
/// quantisation error of cond-fused's bf16 ones, its norms (stored 1 + w) come back as w, and
/// quantising cond-fused's matrices with our rule reproduces MLX's codes, scales and biases exactly.
#[test]
fn mlx4_matches_cond_fused() {
    let (Some(mlx), Some(hf)) = (load("qwen35moe-mlx4"), load("qwen35moe-cond-fused")) else {
        return;
    };
    tiny_dims_ok(&mlx);
    let r = &mlx.report;
    assert_eq!(r.style, CheckpointStyle::Mlx);
    assert_eq!(r.expert_layout, Some(ExpertLayout::SwitchMlp));
    assert!(r.norms_stored_plus_one);
    assert!(r.stats.formats.contains_key("q4g64") && r.stats.formats.contains_key("q8g64"));

    let ours = common::matrices(&hf.weights);
    let theirs = common::matrices(&mlx.weights);
    assert_eq!(ours.len(), theirs.len());
    let mut exact = 0;
    for ((name, hf_m), (_, mlx_m)) in ours.iter().zip(&theirs) {
        let (bits, group, codes, scales, biases) = affine_bytes(mlx_m);
        let expected_bits = if name.ends_with("router") || name.ends_with("shared_expert_gate") {
            8
        } else {
            4
        };
        assert_eq!((bits, group), (expected_bits, 64), "{name}");
        // Within quantisation error of the bf16 original …
        let (w, deq) = (hf_m.to_f32(), mlx_m.to_f32());
        let n = ((1u32 << bits) - 1) as f32;
        for (g, (wg, dg)) in w.chunks(64).zip(deq.chunks(64)).enumerate() {
            let (lo, hi) = wg
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let step = (hi - lo) / n;
            let tol = step * 1.2 + (hi.abs().max(lo.abs())) * 2f32.powi(-7) + 1e-6;
            for (x, y) in wg.iter().zip(dg) {
                assert!(
                    (x - y).abs() <= tol,
                    "{name} group {g}: {x} vs {y} (tol {tol})"
                );
            }
        }
        // … and bit-identical to quantising it with MLX's rule.
        let requant = quantize_affine(hf_m, bits, 64);
        let (_, _, c2, s2, b2) = affine_bytes(&requant);
        assert!(
            codes == c2 && scales == s2 && biases == b2,
            "{name}: our quantisation differs from mlx-lm's"
        );
        exact += 1;
    }
    assert!(exact > 100, "compared {exact} matrices");

    // Norms: MLX stores bf16(1 + w); loaded as bf16(1 + w) - 1 ≈ w (HF's bf16 w).
    let (a, b) = (common::vectors(&hf.weights), common::vectors(&mlx.weights));
    for ((name, x, zero_centred), (_, y, _)) in a.iter().zip(&b) {
        for (p, q) in x.iter().zip(y.iter()) {
            let tol = if *zero_centred { 2f32.powi(-8) } else { 0.0 };
            assert!((p - q).abs() <= tol, "{name}: cond-fused {p} vs mlx {q}");
        }
    }
}

/// `--quant f32` on the MLX fixture gives dense f32 matrices equal to its dequantised values.
#[test]
fn mlx4_dequantises_to_f32() {
    let Some(dir) = fixture("qwen35moe-mlx4") else {
        return;
    };
    let plain = load_model(&dir, &LoadOptions::default()).unwrap();
    let f32_model = load_model(
        &dir,
        &LoadOptions {
            quant: Some(Quant::F32),
        },
    )
    .unwrap();
    for ((name, a), (_, b)) in common::matrices(&plain.weights)
        .iter()
        .zip(common::matrices(&f32_model.weights))
    {
        assert_eq!(b.format_name(), "f32", "{name}");
        assert_eq!(a.to_f32(), b.to_f32(), "{name}");
    }
}
