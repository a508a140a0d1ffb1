//! A weight matrix in its stored format, without a second copy when it comes from a memory-mapped file.
//!
//! Layout convention: `[rows = out_features, cols = in_features]`, row-major, little-endian — the
//! layout of HF `nn.Linear.weight` and of MLX's quantised triples.

use std::sync::Arc;

/// Bytes owned by something that keeps them alive (a memory map of a safetensors shard, or a Vec).
#[derive(Clone)]
pub struct Blob {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Blob {
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Blob {
            owner: Arc::new(bytes),
            start: 0,
            len,
        }
    }
    /// A view of `owner[start..start + len]`. Panics if out of range (callers check sizes first).
    pub fn from_owner(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        assert!(
            start
                .checked_add(len)
                .is_some_and(|end| end <= (*owner).as_ref().len()),
            "blob range out of bounds"
        );
        Blob { owner, start, len }
    }
    pub fn from_f32(values: &[f32]) -> Self {
        Self::from_pod_vec(values.to_vec())
    }
    /// Take ownership of a vector of plain values (u32 codes, bf16 scales, f32 …) without copying;
    /// the bytes keep the element type's alignment, so backends may view them as `&[T]`.
    pub fn from_pod_vec<T: bytemuck::Pod + Send + Sync>(values: Vec<T>) -> Self {
        let len = std::mem::size_of_val(values.as_slice());
        Blob {
            owner: Arc::new(PodVec(values)),
            start: 0,
            len,
        }
    }
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range of this blob sharing the same owner.
    pub fn slice(&self, start: usize, len: usize) -> Blob {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "blob slice out of bounds"
        );
        Blob {
            owner: self.owner.clone(),
            start: self.start + start,
            len,
        }
    }
}

/// A `Vec<T>` seen as bytes (owner of a [`Blob`]).
struct PodVec<T>(Vec<T>);

