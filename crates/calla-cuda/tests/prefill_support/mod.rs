//! Shared by the prefill tests: the GPU (or a skip), seeded random weights in
//! every format (a threaded generator for the real expert stacks), upload helpers and the evidence-
//! printing comparison (max error, where, % of tolerance, first pairs).
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

use calla_cpu::random::{quantise_affine, Rng};
use calla_cuda::ops::gemm::Planes;
use calla_cuda::ops::weights::{DevMatrix, Uploader};
use calla_cuda::runtime::gpu::{DPtr, Gpu, Launch};
use calla_cuda::runtime::pool::Arena;
use calla_model::{
    AttentionWeights, Blob, DType, DeltaNetWeights, FeedForwardSpec, FeedForwardWeights, LayerKind,
    LayerWeights, Matrix, MatrixData, MixerWeights, MlpWeights, ModelSpec, MoeWeights, Weights,
};

/// The GPU, or None (printed) when there is none; CALLA_REQUIRE_GPU=1 turns a missing GPU into a
/// failure (the GPU script sets it, so a broken driver cannot pass as a skip).
pub fn gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
    GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) => {
            eprintln!("using {}", g.describe());
            Some(g)
        }
        Err(e) => {
            if std::env::var("CALLA_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("no GPU: {e:#}");
            }
            eprintln!("skipped (no GPU): {e:#}");
            None
        }
    })
    .clone()
}

pub fn run(gpu: &Gpu, launches: &[Launch]) {
    for l in launches {
        l.run(gpu).unwrap_or_else(|e| panic!("{e:#}"));
    }
    gpu.sync().unwrap_or_else(|e| panic!("{e:#}"));
}

pub fn upload_f32(arena: &mut Arena, v: &[f32]) -> DPtr {
    arena.upload(v).unwrap()
}

pub fn download_f32(gpu: &Gpu, p: DPtr, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    gpu.dtoh(p, &mut v).unwrap();
    v
}

pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// Planes `[n]` read back as f32 (hi + lo).
pub fn download_planes(gpu: &Gpu, p: Planes, n: usize) -> Vec<f32> {
    let mut hi = vec![0u16; n];
    gpu.dtoh(p.hi, &mut hi).unwrap();
    let mut out: Vec<f32> = hi.iter().map(|b| bf16_bits_to_f32(*b)).collect();
    if !p.lo.is_null() {
        let mut lo = vec![0u16; n];
        gpu.dtoh(p.lo, &mut lo).unwrap();
        for (o, l) in out.iter_mut().zip(lo) {
            *o += bf16_bits_to_f32(l);
        }
    }
    out
}

/// Planes allocated for `n` elements (both hi and lo).
/// bf16 hi and lo planes and an f16 plane of its own.
pub fn alloc_planes(arena: &mut Arena, n: usize, ld: usize) -> Planes {
    Planes::new(
        arena.alloc_zeroed(n * 2).unwrap(),
        arena.alloc_zeroed(n * 2).unwrap(),
        ld,
    )
    .with_f16(arena.alloc_zeroed(n * 2).unwrap())
}

/// The f16 plane as f32.
pub fn download_f16(gpu: &Gpu, p: Planes, n: usize) -> Vec<f32> {
    let mut h = vec![0u16; n];
    gpu.dtoh(p.f16, &mut h).unwrap();
    h.iter()
        .map(|b| half::f16::from_bits(*b).to_f32())
        .collect()
}

pub fn upload_matrix(gpu: &Arc<Gpu>, arena: &mut Arena, name: &str, m: &Matrix) -> DevMatrix {
    let mut up = Uploader {
        gpu,
        arena,
        bytes: 0,
        total: 0,
        progress: None,
    };
    up.matrix(name, m).unwrap_or_else(|e| panic!("{e:#}"))
}

pub fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>() / v.len().max(1) as f64).sqrt() as f32
}

/// A tolerance: elementwise `|got − want| ≤ atol_rms·rms(want) + rtol·|want|`, and over the whole
/// tensor `rms(got − want) ≤ rms_rel·rms(want)`.
#[derive(Debug, Clone, Copy)]
pub struct Tol {
    pub atol_rms: f32,
    pub rtol: f32,
    pub rms_rel: f32,
}

