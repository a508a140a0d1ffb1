//! Weight matrices as the CPU engine holds them, and the two products it needs.
//!
//! - `matvec` (one token): rows split across threads; each row is read once and dotted with x in its
//!   stored format (`simd.rs`), so decode streams the weights exactly once.
//! - `matmul` (T tokens): row blocks split across threads; each block is decoded to f32 once and
//!   multiplied with all T tokens by `matrixmultiply::sgemm`, so a prompt reads each weight once per
//!   layer rather than once per token.
//!
//! Legend: R rows (out features), C cols (in features), T tokens, G quantisation group size.
//! Activations are row-major `[T, C]` in, `[T, R]` out.

use anyhow::{bail, ensure, Result};
use bytemuck::Pod;
use calla_model::{Blob, DType, Matrix, MatrixData};
use rayon::prelude::*;

use crate::simd;

/// Bytes of a stored matrix viewed as `[T]`: borrowed from the (memory-mapped) blob when it is aligned
/// for `T`, else copied once.
#[derive(Clone)]
enum Store<T> {
    Mapped(Blob),
    Owned(Vec<T>),
}

impl<T: Pod> Store<T> {
    fn new(blob: &Blob) -> Self {
        if bytemuck::try_cast_slice::<u8, T>(blob.bytes()).is_ok() {
            Store::Mapped(blob.clone())
        } else {
            let mut owned = vec![T::zeroed(); blob.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut owned).copy_from_slice(blob.bytes());
            Store::Owned(owned)
        }
    }
    fn get(&self) -> &[T] {
        match self {
            Store::Mapped(blob) => bytemuck::cast_slice(blob.bytes()),
            Store::Owned(v) => v,
        }
    }
}

#[derive(Clone)]
enum Packed {
    F32(Store<f32>),
    Bf16(Store<u16>),
    /// MLX affine, 4 or 8 bits; scales and biases widened to f32 (exact).
    Affine {
        bits: u32,
        group_size: usize,
        /// `[R, C·bits/32]` code words
        codes: Store<u32>,
        /// `[R, C/G]`
        scales: Vec<f32>,
        /// `[R, C/G]`
        biases: Vec<f32>,
    },
}

/// A `[R, C]` weight matrix (`y = W x`).
#[derive(Clone)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    packed: Packed,
}

/// Multiply-adds per rayon task: below this, splitting costs more than it saves.
const MIN_WORK_PER_TASK: usize = 1 << 15;
/// Rows decoded to f32 at a time in `matmul`.
const MATMUL_ROW_BLOCK: usize = 64;

fn widen(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    (0..bytes.len() / dtype.size())
        .map(|i| dtype.read(bytes, i))
        .collect()
}

impl Linear {
    /// Repack `m`, checking that it is `[rows, cols]`; `name` names the tensor in errors.
    pub fn new(name: &str, m: &Matrix, rows: usize, cols: usize) -> Result<Linear> {
        ensure!(
            m.rows == rows && m.cols == cols,
            "{name}: expected shape [{rows}, {cols}], found [{}, {}]",
            m.rows,
            m.cols
        );
        let packed = match &m.data {
            MatrixData::Dense { dtype, data } => {
                ensure!(
                    data.len() == rows * cols * dtype.size(),
                    "{name}: {} bytes for a [{rows}, {cols}] {} matrix",
                    data.len(),
                    dtype.name()
                );
                match dtype {
                    DType::F32 => Packed::F32(Store::new(data)),
                    DType::BF16 => Packed::Bf16(Store::new(data)),
                    // Rare in this family: widen once rather than keep a third dense path.
                    DType::F16 => Packed::F32(Store::Owned(widen(DType::F16, data.bytes()))),
                }
            }
            MatrixData::Affine {
                bits,
                group_size,
                codes,
                scales,
                biases,
                param_dtype,
            } => {
                if *bits != 4 && *bits != 8 {
                    bail!("{name}: {bits}-bit affine weights are not supported (4 or 8)");
                }
                ensure!(
                    *group_size > 0 && group_size % 16 == 0 && cols % group_size == 0,
                    "{name}: group size {group_size} must be a multiple of 16 dividing cols {cols}"
                );
                let groups = rows * cols / group_size;
                ensure!(
                    codes.len() == rows * cols * *bits as usize / 8
                        && scales.len() == groups * param_dtype.size()
                        && biases.len() == groups * param_dtype.size(),
                    "{name}: codes/scales/biases of {}/{}/{} bytes do not fit [{rows}, {cols}] q{bits}g{group_size}",
                    codes.len(),
                    scales.len(),
                    biases.len()
                );
                Packed::Affine {
                    bits: *bits,
                    group_size: *group_size,
                    codes: Store::new(codes),
                    scales: widen(*param_dtype, scales.bytes()),
                    biases: widen(*param_dtype, biases.bytes()),
                }
            }
        };
        Ok(Linear { rows, cols, packed })
    }

