//! The inner loops of the matvec: dot products of one stored weight row with an f32 vector, and the
//! decoding of a stored row to f32.
//!
//! Each loop is written once as plain Rust over fixed-size lane arrays (which LLVM vectorises) and
//! compiled twice by `dispatch!`: for the baseline target and with AVX2+FMA, picked at run time. The
//! arithmetic (and so the result) is identical in both: no fused multiply-adds are requested, lanes are
//! reduced in the same fixed order.
//!
//! Quantised rows follow MLX's affine format (see `calla_model::MatrixData::Affine`): element j of a
//! little-endian u32 code word is `(word >> bits·j) & mask`, and `w = scale·q + bias` per group of G
//! columns. The dot products use `Σ_c w_c x_c = Σ_g (scale_g · Σ_{c∈g} q_c x_c + bias_g · Σ_{c∈g} x_c)`,
//! with the per-group sums of x computed once per input vector (`group_sums`).

/// Lanes of the f32 accumulators: 4 AVX registers, enough independent adds to hide latency.
const LANES: usize = 32;

macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: avx2() only differs from portable() in the target features it may use,
                    // and this CPU has both of them.
                    return unsafe { avx2($($arg),*) };
                }
            }
            portable($($arg),*)
        }
    };
}

/// Sum of the lanes in a fixed order (pairwise halving), so results do not depend on the code path.
#[inline(always)]
fn reduce<const N: usize>(mut acc: [f32; N]) -> f32 {
    let mut width = N;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            acc[j] += acc[j + width];
        }
    }
    acc[0]
}

dispatch! {
    /// `Σ a_i b_i` over f32 slices of equal length.
    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        let mut acc = [0f32; LANES];
        let body = a.len() / LANES * LANES;
        for (ca, cb) in a[..body].chunks_exact(LANES).zip(b[..body].chunks_exact(LANES)) {
            for j in 0..LANES {
                acc[j] += ca[j] * cb[j];
            }
        }
        let mut sum = reduce(acc);
        for (x, y) in a[body..].iter().zip(&b[body..]) {
            sum += x * y;
        }
        sum
    }
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

dispatch! {
    /// `Σ w_i x_i` with w stored as bf16 bit patterns.
    pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
        debug_assert_eq!(w.len(), x.len());
        let mut acc = [0f32; LANES];
        let body = w.len() / LANES * LANES;
        for (cw, cx) in w[..body].chunks_exact(LANES).zip(x[..body].chunks_exact(LANES)) {
            for j in 0..LANES {
                acc[j] += bf16_to_f32(cw[j]) * cx[j];
            }
        }
        let mut sum = reduce(acc);
        for (w, x) in w[body..].iter().zip(&x[body..]) {
            sum += bf16_to_f32(*w) * x;
        }
        sum
    }
}

dispatch! {
    /// bf16 bit patterns to f32.
    pub fn decode_bf16(w: &[u16], out: &mut [f32]) {
        for (o, w) in out.iter_mut().zip(w) {
            *o = bf16_to_f32(*w);
        }
    }
}

/// Per-group sums of x: `sums[g] = Σ_{c in group g} x_c` (input to the affine dot products).
pub fn group_sums(x: &[f32], group_size: usize, sums: &mut [f32]) {
    for (s, g) in sums.iter_mut().zip(x.chunks_exact(group_size)) {
        *s = g.iter().sum();
    }
}

/// Shifts that take element j out of a 4-bit code word: 8 elements per word.
const Q4_SHIFTS: [u32; 8] = [0, 4, 8, 12, 16, 20, 24, 28];

/// Split x into its even and odd columns (`even[i] = x[2i]`, `odd[i] = x[2i+1]`): byte i of a 4-bit
/// row holds column 2i in its low nibble and 2i+1 in its high nibble, so with x split this way the
/// 4-bit dot product runs over bytes with contiguous loads, like the 8-bit one.
pub fn split_even_odd(x: &[f32], even: &mut [f32], odd: &mut [f32]) {
    for ((pair, e), o) in x.chunks_exact(2).zip(even.iter_mut()).zip(odd.iter_mut()) {
        *e = pair[0];
        *o = pair[1];
    }
}

