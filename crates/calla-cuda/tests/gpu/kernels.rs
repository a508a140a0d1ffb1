//! Kernel families against the CPU reference on fresh random inputs.

use calla_cpu::attention::{Attention, KvCache};
use calla_cpu::deltanet::{DeltaNet, DeltaNetState, Rule};
use calla_cpu::linear::Linear;
use calla_cpu::moe::FeedForward;
use calla_cuda::forward;
use calla_cuda::matvec;
use calla_cuda::pool::Arena;
use calla_cuda::sequence::CudaSequence;
use calla_cuda::weights::Uploader;
use calla_cuda::{CudaBackend, CudaOptions, KvDtype};
use calla_engine::Backend;
use calla_model::load::Quant;
use calla_model::{
    Blob, DType, Family, LayerKind, Matrix, MatrixData, MixerWeights, ModelSpec, Weights,
};

use crate::support::*;

/// A random `[rows, cols]` matrix in `format` ("f32", "bf16", "f16", "q4", "q8").
fn random_matrix(rng: &mut Rng, rows: usize, cols: usize, format: &str) -> Matrix {
    let values = rng.normal_vec(rows * cols, 1.0 / (cols as f32).sqrt());
    match format {
        "f32" => Matrix::dense_f32(rows, cols, &values),
        "bf16" | "f16" => {
            let mut bytes = Vec::with_capacity(values.len() * 2);
            for v in &values {
                let bits = if format == "bf16" {
                    half::bf16::from_f32(*v).to_bits()
                } else {
                    half::f16::from_f32(*v).to_bits()
                };
                bytes.extend_from_slice(&bits.to_le_bytes());
            }
            Matrix {
                rows,
                cols,
                data: MatrixData::Dense {
                    dtype: if format == "bf16" {
                        DType::BF16
                    } else {
                        DType::F16
                    },
                    data: Blob::from_vec(bytes),
                },
            }
        }
        "q4" => calla_cpu::random::quantise_affine(rows, cols, &values, 4, 64),
        "q8" => calla_cpu::random::quantise_affine(rows, cols, &values, 8, 64),
        other => panic!("format {other}"),
    }
}

