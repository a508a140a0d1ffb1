//! Checkpoint tensors → the canonical [`Weights`] tree (conventions in weights.rs).
//!
//! One table per block says which stored module feeds which canonical field; the style (names.rs)
//! supplies the prefix, the store tells which expert layout and which DeltaNet projection layout are
//! present. Dense matrices stay views into the memory map; only Qwen3-Next's interleaved projections
//! (a row gather) and the small f32 vectors are copied.

use crate::config::QuantizationBlock;
use crate::error::LoadError;
use crate::matrix::Matrix;
use crate::spec::{FeedForwardSpec, LayerKind, ModelSpec};
use crate::weights::names::{ignore_category, CheckpointStyle};
use crate::weights::qwen3next::{split_interleaved, SplitProjections};
use crate::weights::read::{ConvLayout, ModuleReader};
use crate::weights::store::TensorStore;
use crate::weights::{
    AttentionWeights, DeltaNetWeights, FeedForwardWeights, LayerWeights, MixerWeights, MlpWeights,
    MoeWeights, Weights,
};

/// How the experts of a layer were stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ExpertLayout {
    /// HF in-memory / hub layout: `experts.gate_up_proj [E, 2I, D]` (gate rows first), `experts.down_proj [E, D, I]`
    Fused,
    /// `save_pretrained`: `experts.{e}.{gate,up,down}_proj.weight`
    PerExpert,
    /// MLX: `switch_mlp.{gate,up,down}_proj.{weight,scales,biases}` with a leading `[E]` axis
    SwitchMlp,
}

/// What assembling found out about the checkpoint (goes into the load report).
#[derive(Debug, Clone, serde::Serialize)]
pub struct AssembleInfo {
    pub style: CheckpointStyle,
    pub expert_layout: Option<ExpertLayout>,
    /// Norms were stored as 1 + w (MLX) and had 1 subtracted.
    pub norms_stored_plus_one: bool,
    /// DeltaNet projections came interleaved (Qwen3-Next) and were reordered.
    pub deltanet_interleaved: bool,
    /// (category, tensor name) of every tensor ignored by rule, in name order.
    pub ignored: Vec<(String, String)>,
}

pub fn assemble(
    store: &TensorStore,
    spec: &ModelSpec,
    quant: Option<&QuantizationBlock>,
) -> Result<(Weights, AssembleInfo), LoadError> {
    let style = CheckpointStyle::detect(store)?;
    let reader = ModuleReader { store, quant };
    let d = spec.hidden_size;

    // Norm convention: MLX conversions store zero-centred norms as 1 + w. mlx-lm's sanitize shifts
    // them exactly when it moves the conv axis to [C, K, 1], so the conv layout is the decisive signal;
    // the naming style decides only when the conv says nothing (K = 1).
    let mut conv_layouts = Vec::new();
    let mut layers = Vec::with_capacity(spec.num_layers());
    let mut expert_layout = None;
    let mut deltanet_interleaved = false;
    for (i, kind) in spec.layers.iter().enumerate() {
        let path = |module: &str| style.layer(i, module);
        let mixer = match kind {
            LayerKind::DeltaNet => {
                let (weights, layout, interleaved) = deltanet(&reader, spec, &path)?;
                conv_layouts.push((path("linear_attn.conv1d.weight"), layout));
                deltanet_interleaved |= interleaved;
                MixerWeights::DeltaNet(weights)
            }
            LayerKind::Attention => MixerWeights::Attention(attention(&reader, spec, &path)?),
        };
        let (feed_forward, layout) = feed_forward(&reader, spec, &path)?;
        if let Some(layout) = layout {
            expert_layout = Some(layout);
        }
        layers.push(LayerWeights {
            input_layernorm: reader.vector(&path("input_layernorm.weight"), d)?,
            post_attention_layernorm: reader.vector(&path("post_attention_layernorm.weight"), d)?,
            mixer,
            feed_forward,
        });
    }
    let norms_stored_plus_one = decide_norm_convention(store, style, &conv_layouts)?;

    let embed_tokens = reader.linear(&style.decoder("embed_tokens"), spec.vocab_size, d)?;
    let final_norm = reader.vector(&style.decoder("norm.weight"), d)?;
    let lm_head_path = style.lm_head();
    let lm_head = if spec.tie_word_embeddings {
        embed_tokens.clone()
    } else {
        reader.linear(lm_head_path, spec.vocab_size, d)?
    };

    let mut weights = Weights {
        embed_tokens,
        layers,
        final_norm,
        lm_head,
    };
    if norms_stored_plus_one {
        subtract_one_from_zero_centred_norms(&mut weights);
    }

    // Everything else must be on the ignore list (or a tied head that was written anyway).
    let mut ignored = Vec::new();
    for name in store.unconsumed() {
        if let Some(category) = ignore_category(&name) {
            ignored.push((category.to_string(), name));
        } else if spec.tie_word_embeddings && name.starts_with(&format!("{lm_head_path}.")) {
            ignored.push(("tied lm_head".to_string(), name));
        }
    }
    for (_, name) in &ignored {
        store.mark_consumed(name);
    }
    let leftovers = store.unconsumed();
    if !leftovers.is_empty() {
        const SHOWN: usize = 20;
        let mut names = leftovers
            .iter()
            .take(SHOWN)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        if leftovers.len() > SHOWN {
            names.push_str(&format!(", … ({} more)", leftovers.len() - SHOWN));
        }
        return Err(LoadError::Unconsumed {
            count: leftovers.len(),
            names,
        });
    }
    Ok((
        weights,
        AssembleInfo {
            style,
            expert_layout,
            norms_stored_plus_one,
            deltanet_interleaved,
            ignored,
        },
    ))
}

