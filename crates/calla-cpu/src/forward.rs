//! The model: embedding → layers (norm → DeltaNet | attention → residual → norm → MoE | MLP → residual)
//! → final norm → lm_head. Intermediates carry stable names, passed to an optional trace hook so that
//! dumps from the CPU engine, the GPU engine and the fixture script diff by name:
//! `embed`, per layer `attn_norm`, `deltanet_out` | `attn_out`, `ffn_norm`, `moe_out` | `mlp_out`, `l_out`,
//! then `result_norm`, `logits`.
//!
//! Legend: T tokens of this call, D hidden, V vocab.

use anyhow::{ensure, Result};
use calla_model::{LayerKind, MixerWeights, ModelSpec, Weights};

use crate::attention::{Attention, KvCache};
use crate::deltanet::{DeltaNet, DeltaNetState, Rule};
use crate::linear::Linear;
use crate::moe::FeedForward;
use crate::norm::rms_norm_zero_centred_into;
use crate::sequence::{CpuSequence, LayerState};

/// Sees every named intermediate: (name, layer or None, values `[T, ·]` row-major).
pub type Trace<'a> = &'a mut dyn FnMut(&str, Option<usize>, &[f32]);

/// Which logits a forward call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prompt chunk that is not the last).
    Skip,
    /// The last position's `[V]`.
    Last,
    /// Every position's `[T, V]` (tests).
    All,
}

enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

struct Layer {
    input_layernorm: Vec<f32>,
    post_attention_layernorm: Vec<f32>,
    mixer: Mixer,
    feed_forward: FeedForward,
}

pub struct Model {
    spec: ModelSpec,
    embed_tokens: Linear,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Linear,
}

fn check_len(name: &str, v: &[f32], want: usize) -> Result<()> {
    ensure!(
        v.len() == want,
        "{name}: {} values, expected {want}",
        v.len()
    );
    Ok(())
}

impl Model {
    pub fn new(spec: ModelSpec, w: &Weights) -> Result<Model> {
        let (d, v) = (spec.hidden_size, spec.vocab_size);
        ensure!(
            w.layers.len() == spec.num_layers(),
            "weights have {} layers, the config {}",
            w.layers.len(),
            spec.num_layers()
        );
        check_len("norm.weight", &w.final_norm, d)?;
        let layers = w
            .layers
            .iter()
            .zip(&spec.layers)
            .enumerate()
            .map(|(il, (lw, kind))| {
                check_len(
                    &format!("layers.{il}.input_layernorm.weight"),
                    &lw.input_layernorm,
                    d,
                )?;
                check_len(
                    &format!("layers.{il}.post_attention_layernorm.weight"),
                    &lw.post_attention_layernorm,
                    d,
                )?;
                let mixer = match (kind, &lw.mixer) {
                    (LayerKind::DeltaNet, MixerWeights::DeltaNet(m)) => {
                        Mixer::DeltaNet(DeltaNet::new(&spec, m, il)?)
                    }
                    (LayerKind::Attention, MixerWeights::Attention(m)) => {
                        Mixer::Attention(Attention::new(&spec, m, il)?)
                    }
                    _ => {
                        anyhow::bail!("layers.{il}: the config says {kind:?}, the weights disagree")
                    }
                };
                Ok(Layer {
                    input_layernorm: lw.input_layernorm.clone(),
                    post_attention_layernorm: lw.post_attention_layernorm.clone(),
                    mixer,
                    feed_forward: FeedForward::new(&spec, &lw.feed_forward, il)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            embed_tokens: Linear::new("embed_tokens", &w.embed_tokens, v, d)?,
            lm_head: Linear::new("lm_head", &w.lm_head, v, d)?,
            final_norm: w.final_norm.clone(),
            layers,
            spec,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// A fresh sequence state for this model.
    pub fn new_sequence(&self) -> CpuSequence {
        CpuSequence {
            position: 0,
            layers: self
                .spec
                .layers
                .iter()
                .map(|kind| match kind {
                    LayerKind::DeltaNet => LayerState::DeltaNet(DeltaNetState::new(&self.spec)),
                    LayerKind::Attention => LayerState::Attention(KvCache::default()),
                })
                .collect(),
        }
    }

    /// Run `tokens` (all `< V`, checked by the caller) at the sequence's position and advance it.
    /// DeltaNet layers use the recurrent rule for one token and the chunked rule for more.
    pub fn forward(
        &self,
        tokens: &[u32],
        seq: &mut CpuSequence,
        logits: Logits,
        mut trace: Option<Trace>,
    ) -> Vec<f32> {
        let (t, d) = (tokens.len(), self.spec.hidden_size);
        let eps = self.spec.rms_norm_eps;
        let rule = if t == 1 {
            Rule::Recurrent
        } else {
            Rule::Chunked
        };
        let mut emit = |name: &str, layer: Option<usize>, values: &[f32]| {
            if let Some(f) = trace.as_mut() {
                f(name, layer, values)
            }
        };

        let mut h = vec![0f32; t * d]; // [T, D] the residual stream
        for (row, tok) in h.chunks_exact_mut(d).zip(tokens) {
            self.embed_tokens.decode_row(*tok as usize, row);
        }
        emit("embed", None, &h);
        let mut normed = vec![0f32; t * d];
        let mut branch = vec![0f32; t * d];
        for (il, (layer, state)) in self.layers.iter().zip(&mut seq.layers).enumerate() {
            rms_norm_zero_centred_into(&h, &layer.input_layernorm, eps, &mut normed);
            emit("attn_norm", Some(il), &normed);
            match (&layer.mixer, state) {
                (Mixer::DeltaNet(m), LayerState::DeltaNet(s)) => {
                    m.forward(&normed, t, s, rule, &mut branch);
                    emit("deltanet_out", Some(il), &branch);
                }
                (Mixer::Attention(m), LayerState::Attention(cache)) => {
                    m.forward(&normed, t, cache, &mut branch);
                    emit("attn_out", Some(il), &branch);
                }
                _ => unreachable!("sequence states are built from the same layer list"),
            }
            add(&mut h, &branch);
            rms_norm_zero_centred_into(&h, &layer.post_attention_layernorm, eps, &mut normed);
            emit("ffn_norm", Some(il), &normed);
            layer.feed_forward.forward(&normed, t, &mut branch);
            let ffn_name = match layer.feed_forward {
                FeedForward::Moe(_) => "moe_out",
                FeedForward::Dense(_) => "mlp_out",
            };
            emit(ffn_name, Some(il), &branch);
            add(&mut h, &branch);
            emit("l_out", Some(il), &h);
        }
        seq.position += t;

        let rows = match logits {
            Logits::Skip => return Vec::new(),
            Logits::Last => &h[(t - 1) * d..],
            Logits::All => &h[..],
        };
        let n = rows.len() / d;
        let mut result_norm = vec![0f32; n * d];
        rms_norm_zero_centred_into(rows, &self.final_norm, eps, &mut result_norm);
        emit("result_norm", None, &result_norm);
        let mut out = vec![0f32; n * self.spec.vocab_size]; // [n, V]
        self.lm_head.matmul(&result_norm, n, &mut out);
        emit("logits", None, &out);
        out
    }
}

fn add(h: &mut [f32], x: &[f32]) {
    for (a, b) in h.iter_mut().zip(x) {
        *a += b;
    }
}
