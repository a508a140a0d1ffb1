//! calla-model: the checkpoint described once.
//!
//! `config` turns a checkpoint's config.json (HF wrapper, flat text config, qwen3_next, MLX) into a
//! validated [`ModelSpec`]; `weights` maps tensor names of every checkpoint style onto one canonical
//! [`Weights`] tree whose matrices stay in their stored format ([`Matrix`]); `tokenizer` wraps the
//! `tokenizers` crate with an incremental, UTF-8-safe detokenizer. Nothing here knows about CPUs or GPUs:
//! backends receive a `ModelSpec` + `Weights` and repack them as they like.
//!
//! Map of the crate: `config` (config.json), `load` (`load_model`, `--quant`, report), `weights/`
//! (`store` mmap + safetensors headers, `names` one name map per checkpoint style, `read` formats
//! and shape checks, `assemble` the canonical tree, `qwen3next` the interleaved-projection reorder,
//! `stats` counts, `export` the inverse writer), `quant` (MLX affine rule), `synthetic` (presets,
//! random and placeholder weights), `tokenizer`.

// `x % n == 0` stays: `is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

pub mod config;
pub mod error;
pub mod load;
pub mod matrix;
pub mod quant;
pub mod spec;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use error::LoadError;
pub use load::{load_model, GenerationDefaults, LoadOptions, LoadReport, LoadedModel, Quant};
pub use matrix::{Blob, DType, Matrix, MatrixData};
pub use spec::{Family, FeedForwardSpec, LayerKind, ModelSpec};
pub use tokenizer::{IncrementalDecoder, Tokenizer};
pub use weights::{
    AttentionWeights, DeltaNetWeights, FeedForwardWeights, LayerWeights, MixerWeights, MlpWeights,
    MoeWeights, Weights,
};
