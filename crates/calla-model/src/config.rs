//! config.json → [`ModelSpec`].
//!
//! Accepted shapes (the published Qwen3.5/3.6 and Qwen3-Next config.json files):
//! - VL wrapper: `model_type` `qwen3_5_moe` / `qwen3_5`, hyperparameters under `text_config`;
//! - flat text configs: `qwen3_5_moe_text`, `qwen3_5_text` (what `save_pretrained` of a CausalLM writes);
//! - `qwen3_next` (flat).
//!
//! The serde structs mirror the JSON names; a missing key takes the default of the transformers class
//! for that model type (`configuration_qwen3_5_moe.py`, `configuration_qwen3_5.py`,
//! `configuration_qwen3_next.py`). The stop list and the MLX `quantization` block are read from the
//! TOP level even when the hyperparameters sit under `text_config` (as mlx-lm writes it).
//! Every validation error names the field (a JSON path) and the value found.

use serde::Deserialize;

use crate::spec::{Family, FeedForwardSpec, LayerKind, ModelSpec};

mod defaults;
mod quantization;

pub use defaults::FamilyDefaults;
pub use quantization::{
    QuantOverride, QuantParams, QuantizationBlock, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES,
};

/// A problem with one field of config.json.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("field `{field}` = {value}: {problem}")]
pub struct ConfigError {
    /// JSON path, e.g. `text_config.num_key_value_heads`.
    pub field: String,
    /// The offending value as written in the JSON (or `<missing>`).
    pub value: String,
    pub problem: String,
}

pub(crate) fn config_error(
    field: impl Into<String>,
    value: impl ToString,
    problem: impl Into<String>,
) -> ConfigError {
    ConfigError {
        field: field.into(),
        value: value.to_string(),
        problem: problem.into(),
    }
}

/// `eos_token_id` is a scalar in some configs and a list in others.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_parameters` (transformers ≥ 5) or the legacy `rope_scaling`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RopeParameters {
    pub rope_type: Option<String>,
    /// transformers < 4.40 wrote `type`
    #[serde(rename = "type")]
    pub legacy_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub mrope_section: Option<Vec<usize>>,
    pub mrope_interleaved: Option<bool>,
}

/// The text model's hyperparameters, named as in config.json. `None` = key absent: the family's
/// transformers default applies (see [`FamilyDefaults`]).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TextConfig {
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_act: Option<String>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub attn_output_gate: Option<bool>,
    pub rope_parameters: Option<RopeParameters>,
    pub rope_scaling: Option<RopeParameters>,
    pub rope_theta: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub linear_conv_kernel_dim: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub num_experts: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub layer_types: Option<Vec<String>>,
    pub full_attention_interval: Option<usize>,
    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<u32>,
}

/// The model types this crate understands, and whether they are the VL wrapper.
fn classify_model_type(model_type: &str) -> Option<(Family, bool)> {
    match model_type {
        "qwen3_5_moe" => Some((Family::Qwen35Moe, true)),
        "qwen3_5" => Some((Family::Qwen35Dense, true)),
        "qwen3_5_moe_text" => Some((Family::Qwen35Moe, false)),
        "qwen3_5_text" => Some((Family::Qwen35Dense, false)),
        "qwen3_next" => Some((Family::Qwen3Next, false)),
        _ => None,
    }
}

pub const SUPPORTED_MODEL_TYPES: &str =
    "qwen3_5_moe, qwen3_5, qwen3_5_moe_text, qwen3_5_text, qwen3_next";

/// A parsed config.json: the text config plus what lives at the top level of a wrapper.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: Family,
    /// The top-level `model_type`.
    pub model_type: String,
    pub architectures: Vec<String>,
    /// True when the hyperparameters were under `text_config` (VL wrapper).
    pub is_wrapper: bool,
    pub text: TextConfig,
    /// Top-level `eos_token_id` (wins over text_config's).
    pub top_level_eos: Option<TokenIds>,
    /// Top-level `tie_word_embeddings` of a wrapper.
    pub top_level_tie_word_embeddings: Option<bool>,
    /// The MLX `quantization` block (or `quantization_config` when only that one is present).
    pub quantization: Option<QuantizationBlock>,
}

