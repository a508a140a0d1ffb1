//! Synthetic models: [`ModelSpec`] presets by name and seeded random [`Weights`] of realistic scale,
//! for the CPU benchmark and tests (no checkpoint needed).
//!
//! Values: matrices ~ N(0, 1/fan_in); zero-centred norms ~ N(0, 0.05²) (so the applied gain 1 + w is
//! near 1); the DeltaNet gated-norm gain ~ 1 + N(0, 0.05²); conv taps ~ N(0, 1/K);
//! A_log = ln U(1, 16) (HF's init); dt_bias ~ N(0, 0.1²).
//! Every matrix is generated in blocks of rows, each block from its own ChaCha8 stream keyed by
//! (seed, matrix name, block), so the result does not depend on the number of threads, and quantised
//! formats are quantised block by block (no full-size f32 copy of the 248k-row embedding).

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

use crate::load::{Quant, QUANT_GROUP_SIZE};
use crate::matrix::{Blob, DType, Matrix, MatrixData};
use crate::quant::{quantize_row, AffineBuffers};
use crate::spec::{Family, FeedForwardSpec, LayerKind, ModelSpec};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, FeedForwardWeights, LayerWeights, MixerWeights, MlpWeights,
    MoeWeights, Weights,
};

/// Names accepted by [`preset`].
pub const PRESETS: [&str; 3] = ["qwen3.6-35b-a3b", "cpu-mid", "tiny"];

fn hybrid_layers(groups: usize) -> Vec<LayerKind> {
    (0..4 * groups)
        .map(|i| {
            if i % 4 == 3 {
                LayerKind::Attention
            } else {
                LayerKind::DeltaNet
            }
        })
        .collect()
}

/// A spec by name: `qwen3.6-35b-a3b` (the real dims, Qwen/Qwen3.6-35B-A3B's text_config), `cpu-mid` (a mid-size model for
/// CPU benchmarks), `tiny` (the fixtures' dims).
pub fn preset(name: &str) -> Option<ModelSpec> {
    let moe = |num_experts, top_k, expert_intermediate, shared_intermediate| FeedForwardSpec::Moe {
        num_experts,
        top_k,
        expert_intermediate,
        shared_intermediate,
        norm_topk_prob: true,
    };
    let spec = match name {
        "qwen3.6-35b-a3b" => ModelSpec {
            family: Family::Qwen35Moe,
            vocab_size: 248_320,
            hidden_size: 2048,
            layers: hybrid_layers(10),
            rms_norm_eps: 1e-6,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 1e7,
            attn_output_gate: true,
            linear_num_key_heads: 16,
            linear_num_value_heads: 32,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            feed_forward: moe(256, 8, 512, 512),
            tie_word_embeddings: false,
            max_position_embeddings: 262_144,
            eos_token_ids: vec![248_046, 248_044],
        },
        "cpu-mid" => ModelSpec {
            family: Family::Qwen35Moe,
            vocab_size: 32_000,
            hidden_size: 1024,
            layers: hybrid_layers(2),
            rms_norm_eps: 1e-6,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim: 128,
            rotary_dim: 32,
            rope_theta: 1e7,
            attn_output_gate: true,
            linear_num_key_heads: 8,
            linear_num_value_heads: 16,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            feed_forward: moe(64, 8, 256, 256),
            tie_word_embeddings: false,
            max_position_embeddings: 32_768,
            eos_token_ids: vec![1],
        },
        "tiny" => ModelSpec {
            family: Family::Qwen35Moe,
            vocab_size: 512,
            hidden_size: 128,
            layers: hybrid_layers(1),
            rms_norm_eps: 1e-6,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rotary_dim: 8,
            rope_theta: 1e7,
            attn_output_gate: true,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 32,
            linear_value_head_dim: 32,
            linear_conv_kernel_dim: 4,
            feed_forward: moe(8, 2, 64, 64),
            tie_word_embeddings: false,
            max_position_embeddings: 4096,
            eos_token_ids: vec![1],
        },
        _ => return None,
    };
    Some(spec)
}

const ROWS_PER_BLOCK: usize = 16;

/// FNV-1a of a name, mixed with the seed: the stream key of one tensor.
fn tensor_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn block_rng(key: u64, block: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(key);
    rng.set_stream(block as u64);
    rng
}