#[test]
#[ignore = "needs CUDA"]
fn matvec_every_format_against_cpu_linear() {
    let gpu = gpu();
    let mut rng = Rng::new(11);
    let mut all = true;
    // (rows, K): odd rows, a K of one q4 unit per lane group, a 512-wide down projection, a real
    // in-projection width, a real out-projection width (4 units per lane in q4: the _r2 kernels).
    for format in ["f32", "bf16", "f16", "q4", "q8"] {
        for (rows, k) in [
            (19usize, 128usize),
            (150, 64),
            (257, 512),
            (4352, 2048),
            (301, 4096),
        ] {
            if format == "q4" && k % 64 != 0 {
                continue;
            }
            let mut arena = Arena::new(&gpu, 64 << 20);
            let m = random_matrix(&mut rng, rows, k, format);
            let x = rng.normal_vec(k, 1.5);
            let w = rng.normal_vec(k, 0.2);
            let start = rng.normal_vec(rows, 1.0);
            let gain: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
            let mut up = Uploader {
                gpu: &gpu,
                arena: &mut arena,
                bytes: 0,
                total: 0,
                progress: None,
            };
            let dm = up.matrix("w", &m).unwrap();
            let (xd, gd, out) = (
                arena.upload(&x).unwrap(),
                arena.upload(&gain).unwrap(),
                arena.upload(&start).unwrap(),
            );
            for accumulate in [false, true] {
                gpu.htod(out, &start).unwrap();
                for l in
                    matvec::matvec(&gpu, xd, k, Some((gd, 1e-6)), &[(dm, out)], accumulate).unwrap()
                {
                    l.run(&gpu).unwrap();
                }
                let got = download(&gpu, out, rows);
                let xn = norm(&x, &w, 1e-6);
                let mut want = vec![0f32; rows];
                Linear::new("w", &m, rows, k)
                    .unwrap()
                    .matvec(&xn, &mut want);
                if accumulate {
                    for (w, s) in want.iter_mut().zip(&start) {
                        *w += s;
                    }
                }
                let name = format!(
                    "matvec {format} norm{}",
                    if accumulate { " +residual" } else { "" }
                );
                all &= check(&name, &format!("[{rows},{k}]"), &got, &want, 2e-4, 2e-4);
            }
        }
    }
    // Stacked segments of mixed formats (two launches), no norm.
    let mut arena = Arena::new(&gpu, 64 << 20);
    let k = 256;
    let parts = [
        random_matrix(&mut rng, 96, k, "q4"),
        random_matrix(&mut rng, 33, k, "f32"),
        random_matrix(&mut rng, 7, k, "q4"),
    ];
    let x = rng.normal_vec(k, 1.0);
    let mut up = Uploader {
        gpu: &gpu,
        arena: &mut arena,
        bytes: 0,
        total: 0,
        progress: None,
    };
    let dms: Vec<_> = parts.iter().map(|p| up.matrix("w", p).unwrap()).collect();
    let xd = arena.upload(&x).unwrap();
    let outs: Vec<_> = parts
        .iter()
        .map(|p| arena.alloc_zeroed(p.rows * 4).unwrap())
        .collect();
    let segs: Vec<_> = dms.iter().copied().zip(outs.iter().copied()).collect();
    let launches = matvec::matvec(&gpu, xd, k, None, &segs, false).unwrap();
    assert_eq!(
        launches.len(),
        2,
        "q4 segments share a launch, f32 gets its own"
    );
    for l in launches {
        l.run(&gpu).unwrap();
    }
    for (i, p) in parts.iter().enumerate() {
        let got = download(&gpu, outs[i], p.rows);
        let mut want = vec![0f32; p.rows];
        Linear::new("w", p, p.rows, k)
            .unwrap()
            .matvec(&x, &mut want);
        all &= check(
            &format!("matvec stacked segment {i} ({})", p.format_name()),
            &format!("[{},{k}]", p.rows),
            &got,
            &want,
            2e-4,
            2e-4,
        );
    }
    // The real DeltaNet in-projection: four stacked q4 segments (qkv 8192, z 4096, b 32, a 32 rows)
    // with the norm, so lane groups of 4 rows straddle segment ends.
    let mut arena = Arena::new(&gpu, 64 << 20);
    let k = 2048;
    let parts: Vec<Matrix> = [8192usize, 4096, 32, 32]
        .iter()
        .map(|&rows| random_matrix(&mut rng, rows, k, "q4"))
        .collect();
    let x = rng.normal_vec(k, 1.0);
    let w = rng.normal_vec(k, 0.2);
    let gain: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
    let mut up = Uploader {
        gpu: &gpu,
        arena: &mut arena,
        bytes: 0,
        total: 0,
        progress: None,
    };
    let dms: Vec<_> = parts.iter().map(|p| up.matrix("w", p).unwrap()).collect();
    let (xd, gd) = (arena.upload(&x).unwrap(), arena.upload(&gain).unwrap());
    let outs: Vec<_> = parts
        .iter()
        .map(|p| arena.alloc_zeroed(p.rows * 4).unwrap())
        .collect();
    let segs: Vec<_> = dms.iter().copied().zip(outs.iter().copied()).collect();
    let launches = matvec::matvec(&gpu, xd, k, Some((gd, 1e-6)), &segs, false).unwrap();
    assert_eq!(launches.len(), 1, "four q4 segments share one launch");
    for l in launches {
        l.run(&gpu).unwrap();
    }
    let xn = norm(&x, &w, 1e-6);
    for (i, p) in parts.iter().enumerate() {
        let got = download(&gpu, outs[i], p.rows);
        let mut want = vec![0f32; p.rows];
        Linear::new("w", p, p.rows, k)
            .unwrap()
            .matvec(&xn, &mut want);
        all &= check(
            &format!("matvec real in-proj segment {i} (q4, norm)"),
            &format!("[{},{k}]", p.rows),
            &got,
            &want,
            2e-4,
            2e-4,
        );
    }
    assert!(all, "matvec mismatches (see the table)");
}