impl ModelConfig {
    /// Parse config.json text. Type errors name the JSON path of the field.
    pub fn from_json_str(json: &str) -> Result<Self, ConfigError> {
        let root: serde_json::Value = serde_json::from_str(json).map_err(|e| {
            config_error(
                "<config.json>",
                "<unparsable>",
                format!("invalid JSON: {e}"),
            )
        })?;
        Self::from_json(&root)
    }

    pub fn from_json(root: &serde_json::Value) -> Result<Self, ConfigError> {
        let obj = root
            .as_object()
            .ok_or_else(|| config_error("<root>", short(root), "expected a JSON object"))?;
        let model_type_value = obj
            .get("model_type")
            .ok_or_else(|| config_error("model_type", "<missing>", "required"))?;
        let model_type = model_type_value
            .as_str()
            .ok_or_else(|| config_error("model_type", model_type_value, "expected a string"))?
            .to_string();
        let (family, is_wrapper) = classify_model_type(&model_type).ok_or_else(|| {
            config_error(
                "model_type",
                format!("{model_type:?}"),
                format!("unsupported model type (supported: {SUPPORTED_MODEL_TYPES})"),
            )
        })?;
        let (text_value, text_path) = if is_wrapper {
            let t = obj.get("text_config").ok_or_else(|| {
                config_error("text_config", "<missing>", "required by the VL wrapper")
            })?;
            (t, "text_config.")
        } else {
            (root, "")
        };
        let text: TextConfig = serde_path_to_error::deserialize(text_value).map_err(|e| {
            let found = value_at(text_value, e.path())
                .map(short)
                .unwrap_or_else(|| "?".into());
            config_error(
                format!("{text_path}{}", e.path()),
                found,
                e.inner().to_string(),
            )
        })?;
        if is_wrapper {
            if let Some(inner) = &text.model_type {
                let expected = match family {
                    Family::Qwen35Moe => "qwen3_5_moe_text",
                    _ => "qwen3_5_text",
                };
                if inner != expected && inner != &model_type {
                    return Err(config_error(
                        "text_config.model_type",
                        format!("{inner:?}"),
                        format!("does not match the wrapper model_type {model_type:?} (expected {expected:?})"),
                    ));
                }
            }
        }
        let top_level_eos = match obj.get("eos_token_id") {
            Some(v) if is_wrapper && !v.is_null() => {
                Some(serde_json::from_value(v.clone()).map_err(|_| {
                    config_error(
                        "eos_token_id",
                        v,
                        "expected an integer or a list of integers",
                    )
                })?)
            }
            _ => None,
        };
        let top_level_tie_word_embeddings = match obj.get("tie_word_embeddings") {
            Some(v) if is_wrapper => Some(
                v.as_bool()
                    .ok_or_else(|| config_error("tie_word_embeddings", v, "expected a boolean"))?,
            ),
            _ => None,
        };
        let quantization =
            match (obj.get("quantization"), obj.get("quantization_config")) {
                (Some(q), _) => Some(QuantizationBlock::from_json(q, "quantization")?),
                // Non-MLX quantisation configs (FP8, GPTQ, …) carry `quant_method`: not supported.
                (None, Some(q)) if q.get("quant_method").is_some() => return Err(config_error(
                    "quantization_config.quant_method",
                    q.get("quant_method").map(short).unwrap_or_default(),
                    "unsupported quantisation method (only MLX affine checkpoints are supported)",
                )),
                (None, Some(q)) => Some(QuantizationBlock::from_json(q, "quantization_config")?),
                (None, None) => None,
            };
        let architectures = obj
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        Ok(ModelConfig {
            family,
            model_type,
            architectures,
            is_wrapper,
            text,
            top_level_eos,
            top_level_tie_word_embeddings,
            quantization,
        })
    }

    fn text_field(&self, name: &str) -> String {
        if self.is_wrapper {
            format!("text_config.{name}")
        } else {
            name.to_string()
        }
    }

