//! Why a checkpoint did not load. Every variant names the file, the tensor or field, what was expected
//! and what was found, so the message alone tells the user what to fix.

use std::path::PathBuf;

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: not found ({what})")]
    MissingFile { path: PathBuf, what: String },

    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },

    #[error("{path}: {detail}")]
    Index { path: PathBuf, detail: String },

    #[error("{path}: not a valid safetensors file: {detail}")]
    Corrupt { path: PathBuf, detail: String },

    #[error(
        "{path}: truncated: its header describes {needed} bytes but the file has {found}; tensor `{tensor}` is the first one cut"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: usize,
        found: usize,
    },

    #[error("missing tensor `{tensor}` (expected {expected}; looked in {looked_in})")]
    MissingTensor {
        tensor: String,
        expected: String,
        looked_in: String,
    },

    #[error("{path}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("{path}: tensor `{tensor}` has dtype {found}, expected {expected}")]
    DType {
        path: PathBuf,
        tensor: String,
        expected: String,
        found: String,
    },

    #[error("{path}: tensor `{tensor}`: {detail}")]
    Quantization {
        path: PathBuf,
        tensor: String,
        detail: String,
    },

    #[error(
        "{count} tensor(s) of the checkpoint were not used by the language model and are not on the ignore list: {names}"
    )]
    Unconsumed { count: usize, names: String },

    #[error("{path}: {detail}")]
    Inconsistent { path: PathBuf, detail: String },
}

impl LoadError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            LoadError::MissingFile {
                path,
                what: "no such file".into(),
            }
        } else {
            LoadError::Io { path, source }
        }
    }
}
