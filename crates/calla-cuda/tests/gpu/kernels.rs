//! Kernel families against the CPU reference on fresh random inputs.

use calla_cpu::attention::{Attention, KvCache};
use calla_cpu::deltanet::{DeltaNet, DeltaNetState, Rule};
use calla_cpu::linear::Linear;
use calla_cpu::moe::FeedForward;
use calla_cuda::engine::decode;
use calla_cuda::engine::sequence::CudaSequence;
use calla_cuda::ops::deltanet;
use calla_cuda::ops::matvec::{self, DotEngine};
use calla_cuda::runtime::pool::Arena;
use calla_cuda::{CudaBackend, CudaOptions, KernelChoices, KvDtype, RouterPlacement};
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
    // q4 only: enough rows that every block of the tensor-core kernel takes more tiles than it holds
    // at once (its register slots),
    // so they are refilled.
    for format in ["f32", "bf16", "f16", "q4", "q8"] {
        for (rows, k) in [
            (19usize, 128usize),
            (150, 64),
            (257, 512),
            (4352, 2048),
            (301, 4096),
            (77, 1024),
            (24001, 1024),
            (20011, 2048),
            (12007, 4096),
        ] {
            if (format == "q4" && k % 64 != 0) || (format != "q4" && rows > 5000) {
                continue;
            }
            let mut arena = Arena::new(&gpu, 64 << 20);
            let m = random_matrix(&mut rng, rows, k, format);
            let x = rng.normal_vec(k, 1.5);
            let w = rng.normal_vec(k, 0.2);
            let start = rng.normal_vec(rows, 1.0);
            let gain: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
            let dm = upload_matrix(&gpu, &mut arena, "w", &m);
            let (xd, gd, out) = (
                arena.upload(&x).unwrap(),
                arena.upload(&gain).unwrap(),
                arena.upload(&start).unwrap(),
            );
            // q4 on both dot-product engines (the tensor-core kernel takes K = 1024, 2048, 4096;
            // other widths fall back to the CUDA-core kernel, so those rows repeat it)
            let engines: &[DotEngine] = if format == "q4" {
                &[DotEngine::Rows, DotEngine::TensorCores]
            } else {
                &[DotEngine::Rows]
            };
            for (&engine, accumulate) in engines.iter().flat_map(|e| [(e, false), (e, true)]) {
                gpu.htod(out, &start).unwrap();
                for l in matvec::matvec_on(
                    &gpu,
                    xd,
                    k,
                    Some((gd, 1e-6)),
                    &[(dm, out)],
                    accumulate,
                    engine,
                )
                .unwrap()
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
                    "matvec {format}{} norm{}",
                    if engine == DotEngine::TensorCores {
                        " tc"
                    } else {
                        ""
                    },
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
    let dms: Vec<_> = parts
        .iter()
        .map(|p| upload_matrix(&gpu, &mut arena, "w", p))
        .collect();
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
    let dms: Vec<_> = parts
        .iter()
        .map(|p| upload_matrix(&gpu, &mut arena, "w", p))
        .collect();
    let (xd, gd) = (arena.upload(&x).unwrap(), arena.upload(&gain).unwrap());
    let outs: Vec<_> = parts
        .iter()
        .map(|p| arena.alloc_zeroed(p.rows * 4).unwrap())
        .collect();
    let segs: Vec<_> = dms.iter().copied().zip(outs.iter().copied()).collect();
    let xn = norm(&x, &w, 1e-6);
    for engine in [DotEngine::Rows, DotEngine::TensorCores] {
        for (o, p) in outs.iter().zip(&parts) {
            gpu.memset_zero(*o, p.rows * 4).unwrap(); // no result of the other engine survives
        }
        let launches =
            matvec::matvec_on(&gpu, xd, k, Some((gd, 1e-6)), &segs, false, engine).unwrap();
        assert_eq!(launches.len(), 1, "four q4 segments share one launch");
        for l in launches {
            l.run(&gpu).unwrap();
        }
        for (i, p) in parts.iter().enumerate() {
            let got = download(&gpu, outs[i], p.rows);
            let mut want = vec![0f32; p.rows];
            Linear::new("w", p, p.rows, k)
                .unwrap()
                .matvec(&xn, &mut want);
            all &= check(
                &format!("matvec real in-proj segment {i} (q4, norm, {engine:?})"),
                &format!("[{},{k}]", p.rows),
                &got,
                &want,
                2e-4,
                2e-4,
            );
        }
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
        let dm = upload_matrix(&gpu, &mut arena, "embed", &m);
        let cursor = arena.alloc_zeroed(16).unwrap();
        let out = arena.alloc_zeroed(d * 4).unwrap();
        for token in [0usize, 517, 999] {
            let c = calla_cuda::engine::backend::Cursor {
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
            kernels: kernel_choices(),
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
    for l in decode::mixer_launches(&gpu, spec, &be.model, &be.layout, &be.scratch, layer).unwrap()
    {
        l.run(&gpu).unwrap();
    }
    download(&gpu, be.scratch.h, x.len())
}

fn run_ffn(be: &mut CudaBackend, spec: &ModelSpec, layer: usize, x: &[f32]) -> Vec<f32> {
    let gpu = be.gpu().clone();
    gpu.htod(be.scratch.h, x).unwrap();
    for l in decode::ffn_launches(&gpu, spec, &be.model, &be.scratch, layer).unwrap() {
        l.run(&gpu).unwrap();
    }
    download(&gpu, be.scratch.h, x.len())
}

/// `run_mixer` for a DeltaNet layer with the decode launch built for `split` blocks per value head
/// (None: the launcher's own choice, as the engine runs it).
fn run_deltanet_mixer(
    be: &mut CudaBackend,
    spec: &ModelSpec,
    seq: &dyn calla_engine::Sequence,
    layer: usize,
    pos: usize,
    x: &[f32],
    split: Option<u32>,
) -> Vec<f32> {
    let Some(split) = split else {
        return run_mixer(be, spec, seq, layer, pos, x);
    };
    let gpu = be.gpu().clone();
    let cs = seq.as_any().downcast_ref::<CudaSequence>().unwrap();
    gpu.htod(be.scratch.h, x).unwrap();
    be.set_cursor(cs, pos, 0).unwrap();
    // the kernel's own norm (the engine moves it to the out-projection where that applies)
    let choices = gpu.choices();
    gpu.set_choices(KernelChoices {
        deltanet_norm_in_out_projection: false,
        ..choices
    });
    let mut launches =
        decode::mixer_launches(&gpu, spec, &be.model, &be.layout, &be.scratch, layer).unwrap();
    gpu.set_choices(choices);
    let io =
        decode::deltanet_io(&be.model, &be.layout, &be.scratch, layer).expect("a DeltaNet layer");
    let at = launches
        .iter()
        .position(|l| l.name.starts_with("deltanet_decode"))
        .expect("a deltanet_decode launch in the mixer");
    launches[at] = deltanet::decode_split(&gpu, spec, &io, split).unwrap();
    for l in launches {
        l.run(&gpu).unwrap();
    }
    download(&gpu, be.scratch.h, x.len())
}

/// `steps` decode steps of the first DeltaNet layer on a fresh sequence against the CPU reference
/// (Rule::Recurrent); returns the row's verdict and every step's GPU output (for repeat checks).
fn deltanet_case(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    steps: usize,
    atol: f32,
    split: Option<u32>,
) -> (bool, Vec<f32>) {
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
    let mut worst_got = Vec::new();
    let mut worst_want = Vec::new();
    for pos in 0..steps {
        let x = rng.normal_vec(d, 1.0);
        let got = run_deltanet_mixer(&mut be, spec, seq.as_ref(), layer, pos, &x, split);
        let xn = norm(&x, &w.layers[layer].input_layernorm, spec.rms_norm_eps);
        let mut out = vec![0f32; d];
        cpu.forward(&xn, 1, &mut state, Rule::Recurrent, &mut out);
        let want: Vec<f32> = x.iter().zip(&out).map(|(a, b)| a + b).collect();
        worst_got.extend(got);
        worst_want.extend(want);
    }
    let shape = format!(
        "Hk{} Hv{} Dk{} Dv{} D{} ×{steps}{}",
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
        d,
        split.map(|s| format!(" P{s}")).unwrap_or_default()
    );
    let ok = check(name, &shape, &worst_got, &worst_want, atol, atol);
    (ok, worst_got)
}

/// The tiny spec with other DeltaNet head dims (f32 weights need Hv·Dv a multiple of 4).
fn deltanet_dims(hidden: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> ModelSpec {
    let mut s = tiny_spec(Family::Qwen35Moe);
    s.hidden_size = hidden;
    s.linear_num_key_heads = hk;
    s.linear_num_value_heads = hv;
    s.linear_key_head_dim = dk;
    s.linear_value_head_dim = dv;
    s
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
            None,
        )
        .0;
    }
    // Another head layout: Dk 64, Dv 48, Hv = 3·Hk, odd D.
    // Heads split unevenly over the 8 blocks of a cluster: Dv 36 → blocks of 4 and 5 columns;
    // Dv 6 → three blocks per head own no column (they still convolve q/k and join the Σo²);
    // Dk 256 (8 key entries per lane), Dv 200 (25 columns per block).
    // (name, D, Hk, Hv, Dk, Dv, seed, steps)
    for (name, d, hk, hv, dk, dv, seed, steps) in [
        ("deltanet layer f32, odd heads", 192, 1, 3, 64, 48, 32, 6),
        (
            "deltanet layer f32, Dv 36 (uneven)",
            128,
            2,
            4,
            32,
            36,
            33,
            7,
        ),
        ("deltanet layer f32, Dv 6 < blocks", 128, 2, 4, 32, 6, 34, 7),
        (
            "deltanet layer f32, Dk 256 Dv 200",
            128,
            1,
            2,
            256,
            200,
            35,
            5,
        ),
    ] {
        let spec = deltanet_dims(d, hk, hv, dk, dv);
        let w = random_weights(&spec, None, seed);
        all &= deltanet_case(name, &spec, &w, steps, 1e-4, None).0;
    }
    let (real, w) = real_two_layers();
    all &= deltanet_case("deltanet layer q4 (real dims)", real, w, 5, 2e-4, None).0;
    assert!(all);
}

/// Both kernel variants (one block per head, and 8 blocks per head in a cluster on sm_90+) against
/// the CPU and against each other, and the engine's variant repeats bit for bit on a fresh
/// sequence (the cross-block Σo² is summed in a fixed order, never with float atomics).
#[test]
#[ignore = "needs CUDA"]
fn deltanet_decode_splits_agree_and_repeat() {
    let gpu = gpu();
    let mut all = true;
    let tiny = tiny_spec(Family::Qwen35Moe);
    let w_tiny = random_weights(&tiny, None, 41);
    let odd = deltanet_dims(192, 1, 3, 64, 48);
    let w_odd = random_weights(&odd, None, 42);
    let uneven = deltanet_dims(128, 2, 4, 32, 36);
    let w_uneven = random_weights(&uneven, None, 43);
    let (real, w_real) = real_two_layers();
    let cases: [(&str, &ModelSpec, &Weights, f32); 4] = [
        ("tiny f32", &tiny, &w_tiny, 1e-4),
        ("odd heads f32", &odd, &w_odd, 1e-4),
        ("Dv 36 f32", &uneven, &w_uneven, 1e-4),
        ("real dims q4", real, w_real, 2e-4),
    ];
    let splits: Vec<u32> = if deltanet::has_clusters(&gpu) {
        vec![1, deltanet::SPLIT]
    } else {
        eprintln!(
            "{}: no thread-block clusters, only the one-block kernel",
            gpu.arch
        );
        vec![1]
    };
    for (tag, spec, w, atol) in cases {
        let steps = 5;
        let mut outs = Vec::new();
        for &split in &splits {
            let name = format!("deltanet {tag}, {split} block(s)/head");
            let (ok, got) = deltanet_case(&name, spec, w, steps, atol, Some(split));
            all &= ok;
            outs.push(got);
        }
        if let [single, split] = &outs[..] {
            // Only the Σo² summation order differs (it never feeds the state).
            all &= check(
                &format!("deltanet {tag}: split vs single"),
                "same inputs",
                split,
                single,
                2e-5,
                2e-5,
            );
        }
        let mut runs = Vec::new();
        for run in 1..=2 {
            let name = format!("deltanet {tag}, engine variant, run {run}");
            let (ok, got) = deltanet_case(&name, spec, w, steps, atol, None);
            all &= ok;
            runs.push(got);
        }
        let (first, again) = (&runs[0], &runs[1]);
        let same = first
            .iter()
            .zip(again)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        all &= check_count(
            &format!("deltanet {tag}: repeat bit-identical"),
            "fresh sequence",
            same,
            first.len(),
            "bits",
        );
    }
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
        "Hq{} Hkv{} Dh{} R{} ×{steps} (grid {} splits)",
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
    // 600 positions, grid 32 splits: the live split count grows by one per tile (a change at
    // every multiple of 32), a second merge group from position 512 (17 tiles).
    all &= attention_case(
        "attention layer f32 KV, 600 steps",
        &tiny,
        &w,
        600,
        1000,
        KvDtype::F32,
        1e-4,
    );
    all &= attention_case(
        "attention layer bf16 KV, 600 steps",
        &tiny,
        &w,
        600,
        1000,
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

/// bf16 rounding of a cache value (identity for an f32 cache).
fn round_kv(x: f32, kv: KvDtype) -> f32 {
    match kv {
        KvDtype::F32 => x,
        KvDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

fn upload_kv(
    gpu: &calla_cuda::runtime::gpu::Gpu,
    dst: calla_cuda::runtime::gpu::DPtr,
    x: &[f32],
    kv: KvDtype,
) {
    match kv {
        KvDtype::F32 => gpu.htod(dst, x).unwrap(),
        KvDtype::Bf16 => {
            let bits: Vec<u16> = x
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            gpu.htod(dst, &bits).unwrap()
        }
    }
}

fn download_kv(
    gpu: &calla_cuda::runtime::gpu::Gpu,
    src: calla_cuda::runtime::gpu::DPtr,
    n: usize,
    kv: KvDtype,
) -> Vec<f32> {
    match kv {
        KvDtype::F32 => download(gpu, src, n),
        KvDtype::Bf16 => {
            let mut bits = vec![0u16; n];
            gpu.dtoh(src, &mut bits).unwrap();
            bits.iter()
                .map(|b| half::bf16::from_bits(*b).to_f32())
                .collect()
        }
    }
}

/// The token's k and v rows [Hkv·Dh] as the cache should hold them: k normalised and rotated, both
/// rounded to the cache type.
fn reference_kv_row(
    spec: &ModelSpec,
    aw: &calla_model::AttentionWeights,
    k: &[f32],
    v: &[f32],
    pos: usize,
    kv: KvDtype,
) -> (Vec<f32>, Vec<f32>) {
    let rope = calla_cpu::attention::Rope::new(spec.rotary_dim, spec.rope_theta);
    let mut k_row = k.to_vec();
    for head in k_row.chunks_exact_mut(spec.head_dim) {
        calla_cpu::norm::rms_norm_zero_centred(head, &aw.k_norm, spec.rms_norm_eps);
        rope.apply(head, pos);
    }
    (
        k_row.iter().map(|x| round_kv(*x, kv)).collect(),
        v.iter().map(|x| round_kv(*x, kv)).collect(),
    )
}

/// The attention output y [Hq·Dh] (before o_proj) of the token at `pos` from the kernel's inputs
/// (q_proj output `qg`), in f64 over `cache_k` / `cache_v` [Hkv, ctx, Dh] rows 0..pos and the
/// token's own cache rows `k_row` / `v_row` [Hkv·Dh].
#[allow(clippy::too_many_arguments)]
fn reference_y(
    spec: &ModelSpec,
    aw: &calla_model::AttentionWeights,
    qg: &[f32],
    k_row: &[f32],
    v_row: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    ctx: usize,
    pos: usize,
) -> Vec<f32> {
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    let rope = calla_cpu::attention::Rope::new(spec.rotary_dim, spec.rope_theta);
    let stride = if spec.attn_output_gate { 2 * dh } else { dh };
    let scale = (dh as f64).powf(-0.5);
    let mut y = vec![0f32; hq * dh];
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        let mut q = qg[h * stride..h * stride + dh].to_vec();
        calla_cpu::norm::rms_norm_zero_centred(&mut q, &aw.q_norm, spec.rms_norm_eps);
        rope.apply(&mut q, pos);
        let key = |t: usize| -> &[f32] {
            if t == pos {
                &k_row[kvh * dh..(kvh + 1) * dh]
            } else {
                &cache_k[(kvh * ctx + t) * dh..(kvh * ctx + t + 1) * dh]
            }
        };
        let value = |t: usize| -> &[f32] {
            if t == pos {
                &v_row[kvh * dh..(kvh + 1) * dh]
            } else {
                &cache_v[(kvh * ctx + t) * dh..(kvh * ctx + t + 1) * dh]
            }
        };
        let scores: Vec<f64> = (0..=pos)
            .map(|t| {
                q.iter()
                    .zip(key(t))
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut o = vec![0f64; dh];
        for (t, w) in weights.iter().enumerate() {
            for (od, vd) in o.iter_mut().zip(value(t)) {
                *od += w * *vd as f64;
            }
        }
        for d in 0..dh {
            let mut r = o[d] / total;
            if spec.attn_output_gate {
                let gate = qg[h * stride + dh + d] as f64;
                r /= 1.0 + (-gate).exp();
            }
            y[h * dh + d] = r as f32;
        }
    }
    y
}

/// Single steps at chosen positions over a cache prefilled with random rows (no walk through every
/// position): per position the kernel's y against an f64 reference from the same inputs, the
/// appended K/V row, the layer output against the CPU engine over the same cache, and a second
/// run of the same step giving bit-identical y (the merging block changes run to run).
/// K rows carry a per-position scale in [0.5, 4], so some positions dominate their split and a
/// merge weight gone wrong shows at the size of y itself.
#[allow(clippy::too_many_arguments)]
fn attention_prefilled_case(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    ctx: usize,
    kv: KvDtype,
    positions: &[usize],
    tol_y: f32,
    tol_out: f32,
) -> bool {
    let (mut be, seq) = rig(spec, w, ctx, kv);
    let gpu = be.gpu().clone();
    let layer = spec
        .layers
        .iter()
        .position(|k| *k == LayerKind::Attention)
        .unwrap();
    let MixerWeights::Attention(aw) = &w.layers[layer].mixer else {
        unreachable!()
    };
    let cpu = Attention::new(spec, aw, layer).unwrap();
    let (hq, hkv, dh, d) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
        spec.hidden_size,
    );
    let mut rng = Rng::new(61);
    let mut cache_k = vec![0f32; hkv * ctx * dh]; // [Hkv, ctx, Dh]
    for row in cache_k.chunks_exact_mut(dh) {
        let sigma = rng.range(0.5, 4.0);
        for x in row.iter_mut() {
            *x = round_kv(rng.normal() * sigma, kv);
        }
    }
    let cache_v: Vec<f32> = rng
        .normal_vec(hkv * ctx * dh, 1.0)
        .iter()
        .map(|x| round_kv(*x, kv))
        .collect();
    let base = seq.as_any().downcast_ref::<CudaSequence>().unwrap().base();
    let (k_off, v_off) = be.layout.layers[layer];
    let grid = be.scratch.nsplit;
    let min_tiles = gpu.choices().attn_min_tiles_per_split;
    let mut all = true;
    for &pos in positions {
        assert!(pos < ctx);
        let x = rng.normal_vec(d, 1.0);
        let mut ys = Vec::new();
        let mut got_out = Vec::new();
        for _ in 0..2 {
            upload_kv(&gpu, base.offset(k_off), &cache_k, kv);
            upload_kv(&gpu, base.offset(v_off), &cache_v, kv);
            got_out = run_mixer(&mut be, spec, seq.as_ref(), layer, pos, &x);
            ys.push(download(&gpu, be.scratch.at_y, hq * dh));
        }
        let splits = calla_cuda::ops::attention::live_splits(pos, grid, min_tiles);
        let shape = format!("Hq{hq} Hkv{hkv} Dh{dh} p{pos} ({splits}/{grid} splits)");
        let same = ys[0]
            .iter()
            .zip(&ys[1])
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        all &= check_count(
            &format!("{name}: y repeats bit for bit"),
            &shape,
            same,
            hq * dh,
            "",
        );

        let qg = download(&gpu, be.scratch.at_qg, spec.q_proj_rows());
        let k = download(&gpu, be.scratch.at_k, hkv * dh);
        let v = download(&gpu, be.scratch.at_v, hkv * dh);
        // the appended row p of every kv head
        let (mut got_k, mut got_v) = (Vec::new(), Vec::new());
        for h in 0..hkv {
            let row = (h * ctx + pos) * dh * kv.size();
            got_k.extend(download_kv(&gpu, base.offset(k_off + row), dh, kv));
            got_v.extend(download_kv(&gpu, base.offset(v_off + row), dh, kv));
        }
        let (want_k, want_v) = reference_kv_row(spec, aw, &k, &v, pos, kv);
        // bf16: one rounding step apart where the f32 norms differ in the last bit
        let row_tol = if kv == KvDtype::Bf16 { 8e-3 } else { 1e-5 };
        all &= check(
            &format!("{name}: K[p] appended"),
            &shape,
            &got_k,
            &want_k,
            row_tol,
            row_tol,
        );
        all &= check(
            &format!("{name}: V[p] appended"),
            &shape,
            &got_v,
            &want_v,
            0.0,
            0.0,
        );
        // y over the rows the kernel appended (checked just above)
        let want_y = reference_y(spec, aw, &qg, &got_k, &got_v, &cache_k, &cache_v, ctx, pos);
        all &= check(
            &format!("{name}: y vs f64"),
            &shape,
            &ys[0],
            &want_y,
            tol_y,
            tol_y,
        );

        // the whole layer against the CPU engine over the same cache ([T, Hkv, Dh] there)
        let mut cache = KvCache::default();
        for t in 0..pos {
            for h in 0..hkv {
                let r = (h * ctx + t) * dh;
                cache.keys.extend_from_slice(&cache_k[r..r + dh]);
                cache.values.extend_from_slice(&cache_v[r..r + dh]);
            }
        }
        let xn = norm(&x, &w.layers[layer].input_layernorm, spec.rms_norm_eps);
        let mut out = vec![0f32; d];
        cpu.forward(&xn, 1, &mut cache, &mut out);
        let want: Vec<f32> = x.iter().zip(&out).map(|(a, b)| a + b).collect();
        all &= check(
            &format!("{name}: layer vs cpu"),
            &shape,
            &got_out,
            &want,
            tol_out,
            tol_out,
        );
    }
    all
}

/// Positions where the live split count changes (grid `nsplit`, one tile per split at least),
/// and the ends: 0, 1, each side of a tile boundary, of the first second-level merge (17 tiles),
/// of every split live (nsplit tiles), of uneven splits, and the last position of the cache.
fn split_change_positions(nsplit: usize, ctx: usize) -> Vec<usize> {
    let t = calla_cuda::ops::attention::TILE;
    let mut p = vec![0, 1, t - 1, t, t + 1, 2 * t];
    for tiles in [
        16,
        17,
        33,
        nsplit,
        nsplit + 1,
        2 * nsplit + 1,
        5 * nsplit + 3,
    ] {
        p.extend([tiles * t - 1, tiles * t]);
    }
    p.push(ctx - 1);
    p.retain(|&x| x < ctx);
    p.sort_unstable();
    p.dedup();
    p
}

#[test]
#[ignore = "needs CUDA"]
fn attention_decode_prefilled_long_context() {
    let mut all = true;
    let tiny = tiny_spec(Family::Qwen35Moe);
    let w = random_weights(&tiny, None, 71);
    // grid 128 splits (8 merge groups) at tiny dims
    let ctx = 6000;
    let nsplit = calla_cuda::ops::attention::num_splits(ctx);
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        all &= attention_prefilled_case(
            &format!("attn prefilled tiny {kv:?}"),
            &tiny,
            &w,
            ctx,
            kv,
            &split_change_positions(nsplit, ctx),
            1e-4,
            if kv == KvDtype::F32 { 1e-4 } else { 2e-2 },
        );
    }
    // Odd shape: G = 3 (96 threads), Dh 96 (3 dims per lane), rotary 40 (pairs across lanes, not a
    // multiple of 32), no output gate; grid 37 splits (3 merge groups, the last of 5).
    let mut odd = tiny.clone();
    odd.num_attention_heads = 6;
    odd.num_key_value_heads = 2;
    odd.head_dim = 96;
    odd.rotary_dim = 40;
    odd.attn_output_gate = false;
    let w = random_weights(&odd, None, 72);
    let ctx = 37 * 32 - 5;
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        all &= attention_prefilled_case(
            &format!("attn prefilled odd {kv:?}"),
            &odd,
            &w,
            ctx,
            kv,
            &split_change_positions(calla_cuda::ops::attention::num_splits(ctx), ctx),
            1e-4,
            if kv == KvDtype::F32 { 1e-4 } else { 2e-2 },
        );
    }
    // Wide groups: G = 16 (in the bf16 kernel two n-tiles of 8 heads, two heads per warp, each
    // warp merging two heads), Dh 64 (4 d-chunks: one per score warp pair, d-tiles on warps 0..3),
    // rotary 32; grid 47 splits (3 merge groups).
    let mut wide = tiny.clone();
    wide.num_attention_heads = 32;
    wide.num_key_value_heads = 2;
    wide.head_dim = 64;
    wide.rotary_dim = 32;
    let w = random_weights(&wide, None, 74);
    let ctx = 47 * 32 - 9;
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        all &= attention_prefilled_case(
            &format!("attn prefilled wide G16 {kv:?}"),
            &wide,
            &w,
            ctx,
            kv,
            &split_change_positions(calla_cuda::ops::attention::num_splits(ctx), ctx),
            1e-4,
            if kv == KvDtype::F32 { 1e-4 } else { 2e-2 },
        );
    }
    // The real shape at 32K (1,024 tiles, 8 per split: the bf16 kernel's 3-stage ring wraps) and the positions where the split count
    // changes on the way there.
    let (real, wr) = real_two_layers();
    let ctx = 32768;
    let mut positions = split_change_positions(128, ctx);
    positions.extend([16383, 20000]);
    positions.sort_unstable();
    for kv in [KvDtype::F32, KvDtype::Bf16] {
        all &= attention_prefilled_case(
            &format!("attn prefilled real {kv:?}"),
            real,
            wr,
            ctx,
            kv,
            &positions,
            1e-4,
            if kv == KvDtype::F32 { 2e-4 } else { 2e-2 },
        );
    }
    // The ticketed merge (attn_decode_bf16; the barrier merge is the default) on the
    // same tiny and real checks.
    let ticketed = KernelChoices {
        co_resident_grids: false,
        ..KernelChoices::default()
    };
    let w = random_weights(&tiny, None, 71);
    all &= with_kernel_choices(ticketed, || {
        attention_prefilled_case(
            "attn prefilled tiny Bf16, ticketed merge",
            &tiny,
            &w,
            6000,
            KvDtype::Bf16,
            &split_change_positions(calla_cuda::ops::attention::num_splits(6000), 6000),
            1e-4,
            2e-2,
        )
    });
    all &= with_kernel_choices(ticketed, || {
        attention_prefilled_case(
            "attn prefilled real Bf16, ticketed merge",
            real,
            wr,
            ctx,
            KvDtype::Bf16,
            &positions,
            1e-4,
            2e-2,
        )
    });
    // Two tiles per split at least (read when the launches are built): the same tiny checks with
    // the other split policy.
    let min_tiles = |n| KernelChoices {
        attn_min_tiles_per_split: n,
        ..KernelChoices::default()
    };
    let w = random_weights(&tiny, None, 73);
    all &= with_kernel_choices(min_tiles(2), || {
        attention_prefilled_case(
            "attn prefilled tiny min 2 tiles",
            &tiny,
            &w,
            6000,
            KvDtype::F32,
            &split_change_positions(128, 6000),
            1e-4,
            1e-4,
        )
    });
    // Five tiles per split at least, bf16: several laps of the bf16 kernel's tile ring at tiny
    // dims, splits of 5 and 6 tiles, the last one partial.
    all &= with_kernel_choices(min_tiles(5), || {
        attention_prefilled_case(
            "attn prefilled tiny min 5 tiles bf16",
            &tiny,
            &w,
            6000,
            KvDtype::Bf16,
            &split_change_positions(128, 6000),
            1e-4,
            2e-2,
        )
    });
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

/// The top-k the CPU takes (calla_cpu::moe::route's order: logit descending, ties to the lowest id;
/// NaN never chosen) and the combine weights, from the logits a router kernel left.
fn top_k_of(logits: &[f32], a: usize, norm_topk: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).filter(|&e| !logits[e].is_nan()).collect();
    order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]).then(x.cmp(&y)));
    let top = logits[order[0]];
    let sum_sel: f32 = order[..a].iter().map(|&e| (logits[e] - top).exp()).sum();
    let sum_all: f32 = order.iter().map(|&e| (logits[e] - top).exp()).sum();
    order[..a]
        .iter()
        .map(|&e| {
            (
                e,
                (logits[e] - top).exp() / if norm_topk { sum_sel } else { sum_all },
            )
        })
        .collect()
}

/// Both places the top-k is taken (the router's last block after a ticket, `RouterPlacement::Ticket`;
/// every block of the tensor-core gate/up, the default) select exactly the CPU's top-k from the
/// router's logits, with exact ties at the k-th place: the router's rows are made identical in
/// threes, so every logit comes three times and the 8th place always falls inside a triple, where the
/// lowest ids must win.
#[test]
#[ignore = "needs CUDA"]
fn routing_takes_the_top_k_with_ties_to_the_lowest_id() {
    let (spec, w) = real_two_layers();
    let (be, _seq) = rig(spec, w, 8, KvDtype::Bf16);
    let gpu = be.gpu().clone();
    // an attention layer's MoE: its plain out-projection also runs the fused routing below
    let layer = (0..spec.num_layers())
        .find(|&i| {
            decode::moe_weights(&be.model, spec, i).is_some()
                && matches!(
                    be.model.layers[i].mixer,
                    calla_cuda::ops::weights::DevMixer::Attention(_)
                )
        })
        .expect("an attention layer with an MoE");
    let mw = decode::moe_weights(&be.model, spec, layer).unwrap();
    let io = decode::moe_io(&be.model, spec, &be.scratch, layer);
    let (e, a, d) = (mw.experts, mw.top_k, mw.router.cols);
    let r = mw.router.kref();
    let rb = r.row_bytes as usize;
    let param_bytes = r.groups_per_row as usize * if r.param_f32 != 0 { 8 } else { 4 };
    for row in (0..e).filter(|row| row % 3 != 0) {
        let src = row - row % 3;
        let (data, params) = (mw.router.data, mw.router.params);
        gpu.dtod(data.offset(row * rb), data.offset(src * rb), rb)
            .unwrap();
        if mw.router.format.is_affine() {
            gpu.dtod(
                params.offset(row * param_bytes),
                params.offset(src * param_bytes),
                param_bytes,
            )
            .unwrap();
        }
    }
    let mut rng = Rng::new(97);
    let (mut equal, mut total, mut worst_w) = (0usize, 0usize, 0f32);
    for _ in 0..16 {
        let x = rng.normal_vec(d, 1.0);
        for mode in ["ticket", "gate/up", "fused"] {
            gpu.memset_zero(io.topk_ids, 4 * a).unwrap();
            let logits = if mode == "fused" {
                // the attention out-projection over a random y runs the router into the
                // accumulators; gate/up selects from them (logits = sums · 2⁻³² / rms)
                let calla_cuda::ops::weights::DevMixer::Attention(m) =
                    &be.model.layers[layer].mixer
                else {
                    unreachable!()
                };
                let s = &be.scratch;
                let k = spec.num_attention_heads * spec.head_dim;
                let tail = calla_cuda::ops::moe::fused_route_tail(
                    gpu.choices(),
                    &mw,
                    &io,
                    &m.o_proj,
                    k,
                    s.route_acc,
                )
                .expect("the fused routing applies at the real shape");
                gpu.htod(s.at_y, &rng.normal_vec(k, 1.0)).unwrap();
                gpu.htod(io.h, &x).unwrap();
                let words = calla_cuda::ops::moe::route_acc_words(e);
                gpu.memset_zero(s.route_acc, 8 * words).unwrap();
                matvec::matvec_routed(&gpu, s.at_y, k, &(m.o_proj, s.h), &tail)
                    .unwrap()
                    .run(&gpu)
                    .unwrap();
                let launches =
                    calla_cuda::ops::moe::moe_after_fused_routing(&gpu, &mw, &io, s.route_acc)
                        .unwrap();
                launches[0].run(&gpu).unwrap(); // gate/up only: the accumulators stay
                let mut acc = vec![0i64; words];
                gpu.dtoh(s.route_acc, &mut acc).unwrap();
                let stride = words / calla_cuda::ops::moe::ROUTE_COPIES;
                let sum = |i: usize| {
                    (0..calla_cuda::ops::moe::ROUTE_COPIES)
                        .map(|c| acc[c * stride + i])
                        .sum::<i64>()
                };
                // as the kernel computes them (f32)
                let ss = sum(e + 1) as f32 * (1.0 / 1048576.0);
                let inv = 1.0 / (ss / d as f32 + spec.rms_norm_eps).sqrt();
                (0..=e)
                    .map(|i| sum(i) as f32 * (1.0 / 4294967296.0) * inv)
                    .collect::<Vec<f32>>()
            } else {
                let choices = gpu.choices();
                gpu.set_choices(KernelChoices {
                    router: if mode == "ticket" {
                        RouterPlacement::Ticket
                    } else {
                        RouterPlacement::InGateUp
                    },
                    ..choices
                });
                let launches = calla_cuda::ops::moe::moe(&gpu, &mw, &io).unwrap();
                gpu.set_choices(choices);
                gpu.htod(io.h, &x).unwrap();
                for l in &launches[..2] {
                    l.run(&gpu).unwrap(); // router, then gate/up
                }
                download(&gpu, io.logits, e + 1)
            };
            let mut ids = vec![0i32; a];
            gpu.dtoh(io.topk_ids, &mut ids).unwrap();
            let weights = download(&gpu, io.topk_w, a);
            let want = top_k_of(&logits[..e], a, mw.norm_topk);
            assert!(
                (0..e).all(|i| logits[i].to_bits() == logits[i - i % 3].to_bits()),
                "{mode}: the copied rows' logits differ"
            );
            total += 1;
            if ids.iter().zip(&want).all(|(&g, &(w, _))| g as usize == w) {
                equal += 1;
            } else {
                let want_ids: Vec<usize> = want.iter().map(|w| w.0).collect();
                eprintln!("{mode}: ids {ids:?}, want {want_ids:?}");
            }
            for (g, (_, w)) in weights.iter().zip(&want) {
                worst_w = worst_w.max((g - w).abs());
            }
            if mw.shared_gate.is_some() {
                let sw = download(&gpu, io.shared_w, 1)[0];
                worst_w = worst_w.max((sw - 1.0 / (1.0 + (-logits[e]).exp())).abs());
            }
        }
    }
    let shape = format!("E{e} A{a} D{d}, {:?} router", mw.router.format);
    let ok = check_count(
        "top-k with ties: ticket, gate/up and fused routing",
        &shape,
        equal,
        total,
        "",
    );
    assert!(ok && worst_w < 1e-6, "combine weights off by {worst_w}");
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
    // q4 at widths the tensor-core gate/up (with the fused norm) and down (one slot, weight 1) take
    let mut dense_q4 = tiny_spec(Family::Qwen35Dense);
    dense_q4.hidden_size = 1024;
    dense_q4.feed_forward = calla_model::FeedForwardSpec::Dense { intermediate: 384 };
    let w = random_weights(&dense_q4, Some(Quant::Q4), 74);
    all &= ffn_case("dense SwiGLU MLP q4 (D 1024, I 384)", &dense_q4, &w, 1e-4);
    let (real, w) = real_two_layers();
    all &= ffn_case("moe q4 (real dims, 256 experts)", real, w, 2e-4);
    // the same on the CUDA-core kernels (the tensor-core gate/up is the default where it applies)
    let rows = KernelChoices {
        dot_engine: DotEngine::Rows,
        ..KernelChoices::default()
    };
    all &= with_kernel_choices(rows, || {
        ffn_case("moe q4 (real dims, 256 experts), CUDA cores", real, w, 2e-4)
    });
    // and with the ticket router (the cluster router is the default on sm_90+)
    let ticket = KernelChoices {
        router: RouterPlacement::Ticket,
        ..KernelChoices::default()
    };
    all &= with_kernel_choices(ticket, || {
        ffn_case(
            "moe q4 (real dims, 256 experts), ticket router",
            real,
            w,
            2e-4,
        ) & ffn_case(
            "moe router+top-k+experts f32, ticket router",
            &tiny,
            &random_weights(&tiny, None, 71),
            1e-4,
        )
    });
    assert!(all);
}

/// The fused routing (the router run by the out-projection's blocks over the rows of h they finish,
/// summed in fixed point, no router launch) against the router's own launch, for both out-projection
/// kernels (the attention's plain one, the DeltaNet's with the head norm) at the real shape: the same
/// experts, h after the MoE within tolerance, the accumulated logits (and the shared-expert gate's)
/// against the CPU router on the new h, and the accumulators back at zero after the layer.
#[test]
#[ignore = "needs CUDA"]
fn fused_routing_matches_the_router_launch() {
    let (spec, w) = real_two_layers();
    let (be, _seq) = rig(spec, w, 8, KvDtype::Bf16);
    let gpu = be.gpu().clone();
    let s = &be.scratch;
    let d = spec.hidden_size;
    let mut rng = Rng::new(131);
    let mut all = true;
    for layer in 0..spec.num_layers() {
        let mw = decode::moe_weights(&be.model, spec, layer).expect("an MoE layer");
        let io = decode::moe_io(&be.model, spec, s, layer);
        let (e, a) = (mw.experts, mw.top_k);
        let (kind, out_proj, k, y, head_norm) = match &be.model.layers[layer].mixer {
            calla_cuda::ops::weights::DevMixer::DeltaNet(m) => (
                "DeltaNet out-projection (head norm)",
                &m.out_proj,
                spec.linear_value_dim(),
                s.dn_y,
                Some(matvec::HeadNorm {
                    head_dim: spec.linear_value_head_dim,
                    nparts: deltanet::SPLIT as usize,
                    eps: spec.rms_norm_eps,
                }),
            ),
            calla_cuda::ops::weights::DevMixer::Attention(m) => (
                "attention out-projection",
                &m.o_proj,
                spec.num_attention_heads * spec.head_dim,
                s.at_y,
                None,
            ),
        };
        let tail = calla_cuda::ops::moe::fused_route_tail(
            gpu.choices(),
            &mw,
            &io,
            out_proj,
            k,
            s.route_acc,
        )
        .expect("the fused routing applies at the real shape");
        let out_launch = |route: Option<&calla_cuda::ops::moe::RouteTail>| match (head_norm, route)
        {
            (Some(hn), r) => {
                matvec::matvec_head_norm(&gpu, y, k, hn, &(*out_proj, s.h), true, r).unwrap()
            }
            (None, Some(r)) => matvec::matvec_routed(&gpu, y, k, &(*out_proj, s.h), r).unwrap(),
            (None, None) => matvec::matvec(&gpu, y, k, None, &[(*out_proj, s.h)], true)
                .unwrap()
                .remove(0),
        };
        let calla_model::FeedForwardWeights::Moe(cpu_moe) = &w.layers[layer].feed_forward else {
            panic!("layer {layer} is not MoE");
        };
        let router = cpu_moe.router.to_f32();
        let shared_gate = cpu_moe.shared_expert_gate.as_ref().map(|g| g.to_f32());
        let acc_words = calla_cuda::ops::moe::route_acc_words(e);
        let stride = acc_words / calla_cuda::ops::moe::ROUTE_COPIES;
        let (mut h_got, mut h_want, mut l_got, mut l_want) = (vec![], vec![], vec![], vec![]);
        let (mut same_ids, mut total, mut cleared) = (0usize, 0usize, true);
        for _ in 0..8 {
            let h0 = rng.normal_vec(d, 1.0);
            let mut yv = rng.normal_vec(k, 1.0);
            if let Some(hn) = head_norm {
                // the DeltaNet's Σo² parts per head: positive, about head_dim / nparts each
                let parts = k / hn.head_dim * hn.nparts;
                yv.extend((0..parts).map(|_| {
                    (hn.head_dim / hn.nparts) as f32 * (0.5 + rng.normal_vec(1, 0.2)[0].abs())
                }));
            }
            gpu.htod(y, &yv).unwrap();
            // fused: the routed out-projection, the accumulators read back, then the MoE
            gpu.htod(s.h, &h0).unwrap();
            out_launch(Some(&tail)).run(&gpu).unwrap();
            let h_mid = download(&gpu, s.h, d);
            let mut acc = vec![0i64; acc_words];
            gpu.dtoh(s.route_acc, &mut acc).unwrap();
            let sum = |i: usize| {
                (0..calla_cuda::ops::moe::ROUTE_COPIES)
                    .map(|c| acc[c * stride + i])
                    .sum::<i64>()
            };
            let ss = sum(e + 1) as f64 / (1u64 << 20) as f64;
            let inv = 1.0 / (ss / d as f64 + spec.rms_norm_eps as f64).sqrt();
            let xn = norm(
                &h_mid,
                &w.layers[layer].post_attention_layernorm,
                spec.rms_norm_eps,
            );
            for r in 0..e {
                l_got.push((sum(r) as f64 / 4294967296.0 * inv) as f32);
                l_want.push((0..d).map(|c| router[r * d + c] * xn[c]).sum::<f32>());
            }
            if let Some(g) = &shared_gate {
                l_got.push((sum(e) as f64 / 4294967296.0 * inv) as f32);
                l_want.push((0..d).map(|c| g[c] * xn[c]).sum::<f32>());
            }
            for l in
                calla_cuda::ops::moe::moe_after_fused_routing(&gpu, &mw, &io, s.route_acc).unwrap()
            {
                l.run(&gpu).unwrap();
            }
            let mut ids_fused = vec![0i32; a];
            gpu.dtoh(io.topk_ids, &mut ids_fused).unwrap();
            h_got.extend(download(&gpu, s.h, d));
            gpu.dtoh(s.route_acc, &mut acc).unwrap();
            cleared &= acc.iter().all(|&v| v == 0);
            // the router's own launch
            gpu.htod(s.h, &h0).unwrap();
            out_launch(None).run(&gpu).unwrap();
            let choices = gpu.choices();
            gpu.set_choices(KernelChoices {
                router: RouterPlacement::InGateUp,
                ..choices
            });
            let launches = calla_cuda::ops::moe::moe(&gpu, &mw, &io).unwrap();
            gpu.set_choices(choices);
            for l in launches {
                l.run(&gpu).unwrap();
            }
            let mut ids_ref = vec![0i32; a];
            gpu.dtoh(io.topk_ids, &mut ids_ref).unwrap();
            h_want.extend(download(&gpu, s.h, d));
            total += 1;
            same_ids += (ids_fused == ids_ref) as usize;
        }
        let shape = format!("E{e} A{a} D{d} K{k}, {:?} router", mw.router.format);
        all &= check(
            &format!("fused routing: logits vs CPU, {kind}"),
            &shape,
            &l_got,
            &l_want,
            2e-4,
            2e-4,
        );
        all &= check_count(
            &format!("fused routing: experts as the router launch's, {kind}"),
            &shape,
            same_ids,
            total,
            "",
        );
        all &= check(
            &format!("fused routing: h after the MoE, {kind}"),
            &shape,
            &h_got,
            &h_want,
            2e-4,
            2e-4,
        );
        all &= check_count(
            "fused routing: accumulators cleared by down",
            &shape,
            cleared as usize,
            1,
            "",
        );
    }
    assert!(all);
}
