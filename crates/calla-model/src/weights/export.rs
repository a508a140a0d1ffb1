//! Writing a [`Weights`] tree as a checkpoint directory in any supported style: the inverse of the
//! loader, used to build test checkpoints (every layout the loader accepts, plus broken ones) and tiny
//! models for other crates' tests without Python.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;
use serde_json::json;

use crate::config::QuantizationBlock;
use crate::matrix::{DType, Matrix, MatrixData};
use crate::spec::{Family, FeedForwardSpec, LayerKind, ModelSpec};
use crate::weights::assemble::ExpertLayout;
use crate::weights::names::CheckpointStyle;
use crate::weights::qwen3next::{fuse_interleaved, SplitProjections};
use crate::weights::{FeedForwardWeights, MixerWeights, MlpWeights, Weights};

#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub style: CheckpointStyle,
    pub experts: ExpertLayout,
    /// Write DeltaNet projections in Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba`.
    pub interleave_deltanet: bool,
    /// Write conv weights as MLX `[C, K, 1]` and zero-centred norms as `1 + w` (what mlx-lm writes).
    pub mlx_conventions: bool,
    /// dtype of the 1-D tensors and conv weights
    pub vector_dtype: DType,
    /// Split into shards of at most this many bytes with an index.json (None = one model.safetensors).
    pub shard_bytes: Option<usize>,
}

impl ExportOptions {
    pub fn hf_causal() -> Self {
        ExportOptions {
            style: CheckpointStyle::HfCausal,
            experts: ExpertLayout::PerExpert,
            interleave_deltanet: false,
            mlx_conventions: false,
            vector_dtype: DType::F32,
            shard_bytes: None,
        }
    }
}

/// One tensor to write.
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

fn vector_tensor(values: &[f32], dtype: DType, shape: Vec<usize>) -> OwnedTensor {
    let m = crate::quant::to_dense(&Matrix::dense_f32(1, values.len(), values), dtype);
    let data = match &m.data {
        MatrixData::Dense { data, .. } => data.bytes().to_vec(),
        MatrixData::Affine { .. } => unreachable!("to_dense returns a dense matrix"),
    };
    OwnedTensor {
        dtype: st_dtype(dtype),
        shape,
        data,
    }
}

/// Adds the tensors of matrix `m` (`lead` = stacking dims) under module `path`; `weight_name`
/// overrides `{path}.weight` (fused experts have no suffix).
fn add_matrix(
    out: &mut BTreeMap<String, OwnedTensor>,
    path: &str,
    weight_name: Option<&str>,
    lead: &[usize],
    m: &Matrix,
) {
    let rows = m.rows / lead.iter().product::<usize>().max(1);
    let shape = |tail: usize| -> Vec<usize> { lead.iter().copied().chain([rows, tail]).collect() };
    let weight = weight_name
        .map(str::to_string)
        .unwrap_or_else(|| format!("{path}.weight"));
    match &m.data {
        MatrixData::Dense { dtype, data } => {
            out.insert(
                weight,
                OwnedTensor {
                    dtype: st_dtype(*dtype),
                    shape: shape(m.cols),
                    data: data.bytes().to_vec(),
                },
            );
        }
        MatrixData::Affine {
            bits,
            group_size,
            codes,
            scales,
            biases,
            param_dtype,
        } => {
            let packed = m.cols * *bits as usize / 32;
            out.insert(
                weight,
                OwnedTensor {
                    dtype: Dtype::U32,
                    shape: shape(packed),
                    data: codes.bytes().to_vec(),
                },
            );
            let groups = m.cols / group_size;
            for (suffix, blob) in [("scales", scales), ("biases", biases)] {
                out.insert(
                    format!("{path}.{suffix}"),
                    OwnedTensor {
                        dtype: st_dtype(*param_dtype),
                        shape: shape(groups),
                        data: blob.bytes().to_vec(),
                    },
                );
            }
        }
    }
}

fn add_mlp(out: &mut BTreeMap<String, OwnedTensor>, prefix: &str, mlp: &MlpWeights) {
    add_matrix(
        out,
        &format!("{prefix}.gate_proj"),
        None,
        &[],
        &mlp.gate_proj,
    );
    add_matrix(out, &format!("{prefix}.up_proj"), None, &[], &mlp.up_proj);
    add_matrix(
        out,
        &format!("{prefix}.down_proj"),
        None,
        &[],
        &mlp.down_proj,
    );
}

