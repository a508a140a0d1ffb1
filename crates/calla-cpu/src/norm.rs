//! The three normalisations of the family, in f32 as transformers computes them.
//!
//! - zero-centred RMSNorm (input/post-attention/final norms, attention q_norm/k_norm):
//!   `y = x · rsqrt(mean(x²) + eps) · (1 + w)` — the weights hold `w` (see calla_model::weights).
//! - gated RMSNorm (DeltaNet output, per value head): `y = w · x · rsqrt(mean(x²) + eps) · silu(z)`.
//! - L2 norm (DeltaNet q and k, per key head): `y = x · rsqrt(Σx² + 1e-6)` (HF `l2norm`, eps inside).

/// Zero-centred RMSNorm of every row of `x` (rows of `w.len()`), in place.
pub fn rms_norm_zero_centred(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    debug_assert_eq!(x.len() % d, 0);
    for row in x.chunks_exact_mut(d) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for (v, w) in row.iter_mut().zip(w) {
            *v = *v * inv * (1.0 + w);
        }
    }
}

/// Zero-centred RMSNorm of `x` into `out` (same shapes).
pub fn rms_norm_zero_centred_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm_zero_centred(out, w, eps);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Gated RMSNorm of every row of `x` (rows of `w.len()`, one per (token, value head)) with gate rows
/// `z` of the same shape, in place: `x ← w · x̂ · silu(z)`.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    debug_assert_eq!(x.len(), z.len());
    for (row, gate) in x.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for ((v, w), z) in row.iter_mut().zip(w).zip(gate) {
            *v = w * (*v * inv) * silu(*z);
        }
    }
}

/// L2-normalise every row of `x` (rows of `d`) in place, HF style: `x · rsqrt(Σx² + 1e-6)`.
pub fn l2_norm(x: &mut [f32], d: usize) {
    for row in x.chunks_exact_mut(d) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        for v in row {
            *v *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::Rng;

    #[test]
    fn norms_match_their_formulas_in_f64() {
        let mut rng = Rng::new(3);
        let d = 19;
        let x = rng.normal_vec(3 * d, 2.0);
        let w = rng.normal_vec(d, 0.3);
        let z = rng.normal_vec(3 * d, 1.0);
        let eps = 1e-6f64;
        let mut zc = x.clone();
        rms_norm_zero_centred(&mut zc, &w, eps as f32);
        let mut gated = x.clone();
        gated_rms_norm(&mut gated, &z, &w, eps as f32);
        let mut l2 = x.clone();
        l2_norm(&mut l2, d);
        for r in 0..3 {
            let row: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|v| *v as f64).collect();
            let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let ss = row.iter().map(|v| v * v).sum::<f64>();
            for i in 0..d {
                let xhat = row[i] / (ms + eps).sqrt();
                let zi = z[r * d + i] as f64;
                let want_zc = xhat * (1.0 + w[i] as f64);
                let want_gated = w[i] as f64 * xhat * zi / (1.0 + (-zi).exp());
                let want_l2 = row[i] / (ss + 1e-6).sqrt();
                for (name, got, want) in [
                    ("zero-centred", zc[r * d + i], want_zc),
                    ("gated", gated[r * d + i], want_gated),
                    ("l2", l2[r * d + i], want_l2),
                ] {
                    assert!(
                        (got as f64 - want).abs() < 1e-5,
                        "{name} [{r},{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