    /// A dense f32 matrix from row-major values (tests, small tensors).
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Linear {
        assert_eq!(values.len(), rows * cols);
        Linear {
            rows,
            cols,
            packed: Packed::F32(Store::Owned(values)),
        }
    }

    /// Row `r` as f32.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        debug_assert!(r < self.rows && out.len() == self.cols);
        let c = self.cols;
        match &self.packed {
            Packed::F32(w) => out.copy_from_slice(&w.get()[r * c..(r + 1) * c]),
            Packed::Bf16(w) => simd::decode_bf16(&w.get()[r * c..(r + 1) * c], out),
            Packed::Affine {
                bits,
                group_size,
                codes,
                scales,
                biases,
            } => {
                let words = c * *bits as usize / 32;
                let groups = c / group_size;
                let row_words = &codes.get()[r * words..(r + 1) * words];
                let (s, b) = (
                    &scales[r * groups..(r + 1) * groups],
                    &biases[r * groups..(r + 1) * groups],
                );
                if *bits == 4 {
                    simd::decode_q4(row_words, s, b, *group_size, out)
                } else {
                    simd::decode_q8(bytemuck::cast_slice(row_words), s, b, *group_size, out)
                }
            }
        }
    }

    fn rows_per_task(&self) -> usize {
        (MIN_WORK_PER_TASK / self.cols.max(1)).max(1)
    }

    /// `y = W x` for one vector: x `[C]`, y `[R]`.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        debug_assert!(x.len() == self.cols && y.len() == self.rows);
        let c = self.cols;
        let chunk = self.rows_per_task();
        match &self.packed {
            Packed::F32(w) => {
                let w = w.get();
                y.par_chunks_mut(chunk).enumerate().for_each(|(i, ys)| {
                    for (j, yr) in ys.iter_mut().enumerate() {
                        let r = i * chunk + j;
                        *yr = simd::dot_f32(&w[r * c..(r + 1) * c], x);
                    }
                });
            }
            Packed::Bf16(w) => {
                let w = w.get();
                y.par_chunks_mut(chunk).enumerate().for_each(|(i, ys)| {
                    for (j, yr) in ys.iter_mut().enumerate() {
                        let r = i * chunk + j;
                        *yr = simd::dot_bf16(&w[r * c..(r + 1) * c], x);
                    }
                });
            }
            Packed::Affine {
                bits,
                group_size,
                codes,
                scales,
                biases,
            } => {
                let (bits, g) = (*bits as usize, *group_size);
                let groups = c / g;
                let mut x_sums = vec![0f32; groups];
                simd::group_sums(x, g, &mut x_sums);
                let (mut x_even, mut x_odd) = (vec![0f32; c / 2], vec![0f32; c / 2]);
                if bits == 4 {
                    simd::split_even_odd(x, &mut x_even, &mut x_odd);
                }
                let words = c * bits / 32;
                let codes = codes.get();
                y.par_chunks_mut(chunk).enumerate().for_each(|(i, ys)| {
                    for (j, yr) in ys.iter_mut().enumerate() {
                        let r = i * chunk + j;
                        let row = &codes[r * words..(r + 1) * words];
                        let s = &scales[r * groups..(r + 1) * groups];
                        let b = &biases[r * groups..(r + 1) * groups];
                        *yr = if bits == 4 {
                            let row = bytemuck::cast_slice(row);
                            simd::dot_q4(row, s, b, g, &x_even, &x_odd, &x_sums)
                        } else {
                            simd::dot_q8(bytemuck::cast_slice(row), s, b, g, x, &x_sums)
                        };
                    }
                });
            }
        }
    }

    /// `Y = X Wᵀ` for T vectors: xs `[T, C]`, ys `[T, R]`. One token takes the matvec path.
    pub fn matmul(&self, xs: &[f32], t: usize, ys: &mut [f32]) {
        debug_assert!(xs.len() == t * self.cols && ys.len() == t * self.rows);
        if t == 1 {
            return self.matvec(xs, ys);
        }
        if t == 0 {
            return;
        }
        let (r_total, c) = (self.rows, self.cols);
        // Computed as [R, T] (each row block owns a contiguous slab), transposed at the end.
        let mut out_rt = vec![0f32; r_total * t];
        out_rt
            .par_chunks_mut(MATMUL_ROW_BLOCK * t)
            .enumerate()
            .for_each(|(block, slab)| {
                let r0 = block * MATMUL_ROW_BLOCK;
                let nb = slab.len() / t;
                let decoded;
                let w_block: &[f32] = match &self.packed {
                    Packed::F32(w) => &w.get()[r0 * c..(r0 + nb) * c],
                    _ => {
                        let mut buf = vec![0f32; nb * c];
                        for (j, row) in buf.chunks_exact_mut(c).enumerate() {
                            self.decode_row(r0 + j, row);
                        }
                        decoded = buf;
                        &decoded
                    }
                };
                // C[i, j] = Σ_k X[i, k] · Wblock[j, k]: A = X [T, C] (row stride C), B = Wblockᵀ
                // [C, nb] (row stride 1, col stride C), C stored at slab[j·T + i].
                // SAFETY: A spans t·c = xs.len() floats, B spans nb·c = w_block.len(), C spans
                // nb·t = slab.len(); the strides above stay inside those extents.
                unsafe {
                    matrixmultiply::sgemm(
                        t,
                        c,
                        nb,
                        1.0,
                        xs.as_ptr(),
                        c as isize,
                        1,
                        w_block.as_ptr(),
                        1,
                        c as isize,
                        0.0,
                        slab.as_mut_ptr(),
                        1,
                        t as isize,
                    );
                }
            });
        for (r, col) in out_rt.chunks_exact(t).enumerate() {
            for (i, v) in col.iter().enumerate() {
                ys[i * r_total + r] = *v;
            }
        }
    }

    /// Bytes of weights this matrix streams per full read.
    pub fn byte_size(&self) -> usize {
        match &self.packed {
            Packed::F32(w) => w.get().len() * 4,
            Packed::Bf16(w) => w.get().len() * 2,
            Packed::Affine {
                codes,
                scales,
                biases,
                ..
            } => (codes.get().len() + scales.len() + biases.len()) * 4,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{quantise_affine, Rng};
    use calla_model::{Blob, Matrix, MatrixData};

    fn bf16_matrix(rows: usize, cols: usize, values: &[f32]) -> Matrix {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        Matrix {
            rows,
            cols,
            data: MatrixData::Dense {
                dtype: DType::BF16,
                data: Blob::from_vec(bytes),
            },
        }
    }

    /// Every format's matvec and matmul against `Matrix::to_f32` + a plain f64 product, on odd shapes.
    #[test]
    fn products_match_dequantised_reference_in_every_format() {
        let mut rng = Rng::new(11);
        for (rows, cols, t) in [(7, 64, 1), (19, 128, 3), (150, 192, 7), (65, 256, 65)] {
            let values = rng.normal_vec(rows * cols, 0.5);
            let mats = [
                ("f32", Matrix::dense_f32(rows, cols, &values)),
                ("bf16", bf16_matrix(rows, cols, &values)),
                ("q4", quantise_affine(rows, cols, &values, 4, 64)),
                ("q8", quantise_affine(rows, cols, &values, 8, 32)),
            ];
            let xs = rng.normal_vec(t * cols, 1.0);
            for (name, m) in &mats {
                let reference = m.to_f32();
                let lin = Linear::new(name, m, rows, cols).unwrap();
                let mut ys = vec![0f32; t * rows];
                lin.matmul(&xs, t, &mut ys);
                let mut y1 = vec![0f32; rows];
                lin.matvec(&xs[..cols], &mut y1);
                for i in 0..t {
                    for r in 0..rows {
                        let want: f64 = (0..cols)
                            .map(|k| reference[r * cols + k] as f64 * xs[i * cols + k] as f64)
                            .sum();
                        let got = ys[i * rows + r] as f64;
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{name} [{rows},{cols}] t={t} token {i} row {r}: {got} vs {want}"
                        );
                        if i == 0 {
                            let got1 = y1[r] as f64;
                            assert!(
                                (got1 - want).abs() < 1e-4 * (1.0 + want.abs()),
                                "{name} matvec row {r}"
                            );
                        }
                    }
                }
                let mut row = vec![0f32; cols];
                lin.decode_row(rows - 1, &mut row);
                assert_eq!(row, reference[(rows - 1) * cols..]);
            }
        }
    }

    #[test]
    fn shape_mismatch_names_the_tensor() {
        let m = Matrix::dense_f32(2, 3, &[0.0; 6]);
        let err = Linear::new("layers.0.mlp.gate", &m, 3, 2).err().unwrap();
        assert!(err.to_string().contains("layers.0.mlp.gate"), "{err}");
    }
}
