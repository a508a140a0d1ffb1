//! Tests of the MLX affine rule, bit packing and error bounds (quant.rs).

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

fn affine_parts(m: &Matrix) -> (u32, usize, Vec<u32>, Vec<f32>, Vec<f32>) {
    match &m.data {
        MatrixData::Affine {
            bits,
            group_size,
            codes,
            scales,
            biases,
            param_dtype,
        } => {
            let codes: Vec<u32> = codes
                .bytes()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let read = |b: &Blob| {
                (0..b.len() / 2)
                    .map(|i| param_dtype.read(b.bytes(), i))
                    .collect()
            };
            (*bits, *group_size, codes, read(scales), read(biases))
        }
        _ => panic!("expected an affine matrix"),
    }
}

/// Element i of a row of packed codes.
fn code_at(words: &[u32], bits: u32, i: usize) -> u32 {
    let per_word = (32 / bits) as usize;
    (words[i / per_word] >> (bits as usize * (i % per_word))) & ((1 << bits) - 1)
}

#[test]
fn mlx_rule_positive_edge_gives_negative_scale() {
    // w in [-1, 2]: |max| wins, scale = -(3/15), edge 2 → q0 = -10, scale = 2/-10, bias = 2.
    let group: Vec<f32> = (0..64).map(|i| -1.0 + 3.0 * i as f32 / 63.0).collect();
    let (scale, bias) = affine_group_params(&group, 4);
    assert_eq!(bias, 2.0);
    assert_eq!(scale, 2.0f32 / -10.0);
    assert_eq!(affine_code(2.0, scale, bias, 4), 0);
    assert_eq!(affine_code(-1.0, scale, bias, 4), 15);
}

#[test]
fn mlx_rule_negative_edge() {
    // w in [-3, 1]: |min| wins, scale = 4/15, q0 = rint(-3 / (4/15)) = rint(-11.25) = -11.
    let mut group = vec![0.5f32; 64];
    group[0] = -3.0;
    group[1] = 1.0;
    let (scale, bias) = affine_group_params(&group, 4);
    assert_eq!(bias, -3.0);
    assert_eq!(scale, -3.0f32 / -11.0);
    assert_eq!(affine_code(-3.0, scale, bias, 4), 0);
    // (1 + 3) / 0.2727 = 14.67 → 15
    assert_eq!(affine_code(1.0, scale, bias, 4), 15);
}

#[test]
fn mlx_rule_constant_and_zero_groups_are_exact() {
    let m = quantize_values(1, 64, &[0.5; 64], 4, 64);
    assert!(m.to_f32().iter().all(|&v| v == 0.5));
    let m = quantize_values(1, 64, &[0.0; 64], 4, 64);
    assert!(m.to_f32().iter().all(|&v| v == 0.0));
    let (_, _, codes, _, biases) = affine_parts(&m);
    assert!(codes.iter().all(|&w| w == 0));
    assert_eq!(biases, vec![0.0]);
}

/// A worked check from the real MLX 4-bit checkpoint: word 0xEEDEFCEE holds the nibbles
/// [14, 14, 12, 15, 14, 13, 14, 14], low nibble first.
#[test]
fn packing_is_low_nibble_first() {
    let word: u32 = 0xEEDE_FCEE;
    let nibbles: Vec<u32> = (0..8).map(|j| code_at(&[word], 4, j)).collect();
    assert_eq!(nibbles, vec![14, 14, 12, 15, 14, 13, 14, 14]);
    let (scale, bias) = (bf16::from_f32(0.00148), bf16::from_f32(-0.02075));
    let mut words = vec![word; 64 / 8];
    words[1] = 0x0000_0001;
    let m = Matrix {
        rows: 1,
        cols: 64,
        data: MatrixData::Affine {
            bits: 4,
            group_size: 64,
            codes: Blob::from_pod_vec(words),
            scales: Blob::from_pod_vec(vec![scale]),
            biases: Blob::from_pod_vec(vec![bias]),
            param_dtype: DType::BF16,
        },
    };
    let w = m.to_f32();
    for (j, &q) in nibbles.iter().enumerate() {
        assert_eq!(w[j], scale.to_f32() * q as f32 + bias.to_f32());
    }
    assert_eq!(w[8], scale.to_f32() + bias.to_f32());
    assert_eq!(w[9], bias.to_f32());
}

