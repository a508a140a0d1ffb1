//! Qwen3-Next's interleaved DeltaNet projections → Qwen3.5's separate layout (transformers' `modeling_qwen3_next.py`).
//!
//! Qwen3-Next stores `in_proj_qkvz: [2·Hk·Dk + 2·Hv·Dv, D]` and `in_proj_ba: [2·Hv, D]` grouped per KEY
//! head g (r = Hv/Hk value heads per key head):
//!
//! ```text
//! in_proj_qkvz rows, block g (size 2·Dk + 2·r·Dv):  [ q_g (Dk) | k_g (Dk) | v_g (r·Dv) | z_g (r·Dv) ]
//! in_proj_ba   rows, block g (size 2·r):            [ b_g (r)  | a_g (r) ]
//! ```
//!
//! (HF `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`: view as `[.., Hk, block]`, split, then
//! `v`/`z` reshape to `[.., Hv, Dv]`, so value head `g·r + j` is the j-th of block g.)
//! The canonical layout is head-major and contiguous: `in_proj_qkv` = `[q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]`,
//! `in_proj_z` = `[Hv·Dv]`, `in_proj_b` / `in_proj_a` = `[Hv]`. Reordering is a row gather.

use crate::matrix::Matrix;
use crate::spec::ModelSpec;

