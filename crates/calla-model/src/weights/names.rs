//! Tensor names: one map per checkpoint style (the published checkpoints' safetensors indexes), plus the ignore list.
//!
//! | style            | decoder prefix            | LM head                  | written by                          |
//! |------------------|---------------------------|--------------------------|-------------------------------------|
//! | `HfConditional`  | `model.language_model.`   | `lm_head`                | Qwen3_5MoeForConditionalGeneration  |
//! | `HfCausal`       | `model.`                  | `lm_head`                | *ForCausalLM, Qwen3NextForCausalLM  |
//! | `Mlx`            | `language_model.model.`   | `language_model.lm_head` | mlx-lm / mlx-vlm conversions        |
//!
//! Module paths below are given without the `.weight` suffix (a quantised module also has `.scales` and
//! `.biases`), which is also how MLX's `quantization` block keys its per-module overrides.

use crate::error::LoadError;
use crate::weights::store::TensorStore;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum CheckpointStyle {
    HfConditional,
    HfCausal,
    Mlx,
}

impl CheckpointStyle {
    /// Prefix of `embed_tokens`, `layers.N.*` and `norm`.
    pub fn decoder_prefix(self) -> &'static str {
        match self {
            CheckpointStyle::HfConditional => "model.language_model.",
            CheckpointStyle::HfCausal => "model.",
            CheckpointStyle::Mlx => "language_model.model.",
        }
    }

    /// Module path of the LM head.
    pub fn lm_head(self) -> &'static str {
        match self {
            CheckpointStyle::HfConditional | CheckpointStyle::HfCausal => "lm_head",
            CheckpointStyle::Mlx => "language_model.lm_head",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CheckpointStyle::HfConditional => "hf-conditional-generation (model.language_model.*)",
            CheckpointStyle::HfCausal => "hf-causal-lm (model.*)",
            CheckpointStyle::Mlx => "mlx (language_model.model.*)",
        }
    }

    /// Module path of layer `i`'s submodule, e.g. `layer(3, "self_attn.q_proj")`.
    pub fn layer(self, i: usize, module: &str) -> String {
        format!("{}layers.{i}.{module}", self.decoder_prefix())
    }

    pub fn decoder(self, module: &str) -> String {
        format!("{}{module}", self.decoder_prefix())
    }

    /// Decide the style from the names present. The first rule that matches wins: MLX names are
    /// unambiguous, then the wrapper's, then the bare CausalLM prefix.
    pub fn detect(store: &TensorStore) -> Result<CheckpointStyle, LoadError> {
        let has_prefix = |p: &str| {
            store
                .names()
                .any(|n| n.starts_with(p) && ignore_category(n).is_none())
        };
        if has_prefix("language_model.model.") {
            Ok(CheckpointStyle::Mlx)
        } else if has_prefix("model.language_model.") {
            Ok(CheckpointStyle::HfConditional)
        } else if has_prefix("model.layers.") || has_prefix("model.embed_tokens.") {
            Ok(CheckpointStyle::HfCausal)
        } else {
            Err(LoadError::Inconsistent {
                path: store.dir.clone(),
                detail: "no language-model tensors found (expected names starting with `model.language_model.`, \
                         `model.` or `language_model.model.`)"
                    .into(),
            })
        }
    }
}

/// Tensors that belong to the checkpoint but not to the text model: the vision tower and the MTP
/// head (mlx-lm's `sanitize` drops them too). Returns the category for the report, or None if not ignored.
pub fn ignore_category(name: &str) -> Option<&'static str> {
    const VISION: [&str; 5] = [
        "model.visual.",
        "visual.",
        "vision_tower.",
        "model.vision_tower.",
        "language_model.vision_tower.",
    ];
    const MTP: [&str; 5] = [
        "mtp.",
        "model.mtp.",
        "language_model.mtp.",
        "model.language_model.mtp.",
        "language_model.model.mtp.",
    ];
    if VISION.iter().any(|p| name.starts_with(p)) {
        Some("vision")
    } else if MTP.iter().any(|p| name.starts_with(p)) {
        Some("mtp")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignore_rules_cover_vision_and_mtp_only() {
        assert_eq!(
            ignore_category("model.visual.patch_embed.proj.weight"),
            Some("vision")
        );
        assert_eq!(
            ignore_category("vision_tower.blocks.0.attn.qkv.weight"),
            Some("vision")
        );
        assert_eq!(ignore_category("mtp.fc.weight"), Some("mtp"));
        assert_eq!(
            ignore_category("mtp.layers.0.mlp.experts.3.up_proj.weight"),
            Some("mtp")
        );
        assert_eq!(
            ignore_category("model.language_model.layers.0.mlp.gate.weight"),
            None
        );
        assert_eq!(ignore_category("model.layers.0.mtp_like.weight"), None);
        assert_eq!(ignore_category("lm_head.weight"), None);
    }

    #[test]
    fn module_paths() {
        assert_eq!(
            CheckpointStyle::HfConditional.layer(3, "self_attn.q_proj"),
            "model.language_model.layers.3.self_attn.q_proj"
        );
        assert_eq!(
            CheckpointStyle::Mlx.decoder("norm"),
            "language_model.model.norm"
        );
        assert_eq!(CheckpointStyle::HfCausal.lm_head(), "lm_head");
    }
}