/// Values built as s·q + b with bf16-exact s, b and both code ends present in every group: the
/// codes come back exactly, and so do the values.
#[test]
fn packed_codes_round_trip() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for bits in [4u32, 8] {
        for group_size in [32usize, 64, 128] {
            let n = (1u32 << bits) - 1;
            let (rows, cols) = (3, 256);
            // b = -1, s = 1/(n+1): |min| = 1 > |max| = 1/(n+1) so the rule keeps s and b exactly.
            let (s, b) = (1.0 / (n + 1) as f32, -1.0f32);
            let mut q: Vec<u32> = (0..rows * cols).map(|_| rng.random_range(0..=n)).collect();
            for g in 0..rows * cols / group_size {
                q[g * group_size] = 0;
                q[g * group_size + 1] = n;
            }
            let values: Vec<f32> = q.iter().map(|&c| s * c as f32 + b).collect();
            let m = quantize_values(rows, cols, &values, bits, group_size);
            let (got_bits, got_group, words, scales, biases) = affine_parts(&m);
            assert_eq!((got_bits, got_group), (bits, group_size));
            let words_per_row = cols * bits as usize / 32;
            for r in 0..rows {
                for c in 0..cols {
                    let code = code_at(&words[r * words_per_row..], bits, c);
                    assert_eq!(code, q[r * cols + c], "bits {bits} g{group_size} ({r},{c})");
                }
            }
            assert!(scales.iter().all(|&x| x == s) && biases.iter().all(|&x| x == b));
            assert_eq!(m.to_f32(), values);
        }
    }
}

/// Random N(0, 1) rows: every element is within scale/2 (plus the clamping allowance of MLX's
/// edge-exact rule, plus the bf16 rounding of scale and bias) of the original.
#[test]
fn quantisation_error_is_bounded() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    for bits in [4u32, 8] {
        for group_size in [32usize, 64, 128] {
            let (rows, cols) = (7, 384);
            let values: Vec<f32> = (0..rows * cols).map(|_| normal.sample(&mut rng)).collect();
            let m = quantize_values(rows, cols, &values, bits, group_size);
            let deq = m.to_f32();
            let n = ((1u32 << bits) - 1) as f32;
            let mut worst_ratio = 0f32;
            for (g, group) in values.chunks(group_size).enumerate() {
                let (scale, bias) = affine_group_params(group, bits);
                let (lo, hi) = group
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                let clamp_allowance = ((hi - lo) - n * scale.abs()).max(0.0);
                let bf16_allowance = (scale.abs() * n + bias.abs()) * 2f32.powi(-8);
                let bound = scale.abs() / 2.0 + clamp_allowance + bf16_allowance + 1e-6;
                for (j, &w) in group.iter().enumerate() {
                    let err = (deq[g * group_size + j] - w).abs();
                    assert!(
                        err <= bound,
                        "bits {bits} g{group_size}: |err| {err} > {bound}"
                    );
                    worst_ratio = worst_ratio.max(err / scale.abs());
                }
            }
            // At 4 bits the worst error stays near half a step. At 8 bits the bf16 rounding of
            // scale and bias (2^-9 relative, times up to 255 steps) dominates: no step-based check.
            if bits == 4 {
                assert!(
                    worst_ratio < 1.2,
                    "bits {bits} g{group_size}: worst error {worst_ratio} steps"
                );
            }
        }
    }
}

#[test]
fn dense_conversions() {
    let values = [1.0f32, -2.5, 3.3, 1e-3, 65504.0, -0.0];
    let m = Matrix::dense_f32(2, 3, &values);
    let b = to_dense(&m, DType::BF16);
    assert_eq!(b.format_name(), "bf16");
    let expect: Vec<f32> = values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(b.to_f32(), expect);
    let back = to_dense(&b, DType::F32);
    assert_eq!(back.to_f32(), expect);
    // Dequantising an affine matrix to f32 gives exactly its row_f32 values.
    let q = quantize_values(
        2,
        64,
        &(0..128).map(|i| (i as f32).sin()).collect::<Vec<_>>(),
        4,
        32,
    );
    assert_eq!(to_dense(&q, DType::F32).to_f32(), q.to_f32());
}