/// The checkpoint's tensors by name.
pub fn checkpoint_tensors(
    spec: &ModelSpec,
    weights: &Weights,
    opts: &ExportOptions,
) -> BTreeMap<String, OwnedTensor> {
    let mut out = BTreeMap::new();
    let style = opts.style;
    let vd = opts.vector_dtype;
    let zero_centred = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|x| if opts.mlx_conventions { x + 1.0 } else { *x })
            .collect()
    };
    let vector = |out: &mut BTreeMap<String, OwnedTensor>, name: String, v: &[f32]| {
        out.insert(name, vector_tensor(v, vd, vec![v.len()]));
    };
    add_matrix(
        &mut out,
        &style.decoder("embed_tokens"),
        None,
        &[],
        &weights.embed_tokens,
    );
    vector(
        &mut out,
        style.decoder("norm.weight"),
        &zero_centred(&weights.final_norm),
    );
    if !spec.tie_word_embeddings {
        add_matrix(&mut out, style.lm_head(), None, &[], &weights.lm_head);
    }
    for (i, layer) in weights.layers.iter().enumerate() {
        let p = |m: &str| style.layer(i, m);
        vector(
            &mut out,
            p("input_layernorm.weight"),
            &zero_centred(&layer.input_layernorm),
        );
        vector(
            &mut out,
            p("post_attention_layernorm.weight"),
            &zero_centred(&layer.post_attention_layernorm),
        );
        match &layer.mixer {
            MixerWeights::DeltaNet(dn) => {
                if opts.interleave_deltanet {
                    let split = SplitProjections {
                        in_proj_qkv: dn.in_proj_qkv.clone(),
                        in_proj_z: dn.in_proj_z.clone(),
                        in_proj_b: dn.in_proj_b.clone(),
                        in_proj_a: dn.in_proj_a.clone(),
                    };
                    let (qkvz, ba) = fuse_interleaved(spec, &split);
                    add_matrix(&mut out, &p("linear_attn.in_proj_qkvz"), None, &[], &qkvz);
                    add_matrix(&mut out, &p("linear_attn.in_proj_ba"), None, &[], &ba);
                } else {
                    add_matrix(
                        &mut out,
                        &p("linear_attn.in_proj_qkv"),
                        None,
                        &[],
                        &dn.in_proj_qkv,
                    );
                    add_matrix(
                        &mut out,
                        &p("linear_attn.in_proj_z"),
                        None,
                        &[],
                        &dn.in_proj_z,
                    );
                    add_matrix(
                        &mut out,
                        &p("linear_attn.in_proj_b"),
                        None,
                        &[],
                        &dn.in_proj_b,
                    );
                    add_matrix(
                        &mut out,
                        &p("linear_attn.in_proj_a"),
                        None,
                        &[],
                        &dn.in_proj_a,
                    );
                }
                add_matrix(
                    &mut out,
                    &p("linear_attn.out_proj"),
                    None,
                    &[],
                    &dn.out_proj,
                );
                let (c, k) = (spec.linear_conv_dim(), spec.linear_conv_kernel_dim);
                let conv_shape = if opts.mlx_conventions {
                    vec![c, k, 1]
                } else {
                    vec![c, 1, k]
                };
                out.insert(
                    p("linear_attn.conv1d.weight"),
                    vector_tensor(&dn.conv1d, vd, conv_shape),
                );
                vector(&mut out, p("linear_attn.A_log"), &dn.a_log);
                vector(&mut out, p("linear_attn.dt_bias"), &dn.dt_bias);
                vector(&mut out, p("linear_attn.norm.weight"), &dn.norm);
            }
            MixerWeights::Attention(at) => {
                for (name, m) in [
                    ("q_proj", &at.q_proj),
                    ("k_proj", &at.k_proj),
                    ("v_proj", &at.v_proj),
                    ("o_proj", &at.o_proj),
                ] {
                    add_matrix(&mut out, &p(&format!("self_attn.{name}")), None, &[], m);
                }
                vector(
                    &mut out,
                    p("self_attn.q_norm.weight"),
                    &zero_centred(&at.q_norm),
                );
                vector(
                    &mut out,
                    p("self_attn.k_norm.weight"),
                    &zero_centred(&at.k_norm),
                );
            }
        }
        match &layer.feed_forward {
            FeedForwardWeights::Dense(mlp) => add_mlp(&mut out, &p("mlp"), mlp),
            FeedForwardWeights::Moe(moe) => {
                add_matrix(&mut out, &p("mlp.gate"), None, &[], &moe.router);
                if let Some(shared) = &moe.shared_expert {
                    add_mlp(&mut out, &p("mlp.shared_expert"), shared);
                }
                if let Some(gate) = &moe.shared_expert_gate {
                    add_matrix(&mut out, &p("mlp.shared_expert_gate"), None, &[], gate);
                }
                let e = moe.experts.len();
                // The experts' `which` projections (0 gate, 1 up, 2 down), row-stacked.
                let stack = |which: &[usize]| -> Matrix {
                    let parts: Vec<&Matrix> = moe
                        .experts
                        .iter()
                        .flat_map(|x| {
                            which
                                .iter()
                                .map(move |&w| [&x.gate_proj, &x.up_proj, &x.down_proj][w])
                        })
                        .collect();
                    Matrix::concat_rows(&parts)
                };
                match opts.experts {
                    ExpertLayout::PerExpert => {
                        for (x, expert) in moe.experts.iter().enumerate() {
                            add_mlp(&mut out, &p(&format!("mlp.experts.{x}")), expert);
                        }
                    }
                    ExpertLayout::Fused => {
                        // gate_up_proj [E, 2I, D]: per expert, gate rows then up rows
                        let (gu, dn) = (p("mlp.experts.gate_up_proj"), p("mlp.experts.down_proj"));
                        add_matrix(&mut out, &gu, Some(&gu), &[e], &stack(&[0, 1]));
                        add_matrix(&mut out, &dn, Some(&dn), &[e], &stack(&[2]));
                    }
                    ExpertLayout::SwitchMlp => {
                        for (w, name) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
                            add_matrix(
                                &mut out,
                                &p(&format!("mlp.switch_mlp.{name}")),
                                None,
                                &[e],
                                &stack(&[w]),
                            );
                        }
                    }
                }
            }
        }
    }
    out
}

