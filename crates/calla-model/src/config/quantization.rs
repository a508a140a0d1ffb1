//! The MLX `quantization` block of config.json (as mlx-lm writes it): global parameters plus per-module
//! overrides keyed by module path, siblings of the global keys.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{config_error, ConfigError};

/// One per-module entry of the MLX quantisation block: parameters, or `false` (left unquantised).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum QuantOverride {
    Params(QuantParams),
    Enabled(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct QuantParams {
    pub group_size: usize,
    pub bits: u32,
}

/// The MLX `quantization` block: global `(bits, group_size, mode)` plus per-module overrides keyed
/// by the full module path (siblings of the global keys, as mlx-lm writes them).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct QuantizationBlock {
    pub group_size: usize,
    pub bits: u32,
    pub mode: String,
    /// module path (e.g. `language_model.model.layers.0.mlp.gate`) → its parameters; `None` =
    /// explicitly left unquantised.
    pub overrides: BTreeMap<String, Option<QuantParams>>,
}

impl QuantizationBlock {
    /// The parameters a module at `path` was quantised with (None = explicitly unquantised).
    pub fn params_for(&self, path: &str) -> Option<QuantParams> {
        match self.overrides.get(path) {
            Some(p) => *p,
            None => Some(QuantParams {
                group_size: self.group_size,
                bits: self.bits,
            }),
        }
    }

    pub(crate) fn from_json(value: &serde_json::Value, field: &str) -> Result<Self, ConfigError> {
        let obj = value
            .as_object()
            .ok_or_else(|| config_error(field, value, "expected an object"))?;
        let get_usize = |key: &str| -> Result<usize, ConfigError> {
            let v = obj
                .get(key)
                .ok_or_else(|| config_error(format!("{field}.{key}"), "<missing>", "required"))?;
            v.as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| config_error(format!("{field}.{key}"), v, "expected an integer"))
        };
        let group_size = get_usize("group_size")?;
        let bits = get_usize("bits")? as u32;
        let mode = match obj.get("mode") {
            None => "affine".to_string(),
            Some(v) => v
                .as_str()
                .ok_or_else(|| config_error(format!("{field}.mode"), v, "expected a string"))?
                .to_string(),
        };
        if mode != "affine" {
            return Err(config_error(
                format!("{field}.mode"),
                format!("{mode:?}"),
                "only MLX affine quantisation is supported",
            ));
        }
        check_quant_params(field, bits, group_size)?;
        let mut overrides = BTreeMap::new();
        for (key, v) in obj {
            if matches!(key.as_str(), "group_size" | "bits" | "mode") {
                continue;
            }
            let entry_field = format!("{field}.{key}");
            let parsed: QuantOverride = serde_json::from_value(v.clone()).map_err(|_| {
                config_error(
                    &entry_field,
                    v,
                    "expected {\"group_size\", \"bits\"} or a boolean",
                )
            })?;
            let params = match parsed {
                QuantOverride::Params(p) => {
                    check_quant_params(&entry_field, p.bits, p.group_size)?;
                    if let Some(m) = v.get("mode").and_then(|m| m.as_str()) {
                        if m != "affine" {
                            return Err(config_error(
                                format!("{entry_field}.mode"),
                                format!("{m:?}"),
                                "only MLX affine quantisation is supported",
                            ));
                        }
                    }
                    Some(p)
                }
                QuantOverride::Enabled(false) => None,
                QuantOverride::Enabled(true) => Some(QuantParams { group_size, bits }),
            };
            overrides.insert(key.clone(), params);
        }
        Ok(QuantizationBlock {
            group_size,
            bits,
            mode,
            overrides,
        })
    }
}

/// Bit widths and group sizes the loader and backends accept (MLX affine subset).
pub const SUPPORTED_BITS: [u32; 2] = [4, 8];
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

fn check_quant_params(field: &str, bits: u32, group_size: usize) -> Result<(), ConfigError> {
    if !SUPPORTED_BITS.contains(&bits) {
        return Err(config_error(
            format!("{field}.bits"),
            bits,
            format!("unsupported bit width (supported: {SUPPORTED_BITS:?})"),
        ));
    }
    if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
        return Err(config_error(
            format!("{field}.group_size"),
            group_size,
            format!("unsupported group size (supported: {SUPPORTED_GROUP_SIZES:?})"),
        ));
    }
    Ok(())
}