    /// Layer kinds: `layer_types` when present, else from `full_attention_interval` (default 4):
    /// layer i is full attention iff (i+1) % interval == 0.
    pub fn layer_types(&self) -> Result<Vec<LayerKind>, ConfigError> {
        let num_layers = self.num_hidden_layers();
        match &self.text.layer_types {
            Some(types) => {
                if types.len() != num_layers {
                    return Err(config_error(
                        self.text_field("layer_types"),
                        format!("<list of {}>", types.len()),
                        format!("length must equal num_hidden_layers = {num_layers}"),
                    ));
                }
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        // transformers' remap_legacy_layer_types: "attention" / "mamba"
                        "full_attention" | "attention" => Ok(LayerKind::Attention),
                        "linear_attention" | "mamba" => Ok(LayerKind::DeltaNet),
                        other => Err(config_error(
                            format!("{}[{i}]", self.text_field("layer_types")),
                            format!("{other:?}"),
                            "unknown layer type (expected \"linear_attention\" or \"full_attention\")",
                        )),
                    })
                    .collect()
            }
            None => {
                let interval = self.text.full_attention_interval.unwrap_or(4);
                if interval == 0 {
                    return Err(config_error(
                        self.text_field("full_attention_interval"),
                        0,
                        "must be at least 1",
                    ));
                }
                Ok((0..num_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::Attention
                        } else {
                            LayerKind::DeltaNet
                        }
                    })
                    .collect())
            }
        }
    }

    pub fn defaults(&self) -> FamilyDefaults {
        FamilyDefaults::of(self.family)
    }
    pub fn num_hidden_layers(&self) -> usize {
        self.text
            .num_hidden_layers
            .unwrap_or(self.defaults().num_hidden_layers)
    }

    /// The rope parameters in force: `rope_parameters` first, then the legacy top-level keys.
    /// Returns (rope_theta, partial_rotary_factor, rope_type, mrope_section).
    pub fn rope(&self) -> (f64, f64, Option<String>, Option<Vec<usize>>) {
        let params = self
            .text
            .rope_parameters
            .clone()
            .or_else(|| self.text.rope_scaling.clone())
            .unwrap_or_default();
        let theta = params
            .rope_theta
            .or(self.text.rope_theta)
            .unwrap_or(10000.0);
        let factor = params
            .partial_rotary_factor
            .or(self.text.partial_rotary_factor)
            .unwrap_or(0.25);
        let rope_type = params.rope_type.or(params.legacy_type);
        (theta, factor, rope_type, params.mrope_section)
    }

    /// Stop tokens: the top-level list wins over text_config's (usually scalar) value.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.top_level_eos
            .as_ref()
            .or(self.text.eos_token_id.as_ref())
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    pub fn tie_word_embeddings(&self) -> bool {
        self.top_level_tie_word_embeddings
            .or(self.text.tie_word_embeddings)
            .unwrap_or(false)
    }

    /// Validate and resolve into a [`ModelSpec`].
    pub fn to_spec(&self) -> Result<ModelSpec, ConfigError> {
        let t = &self.text;
        let d = self.defaults();
        let f = |name: &str| self.text_field(name);
        // Every dimension is bounded before anything is sized by it: a value far past any real
        // model (`num_hidden_layers: 1000000000`) is an error, not a 1.4 TB allocation.
        let positive = |name: &str, value: usize| -> Result<usize, ConfigError> {
            let max = limits::max_of(name);
            if value == 0 {
                Err(config_error(f(name), 0, "must be positive"))
            } else if value > max {
                Err(config_error(
                    f(name),
                    value,
                    format!("is implausibly large (calla accepts at most {max})"),
                ))
            } else {
                Ok(value)
            }
        };

        let vocab_size = positive("vocab_size", t.vocab_size.unwrap_or(d.vocab_size))?;
        let hidden_size = positive("hidden_size", t.hidden_size.unwrap_or(d.hidden_size))?;
        positive("num_hidden_layers", self.num_hidden_layers())?;
        let layers = self.layer_types()?;

        if let Some(act) = &t.hidden_act {
            if act != "silu" {
                return Err(config_error(
                    f("hidden_act"),
                    format!("{act:?}"),
                    "only \"silu\" is supported",
                ));
            }
        }
        if t.attention_bias == Some(true) {
            return Err(config_error(
                f("attention_bias"),
                true,
                "attention biases are not supported",
            ));
        }

        // Attention.
        let num_attention_heads = positive(
            "num_attention_heads",
            t.num_attention_heads.unwrap_or(d.num_attention_heads),
        )?;
        let num_key_value_heads = positive(
            "num_key_value_heads",
            t.num_key_value_heads.unwrap_or(d.num_key_value_heads),
        )?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(config_error(
                f("num_key_value_heads"),
                num_key_value_heads,
                format!("must divide num_attention_heads = {num_attention_heads}"),
            ));
        }
        let head_dim = positive("head_dim", t.head_dim.unwrap_or(256))?;
        let (rope_theta, partial_rotary_factor, rope_type, mrope_section) = self.rope();
        if let Some(rt) = &rope_type {
            if rt != "default" && rt != "mrope" {
                return Err(config_error(
                    f("rope_parameters.rope_type"),
                    format!("{rt:?}"),
                    "only the default rope is supported",
                ));
            }
        }
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(config_error(
                f("rope_parameters.rope_theta"),
                rope_theta,
                "must be positive",
            ));
        }
        let rotary_exact = head_dim as f64 * partial_rotary_factor;
        let rotary_dim = rotary_exact.round() as usize;
        if !(0.0..=1.0).contains(&partial_rotary_factor)
            || (rotary_exact - rotary_dim as f64).abs() > 1e-9
            || rotary_dim % 2 != 0
            || rotary_dim == 0
        {
            return Err(config_error(
                f("rope_parameters.partial_rotary_factor"),
                partial_rotary_factor,
                format!(
                    "head_dim {head_dim} × factor must give a positive even number of rotary dims (got {rotary_exact})"
                ),
            ));
        }
        if let Some(section) = &mrope_section {
            let sum: usize = section.iter().sum();
            if 2 * sum != rotary_dim {
                return Err(config_error(
                    f("rope_parameters.mrope_section"),
                    format!("{section:?}"),
                    format!("must sum to rotary_dim/2 = {}", rotary_dim / 2),
                ));
            }
        }
        let attn_output_gate = t.attn_output_gate.unwrap_or(true);

        // Gated DeltaNet.
        let linear_num_key_heads =
            positive("linear_num_key_heads", t.linear_num_key_heads.unwrap_or(16))?;
        let linear_num_value_heads = positive(
            "linear_num_value_heads",
            t.linear_num_value_heads.unwrap_or(32),
        )?;
        if linear_num_value_heads % linear_num_key_heads != 0 {
            return Err(config_error(
                f("linear_num_value_heads"),
                linear_num_value_heads,
                format!("must be a multiple of linear_num_key_heads = {linear_num_key_heads}"),
            ));
        }
        let linear_key_head_dim =
            positive("linear_key_head_dim", t.linear_key_head_dim.unwrap_or(128))?;
        let linear_value_head_dim = positive(
            "linear_value_head_dim",
            t.linear_value_head_dim.unwrap_or(128),
        )?;
        let linear_conv_kernel_dim = positive(
            "linear_conv_kernel_dim",
            t.linear_conv_kernel_dim.unwrap_or(4),
        )?;

        // Feed-forward.
        let feed_forward = match self.family {
            Family::Qwen35Dense => FeedForwardSpec::Dense {
                intermediate: positive(
                    "intermediate_size",
                    t.intermediate_size.unwrap_or(d.intermediate_size),
                )?,
            },
            Family::Qwen35Moe | Family::Qwen3Next => {
                if self.family == Family::Qwen3Next {
                    if let Some(step) = t.decoder_sparse_step {
                        if step != 1 {
                            return Err(config_error(
                                f("decoder_sparse_step"),
                                step,
                                "only MoE in every layer (1) is supported",
                            ));
                        }
                    }
                    if let Some(layers) = &t.mlp_only_layers {
                        if !layers.is_empty() {
                            return Err(config_error(
                                f("mlp_only_layers"),
                                format!("{layers:?}"),
                                "dense-MLP layers inside a MoE model are not supported",
                            ));
                        }
                    }
                }
                let num_experts = positive("num_experts", t.num_experts.unwrap_or(d.num_experts))?;
                let top_k = positive(
                    "num_experts_per_tok",
                    t.num_experts_per_tok.unwrap_or(d.num_experts_per_tok),
                )?;
                if top_k > num_experts {
                    return Err(config_error(
                        f("num_experts_per_tok"),
                        top_k,
                        format!("exceeds num_experts = {num_experts}"),
                    ));
                }
                FeedForwardSpec::Moe {
                    num_experts,
                    top_k,
                    expert_intermediate: positive(
                        "moe_intermediate_size",
                        t.moe_intermediate_size.unwrap_or(512),
                    )?,
                    shared_intermediate: t.shared_expert_intermediate_size.unwrap_or(512),
                    // qwen3_5_moe renormalises unconditionally; qwen3_next follows its flag.
                    norm_topk_prob: match self.family {
                        Family::Qwen3Next => t.norm_topk_prob.unwrap_or(true),
                        _ => true,
                    },
                }
            }
        };

        let rms_norm_eps = t.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite()
            && rms_norm_eps > 0.0
            && rms_norm_eps <= limits::MAX_RMS_NORM_EPS)
        {
            return Err(config_error(
                f("rms_norm_eps"),
                format!("{rms_norm_eps:?}"),
                format!("must be positive and at most {}", limits::MAX_RMS_NORM_EPS),
            ));
        }
        if let FeedForwardSpec::Moe {
            shared_intermediate,
            ..
        } = &feed_forward
        {
            if *shared_intermediate > limits::max_of("shared_expert_intermediate_size") {
                return Err(config_error(
                    f("shared_expert_intermediate_size"),
                    shared_intermediate,
                    "is implausibly large",
                ));
            }
        }
        let max_position_embeddings = t.max_position_embeddings.unwrap_or(32768);
        if !(2..=limits::MAX_POSITIONS).contains(&max_position_embeddings) {
            return Err(config_error(
                f("max_position_embeddings"),
                max_position_embeddings,
                format!("must be between 2 and {}", limits::MAX_POSITIONS),
            ));
        }
        if !(rope_theta <= limits::MAX_ROPE_THETA) {
            return Err(config_error(
                f("rope_parameters.rope_theta"),
                rope_theta,
                "is implausibly large",
            ));
        }
        let eos_token_ids = self.eos_token_ids();
        if let Some(bad) = eos_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(config_error(
                "eos_token_id",
                bad,
                format!("outside the vocabulary (vocab_size {vocab_size})"),
            ));
        }

        Ok(ModelSpec {
            family: self.family,
            vocab_size,
            hidden_size,
            layers,
            rms_norm_eps: rms_norm_eps as f32,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
            linear_conv_kernel_dim,
            feed_forward,
            tie_word_embeddings: self.tie_word_embeddings(),
            max_position_embeddings,
            eos_token_ids,
        })
    }
}

