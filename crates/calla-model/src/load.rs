//! `load_model`: a checkpoint directory → spec, weights, generation defaults and a report.
//!
//! config.json → [`ModelSpec`] (config.rs); generation_config.json → [`GenerationDefaults`] (absent =
//! all None); safetensors → canonical [`Weights`] (weights/); then the optional `--quant` conversion
//! (quant.rs), in parallel over matrices.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::{ModelConfig, QuantizationBlock, TokenIds};
use crate::matrix::{DType, Matrix, MatrixData};
use crate::quant::{quantize_affine, to_dense};
use crate::spec::ModelSpec;
use crate::weights::assemble::{assemble, ExpertLayout};
use crate::weights::names::CheckpointStyle;
use crate::weights::stats::{weight_stats, WeightStats};
use crate::weights::store::{dtype_name, TensorStore};
pub use crate::weights::store::{FileStamp, Residency};
use crate::weights::{FeedForwardWeights, MixerWeights, Weights};

pub use crate::error::LoadError;

/// Format conversion applied at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Quant {
    /// MLX affine 4-bit, group 64 (router and shared-expert gate 8-bit, as mlx-lm does); matrices
    /// already quantised are kept.
    Q4,
    /// MLX affine 8-bit, group 64; matrices already quantised are kept.
    Q8,
    /// Dense matrices to bf16; quantised ones kept.
    Bf16,
    /// Everything to f32 (affine matrices dequantised).
    F32,
}

/// The group size of load-time quantisation (MLX's default; the published 4-bit checkpoints use it).
pub const QUANT_GROUP_SIZE: usize = 64;

impl std::str::FromStr for Quant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4" => Ok(Quant::Q4),
            "q8" => Ok(Quant::Q8),
            "bf16" => Ok(Quant::Bf16),
            "f32" => Ok(Quant::F32),
            other => Err(format!(
                "unknown quantisation {other:?} (expected q4, q8, bf16 or f32)"
            )),
        }
    }
}

impl std::fmt::Display for Quant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quant::Q4 => "q4",
            Quant::Q8 => "q8",
            Quant::Bf16 => "bf16",
            Quant::F32 => "f32",
        })
    }
}

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// None = keep the stored formats.
    pub quant: Option<Quant>,
}

/// generation_config.json, as written (every field optional).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub do_sample: Option<bool>,
    pub max_new_tokens: Option<usize>,
    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DTypeCount {
    pub tensors: usize,
    pub bytes: u64,
}

/// What was loaded, from where, in which formats.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub style: CheckpointStyle,
    /// Human-readable style, e.g. "mlx (language_model.model.*)".
    pub style_name: String,
    pub architectures: Vec<String>,
    pub model_type: String,
    pub expert_layout: Option<ExpertLayout>,
    pub norms_stored_plus_one: bool,
    pub deltanet_interleaved: bool,
    /// (file name, bytes)
    pub files: Vec<(String, u64)>,
    /// dtypes of the stored tensors (all of them, ignored ones included)
    pub stored_dtypes: BTreeMap<String, DTypeCount>,
    /// ignored-tensor category ("vision", "mtp", "tied lm_head") → count
    pub ignored_counts: BTreeMap<String, usize>,
    pub ignored_names: Vec<String>,
    pub quantization: Option<QuantizationBlock>,
    pub converted_to: Option<Quant>,
    /// Counts of the weights as they are in memory (after any conversion).
    pub stats: WeightStats,
    pub load_seconds: f64,
}

#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub dir: PathBuf,
    pub spec: ModelSpec,
    pub weights: Weights,
    pub report: LoadReport,
    pub generation: GenerationDefaults,
    /// The mapped files as they were when mapped (empty when read into memory).
    pub mapped: Vec<FileStamp>,
}

/// Read a JSON file (missing file, unreadable file and invalid JSON are distinct errors).
fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    // A FIFO or device under a checkpoint file's name would block the read for ever.
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(LoadError::Corrupt {
                path: path.to_path_buf(),
                detail: "not a regular file (a FIFO, device or directory)".into(),
            });
        }
    }
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Read config.json into its parsed form (also used by tools that need the quantisation block).
pub fn read_config(dir: &Path) -> Result<ModelConfig, LoadError> {
    let path = dir.join("config.json");
    let json = read_json(&path)?;
    ModelConfig::from_json(&json).map_err(|source| LoadError::Config { path, source })
}

/// generation_config.json; a missing file gives all-None defaults.
pub fn read_generation_defaults(dir: &Path) -> Result<GenerationDefaults, LoadError> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(GenerationDefaults::default());
    }
    let json = read_json(&path)?;
    serde_path_to_error::deserialize(&json).map_err(|e| {
        let value = crate::config::value_at(&json, e.path())
            .map(crate::config::short)
            .unwrap_or_else(|| "?".into());
        LoadError::Config {
            path: path.clone(),
            source: crate::config::ConfigError {
                field: e.path().to_string(),
                value,
                problem: e.inner().to_string(),
            },
        }
    })
}