fn deltanet(
    reader: &ModuleReader,
    spec: &ModelSpec,
    path: &dyn Fn(&str) -> String,
) -> Result<(DeltaNetWeights, ConvLayout, bool), LoadError> {
    let d = spec.hidden_size;
    let hv = spec.linear_num_value_heads;
    let (conv_dim, value_dim) = (spec.linear_conv_dim(), spec.linear_value_dim());
    let interleaved = reader
        .store
        .contains(&format!("{}.weight", path("linear_attn.in_proj_qkvz")));
    let projections = if interleaved {
        // Qwen3-Next: fused per key head, reordered into the canonical layout.
        let qkvz = reader.linear(&path("linear_attn.in_proj_qkvz"), conv_dim + value_dim, d)?;
        let ba = reader.linear(&path("linear_attn.in_proj_ba"), 2 * hv, d)?;
        split_interleaved(spec, &qkvz, &ba)
    } else {
        SplitProjections {
            in_proj_qkv: reader.linear(&path("linear_attn.in_proj_qkv"), conv_dim, d)?,
            in_proj_z: reader.linear(&path("linear_attn.in_proj_z"), value_dim, d)?,
            in_proj_b: reader.linear(&path("linear_attn.in_proj_b"), hv, d)?,
            in_proj_a: reader.linear(&path("linear_attn.in_proj_a"), hv, d)?,
        }
    };
    let (conv1d, layout) = reader.conv(
        &path("linear_attn.conv1d.weight"),
        conv_dim,
        spec.linear_conv_kernel_dim,
    )?;
    let weights = DeltaNetWeights {
        in_proj_qkv: projections.in_proj_qkv,
        in_proj_z: projections.in_proj_z,
        in_proj_b: projections.in_proj_b,
        in_proj_a: projections.in_proj_a,
        conv1d,
        a_log: reader.vector(&path("linear_attn.A_log"), hv)?,
        dt_bias: reader.vector(&path("linear_attn.dt_bias"), hv)?,
        norm: reader.vector(&path("linear_attn.norm.weight"), spec.linear_value_head_dim)?,
        out_proj: reader.linear(&path("linear_attn.out_proj"), d, value_dim)?,
    };
    Ok((weights, layout, interleaved))
}

fn attention(
    reader: &ModuleReader,
    spec: &ModelSpec,
    path: &dyn Fn(&str) -> String,
) -> Result<AttentionWeights, LoadError> {
    let d = spec.hidden_size;
    Ok(AttentionWeights {
        q_proj: reader.linear(&path("self_attn.q_proj"), spec.q_proj_rows(), d)?,
        k_proj: reader.linear(&path("self_attn.k_proj"), spec.kv_dim(), d)?,
        v_proj: reader.linear(&path("self_attn.v_proj"), spec.kv_dim(), d)?,
        o_proj: reader.linear(
            &path("self_attn.o_proj"),
            d,
            spec.num_attention_heads * spec.head_dim,
        )?,
        q_norm: reader.vector(&path("self_attn.q_norm.weight"), spec.head_dim)?,
        k_norm: reader.vector(&path("self_attn.k_norm.weight"), spec.head_dim)?,
    })
}

fn mlp(reader: &ModuleReader, prefix: &str, d: usize, i: usize) -> Result<MlpWeights, LoadError> {
    Ok(MlpWeights {
        gate_proj: reader.linear(&format!("{prefix}.gate_proj"), i, d)?,
        up_proj: reader.linear(&format!("{prefix}.up_proj"), i, d)?,
        down_proj: reader.linear(&format!("{prefix}.down_proj"), d, i)?,
    })
}