/// Upper bounds on config values: far above every model of the family (Qwen3.5-397B has 60 layers,
/// hidden 4096, 512 experts, 262,144 positions), far below what would exhaust memory.
pub mod limits {
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_POSITIONS: usize = 1 << 24;
    pub const MAX_RMS_NORM_EPS: f64 = 0.1;
    pub const MAX_ROPE_THETA: f64 = 1e12;

    /// The most a positive integer field may be.
    pub fn max_of(field: &str) -> usize {
        match field {
            "num_hidden_layers" => MAX_LAYERS,
            "vocab_size" => 1 << 22,
            "hidden_size" => 1 << 16,
            "num_attention_heads" | "num_key_value_heads" => 1024,
            "linear_num_key_heads" | "linear_num_value_heads" => 1024,
            "head_dim" | "linear_key_head_dim" | "linear_value_head_dim" => 4096,
            "linear_conv_kernel_dim" => 64,
            "num_experts" => 4096,
            "num_experts_per_tok" => 256,
            "intermediate_size" | "moe_intermediate_size" | "shared_expert_intermediate_size" => {
                1 << 20
            }
            _ => 1 << 24,
        }
    }
}

/// The JSON value at a serde_path_to_error path (for error messages).
pub(crate) fn value_at<'a>(
    root: &'a serde_json::Value,
    path: &serde_path_to_error::Path,
) -> Option<&'a serde_json::Value> {
    use serde_path_to_error::Segment;
    let mut v = root;
    for segment in path.iter() {
        v = match segment {
            Segment::Map { key } => v.get(key.as_str())?,
            Segment::Seq { index } => v.get(*index)?,
            _ => return None,
        };
    }
    Some(v)
}

/// A value shortened for an error message.
pub(crate) fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(57).map(|(i, _)| i).unwrap_or(s.len())]
        )
    } else {
        s
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