/// For each canonical row of `[qkv | z]`, the row of `in_proj_qkvz` it comes from.
pub fn qkvz_source_rows(spec: &ModelSpec) -> Vec<usize> {
    let (hk, dk, dv) = (
        spec.linear_num_key_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    let r = spec.linear_num_value_heads / hk;
    let block = 2 * dk + 2 * r * dv;
    let mut order = Vec::with_capacity(hk * block);
    // q, k: head-major over key heads
    for offset in [0, dk] {
        for g in 0..hk {
            order.extend((0..dk).map(|d| g * block + offset + d));
        }
    }
    // v, z: the r value heads of block g are value heads g·r .. g·r + r - 1, in order
    for offset in [2 * dk, 2 * dk + r * dv] {
        for g in 0..hk {
            order.extend((0..r * dv).map(|j| g * block + offset + j));
        }
    }
    order
}

/// For each canonical row of `[b | a]`, the row of `in_proj_ba` it comes from.
pub fn ba_source_rows(spec: &ModelSpec) -> Vec<usize> {
    let hk = spec.linear_num_key_heads;
    let r = spec.linear_num_value_heads / hk;
    let mut order = Vec::with_capacity(2 * hk * r);
    for offset in [0, r] {
        for g in 0..hk {
            order.extend((0..r).map(|j| g * 2 * r + offset + j));
        }
    }
    order
}

/// The canonical DeltaNet input projections split out of Qwen3-Next's fused ones.
pub struct SplitProjections {
    pub in_proj_qkv: Matrix,
    pub in_proj_z: Matrix,
    pub in_proj_b: Matrix,
    pub in_proj_a: Matrix,
}

pub fn split_interleaved(spec: &ModelSpec, qkvz: &Matrix, ba: &Matrix) -> SplitProjections {
    let qkv_rows = spec.linear_conv_dim();
    let hv = spec.linear_num_value_heads;
    let qkvz_order = qkvz_source_rows(spec);
    let ba_order = ba_source_rows(spec);
    SplitProjections {
        in_proj_qkv: qkvz.gather_rows(&qkvz_order[..qkv_rows]),
        in_proj_z: qkvz.gather_rows(&qkvz_order[qkv_rows..]),
        in_proj_b: ba.gather_rows(&ba_order[..hv]),
        in_proj_a: ba.gather_rows(&ba_order[hv..]),
    }
}

/// The inverse: fuse canonical projections into Qwen3-Next's interleaved layout (for writing test
/// checkpoints). Returns (in_proj_qkvz, in_proj_ba).
pub fn fuse_interleaved(spec: &ModelSpec, p: &SplitProjections) -> (Matrix, Matrix) {
    let stacked_qkvz = Matrix::concat_rows(&[&p.in_proj_qkv, &p.in_proj_z]);
    let stacked_ba = Matrix::concat_rows(&[&p.in_proj_b, &p.in_proj_a]);
    (
        stacked_qkvz.gather_rows(&inverse(&qkvz_source_rows(spec))),
        stacked_ba.gather_rows(&inverse(&ba_source_rows(spec))),
    )
}

fn inverse(order: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; order.len()];
    for (canonical, &stored) in order.iter().enumerate() {
        inv[stored] = canonical;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Family, FeedForwardSpec};

    fn spec(hk: usize, hv: usize, dk: usize, dv: usize) -> ModelSpec {
        ModelSpec {
            family: Family::Qwen3Next,
            vocab_size: 8,
            hidden_size: 3,
            layers: vec![],
            rms_norm_eps: 1e-6,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            head_dim: 4,
            rotary_dim: 2,
            rope_theta: 1e4,
            attn_output_gate: true,
            linear_num_key_heads: hk,
            linear_num_value_heads: hv,
            linear_key_head_dim: dk,
            linear_value_head_dim: dv,
            linear_conv_kernel_dim: 4,
            feed_forward: FeedForwardSpec::Dense { intermediate: 4 },
            tie_word_embeddings: false,
            max_position_embeddings: 16,
            eos_token_ids: vec![],
        }
    }

    /// Hand-written example: Hk = 2, Dk = 2, Hv = 4, Dv = 1 (r = 2), block = 8 rows:
    /// block 0 = [q0.0 q0.1 k0.0 k0.1 v0 v1 z0 z1], block 1 = [q1.0 q1.1 k1.0 k1.1 v2 v3 z2 z3].
    #[test]
    fn hand_built_order_dv1() {
        let s = spec(2, 4, 2, 1);
        let order = qkvz_source_rows(&s);
        //                q0.0 q0.1 q1.0 q1.1 k0.0 k0.1 k1.0 k1.1 v0 v1 v2  v3 | z0 z1 z2  z3
        assert_eq!(
            order,
            vec![0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
        );
        // ba blocks: [b0 b1 a0 a1], [b2 b3 a2 a3]
        assert_eq!(ba_source_rows(&s), vec![0, 1, 4, 5, 2, 3, 6, 7]);
    }

    /// Hk = 1, Dk = 1, Hv = 2, Dv = 2 (r = 2): one block [q | k | v0.0 v0.1 v1.0 v1.1 | z0.0 z0.1 z1.0 z1.1].
    /// Value heads stay contiguous with their Dv dims.
    #[test]
    fn hand_built_order_dv2() {
        let s = spec(1, 2, 1, 2);
        assert_eq!(qkvz_source_rows(&s), (0..10).collect::<Vec<_>>());
        let s = spec(2, 2, 1, 2); // r = 1, block = 2 + 4 = 6: [q k v.0 v.1 z.0 z.1] per key head
                                  //                               q0 q1 k0 k1 v0.0 v0.1 v1.0 v1.1 z0.0 z0.1 z1.0 z1.1
        assert_eq!(
            qkvz_source_rows(&s),
            vec![0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11]
        );
        assert_eq!(ba_source_rows(&s), vec![0, 2, 1, 3]);
    }

    /// The split applied to a matrix whose rows are labelled by their stored index picks the right
    /// rows, and fuse_interleaved inverts it.
    #[test]
    fn split_then_fuse_round_trips() {
        let s = spec(2, 4, 2, 1);
        let cols = 3;
        let label = |rows: usize| {
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| (i / cols) as f32 + 0.25 * (i % cols) as f32)
                .collect();
            Matrix::dense_f32(rows, cols, &values)
        };
        let qkvz = label(16);
        let ba = label(8);
        let split = split_interleaved(&s, &qkvz, &ba);
        let first_col =
            |m: &Matrix| -> Vec<f32> { m.to_f32().chunks(cols).map(|r| r[0]).collect() };
        assert_eq!(
            first_col(&split.in_proj_qkv),
            vec![0., 1., 8., 9., 2., 3., 10., 11., 4., 5., 12., 13.]
        );
        assert_eq!(first_col(&split.in_proj_z), vec![6., 7., 14., 15.]);
        assert_eq!(first_col(&split.in_proj_b), vec![0., 1., 4., 5.]);
        assert_eq!(first_col(&split.in_proj_a), vec![2., 3., 6., 7.]);
        let (qkvz2, ba2) = fuse_interleaved(&s, &split);
        assert_eq!(qkvz2.to_f32(), qkvz.to_f32());
        assert_eq!(ba2.to_f32(), ba.to_f32());
    }
}
