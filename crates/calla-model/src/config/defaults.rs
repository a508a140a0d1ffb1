//! The transformers class defaults per model type: the value a key absent from config.json takes.

use crate::spec::Family;

/// The transformers class defaults of one model type (the values a missing key takes).
#[derive(Debug, Clone, Copy)]
pub struct FamilyDefaults {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
}

impl FamilyDefaults {
    pub fn of(family: Family) -> Self {
        match family {
            // Qwen3_5MoeTextConfig
            Family::Qwen35Moe => FamilyDefaults {
                vocab_size: 248320,
                hidden_size: 2048,
                intermediate_size: 0,
                num_hidden_layers: 40,
                num_attention_heads: 16,
                num_key_value_heads: 2,
                num_experts: 256,
                num_experts_per_tok: 8,
            },
            // Qwen3_5TextConfig
            Family::Qwen35Dense => FamilyDefaults {
                vocab_size: 248320,
                hidden_size: 4096,
                intermediate_size: 12288,
                num_hidden_layers: 32,
                num_attention_heads: 16,
                num_key_value_heads: 4,
                num_experts: 0,
                num_experts_per_tok: 0,
            },
            // Qwen3NextConfig
            Family::Qwen3Next => FamilyDefaults {
                vocab_size: 151936,
                hidden_size: 2048,
                intermediate_size: 5632,
                num_hidden_layers: 48,
                num_attention_heads: 16,
                num_key_value_heads: 2,
                num_experts: 512,
                num_experts_per_tok: 10,
            },
        }
    }
}