fn feed_forward(
    reader: &ModuleReader,
    spec: &ModelSpec,
    path: &dyn Fn(&str) -> String,
) -> Result<(FeedForwardWeights, Option<ExpertLayout>), LoadError> {
    let d = spec.hidden_size;
    let (num_experts, expert_intermediate, shared_intermediate) = match spec.feed_forward {
        FeedForwardSpec::Dense { intermediate } => {
            return Ok((
                FeedForwardWeights::Dense(mlp(reader, &path("mlp"), d, intermediate)?),
                None,
            ))
        }
        FeedForwardSpec::Moe {
            num_experts,
            expert_intermediate,
            shared_intermediate,
            ..
        } => (num_experts, expert_intermediate, shared_intermediate),
    };
    let (e, i) = (num_experts, expert_intermediate);
    let store = reader.store;
    let layout = if store.contains(&path("mlp.experts.gate_up_proj")) {
        ExpertLayout::Fused
    } else if store.contains(&format!("{}.weight", path("mlp.switch_mlp.gate_proj"))) {
        ExpertLayout::SwitchMlp
    } else {
        // Per-expert; a missing expert 0 is reported by the first read below.
        ExpertLayout::PerExpert
    };
    let experts = match layout {
        ExpertLayout::Fused => {
            let gate_up_name = path("mlp.experts.gate_up_proj");
            let down_name = path("mlp.experts.down_proj");
            let gate_up = reader.stacked(&gate_up_name, &gate_up_name, e, 2 * i, d)?;
            let down = reader.stacked(&down_name, &down_name, e, d, i)?;
            (0..e)
                .map(|x| MlpWeights {
                    // expert x occupies rows [x·2I, (x+1)·2I): gate first, then up
                    gate_proj: gate_up.rows_view(x * 2 * i, i),
                    up_proj: gate_up.rows_view(x * 2 * i + i, i),
                    down_proj: down.rows_view(x * d, d),
                })
                .collect()
        }
        ExpertLayout::SwitchMlp => {
            let stacked = |proj: &str, rows: usize, cols: usize| -> Result<Matrix, LoadError> {
                let module = path(&format!("mlp.switch_mlp.{proj}"));
                reader.stacked(&module, &format!("{module}.weight"), e, rows, cols)
            };
            let gate = stacked("gate_proj", i, d)?;
            let up = stacked("up_proj", i, d)?;
            let down = stacked("down_proj", d, i)?;
            (0..e)
                .map(|x| MlpWeights {
                    gate_proj: gate.rows_view(x * i, i),
                    up_proj: up.rows_view(x * i, i),
                    down_proj: down.rows_view(x * d, d),
                })
                .collect()
        }
        ExpertLayout::PerExpert => (0..e)
            .map(|x| mlp(reader, &path(&format!("mlp.experts.{x}")), d, i))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let (shared_expert, shared_expert_gate) = if shared_intermediate > 0 {
        (
            Some(mlp(
                reader,
                &path("mlp.shared_expert"),
                d,
                shared_intermediate,
            )?),
            Some(reader.linear(&path("mlp.shared_expert_gate"), 1, d)?),
        )
    } else {
        (None, None)
    };
    let moe = MoeWeights {
        router: reader.linear(&path("mlp.gate"), e, d)?,
        experts,
        shared_expert,
        shared_expert_gate,
    };
    Ok((FeedForwardWeights::Moe(moe), Some(layout)))
}

fn decide_norm_convention(
    store: &TensorStore,
    style: CheckpointStyle,
    conv_layouts: &[(String, ConvLayout)],
) -> Result<bool, LoadError> {
    let mlx = conv_layouts.iter().find(|(_, l)| *l == ConvLayout::Mlx);
    let hf = conv_layouts.iter().find(|(_, l)| *l == ConvLayout::Hf);
    match (mlx, hf) {
        (Some((a, _)), Some((b, _))) => Err(LoadError::Inconsistent {
            path: store.dir.clone(),
            detail: format!(
                "conv weights in both layouts: `{a}` is MLX [C, K, 1] but `{b}` is HF [C, 1, K]"
            ),
        }),
        (Some(_), None) => Ok(true),
        (None, Some(_)) => Ok(false),
        (None, None) => Ok(style == CheckpointStyle::Mlx),
    }
}

fn subtract_one_from_zero_centred_norms(weights: &mut Weights) {
    let shift = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x -= 1.0);
    shift(&mut weights.final_norm);
    for layer in &mut weights.layers {
        shift(&mut layer.input_layernorm);
        shift(&mut layer.post_attention_layernorm);
        if let MixerWeights::Attention(attn) = &mut layer.mixer {
            shift(&mut attn.q_norm);
            shift(&mut attn.k_norm);
        }
        // The DeltaNet gated norm is a plain gain in every format: untouched.
    }
}
