//! Format conversion at load time: MLX-compatible affine quantisation, bf16/f32 conversion.
//!
//! The affine rule is MLX's own (`mlx/backend/cpu/quantized.cpp`, `quantize<T, U>`), per group of
//! `g` consecutive inputs of one row, `n = 2^bits − 1`:
//!
//! ```text
//! scale = max((w_max − w_min) / n, 1e-7), negated unless |w_min| > |w_max|
//! edge  = |w_min| > |w_max| ? w_min : w_max          // the end of larger magnitude
//! q0    = rint(edge / scale)
//! if q0 ≠ 0 { scale = edge / q0; bias = edge } else { bias = 0 }
//! q     = clamp(rint((w − bias) / scale), 0, n)      // rint: round half to even
//! ```
//!
//! so `w ≈ scale·q + bias` reproduces the larger-magnitude end exactly (scale may be negative). The
//! codes are computed from the f32 scale/bias; scale and bias are then stored rounded (bf16 here,
//! MLX stores the input dtype — bf16 for every published checkpoint). Because the scale is adjusted
//! to hit the edge, the opposite end can exceed `n` and be clamped: the error there can exceed
//! scale/2 by at most `range − n·|scale|`.
//!
//! Packing: codes of a row form a little-endian bit stream in u32 words, element j of a word at bit
//! `bits·j` (low bits first), matching [`MatrixData::Affine`].

use half::bf16;
use rayon::prelude::*;

use crate::matrix::{Blob, DType, Matrix, MatrixData};

/// MLX's lower bound on the scale of a constant group.
const MLX_SCALE_EPS: f32 = 1e-7;

/// Scale and bias of one group (before rounding to the stored dtype), by MLX's rule.
pub fn affine_group_params(group: &[f32], bits: u32) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
    for &w in group {
        w_min = w_min.min(w);
        w_max = w_max.max(w);
    }
    let min_is_edge = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(MLX_SCALE_EPS);
    if !min_is_edge {
        scale = -scale;
    }
    let edge = if min_is_edge { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    if q0 != 0.0 {
        (edge / q0, edge)
    } else {
        (scale, 0.0)
    }
}

/// The code of one value: `clamp(rint((w − bias)/scale), 0, n)`.
#[inline]
pub fn affine_code(w: f32, scale: f32, bias: f32, bits: u32) -> u32 {
    let n_bins = ((1u32 << bits) - 1) as f32;
    ((w - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32
}

/// Quantise one row of f32 values into its packed codes, scales and biases (bf16).
/// `codes.len() = row.len()·bits/32`, `scales.len() = biases.len() = row.len()/group_size`.
pub fn quantize_row(
    row: &[f32],
    bits: u32,
    group_size: usize,
    codes: &mut [u32],
    scales: &mut [bf16],
    biases: &mut [bf16],
) {
    let per_word = (32 / bits) as usize;
    codes.iter_mut().for_each(|w| *w = 0);
    for (g, group) in row.chunks_exact(group_size).enumerate() {
        let (scale, bias) = affine_group_params(group, bits);
        scales[g] = bf16::from_f32(scale);
        biases[g] = bf16::from_f32(bias);
        for (j, &w) in group.iter().enumerate() {
            let col = g * group_size + j;
            codes[col / per_word] |=
                affine_code(w, scale, bias, bits) << (bits as usize * (col % per_word));
        }
    }
}

/// Owned buffers of an affine matrix under construction.
pub struct AffineBuffers {
    pub codes: Vec<u32>,
    pub scales: Vec<bf16>,
    pub biases: Vec<bf16>,
    pub words_per_row: usize,
    pub groups_per_row: usize,
}

impl AffineBuffers {
    pub fn new(rows: usize, cols: usize, bits: u32, group_size: usize) -> Self {
        assert!(
            cols % group_size == 0 && 32 % bits == 0 && cols * bits as usize % 32 == 0,
            "affine: bad shape/bits"
        );
        let words_per_row = cols * bits as usize / 32;
        let groups_per_row = cols / group_size;
        AffineBuffers {
            codes: vec![0; rows * words_per_row],
            scales: vec![bf16::ZERO; rows * groups_per_row],
            biases: vec![bf16::ZERO; rows * groups_per_row],
            words_per_row,
            groups_per_row,
        }
    }

    pub fn into_matrix(self, rows: usize, cols: usize, bits: u32, group_size: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: MatrixData::Affine {
                bits,
                group_size,
                codes: Blob::from_pod_vec(self.codes),
                scales: Blob::from_pod_vec(self.scales),
                biases: Blob::from_pod_vec(self.biases),
                param_dtype: DType::BF16,
            },
        }
    }
}

/// Quantise a matrix to MLX affine `bits`/`group_size` with bf16 scales and biases, rows in parallel.
/// Requires `cols % group_size == 0` and bits ∈ {2, 4, 8} (callers check; panics otherwise).
pub fn quantize_affine(m: &Matrix, bits: u32, group_size: usize) -> Matrix {
    let mut buffers = AffineBuffers::new(m.rows, m.cols, bits, group_size);
    let (wpr, gpr) = (buffers.words_per_row, buffers.groups_per_row);
    buffers
        .codes
        .par_chunks_mut(wpr)
        .zip(buffers.scales.par_chunks_mut(gpr))
        .zip(buffers.biases.par_chunks_mut(gpr))
        .enumerate()
        .for_each_init(
            || vec![0f32; m.cols],
            |row, (r, ((codes, scales), biases))| {
                m.row_f32(r, row);
                quantize_row(row, bits, group_size, codes, scales, biases);
            },
        );
    buffers.into_matrix(m.rows, m.cols, bits, group_size)
}

/// Quantise f32 values directly (synthetic weights): no intermediate dense matrix is kept.
pub fn quantize_values(
    rows: usize,
    cols: usize,
    values: &[f32],
    bits: u32,
    group_size: usize,
) -> Matrix {
    quantize_affine(&Matrix::dense_f32(rows, cols, values), bits, group_size)
}

/// Convert to a dense matrix of `dtype` (dequantising affine ones). Rows in parallel; the result
/// is an owned, element-aligned buffer.
pub fn to_dense(m: &Matrix, dtype: DType) -> Matrix {
    if let MatrixData::Dense { dtype: d, .. } = &m.data {
        if *d == dtype {
            return m.clone();
        }
    }
    fn convert<T: bytemuck::Pod + Send + Sync + Default>(
        m: &Matrix,
        from_f32: fn(f32) -> T,
    ) -> Blob {
        let cols = m.cols.max(1);
        let mut out = vec![T::default(); m.rows * m.cols];
        out.par_chunks_mut(cols).enumerate().for_each_init(
            || vec![0f32; m.cols],
            |row, (r, dst)| {
                m.row_f32(r, row);
                for (o, &v) in dst.iter_mut().zip(row.iter()) {
                    *o = from_f32(v);
                }
            },
        );
        Blob::from_pod_vec(out)
    }
    let data = match dtype {
        DType::F32 => convert::<f32>(m, |v| v),
        DType::BF16 => convert::<bf16>(m, bf16::from_f32),
        DType::F16 => convert::<half::f16>(m, half::f16::from_f32),
    };
    Matrix {
        rows: m.rows,
        cols: m.cols,
        data: MatrixData::Dense { dtype, data },
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