#[test]
#[ignore = "needs CUDA"]
fn embedding_gather_every_format() {
    let gpu = gpu();
    let mut rng = Rng::new(12);
    let mut all = true;
    for format in ["f32", "bf16", "f16", "q4", "q8"] {
        let (v, d) = (1000, 2048);
        let mut arena = Arena::new(&gpu, 64 << 20);
        let m = random_matrix(&mut rng, v, d, format);
        let mut up = Uploader {
            gpu: &gpu,
            arena: &mut arena,
            bytes: 0,
            total: 0,
            progress: None,
        };
        let dm = up.matrix("embed", &m).unwrap();
        let cursor = arena.alloc_zeroed(16).unwrap();
        let out = arena.alloc_zeroed(d * 4).unwrap();
        for token in [0usize, 517, 999] {
            let c = calla_cuda::backend::Cursor {
                state_base: 0,
                pos: 0,
                token: token as i32,
            };
            gpu.htod(cursor, std::slice::from_ref(&c)).unwrap();
            matvec::embed(&gpu, &dm, cursor, out)
                .unwrap()
                .run(&gpu)
                .unwrap();
            let got = download(&gpu, out, d);
            let mut want = vec![0f32; d];
            m.row_f32(token, &mut want);
            all &= check(
                &format!("embed {format} token {token}"),
                &format!("[{v},{d}]"),
                &got,
                &want,
                0.0,
                0.0,
            );
        }
    }
    assert!(all);
}

/// A backend over `w` with no graphs (launches run one by one), sized for `ctx` positions.
fn rig(
    spec: &ModelSpec,
    w: &Weights,
    ctx: usize,
    kv: KvDtype,
) -> (CudaBackend, Box<dyn calla_engine::Sequence>) {
    let mut be = CudaBackend::new(
        spec,
        w,
        &CudaOptions {
            max_context: Some(ctx),
            kv_cache: kv,
            use_graphs: false,
            ..Default::default()
        },
    )
    .unwrap();
    let seq = be.new_sequence().unwrap();
    (be, seq)
}

fn run_mixer(
    be: &mut CudaBackend,
    spec: &ModelSpec,
    seq: &dyn calla_engine::Sequence,
    layer: usize,
    pos: usize,
    x: &[f32],
) -> Vec<f32> {
    let gpu = be.gpu().clone();
    let cs = seq.as_any().downcast_ref::<CudaSequence>().unwrap();
    gpu.htod(be.scratch.h, x).unwrap();
    be.set_cursor(cs, pos, 0).unwrap();
    for l in forward::mixer_launches(&gpu, spec, &be.model, &be.layout, &be.scratch, layer).unwrap()
    {
        l.run(&gpu).unwrap();
    }
    download(&gpu, be.scratch.h, x.len())
}

fn run_ffn(be: &mut CudaBackend, spec: &ModelSpec, layer: usize, x: &[f32]) -> Vec<f32> {
    let gpu = be.gpu().clone();
    gpu.htod(be.scratch.h, x).unwrap();
    for l in forward::ffn_launches(&gpu, spec, &be.model, &be.scratch, layer).unwrap() {
        l.run(&gpu).unwrap();
    }
    download(&gpu, be.scratch.h, x.len())
}

fn deltanet_case(name: &str, spec: &ModelSpec, w: &Weights, steps: usize, atol: f32) -> bool {
    let (mut be, seq) = rig(spec, w, steps + 4, KvDtype::F32);
    let layer = spec
        .layers
        .iter()
        .position(|k| *k == LayerKind::DeltaNet)
        .unwrap();
    let MixerWeights::DeltaNet(dw) = &w.layers[layer].mixer else {
        unreachable!()
    };
    let cpu = DeltaNet::new(spec, dw, layer).unwrap();
    let mut state = DeltaNetState::new(spec);
    let mut rng = Rng::new(21);
    let d = spec.hidden_size;
    let mut all = true;
    let mut worst_got = Vec::new();
    let mut worst_want = Vec::new();
    for pos in 0..steps {
        let x = rng.normal_vec(d, 1.0);
        let got = run_mixer(&mut be, spec, seq.as_ref(), layer, pos, &x);
        let xn = norm(&x, &w.layers[layer].input_layernorm, spec.rms_norm_eps);
        let mut out = vec![0f32; d];
        cpu.forward(&xn, 1, &mut state, Rule::Recurrent, &mut out);
        let want: Vec<f32> = x.iter().zip(&out).map(|(a, b)| a + b).collect();
        worst_got.extend(got);
        worst_want.extend(want);
    }
    let shape = format!(
        "Hk{} Hv{} Dk{} Dv{} D{} ×{steps}",
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
        d
    );
    all &= check(name, &shape, &worst_got, &worst_want, atol, atol);
    all
}