/// How one synthetic matrix is stored.
#[derive(Clone, Copy)]
enum Format {
    Dense(DType),
    Affine(u32),
}

fn format_for(quant: Quant, cols: usize, is_gate: bool) -> Format {
    match quant {
        Quant::F32 => Format::Dense(DType::F32),
        Quant::Bf16 => Format::Dense(DType::BF16),
        Quant::Q4 | Quant::Q8 if cols % QUANT_GROUP_SIZE != 0 => Format::Dense(DType::BF16),
        Quant::Q4 if !is_gate => Format::Affine(4),
        Quant::Q4 | Quant::Q8 => Format::Affine(8),
    }
}

/// A `[rows, cols]` matrix with entries ~ N(0, std²).
fn random_matrix(rows: usize, cols: usize, std: f32, format: Format, key: u64) -> Matrix {
    let normal = Normal::new(0.0f32, std).expect("finite std");
    let fill = |block: usize, buf: &mut [f32]| {
        let mut rng = block_rng(key, block);
        buf.iter_mut().for_each(|x| *x = normal.sample(&mut rng));
    };
    match format {
        Format::Dense(dtype) => {
            fn build<T: bytemuck::Pod + Send + Sync + Default>(
                rows: usize,
                cols: usize,
                fill: &(dyn Fn(usize, &mut [f32]) + Sync),
                convert: fn(f32) -> T,
            ) -> Blob {
                let mut out = vec![T::default(); rows * cols];
                out.par_chunks_mut(ROWS_PER_BLOCK * cols)
                    .enumerate()
                    .for_each(|(block, dst)| {
                        let mut values = vec![0f32; dst.len()];
                        fill(block, &mut values);
                        dst.iter_mut()
                            .zip(&values)
                            .for_each(|(o, &v)| *o = convert(v));
                    });
                Blob::from_pod_vec(out)
            }
            let data = match dtype {
                DType::F32 => build::<f32>(rows, cols, &fill, |v| v),
                DType::BF16 => build::<bf16>(rows, cols, &fill, bf16::from_f32),
                DType::F16 => build::<f16>(rows, cols, &fill, f16::from_f32),
            };
            Matrix {
                rows,
                cols,
                data: MatrixData::Dense { dtype, data },
            }
        }
        Format::Affine(bits) => {
            let group = QUANT_GROUP_SIZE;
            let mut buffers = AffineBuffers::new(rows, cols, bits, group);
            let (wpr, gpr) = (buffers.words_per_row, buffers.groups_per_row);
            buffers
                .codes
                .par_chunks_mut(ROWS_PER_BLOCK * wpr)
                .zip(buffers.scales.par_chunks_mut(ROWS_PER_BLOCK * gpr))
                .zip(buffers.biases.par_chunks_mut(ROWS_PER_BLOCK * gpr))
                .enumerate()
                .for_each(|(block, ((codes, scales), biases))| {
                    let block_rows = codes.len() / wpr;
                    let mut values = vec![0f32; block_rows * cols];
                    fill(block, &mut values);
                    for r in 0..block_rows {
                        quantize_row(
                            &values[r * cols..(r + 1) * cols],
                            bits,
                            group,
                            &mut codes[r * wpr..(r + 1) * wpr],
                            &mut scales[r * gpr..(r + 1) * gpr],
                            &mut biases[r * gpr..(r + 1) * gpr],
                        );
                    }
                });
            buffers.into_matrix(rows, cols, bits, group)
        }
    }
}

struct Generator {
    seed: u64,
    quant: Quant,
    /// Some = placeholder mode: every matrix is a view of this shared zero buffer.
    zeros: Option<Blob>,
}

/// A matrix of `format` whose blobs are views of `zeros` (no allocation of its own).
fn placeholder_matrix(rows: usize, cols: usize, format: Format, zeros: &Blob) -> Matrix {
    let data = match format {
        Format::Dense(dtype) => MatrixData::Dense {
            dtype,
            data: zeros.slice(0, rows * cols * dtype.size()),
        },
        Format::Affine(bits) => {
            let groups = rows * cols / QUANT_GROUP_SIZE;
            MatrixData::Affine {
                bits,
                group_size: QUANT_GROUP_SIZE,
                codes: zeros.slice(0, rows * cols * bits as usize / 8),
                scales: zeros.slice(0, groups * 2),
                biases: zeros.slice(0, groups * 2),
                param_dtype: DType::BF16,
            }
        }
    };
    Matrix { rows, cols, data }
}

