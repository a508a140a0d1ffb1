//! Tests of config.rs: real config shapes parse to the expected spec; every inconsistency gives an
//! error naming the field and the value.

use super::*;
use serde_json::json;

/// The Qwen3.6-35B-A3B MLX wrapper config (mlx-community/Qwen3.6-35B-A3B-4bit's config.json), trimmed to the keys a parser reads.
fn qwen36_wrapper() -> serde_json::Value {
    let layer_types: Vec<&str> = (0..40)
        .map(|i| {
            if i % 4 == 3 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "eos_token_id": [248046, 248044],
        "image_token_id": 248056,
        "quantization": {
            "group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8}
        },
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "attn_output_gate": true, "full_attention_interval": 4, "head_dim": 256,
            "hidden_act": "silu", "hidden_size": 2048, "layer_types": layer_types,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "moe_intermediate_size": 512,
            "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
            "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                                "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
            "vocab_size": 248320, "eos_token_id": 248044
        }
    })
}

fn spec_of(v: &serde_json::Value) -> Result<ModelSpec, ConfigError> {
    ModelConfig::from_json(v)?.to_spec()
}

fn expect_error(v: &serde_json::Value, field: &str, value: &str) -> ConfigError {
    let err = spec_of(v).expect_err("config should be rejected");
    assert_eq!(err.field, field, "error: {err}");
    assert_eq!(err.value, value, "error: {err}");
    let msg = err.to_string();
    assert!(
        msg.contains(field) && msg.contains(value),
        "message `{msg}` names field and value"
    );
    err
}

#[test]
fn qwen36_wrapper_gives_the_real_dims() {
    let config = ModelConfig::from_json(&qwen36_wrapper()).unwrap();
    assert!(config.is_wrapper);
    let spec = config.to_spec().unwrap();
    assert_eq!(spec.family, Family::Qwen35Moe);
    assert_eq!(
        (spec.vocab_size, spec.hidden_size, spec.num_layers()),
        (248320, 2048, 40)
    );
    assert_eq!(
        (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim
        ),
        (16, 2, 256)
    );
    assert_eq!((spec.rotary_dim, spec.rope_theta), (64, 1e7));
    assert_eq!(
        (spec.linear_num_key_heads, spec.linear_num_value_heads),
        (16, 32)
    );
    assert_eq!(spec.linear_conv_dim(), 8192);
    assert_eq!(spec.q_proj_rows(), 8192);
    assert_eq!(spec.num_attention_layers(), 10);
    for (i, kind) in spec.layers.iter().enumerate() {
        assert_eq!(*kind == LayerKind::Attention, i % 4 == 3, "layer {i}");
    }
    assert_eq!(
        spec.feed_forward,
        FeedForwardSpec::Moe {
            num_experts: 256,
            top_k: 8,
            expert_intermediate: 512,
            shared_intermediate: 512,
            norm_topk_prob: true
        }
    );
    // The top-level list wins over text_config's scalar.
    assert_eq!(spec.eos_token_ids, vec![248046, 248044]);
    assert_eq!(spec.max_position_embeddings, 262144);
    assert!(!spec.tie_word_embeddings);

    let q = config.quantization.unwrap();
    assert_eq!((q.bits, q.group_size, q.mode.as_str()), (4, 64, "affine"));
    let router = q
        .params_for("language_model.model.layers.0.mlp.gate")
        .unwrap();
    assert_eq!((router.bits, router.group_size), (8, 64));
    let other = q
        .params_for("language_model.model.layers.0.mlp.switch_mlp.up_proj")
        .unwrap();
    assert_eq!(other.bits, 4);
}

#[test]
fn flat_text_config_derives_layers_from_interval_and_uses_class_defaults() {
    let v = json!({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 8, "full_attention_interval": 4,
                   "eos_token_id": 248046});
    let config = ModelConfig::from_json(&v).unwrap();
    assert!(!config.is_wrapper);
    let spec = config.to_spec().unwrap();
    assert_eq!(spec.num_layers(), 8);
    assert_eq!(spec.layers[3], LayerKind::Attention);
    assert_eq!(spec.layers[7], LayerKind::Attention);
    assert_eq!(spec.num_attention_layers(), 2);
    // Qwen3_5MoeTextConfig defaults
    assert_eq!(
        (spec.hidden_size, spec.vocab_size, spec.head_dim),
        (2048, 248320, 256)
    );
    assert_eq!(spec.max_position_embeddings, 32768);
    assert_eq!(spec.rope_theta, 10000.0);
    assert_eq!(spec.rotary_dim, 64);
    assert_eq!(spec.eos_token_ids, vec![248046]);
}