#[test]
#[ignore = "needs CUDA"]
fn deltanet_decode_layer_against_cpu() {
    let mut all = true;
    let tiny = tiny_spec(Family::Qwen35Moe);
    for (q, tag) in [
        (None, "f32"),
        (Some(Quant::Q4), "q4"),
        (Some(Quant::Bf16), "bf16"),
    ] {
        let w = random_weights(&tiny, q, 31);
        all &= deltanet_case(
            &format!("deltanet layer (conv+norms+rule) {tag}"),
            &tiny,
            &w,
            9,
            1e-4,
        );
    }
    // Another head layout: Dk 64, Dv 48, Hv = 3·Hk, odd D.
    let mut odd = tiny.clone();
    odd.hidden_size = 192;
    odd.linear_num_key_heads = 1;
    odd.linear_num_value_heads = 3;
    odd.linear_key_head_dim = 64;
    odd.linear_value_head_dim = 48;
    let w = random_weights(&odd, None, 32);
    all &= deltanet_case("deltanet layer f32, odd heads", &odd, &w, 6, 1e-4);
    let (real, w) = real_two_layers();
    all &= deltanet_case("deltanet layer q4 (real dims)", real, w, 5, 2e-4);
    assert!(all);
}

fn attention_case(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    steps: usize,
    ctx: usize,
    kv: KvDtype,
    tol: f32,
) -> bool {
    let (mut be, seq) = rig(spec, w, ctx, kv);
    let layer = spec
        .layers
        .iter()
        .position(|k| *k == LayerKind::Attention)
        .unwrap();
    let MixerWeights::Attention(aw) = &w.layers[layer].mixer else {
        unreachable!()
    };
    let cpu = Attention::new(spec, aw, layer).unwrap();
    let mut cache = KvCache::default();
    let mut rng = Rng::new(41);
    let d = spec.hidden_size;
    let (mut got_all, mut want_all) = (Vec::new(), Vec::new());
    for pos in 0..steps {
        let x = rng.normal_vec(d, 1.0);
        let got = run_mixer(&mut be, spec, seq.as_ref(), layer, pos, &x);
        let xn = norm(&x, &w.layers[layer].input_layernorm, spec.rms_norm_eps);
        let mut out = vec![0f32; d];
        cpu.forward(&xn, 1, &mut cache, &mut out);
        got_all.extend(got);
        want_all.extend(x.iter().zip(&out).map(|(a, b)| a + b));
    }
    let shape = format!(
        "Hq{} Hkv{} Dh{} R{} ×{steps} ({} splits)",
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
        spec.rotary_dim,
        be.scratch.nsplit
    );
    check(name, &shape, &got_all, &want_all, tol, tol)
}

#[test]
#[ignore = "needs CUDA"]
fn attention_decode_layer_against_cpu() {
    let mut all = true;
    let tiny = tiny_spec(Family::Qwen35Moe);
    let w = random_weights(&tiny, None, 51);
    // 70 positions in 3 splits of ≥ 1 tile: several tiles per split, partial last tile.
    all &= attention_case(
        "attention layer f32 KV",
        &tiny,
        &w,
        70,
        100,
        KvDtype::F32,
        1e-4,
    );
    all &= attention_case(
        "attention layer bf16 KV",
        &tiny,
        &w,
        70,
        100,
        KvDtype::Bf16,
        2e-2,
    );
    let wq = random_weights(&tiny, Some(Quant::Q4), 52);
    all &= attention_case(
        "attention layer q4, f32 KV",
        &tiny,
        &wq,
        40,
        40,
        KvDtype::F32,
        1e-4,
    );
    let (real, wr) = real_two_layers();
    all &= attention_case(
        "attention layer q4 (real dims) f32 KV",
        real,
        wr,
        40,
        2048,
        KvDtype::F32,
        2e-4,
    );
    all &= attention_case(
        "attention layer q4 (real dims) bf16 KV",
        real,
        wr,
        40,
        2048,
        KvDtype::Bf16,
        2e-2,
    );
    assert!(all);
}

