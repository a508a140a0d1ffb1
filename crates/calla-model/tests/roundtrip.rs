//! Every checkpoint style the loader accepts, written from known random weights and loaded back:
//! the canonical tree must come back value for value.

mod common;

use std::collections::BTreeMap;

use calla_model::config::{QuantParams, QuantizationBlock};
use calla_model::load::{load_model, LoadOptions, Quant};
use calla_model::synthetic::{preset, random_weights};
use calla_model::weights::assemble::ExpertLayout;
use calla_model::weights::export::{
    checkpoint_tensors, config_json, export_checkpoint, write_checkpoint, ExportOptions,
    OwnedTensor,
};
use calla_model::weights::names::CheckpointStyle;
use calla_model::{DType, Family, FeedForwardSpec, ModelSpec};
use common::{assert_same_weights, bf16_round};

fn tiny(family: Family) -> ModelSpec {
    let mut spec = preset("tiny").unwrap();
    spec.family = family;
    if family == Family::Qwen35Dense {
        spec.feed_forward = FeedForwardSpec::Dense { intermediate: 256 };
    }
    spec
}

/// The MLX quantisation block of a converted model: 4-bit everywhere, router and shared gate 8-bit.
fn mlx_block(spec: &ModelSpec) -> QuantizationBlock {
    let mut overrides = BTreeMap::new();
    for i in 0..spec.num_layers() {
        for module in ["mlp.gate", "mlp.shared_expert_gate"] {
            overrides.insert(
                format!("language_model.model.layers.{i}.{module}"),
                Some(QuantParams {
                    group_size: 64,
                    bits: 8,
                }),
            );
        }
    }
    QuantizationBlock {
        group_size: 64,
        bits: 4,
        mode: "affine".into(),
        overrides,
    }
}

#[test]
fn hf_causal_per_expert_f32() {
    let spec = tiny(Family::Qwen35Moe);
    let weights = random_weights(&spec, Quant::F32, 1);
    let dir = tempfile::tempdir().unwrap();
    export_checkpoint(
        dir.path(),
        &spec,
        &weights,
        &ExportOptions::hf_causal(),
        None,
    )
    .unwrap();
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(loaded.spec, spec);
    assert_same_weights(&weights, &loaded.weights, 0.0, 0.0);
    let r = &loaded.report;
    assert_eq!(r.style, CheckpointStyle::HfCausal);
    assert_eq!(r.expert_layout, Some(ExpertLayout::PerExpert));
    assert!(!r.norms_stored_plus_one && !r.deltanet_interleaved);
    assert!(r.ignored_names.is_empty());
    assert_eq!(r.stored_dtypes.keys().collect::<Vec<_>>(), vec!["f32"]);
    assert_eq!(
        loaded.generation,
        Default::default(),
        "no generation_config.json = all None"
    );
}

#[test]
fn hf_conditional_fused_bf16_sharded_with_vision_and_mtp() {
    let spec = tiny(Family::Qwen35Moe);
    let weights = random_weights(&spec, Quant::Bf16, 2);
    let dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        style: CheckpointStyle::HfConditional,
        experts: ExpertLayout::Fused,
        vector_dtype: DType::BF16,
        shard_bytes: Some(200_000),
        ..ExportOptions::hf_causal()
    };
    let mut tensors = checkpoint_tensors(&spec, &weights, &opts);
    let extra = |shape: Vec<usize>| OwnedTensor {
        dtype: safetensors::Dtype::BF16,
        data: vec![0u8; 2 * shape.iter().product::<usize>()],
        shape,
    };
    tensors.insert(
        "model.visual.patch_embed.proj.weight".into(),
        extra(vec![8, 3, 2, 2, 2]),
    );
    tensors.insert(
        "model.visual.merger.linear_fc1.weight".into(),
        extra(vec![4, 4]),
    );
    tensors.insert("mtp.fc.weight".into(), extra(vec![4, 8]));
    tensors.insert(
        "mtp.layers.0.mlp.experts.0.up_proj.weight".into(),
        extra(vec![4, 4]),
    );
    write_checkpoint(
        dir.path(),
        &config_json(&spec, true, None),
        &tensors,
        opts.shard_bytes,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"temperature": 1.0, "top_k": 20, "top_p": 0.95, "do_sample": true, "eos_token_id": [3, 1]}"#,
    )
    .unwrap();

    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert!(
        loaded.report.files.len() > 1,
        "sharded: {:?}",
        loaded.report.files
    );
    // vectors were written as bf16
    assert_same_weights(&weights, &loaded.weights, 0.0, 2f32.powi(-8));
    let r = &loaded.report;
    assert_eq!(r.style, CheckpointStyle::HfConditional);
    assert_eq!(r.expert_layout, Some(ExpertLayout::Fused));
    assert_eq!(r.ignored_counts.get("vision"), Some(&2));
    assert_eq!(r.ignored_counts.get("mtp"), Some(&2));
    // Per-expert matrices are views into the fused tensor: gate rows first, then up.
    assert_eq!(loaded.generation.top_k, Some(20));
    // generation_config.json's stop list wins.
    assert_eq!(loaded.spec.eos_token_ids, vec![3, 1]);
}