#[test]
fn qwen3_next_defaults_and_router_flag() {
    let v = json!({"model_type": "qwen3_next", "num_hidden_layers": 4, "norm_topk_prob": false,
                   "rope_theta": 5000000.0, "partial_rotary_factor": 0.5});
    let spec = spec_of(&v).unwrap();
    assert_eq!(spec.family, Family::Qwen3Next);
    assert_eq!(spec.vocab_size, 151936);
    // legacy top-level rope keys are read when rope_parameters is absent
    assert_eq!((spec.rope_theta, spec.rotary_dim), (5e6, 128));
    match spec.feed_forward {
        FeedForwardSpec::Moe {
            num_experts,
            top_k,
            norm_topk_prob,
            ..
        } => {
            assert_eq!((num_experts, top_k, norm_topk_prob), (512, 10, false))
        }
        _ => panic!("qwen3_next is MoE"),
    }
}

#[test]
fn dense_wrapper_and_legacy_layer_names() {
    let v = json!({"model_type": "qwen3_5", "eos_token_id": [1, 2], "tie_word_embeddings": true,
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 2, "intermediate_size": 256,
                        "layer_types": ["mamba", "attention"], "eos_token_id": 3}});
    let spec = spec_of(&v).unwrap();
    assert_eq!(spec.family, Family::Qwen35Dense);
    assert_eq!(
        spec.feed_forward,
        FeedForwardSpec::Dense { intermediate: 256 }
    );
    assert_eq!(spec.layers, vec![LayerKind::DeltaNet, LayerKind::Attention]);
    assert_eq!(spec.eos_token_ids, vec![1, 2]);
    assert!(spec.tie_word_embeddings);
}

#[test]
fn rejects_unknown_model_type() {
    let mut v = qwen36_wrapper();
    v["model_type"] = json!("llama");
    let err = expect_error(&v, "model_type", "\"llama\"");
    assert!(
        err.problem.contains("qwen3_5_moe"),
        "lists supported types: {err}"
    );
    let err = spec_of(&json!({"hidden_size": 3})).unwrap_err();
    assert_eq!(err.field, "model_type");
}

#[test]
fn rejects_missing_text_config() {
    let v = json!({"model_type": "qwen3_5_moe"});
    expect_error(&v, "text_config", "<missing>");
}

#[test]
fn rejects_heads_not_dividing() {
    let mut v = qwen36_wrapper();
    v["text_config"]["num_key_value_heads"] = json!(3);
    expect_error(&v, "text_config.num_key_value_heads", "3");
}

#[test]
fn rejects_layer_types_length_mismatch() {
    let mut v = qwen36_wrapper();
    v["text_config"]["num_hidden_layers"] = json!(39);
    expect_error(&v, "text_config.layer_types", "<list of 40>");
}

#[test]
fn rejects_unknown_layer_type() {
    let mut v = qwen36_wrapper();
    v["text_config"]["layer_types"][5] = json!("sliding_attention");
    expect_error(&v, "text_config.layer_types[5]", "\"sliding_attention\"");
}

#[test]
fn rejects_odd_rotary_dims() {
    let mut v = qwen36_wrapper();
    v["text_config"]["head_dim"] = json!(36);
    v["text_config"]["rope_parameters"]["partial_rotary_factor"] = json!(0.25); // 9 dims
    v["text_config"]["rope_parameters"]["mrope_section"] = json!(null);
    expect_error(
        &v,
        "text_config.rope_parameters.partial_rotary_factor",
        "0.25",
    );
}

#[test]
fn rejects_mrope_section_not_matching_rotary_dims() {
    let mut v = qwen36_wrapper();
    v["text_config"]["rope_parameters"]["mrope_section"] = json!([2, 1, 1]);
    expect_error(&v, "text_config.rope_parameters.mrope_section", "[2, 1, 1]");
}