impl<T: bytemuck::Pod> AsRef<[u8]> for PodVec<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// Element `i` of a little-endian buffer of this dtype, as f32.
    #[inline]
    pub fn read(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
            DType::F16 => {
                half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
            DType::BF16 => {
                half::bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

#[derive(Debug, Clone)]
pub enum MatrixData {
    /// Plain floating point, row-major.
    Dense { dtype: DType, data: Blob },
    /// MLX affine quantisation: `w[r][c] = scale[r][c/g]·q[r][c] + bias[r][c/g]`, codes packed in
    /// little-endian u32 words, low bits first (`(word >> (bits·j)) & mask` is element j of the word).
    /// codes: `[rows, cols·bits/32]` u32; scales, biases: `[rows, cols/g]` of `param_dtype`.
    Affine {
        bits: u32,
        group_size: usize,
        codes: Blob,
        scales: Blob,
        biases: Blob,
        param_dtype: DType,
    },
}

#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    pub fn dense_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols);
        Matrix {
            rows,
            cols,
            data: MatrixData::Dense {
                dtype: DType::F32,
                data: Blob::from_f32(values),
            },
        }
    }

    /// Bytes this matrix occupies in its format (codes + scales + biases for quantised ones).
    pub fn byte_size(&self) -> usize {
        match &self.data {
            MatrixData::Dense { data, .. } => data.len(),
            MatrixData::Affine {
                codes,
                scales,
                biases,
                ..
            } => codes.len() + scales.len() + biases.len(),
        }
    }

    /// Short format name for reports: "bf16", "f32", "q4g64", …
    pub fn format_name(&self) -> String {
        match &self.data {
            MatrixData::Dense { dtype, .. } => dtype.name().to_string(),
            MatrixData::Affine {
                bits, group_size, ..
            } => format!("q{bits}g{group_size}"),
        }
    }

    /// Dequantise/convert row `r` into `out` (len = cols).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        debug_assert!(r < self.rows && out.len() == self.cols);
        let cols = self.cols;
        match &self.data {
            MatrixData::Dense { dtype, data } => {
                let b = &data.bytes()[r * cols * dtype.size()..(r + 1) * cols * dtype.size()];
                match dtype {
                    DType::F32 => {
                        for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                    DType::BF16 => {
                        for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                        }
                    }
                    DType::F16 => {
                        for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                            *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                        }
                    }
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
                let bits = *bits as usize;
                let words_per_row = cols * bits / 32;
                let groups_per_row = cols / group_size;
                let code_bytes = &codes.bytes()[r * words_per_row * 4..(r + 1) * words_per_row * 4];
                let per_word = 32 / bits;
                let mask = (1u32 << bits) - 1;
                let sb = scales.bytes();
                let bb = biases.bytes();
                for (w, c) in code_bytes.chunks_exact(4).enumerate() {
                    let word = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    for j in 0..per_word {
                        let col = w * per_word + j;
                        let g = r * groups_per_row + col / group_size;
                        let q = ((word >> (bits * j)) & mask) as f32;
                        out[col] = param_dtype.read(sb, g) * q + param_dtype.read(bb, g);
                    }
                }
            }
        }
    }

    /// Bytes one row occupies in each blob of this format: (data or codes, scales, biases).
    fn row_bytes(&self) -> (usize, usize) {
        match &self.data {
            MatrixData::Dense { dtype, .. } => (self.cols * dtype.size(), 0),
            MatrixData::Affine {
                bits,
                group_size,
                param_dtype,
                ..
            } => (
                self.cols * *bits as usize / 8,
                self.cols / group_size * param_dtype.size(),
            ),
        }
    }

    /// Rows `[start, start + count)` as a matrix sharing this one's bytes (no copy). Used for
    /// per-expert views into stacked expert tensors and the gate/up halves of a fused gate_up_proj.
    pub fn rows_view(&self, start: usize, count: usize) -> Matrix {
        assert!(start + count <= self.rows, "rows_view out of bounds");
        let (row, param_row) = self.row_bytes();
        let data = match &self.data {
            MatrixData::Dense { dtype, data } => MatrixData::Dense {
                dtype: *dtype,
                data: data.slice(start * row, count * row),
            },
            MatrixData::Affine {
                bits,
                group_size,
                codes,
                scales,
                biases,
                param_dtype,
            } => MatrixData::Affine {
                bits: *bits,
                group_size: *group_size,
                codes: codes.slice(start * row, count * row),
                scales: scales.slice(start * param_row, count * param_row),
                biases: biases.slice(start * param_row, count * param_row),
                param_dtype: *param_dtype,
            },
        };
        Matrix {
            rows: count,
            cols: self.cols,
            data,
        }
    }

    /// A new matrix whose row `i` is row `order[i]` of this one, in the same format (a copy).
    pub fn gather_rows(&self, order: &[usize]) -> Matrix {
        let (row, param_row) = self.row_bytes();
        let gather = |blob: &Blob, width: usize| -> Blob {
            let bytes = blob.bytes();
            let mut out = Vec::with_capacity(order.len() * width);
            for &r in order {
                assert!(r < self.rows, "gather_rows: row {r} out of {}", self.rows);
                out.extend_from_slice(&bytes[r * width..(r + 1) * width]);
            }
            Blob::from_vec(out)
        };
        let data = match &self.data {
            MatrixData::Dense { dtype, data } => MatrixData::Dense {
                dtype: *dtype,
                data: gather(data, row),
            },
            MatrixData::Affine {
                bits,
                group_size,
                codes,
                scales,
                biases,
                param_dtype,
            } => MatrixData::Affine {
                bits: *bits,
                group_size: *group_size,
                codes: gather(codes, row),
                scales: gather(scales, param_row),
                biases: gather(biases, param_row),
                param_dtype: *param_dtype,
            },
        };
        Matrix {
            rows: order.len(),
            cols: self.cols,
            data,
        }
    }

    /// Row-concatenation of matrices with the same columns and format (a copy). Panics on mixed
    /// formats: callers build the parts themselves (test checkpoints, fused-layout writers).
    pub fn concat_rows(parts: &[&Matrix]) -> Matrix {
        assert!(!parts.is_empty(), "concat_rows of nothing");
        let first = parts[0];
        for m in parts {
            assert_eq!(m.cols, first.cols, "concat_rows: column mismatch");
            assert_eq!(
                m.format_name(),
                first.format_name(),
                "concat_rows: mixed formats"
            );
        }
        // Blob `which` of each part: 0 = data/codes, 1 = scales, 2 = biases.
        let join = |which: usize| -> Blob {
            let mut out = Vec::new();
            for m in parts {
                let blob = match (&m.data, which) {
                    (MatrixData::Dense { data, .. }, _) => data,
                    (MatrixData::Affine { codes, .. }, 0) => codes,
                    (MatrixData::Affine { scales, .. }, 1) => scales,
                    (MatrixData::Affine { biases, .. }, _) => biases,
                };
                out.extend_from_slice(blob.bytes());
            }
            Blob::from_vec(out)
        };
        let data = match &first.data {
            MatrixData::Dense { dtype, .. } => MatrixData::Dense {
                dtype: *dtype,
                data: join(0),
            },
            MatrixData::Affine {
                bits,
                group_size,
                param_dtype,
                ..
            } => MatrixData::Affine {
                bits: *bits,
                group_size: *group_size,
                codes: join(0),
                scales: join(1),
                biases: join(2),
                param_dtype: *param_dtype,
            },
        };
        Matrix {
            rows: parts.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            data,
        }
    }

    /// Number of weights (rows × cols), whatever the format.
    pub fn num_params(&self) -> usize {
        self.rows * self.cols
    }

    /// The whole matrix as f32, row-major (tests and load-time conversions only).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_f32(r, row);
        }
        out
    }
}