#[test]
fn mlx_4bit_switch_mlp_with_shifted_norms() {
    let spec = tiny(Family::Qwen35Moe);
    let weights = random_weights(&spec, Quant::Q4, 3);
    let dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        style: CheckpointStyle::Mlx,
        experts: ExpertLayout::SwitchMlp,
        mlx_conventions: true,
        vector_dtype: DType::BF16,
        ..ExportOptions::hf_causal()
    };
    let block = mlx_block(&spec);
    export_checkpoint(dir.path(), &spec, &weights, &opts, Some(&block)).unwrap();
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    let r = &loaded.report;
    assert_eq!(r.style, CheckpointStyle::Mlx);
    assert_eq!(r.expert_layout, Some(ExpertLayout::SwitchMlp));
    assert!(r.norms_stored_plus_one);
    assert_eq!(r.quantization.as_ref().map(|q| q.bits), Some(4));
    assert!(r.stats.formats.contains_key("q4g64") && r.stats.formats.contains_key("q8g64"));
    // Zero-centred norms were stored as bf16(1 + w): back to w within bf16 rounding of values near 1.
    // Other vectors: within bf16 rounding of their own value.
    assert_same_weights(&weights, &loaded.weights, 2f32.powi(-8), 2f32.powi(-8));
    let expected = bf16_round(1.0 + weights.final_norm[0]) - 1.0;
    assert_eq!(loaded.weights.final_norm[0], expected);
}

#[test]
fn qwen3_next_interleaved_projections_are_reordered() {
    let spec = tiny(Family::Qwen3Next);
    let weights = random_weights(&spec, Quant::F32, 4);
    let dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        interleave_deltanet: true,
        experts: ExpertLayout::Fused,
        ..ExportOptions::hf_causal()
    };
    export_checkpoint(dir.path(), &spec, &weights, &opts, None).unwrap();
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(text.contains("\"qwen3_next\""));
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert!(loaded.report.deltanet_interleaved);
    assert_same_weights(&weights, &loaded.weights, 0.0, 0.0);
}

#[test]
fn qwen35_dense_mlp() {
    let spec = tiny(Family::Qwen35Dense);
    let weights = random_weights(&spec, Quant::F32, 5);
    let dir = tempfile::tempdir().unwrap();
    // f16 vectors exercise the f16 read path.
    let opts = ExportOptions {
        vector_dtype: DType::F16,
        ..ExportOptions::hf_causal()
    };
    export_checkpoint(dir.path(), &spec, &weights, &opts, None).unwrap();
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(
        loaded.spec.feed_forward,
        FeedForwardSpec::Dense { intermediate: 256 }
    );
    assert_eq!(loaded.report.expert_layout, None);
    assert!(loaded.report.stored_dtypes.contains_key("f16"));
    assert_same_weights(&weights, &loaded.weights, 1e-7, 2f32.powi(-11));
}