fn ffn_case(name: &str, spec: &ModelSpec, w: &Weights, tol: f32) -> bool {
    let (mut be, _seq) = rig(spec, w, 8, KvDtype::F32);
    let mut rng = Rng::new(61);
    let d = spec.hidden_size;
    let (mut got_all, mut want_all) = (Vec::new(), Vec::new());
    for layer in 0..spec.num_layers() {
        let cpu = FeedForward::new(spec, &w.layers[layer].feed_forward, layer).unwrap();
        for _ in 0..4 {
            let x = rng.normal_vec(d, 1.0);
            let got = run_ffn(&mut be, spec, layer, &x);
            let xn = norm(
                &x,
                &w.layers[layer].post_attention_layernorm,
                spec.rms_norm_eps,
            );
            let mut out = vec![0f32; d];
            cpu.forward(&xn, 1, &mut out);
            got_all.extend(got);
            want_all.extend(x.iter().zip(&out).map(|(a, b)| a + b));
        }
    }
    let shape = match &spec.feed_forward {
        calla_model::FeedForwardSpec::Moe {
            num_experts,
            top_k,
            expert_intermediate,
            shared_intermediate,
            ..
        } => {
            format!("E{num_experts} A{top_k} I{expert_intermediate} Is{shared_intermediate} D{d}")
        }
        calla_model::FeedForwardSpec::Dense { intermediate } => {
            format!("dense I{intermediate} D{d}")
        }
    };
    check(name, &shape, &got_all, &want_all, tol, tol)
}

#[test]
#[ignore = "needs CUDA"]
fn moe_and_mlp_against_cpu() {
    let mut all = true;
    let tiny = tiny_spec(Family::Qwen35Moe);
    for (q, tag) in [
        (None, "f32"),
        (Some(Quant::Q4), "q4 (8-bit router)"),
        (Some(Quant::Bf16), "bf16"),
    ] {
        let w = random_weights(&tiny, q, 71);
        all &= ffn_case(&format!("moe router+top-k+experts {tag}"), &tiny, &w, 1e-4);
    }
    // Routed experts q4, shared expert f32: the separate-launch path.
    let mut mixed = random_weights(&tiny, None, 72);
    for layer in &mut mixed.layers {
        if let calla_model::FeedForwardWeights::Moe(m) = &mut layer.feed_forward {
            for e in &mut m.experts {
                e.gate_proj = calla_cpu::random::quantise_affine(
                    e.gate_proj.rows,
                    e.gate_proj.cols,
                    &e.gate_proj.to_f32(),
                    4,
                    64,
                );
                e.up_proj = calla_cpu::random::quantise_affine(
                    e.up_proj.rows,
                    e.up_proj.cols,
                    &e.up_proj.to_f32(),
                    4,
                    64,
                );
                e.down_proj = calla_cpu::random::quantise_affine(
                    e.down_proj.rows,
                    e.down_proj.cols,
                    &e.down_proj.to_f32(),
                    4,
                    64,
                );
            }
        }
    }
    all &= ffn_case("moe q4 experts + f32 shared expert", &tiny, &mixed, 1e-4);
    let dense = tiny_spec(Family::Qwen35Dense);
    let w = random_weights(&dense, None, 73);
    all &= ffn_case("dense SwiGLU MLP f32", &dense, &w, 1e-4);
    let (real, w) = real_two_layers();
    all &= ffn_case("moe q4 (real dims, 256 experts)", real, w, 2e-4);
    assert!(all);
}
