//! Reading one module of a checkpoint into calla's formats, checking shape and dtype on the way.
//!
//! A linear module at path `P` is stored either dense (`P.weight`, f32/bf16/f16, `[out, in]`) or as an
//! MLX affine triple (`P.weight` u32 codes `[out, in·bits/32]`, `P.scales` / `P.biases` `[out, in/g]`).
//! Stacked experts have a leading `[E]` axis on all of these. The bit width is inferred from the packed
//! width and checked against the config's quantisation block (MLX affine: `mlx.core.quantize`).

use crate::config::{QuantizationBlock, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES};
use crate::error::LoadError;
use crate::matrix::{Matrix, MatrixData};
use crate::weights::store::{TensorStore, TensorView};
use safetensors::Dtype;

/// How a DeltaNet conv1d weight was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvLayout {
    /// HF `[C, 1, K]`
    Hf,
    /// MLX `[C, K, 1]` (mlx-lm's sanitize moved the axis; such checkpoints store norms as 1 + w)
    Mlx,
    /// K = 1: both layouts coincide, nothing can be inferred
    Ambiguous,
}

pub struct ModuleReader<'a> {
    pub store: &'a TensorStore,
    pub quant: Option<&'a QuantizationBlock>,
}

impl<'a> ModuleReader<'a> {
    /// Linear module `path` with weight `[rows, cols]`.
    pub fn linear(&self, path: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        self.matrix(path, &format!("{path}.weight"), None, rows, cols)
    }

    /// E stacked matrices `[E, rows, cols]` stored under `weight_name` (with the MLX triple at
    /// `path.scales` / `path.biases` if quantised), returned as one `[E·rows, cols]` matrix whose
    /// expert `e` is `rows_view(e·rows, rows)`.
    pub fn stacked(
        &self,
        path: &str,
        weight_name: &str,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, LoadError> {
        self.matrix(path, weight_name, Some(experts), rows, cols)
    }

    pub fn is_quantized(&self, path: &str) -> bool {
        self.store.contains(&format!("{path}.scales"))
    }

    fn matrix(
        &self,
        path: &str,
        weight_name: &str,
        experts: Option<usize>,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, LoadError> {
        let lead: Vec<usize> = experts.into_iter().collect();
        let total_rows = experts.unwrap_or(1) * rows;
        let with_lead =
            |tail: &[usize]| -> Vec<usize> { lead.iter().chain(tail).copied().collect() };
        if !self.is_quantized(path) {
            let t = self.store.take(
                weight_name,
                &format!("{:?} weight", with_lead(&[rows, cols])),
            )?;
            let dtype = t.float_dtype()?;
            t.expect_shape(&with_lead(&[rows, cols]))?;
            return Ok(Matrix {
                rows: total_rows,
                cols,
                data: MatrixData::Dense {
                    dtype,
                    data: t.data,
                },
            });
        }

        let configured = self.quant.and_then(|q| q.params_for(path));
        let codes = self
            .store
            .take(weight_name, "u32 codes of an MLX-quantised module")?;
        let scales = self
            .store
            .take(&format!("{path}.scales"), "MLX quantisation scales")?;
        let biases = self
            .store
            .take(&format!("{path}.biases"), "MLX quantisation biases")?;
        if codes.dtype != Dtype::U32 {
            return Err(codes.dtype_error("u32 (MLX packed codes)"));
        }
        let quant_error = |t: &TensorView, detail: String| LoadError::Quantization {
            path: t.path.clone(),
            tensor: t.name.clone(),
            detail,
        };
        // Leading dims must match before the packed width can say anything.
        let expected_codes_lead = with_lead(&[rows]);
        let codes_ok = codes.shape.len() == expected_codes_lead.len() + 1
            && codes.shape[..expected_codes_lead.len()] == expected_codes_lead[..];
        if !codes_ok {
            let bits = configured.map_or(4, |p| p.bits as usize);
            return Err(codes.shape_error(&with_lead(&[rows, cols * bits / 32])));
        }
        let packed = *codes.shape.last().unwrap_or(&0);
        let bits = if packed * 32 % cols == 0 {
            packed * 32 / cols
        } else {
            0
        };
        if !SUPPORTED_BITS.contains(&(bits as u32)) {
            return Err(quant_error(
                &codes,
                format!(
                    "{packed} u32 words per row for {cols} inputs is not a supported bit width \
                     (expected {:?} words for {SUPPORTED_BITS:?} bits)",
                    SUPPORTED_BITS.map(|b| cols * b as usize / 32)
                ),
            ));
        }
        let scale_dtype = scales.float_dtype()?;
        let groups = match scales.shape.last() {
            Some(&g) if scales.shape.len() == lead.len() + 2 && g > 0 && cols % g == 0 => g,
            _ => return Err(scales.shape_error(&with_lead(&[rows, cols / 64]))),
        };
        let group_size = cols / groups;
        scales.expect_shape(&with_lead(&[rows, groups]))?;
        if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
            return Err(quant_error(
                &scales,
                format!("{groups} groups for {cols} inputs = group size {group_size}, supported: {SUPPORTED_GROUP_SIZES:?}"),
            ));
        }
        biases.expect_shape(&scales.shape)?;
        if biases.dtype != scales.dtype {
            return Err(biases.dtype_error(&crate::weights::store::dtype_name(scales.dtype)));
        }
        if let Some(q) = self.quant {
            match configured {
                None => {
                    return Err(quant_error(
                        &codes,
                        format!("config.json's quantization block lists `{path}` as unquantised, but it is stored quantised"),
                    ))
                }
                Some(p) if p.bits as usize != bits || p.group_size != group_size => {
                    let source = if q.overrides.contains_key(path) { "its per-module entry" } else { "the global entry" };
                    return Err(quant_error(
                        &codes,
                        format!(
                            "stored as {bits}-bit group {group_size}, but config.json's quantization block ({source}) says {}-bit group {}",
                            p.bits, p.group_size
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(Matrix {
            rows: total_rows,
            cols,
            data: MatrixData::Affine {
                bits: bits as u32,
                group_size,
                codes: codes.data,
                scales: scales.data,
                biases: biases.data,
                param_dtype: scale_dtype,
            },
        })
    }

    /// A 1-D float tensor of length `len`, as f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let t = self.store.take(name, &format!("[{len}] vector"))?;
        t.float_dtype()?;
        t.expect_shape(&[len])?;
        t.to_f32_vec()
    }

    /// The depthwise conv weight as `[C, K]` f32 from HF `[C, 1, K]` or MLX `[C, K, 1]`.
    /// Both layouts put tap k of channel c at c·K + k, so only the shape tells them apart.
    pub fn conv(
        &self,
        name: &str,
        channels: usize,
        kernel: usize,
    ) -> Result<(Vec<f32>, ConvLayout), LoadError> {
        let t = self
            .store
            .take(name, &format!("[{channels}, 1, {kernel}] conv weight"))?;
        t.float_dtype()?;
        let layout = if kernel == 1 && t.shape == [channels, 1, 1] {
            ConvLayout::Ambiguous
        } else if t.shape == [channels, 1, kernel] {
            ConvLayout::Hf
        } else if t.shape == [channels, kernel, 1] {
            ConvLayout::Mlx
        } else {
            return Err(t.shape_error(&[channels, 1, kernel]));
        };
        Ok((t.to_f32_vec()?, layout))
    }
}