#[test]
fn rejects_value_heads_not_a_multiple_of_key_heads() {
    let mut v = qwen36_wrapper();
    v["text_config"]["linear_num_value_heads"] = json!(24);
    v["text_config"]["linear_num_key_heads"] = json!(16);
    expect_error(&v, "text_config.linear_num_value_heads", "24");
}

#[test]
fn rejects_top_k_above_num_experts() {
    let mut v = qwen36_wrapper();
    v["text_config"]["num_experts_per_tok"] = json!(300);
    expect_error(&v, "text_config.num_experts_per_tok", "300");
}

#[test]
fn rejects_unsupported_quantisation() {
    let mut v = qwen36_wrapper();
    v["quantization"]["bits"] = json!(3);
    let err = ModelConfig::from_json(&v).unwrap_err();
    assert_eq!(
        (err.field.as_str(), err.value.as_str()),
        ("quantization.bits", "3")
    );

    let mut v = qwen36_wrapper();
    v["quantization"]["language_model.model.layers.0.mlp.gate"]["group_size"] = json!(16);
    let err = ModelConfig::from_json(&v).unwrap_err();
    assert_eq!(
        err.field,
        "quantization.language_model.model.layers.0.mlp.gate.group_size"
    );
    assert_eq!(err.value, "16");

    let mut v = qwen36_wrapper();
    v["quantization"]["mode"] = json!("mxfp4");
    let err = ModelConfig::from_json(&v).unwrap_err();
    assert_eq!(
        (err.field.as_str(), err.value.as_str()),
        ("quantization.mode", "\"mxfp4\"")
    );
}

#[test]
fn quantisation_override_false_means_unquantised() {
    let mut v = qwen36_wrapper();
    v["quantization"]["language_model.lm_head"] = json!(false);
    let q = ModelConfig::from_json(&v).unwrap().quantization.unwrap();
    assert_eq!(q.params_for("language_model.lm_head"), None);
}

#[test]
fn type_errors_name_the_json_path_and_value() {
    let mut v = qwen36_wrapper();
    v["text_config"]["hidden_size"] = json!("big");
    let err = ModelConfig::from_json(&v).unwrap_err();
    assert_eq!(err.field, "text_config.hidden_size");
    assert_eq!(err.value, "\"big\"");
}

#[test]
fn rejects_unsupported_activation_and_rope_type() {
    let mut v = qwen36_wrapper();
    v["text_config"]["hidden_act"] = json!("gelu");
    expect_error(&v, "text_config.hidden_act", "\"gelu\"");
    let mut v = qwen36_wrapper();
    v["text_config"]["rope_parameters"]["rope_type"] = json!("yarn");
    expect_error(&v, "text_config.rope_parameters.rope_type", "\"yarn\"");
}

#[test]
fn rejects_mismatched_inner_model_type() {
    let mut v = qwen36_wrapper();
    v["text_config"]["model_type"] = json!("qwen3_5_text");
    expect_error(&v, "text_config.model_type", "\"qwen3_5_text\"");
}

#[test]
fn rejects_zero_sizes() {
    let mut v = qwen36_wrapper();
    v["text_config"]["hidden_size"] = json!(0);
    expect_error(&v, "text_config.hidden_size", "0");
}

/// Absurd sizes are refused before anything is allocated by them (issue 33 defect 7, 11).
#[test]
fn rejects_absurd_sizes_before_allocating() {
    for (key, value, shown) in [
        ("num_hidden_layers", json!(1_000_000_000u64), "1000000000"),
        ("hidden_size", json!(1u64 << 40), "1099511627776"),
        ("vocab_size", json!(1u64 << 40), "1099511627776"),
        ("num_experts", json!(1_000_000), "1000000"),
        ("max_position_embeddings", json!(0), "0"),
        (
            "max_position_embeddings",
            json!(i64::MAX),
            "9223372036854775807",
        ),
        ("rms_norm_eps", json!(1e308), "1e308"),
    ] {
        let mut v = qwen36_wrapper();
        v["text_config"][key] = value;
        if key == "num_hidden_layers" {
            v["text_config"]
                .as_object_mut()
                .unwrap()
                .remove("layer_types");
        }
        let started = std::time::Instant::now();
        let err = spec_of(&v).expect_err(key);
        assert_eq!(err.field, format!("text_config.{key}"), "{err}");
        assert_eq!(err.value, shown, "{err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "{key}"
        );
    }
}