/// config.json for `spec`: the VL wrapper (`text_config` nested, stop list and quantisation block at
/// the top level) or the flat text config.
pub fn config_json(
    spec: &ModelSpec,
    wrapper: bool,
    quantization: Option<&QuantizationBlock>,
) -> serde_json::Value {
    let layer_types: Vec<&str> = spec
        .layers
        .iter()
        .map(|k| match k {
            LayerKind::Attention => "full_attention",
            LayerKind::DeltaNet => "linear_attention",
        })
        .collect();
    let (text_type, wrapper_type, arch) = match spec.family {
        Family::Qwen35Moe => ("qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5Moe"),
        Family::Qwen35Dense => ("qwen3_5_text", "qwen3_5", "Qwen3_5"),
        Family::Qwen3Next => ("qwen3_next", "qwen3_next", "Qwen3Next"),
    };
    let mut text = json!({
        "model_type": text_type,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers(), "layer_types": layer_types,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "rms_norm_eps": spec.rms_norm_eps as f64,
        "attn_output_gate": spec.attn_output_gate,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "partial_rotary_factor": spec.rotary_dim as f64 / spec.head_dim as f64},
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_key_head_dim": spec.linear_key_head_dim, "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads, "linear_num_value_heads": spec.linear_num_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "eos_token_id": spec.eos_token_ids,
    });
    match spec.feed_forward {
        FeedForwardSpec::Dense { intermediate } => text["intermediate_size"] = json!(intermediate),
        FeedForwardSpec::Moe {
            num_experts,
            top_k,
            expert_intermediate,
            shared_intermediate,
            norm_topk_prob,
        } => {
            text["num_experts"] = json!(num_experts);
            text["num_experts_per_tok"] = json!(top_k);
            text["moe_intermediate_size"] = json!(expert_intermediate);
            text["shared_expert_intermediate_size"] = json!(shared_intermediate);
            text["norm_topk_prob"] = json!(norm_topk_prob);
        }
    }
    let mut root = if wrapper && spec.family != Family::Qwen3Next {
        json!({
            "architectures": [format!("{arch}ForConditionalGeneration")],
            "model_type": wrapper_type,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "eos_token_id": spec.eos_token_ids,
            "text_config": text,
        })
    } else {
        text["architectures"] = json!([format!("{arch}ForCausalLM")]);
        text
    };
    if let Some(q) = quantization {
        let mut block = json!({"group_size": q.group_size, "bits": q.bits, "mode": q.mode});
        for (path, params) in &q.overrides {
            block[path] = match params {
                Some(p) => json!({"group_size": p.group_size, "bits": p.bits}),
                None => json!(false),
            };
        }
        root["quantization_config"] = block.clone();
        root["quantization"] = block;
    }
    root
}

/// Write `tensors` (plus config.json) into `dir`: one model.safetensors, or shards + index.json.
pub fn write_checkpoint(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &BTreeMap<String, OwnedTensor>,
    shard_bytes: Option<usize>,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(config)?)?;
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut current = 0;
    for (name, t) in tensors {
        if let Some(limit) = shard_bytes {
            if current > 0 && current + t.data.len() > limit {
                shards.push(Vec::new());
                current = 0;
            }
        }
        current += t.data.len();
        shards.last_mut().expect("non-empty").push(name);
    }
    let single = shard_bytes.is_none();
    let mut weight_map = serde_json::Map::new();
    for (s, names) in shards.iter().enumerate() {
        let file = if single {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards.len())
        };
        let mut views = Vec::with_capacity(names.len());
        for name in names {
            let t = &tensors[*name];
            let view =
                StView::new(t.dtype, t.shape.clone(), &t.data).map_err(std::io::Error::other)?;
            views.push(((*name).clone(), view));
            weight_map.insert((*name).clone(), json!(file));
        }
        safetensors::serialize_to_file(views, None, &dir.join(&file))
            .map_err(std::io::Error::other)?;
    }
    if !single {
        let index = json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_vec_pretty(&index)?,
        )?;
    }
    Ok(())
}

/// Convenience: config + tensors of `weights` in the style of `opts`.
pub fn export_checkpoint(
    dir: &Path,
    spec: &ModelSpec,
    weights: &Weights,
    opts: &ExportOptions,
    quantization: Option<&QuantizationBlock>,
) -> std::io::Result<()> {
    let wrapper = opts.style != CheckpointStyle::HfCausal;
    let config = config_json(spec, wrapper, quantization);
    write_checkpoint(
        dir,
        &config,
        &checkpoint_tensors(spec, weights, opts),
        opts.shard_bytes,
    )
}