/// Split precision (≈ f32): measured rms errors ≤ 2e-5 of the reference.
pub const SPLIT: Tol = Tol {
    atol_rms: 1e-3,
    rtol: 1e-3,
    rms_rel: 2e-4,
};
/// bf16 activations (fast precision, bf16 KV): measured rms errors 3–7e-3; single elements up to
/// ~10% of the rms where a normalisation divides by a small norm (DeltaNet's gated norm of a
/// near-empty state, attention rows over one or two positions), hence the loose elementwise bound.
pub const FAST: Tol = Tol {
    atol_rms: 0.25,
    rtol: 0.05,
    rms_rel: 1.5e-2,
};
/// f16 activations × f16 weights (half precision): each operand rounded to 11 bits, ~8× less than
/// bf16, so the bounds sit between split's and fast's.
pub const HALF: Tol = Tol {
    atol_rms: 0.05,
    rtol: 0.01,
    rms_rel: 2.5e-3,
};
/// Exact up to float rounding of a different summation order.
pub const EXACTISH: Tol = Tol {
    atol_rms: 1e-6,
    rtol: 1e-6,
    rms_rel: 1e-6,
};
/// Bit-identical.
pub const EXACT: Tol = Tol {
    atol_rms: 0.0,
    rtol: 0.0,
    rms_rel: 0.0,
};

/// Checks `got` against `want` within `tol`; prints the evidence (max error, where, % of tolerance,
/// rms error) and returns whether it passed. NaN never passes.
pub fn check(name: &str, got: &[f32], want: &[f32], tol: Tol) -> bool {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    let scale = rms(want).max(1e-20);
    let atol = tol.atol_rms * scale;
    let (mut worst, mut worst_i, mut worst_ratio, mut bad) = (0f32, 0usize, 0f32, 0usize);
    let mut sum_sq = 0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let limit = atol + tol.rtol * w.abs();
        let ratio = if err.is_nan() || g.is_nan() {
            f32::INFINITY
        } else if err == 0.0 {
            0.0
        } else {
            err / limit
        };
        if ratio > 1.0 {
            bad += 1;
        }
        if ratio > worst_ratio {
            worst_ratio = ratio;
            worst = err;
            worst_i = i;
        }
        sum_sq += (err as f64) * (err as f64);
    }
    let rel = (sum_sq / got.len().max(1) as f64).sqrt() as f32 / scale;
    let rms_ok = rel <= tol.rms_rel || (tol.rms_rel == 0.0 && sum_sq == 0.0);
    let pass = bad == 0 && rms_ok && rel.is_finite();
    println!(
        "{} {name}: n={} rms(ref)={scale:.3e} max|err|={worst:.3e} at {worst_i} (got {:.6e}, want {:.6e}) = {:.1}% of tol \
         [atol {:.0e}·rms + rtol {:.0e}], rms err/rms ref = {rel:.2e} (limit {:.0e}){}",
        if pass { "ok  " } else { "FAIL" },
        got.len(),
        got.get(worst_i).copied().unwrap_or(0.0),
        want.get(worst_i).copied().unwrap_or(0.0),
        worst_ratio * 100.0,
        tol.atol_rms,
        tol.rtol,
        tol.rms_rel,
        if bad == 0 { String::new() } else { format!(", {bad} elements out of tolerance") }
    );
    if !pass {
        let pairs: Vec<String> = got
            .iter()
            .zip(want)
            .take(6)
            .map(|(g, w)| format!("({g:.5}, {w:.5})"))
            .collect();
        println!("     first (got, want): {}", pairs.join(" "));
    }
    pass
}

/// Weight formats the tests draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WFmt {
    F32,
    Bf16,
    F16,
    Q4,
    Q8,
}

pub fn dense(rows: usize, cols: usize, values: &[f32], dtype: DType) -> Matrix {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => return Matrix::dense_f32(rows, cols, values),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
    };
    Matrix {
        rows,
        cols,
        data: MatrixData::Dense {
            dtype,
            data: Blob::from_vec(bytes),
        },
    }
}