pub fn load_model(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel, LoadError> {
    load_model_with(dir, opts, Residency::Mapped)
}

/// [`load_model`], choosing how the weights' bytes are held (mapped, or read into memory).
pub fn load_model_with(
    dir: &Path,
    opts: &LoadOptions,
    residency: Residency,
) -> Result<LoadedModel, LoadError> {
    let started = Instant::now();
    let config = read_config(dir)?;
    let mut spec = config.to_spec().map_err(|source| LoadError::Config {
        path: dir.join("config.json"),
        source,
    })?;
    let generation = read_generation_defaults(dir)?;
    // generation_config.json's stop list wins over config.json's (as transformers' generate does).
    if let Some(eos) = &generation.eos_token_id {
        let ids = eos.to_vec();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= spec.vocab_size) {
            return Err(LoadError::Config {
                path: dir.join("generation_config.json"),
                source: crate::config::ConfigError {
                    field: "eos_token_id".into(),
                    value: bad.to_string(),
                    problem: format!("outside the vocabulary (vocab_size {})", spec.vocab_size),
                },
            });
        }
        spec.eos_token_ids = ids;
    }

    let store = TensorStore::open_with(dir, residency)?;
    let (mut weights, info) = assemble(&store, &spec, config.quantization.as_ref())?;
    if let Some(quant) = opts.quant {
        convert_weights(&mut weights, &spec, quant);
    }

    let mut stored_dtypes: BTreeMap<String, DTypeCount> = BTreeMap::new();
    for name in store.names() {
        if let Some(entry) = store.entry(name) {
            let count = stored_dtypes.entry(dtype_name(entry.dtype)).or_default();
            count.tensors += 1;
            count.bytes += entry.len as u64;
        }
    }
    let mut ignored_counts = BTreeMap::new();
    for (category, _) in &info.ignored {
        *ignored_counts.entry(category.clone()).or_insert(0) += 1;
    }
    let report = LoadReport {
        style: info.style,
        style_name: info.style.name().to_string(),
        architectures: config.architectures.clone(),
        model_type: config.model_type.clone(),
        expert_layout: info.expert_layout,
        norms_stored_plus_one: info.norms_stored_plus_one,
        deltanet_interleaved: info.deltanet_interleaved,
        files: store
            .files
            .iter()
            .map(|f| {
                let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned());
                (name.unwrap_or_default(), (*f.map).as_ref().len() as u64)
            })
            .collect(),
        stored_dtypes,
        ignored_counts,
        ignored_names: info.ignored.iter().map(|(_, n)| n.clone()).collect(),
        quantization: config.quantization.clone(),
        converted_to: opts.quant,
        stats: weight_stats(&spec, &weights),
        load_seconds: started.elapsed().as_secs_f64(),
    };
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        spec,
        weights,
        report,
        generation,
        mapped: store.files.iter().filter_map(|f| f.stamp.clone()).collect(),
    })
}

/// Role of a matrix for conversion: mlx-lm quantises the router and the shared-expert gate at 8 bits.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Plain,
    Gate,
}

fn matrices_mut(weights: &mut Weights, include_lm_head: bool) -> Vec<(Role, &mut Matrix)> {
    let mut out: Vec<(Role, &mut Matrix)> = vec![(Role::Plain, &mut weights.embed_tokens)];
    if include_lm_head {
        out.push((Role::Plain, &mut weights.lm_head));
    }
    for layer in &mut weights.layers {
        match &mut layer.mixer {
            MixerWeights::DeltaNet(dn) => out.extend(
                [
                    &mut dn.in_proj_qkv,
                    &mut dn.in_proj_z,
                    &mut dn.in_proj_b,
                    &mut dn.in_proj_a,
                    &mut dn.out_proj,
                ]
                .map(|m| (Role::Plain, m)),
            ),
            MixerWeights::Attention(at) => out.extend(
                [
                    &mut at.q_proj,
                    &mut at.k_proj,
                    &mut at.v_proj,
                    &mut at.o_proj,
                ]
                .map(|m| (Role::Plain, m)),
            ),
        }
        let mlps = match &mut layer.feed_forward {
            FeedForwardWeights::Dense(mlp) => vec![mlp],
            FeedForwardWeights::Moe(moe) => {
                out.push((Role::Gate, &mut moe.router));
                if let Some(gate) = &mut moe.shared_expert_gate {
                    out.push((Role::Gate, gate));
                }
                moe.experts
                    .iter_mut()
                    .chain(moe.shared_expert.as_mut())
                    .collect()
            }
        };
        for mlp in mlps {
            out.extend(
                [&mut mlp.gate_proj, &mut mlp.up_proj, &mut mlp.down_proj]
                    .map(|m| (Role::Plain, m)),
            );
        }
    }
    out
}

/// Apply `--quant` to every matrix of the tree (rayon across matrices and, inside, across rows).
pub fn convert_weights(weights: &mut Weights, spec: &ModelSpec, quant: Quant) {
    let tied = spec.tie_word_embeddings;
    matrices_mut(weights, !tied)
        .into_par_iter()
        .for_each(|(role, m)| {
            let is_affine = matches!(m.data, MatrixData::Affine { .. });
            let converted = match quant {
                Quant::Q4 | Quant::Q8 if is_affine || m.cols % QUANT_GROUP_SIZE != 0 => None,
                Quant::Q4 => Some(quantize_affine(
                    m,
                    if role == Role::Gate { 8 } else { 4 },
                    QUANT_GROUP_SIZE,
                )),
                Quant::Q8 => Some(quantize_affine(m, 8, QUANT_GROUP_SIZE)),
                Quant::Bf16 if is_affine => None,
                Quant::Bf16 => Some(to_dense(m, DType::BF16)),
                Quant::F32 => Some(to_dense(m, DType::F32)),
            };
            if let Some(c) = converted {
                *m = c;
            }
        });
    if tied {
        weights.lm_head = weights.embed_tokens.clone();
    }
}