#[test]
fn tied_embeddings_share_the_head() {
    let mut spec = tiny(Family::Qwen35Moe);
    spec.tie_word_embeddings = true;
    let weights = random_weights(&spec, Quant::F32, 6);
    let dir = tempfile::tempdir().unwrap();
    export_checkpoint(
        dir.path(),
        &spec,
        &weights,
        &ExportOptions::hf_causal(),
        None,
    )
    .unwrap();
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(
        loaded.weights.lm_head.to_f32(),
        loaded.weights.embed_tokens.to_f32()
    );
    assert_same_weights(&weights, &loaded.weights, 0.0, 0.0);
}

/// `--quant` at load: Q4 gives 4-bit matrices (8-bit router/shared gate) equal to quantising the
/// stored ones; F32 dequantises an MLX checkpoint; Bf16 rounds dense ones.
#[test]
fn load_time_conversion() {
    let spec = tiny(Family::Qwen35Moe);
    let weights = random_weights(&spec, Quant::F32, 7);
    let dir = tempfile::tempdir().unwrap();
    export_checkpoint(
        dir.path(),
        &spec,
        &weights,
        &ExportOptions::hf_causal(),
        None,
    )
    .unwrap();

    let q4 = load_model(
        dir.path(),
        &LoadOptions {
            quant: Some(Quant::Q4),
        },
    )
    .unwrap();
    let direct = random_weights(&spec, Quant::Q4, 7);
    assert_same_weights(&direct, &q4.weights, 0.0, 0.0);
    assert_eq!(q4.report.converted_to, Some(Quant::Q4));

    let q8 = load_model(
        dir.path(),
        &LoadOptions {
            quant: Some(Quant::Q8),
        },
    )
    .unwrap();
    assert!(common::matrices(&q8.weights)
        .iter()
        .all(|(_, m)| m.format_name() == "q8g64"));

    let bf = load_model(
        dir.path(),
        &LoadOptions {
            quant: Some(Quant::Bf16),
        },
    )
    .unwrap();
    let e = &bf.weights.embed_tokens;
    assert_eq!(e.format_name(), "bf16");
    let expect: Vec<f32> = weights
        .embed_tokens
        .to_f32()
        .iter()
        .map(|&v| bf16_round(v))
        .collect();
    assert_eq!(e.to_f32(), expect);

    // An MLX checkpoint loaded with --quant f32 is fully dense and equals the dequantised values.
    let mlx_weights = random_weights(&spec, Quant::Q4, 8);
    let mlx_dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        style: CheckpointStyle::Mlx,
        experts: ExpertLayout::SwitchMlp,
        mlx_conventions: true,
        ..ExportOptions::hf_causal()
    };
    export_checkpoint(
        mlx_dir.path(),
        &spec,
        &mlx_weights,
        &opts,
        Some(&mlx_block(&spec)),
    )
    .unwrap();
    let f32_loaded = load_model(
        mlx_dir.path(),
        &LoadOptions {
            quant: Some(Quant::F32),
        },
    )
    .unwrap();
    for ((name, a), (_, b)) in common::matrices(&mlx_weights)
        .iter()
        .zip(common::matrices(&f32_loaded.weights))
    {
        assert_eq!(b.format_name(), "f32", "{name}");
        assert_eq!(a.to_f32(), b.to_f32(), "{name}");
    }
    // Q4 keeps already-quantised matrices as they are.
    let kept = load_model(
        mlx_dir.path(),
        &LoadOptions {
            quant: Some(Quant::Q4),
        },
    )
    .unwrap();
    assert_same_weights(&mlx_weights, &kept.weights, 2f32.powi(-8), 0.0);
}

#[test]
fn bytes_per_token_counts_active_experts_only() {
    let spec = tiny(Family::Qwen35Moe);
    let weights = random_weights(&spec, Quant::F32, 9);
    let stats = calla_model::weights::stats::weight_stats(&spec, &weights);
    let expert_bytes = 3 * 64 * 128 * 4; // gate, up, down of one expert in f32
    let all_experts = spec.num_layers() * 8 * expert_bytes;
    let active_experts = spec.num_layers() * 2 * expert_bytes;
    assert_eq!(
        stats.bytes_per_token as usize,
        stats.total_bytes as usize - all_experts + active_experts
            - weights.embed_tokens.byte_size()
            + weights.embed_tokens.byte_size() / spec.vocab_size
    );
}