/// A `[rows, cols]` matrix of std `std` in `fmt` (affine formats with group 64).
pub fn matrix(rng: &mut Rng, rows: usize, cols: usize, std: f32, fmt: WFmt) -> Matrix {
    if fmt == WFmt::Q4 && rows * cols >= 1 << 20 {
        return random_q4(rows, cols, std, rng.next_u64());
    }
    let v = rng.normal_vec(rows * cols, std);
    match fmt {
        WFmt::F32 => Matrix::dense_f32(rows, cols, &v),
        WFmt::Bf16 => dense(rows, cols, &v, DType::BF16),
        WFmt::F16 => dense(rows, cols, &v, DType::F16),
        WFmt::Q4 => quantise_affine(rows, cols, &v, 4, 64),
        WFmt::Q8 => quantise_affine(rows, cols, &v, 8, 64),
    }
}

/// A large MLX q4/g64 matrix drawn directly as codes (uniform 0..15) with bf16 scales around
/// std/4.61 and centring biases, generated on all cores (the real expert stacks are 0.8 G weights).
pub fn random_q4(rows: usize, cols: usize, std: f32, seed: u64) -> Matrix {
    assert!(cols.is_multiple_of(64));
    let words_per_row = cols / 8;
    let groups_per_row = cols / 64;
    let mut codes = vec![0u32; rows * words_per_row];
    let mut scales = vec![0u16; rows * groups_per_row];
    let mut biases = vec![0u16; rows * groups_per_row];
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(4)
        .min(32);
    let rows_per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, ((c, sc), bi)) in codes
            .chunks_mut(rows_per * words_per_row)
            .zip(scales.chunks_mut(rows_per * groups_per_row))
            .zip(biases.chunks_mut(rows_per * groups_per_row))
            .enumerate()
        {
            s.spawn(move || {
                let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9));
                for w in c.iter_mut() {
                    *w = rng.next_u64() as u32;
                }
                for (s, b) in sc.iter_mut().zip(bi.iter_mut()) {
                    let scale = std / 4.61 * rng.range(0.8, 1.2);
                    let sb = half::bf16::from_f32(scale);
                    *s = sb.to_bits();
                    *b = half::bf16::from_f32(-7.5 * sb.to_f32() + rng.range(-0.2, 0.2) * std)
                        .to_bits();
                }
            });
        }
    });
    Matrix {
        rows,
        cols,
        data: MatrixData::Affine {
            bits: 4,
            group_size: 64,
            codes: Blob::from_vec(bytemuck::cast_slice(&codes).to_vec()),
            scales: Blob::from_vec(bytemuck::cast_slice(&scales).to_vec()),
            biases: Blob::from_vec(bytemuck::cast_slice(&biases).to_vec()),
            param_dtype: DType::BF16,
        },
    }
}

/// A spec with the given layer kinds and dims taken from `base` (vocab shrunk: these tests are
/// about layers, not the head).
pub fn layers_spec(base: &ModelSpec, kinds: &[LayerKind]) -> ModelSpec {
    let mut s = base.clone();
    s.layers = kinds.to_vec();
    s.vocab_size = 512;
    s
}

