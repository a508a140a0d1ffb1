//! Helpers shared by the integration tests: comparing weight trees, building test checkpoints.
#![allow(dead_code)]

use calla_model::weights::{FeedForwardWeights, MixerWeights, MlpWeights, Weights};
use calla_model::Matrix;

/// Every (name, matrix) of a tree, in a fixed order.
pub fn matrices(w: &Weights) -> Vec<(String, &Matrix)> {
    let mut out = vec![
        ("embed_tokens".to_string(), &w.embed_tokens),
        ("lm_head".to_string(), &w.lm_head),
    ];
    fn mlp<'a>(out: &mut Vec<(String, &'a Matrix)>, p: String, m: &'a MlpWeights) {
        out.push((format!("{p}.gate_proj"), &m.gate_proj));
        out.push((format!("{p}.up_proj"), &m.up_proj));
        out.push((format!("{p}.down_proj"), &m.down_proj));
    }
    for (i, layer) in w.layers.iter().enumerate() {
        match &layer.mixer {
            MixerWeights::DeltaNet(dn) => {
                for (n, m) in [
                    ("in_proj_qkv", &dn.in_proj_qkv),
                    ("in_proj_z", &dn.in_proj_z),
                    ("in_proj_b", &dn.in_proj_b),
                    ("in_proj_a", &dn.in_proj_a),
                    ("out_proj", &dn.out_proj),
                ] {
                    out.push((format!("layers.{i}.{n}"), m));
                }
            }
            MixerWeights::Attention(at) => {
                for (n, m) in [
                    ("q_proj", &at.q_proj),
                    ("k_proj", &at.k_proj),
                    ("v_proj", &at.v_proj),
                    ("o_proj", &at.o_proj),
                ] {
                    out.push((format!("layers.{i}.{n}"), m));
                }
            }
        }
        match &layer.feed_forward {
            FeedForwardWeights::Dense(m) => mlp(&mut out, format!("layers.{i}.mlp"), m),
            FeedForwardWeights::Moe(moe) => {
                out.push((format!("layers.{i}.router"), &moe.router));
                for (e, x) in moe.experts.iter().enumerate() {
                    mlp(&mut out, format!("layers.{i}.experts.{e}"), x);
                }
                if let Some(s) = &moe.shared_expert {
                    mlp(&mut out, format!("layers.{i}.shared_expert"), s);
                }
                if let Some(g) = &moe.shared_expert_gate {
                    out.push((format!("layers.{i}.shared_expert_gate"), g));
                }
            }
        }
    }
    out
}

/// Every (name, vector) of a tree, with a flag: true for zero-centred norms.
pub fn vectors(w: &Weights) -> Vec<(String, &[f32], bool)> {
    let mut out: Vec<(String, &[f32], bool)> = vec![("final_norm".into(), &w.final_norm, true)];
    for (i, layer) in w.layers.iter().enumerate() {
        out.push((
            format!("layers.{i}.input_layernorm"),
            &layer.input_layernorm,
            true,
        ));
        out.push((
            format!("layers.{i}.post_attention_layernorm"),
            &layer.post_attention_layernorm,
            true,
        ));
        match &layer.mixer {
            MixerWeights::DeltaNet(dn) => {
                out.push((format!("layers.{i}.conv1d"), &dn.conv1d, false));
                out.push((format!("layers.{i}.A_log"), &dn.a_log, false));
                out.push((format!("layers.{i}.dt_bias"), &dn.dt_bias, false));
                out.push((format!("layers.{i}.gated_norm"), &dn.norm, false));
            }
            MixerWeights::Attention(at) => {
                out.push((format!("layers.{i}.q_norm"), &at.q_norm, true));
                out.push((format!("layers.{i}.k_norm"), &at.k_norm, true));
            }
        }
    }
    out
}

/// Assert two trees hold the same values: matrices exactly (same format and values), vectors within
/// `abs_tol + rel_tol·|expected|`.
pub fn assert_same_weights(expected: &Weights, got: &Weights, abs_tol: f32, rel_tol: f32) {
    let (a, b) = (matrices(expected), matrices(got));
    assert_eq!(a.len(), b.len(), "matrix count");
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "{name} shape");
        assert_eq!(x.format_name(), y.format_name(), "{name} format");
        assert!(x.to_f32() == y.to_f32(), "{name} values differ");
    }
    let (a, b) = (vectors(expected), vectors(got));
    for ((name, x, _), (_, y, _)) in a.iter().zip(&b) {
        assert_eq!(x.len(), y.len(), "{name} length");
        for (j, (p, q)) in x.iter().zip(y.iter()).enumerate() {
            let tol = abs_tol + rel_tol * p.abs();
            assert!(
                (p - q).abs() <= tol,
                "{name}[{j}]: expected {p}, got {q} (tolerance {tol})"
            );
        }
    }
}

/// Round `v` through bf16 (what a bf16 checkpoint stores).
pub fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}