dispatch! {
    /// `Σ_c w_c x_c` for one 4-bit affine row: `codes` are its cols/2 bytes, `scales`/`biases` its
    /// cols/G group parameters, `x_even`/`x_odd` from `split_even_odd`, `x_group_sums` the per-group
    /// sums of x. G is a multiple of 16.
    pub fn dot_q4(
        codes: &[u8],
        scales: &[f32],
        biases: &[f32],
        group_size: usize,
        x_even: &[f32],
        x_odd: &[f32],
        x_group_sums: &[f32],
    ) -> f32 {
        let half = group_size / 2;
        let mut acc = [0f32; 8];
        let mut bias_term = 0f32;
        for (g, ((group_codes, xe), xo)) in codes
            .chunks_exact(half)
            .zip(x_even.chunks_exact(half))
            .zip(x_odd.chunks_exact(half))
            .enumerate()
        {
            // Σ_{c in g} q_c x_c, kept in 8 lanes
            let mut group_acc = [0f32; 8];
            for ((c8, e8), o8) in group_codes.chunks_exact(8).zip(xe.chunks_exact(8)).zip(xo.chunks_exact(8)) {
                for j in 0..8 {
                    group_acc[j] += (c8[j] & 0xF) as f32 * e8[j] + (c8[j] >> 4) as f32 * o8[j];
                }
            }
            let scale = scales[g];
            for j in 0..8 {
                acc[j] += scale * group_acc[j];
            }
            bias_term += biases[g] * x_group_sums[g];
        }
        reduce(acc) + bias_term
    }
}

dispatch! {
    /// `Σ_c w_c x_c` for one 8-bit affine row; `codes` are the row's bytes (element j of a little-endian
    /// word is byte j, so the byte order is the column order). G is a multiple of 8.
    pub fn dot_q8(
        codes: &[u8],
        scales: &[f32],
        biases: &[f32],
        group_size: usize,
        x: &[f32],
        x_group_sums: &[f32],
    ) -> f32 {
        let mut acc = [0f32; 8];
        let mut bias_term = 0f32;
        for (g, (group_codes, group_x)) in codes
            .chunks_exact(group_size)
            .zip(x.chunks_exact(group_size))
            .enumerate()
        {
            let mut group_acc = [0f32; 8];
            for (c8, x8) in group_codes.chunks_exact(8).zip(group_x.chunks_exact(8)) {
                for j in 0..8 {
                    group_acc[j] += c8[j] as f32 * x8[j];
                }
            }
            let scale = scales[g];
            for j in 0..8 {
                acc[j] += scale * group_acc[j];
            }
            bias_term += biases[g] * x_group_sums[g];
        }
        reduce(acc) + bias_term
    }
}

dispatch! {
    /// One 4-bit affine row to f32: `out[c] = scale[c/G]·q_c + bias[c/G]`.
    pub fn decode_q4(words: &[u32], scales: &[f32], biases: &[f32], group_size: usize, out: &mut [f32]) {
        let words_per_group = group_size / 8;
        for (g, (group_words, group_out)) in words
            .chunks_exact(words_per_group)
            .zip(out.chunks_exact_mut(group_size))
            .enumerate()
        {
            let (scale, bias) = (scales[g], biases[g]);
            for (word, o8) in group_words.iter().zip(group_out.chunks_exact_mut(8)) {
                for j in 0..8 {
                    o8[j] = scale * ((*word >> Q4_SHIFTS[j]) & 0xF) as f32 + bias;
                }
            }
        }
    }
}

dispatch! {
    /// One 8-bit affine row (its bytes) to f32.
    pub fn decode_q8(codes: &[u8], scales: &[f32], biases: &[f32], group_size: usize, out: &mut [f32]) {
        for (g, (group_codes, group_out)) in codes
            .chunks_exact(group_size)
            .zip(out.chunks_exact_mut(group_size))
            .enumerate()
        {
            let (scale, bias) = (scales[g], biases[g]);
            for (c, o) in group_codes.iter().zip(group_out.iter_mut()) {
                *o = scale * *c as f32 + bias;
            }
        }
    }
}

dispatch! {
    /// `y += a·x`
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y += a * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::Rng;

    #[test]
    fn dot_products_match_plain_sums_on_odd_lengths() {
        let mut rng = Rng::new(7);
        for n in [1, 7, 31, 32, 33, 150, 2048] {
            let a = rng.normal_vec(n, 1.0);
            let b = rng.normal_vec(n, 1.0);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot_f32(&a, &b) as f64;
            assert!(
                (got - want).abs() < 1e-4 * (n as f64).sqrt(),
                "n={n}: {got} vs {want}"
            );
            let w16: Vec<u16> = a
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let want16: f64 = w16
                .iter()
                .zip(&b)
                .map(|(w, x)| half::bf16::from_bits(*w).to_f64() * *x as f64)
                .sum();
            let got16 = dot_bf16(&w16, &b) as f64;
            assert!(
                (got16 - want16).abs() < 1e-4 * (n as f64).sqrt(),
                "bf16 n={n}"
            );
        }
    }
}