/// Random weights for `spec`: projections of std gain/√cols in `fmt` (the router in q8 when fmt is
/// quantised, as MLX stores it), norms near 1, DeltaNet constants as HF initialises them.
pub fn random_weights(spec: &ModelSpec, fmt: WFmt, gain: f32, seed: u64) -> Weights {
    let mut rng = Rng::new(seed);
    let d = spec.hidden_size;
    let mut m = |rng: &mut Rng, rows: usize, cols: usize| {
        let f = if !cols.is_multiple_of(64) && matches!(fmt, WFmt::Q4 | WFmt::Q8) {
            WFmt::Bf16
        } else {
            fmt
        };
        matrix(rng, rows, cols, gain / (cols as f32).sqrt(), f)
    };
    let router_fmt = if matches!(fmt, WFmt::Q4 | WFmt::Q8) {
        WFmt::Q8
    } else {
        fmt
    };
    let layers = spec
        .layers
        .iter()
        .map(|kind| {
            let mixer = match kind {
                LayerKind::DeltaNet => {
                    let (hv, c, k) = (
                        spec.linear_num_value_heads,
                        spec.linear_conv_dim(),
                        spec.linear_conv_kernel_dim,
                    );
                    MixerWeights::DeltaNet(DeltaNetWeights {
                        in_proj_qkv: m(&mut rng, c, d),
                        in_proj_z: m(&mut rng, spec.linear_value_dim(), d),
                        in_proj_b: m(&mut rng, hv, d),
                        in_proj_a: m(&mut rng, hv, d),
                        conv1d: rng.normal_vec(c * k, 0.5),
                        a_log: (0..hv).map(|_| rng.range(1.0, 16.0).ln()).collect(),
                        dt_bias: (0..hv).map(|_| rng.range(-1.0, 1.0)).collect(),
                        norm: (0..spec.linear_value_head_dim)
                            .map(|_| rng.range(0.8, 1.2))
                            .collect(),
                        out_proj: m(&mut rng, d, spec.linear_value_dim()),
                    })
                }
                LayerKind::Attention => MixerWeights::Attention(AttentionWeights {
                    q_proj: m(&mut rng, spec.q_proj_rows(), d),
                    k_proj: m(&mut rng, spec.kv_dim(), d),
                    v_proj: m(&mut rng, spec.kv_dim(), d),
                    o_proj: m(&mut rng, d, spec.num_attention_heads * spec.head_dim),
                    q_norm: rng.normal_vec(spec.head_dim, 0.1),
                    k_norm: rng.normal_vec(spec.head_dim, 0.1),
                }),
            };
            let mlp =
                |rng: &mut Rng, i: usize, m: &mut dyn FnMut(&mut Rng, usize, usize) -> Matrix| {
                    MlpWeights {
                        gate_proj: m(rng, i, d),
                        up_proj: m(rng, i, d),
                        down_proj: m(rng, d, i),
                    }
                };
            let feed_forward = match &spec.feed_forward {
                FeedForwardSpec::Moe {
                    num_experts,
                    expert_intermediate,
                    shared_intermediate,
                    ..
                } => FeedForwardWeights::Moe(MoeWeights {
                    router: matrix(
                        &mut rng,
                        *num_experts,
                        d,
                        1.0 / (d as f32).sqrt(),
                        router_fmt,
                    ),
                    experts: (0..*num_experts)
                        .map(|_| mlp(&mut rng, *expert_intermediate, &mut m))
                        .collect(),
                    shared_expert: (*shared_intermediate > 0)
                        .then(|| mlp(&mut rng, *shared_intermediate, &mut m)),
                    shared_expert_gate: (*shared_intermediate > 0).then(|| {
                        Matrix::dense_f32(1, d, &rng.normal_vec(d, 1.0 / (d as f32).sqrt()))
                    }),
                }),
                FeedForwardSpec::Dense { intermediate } => {
                    FeedForwardWeights::Dense(mlp(&mut rng, *intermediate, &mut m))
                }
            };
            LayerWeights {
                input_layernorm: rng.normal_vec(d, 0.1),
                post_attention_layernorm: rng.normal_vec(d, 0.1),
                mixer,
                feed_forward,
            }
        })
        .collect();
    Weights {
        embed_tokens: Matrix::dense_f32(
            spec.vocab_size,
            d,
            &rng.normal_vec(spec.vocab_size * d, 1.0),
        ),
        layers,
        final_norm: rng.normal_vec(d, 0.1),
        lm_head: matrix(
            &mut rng,
            spec.vocab_size,
            d,
            1.0 / (d as f32).sqrt(),
            WFmt::F32,
        ),
    }
}

/// The prompt sizes every test runs: around one chunk of 64 and a long one.
pub const TOKEN_COUNTS: [usize; 7] = [1, 7, 63, 64, 65, 150, 1000];