impl Generator {
    /// A linear layer `[out, in]` ~ N(0, 1/in).
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Matrix {
        self.matrix(name, rows, cols, false)
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize, is_gate: bool) -> Matrix {
        let format = format_for(self.quant, cols, is_gate);
        if let Some(zeros) = &self.zeros {
            return placeholder_matrix(rows, cols, format, zeros);
        }
        let std = 1.0 / (cols as f32).sqrt();
        random_matrix(rows, cols, std, format, tensor_key(self.seed, name))
    }
    fn normal(&self, name: &str, len: usize, mean: f32, std: f32) -> Vec<f32> {
        let mut rng = block_rng(tensor_key(self.seed, name), 0);
        let normal = Normal::new(mean, std).expect("finite std");
        (0..len).map(|_| normal.sample(&mut rng)).collect()
    }
    fn a_log(&self, name: &str, len: usize) -> Vec<f32> {
        let mut rng = block_rng(tensor_key(self.seed, name), 0);
        (0..len)
            .map(|_| rng.random_range(1.0f32..16.0).ln())
            .collect()
    }
    fn mlp(&self, prefix: &str, d: usize, i: usize) -> MlpWeights {
        MlpWeights {
            gate_proj: self.linear(&format!("{prefix}.gate_proj"), i, d),
            up_proj: self.linear(&format!("{prefix}.up_proj"), i, d),
            down_proj: self.linear(&format!("{prefix}.down_proj"), d, i),
        }
    }

    fn layer(&self, spec: &ModelSpec, i: usize, kind: LayerKind) -> LayerWeights {
        let d = spec.hidden_size;
        let p = |m: &str| format!("layers.{i}.{m}");
        let mixer = match kind {
            LayerKind::DeltaNet => MixerWeights::DeltaNet(DeltaNetWeights {
                in_proj_qkv: self.linear(&p("in_proj_qkv"), spec.linear_conv_dim(), d),
                in_proj_z: self.linear(&p("in_proj_z"), spec.linear_value_dim(), d),
                in_proj_b: self.linear(&p("in_proj_b"), spec.linear_num_value_heads, d),
                in_proj_a: self.linear(&p("in_proj_a"), spec.linear_num_value_heads, d),
                conv1d: self.normal(
                    &p("conv1d"),
                    spec.linear_conv_dim() * spec.linear_conv_kernel_dim,
                    0.0,
                    1.0 / (spec.linear_conv_kernel_dim as f32).sqrt(),
                ),
                a_log: self.a_log(&p("A_log"), spec.linear_num_value_heads),
                dt_bias: self.normal(&p("dt_bias"), spec.linear_num_value_heads, 0.0, 0.1),
                norm: self.normal(&p("gated_norm"), spec.linear_value_head_dim, 1.0, 0.05),
                out_proj: self.linear(&p("out_proj"), d, spec.linear_value_dim()),
            }),
            LayerKind::Attention => MixerWeights::Attention(AttentionWeights {
                q_proj: self.linear(&p("q_proj"), spec.q_proj_rows(), d),
                k_proj: self.linear(&p("k_proj"), spec.kv_dim(), d),
                v_proj: self.linear(&p("v_proj"), spec.kv_dim(), d),
                o_proj: self.linear(&p("o_proj"), d, spec.num_attention_heads * spec.head_dim),
                q_norm: self.normal(&p("q_norm"), spec.head_dim, 0.0, 0.05),
                k_norm: self.normal(&p("k_norm"), spec.head_dim, 0.0, 0.05),
            }),
        };
        let feed_forward = match spec.feed_forward {
            FeedForwardSpec::Dense { intermediate } => {
                FeedForwardWeights::Dense(self.mlp(&p("mlp"), d, intermediate))
            }
            FeedForwardSpec::Moe {
                num_experts,
                expert_intermediate,
                shared_intermediate,
                ..
            } => FeedForwardWeights::Moe(MoeWeights {
                router: self.matrix(&p("router"), num_experts, d, true),
                experts: (0..num_experts)
                    .into_par_iter()
                    .map(|e| self.mlp(&p(&format!("experts.{e}")), d, expert_intermediate))
                    .collect(),
                shared_expert: (shared_intermediate > 0)
                    .then(|| self.mlp(&p("shared_expert"), d, shared_intermediate)),
                shared_expert_gate: (shared_intermediate > 0)
                    .then(|| self.matrix(&p("shared_expert_gate"), 1, d, true)),
            }),
        };
        LayerWeights {
            input_layernorm: self.normal(&p("input_layernorm"), d, 0.0, 0.05),
            post_attention_layernorm: self.normal(&p("post_attention_layernorm"), d, 0.0, 0.05),
            mixer,
            feed_forward,
        }
    }
}

/// Seeded random weights for `spec`, generated in parallel and stored in `quant`'s format
/// (Q4/Q8: MLX affine group 64 with an 8-bit router and shared-expert gate, as a `--quant` load makes
/// them; matrices whose inputs are not a multiple of 64 stay bf16).
pub fn random_weights(spec: &ModelSpec, quant: Quant, seed: u64) -> Weights {
    build_weights(
        spec,
        Generator {
            seed,
            quant,
            zeros: None,
        },
    )
}

/// Weights of the right shapes and formats whose matrices are all views of ONE shared zero buffer
/// (the size of the largest matrix, allocated zeroed so untouched pages cost nothing): for sizing,
/// byte counts and memory planning of full-size models without generating them. Vectors are real
/// (small) values as in [`random_weights`].
pub fn placeholder_weights(spec: &ModelSpec, quant: Quant) -> Weights {
    let d = spec.hidden_size;
    let widest_rows = [
        spec.vocab_size,
        spec.q_proj_rows(),
        spec.linear_conv_dim(),
        spec.linear_value_dim(),
        d,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let widest_cols = [
        d,
        spec.linear_value_dim(),
        spec.num_attention_heads * spec.head_dim,
    ]
    .into_iter()
    .chain(match spec.feed_forward {
        FeedForwardSpec::Dense { intermediate } => vec![intermediate],
        FeedForwardSpec::Moe {
            expert_intermediate,
            shared_intermediate,
            num_experts,
            ..
        } => {
            vec![expert_intermediate, shared_intermediate, num_experts]
        }
    })
    .max()
    .unwrap_or(0);
    let zeros = Blob::from_pod_vec(vec![
        0u32;
        widest_rows.max(widest_cols) * widest_cols.max(d)
    ]);
    build_weights(
        spec,
        Generator {
            seed: 0,
            quant,
            zeros: Some(zeros),
        },
    )
}

fn build_weights(spec: &ModelSpec, g: Generator) -> Weights {
    let (quant, seed) = (g.quant, g.seed);
    let d = spec.hidden_size;
    let layers: Vec<LayerWeights> = spec
        .layers
        .par_iter()
        .enumerate()
        .map(|(i, &kind)| g.layer(spec, i, kind))
        .collect();
    // Embedding rows ~ N(0, 1): a lookup, not a product, so no fan-in scaling.
    let embed_format = format_for(quant, d, false);
    let embed_tokens = match &g.zeros {
        Some(zeros) => placeholder_matrix(spec.vocab_size, d, embed_format, zeros),
        None => random_matrix(
            spec.vocab_size,
            d,
            1.0,
            embed_format,
            tensor_key(seed, "embed_tokens"),
        ),
    };
    let lm_head = if spec.tie_word_embeddings {
        embed_tokens.clone()
    } else {
        g.linear("lm_head", spec.vocab_size, d)
    };
    Weights {
        embed_tokens,
        layers,
        final_norm: g.normal("final_norm", d, 0.0, 0.05),
        lm_head,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::stats::weight_stats;

    #[test]
    fn presets_have_the_documented_dims() {
        let real = preset("qwen3.6-35b-a3b").unwrap();
        assert_eq!(real.num_layers(), 40);
        assert_eq!(real.num_attention_layers(), 10);
        assert_eq!(real.linear_conv_dim(), 8192);
        let mid = preset("cpu-mid").unwrap();
        assert_eq!(
            (mid.hidden_size, mid.num_layers(), mid.vocab_size),
            (1024, 8, 32000)
        );
        assert_eq!(mid.layers[3], LayerKind::Attention);
        assert_eq!(mid.layers[4], LayerKind::DeltaNet);
        assert!(preset("nope").is_none());
        for name in PRESETS {
            let spec = preset(name).unwrap();
            // Each preset round-trips through the config validator (consistent dims).
            let json = crate::weights::export::config_json(&spec, false, None);
            let parsed = crate::config::ModelConfig::from_json(&json)
                .unwrap()
                .to_spec()
                .unwrap();
            assert_eq!(parsed, spec, "{name}");
        }
    }

    #[test]
    fn random_weights_are_seeded_and_of_realistic_scale() {
        let spec = preset("tiny").unwrap();
        let a = random_weights(&spec, Quant::F32, 5);
        let b = random_weights(&spec, Quant::F32, 5);
        let c = random_weights(&spec, Quant::F32, 6);
        let q = |w: &Weights| match &w.layers[0].mixer {
            MixerWeights::DeltaNet(dn) => dn.in_proj_qkv.to_f32(),
            _ => unreachable!(),
        };
        assert_eq!(q(&a), q(&b));
        assert_ne!(q(&a), q(&c));
        let values = q(&a);
        let std = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
        let expected = 1.0 / (spec.hidden_size as f32).sqrt();
        assert!(
            (std / expected - 1.0).abs() < 0.05,
            "std {std} vs {expected}"
        );
        match &a.layers[0].mixer {
            MixerWeights::DeltaNet(dn) => {
                assert!(dn.a_log.iter().all(|&x| (0.0..16f32.ln()).contains(&x)));
                assert!(dn.norm.iter().all(|&x| (x - 1.0).abs() < 0.3));
            }
            _ => unreachable!(),
        }
        assert!(a.final_norm.iter().all(|x| x.abs() < 0.3));
    }

    /// The real model's sizes from shapes alone: ≈ 35B parameters, ≈ 19.5 GB at
    /// MLX 4-bit, ≈ 1.65 GB of weights read per decoded token.
    #[test]
    fn full_size_byte_counts_match_the_reference() {
        let spec = preset("qwen3.6-35b-a3b").unwrap();
        let q4 = weight_stats(&spec, &placeholder_weights(&spec, Quant::Q4));
        let params_b = q4.total_params as f64 / 1e9;
        assert!((34.0..36.5).contains(&params_b), "{params_b} B params");
        let gb = q4.total_bytes as f64 / 1e9;
        assert!((19.0..20.5).contains(&gb), "{gb} GB at 4-bit");
        let per_token = q4.bytes_per_token as f64 / 1e9;
        assert!(
            (1.6..1.75).contains(&per_token),
            "{per_token} GB per token at 4-bit"
        );
        let bf16 = weight_stats(&spec, &placeholder_weights(&spec, Quant::Bf16));
        let gb = bf16.total_bytes as f64 / 1e9;
        eprintln!(
            "qwen3.6-35b-a3b: {params_b:.2} B params; q4 {:.2} GB, {per_token:.3} GB/token; bf16 {gb:.2} GB, {:.3} GB/token",
            q4.total_bytes as f64 / 1e9,
            bf16.bytes_per_token as f64 / 1e9
        );
        assert!((68.0..72.0).contains(&gb), "{gb} GB at bf16");
    }

    #[test]
    fn quantised_random_weights_match_quantising_the_dense_ones() {
        let spec = preset("tiny").unwrap();
        let dense = random_weights(&spec, Quant::F32, 9);
        let q4 = random_weights(&spec, Quant::Q4, 9);
        let pick = |w: &Weights| match &w.layers[1].feed_forward {
            FeedForwardWeights::Moe(moe) => (moe.experts[3].up_proj.clone(), moe.router.clone()),
            _ => unreachable!(),
        };
        let (dense_up, dense_router) = pick(&dense);
        let (q_up, q_router) = pick(&q4);
        assert_eq!(q_up.format_name(), "q4g64");
        assert_eq!(q_router.format_name(), "q8g64");
        let direct = crate::quant::quantize_affine(&dense_up, 4, 64);
        assert_eq!(q_up.to_f32(), direct.to_f32());
        let stats = weight_stats(&spec, &q4);
        assert!(stats.formats.contains_key("q4g64") && stats.formats.contains_key("q8g64"));
        assert_eq!(dense_router.rows, 8);
    }
}
